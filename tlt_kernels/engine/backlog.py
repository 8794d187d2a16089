"""Deferred drafter commits: what plain steps emitted that the drafter has not been shown yet.

A plain step (the "off" arm) drafts nothing, so keeping the drafter current after it (appending to the n-gram
histories, extending the EAGLE layer's KV cache with the step's feature) is work that no step reads until the next
drafting step. For a drafter that allows it (``lazy_commit``), the engine records here where the plain steps began
in each request's output, and stashes the target's feature of each step's root for a drafter that reads features;
before the next drafting step, or when the backlog is full, it hands the whole backlog to the drafter's ``commit``
as one accepted path per request, its tokens read from the rollout's output. The drafter ends in the state it
would have had (the n-gram histories exactly; the EAGLE layer's KV up to the rounding of one forward over the
backlog instead of one per token).

Rows only leave a rollout, so every row of a later plain step was in the first one: the backlog's rows are the
first step's, and each row's tokens are those it emitted since (none more once it has finished or failed).

A taken path is padded to one of a few widths (:attr:`DrafterBacklog.widths`: powers of two, and the capacity): a
drafter's commit of a new width is a graph to capture or a kernel to compile, so the widths are few and known when
the engine captures its graphs.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..drafter.base import AcceptedPath


class DrafterBacklog:
    """Up to ``capacity`` plain steps: where each request's tokens began (int64 ``[max_batch_size]``) and, with
    ``features=True``, the steps' features (``[max_batch_size, capacity, hidden_size]`` in ``dtype``), on
    ``device``. Device work only: stashing and taking never synchronize with the host; a stash writes nothing
    without features, except at the first step."""

    def __init__(self, max_batch_size: int, capacity: int, hidden_size: int, dtype: torch.dtype, device,
                 features: bool):
        if capacity < 1:
            raise ValueError(f"DrafterBacklog: capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.hidden = torch.zeros(max_batch_size, capacity, hidden_size, dtype=dtype, device=device) if features \
            else None
        self.start = torch.zeros(max_batch_size, dtype=torch.int64, device=device)  # tokens before the first step
        self.size = 0  # plain steps stashed since the last take (host)
        self.rows: Optional[torch.Tensor] = None  # int64 [r]: the rows of the first stashed step
        # The widths a taken path has: powers of two below the capacity, and the capacity.
        self.widths = sorted({1 << i for i in range(capacity.bit_length()) if 1 << i < capacity} | {capacity})

    @property
    def full(self) -> bool:
        return self.size == self.capacity

    def stash(self, rows: torch.Tensor, hidden: torch.Tensor, generated: torch.Tensor, counts: torch.Tensor) -> None:
        """One plain step of ``rows`` (int64 ``[b]``): the target's ``hidden`` ``[b, H]`` of each row's root (the
        token before the one the step emitted), the rollout's ``generated`` (int64 ``[B]``, this step's tokens
        included) and the step's emitted ``counts`` (int64 ``[b]``)."""
        if self.full:
            raise RuntimeError("DrafterBacklog.stash: the backlog is full; take() it first")
        if self.size == 0:
            self.rows = rows
            self.start[rows] = generated[rows] - counts
        if self.hidden is not None:
            self.hidden[rows, self.size] = hidden.to(self.hidden.dtype)
        self.size += 1

    def take(self, output_tokens: torch.Tensor, generated: torch.Tensor) -> Tuple[torch.Tensor, AcceptedPath]:
        """The backlog as ``(rows int64 [r], AcceptedPath)`` from the rollout's ``output_tokens`` (int64 ``[B, W]``)
        and ``generated`` (int64 ``[B]``): each row's tokens since the first step, ``num_new`` of them, which may be 0
        (a row that finished or failed at the first step; a lazy drafter's commit takes 0 as "nothing to learn").
        The path's width is the smallest of :attr:`widths` that holds ``size`` steps; columns past a row's
        ``num_new`` are padding. Empties the backlog."""
        if self.size == 0:
            raise RuntimeError("DrafterBacklog.take: nothing is stashed")
        rows, width = self.rows, next(w for w in self.widths if w >= self.size)
        start = self.start[rows]
        columns = (start.unsqueeze(1) + torch.arange(width, device=start.device)).clamp(max=output_tokens.shape[1] - 1)
        tokens = output_tokens[rows].gather(1, columns)
        hidden = self.hidden[rows, :width] if self.hidden is not None else None
        path = AcceptedPath(tokens, generated[rows] - start - 1, hidden)
        self.clear()
        return rows, path

    def clear(self) -> None:
        """Forget what is stashed (a rollout ended or failed)."""
        self.size, self.rows = 0, None
