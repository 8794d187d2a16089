"""Triton SwiGLU activation: ``silu(gate) * up`` in one launch, silu computed in fp32 and rounded to the dtype
before the product (as ``F.silu(gate) * up`` rounds)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(G_ptr, U_ptr, Out_ptr, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    g = tl.load(G_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(Out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(Out_ptr + offs, (silu * u).to(Out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``gate, up``: contiguous, same shape and dtype."""
    out = torch.empty_like(gate)
    n = gate.numel()
    if n:
        block = 1024
        _silu_and_mul_kernel[(triton.cdiv(n, block),)](gate, up, out, n, BLOCK=block)
    return out
