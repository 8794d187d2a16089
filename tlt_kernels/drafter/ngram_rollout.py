"""The n-gram drafter as a rollout :class:`~tlt_kernels.drafter.base.Drafter`: one device history per request.

Separate steps (``fuse_step=False``): each rollout gets a fresh :class:`~tlt_kernels.drafter.NGramDrafter` over the
whole batch (prompt, then every emitted token); a step proposes from every history in one launch and keeps the
running rows' trees, and the commit appends the accepted path as eager torch ops.

Fused steps (``fuse_step=True``): a captured graph reads fixed addresses, so the histories live in one
:class:`~tlt_kernels.drafter.NGramDrafter` allocated at :meth:`~NGramRolloutDrafter.bind` for every request slot
plus a sink row (row ``max_batch_size``), with a sibling table ``int64 [max_batch_size + 1, max_group_size - 1]``
(-1 padded) for group drafting; each rollout resets them in place. The state rows are the running rows' indices
into that buffer (padding rows: the sink row), the graph's draft proposes from them and its commit appends the
accepted path in place (:meth:`~tlt_kernels.drafter.NGramDrafter.append_rows`).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from .._validation import check_positive_ints
from .base import DrafterBase, ProposedTree
from .ngram_drafter import NGramDrafter

# Largest group (GRPO's G) a fused n-gram drafter takes by default. Every sibling slot of the table is visited only
# when the request's own history has no max_n match, and an empty (-1) slot costs one length read, so a wide default
# costs nothing in the common case (no groups, or G = 8).
DEFAULT_MAX_GROUP_SIZE = 16


def ngram_tree_width(strategy) -> int:
    """A chain of ``min(num_steps, num_verify - 1)`` drafts for ``topk == 1``, else ``topk`` branches of
    ``(num_verify - 1) // topk`` drafts each; plain decoding: 1 (root included)."""
    if strategy.is_off:
        return 1
    if strategy.topk <= 1:
        return 1 + min(strategy.num_steps, strategy.num_verify - 1)
    per_branch = max(1, (strategy.num_verify - 1) // strategy.topk)
    return 1 + strategy.topk * per_branch


class NGramRolloutDrafter(DrafterBase):
    """Prompt-lookup drafts of n-grams ``min_n..max_n`` (longest match wins) from per-request histories.

    ``max_group_size``: with ``fuse_step=True``, the largest request group ``generate(groups=)`` may pass (the
    sibling table the step graphs read is allocated once, that wide); 1 drafts from each request alone with the
    self-only kernel. Separate steps take groups of any size.
    """

    fused_step_error = None
    lazy_commit = True  # the commit appends any number of tokens (0 included)
    commit_reads_hidden = False

    def __init__(self, min_n: int = 1, max_n: int = 4, max_group_size: int = DEFAULT_MAX_GROUP_SIZE):
        check_positive_ints("NGramRolloutDrafter", max_group_size=max_group_size)
        self.min_n, self.max_n, self.max_group_size = min_n, max_n, max_group_size
        self.history_len = None
        self.histories: Optional[NGramDrafter] = None  # the rollout's histories
        self.persistent: Optional[NGramDrafter] = None  # fused steps: the histories of every slot, bound once
        self.sink_row = None  # fused steps: the row padding rows read and write

    def tree_width(self, strategy) -> int:
        return ngram_tree_width(strategy)

    def bind(self, *, strategies, fuse_step, device, max_batch_size, slots_per_request, block_size) -> None:
        super().bind(strategies=strategies, fuse_step=fuse_step, device=device, max_batch_size=max_batch_size,
                     slots_per_request=slots_per_request, block_size=block_size)
        self.history_len = slots_per_request
        if fuse_step:
            self.sink_row = max_batch_size
            self.persistent = NGramDrafter(max_batch_size + 1, slots_per_request, device, self.min_n, self.max_n)
            self.histories = self.persistent  # read by graphs captured before any rollout, so never unset
            if self.max_group_size > 1:
                self.persistent.siblings = torch.full((max_batch_size + 1, self.max_group_size - 1), -1,
                                                      dtype=torch.int64, device=self.persistent.device)

    # -- a rollout ----------------------------------------------------------------------------------
    def start(self, prompts, prompt_lens, first_tokens, prefill_hidden) -> None:
        B, dev = prompts.shape[0], prompts.device
        rows = torch.arange(B, device=dev)
        # Unvalidated (the engine checked the prompts): a check would stall the host until the prefill ends.
        if self.persistent is None:
            self.histories = NGramDrafter(B, self.history_len, dev, self.min_n, self.max_n)
            self.histories.reset(rows, prompts, prompt_lens, validate=False)
            self.histories.append(first_tokens.unsqueeze(1), torch.ones(B, dtype=torch.int32, device=dev),
                                  validate=False)
            return
        # In place (the graphs hold these addresses): unused slots and the sink start empty (nothing to scan), and
        # no request has siblings until set_groups.
        self.persistent.lengths.zero_()
        if self.persistent.siblings is not None:
            self.persistent.siblings.fill_(-1)
        self.persistent.reset(rows, prompts, prompt_lens, validate=False)
        self.persistent.append_rows(rows, first_tokens.unsqueeze(1), torch.ones(B, dtype=torch.int32, device=dev))

    def set_groups(self, siblings: torch.Tensor) -> None:
        """Draft from the request's whole group: ``siblings`` int64 ``[B, S]`` (ngram_propose's ``siblings=``)."""
        if self.persistent is None:
            self.histories.siblings = siblings
            return
        B, S = siblings.shape
        if S == 0:  # every group a single request: nothing to draw from
            return
        if S > self.max_group_size - 1:
            raise ValueError(f"generate(groups=) has a group of {S + 1} requests, above the fused n-gram drafter's "
                             f"max_group_size={self.max_group_size} (its sibling table is allocated once for the "
                             f"step graphs); pass drafter=NGramRolloutDrafter(max_group_size={S + 1}) or larger")
        self.persistent.siblings[:B, :S] = siblings

    def state_rows(self, rows):
        return [rows] if self.persistent is not None else []

    def propose(self, strategy, rows, state_rows, graphs) -> ProposedTree:
        # Fused engines (eager fallback) index the persistent histories by their state rows: the same indices.
        return self._propose_rows(strategy, state_rows[0] if state_rows else rows)

    def commit(self, rows, state_rows, path, graphs, new_state=None) -> None:
        if new_state is not None:
            return  # a fused step graph appended the accepted path in place
        if state_rows:
            self.persistent.append_rows(state_rows[0], path.tokens, path.num_new)
            return
        # The histories span the whole batch: finished rows append nothing.
        B, width = self.histories.batch_size, path.tokens.shape[1]
        new_tokens = torch.zeros(B, width, dtype=torch.int64, device=rows.device)
        num_new = torch.zeros(B, dtype=torch.int32, device=rows.device)
        new_tokens[rows] = path.tokens
        num_new[rows] = path.num_new
        self.histories.append(new_tokens, num_new, validate=False)  # 1 <= num_new <= T by construction

    def finish(self) -> None:
        if self.persistent is None:  # the persistent histories stay for the next rollout (the graphs hold them)
            self.histories = None

    def snapshot(self) -> Callable[[], None]:
        """Restores the histories a fused step graph appends to in place (a trace probe runs steps uncommitted)."""
        if self.persistent is None:
            return lambda: None
        buffer, lengths = self.persistent.buffer.clone(), self.persistent.lengths.clone()
        return lambda: (self.persistent.buffer.copy_(buffer), self.persistent.lengths.copy_(lengths))

    # -- counterfactual drafts (the counterfactual policy's counts: tlt_kernels.engine.counterfactual) ----------
    def propose_earlier(self, strategy, history_rows, back: int) -> ProposedTree:
        """The trees ``strategy`` would have proposed for ``history_rows`` (int64 ``[b]``) from each history without
        its last ``back`` tokens (at least its first token kept). Device ops only; the histories are unchanged (their
        lengths are set back for the proposal only)."""
        histories = self.histories
        lengths = histories.lengths
        histories.lengths = (lengths - back).clamp(min=1).to(lengths.dtype)  # a new tensor: graphs keep theirs
        try:
            return self._propose_rows(strategy, history_rows)
        finally:
            histories.lengths = lengths

    def recent_tokens(self, history_rows, back: int) -> torch.Tensor:
        """``int64 [b, back]``: the ``back`` tokens after each of ``history_rows``' histories as
        :meth:`propose_earlier` cut them, what its trees are scored against (a history of at most ``back`` tokens
        reads past its end: its counts mean nothing)."""
        histories = self.histories
        start = (histories.lengths[history_rows].to(torch.int64) - back).clamp(min=1)
        positions = (start.unsqueeze(1) + torch.arange(back, device=start.device)).clamp(max=histories.max_len)
        return histories.buffer[history_rows.unsqueeze(1), positions]

    # -- the fused step -----------------------------------------------------------------------------
    def fused_functions(self, strategy):
        if self.persistent is None:
            raise ValueError("the n-gram drafter was bound with fuse_step=False: it has no fused step functions")
        draft = (lambda history_rows: self._propose_rows(strategy, history_rows)) if self.tree_width(strategy) > 1 \
            else None
        return draft, self._append_accepted

    def pad_state_rows(self, batch_size: int):
        if self.persistent is None:
            return []
        return [torch.full((batch_size,), self.sink_row, dtype=torch.int64, device=self.persistent.device)]

    def _propose_rows(self, strategy, history_rows) -> ProposedTree:
        """Trees of ``tree_width(strategy)`` nodes for ``history_rows``: every history proposes in one launch (group
        drafting reads any row), then the rows' trees are gathered. Device ops only, fixed shapes."""
        width = self.tree_width(strategy)
        if strategy.topk <= 1:
            tree = self.histories.propose_chain_tree(width - 1)
        else:
            tree = self.histories.propose_tree((width - 1) // strategy.topk, strategy.topk)
        return ProposedTree(tree.draft_tokens[history_rows], tree.parents[history_rows].to(torch.int32),
                            tree.num_nodes[history_rows].to(torch.int32))

    def _append_accepted(self, state_rows, emitted, num_accepted, path_hidden):
        """The fused step's commit: the accepted path (``num_accepted + 1`` emitted tokens) joins each row's history
        in place; no new state to hand back."""
        self.persistent.append_rows(state_rows[0], emitted.clamp(min=0), (num_accepted + 1).to(torch.int32))
        return []
