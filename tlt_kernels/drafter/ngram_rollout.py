"""The n-gram drafter as a rollout :class:`~tlt_kernels.drafter.base.Drafter`: one device history per request.

Each rollout gets a fresh :class:`~tlt_kernels.drafter.NGramDrafter` over the whole batch (prompt, then every
emitted token); a step proposes from every history in one launch and keeps the running rows' trees.
"""
from __future__ import annotations

import torch

from .base import DrafterBase, ProposedTree
from .ngram_drafter import NGramDrafter


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
    """Prompt-lookup drafts of n-grams ``min_n..max_n`` (longest match wins) from per-request histories."""

    fused_step_error = ("fuse_step=True supports plain decoding and the EAGLE drafter (the n-gram drafter's "
                        "histories are updated outside the step); use fuse_step=False with drafter='ngram'")

    def __init__(self, min_n: int = 1, max_n: int = 4):
        self.min_n, self.max_n = min_n, max_n
        self.history_len = None
        self.histories = None  # the rollout's NGramDrafter

    def tree_width(self, strategy) -> int:
        return ngram_tree_width(strategy)

    def bind(self, *, strategies, fuse_step, device, max_batch_size, slots_per_request, block_size) -> None:
        super().bind(strategies=strategies, fuse_step=fuse_step, device=device, max_batch_size=max_batch_size,
                     slots_per_request=slots_per_request, block_size=block_size)
        self.history_len = slots_per_request

    def start(self, prompts, prompt_lens, first_tokens, prefill_hidden) -> None:
        B, dev = prompts.shape[0], prompts.device
        self.histories = NGramDrafter(B, self.history_len, dev, self.min_n, self.max_n)
        self.histories.reset(torch.arange(B, device=dev), prompts, prompt_lens)
        self.histories.append(first_tokens.unsqueeze(1), torch.ones(B, dtype=torch.int32, device=dev))

    def set_groups(self, siblings: torch.Tensor) -> None:
        """Draft from the request's whole group: ``siblings`` int64 ``[B, S]`` (ngram_propose's ``siblings=``)."""
        self.histories.siblings = siblings

    def propose(self, strategy, rows, state_rows, graphs) -> ProposedTree:
        width = self.tree_width(strategy)
        if strategy.topk <= 1:
            tree = self.histories.propose_chain_tree(width - 1)
        else:
            tree = self.histories.propose_tree((width - 1) // strategy.topk, strategy.topk)
        return ProposedTree(tree.draft_tokens[rows], tree.parents[rows], tree.num_nodes[rows])

    def commit(self, rows, state_rows, path, graphs, new_state=None) -> None:
        # The histories span the whole batch: finished rows append nothing.
        B, width = self.histories.batch_size, path.tokens.shape[1]
        new_tokens = torch.zeros(B, width, dtype=torch.int64, device=rows.device)
        num_new = torch.zeros(B, dtype=torch.int32, device=rows.device)
        new_tokens[rows] = path.tokens
        num_new[rows] = path.num_new
        self.histories.append(new_tokens, num_new, validate=False)  # 1 <= num_new <= T by construction

    def finish(self) -> None:
        self.histories = None
