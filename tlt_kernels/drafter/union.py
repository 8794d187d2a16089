"""Two drafters' trees verified as one: the model drafter's tree, with a model-free drafter's branch beside it.

Every step both drafters propose for the same strategy; the union keeps the first (primary) tree as it is and hangs
the second's non-root nodes under the same root, after it. The walk tries children in index order, so the
primary's drafts are tried first at the root, and a second draft of a token the primary's branch already offered
is never accepted after that branch was rejected (the residual no longer holds it), so the union is as lossless as
either tree. Both drafters then learn the accepted path, whichever branch it took. The intended pair: an EAGLE
drafter (which generalizes) and the n-gram drafter over the request's group (which copies what a sibling wrote):
``SpeculativeEngine(target, [eagle, "ngram"], ...)``.
"""
from __future__ import annotations

from typing import List, Sequence

import torch

from .base import DrafterBase, ProposedTree, hand_groups


def union_tree(first: ProposedTree, second: ProposedTree) -> ProposedTree:
    """``first``'s nodes, then ``second``'s non-root nodes (their parents renumbered; second's root is first's),
    then padding: ``T = T1 + T2 - 1`` nodes, ``num_nodes = n1 + n2 - 1``. Device ops only (no host sync)."""
    b, T1 = first.tokens.shape
    T2 = second.tokens.shape[1]
    T = T1 + T2 - 1
    dev = first.tokens.device
    n1, n2 = first.num_nodes.long(), second.num_nodes.long()
    tokens = torch.zeros(b, T + 1, dtype=torch.int64, device=dev)  # column T takes the dropped writes
    parents = torch.zeros(b, T + 1, dtype=torch.int32, device=dev)
    index = torch.arange(T1, device=dev).unsqueeze(0)
    keep = index < n1.unsqueeze(1)
    slot = torch.where(keep, index, T)
    tokens.scatter_(1, slot, first.tokens.long())
    parents.scatter_(1, slot, first.parents.to(torch.int32))
    j = torch.arange(1, T2, device=dev).unsqueeze(0)
    valid = j < n2.unsqueeze(1)
    slot = torch.where(valid, n1.unsqueeze(1) + j - 1, T)
    own = second.parents[:, 1:].long()
    renumbered = torch.where(own == 0, 0, n1.unsqueeze(1) + own - 1)
    tokens.scatter_(1, slot, second.tokens[:, 1:].long())
    parents.scatter_(1, slot, renumbered.to(torch.int32))
    parents[:, 0] = -1
    return ProposedTree(tokens[:, :T], parents[:, :T], (n1 + n2 - 1).to(torch.int32))


class UnionDrafter(DrafterBase):
    """``primary``'s tree with ``secondary``'s branch beside it (see the module docstring). ``module`` (the
    weights a spot trainer publishes into) is the primary's. The primary's graphs are captured for the union's
    widths; the secondary's must need no graph of its own. No fused step (the n-gram drafter updates its histories
    outside the step)."""

    fused_step_error = ("fuse_step=True is not available with two drafters (the n-gram drafter updates its "
                        "histories outside the step); use fuse_step=False")

    def __init__(self, primary, secondary):
        self.primary, self.secondary = primary, secondary
        self.module = primary.module
        self._split = 0  # how many of the state rows are the primary's

    def tree_width(self, strategy) -> int:
        if strategy.is_off:
            return 1
        return self.primary.tree_width(strategy) + self.secondary.tree_width(strategy) - 1

    def bind(self, *, strategies, fuse_step, device, max_batch_size, slots_per_request, block_size) -> None:
        super().bind(strategies=strategies, fuse_step=fuse_step, device=device, max_batch_size=max_batch_size,
                     slots_per_request=slots_per_request, block_size=block_size)
        for part in (self.primary, self.secondary):
            part.bind(strategies=strategies, fuse_step=False, device=device, max_batch_size=max_batch_size,
                      slots_per_request=slots_per_request, block_size=block_size)

    def start(self, prompts, prompt_lens, first_tokens, prefill_hidden) -> None:
        for part in (self.primary, self.secondary):
            part.start(prompts, prompt_lens, first_tokens, prefill_hidden)

    def set_groups(self, siblings: torch.Tensor) -> None:
        for part in (self.primary, self.secondary):
            hand_groups(part, siblings)

    def state_rows(self, rows) -> List[torch.Tensor]:
        mine = self.primary.state_rows(rows)
        self._split = len(mine)
        return [*mine, *self.secondary.state_rows(rows)]

    def propose(self, strategy, rows, state_rows, graphs) -> ProposedTree:
        first = self.primary.propose(strategy, rows, state_rows[: self._split], graphs)
        second = self.secondary.propose(strategy, rows, state_rows[self._split:], graphs)
        return union_tree(first, second)

    def commit(self, rows, state_rows, path, graphs, new_state=None) -> None:
        self.primary.commit(rows, state_rows[: self._split], path, graphs)
        self.secondary.commit(rows, state_rows[self._split:], path, graphs)

    def finish(self) -> None:
        for part in (self.primary, self.secondary):
            part.finish()

    def load_published(self, holder) -> None:
        self.primary.load_published(holder)

    def graph_specs(self, strategies: Sequence, widths: Sequence[int]):
        return self.primary.graph_specs(strategies, widths) + self.secondary.graph_specs(strategies, widths)

    def graph_names(self, strategy):
        before, after = self.primary.graph_names(strategy, path_width=self.tree_width(strategy))
        more_before, more_after = self.secondary.graph_names(strategy)
        return [*before, *more_before], [*after, *more_after]
