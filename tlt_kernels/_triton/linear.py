"""Triton linear layer for a few rows, ``y = x @ W^T (+ bias)``: row tiles of 16 or more on the tensor cores, one
program per (output column tile, row tile), each walking K in ``BLOCK_K`` chunks.

The rows of a decoding or verify step's projections are B x T, a handful at the long tail; there each projection of
a small model costs about one launch's latency, whatever the vendor GEMM's tiling (docs/MODELS.md). A row tile of 16
costs the tensor cores no more than one row does, and narrow column tiles put more programs on the SMs.

Products are summed in fp32 (tf32 never: fp32 inputs use ``ieee`` products) and rounded once to x's dtype, the bias
added in fp32 before the rounding. The CPU interpreter computes bf16 arithmetic as zeros, so there the tiles are
upcast to fp32 first. Eager calls launch directly; otherwise the launch runs inside the custom op ``tlt::linear``
(fake implementation for ``torch.compile``; no host sync).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from .._backend import direct_dispatch_ok, triton_interpret_enabled
from .rounding import hand_round, round_to


@triton.jit
def _linear_kernel(X, W, Bias, Out, M, N, stride_xm, stride_wn, K: tl.constexpr, HAS_BIAS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EXACT: tl.constexpr,
                   HAND_ROUND: tl.constexpr):
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    x_rows = X + rows.to(tl.int64)[:, None] * stride_xm
    w_rows = W + cols.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):  # K is a constexpr: fixed bounds (the interpreter takes no tensor bounds)
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & (ks < K)[None, :], other=0.0)
        w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & (ks < K)[None, :], other=0.0)
        if EXACT:  # fp32 inputs, or the interpreter (no bf16 arithmetic): fp32 products without tf32
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    if HAS_BIAS:
        acc += tl.load(Bias + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = round_to(acc, Out.dtype.element_ty, HAND_ROUND)
    tl.store(Out + rows.to(tl.int64)[:, None] * N + cols[None, :], out, mask=row_ok[:, None] & col_ok[None, :])


def launch_config(rows: int, in_features: int, out_features: int) -> Tuple[int, int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)``: the best of tools/skinny_linear_probe's grid on an
    H200 at SmolLM2's projections (docs/MODELS.md): 16 columns a program (32 for wide outputs, which have programs to
    spare), chunks of 128 over short rows and 256 over long ones."""
    block_m = min(64, max(16, triton.next_power_of_2(rows)))
    wide = out_features >= 2048
    return block_m, 32 if wide else 16, 128 if in_features <= 640 else 256, 2 if wide else 4, 3


def linear_out(x2: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], out: torch.Tensor) -> None:
    """Launch into ``out`` (contiguous ``[M, N]``) for ``x2 [M, K]`` and ``weight [N, K]``, both with unit last
    strides, and ``bias`` None or contiguous ``[N]``."""
    M, K = x2.shape
    N = weight.shape[0]
    if M == 0 or N == 0:
        return
    block_m, block_n, block_k, warps, stages = launch_config(M, K, N)
    block_k = min(block_k, max(16, triton.next_power_of_2(K)))
    exact = x2.dtype == torch.float32 or triton_interpret_enabled()
    grid = (triton.cdiv(N, block_n), triton.cdiv(M, block_m))
    _linear_kernel[grid](x2, weight, bias if bias is not None else weight, out, M, N, x2.stride(0), weight.stride(0),
                         K=K, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                         EXACT=exact, HAND_ROUND=hand_round(x2.dtype), num_warps=warps, num_stages=stages)


def _rows_of(x: torch.Tensor) -> torch.Tensor:
    """``x [..., K]`` as ``[M, K]`` with a unit last stride (a view where the leading dims allow, else a copy)."""
    return x.reshape(-1, x.shape[-1])


@torch.library.custom_op("tlt::linear", mutates_args=())
def _linear_op(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    out = torch.empty(*x.shape[:-1], weight.shape[0], dtype=x.dtype, device=x.device)
    linear_out(_rows_of(x), weight, bias, out.view(-1, weight.shape[0]))
    return out


@_linear_op.register_fake
def _(x, weight, bias):
    return torch.empty(*x.shape[:-1], weight.shape[0], dtype=x.dtype, device=x.device)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Backend of :func:`tlt_kernels.ops.linear.linear`: a new contiguous ``[..., N]`` tensor of x's dtype."""
    if direct_dispatch_ok(x, weight, bias):  # plain eager: launch without the op's dispatch
        out = torch.empty(*x.shape[:-1], weight.shape[0], dtype=x.dtype, device=x.device)
        linear_out(_rows_of(x), weight, bias, out.view(-1, weight.shape[0]))
        return out
    return torch.ops.tlt.linear(x, weight, bias)
