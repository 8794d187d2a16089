"""Model-free n-gram (prompt lookup) drafter over per-request histories kept on the device.

The histories live in one ``int64 [B, max_len + 1]`` device buffer; column ``max_len`` is a write
sink, so appending a ragged batch of new tokens is a single masked scatter with no host copy and
no data-dependent shape (CUDA-graph friendly). Proposals call :func:`tlt_kernels.ngram_propose`
(chain) or ``ngram_propose_tree`` (several earlier occurrences merged into one token tree) over the
whole batch in one launch.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .._backend import BACKENDS
from .._validation import capturing, check_positive_ints, check_tensor
from ..tree import chain_parents


def _check_counts(name: str, counts: torch.Tensor, width: int, what: str) -> None:
    """Every ``counts[b]`` in ``[0, width]`` (one host sync), else a ValueError naming the first bad row."""
    bad = (counts < 0) | (counts > width)
    if bool(bad.any()):
        b = int(bad.nonzero()[0, 0])
        raise ValueError(f"{name}[{b}] = {int(counts[b])} is outside [0, {width}] ({what})")


BACKEND_NAMES = ("auto",) + tuple(BACKENDS)


class ChainTree(NamedTuple):
    """A chain draft as a token tree: ``parents int32 [B, k+1]``, ``draft_tokens int64 [B, k+1]``
    (node 0 = root = last history token), ``num_nodes int32 [B]`` (= 1 + number of drafts)."""

    parents: torch.Tensor
    draft_tokens: torch.Tensor
    num_nodes: torch.Tensor


def drafts_to_tree(drafts: torch.Tensor, num_drafts: torch.Tensor, root_tokens: torch.Tensor) -> ChainTree:
    """Turn ``NGramDrafts`` (``drafts int64 [B, k]``, ``num_drafts int32 [B]``) into a chain tree."""
    B, k = drafts.shape
    tokens = torch.cat([root_tokens.to(torch.int64).unsqueeze(1), drafts.clamp(min=0)], 1)
    return ChainTree(chain_parents(B, k + 1, drafts.device), tokens, (num_drafts + 1).to(torch.int32))


class NGramDrafter:
    """Per-request histories on the device plus n-gram proposals.

    Args:
        batch_size: number of request slots ``B``.
        max_len: history capacity per slot (tokens past it are dropped: the newest tokens of an
            over-long request are not looked up, which only costs draft quality).
        device: where the histories live.
        min_n, max_n: n-gram sizes tried (longest match wins).
        backend: backend of the proposal op (``"auto"``, ``"torch"``, ``"triton"``).
    """

    def __init__(self, batch_size: int, max_len: int, device="cpu", min_n: int = 1, max_n: int = 4, backend: str = "auto"):
        check_positive_ints("NGramDrafter", batch_size=batch_size, max_len=max_len, min_n=min_n, max_n=max_n)
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        if backend not in BACKEND_NAMES:
            raise ValueError(f"NGramDrafter: backend={backend!r} is not one of {BACKEND_NAMES}")
        self.max_len = max_len
        self.min_n, self.max_n, self.backend = min_n, max_n, backend
        self.buffer = torch.zeros(batch_size, max_len + 1, dtype=torch.int64, device=device)
        self.device = self.buffer.device  # normalized: "cuda" becomes "cuda:<current>", the buffer's own device
        self.lengths = torch.zeros(batch_size, dtype=torch.int32, device=self.device)
        # int64 [B, S] or None: rows each history may also draw from (its group; ngram_propose's siblings=)
        self.siblings: Optional[torch.Tensor] = None

    @property
    def batch_size(self) -> int:
        return self.buffer.shape[0]

    @property
    def histories(self) -> torch.Tensor:
        """``int64 [B, max_len]`` view of the histories (first ``lengths[b]`` valid)."""
        return self.buffer[:, : self.max_len]

    def reset(self, slots, prompts: torch.Tensor, prompt_lens: torch.Tensor, validate: bool = True) -> None:
        """Start new requests in ``slots`` (``int [R]`` or list, distinct, in ``[0, batch_size)``) with
        ``prompts int64 [R, P]`` of ``prompt_lens`` tokens each (in ``[0, P]``; past ``max_len`` they are dropped).

        ``validate`` checks the slots and lengths on the host (two syncs; skipped during CUDA-graph capture): a slot
        of -1 would index the last request from the end, and a length past ``P`` would count tokens that were never
        written. ``validate=False``: device work only (the engine's start, whose slots and lengths it checked).
        """
        slots = torch.as_tensor(slots, dtype=torch.int64, device=self.device)
        if slots.dim() != 1:
            raise ValueError(f"slots must be a list or a 1-D tensor of slot indices, got shape {tuple(slots.shape)}")
        R = slots.shape[0]
        check_tensor("prompts", prompts, dtype=(torch.int32, torch.int64), ndim=2, device=self.device)
        check_tensor("prompt_lens", prompt_lens, dtype=(torch.int32, torch.int64), shape=(R,), device=self.device)
        if prompts.shape[0] != R:
            raise ValueError(f"prompts has {prompts.shape[0]} rows, expected one per slot ({R})")
        if validate and not capturing(self.device):
            self._check_reset(slots, prompt_lens, prompts.shape[1])
        # index_fill_, not ``t[slots] = 0``: a Python scalar through advanced indexing is copied to the device
        # synchronously, which stalled the engine's start until the prefill ended.
        self.lengths.index_fill_(0, slots, 0)
        self.buffer.index_fill_(0, slots, 0)
        self._scatter(slots, prompts.to(torch.int64), prompt_lens)

    def append(self, new_tokens: torch.Tensor, num_new: torch.Tensor, validate: bool = True) -> None:
        """Append ``new_tokens int64 [B, n]`` (first ``num_new[b]`` of each row, ``0 <= num_new[b] <= n``) to every
        history.

        One scatter. ``validate`` checks ``num_new`` on the host (one sync; skipped during CUDA-graph capture): a
        count past ``n`` would add tokens that were never written, a negative one would shorten the history.
        ``validate=False``: pure device work, no host synchronization (the engine's per-step call; it builds
        ``num_new`` in range).
        """
        check_tensor("new_tokens", new_tokens, dtype=(torch.int32, torch.int64), ndim=2, device=self.device)
        check_tensor("num_new", num_new, dtype=(torch.int32, torch.int64), shape=(self.batch_size,), device=self.device)
        if new_tokens.shape[0] != self.batch_size:
            raise ValueError(f"new_tokens has {new_tokens.shape[0]} rows, expected batch_size={self.batch_size}")
        if validate and not capturing(self.device):
            _check_counts("append: num_new", num_new, new_tokens.shape[1], "the width of new_tokens")
        self._scatter(None, new_tokens.to(torch.int64), num_new)

    def append_rows(self, rows: torch.Tensor, new_tokens: torch.Tensor, num_new: torch.Tensor) -> None:
        """Append ``new_tokens int64 [R, n]`` (first ``num_new[r]`` of each, in ``[0, n]``) to the histories of
        ``rows`` (int64 ``[R]``), in place: what :meth:`append` does for the whole batch, for some rows only.

        ``rows`` must be distinct, except for a repeated row nobody reads (the fused step's padding rows all point
        at one sink row: which of their writes lands there does not matter). Pure device work with fixed shapes and
        no host sync (a captured graph's commit); no value checks, so the caller builds ``num_new`` in range.
        """
        n = new_tokens.shape[1]
        lens = self.lengths[rows].to(torch.int64)
        columns = torch.arange(n, device=self.device)
        pos = lens.unsqueeze(1) + columns
        keep = (columns < num_new.to(torch.int64).unsqueeze(1)) & (pos < self.max_len)
        pos = torch.where(keep, pos, self.max_len)  # the sink column takes the writes past num_new or max_len
        self.buffer.index_put_((rows.unsqueeze(1).expand(-1, n), pos), new_tokens.to(torch.int64))
        new_lens = (lens + num_new.to(torch.int64)).clamp(max=self.max_len).to(torch.int32)
        self.lengths.index_put_((rows,), new_lens)

    def _check_reset(self, slots: torch.Tensor, prompt_lens: torch.Tensor, P: int) -> None:
        s = slots.tolist()
        bad = [v for v in s if not 0 <= v < self.batch_size]
        if bad:
            raise ValueError(f"reset: slot {bad[0]} is outside [0, batch_size={self.batch_size})")
        if len(set(s)) != len(s):
            raise ValueError(f"reset: slots must be distinct, got {s[:16]}")
        _check_counts("reset: prompt_lens", prompt_lens, P, "the width of prompts")

    def _scatter(self, slots: Optional[torch.Tensor], toks: torch.Tensor, num: torch.Tensor) -> None:
        n = toks.shape[1]
        lens = self.lengths if slots is None else self.lengths[slots]
        pos = lens.to(torch.int64).unsqueeze(1) + torch.arange(n, device=self.device)
        keep = (torch.arange(n, device=self.device) < num.to(torch.int64).unsqueeze(1)) & (pos < self.max_len)
        pos = torch.where(keep, pos, torch.full_like(pos, self.max_len))  # the sink column
        new_lens = (lens.to(torch.int64) + num.to(torch.int64)).clamp(max=self.max_len).to(torch.int32)
        if slots is None:
            self.buffer.scatter_(1, pos, toks)
            self.lengths.copy_(new_lens)
        else:
            rows = self.buffer[slots]
            rows.scatter_(1, pos, toks)
            self.buffer[slots] = rows
            self.lengths[slots] = new_lens

    def propose(self, k: int, validate: bool = False):
        """Chain drafts: :class:`tlt_kernels.NGramDrafts` (``drafts int64 [B, k]``, ``num_drafts int32 [B]``)."""
        from ..ops.ngram import ngram_propose

        return ngram_propose(self.buffer, self.lengths, k, self.min_n, self.max_n, validate=validate, backend=self.backend,
                             siblings=self.siblings)

    def root_tokens(self) -> torch.Tensor:
        """``int64 [B]`` last token of each history (0 when empty)."""
        last = (self.lengths.to(torch.int64) - 1).clamp(min=0).unsqueeze(1)
        return torch.where(self.lengths > 0, self.buffer.gather(1, last).squeeze(1), torch.zeros_like(last.squeeze(1)))

    def propose_chain_tree(self, k: int) -> ChainTree:
        d = self.propose(k)
        return drafts_to_tree(d.drafts, d.num_drafts, self.root_tokens())

    def propose_tree(self, k: int, num_branches: int, validate: bool = False):
        """Tree drafts from the ``num_branches`` most recent occurrences of the longest match:
        ``NGramTree(parents int32 [B, T], draft_tokens int64 [B, T], num_nodes int32 [B])``,
        ``T = 1 + num_branches * k``."""
        from ..ops.ngram import ngram_propose_tree

        return ngram_propose_tree(self.buffer, self.lengths, k, num_branches, self.min_n, self.max_n, validate=validate,
                                  backend=self.backend, siblings=self.siblings)
