"""Reference top-k log-probabilities of a row of logits (pure torch, CPU and GPU).

The ``k`` largest logits of each row, largest first; equal logits rank by column, the lower first (a stable sort);
``-0.0`` equals ``0.0`` and every NaN ranks above ``+inf``. The ranking is spelled out rather than left to
``torch.sort``, whose GPU sort orders NaN and signed zeros otherwise than its CPU sort. Each token is reported with its
log-probability under the row's softmax at temperature 1, computed in fp32 (``torch.log_softmax``).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch


def rank_descending(x: torch.Tensor) -> torch.Tensor:
    """int64 indices that order the last dim of ``x`` (any float dtype) largest first: equal values by index, the
    lower first; ``-0.0`` equals ``0.0``; every NaN above ``+inf`` (the rank keys' order,
    :mod:`tlt_kernels._triton.rank_keys`)."""
    x = x.float()
    nan = x.isnan()
    by_value = torch.where(nan, torch.inf, torch.where(x == 0, 0.0, x))  # NaN ties +inf here, -0.0 is 0.0
    order = torch.sort(by_value, dim=-1, descending=True, stable=True).indices
    nan_first = torch.sort(nan.gather(-1, order).to(torch.uint8), dim=-1, descending=True, stable=True).indices
    return order.gather(-1, nan_first)


def top_logprobs(logits: torch.Tensor, k: int,
                 token_ids: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``logits [..., V]`` (fp32 / bf16 / fp16) -> ``(logprobs float32 [..., k], tokens int64 [..., k])``; the
    columns ranked, each reported as ``token_ids[column]`` when given (int64 ``[V]``)."""
    x = logits.float()
    columns = rank_descending(x)[..., :k].contiguous()
    logprobs = torch.log_softmax(x, dim=-1).gather(-1, columns)
    return logprobs, (columns if token_ids is None else token_ids[columns])
