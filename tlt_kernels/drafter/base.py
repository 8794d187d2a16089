"""The drafter interface of :class:`~tlt_kernels.engine.SpeculativeEngine`: what any drafter gives the engine.

A rollout drafter proposes a token tree per running request every step and learns the tokens the target accepted.
The engine drives it through :class:`Drafter` and never asks which drafter it has; :class:`NoDrafter` (plain
decoding), :class:`~tlt_kernels.drafter.ngram_rollout.NGramRolloutDrafter` and
:class:`~tlt_kernels.drafter.eagle_rollout.EagleRolloutDrafter` implement it, and so can a user's class
(docs/DRAFTERS.md, "Writing your own drafter"). :class:`DrafterBase` gives every method a default.
"""
from __future__ import annotations

from functools import cached_property
from typing import Callable, Hashable, List, NamedTuple, Optional, Protocol, Sequence, Tuple, runtime_checkable

import torch

# One graph a drafter asks the engine to capture: (name, fn(*inputs) -> tensors, example_inputs(batch_size)).
GraphSpec = Tuple[Hashable, Callable, Callable[[int], list]]


class ProposedTree(NamedTuple):
    """Draft token trees of ``b`` requests, ``T`` nodes each (node 0 = the root).

    ``tokens`` int64 ``[b, T]`` (node 0 may hold anything: the engine writes each request's last token there),
    ``parents`` int32 ``[b, T]`` (``parents[:, 0] = -1``, every other parent index below its node), ``num_nodes``
    int32 ``[b]`` in ``[1, T]`` (nodes past it are padding).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    num_nodes: torch.Tensor


class AcceptedPath:
    """What the target accepted this step, for ``b`` requests and trees of ``T`` nodes.

    ``tokens`` int64 ``[b, T]``: the accepted drafts then the target's own token (first ``num_new[b]`` valid, the
    rest >= 0 padding); ``num_new`` int32 ``[b]`` in ``[1, T]`` (accepted drafts + 1); ``hidden`` ``[b, T, H]`` in
    the target's dtype: the target's features (last layer, before the final norm) of the accepted path's nodes.
    ``tokens`` and ``num_new`` are computed on first use (a drafter that ignores them costs no kernel launch).
    """

    def __init__(self, emitted: torch.Tensor, num_accepted: torch.Tensor, hidden: torch.Tensor):
        self._emitted, self._num_accepted, self.hidden = emitted, num_accepted, hidden

    @cached_property
    def tokens(self) -> torch.Tensor:
        return self._emitted.clamp(min=0)

    @cached_property
    def num_new(self) -> torch.Tensor:
        return (self._num_accepted + 1).to(torch.int32)


@runtime_checkable
class GraphCalls(Protocol):
    """The engine's graph replayer, handed to :meth:`Drafter.propose` / :meth:`Drafter.commit`."""

    def call(self, name: Hashable, fn: Callable, inputs: Sequence[torch.Tensor], batch_size: int):
        """``fn(*inputs)``'s outputs for ``batch_size`` rows: replayed from the captured graph ``name`` when one
        covers the batch (outputs cut to ``batch_size`` rows), else ``fn`` called eagerly. Returns ``(outputs,
        replayed)``."""


@runtime_checkable
class Drafter(Protocol):
    """A drafter the engine can drive (every method is called with no gradient, on the target's device).

    ``rows`` are int64 ``[b]`` device indices of the running requests in ``[0, B)`` (``B``: the rollout's batch).
    ``state_rows`` is the list of per-request state tensors (first dimension ``b``) the drafter's graphs take
    (``[]`` for a drafter without device state).

    Optional (not part of the protocol, so existing drafters stay valid; :class:`DrafterBase` has them):
    ``set_groups(siblings)``, called after :meth:`start` when ``generate`` is given request groups, with
    ``siblings`` int64 ``[B, S]``: the other rows of each request's group (-1 padded). A drafter that can draft
    from them (the n-gram drafter) keeps them for the rollout; others ignore them. ``snapshot() -> restore()``: a
    drafter whose fused commit writes its state in place (the n-gram histories) restores it after a trace probe.
    ``lazy_commit`` (bool): the engine may defer this drafter's commits over plain steps and hand them over later
    as one :class:`AcceptedPath` per request (up to ``SpeculativeEngine(lazy_commit_steps=)`` tokens wide, where
    ``num_new`` may be 0: nothing to learn), through the same :meth:`commit` with ``new_state=None``, before the
    next :meth:`propose`. ``commit_reads_hidden`` (bool): whether that commit reads ``path.hidden`` (else the
    engine keeps no features for it). ``prefill_graph_specs(lengths) -> List[GraphSpec]``: graphs of this drafter's
    :meth:`start` over prompts padded to each of ``lengths`` (the engine's prefill buckets), captured beside the
    target's prefill graphs; a drafter that has it is started as ``start(..., graphs=, bucket=)``, ``bucket`` the
    length whose graphs replayed the prefill (None: it ran eagerly) (:func:`start_drafter`).
    """

    module: Optional[torch.nn.Module]  # trainable weights the spot trainer publishes into, or None

    def tree_width(self, strategy) -> int:
        """Nodes ``T`` of the tree proposed per request under ``strategy`` (root included; 1 = no drafts)."""

    def bind(self, *, strategies: Sequence, fuse_step: bool, device: torch.device, max_batch_size: int,
             slots_per_request: int, block_size: int) -> None:
        """Once, at engine construction: check the strategies (ValueError) and allocate per-engine memory."""

    def start(self, prompts: torch.Tensor, prompt_lens: torch.Tensor, first_tokens: torch.Tensor,
              prefill_hidden: torch.Tensor) -> None:
        """A rollout starts: ``prompts`` int64 ``[B, L]`` (``prompt_lens`` int64 ``[B]`` valid), ``first_tokens``
        int64 ``[B]`` (drawn from the prefill), ``prefill_hidden`` ``[B, L, H]`` target features of the prompts."""

    def state_rows(self, rows: torch.Tensor) -> List[torch.Tensor]:
        """This step's state of the running ``rows`` (gathered copies, the drafter graphs' inputs)."""

    def propose(self, strategy, rows: torch.Tensor, state_rows: List[torch.Tensor], graphs: GraphCalls) -> ProposedTree:
        """Draft trees of ``tree_width(strategy) > 1`` nodes for ``rows``."""

    def commit(self, rows: torch.Tensor, state_rows: List[torch.Tensor], path: AcceptedPath, graphs: GraphCalls,
               new_state: Optional[List[torch.Tensor]] = None) -> None:
        """Learn the accepted path of every running row. ``new_state``: the rows' new state, already computed by
        a fused step graph (:meth:`fused_functions`'s commit function); None: compute it here."""

    def finish(self) -> None:
        """The rollout ended (also after an error): free per-rollout memory."""

    def load_published(self, holder) -> None:
        """Load the spot trainer's newest published weights from ``holder`` (a WeightsHolder), if any."""

    def graph_specs(self, strategies: Sequence, widths: Sequence[int]) -> List[GraphSpec]:
        """Graphs to capture next to the verify forward (separate-graph steps); with no ``strategies``, only the commit
        graphs for accepted paths of ``widths`` (the engine's deferred backlog commits through them)."""

    def graph_names(self, strategy) -> Tuple[list, list]:
        """Names of the graphs a step of ``strategy`` replays before and after the verify forward. (A drafter used
        as a union's primary also takes ``path_width=``: the union's tree width, which its commit graphs see.)"""

    def fused_functions(self, strategy) -> Tuple[Optional[Callable], Optional[Callable]]:
        """For the fused step graph: ``(draft(*state_rows) -> (tokens, parents, num_nodes) or None,
        commit(state_rows, emitted, num_accepted, path_hidden) -> new state tensors or None)``."""

    def pad_state_rows(self, batch_size: int) -> List[torch.Tensor]:
        """``batch_size`` harmless padding rows of state (example inputs of the fused step graphs)."""


def hand_groups(drafter, siblings: torch.Tensor) -> None:
    """Give ``drafter`` the rollout's sibling table if it takes one: ``set_groups`` is optional on :class:`Drafter`
    (a drafter without it drafts from each request alone)."""
    set_groups = getattr(drafter, "set_groups", None)
    if set_groups is not None:
        set_groups(siblings)


def prefill_graph_specs(drafter, lengths: Sequence[int]) -> List[GraphSpec]:
    """The graphs of ``drafter``'s start over prompts padded to each of ``lengths`` (``[]``: it has none; the hook
    is optional on :class:`Drafter`)."""
    specs = getattr(drafter, "prefill_graph_specs", None)
    return [] if specs is None else specs(lengths)


def start_drafter(drafter, prompts: torch.Tensor, prompt_lens: torch.Tensor, first_tokens: torch.Tensor,
                  prefill_hidden: torch.Tensor, graphs: Optional[GraphCalls], bucket: Optional[int]) -> None:
    """:meth:`Drafter.start`, with ``graphs=`` and ``bucket=`` (the prefill bucket whose graph replayed, None when the
    prefill ran eagerly) for a drafter that captures its start (``prefill_graph_specs``)."""
    if getattr(drafter, "prefill_graph_specs", None) is None:
        drafter.start(prompts, prompt_lens, first_tokens, prefill_hidden)
    else:
        drafter.start(prompts, prompt_lens, first_tokens, prefill_hidden, graphs=graphs, bucket=bucket)


def root_only_tree(roots: torch.Tensor) -> ProposedTree:
    """A one-node tree per request (plain decoding): ``roots`` int64 ``[b]``."""
    b, dev = roots.shape[0], roots.device
    return ProposedTree(roots.unsqueeze(1), torch.full((b, 1), -1, dtype=torch.int32, device=dev),
                     torch.ones(b, dtype=torch.int32, device=dev))


class DrafterBase:
    """Defaults for every :class:`Drafter` method: no device state, no graphs of its own, no fused step.

    A subclass must implement :meth:`tree_width` and :meth:`propose`; :meth:`start` and :meth:`commit` usually too.
    """

    module: Optional[torch.nn.Module] = None
    # The engine may defer commits over plain steps (Drafter's docstring); off by default: a custom drafter's
    # commit may not take paths of any width.
    lazy_commit: bool = False
    commit_reads_hidden: bool = True
    # None: the drafter runs inside a fused step graph; else the ValueError message for fuse_step=True.
    fused_step_error: Optional[str] = ("fuse_step=True supports plain decoding, the n-gram and EAGLE drafters and "
                                       "their union; use fuse_step=False with this drafter")

    def tree_width(self, strategy) -> int:
        raise NotImplementedError

    def bind(self, *, strategies, fuse_step, device, max_batch_size, slots_per_request, block_size) -> None:
        if fuse_step and self.fused_step_error is not None:
            raise ValueError(self.fused_step_error)

    def start(self, prompts, prompt_lens, first_tokens, prefill_hidden) -> None:
        pass

    def set_groups(self, siblings: torch.Tensor) -> None:
        pass  # this drafter drafts from each request alone

    def state_rows(self, rows) -> List[torch.Tensor]:
        return []

    def propose(self, strategy, rows, state_rows, graphs) -> ProposedTree:
        raise NotImplementedError

    def commit(self, rows, state_rows, path, graphs, new_state=None) -> None:
        pass

    def finish(self) -> None:
        pass

    def load_published(self, holder) -> None:
        pass

    def snapshot(self) -> Callable[[], None]:
        """A function that restores the state this drafter's fused step graph changes in place (a trace probe runs
        a step without committing it). Optional, like ``set_groups``; here: nothing changes in place."""
        return lambda: None

    def graph_specs(self, strategies, widths) -> List[GraphSpec]:
        return []

    def graph_names(self, strategy, path_width=None) -> Tuple[list, list]:
        return [], []

    def fused_functions(self, strategy):
        raise ValueError(self.fused_step_error)

    def pad_state_rows(self, batch_size: int) -> List[torch.Tensor]:
        return []


class NoDrafter(DrafterBase):
    """Plain decoding: every tree is the root alone; strategies that draft are refused at construction."""

    fused_step_error = None

    def tree_width(self, strategy) -> int:
        return 1

    def bind(self, *, strategies, fuse_step, device, max_batch_size, slots_per_request, block_size) -> None:
        drafting = [str(s) for s in strategies if not s.is_off]
        if drafting:
            raise ValueError(f"strategies {drafting} need a drafter; pass drafter='ngram' or an EagleDrafter")

    def propose(self, strategy, rows, state_rows, graphs) -> ProposedTree:
        raise ValueError("NoDrafter proposes no drafts (every strategy it accepts has tree width 1)")

    def fused_functions(self, strategy):
        return None, None
