"""Feature capture for the rollout buffer: every request's target features and tokens, committed position by
committed position, so that a finished request's whole sequence can go to the spot trainer's buffer."""
from __future__ import annotations

from typing import List

import torch

from .state import ints_on_device


class FeatureCapture:
    """``features`` ``[B, S, H]`` (the target's dtype) and ``tokens`` int64 ``[B, S]`` of a rollout; column
    ``S - 1`` is a write sink for masked scatters.

    Args:
        prompts: int64 ``[B, L]``; prefill_hidden: ``[B, L, H]`` target features of the prompts.
        columns: ``S`` (more than any request's prompt + generated + widest tree).
    """

    def __init__(self, prompts: torch.Tensor, prefill_hidden: torch.Tensor, columns: int):
        B, L = prompts.shape
        dev = prompts.device
        self.features = torch.zeros(B, columns, prefill_hidden.shape[-1], dtype=prefill_hidden.dtype, device=dev)
        self.tokens = torch.zeros(B, columns, dtype=torch.int64, device=dev)
        self.features[:, :L] = prefill_hidden
        self.tokens[:, :L] = prompts

    def record(self, rows, context_lens, num_accepted, path_hidden, path_tokens) -> None:
        """Committed positions ``context_lens + j`` (``j <= num_accepted``, int64 ``[b]``) of ``rows`` (int64 ``[b]``)
        take the accepted path's features (``path_hidden [b, T, H]``) and tokens (``path_tokens`` int64 ``[b, T]``).
        The other path slots go to the sink column; only the ``b * T`` written positions are touched."""
        width, sink = path_tokens.shape[1], self.tokens.shape[1] - 1
        j = torch.arange(width, device=path_tokens.device)
        positions = torch.where(j <= num_accepted.unsqueeze(1), context_lens.to(torch.int64).unsqueeze(1) + j, sink)
        where = (rows.unsqueeze(1), positions)  # [b, 1] broadcast against [b, T]
        self.features.index_put_(where, path_hidden.to(self.features.dtype))
        self.tokens.index_put_(where, path_tokens)

    def add_to_buffer(self, buffer, requests: List[int], lengths: List[int], step: int) -> None:
        """Hand ``requests``' sequences (their first ``lengths`` positions, host ints: the committed context lengths)
        to ``buffer`` (a RolloutBuffer); reads nothing from the device and does not wait for it."""
        if not requests:
            return
        idx = ints_on_device(requests, self.features.device)
        longest = max(lengths)
        buffer.add(self.features[idx, :longest], self.tokens[idx, :longest], step=step, lengths=lengths)
