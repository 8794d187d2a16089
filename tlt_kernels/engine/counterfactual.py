"""Every drafting arm's acceptance at every step, for the counterfactual policy
(:class:`~tlt_kernels.runtime.policies.CounterfactualPolicy`; docs/RUNTIME.md, "The counterfactual policy").

The n-gram drafter's drafts are a function of the history, so the engine can score any arm's drafts, played or not.
At each step, before it runs, each drafting arm of ``num_steps`` drafts proposes from every running request's
history without its last ``num_steps`` tokens, and the proposal is matched against those tokens. At temperature 0
the matched root path is what verifying it would have accepted; under sampling the count has that law (one-hot
candidates are accepted exactly when the target's token is among them). The counts are the lagging rows' (the
requests the static batch waits for, as the selector's own counts are), over the rows whose scored position lies
past the prompt. They travel with the step's outcome (one device-to-host transfer) and reach the selector through
:meth:`~tlt_kernels.runtime.StrategySelector.observe_counterfactual`, except the played arm's: the step's own
counts cover it.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from ..runtime.policies import CounterfactualPolicy
from ..tree import tree_depths


def tree_reach(draft_tokens: torch.Tensor, parents: torch.Tensor, num_nodes: torch.Tensor,
               continuation: torch.Tensor) -> torch.Tensor:
    """``int64 [b]``: the depth of the deepest node of each tree whose root path matches ``continuation``.

    ``draft_tokens`` int64 ``[b, T]`` (node 0: the root), ``parents`` int32 ``[b, T]`` (:mod:`tlt_kernels.tree`),
    ``num_nodes`` int32 ``[b]``, ``continuation`` int64 ``[b, d]``: the tokens that followed the root; nodes deeper
    than ``d`` are not scored. One pass per depth, device ops only."""
    depth = tree_depths(parents, num_nodes).to(torch.int64)
    matched = depth == 0  # the root (padding nodes have depth 0 too, but no node names them as its parent)
    parent = parents.to(torch.int64).clamp(min=0)
    for level in range(1, continuation.shape[1] + 1):
        hit = (depth == level) & (draft_tokens == continuation[:, level - 1:level]) & matched.gather(1, parent)
        matched = matched | hit
    return torch.where(matched, depth, torch.zeros_like(depth)).amax(1)


class CounterfactualScorer:
    """Stages every drafting arm's counterfactual counts with each step's outcome (module docstring).

    Args:
        drafter: the engine's n-gram drafter (an :class:`~tlt_kernels.drafter.ngram_rollout.NGramRolloutDrafter`).
        strategies: the selector's arms; the drafting ones are scored, in this order.
    """

    #: the CUDA graph of :meth:`row_scores` (fused n-gram engines capture it per batch size: :meth:`graph_spec`)
    GRAPH = ("counterfactual scores",)

    def __init__(self, drafter, strategies: Sequence):
        self.drafter = drafter
        self.arms = [s for s in strategies if s.num_steps]

    def row_scores(self, rows: torch.Tensor, lagging: torch.Tensor, generated: torch.Tensor):
        """``(int64 [b, n],)``: each row's share of :meth:`stage`'s vector (per arm: whether it is scored, then
        whether it reaches each depth). Fixed shapes, device ops only: capturable."""
        parts = []
        for arm in self.arms:
            back = arm.num_steps
            tree = self.drafter.propose_earlier(arm, rows, back)
            reach = tree_reach(tree.tokens, tree.parents, tree.num_nodes, self.drafter.recent_tokens(rows, back))
            scored = lagging & (generated > back)
            depths = torch.arange(1, back + 1, device=reach.device)
            parts += [scored.unsqueeze(1), (reach.unsqueeze(1) >= depths) & scored.unsqueeze(1)]
        return (torch.cat(parts, 1).to(torch.int64),)

    def stage(self, rows: torch.Tensor, lagging: torch.Tensor, generated: torch.Tensor, graphs=None) -> torch.Tensor:
        """``int64 [n]`` (``n``: one plus the depth per arm): per arm, the lagging rows scored and how many of them
        reach each depth. ``rows`` int64
        ``[b]`` the running rows (their histories' rows), ``lagging`` bool ``[b]``, ``generated`` int64 ``[b]`` their
        tokens so far (a row is scored once its last ``num_steps`` tokens all follow the prompt). ``graphs`` (the
        engine's :class:`~tlt_kernels.engine.graphs.GraphReplay`, or None): replay :data:`GRAPH` where captured."""
        name = self.GRAPH if graphs is not None and graphs.registered(self.GRAPH) else None
        inputs = [rows, lagging, generated]
        if graphs is None:
            return self.row_scores(*inputs)[0].sum(0)
        outputs, _ = graphs.call(name, self.row_scores, inputs, rows.shape[0])
        return outputs[0].sum(0)  # padding rows are not lagging: they add nothing

    def graph_spec(self, padding_row: int, device):
        """``(name, fn, example_inputs)`` of :data:`GRAPH` for ``GraphPool.add``: padding rows read history row
        ``padding_row`` and are not lagging."""
        def example_inputs(batch_size: int):
            return [torch.full((batch_size,), padding_row, dtype=torch.int64, device=device),
                    torch.zeros(batch_size, dtype=torch.bool, device=device),
                    torch.zeros(batch_size, dtype=torch.int64, device=device)]
        return self.GRAPH, self.row_scores, example_inputs

    def unpack(self, values: Sequence[int]) -> List[Tuple[object, List[int], int]]:
        """``(arm, accepted_per_position, rows)`` of every arm with rows scored, from the host's copy of
        :meth:`stage`'s vector."""
        out, at = [], 0
        for arm in self.arms:
            rows, counts = values[at], list(values[at + 1: at + 1 + arm.num_steps])
            at += 1 + arm.num_steps
            if rows:
                out.append((arm, counts, rows))
        return out


def counterfactual_scorer(selector, drafter, captured: Optional[CounterfactualScorer] = None
                          ) -> Optional[CounterfactualScorer]:
    """The scorer an engine needs: one where ``selector``'s policy learns from counterfactuals, else None; a
    ValueError where that policy meets a drafter that cannot score arms it does not run. ``captured``: the scorer
    whose graphs the engine captured, returned when it scores the same arms."""
    if selector is None or not isinstance(getattr(selector, "policy", None), CounterfactualPolicy):
        return None
    if not hasattr(drafter, "propose_earlier"):
        raise ValueError(f"the counterfactual policy needs a drafter that scores every arm's drafts for free (the "
                         f"n-gram drafter); got {type(drafter).__name__}: use policy='cost' with it")
    scorer = CounterfactualScorer(drafter, selector.strategies)
    return captured if captured is not None and captured.arms == scorer.arms else scorer
