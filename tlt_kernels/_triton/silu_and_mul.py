"""Triton ``silu(gate) * up``: grid ``(N, cdiv(I, BLOCK))`` over the rows and column tiles of ``[N, I]``.

Row strides of ``gate`` and ``up`` are passed separately, so the two halves of one packed gate/up projection are
read in place. bf16 / fp16 values are upcast to fp32 for the arithmetic; the SiLU is rounded to the activation
dtype, then the product (a single fp32 multiply of two values of that dtype, which rounds like torch's multiply).
The SiLU can differ by an ulp of the dtype from torch's where ``exp`` differs in its last fp32 bit.

Eager calls launch directly; otherwise the launch runs inside the custom op ``tlt::silu_and_mul`` (fake
implementation for ``torch.compile``; no host sync).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._backend import direct_dispatch_ok
from .rounding import hand_round, round_to

MAX_BLOCK = 2048  # columns per program: wide rows are split over programs (elementwise, nothing to reduce)


@triton.jit
def _silu_and_mul_kernel(G_ptr, U_ptr, Out_ptr, stride_g, stride_u, I, BLOCK: tl.constexpr,
                         HAND_ROUND: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    dt = Out_ptr.dtype.element_ty
    g = tl.load(G_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    # F.silu rounds its fp32 result to the dtype before the product, which rounds again.
    act = round_to(g / (1.0 + tl.exp(-g)), dt, HAND_ROUND)
    tl.store(Out_ptr + row * I + cols, round_to(act.to(tl.float32) * u, dt, HAND_ROUND), mask=mask)


def silu_and_mul_out(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor) -> None:
    """Launch into ``out`` (new contiguous ``[..., I]``); ``gate`` / ``up``: ``[..., I]`` with a unit last stride."""
    I = gate.shape[-1]
    if gate.numel() == 0:
        return
    g2, u2 = gate.reshape(-1, I), up.reshape(-1, I)
    block = min(triton.next_power_of_2(I), MAX_BLOCK)
    grid = (g2.shape[0], triton.cdiv(I, block))
    _silu_and_mul_kernel[grid](g2, u2, out, g2.stride(0), u2.stride(0), I, BLOCK=block,
                               HAND_ROUND=hand_round(gate.dtype),
                               num_warps=1 if block <= 256 else 4)


@torch.library.custom_op("tlt::silu_and_mul", mutates_args=())
def _silu_and_mul_op(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    silu_and_mul_out(gate, up, out)
    return out


@_silu_and_mul_op.register_fake
def _(gate, up):
    return torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Backend of :func:`tlt_kernels.ops.silu_and_mul.silu_and_mul`: a new contiguous tensor of gate's shape."""
    if direct_dispatch_ok(gate, up):  # plain eager: launch without the op's dispatch
        out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
        silu_and_mul_out(gate, up, out)
        return out
    return torch.ops.tlt.silu_and_mul(gate, up)
