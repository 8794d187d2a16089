"""One decoding step's propose -> verify -> accept, behind one interface with two implementations:

* :class:`SeparateGraphStepRunner`: the drafter's graphs, then the verify forward's graph (one per tree width and
  padded batch size), then acceptance and KV compaction; each part runs eagerly where no graph covers it. Plain
  steps (tree width 1) draft nothing, so they replay one graph of the whole step like the fused runner's: an
  adaptive engine's "off" arm then costs what a plain engine's step costs.
* :class:`FusedGraphStepRunner`: the whole step (draft, verify forward, accept, KV compaction, drafter extension)
  as one graph per (strategy, padded batch size): one launch per step instead of three. Without a graph for the
  batch it falls back to the separate runner (whose parts then run eagerly). With a drafter whose commits the engine
  defers over plain steps, plain steps replay the drafter-free graph too.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property, partial
from typing import List, NamedTuple, Optional

import torch

from ..drafter.base import NoDrafter, ProposedTree, root_only_tree
from ..ops.compact_kv import compact_kv
from ..ops.verify_tree import verify_tree
from .sampling import RequestSampling


@dataclass
class StepInputs:
    """The running rows of one step: ``rows`` int64 ``[b]`` (device), their ``block_table`` int32 ``[b, blocks]``,
    ``context_lens`` int32 ``[b]`` before the step, ``root_tokens`` int64 ``[b]``, the drafter's ``drafter_state``
    rows, and the rollout's sampling parameters and Philox ``offsets`` int64 ``[B]``. ``max_context_len``: the
    longest of ``context_lens``, known on the host: an eager verify forward sizes its attention plan with it instead
    of reading the lengths from the device (None: it reads them)."""

    rows: torch.Tensor
    block_table: torch.Tensor
    context_lens: torch.Tensor
    root_tokens: torch.Tensor
    drafter_state: List[torch.Tensor]
    sampling: RequestSampling
    offsets: torch.Tensor
    max_context_len: Optional[int] = None

    @property
    def batch_size(self) -> int:
        return self.rows.shape[0]

    @cached_property
    def verify_sampling(self) -> dict:
        return self.sampling.verify_kwargs(self.rows, self.offsets)

    @cached_property
    def graph_sampling(self) -> tuple:
        return self.sampling.graph_inputs(self.rows, self.offsets)


class StepResult(NamedTuple):
    """A step's outcome for ``b`` rows and trees of ``width`` nodes: ``emitted`` int64 ``[b, T]`` (accepted drafts
    then the target's token, -1 past them), ``num_accepted`` int32 ``[b]``, ``context_lens`` int32 ``[b]`` after
    compaction, ``path_hidden`` ``[b, T, H]`` and ``path_tokens`` int64 ``[b, T]`` of the accepted path, ``error``
    int32 ``[b]`` (verify_tree's NaN/+inf flag), ``drafter_state`` (the rows' new drafter state from a fused graph;
    None: the drafter's commit computes it), ``replayed`` (from graphs or eager), ``scores`` float32 ``[b, T, 2]``
    (the emitted tokens' sampling and raw log-probs, when the target step scores them; else None)."""

    emitted: torch.Tensor
    num_accepted: torch.Tensor
    context_lens: torch.Tensor
    path_hidden: torch.Tensor
    path_tokens: torch.Tensor
    error: torch.Tensor
    drafter_state: Optional[List[torch.Tensor]]
    replayed: bool
    width: int
    scores: Optional[torch.Tensor] = None


class TargetStep:
    """The target's side of a step: the verify forward over the paged cache, acceptance and KV compaction."""

    def __init__(self, target, cache, sink_table: torch.Tensor, backend: str, logprobs: bool = False):
        self.target, self.cache, self.sink_table, self.backend = target, cache, sink_table, backend
        self.device = target.device
        self.logprobs = logprobs  # accept() also returns the emitted tokens' log-probs

    def verify_forward(self, tokens, parents, num_nodes, block_table, context_lens, max_context_len=None):
        """``(logits [b, T, V], hidden [b, T, H])`` of the tree nodes (the verify graphs' function). ``max_context_len``
        (an upper bound of ``context_lens``) spares the plan a device read; a graph capture passes none (the plan
        then takes the table's capacity)."""
        return self.target.forward_tree(tokens, parents, num_nodes, self.cache, block_table, context_lens,
                                        validate=False, backend=self.backend, max_context_len=max_context_len)

    def accept(self, tree: ProposedTree, logits, hidden, block_table, context_lens, sampling: dict) -> tuple:
        """verify_tree + compact_kv + the accepted path's features: ``(emitted int64 [b, T], num_accepted int32
        [b], new context_lens int32 [b], path_hidden [b, T, H], path_tokens int64 [b, T], error int32 [b])``, then
        with :attr:`logprobs` the emitted tokens' ``scores`` float32 ``[b, T, 2]`` (sampling, raw log-probs)."""
        tokens, parents, num_nodes = tree
        width = tokens.shape[1]
        res = verify_tree(logits, tokens, parents, num_nodes, max_depth=width - 1, validate=False,
                          return_logprobs=self.logprobs, return_raw_logprobs=self.logprobs, **sampling)
        new_context_lens = compact_kv(self.cache.k, self.cache.v, block_table, context_lens, res.accepted_nodes,
                                      res.num_accepted, validate=False)
        path = res.accepted_nodes.to(torch.int64).clamp(min=0)  # [b, T]
        path_hidden = hidden.gather(1, path.unsqueeze(2).expand(-1, -1, hidden.shape[-1]))
        outputs = (res.tokens.to(torch.int64), res.num_accepted, new_context_lens, path_hidden, tokens.gather(1, path),
                   res.error)
        return outputs + (torch.stack([res.logprobs, res.raw_logprobs], 2),) if self.logprobs else outputs

    def pad_verify_inputs(self, width: int, p: int):
        """Padding rows of the verify graph (its example inputs): a 1-node tree at slot 0 of the sink request,
        whose K/V nobody reads."""
        dev = self.device
        tokens = torch.zeros(p, width, dtype=torch.int64, device=dev)
        parents = torch.zeros(p, width, dtype=torch.int32, device=dev)
        parents[:, 0] = -1
        num_nodes = torch.ones(p, dtype=torch.int32, device=dev)
        block_table = self.sink_table.expand(p, -1).clone()
        context_lens = torch.zeros(p, dtype=torch.int32, device=dev)
        return tokens, parents, num_nodes, block_table, context_lens


def _drafter_free_step(plain: "StepRunner", strategy, inputs: StepInputs) -> StepResult:
    """A plain step on ``plain``, a runner whose graphs hold no drafter: no drafter state in, ``drafter_state=None``
    out, so the engine commits (or defers) the drafter's part itself."""
    return plain.run(strategy, replace(inputs, drafter_state=[]))._replace(drafter_state=None)


class StepRunner:
    """The step-runner interface: graphs to register, which batches they cover, and :meth:`run`."""

    def __init__(self, target_step: TargetStep, drafter, graphs):
        self.target_step, self.drafter, self.graphs = target_step, drafter, graphs

    def register_graphs(self, strategies, widths, sizes) -> None:
        """Add this runner's graphs for ``sizes`` to the pool (names already registered are kept)."""
        raise NotImplementedError

    def register_drafter_graphs(self, strategies, widths, sizes) -> None:
        """Add the drafter's own graphs at ``sizes``: its drafts of ``strategies`` and its commits of paths of
        ``widths`` (no strategies: only the commits, such as a deferred backlog's)."""
        for name, fn, example_inputs in self.drafter.graph_specs(strategies, widths):
            self._add_graph(name, fn, sizes, example_inputs)

    def covers(self, strategy, batch_size: int) -> bool:
        """Whether a captured graph runs a step of ``strategy`` at ``batch_size``."""
        raise NotImplementedError

    def graph_names(self, strategy) -> list:
        """The graphs one step of ``strategy`` replays, in order."""
        raise NotImplementedError

    def run(self, strategy, inputs: StepInputs) -> StepResult:
        raise NotImplementedError

    def _add_graph(self, name, fn, sizes, example_inputs) -> None:
        if not self.graphs.registered(name):
            self.graphs.pool.add(name, fn, sizes, example_inputs)


class SeparateGraphStepRunner(StepRunner):
    """Drafter graphs, then the verify graph, then accept + compaction; plain steps replay one fused graph of the
    whole step when ``plain_graph`` (see the module docstring)."""

    def __init__(self, target_step: TargetStep, drafter, graphs, plain_graph: bool = True):
        super().__init__(target_step, drafter, graphs)
        # The plain step's graph holds no drafter: the drafter commits the accepted token eagerly, as after any step.
        self.plain = FusedGraphStepRunner(target_step, NoDrafter(), graphs, fallback=self) if plain_graph else None

    def _plain(self, strategy, batch_size: Optional[int] = None) -> bool:
        """Whether ``strategy`` runs the plain step's graph (at ``batch_size``, when given)."""
        if self.plain is None or self.drafter.tree_width(strategy) != 1 or not self.graphs.registered(
                self.plain.step_key(strategy)):
            return False
        return batch_size is None or self.plain.covers(strategy, batch_size)

    def register_graphs(self, strategies, widths, sizes) -> None:
        if self.plain is not None:
            self.plain.register_graphs([s for s in strategies if self.drafter.tree_width(s) == 1], [1], sizes)
        for width in widths:
            self._add_graph(("verify", width), self.target_step.verify_forward, sizes,
                            lambda B, width=width: self.target_step.pad_verify_inputs(width, B))
        self.register_drafter_graphs(strategies, widths, sizes)

    def covers(self, strategy, batch_size: int) -> bool:
        if self._plain(strategy):
            return self.plain.covers(strategy, batch_size)
        return self.graphs.pool.covers(("verify", self.drafter.tree_width(strategy)), batch_size)

    def graph_names(self, strategy) -> list:
        if self._plain(strategy):
            return self.plain.graph_names(strategy)
        before, after = self.drafter.graph_names(strategy)
        return [*before, ("verify", self.drafter.tree_width(strategy)), *after]

    def run(self, strategy, inputs: StepInputs) -> StepResult:
        if self._plain(strategy, inputs.batch_size) and self.graphs.padded_size(self.plain.step_key(strategy),
                                                                                 inputs.batch_size) is not None:
            return _drafter_free_step(self.plain, strategy, inputs)
        tree = self.propose(strategy, inputs)
        verify_inputs = (*tree, inputs.block_table, inputs.context_lens)
        eager = partial(self.target_step.verify_forward, max_context_len=inputs.max_context_len)  # no device read
        (logits, hidden), replayed = self.graphs.call(("verify", tree.tokens.shape[1]), eager, verify_inputs,
                                                      inputs.batch_size)
        accepted = self.target_step.accept(tree, logits, hidden, inputs.block_table, inputs.context_lens,
                                           inputs.verify_sampling)
        scores = accepted[6] if self.target_step.logprobs else None
        return StepResult(*accepted[:6], drafter_state=None, replayed=replayed, width=tree.tokens.shape[1],
                          scores=scores)

    def propose(self, strategy, inputs: StepInputs) -> ProposedTree:
        """The drafter's trees with each request's last token at the root (a root alone for width 1)."""
        if self.drafter.tree_width(strategy) == 1:
            return root_only_tree(inputs.root_tokens)
        tree = self.drafter.propose(strategy, inputs.rows, inputs.drafter_state, self.graphs)
        tokens = tree.tokens.clone()
        tokens[:, 0] = inputs.root_tokens
        return ProposedTree(tokens, tree.parents.to(torch.int32), tree.num_nodes.to(torch.int32))


class FusedGraphStepRunner(StepRunner):
    """One graph per (strategy, padded batch size); the separate runner where none covers the batch.

    ``plain_steps_without_drafter``: plain steps (tree width 1) replay a graph of the step without the drafter's
    commit and return ``drafter_state=None``, so the engine commits them itself, or defers them (a ``lazy_commit``
    drafter: :mod:`tlt_kernels.engine.backlog`)."""

    def __init__(self, target_step: TargetStep, drafter, graphs, fallback: Optional[StepRunner] = None,
                 plain_steps_without_drafter: bool = False):
        super().__init__(target_step, drafter, graphs)
        self.fallback = fallback or SeparateGraphStepRunner(target_step, drafter, graphs, plain_graph=False)
        self.plain = FusedGraphStepRunner(target_step, NoDrafter(), graphs, fallback=self.fallback) \
            if plain_steps_without_drafter else None

    @staticmethod
    def step_key(strategy):
        return ("step", strategy.num_steps, strategy.topk, strategy.num_verify)

    def _runner(self, strategy) -> "FusedGraphStepRunner":
        """The runner of ``strategy``'s steps: the drafter-free one for plain steps when there is one, else this."""
        return self.plain if self.plain is not None and self.drafter.tree_width(strategy) == 1 else self

    def register_graphs(self, strategies, widths, sizes) -> None:
        for strategy in strategies:
            if self._runner(strategy) is not self:
                self.plain.register_graphs([strategy], widths, sizes)
                continue
            self._add_graph(self.step_key(strategy), self._step_fn(strategy), sizes,
                            lambda B, strategy=strategy: self._pad_step(B))

    def covers(self, strategy, batch_size: int) -> bool:
        return self.graphs.pool.covers(self.step_key(strategy), batch_size)

    def graph_names(self, strategy) -> list:
        return [self.step_key(strategy)]

    def run(self, strategy, inputs: StepInputs) -> StepResult:
        if self._runner(strategy) is not self:
            return _drafter_free_step(self.plain, strategy, inputs)
        if self.graphs.padded_size(self.step_key(strategy), inputs.batch_size) is None:
            return self.fallback.run(strategy, inputs)
        graph_inputs = [inputs.block_table, inputs.context_lens, inputs.root_tokens, *inputs.graph_sampling,
                        *inputs.drafter_state]
        outputs = self.graphs.replay(self.step_key(strategy), graph_inputs, inputs.batch_size)
        emitted, num_accepted, context_lens, path_hidden, path_tokens, error, *rest = outputs
        scores = rest.pop(0) if self.target_step.logprobs else None  # the graph's outputs: accept's, then the state
        return StepResult(emitted, num_accepted, context_lens, path_hidden, path_tokens, error, rest,
                          replayed=True, width=self.drafter.tree_width(strategy), scores=scores)

    def _step_fn(self, strategy):
        draft, commit = self.drafter.fused_functions(strategy)
        if self.drafter.tree_width(strategy) == 1:
            draft = None
        target_step = self.target_step

        def step(block_table, context_lens, roots, temperature, top_k, top_p, seed, offset, *state_rows):
            if draft is None:
                tree = root_only_tree(roots)
            else:
                tokens, parents, num_nodes = draft(*state_rows)
                tokens = tokens.clone()
                tokens[:, 0] = roots
                tree = ProposedTree(tokens, parents, num_nodes)
            logits, hidden = target_step.verify_forward(*tree, block_table, context_lens)
            sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, offset=offset)
            outputs = list(target_step.accept(tree, logits, hidden, block_table, context_lens, sampling))
            if state_rows:
                emitted, num_accepted, path_hidden = outputs[0], outputs[1], outputs[3]
                outputs += list(commit(list(state_rows), emitted, num_accepted, path_hidden))
            return outputs

        return step

    def _pad_step(self, p: int):
        """Example inputs of a fused step: sink rows (the verify padding), neutral sampling (greedy), drafter sink
        rows."""
        dev = self.target_step.device
        _, _, _, block_table, context_lens = self.target_step.pad_verify_inputs(1, p)
        return [block_table, context_lens, torch.zeros(p, dtype=torch.int64, device=dev),
                torch.zeros(p, dtype=torch.float32, device=dev), torch.zeros(p, dtype=torch.int32, device=dev),
                torch.ones(p, dtype=torch.float32, device=dev), torch.zeros(p, dtype=torch.int64, device=dev),
                torch.zeros(p, dtype=torch.int64, device=dev), *self.drafter.pad_state_rows(p)]
