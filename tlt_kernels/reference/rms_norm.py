"""Reference RMSNorm with an optional fused residual add (pure torch, CPU and GPU).

The rounding order is transformers' Llama RMSNorm (and :class:`tlt_kernels.models.llama.RMSNorm`): the residual
add in the activation dtype, the mean of squares and the scaling in fp32, the normalized value rounded to the
activation dtype, then the weight product in that dtype.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(weight * normalize(h), h)`` with ``h = x`` or ``x + residual``.

    Args:
        x: ``[..., H]`` bf16 / fp16 / fp32.
        weight: ``[H]``, x's dtype.
        eps: added to the fp32 mean of squares.
        residual: None or a tensor of x's shape and dtype.

    Returns:
        ``out`` (a new ``[..., H]`` tensor of x's dtype) and ``h`` (``x`` itself when ``residual`` is None).
    """
    h = x if residual is None else x + residual
    hf = h.float()
    normed = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight * normed, h
