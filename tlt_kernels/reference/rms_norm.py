"""Reference RMSNorm with an optional fused residual add (pure torch, any device).

``h = x + residual`` (rounded to the activation dtype, as a torch add), then
``out = weight * (h * rsqrt(mean(h^2) + eps))`` with the reduction in fp32, the normalised value cast to the
activation dtype before the weight: transformers' Llama RMSNorm, so a model on this op keeps its logits.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(out, h)`` for ``x, residual: [..., H]`` and ``weight: [H]`` (see the module docstring)."""
    h = x if residual is None else x + residual
    hf = h.float()
    normed = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)
    return weight * normed, h
