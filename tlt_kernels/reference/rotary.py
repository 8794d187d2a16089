"""Reference rotate-half rotary embedding of q and k (pure torch, CPU and GPU), as in transformers' Llama.

``out = x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])``, in the
activation dtype: each product rounded to it, then the sum.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``cat(-x[..., D/2:], x[..., :D/2])`` over the last dim."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q [B, T, Hq, D]`` and ``k [B, T, Hkv, D]`` by ``cos, sin [B, T, D]`` (all one dtype).

    Returns new contiguous tensors of q's and k's shapes.
    """
    c, s = cos.unsqueeze(2), sin.unsqueeze(2)
    q_out = (q * c + rotate_half(q) * s).contiguous()
    k_out = (k * c + rotate_half(k) * s).contiguous()
    return q_out, k_out


def rotary_to_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                    q_out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`apply_rotary`, then the rotated ``k`` and ``v`` (``[B, T, Hkv, D]``) stored at rows ``slots``
    (int64 ``[B * T]``, row-major over ``(b, t)``) of ``k_cache`` / ``v_cache`` (``[N, Hkv, D]``, written in place).
    Returns the rotated q: new contiguous, or copied into ``q_out`` (``[B, T, Hq, D]``, any strides)."""
    rotated_q, k_out = apply_rotary(q, k, cos, sin)
    k_cache.index_copy_(0, slots, k_out.reshape(-1, *k_cache.shape[1:]))
    v_cache.index_copy_(0, slots, v.reshape(-1, *v_cache.shape[1:]))
    return rotated_q if q_out is None else q_out.copy_(rotated_q)
