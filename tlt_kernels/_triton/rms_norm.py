"""Triton RMSNorm with an optional fused residual add: one program per row, the whole row in one block.

Grid ``(N,)`` over the ``N`` rows of ``x`` viewed as ``[N, H]`` (row stride passed, so a slice of a wider buffer
is read in place), ``BLOCK = next_power_of_2(H)`` with a mask for the tail. bf16 / fp16 values are loaded as
stored and upcast to fp32 for all arithmetic; results are rounded to the activation dtype exactly where the
reference rounds (:mod:`tlt_kernels.reference.rms_norm`). The residual sum and the weight product are single fp32
operations on two values of the activation dtype, which round to the same bits as torch's own add / multiply in
that dtype; the normalized value can differ by an ulp of the dtype from torch's where the fp32 mean of squares
(another summation order) or ``rsqrt`` differs in its last bit.

Eager calls launch directly (:func:`tlt_kernels._backend.direct_dispatch_ok`); otherwise the launch runs inside
the ``torch.library`` custom ops ``tlt::rms_norm`` / ``tlt::add_rms_norm`` (fake implementations for
``torch.compile``; no host sync, so CUDA graphs capture them).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from .._backend import direct_dispatch_ok
from .rounding import hand_round, round_to


@triton.jit
def _rms_norm_kernel(
    X_ptr, R_ptr, W_ptr, Out_ptr, H_ptr, stride_x, stride_r, H, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, HAND_ROUND: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    dt = Out_ptr.dtype.element_ty
    x = tl.load(X_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(R_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        # The residual stream is kept in the activation dtype: round the sum once, like torch's add.
        h = round_to(x + r, dt, HAND_ROUND)
        tl.store(H_ptr + row * H + cols, h, mask=mask)
        hf = h.to(tl.float32)
    else:
        hf = x
    var = tl.sum(hf * hf, axis=0) / H
    # Rounded to the dtype before the weight product, as transformers does.
    normed = round_to(hf * tl.rsqrt(var + eps), dt, HAND_ROUND)
    w = tl.load(W_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = round_to(w * normed.to(tl.float32), dt, HAND_ROUND)
    tl.store(Out_ptr + row * H + cols, out, mask=mask)


def _num_warps(block: int) -> int:
    return 1 if block <= 256 else 4 if block <= 2048 else 8 if block <= 8192 else 16


def rms_norm_out(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: Optional[torch.Tensor],
                 out: torch.Tensor, h: Optional[torch.Tensor]) -> None:
    """Launch into ``out`` (and ``h`` when ``residual`` is given), both new contiguous ``[..., H]`` tensors.

    ``x`` / ``residual``: ``[..., H]`` with a unit last stride (validated by :func:`tlt_kernels.ops.rms_norm.rms_norm`);
    their leading dims are flattened to rows, as a view where the strides allow it, else as a copy."""
    H = x.shape[-1]
    if x.numel() == 0:
        return
    x2 = x.reshape(-1, H)
    r2 = residual.reshape(-1, H) if residual is not None else x2
    block = triton.next_power_of_2(H)
    _rms_norm_kernel[(x2.shape[0],)](
        x2, r2, weight, out, h if h is not None else out, x2.stride(0), r2.stride(0), H, float(eps),
        HAS_RESIDUAL=residual is not None, BLOCK=block, HAND_ROUND=hand_round(x.dtype),
        num_warps=_num_warps(block),
    )


@torch.library.custom_op("tlt::rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rms_norm_out(x, weight, eps, None, out, None)
    return out


@_rms_norm_op.register_fake
def _(x, weight, eps):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@torch.library.custom_op("tlt::add_rms_norm", mutates_args=())
def _add_rms_norm_op(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> Tuple[torch.Tensor, torch.Tensor]:
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    h = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rms_norm_out(x, weight, eps, residual, out, h)
    return out, h


@_add_rms_norm_op.register_fake
def _(x, residual, weight, eps):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device), torch.empty(x.shape, dtype=x.dtype, device=x.device)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Backend of :func:`tlt_kernels.ops.rms_norm.rms_norm`: ``(out, h)``, ``h`` is ``x`` when ``residual`` is None."""
    if direct_dispatch_ok(x, weight, residual):  # plain eager: launch without the op's dispatch
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        h = None if residual is None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
        rms_norm_out(x, weight, eps, residual, out, h)
        return out, (x if h is None else h)
    if residual is None:
        return torch.ops.tlt.rms_norm(x, weight, eps), x
    return torch.ops.tlt.add_rms_norm(x, residual, weight, eps)
