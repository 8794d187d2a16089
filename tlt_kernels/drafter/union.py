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

from .base import DrafterBase, ProposedTree, hand_groups, prefill_graph_specs, start_drafter


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
    widths; the secondary's must need no graph of its own. With ``fuse_step=True`` it runs inside the step graph when
    both parts do: the state rows are the primary's then the secondary's, the draft merges both drafts with
    :func:`union_tree` (device ops, fixed shapes), the commit hands each part its own rows and new state."""

    fused_step_error = None  # each part raises its own at bind

    def __init__(self, primary, secondary):
        self.primary, self.secondary = primary, secondary
        self.module = primary.module
        self._split = 0  # how many of the state rows are the primary's
        self._new_state_split = 0  # how many of a fused commit's new state tensors are the primary's

    @property
    def lazy_commit(self) -> bool:
        """Deferred commits (the engine's backlog) when both parts take them."""
        return all(getattr(part, "lazy_commit", False) for part in (self.primary, self.secondary))

    @property
    def commit_reads_hidden(self) -> bool:
        return any(getattr(part, "commit_reads_hidden", True) for part in (self.primary, self.secondary))

    def tree_width(self, strategy) -> int:
        if strategy.is_off:
            return 1
        return self.primary.tree_width(strategy) + self.secondary.tree_width(strategy) - 1

    def bind(self, *, strategies, fuse_step, device, max_batch_size, slots_per_request, block_size) -> None:
        super().bind(strategies=strategies, fuse_step=fuse_step, device=device, max_batch_size=max_batch_size,
                     slots_per_request=slots_per_request, block_size=block_size)
        for part in (self.primary, self.secondary):
            part.bind(strategies=strategies, fuse_step=fuse_step, device=device, max_batch_size=max_batch_size,
                      slots_per_request=slots_per_request, block_size=block_size)
        if fuse_step:  # the step graphs split their state rows before any rollout has called state_rows
            self._split = len(self.primary.pad_state_rows(1))

    def start(self, prompts, prompt_lens, first_tokens, prefill_hidden, graphs=None, bucket=None) -> None:
        for part in (self.primary, self.secondary):
            start_drafter(part, prompts, prompt_lens, first_tokens, prefill_hidden, graphs, bucket)

    def prefill_graph_specs(self, lengths):
        """Both parts' start graphs (a part without the hook has none)."""
        return [*prefill_graph_specs(self.primary, lengths), *prefill_graph_specs(self.secondary, lengths)]

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
        first_state = second_state = None  # None: each part computes its new state itself
        if new_state is not None:  # from a fused step graph: the primary's tensors, then the secondary's
            first_state, second_state = new_state[: self._new_state_split], new_state[self._new_state_split:]
        self.primary.commit(rows, state_rows[: self._split], path, graphs, new_state=first_state)
        self.secondary.commit(rows, state_rows[self._split:], path, graphs, new_state=second_state)

    def finish(self) -> None:
        for part in (self.primary, self.secondary):
            part.finish()

    def snapshot(self):
        """Restores what either part's fused step changes in place (a part without ``snapshot`` changes nothing)."""
        restores = [getattr(part, "snapshot", lambda: (lambda: None))() for part in (self.primary, self.secondary)]
        return lambda: [restore() for restore in restores]

    def fused_functions(self, strategy):
        first_draft, first_commit = self.primary.fused_functions(strategy)
        second_draft, second_commit = self.secondary.fused_functions(strategy)

        def draft(*state_rows):
            first = ProposedTree(*first_draft(*state_rows[: self._split]))
            return union_tree(first, ProposedTree(*second_draft(*state_rows[self._split:])))

        def commit(state_rows, emitted, num_accepted, path_hidden):
            first = list(first_commit(state_rows[: self._split], emitted, num_accepted, path_hidden) or [])
            second = list(second_commit(state_rows[self._split:], emitted, num_accepted, path_hidden) or [])
            self._new_state_split = len(first)  # set when the graph is first run, before any replay returns state
            return first + second

        return (draft if self.tree_width(strategy) > 1 else None), commit

    def pad_state_rows(self, batch_size: int):
        return [*self.primary.pad_state_rows(batch_size), *self.secondary.pad_state_rows(batch_size)]

    def load_published(self, holder) -> None:
        self.primary.load_published(holder)

    def graph_specs(self, strategies: Sequence, widths: Sequence[int]):
        return self.primary.graph_specs(strategies, widths) + self.secondary.graph_specs(strategies, widths)

    def graph_names(self, strategy):
        before, after = self.primary.graph_names(strategy, path_width=self.tree_width(strategy))
        more_before, more_after = self.secondary.graph_names(strategy)
        return [*before, *more_before], [*after, *more_after]
