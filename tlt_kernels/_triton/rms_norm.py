"""Triton RMSNorm with the residual add fused: one program per row of ``H`` features, one launch.

Rounding follows the reference step by step: the add of two half values is exact in fp32, so rounding it to the
dtype equals torch's half add; the weight product of two half values is exact in fp32 too, so rounding it once
gives torch's half product. Only the fp32 sum of squares may differ from torch's in its last bit (another
reduction order), which can move the normalised value by one unit in the last place of the dtype.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(X_ptr, Res_ptr, W_ptr, Out_ptr, H_ptr, H, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(X_ptr + row * H + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(Res_ptr + row * H + cols, mask=mask, other=0.0).to(tl.float32)
        h = (x + r).to(H_ptr.dtype.element_ty)
        tl.store(H_ptr + row * H + cols, h, mask=mask)
        x = h.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)
    normed = (x * rstd).to(Out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(W_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out_ptr + row * H + cols, (w * normed).to(Out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(out, h)``; ``x``, ``residual`` contiguous ``[..., H]``, ``weight`` contiguous ``[H]``."""
    H = x.shape[-1]
    out = torch.empty_like(x)
    h = x if residual is None else torch.empty_like(x)
    rows = x.numel() // H if H else 0
    if rows:
        _rms_norm_kernel[(rows,)](x, residual if residual is not None else x, weight, out, h, H, float(eps),
                                  HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(H))
    return out, h
