"""Reference top-k log-probabilities of a row of logits (pure torch, CPU and GPU).

The ``k`` largest logits of each row, largest first; equal logits rank by column, the lower first (a stable sort);
``-0.0`` equals ``0.0`` and every NaN ranks above ``+inf`` (``torch.sort``'s order). Each is reported with its
log-probability under the row's softmax at temperature 1, computed in fp32 (``torch.log_softmax``).
"""
from __future__ import annotations

from typing import Tuple

import torch


def top_logprobs(logits: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``logits [..., V]`` (fp32 / bf16 / fp16) -> ``(logprobs float32 [..., k], tokens int64 [..., k])``."""
    x = logits.float()
    tokens = torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k].contiguous()
    return torch.log_softmax(x, dim=-1).gather(-1, tokens), tokens
