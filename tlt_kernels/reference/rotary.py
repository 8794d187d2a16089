"""Reference rotary position embedding, "rotate half" pairing (pure torch), as transformers' Llama applies it:
``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])``, each product and
the sum rounded to the activation dtype."""
from __future__ import annotations

from typing import Tuple

import torch


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x: [B, T, H, D]`` rotated by ``cos, sin: [B, T, D]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(2) + rotated * sin.unsqueeze(2)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(rotate(q), rotate(k))``."""
    return rotate(q, cos, sin), rotate(k, cos, sin)
