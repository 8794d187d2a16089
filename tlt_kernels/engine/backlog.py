"""Deferred drafter commits: what plain steps emitted that the drafter has not been shown yet.

A plain step (the "off" arm) drafts nothing, so keeping the drafter current after it (appending to the n-gram
histories, extending the EAGLE layer's KV cache with the step's feature) is work that no step reads until the next
drafting step. For a drafter that allows it (``lazy_commit``), the engine stashes each plain step's emitted token,
and the target's feature of the token before it for a drafter that reads features, here; before the next drafting
step, or when the backlog is full, it hands the whole backlog to the drafter's ``commit`` as one accepted path per
request. The drafter ends in the state it would have had (the n-gram histories exactly; the EAGLE layer's KV up to
the rounding of one forward over the backlog instead of one per token).

Rows only leave a rollout, so every row of a later plain step was in the first one: the backlog's rows are the
first step's, each with its own count (a row stops counting once it has finished or failed).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..drafter.base import AcceptedPath


class DrafterBacklog:
    """Up to ``capacity`` plain steps' tokens (int64 ``[max_batch_size, capacity]``), features (``[max_batch_size,
    capacity, hidden_size]`` in ``dtype``, only with ``features=True``) and per-request counts (int32), on
    ``device``. Device writes only: stashing and taking never synchronize with the host."""

    def __init__(self, max_batch_size: int, capacity: int, hidden_size: int, dtype: torch.dtype, device,
                 features: bool):
        if capacity < 1:
            raise ValueError(f"DrafterBacklog: capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.tokens = torch.zeros(max_batch_size, capacity, dtype=torch.int64, device=device)
        self.hidden = torch.zeros(max_batch_size, capacity, hidden_size, dtype=dtype, device=device) if features \
            else None
        self.counts = torch.zeros(max_batch_size, dtype=torch.int32, device=device)
        self.size = 0  # plain steps stashed since the last take (host)
        self.rows: Optional[torch.Tensor] = None  # int64 [r]: the rows of the first stashed step

    @property
    def full(self) -> bool:
        return self.size == self.capacity

    def stash(self, rows: torch.Tensor, emitted: torch.Tensor, hidden: torch.Tensor, keep: torch.Tensor) -> None:
        """One plain step of ``rows`` (int64 ``[b]``): its ``emitted`` tokens (int64 ``[b]``, -1 on a failed row),
        the target's ``hidden`` ``[b, H]`` of each row's previous token, and ``keep`` (bool ``[b]``: rows that had
        finished before the step or failed in it, which learn nothing from it)."""
        if self.full:
            raise RuntimeError("DrafterBacklog.stash: the backlog is full; take() it first")
        if self.size == 0:
            self.rows = rows
            self.counts[rows] = 0
        self.tokens[rows, self.size] = emitted.clamp(min=0)
        if self.hidden is not None:
            self.hidden[rows, self.size] = hidden.to(self.hidden.dtype)
        self.counts[rows] += (~keep).to(torch.int32)
        self.size += 1

    def take(self) -> Tuple[torch.Tensor, AcceptedPath]:
        """The backlog as ``(rows int64 [r], AcceptedPath)`` of width ``size``: each row's first ``num_new`` tokens,
        where ``num_new`` may be 0 (a row that finished or failed at the first stashed step; a lazy drafter's commit
        takes 0 as "nothing to learn"). Empties the backlog."""
        if self.size == 0:
            raise RuntimeError("DrafterBacklog.take: nothing is stashed")
        rows, width = self.rows, self.size
        hidden = self.hidden[rows, :width] if self.hidden is not None else None
        path = AcceptedPath(self.tokens[rows, :width], self.counts[rows] - 1, hidden)
        self.size, self.rows = 0, None
        return rows, path

    def clear(self) -> None:
        """Forget what is stashed (a rollout ended or failed)."""
        self.size, self.rows = 0, None
