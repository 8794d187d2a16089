"""The rollout's prefill as CUDA graphs, one per prompt-length bucket (``SpeculativeEngine(prefill_lengths=)``).

An eager prefill is host-bound on a small model: hundreds of launches over the layers for a few milliseconds of GPU
work (docs/MODELS.md, "A fixed cost per rollout"). A batch of fresh prompts whose longest fits a bucket is padded
to the bucket's length (pad tokens: id 0; the outputs of valid positions do not change, see
:meth:`~tlt_kernels.models.LlamaForCausalLM.prefill_fresh`) and replays that bucket's graph at the smallest captured
batch size that holds it; the rows past the batch are padding requests that write the engine's sink request. Any
other batch (a longer prompt, a batch size without a graph, graphs not captured) runs the eager prefill. A drafter
that captures its start (``prefill_graph_specs``, such as the EAGLE drafter's) has its graphs at the same buckets and
batch sizes.

One long prompt pads every other prompt of the batch to its bucket (an RL batch's prompt lengths vary several-fold).
:meth:`PrefillGraphs.plan` therefore also weighs grouped replays: each request at its own bucket, each bucket's
requests in pieces of captured batch sizes; it keeps whichever plan costs less. A replay's cost is its graph's time,
measured once after capture (:meth:`PrefillGraphs.measure`, which the engine calls on a GPU): a replay of a small
model's prefill is bound by its hundreds of kernels more than by its tokens, so a split rarely pays there
(docs/MODELS.md, "Mixed prompt lengths"). Unmeasured (on the CPU), a replay costs its padded tokens plus
``REPLAY_TOKENS``. The pieces also let a batch larger than every captured size replay.
"""
from __future__ import annotations

import functools
import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from ..drafter.base import prefill_graph_specs
from .probe import replay_seconds
from .state import ints_on_device

# An unmeasured replay's cost beyond its padded tokens (graphs not timed, e.g. on the CPU): a plan splits a batch
# only where that saves more than this per replay. Measured times replace it (PrefillGraphs.measure).
REPLAY_TOKENS = 256
# Replays timed per captured (bucket, batch size) by PrefillGraphs.measure: the median of these.
MEASURE_REPEATS = 3
# One replay of a plan: (bucket, the request rows it prefills).
Replay = Tuple[int, List[int]]


def check_prefill_max_tokens(max_tokens: int) -> int:
    """``prefill_max_tokens`` as a positive int (ValueError naming the argument)."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"prefill_max_tokens must be a positive int, got {max_tokens!r}")
    return max_tokens


def check_prefill_lengths(lengths: Sequence[int], max_seq_len: int) -> Tuple[int, ...]:
    """``prefill_lengths`` as sorted distinct ints in ``[1, max_seq_len]`` (ValueError naming the argument)."""
    values = tuple(lengths)
    if any(isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= max_seq_len for v in values):
        raise ValueError(f"prefill_lengths must be ints in [1, max_seq_len={max_seq_len}], got {list(values)}")
    return tuple(sorted(set(values)))


@functools.lru_cache(maxsize=4096)  # per rollout start: a batch's buckets and counts recur
def replay_pieces(sizes: Tuple[int, ...], piece_costs: Tuple[float, ...], count: int) -> Tuple[int, ...]:
    """The requests per replay that prefill ``count`` prompts of one bucket most cheaply, each replay at one of the
    captured batch ``sizes`` (a piece smaller than its size is padded), a replay at ``sizes[i]`` costing
    ``piece_costs[i]``: a small dynamic program over the counts; the largest piece first."""
    best = [(0.0, [])]  # best[m]: (cost, pieces) for m prompts
    for m in range(1, count + 1):
        options = ((best[max(m - s, 0)], s, c) for s, c in zip(sizes, piece_costs))
        best.append(min((cost + c, pieces + [min(s, m)]) for (cost, pieces), s, c in options))
    return tuple(sorted(best[count][1], reverse=True))


class PrefillGraphs:
    """Graph ``("prefill", L)`` per bucket ``L`` of ``lengths``: ``(tokens int64 [b, L], lengths int32 [b],
    block_table int32 [b, W]) -> (logits [b, V], hidden [b, L, H])`` of ``target.prefill_fresh`` into ``cache``."""

    def __init__(self, target, cache, sink_table: torch.Tensor, graphs, lengths: Sequence[int],
                 max_tokens: int = 32768):
        self.target, self.cache, self.sink_table, self.graphs = target, cache, sink_table, graphs
        self.lengths, self.max_tokens = tuple(lengths), max_tokens
        # seconds of one replay per captured (bucket, batch size); empty: unmeasured (plans count tokens)
        self.replay_s: Dict[Tuple[int, int], float] = {}

    def register(self, batch_sizes: Sequence[int], drafter=None) -> None:
        """Add every bucket's graph to the pool at those of ``batch_sizes`` whose ``batch x bucket`` is at most
        ``max_tokens`` (a graph's activations and static hidden states grow with it; larger batches run eagerly),
        and at the same sizes ``drafter``'s start graphs for the bucket (``prefill_graph_specs``, optional)."""
        for length in self.lengths:
            sizes = [b for b in batch_sizes if b * length <= self.max_tokens]
            if sizes:
                self.graphs.pool.add(("prefill", length), self._prefill, sizes,
                                     lambda b, length=length: self._padding_inputs(b, length))
                for name, fn, example_inputs in prefill_graph_specs(drafter, [length]):
                    self.graphs.pool.add(name, fn, sizes, example_inputs)

    def measure(self, repeats: int = MEASURE_REPEATS) -> Dict[Tuple[int, int], float]:
        """Time every captured prefill graph on its padding inputs (:func:`~.probe.replay_seconds`, as the cost
        table's step graphs: the median of ``repeats`` replays, wall clock between device synchronizations, so the
        replay's launch is in): what :meth:`plan` then weighs. Call it after the graphs are captured (the engine's
        ``capture_graphs`` does on a GPU); returns :attr:`replay_s`."""
        device, pool = self.sink_table.device, self.graphs.pool
        times = {(bucket, size): replay_seconds(device, functools.partial(pool.replay_padding, ("prefill", bucket),
                                                                          size), repeats)
                 for bucket in self.lengths for size in self.graphs.captured_sizes(("prefill", bucket))}
        self.replay_s = times
        return times

    def _prefill(self, tokens, lengths, block_table):
        # The engine's tables cover a request's slots_per_request >= any bucket, its own blocks: padding to the tail.
        return self.target.prefill_fresh(tokens, lengths, self.cache, block_table, padding_to_tail=True)

    def _padding_inputs(self, batch_size: int, length: int):
        """Padding requests: one token each, written into the sink request's first slot."""
        device = self.sink_table.device
        return (torch.zeros(batch_size, length, dtype=torch.int64, device=device),
                torch.ones(batch_size, dtype=torch.int32, device=device),
                self.sink_table.expand(batch_size, -1).contiguous())

    def bucket(self, length: int) -> Optional[int]:
        """The shortest bucket that holds a prompt of ``length`` tokens (None: longer than every bucket)."""
        return next((b for b in self.lengths if b >= length), None)

    def replayed_bucket(self, batch_size: int, length: int) -> Optional[int]:
        """The bucket whose captured graph holds ``batch_size`` prompts of up to ``length`` tokens (None: the eager
        prefill runs)."""
        bucket = self.bucket(length)
        if bucket is None or self.graphs.padded_size(("prefill", bucket), batch_size) is None:
            return None
        return bucket

    def plan(self, lens_host: Sequence[int]) -> Optional[List[Replay]]:
        """The replays that prefill prompts of ``lens_host`` tokens: the whole batch at its longest prompt's bucket,
        or the requests grouped by their own buckets, whichever costs less (:meth:`_replay_cost`); None when
        neither has graphs (the eager prefill runs)."""
        rows = list(range(len(lens_host)))
        whole = self.replayed_bucket(len(rows), max(lens_host))
        plans = [] if whole is None else [[(whole, rows)]]
        grouped = self._grouped_plan(lens_host)
        if grouped is not None and len(grouped) > 1:
            plans.append(grouped)
        return min(plans, key=self._cost) if plans else None

    def _grouped_plan(self, lens_host: Sequence[int]) -> Optional[List[Replay]]:
        """Each request at its own bucket, each bucket's requests in the pieces :func:`replay_pieces` picks. None: a
        request longer than every bucket, or a bucket without graphs."""
        groups = {}
        for row, length in enumerate(lens_host):
            groups.setdefault(self.bucket(length), []).append(row)
        if None in groups:
            return None
        replays = []
        for bucket, rows in sorted(groups.items()):
            sizes = tuple(self.graphs.captured_sizes(("prefill", bucket)))
            if not sizes:
                return None
            costs = tuple(self._replay_cost(bucket, size) for size in sizes)
            for count in replay_pieces(sizes, costs, len(rows)):
                replays.append((bucket, rows[:count]))
                rows = rows[count:]
        return replays

    def _replay_cost(self, bucket: int, size: int) -> float:
        """One replay of bucket ``bucket``'s graph at captured batch ``size``: its measured seconds, or unmeasured,
        its padded tokens plus ``REPLAY_TOKENS`` (the two units never meet: :meth:`measure` times every graph)."""
        if self.replay_s:
            return self.replay_s.get((bucket, size), math.inf)  # a graph captured after measure(): never chosen
        return size * bucket + REPLAY_TOKENS

    def _cost(self, plan: List[Replay]) -> float:
        """The plan's replays' costs (:meth:`_replay_cost`), each at the captured batch size it replays."""
        return sum(self._replay_cost(bucket, self.graphs.padded_size(("prefill", bucket), len(rows)))
                   for bucket, rows in plan)

    def run(self, tokens: torch.Tensor, lengths: torch.Tensor, block_table: torch.Tensor,
            lens_host: Optional[Sequence[int]] = None) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """``(logits [B, V], hidden [B, L, H])`` of fresh prompts ``tokens [B, L]`` from replayed graphs, or None
        when no captured graph holds the batch (the caller runs the eager prefill). ``lens_host``: the prompts'
        lengths as host ints (default: every prompt ``L`` long: one replay). Hidden rows past a request's length
        are garbage, as the eager prefill's."""
        batch_size, length = tokens.shape
        plan = self.plan([length] * batch_size if lens_host is None else lens_host)
        if plan is None:
            return None
        if len(plan) == 1:  # the whole batch, in order: no gathers
            logits, hidden = self._replay(plan[0][0], tokens, lengths, block_table, batch_size)
            return logits, hidden[:, :length].contiguous()  # the eager prefill's layout: consumers may view it
        return self._run_grouped(plan, tokens, lengths, block_table)

    def _replay(self, bucket: int, tokens, lengths, block_table, batch_size: int):
        """One replay of ``batch_size`` prompts (each at most ``bucket`` long), padded or cut to ``bucket``: views
        of the graph's static ``logits [b, V]`` and ``hidden [b, bucket, H]``."""
        length = tokens.shape[1]
        padded = F.pad(tokens, (0, bucket - length)) if bucket > length else tokens[:, :bucket]
        return self.graphs.replay(("prefill", bucket), [padded, lengths.to(torch.int32), block_table], batch_size)

    def _run_grouped(self, plan: List[Replay], tokens, lengths, block_table):
        """The plan's replays, each on its rows' prompts; their outputs copied to the batch's rows as each ends (a
        later replay of the same graph overwrites its static outputs). Hidden rows past a replay's bucket are 0."""
        index = ints_on_device([row for _, rows in plan for row in rows], tokens.device)  # one copy for all replays
        logits = hidden = None
        start = 0
        for bucket, rows in plan:
            rows_dev = index[start:start + len(rows)]
            start += len(rows)
            piece = [t.index_select(0, rows_dev) for t in (tokens, lengths, block_table)]
            piece_logits, piece_hidden = self._replay(bucket, *piece, len(rows))
            if logits is None:
                logits = piece_logits.new_empty(tokens.shape[0], piece_logits.shape[1])
                hidden = piece_hidden.new_zeros(tokens.shape[0], tokens.shape[1], piece_hidden.shape[2])
            width = min(bucket, tokens.shape[1])
            logits.index_copy_(0, rows_dev, piece_logits)
            hidden[:, :width].index_copy_(0, rows_dev, piece_hidden[:, :width])
        return logits, hidden
