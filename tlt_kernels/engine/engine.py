"""``SpeculativeEngine``: adaptive speculative decoding of a rollout batch with a long tail.

One decoding step over the ``b`` requests still running::

    s = selector.select(b)                                   # select: strategy for this batch size
    tree = drafter.propose(s, rows)                          # propose: token tree, width drafter.tree_width(s)
    logits, hidden = target.forward_tree(tree)               # verify: replayed from the GraphPool (T, padded b)
    res = verify_tree(logits, tree, seed, offset)            #   lossless acceptance, counter-based RNG
    ctx = compact_kv(cache, res.accepted_nodes)              #   accepted path -> contiguous slots
    emit res.tokens up to each budget, cut after EOS         # emit
    drafter.commit(rows, accepted path)                      # commit (EAGLE: target features of the path)
    requests that finished leave the batch                   # retire
    selector.update(s, b, emitted, step_seconds, lagging rows' accepted_per_position)   # they decide the end

The host reads a step's outcome once (finished rows, counts for the selector). With ``overlap_steps`` (the default)
it launches step t+1 before reading step t's outcome, so that read, the selector update and the next launch's
preparation run while the GPU computes; a request that finished at step t rides along in step t+1 and changes
nothing there (docs/RUNTIME.md, "Overlapped steps").

The modules: :mod:`.state` (what a rollout carries, emit/commit/retire), :mod:`.step_runner` (propose -> verify ->
accept, separate or fused graphs), :mod:`.graphs` (replay-or-eager, capture), :mod:`.capture` (features for the
rollout buffer), :mod:`.probe` (arm probing, cost table), :mod:`.spot` (the spot-training thread),
:mod:`.sampling` and :mod:`.records`. Drafters implement :class:`tlt_kernels.drafter.base.Drafter`.

Requests leave the batch when they reach their own ``max_new_tokens`` (or EOS), so the batch
shrinks over the rollout; the selector re-decides every step, which is what makes the tail fast
(small batches verify wide trees almost for free, large batches do not).

Randomness: request ``b`` uses Philox key ``seed[b]`` and counter offset ``offset[b]``, which starts
at 0 (the first token, drawn from the prefill logits) and advances by one per decoding step. With
plain decoding this is exactly :func:`tlt_kernels.models.reference_generate`'s stream, so the
engine's plain path reproduces it token for token; speculative steps match it in distribution
(verify_tree is lossless). A request's output depends only on its own seed, prompt and the
sequence of strategies it was verified with -- not on the other requests of the batch.

Spot training: finished requests' target features (last layer, before the final norm) and tokens go
to a :class:`~tlt_kernels.drafter.RolloutBuffer`; once the batch falls below
``spot_batch_fraction`` of its start (the tail, where most of the GPU idles), a
:class:`~tlt_kernels.drafter.SpotTrainer` trains a copy of the drafter on a side thread/stream until
the rollout ends, and the rollout's drafter loads each published version between steps.
"""
from __future__ import annotations

import logging
import math
import numbers
import time
import warnings
from typing import List, Optional, Sequence, Tuple, Union

import torch

from .._backend import BACKENDS
from ..drafter.base import AcceptedPath, hand_groups, start_drafter
from ..drafter.resolve import as_drafter, tree_width
from ..models.kv_cache import PagedKVCache
from ..models.llama import check_token_ids
from ..ops.verify_tree import verify_tree
from ..runtime.strategy import Strategy
from .backlog import DrafterBacklog
from .capture import FeatureCapture
from .counterfactual import CounterfactualScorer, counterfactual_scorer
from .graphs import GraphReplay
from .groups import sibling_table
from .prefill import PrefillGraphs, check_prefill_lengths, check_prefill_max_tokens
from .probe import measure_cost_table, probe_arms
from .records import GenerateOutput, ProgressBar, StepLog
from .sampling import RequestSampling
from .spot import SpotSession, highest_priority_stream, priority_stream
from .state import LaunchedStep, RolloutState, StepCounts, ints_on_device
from .step_runner import FusedGraphStepRunner, SeparateGraphStepRunner, StepInputs, StepResult, TargetStep

__all__ = ["GenerateOutput", "SpeculativeEngine", "StepLog", "tree_width"]

log = logging.getLogger("tlt_kernels.engine")

Prompts = Union[torch.Tensor, Sequence[Union[Sequence[int], torch.Tensor]]]


_BACKEND_NAMES = ("auto",) + tuple(BACKENDS)


def _int(v, low: int) -> bool:
    return not isinstance(v, bool) and isinstance(v, numbers.Integral) and v >= low


def _check_switch_interval(seconds) -> Optional[float]:
    if seconds is None:
        return None
    if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real) or not 0 < seconds < math.inf:
        raise ValueError(f"spot_switch_interval_s must be a positive number of seconds or None, got {seconds!r}")
    return float(seconds)


def _check_sizes(max_batch_size, max_seq_len, block_size, backend) -> None:
    """The engine's capacity arguments: ints (a float would reach the cache's shapes) and a known backend name."""
    if not (_int(max_batch_size, 1) and _int(max_seq_len, 2)):
        raise ValueError(f"max_batch_size must be an int >= 1 and max_seq_len an int >= 2, got {max_batch_size!r}, "
                         f"{max_seq_len!r}")
    if not _int(block_size, 1):
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r} (tokens per KV block)")
    if backend not in _BACKEND_NAMES:
        raise ValueError(f"backend={backend!r} is not one of {_BACKEND_NAMES}")


class SpeculativeEngine:
    """Adaptive speculative decoding over a paged KV cache.

    Args:
        target: :class:`~tlt_kernels.models.LlamaForCausalLM` (or anything with the same
            ``prefill`` / ``forward_tree`` / ``config`` / ``dtype`` / ``device``).
        drafter: ``None`` (plain decoding only), ``"ngram"``, an
            :class:`~tlt_kernels.drafter.NGramDrafter` (its ``min_n``/``max_n`` are used; the
            engine makes a fresh one per rollout), an :class:`~tlt_kernels.drafter.EagleDrafter`, or any
            :class:`~tlt_kernels.drafter.base.Drafter` (docs/DRAFTERS.md, "Writing your own drafter").
            :attr:`drafter` is then the drafter's weights module (the EagleDrafter) or None.
        selector: a :class:`~tlt_kernels.runtime.StrategySelector`, a fixed :class:`Strategy`, or
            ``None`` (plain decoding).
        graph_pool: a :class:`~tlt_kernels.runtime.GraphPool`; :meth:`capture_graphs` records the
            verify forward of every tree width and padded batch size into it. ``None``: eager.
        max_batch_size, max_seq_len: capacity of the paged cache (prompt + generated tokens per
            request); fixed at construction so captured graphs stay valid.
        block_size: tokens per KV block.
        spot_trainer, rollout_buffer: optional :class:`~tlt_kernels.drafter.SpotTrainer` (training
            its own copy of the drafter) and the :class:`~tlt_kernels.drafter.RolloutBuffer` it samples;
            the engine fills the buffer with finished requests and trains in the tail.
        spot_batch_fraction: the tail starts when the batch is below this fraction of its start.
        spot_switch_interval_s: the interpreter's thread switch interval (``sys.setswitchinterval``, process-wide)
            while the spot trainer's thread runs, restored after; the rollout's loop waits up to one interval for
            the interpreter's lock after each wait for the GPU (:mod:`tlt_kernels.engine.spot`). None: left alone.
        spot_overlap_steps: keep steps overlapping while a spot trainer's thread runs (``overlap_steps`` on). Off
            (the default, measured faster: docs/DRAFTERS.md), the tail runs step by step from the trainer's start, so
            the trainer's thread works while the host waits for each step; on, the host's per-step work stays hidden
            behind the GPU's, and the trainer's thread gets the interpreter during the host's waits for the step
            before. A trainer of its own process (``SpotTrainerProcess``) runs no thread here: steps keep
            overlapping.
        prioritize_rollout: with a spot trainer on CUDA, ``generate`` runs on a stream of the device's highest
            priority (ordered after the caller's stream and before its later work), so the trainer's kernels, on a
            stream of the lowest, yield to the tail's small ones at every kernel boundary. False: the caller's stream.
        backend: tree-attention backend of the verify forward (``"auto"``, ``"torch"``, ``"triton"``, ``"cuda"``).
        fuse_step: capture the whole decoding step (draft, verify forward, accept, KV compaction, drafter
            extension) as one graph per (strategy, padded batch size) instead of one graph per part:
            one launch per step instead of three. Plain decoding, the n-gram and EAGLE drafters and their union
            (a custom drafter opts in with ``fused_step_error = None``); the n-gram histories then live in buffers
            allocated here for ``max_batch_size`` requests, and ``generate(groups=)`` takes groups of at most the
            drafter's ``max_group_size`` (``NGramRolloutDrafter``, default 16).
        progress: draw a progress bar on stderr. Per-step records go to the ``tlt_kernels.engine``
            logger (DEBUG) and to :attr:`GenerateOutput.steps`.
        overlap_steps: launch each step before reading the previous step's outcome, so the host's per-step work
            (reading the outcome, the selector, retiring requests, preparing the next launch) runs while the GPU
            computes instead of between steps. A request that finishes then rides along in one more step, which
            changes nothing of it (its tokens, context, features and Philox counter stay); the selector learns
            from each step one step later. Off with ``trace=``, and from the step a spot trainer's thread starts
            in the tail unless ``spot_overlap_steps`` (both work between steps).
        step_kernel: do a step's bookkeeping (emit, commit, the host transfer's staging) in one Triton launch
            instead of about 45 small torch ops (``RolloutState.finish_step``; docs/RUNTIME.md). ``None`` (default):
            on a GPU; True also runs it on the CPU under Triton's interpreter; False: the torch ops.
        logprobs: score every emitted token: :attr:`GenerateOutput.logprobs` (under the distribution it was
            sampled from) and :attr:`GenerateOutput.raw_logprobs` (``log_softmax`` of the target's logits), what an
            RL trainer's importance ratios need from the rollout. Set at construction: the step graphs capture the
            scoring (``verify_tree(return_logprobs=True, return_raw_logprobs=True)``).
        prefill_lengths: prompt-length buckets whose prefill :meth:`capture_graphs` also records, at its batch
            sizes (:mod:`tlt_kernels.engine.prefill`): a batch whose longest prompt fits a bucket replays it, padded,
            instead of the eager prefill's hundreds of launches (the target needs ``prefill_fresh``); a batch of
            mixed lengths may replay each bucket's graph on its own requests instead, when that pads fewer tokens.
            Each bucket keeps static ``[batch, bucket, H]`` hidden states per captured batch size. A drafter that
            captures its start (the EAGLE drafter) replays its own graph for the bucket. ``()`` (default): the
            eager prefill.
        prefill_max_tokens: a bucket's graph is captured only at batch sizes ``b`` with ``b * bucket`` at most this
            (its memory grows with it); a larger batch of that bucket replays in pieces of the captured sizes.
        lazy_commit_steps: with a drafter that allows it (``lazy_commit``: the n-gram and EAGLE drafters, their
            union), plain steps leave the drafter alone and join a backlog (:mod:`tlt_kernels.engine.backlog`); the
            drafter learns the backlog as one path before its next draft, or after this many plain steps. A plain
            step then costs about what plain decoding's does. 0: the drafter commits every step.
        counterfactual_graphs: with ``fuse_step`` and the n-gram drafter, :meth:`capture_graphs` also captures the
            counterfactual scorer of the engine's arms (:mod:`tlt_kernels.engine.counterfactual`), for a selector of
            the counterfactual policy set after the capture. On whenever the selector's policy is counterfactual at
            the capture; without the graphs, that policy's scoring runs eagerly.
    """

    def __init__(self, target, drafter=None, selector=None, graph_pool=None, *, max_batch_size: int = 256,
                 max_seq_len: int = 2048, block_size: int = 16, spot_trainer=None, rollout_buffer=None,
                 spot_batch_fraction: float = 0.25, backend: str = "auto", progress: bool = False, fuse_step: bool = False,
                 overlap_steps: bool = True, step_kernel: Optional[bool] = None, logprobs: bool = False,
                 lazy_commit_steps: int = 32, spot_switch_interval_s: Optional[float] = 2e-4,
                 prioritize_rollout: bool = True, prefill_lengths: Sequence[int] = (),
                 prefill_max_tokens: int = 32768, spot_overlap_steps: bool = False,
                 counterfactual_graphs: bool = False):
        _check_sizes(max_batch_size, max_seq_len, block_size, backend)
        self.target = target
        self.device = target.device
        if hasattr(target, "pack_projections"):  # q/k/v and gate/up as one GEMM each in every step (views: no copy)
            target.pack_projections()
        self.tree_drafter = as_drafter(drafter, self.device)  # the Drafter the steps drive
        self.drafter = self.tree_drafter.module
        if selector is None:
            selector = Strategy.off()
        if isinstance(selector, Strategy):
            self.selector, self.static = None, selector
            self.strategies = [selector]
        else:
            self.selector, self.static = selector, None
            self.strategies = list(selector.strategies)
        self.widths = sorted({1} | {self.tree_drafter.tree_width(s) for s in self.strategies})
        self.max_width = self.widths[-1]
        self.max_batch_size, self.max_seq_len, self.block_size = max_batch_size, max_seq_len, block_size
        self.backend, self.progress, self.fuse_step = backend, progress, fuse_step
        self.spot_trainer, self.rollout_buffer = spot_trainer, rollout_buffer
        self.spot_batch_fraction = spot_batch_fraction
        self.spot_switch_interval_s = _check_switch_interval(spot_switch_interval_s)
        self.prioritize_rollout = bool(prioritize_rollout)
        self._priority_stream = None  # made at the first rollout that needs it (no CUDA call at construction)
        self.overlap_steps = bool(overlap_steps)
        self.spot_overlap_steps = bool(spot_overlap_steps)
        self.step_kernel = None if step_kernel is None else bool(step_kernel)
        # One compiled step kernel for every batch size and strategy (a new variant mid-rollout is a JIT compile).
        self.step_blocks = (1 << (self.max_batch_size - 1).bit_length(), 1 << (self.max_width - 1).bit_length())
        self.rollout_step = 0
        # Every request row covers prompt + generated + the widest tree (tree nodes sit past the context), and one
        # more tree: an overlapped step may run a request once after its last step (its slots are scratch).
        self.slots_per_request = max_seq_len + 2 * self.max_width + 1
        self.tree_drafter.bind(strategies=self.strategies, fuse_step=fuse_step, device=self.device,
                               max_batch_size=max_batch_size, slots_per_request=self.slots_per_request,
                               block_size=block_size)
        blocks = -(-self.slots_per_request // block_size)
        # +1 row: a sink request that padded graph rows write into, so they never touch a live request.
        self.cache = PagedKVCache(target.config, (max_batch_size + 1) * blocks, block_size, device=self.device, dtype=target.dtype)
        self.sink_table, _ = self.cache.allocate(1, self.slots_per_request)
        self.graph_pool = graph_pool
        self.graphs = GraphReplay(graph_pool)
        self.prefill_graphs = PrefillGraphs(target, self.cache, self.sink_table, self.graphs,
                                            check_prefill_lengths(prefill_lengths, max_seq_len),
                                            check_prefill_max_tokens(prefill_max_tokens))
        # The counterfactual policy's counts (None for any other policy; resolved again at each generate, for a
        # selector set since); they read the drafter's histories, so plain steps commit at once: an engine built for
        # the policy keeps no backlog, and one that has a backlog defers nothing while the policy runs.
        self.counterfactual = counterfactual_scorer(self.selector, self.tree_drafter)
        self.counterfactual_graphs = bool(counterfactual_graphs)
        self._captured_scorer = None  # the scorer whose graphs capture_graphs captured (fused n-gram engines)
        self.backlog = self._backlog(lazy_commit_steps)
        self.logprobs = bool(logprobs)
        target_step = TargetStep(target, self.cache, self.sink_table, backend, self.logprobs)
        if fuse_step:  # plain steps of a lazy drafter replay a graph without its commit
            self.step_runner = FusedGraphStepRunner(target_step, self.tree_drafter, self.graphs,
                                                    plain_steps_without_drafter=self.backlog is not None)
        else:
            self.step_runner = SeparateGraphStepRunner(target_step, self.tree_drafter, self.graphs)

    def _backlog(self, lazy_commit_steps) -> Optional[DrafterBacklog]:
        """The stash of deferred plain steps (None: the drafter commits every step)."""
        if not _int(lazy_commit_steps, 0):
            raise ValueError(f"lazy_commit_steps must be an int >= 0, got {lazy_commit_steps!r}")
        if (lazy_commit_steps == 0 or not getattr(self.tree_drafter, "lazy_commit", False)
                or self.counterfactual is not None):
            return None
        return DrafterBacklog(self.max_batch_size, lazy_commit_steps, self.target.config.hidden_size,
                              self.target.dtype, self.device, getattr(self.tree_drafter, "commit_reads_hidden", True))

    @property
    def graph_error(self) -> Optional[str]:
        """Why the graph capture failed (the engine then runs eagerly); None when it did not."""
        return self.graphs.error

    @property
    def graph_retry_error(self) -> Optional[str]:
        """A capture failure that the retry recovered from (None: none)."""
        return self.graphs.retry_error

    # -- CUDA graphs --------------------------------------------------------------------------------
    def capture_graphs(self, batch_sizes: Optional[Sequence[int]] = None) -> dict:
        """Capture the verify forward of every tree width for ``batch_sizes`` (default: powers of two up
        to ``max_batch_size``, and ``max_batch_size``) into the graph pool (with ``fuse_step``: the whole step of
        every strategy; with a drafter that has graphs: its draft and extension too), and on a GPU times the
        prefill graphs (:meth:`~tlt_kernels.engine.prefill.PrefillGraphs.measure`: a mixed batch's plan weighs them).

        Failures are not fatal: a failed capture is retried once; if that fails too, the engine falls back to
        eager verification and records why in :attr:`graph_error`. Returns the pool's ``stats()`` (or
        ``{"error": ...}``).
        """
        if self.graph_pool is None:
            raise ValueError("capture_graphs needs a graph_pool (SpeculativeEngine(..., graph_pool=GraphPool()))")
        if batch_sizes is None:
            batch_sizes = sorted({1 << i for i in range(int(math.log2(self.max_batch_size)) + 1)} | {self.max_batch_size})
        sizes = [b for b in batch_sizes if 1 <= b <= self.max_batch_size]
        if not self.graphs.capture(lambda: self._register_graphs(sizes)):
            return {"error": self.graph_error}
        if torch.device(self.device).type == "cuda":  # what a mixed batch's prefill plan weighs (PrefillGraphs.plan)
            self.prefill_graphs.measure()
        if self.selector is not None and self.selector.available is None:
            self.selector.available = self.covers
            self.selector.invalidate_available()
        return self.graph_pool.stats()

    def _register_graphs(self, sizes) -> None:
        """Every strategy's step graphs, the drafter's commit graphs for the backlog's path widths, and the prefill
        buckets' graphs (the target's and the drafter's start)."""
        self.step_runner.register_graphs(self.strategies, self.widths, sizes)
        if self.backlog is not None:
            self.step_runner.register_drafter_graphs([], self.backlog.widths, sizes)
        self._register_scorer_graphs(sizes)
        self.prefill_graphs.register(sizes, self.tree_drafter)

    def _register_scorer_graphs(self, sizes) -> None:
        """The counterfactual scorer of the engine's arms, where the engine scores them (a counterfactual selector,
        or ``counterfactual_graphs``) and its n-gram histories sit at fixed addresses (fused steps)."""
        sink = getattr(self.tree_drafter, "sink_row", None)
        self.counterfactual = counterfactual_scorer(self.selector, self.tree_drafter)  # the selector may be new
        wanted = self.counterfactual_graphs or self.counterfactual is not None
        if not (wanted and self.fuse_step and sink is not None and hasattr(self.tree_drafter, "propose_earlier")):
            return
        scorer = CounterfactualScorer(self.tree_drafter, self.strategies)
        if scorer.arms and not self.graphs.registered(scorer.GRAPH):
            name, fn, example_inputs = scorer.graph_spec(sink, self.device)
            self.graph_pool.add(name, fn, sizes, example_inputs)
            self._captured_scorer = scorer
            if self.counterfactual is not None:  # the selector's policy scores now: with the captured graphs
                self.counterfactual = scorer

    def covers(self, strategy: Strategy, batch_size: int) -> bool:
        """Whether a captured graph verifies ``strategy`` at ``batch_size`` (``StrategySelector(available=)``)."""
        if not self.graphs.captured:
            return True
        return self.step_runner.covers(strategy, batch_size)

    def measure_cost_table(self, batch_sizes: Optional[Sequence[int]] = None, repeats: int = 5):
        """Step time of every strategy at every captured batch size, measured now by replaying the step's graphs
        on padding rows (median of ``repeats``, wall clock between device synchronizations, so launch costs are
        in): the start-up table of the ``"cost"`` selector policy, e.g.
        ``StrategySelector(arms, cost_table=engine.measure_cost_table(), available=engine.covers)``.
        Padding rows attend to an empty context, so long-context attention is not in the figures; the policy's
        online per-(bucket, arm) correction absorbs the difference. Returns a
        :class:`~tlt_kernels.runtime.policies.CostTable`."""
        if not self.graphs.captured:
            raise ValueError("measure_cost_table needs captured graphs: call capture_graphs() first")
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {repeats}")
        return measure_cost_table(self.graph_pool, self.step_runner, self.strategies, self.device, batch_sizes, repeats)

    # -- generation ---------------------------------------------------------------------------------
    def _check_request_args(self, tokens_in, lens, max_new_tokens, eos_token_id) -> Tuple[List[int], List[int]]:
        """generate's argument checks (once per rollout, before the prefill): returns each request's
        ``max_new_tokens`` and prompt length as host lists (the rollout's start then reads nothing)."""
        B, L = tokens_in.shape
        if B > self.max_batch_size:
            raise ValueError(f"{B} prompts exceed max_batch_size={self.max_batch_size}")
        if B == 0 or L == 0:  # (the prefill runs unchecked: _eager_prefill)
            raise ValueError(f"prompts must hold at least one request, each with at least one token, got a "
                             f"[{B}, {L}] batch")
        V = self.target.config.vocab_size
        check_token_ids("prompts", tokens_in, V, lens)  # the embedding would raise a bare IndexError
        if eos_token_id is not None and (isinstance(eos_token_id, bool) or not isinstance(eos_token_id, numbers.Integral)
                                         or not 0 <= eos_token_id < V):
            raise ValueError(f"eos_token_id must be an int in [0, vocab_size={V}) or None, got {eos_token_id!r}")
        max_new = torch.as_tensor(max_new_tokens)
        if max_new.is_floating_point() or max_new.dtype == torch.bool:  # int64 would truncate 2.5 to 2
            raise ValueError(f"max_new_tokens must be an int >= 1 or {B} of them, got {max_new_tokens!r}")
        max_new = max_new.to(torch.int64).flatten()
        if max_new.numel() == 1:
            max_new = max_new.expand(B).clone()
        if max_new.numel() != B or bool((max_new < 1).any()):
            raise ValueError(f"max_new_tokens must be an int >= 1 or {B} of them, got {max_new_tokens!r}")
        lens_host = lens.cpu()
        need = int((lens_host + max_new.cpu()).max())
        if need > self.max_seq_len:
            raise ValueError(f"prompt + max_new_tokens reaches {need} tokens, above max_seq_len={self.max_seq_len}")
        return max_new.tolist(), lens_host.tolist()

    @torch.no_grad()
    def generate(self, prompts: Prompts, max_new_tokens, temperature=0.0, top_k=None, top_p=None, seed=0,
                 eos_token_id: Optional[int] = None, trace: Optional[list] = None,
                 groups: Optional[Sequence] = None) -> GenerateOutput:
        """Generate a rollout batch.

        Args:
            prompts: int64 ``[B, L]`` or a list of ``B`` 1-D token sequences (lengths >= 1).
            max_new_tokens: int, or one int per request (requests leave the batch when done).
            temperature: float or per-request list; 0 = greedy. top_k / top_p: None (off), a scalar or a
                per-request list (see :func:`tlt_kernels.verify_tree`).
            seed: int, list or int64 ``[B]``: per-request Philox seeds (outputs are reproducible per request).
            eos_token_id: a request also stops after emitting it.
            trace: a list to append one record per step to, in :func:`tlt_kernels.runtime.simulate.load_trace`'s
                format: before each step every strategy is *probed* on the live batch (drafted, verified and
                accepted without committing; the real step then overwrites the probed KV slots) and timed, so the
                selector can be replayed against the trace's hindsight oracle. Slow (one probe per arm per step).
            groups: one hashable group id per request (GRPO: the prompt's id for each of its ``G`` responses), or
                None. The n-gram drafter then drafts from the histories of the request's whole group, finished
                requests included (:func:`tlt_kernels.ngram_propose`'s ``siblings=``); other drafters ignore it.
        Returns:
            :class:`GenerateOutput`.
        """
        from ..models.reference_decode import _as_padded

        with priority_stream(self.device, self._rollout_stream()):
            prompt_tokens, prompt_lens = _as_padded(prompts, self.device)
            max_new, lens_host = self._check_request_args(prompt_tokens, prompt_lens, max_new_tokens, eos_token_id)
            sampling = RequestSampling(prompt_tokens.shape[0], self.device, temperature, top_k, top_p, seed)
            siblings = sibling_table(groups, prompt_tokens.shape[0], self.device)
            return self._rollout(prompt_tokens, prompt_lens, lens_host, max_new, sampling, siblings, eos_token_id,
                                 trace)

    def _rollout(self, prompt_tokens, prompt_lens, lens_host, max_new, sampling, siblings, eos_token_id,
                 trace) -> GenerateOutput:
        """:meth:`generate` after its checks: start -> ``while active: step`` -> finish, and the output
        (``lens_host``: ``prompt_lens`` as a host list)."""
        block_table, _ = self.cache.allocate(prompt_tokens.shape[0], self.slots_per_request)
        if self.selector is not None:  # the longest request's budget: the loss budget's horizon
            self.selector.new_rollout(max_tokens=max(max_new))
        # The selector may have been replaced since the last rollout: its policy decides whether steps score arms.
        self.counterfactual = counterfactual_scorer(self.selector, self.tree_drafter, self._captured_scorer)
        rollout = None
        try:
            rollout = self._start(prompt_tokens, prompt_lens, lens_host, max_new, block_table, sampling, eos_token_id)
            if siblings is not None:
                hand_groups(self.tree_drafter, siblings)
            rollout.trace = trace
            rollout.overlap = self.overlap_steps and trace is None  # and off once a spot trainer starts
            rollout.step_kernel = self.step_kernel
            rollout.step_blocks = self.step_blocks
            while rollout.active_rows:
                self._step(rollout)
            self._finish_pending(rollout)
            wall_s = self._finish(rollout)
        finally:
            if rollout is not None:  # after an error too: the trainer's thread and the switch interval
                rollout.spot.stop()
            self.cache.free(block_table)
            if self.backlog is not None:
                self.backlog.clear()
            self.tree_drafter.finish()
        self.rollout_step += 1
        errors = sorted(rollout.errors)
        if errors:
            warnings.warn(f"SpeculativeEngine.generate: the target's logits held NaN/+inf (or only -inf) for requests "
                          f"{errors}; they stopped at that step (GenerateOutput.errors)", RuntimeWarning, stacklevel=3)
        return self._output(rollout, wall_s, errors)

    def _rollout_stream(self):
        """The stream ``generate`` runs on: with a spot trainer on CUDA (and ``prioritize_rollout``), one of the
        device's highest priority, so the trainer's kernels yield to the rollout's; else None (the caller's)."""
        if not (self.prioritize_rollout and self.spot_trainer is not None and self.device.type == "cuda"):
            return None
        if self._priority_stream is None:
            self._priority_stream = highest_priority_stream(self.device)
        return self._priority_stream

    @staticmethod
    def _output(rollout: RolloutState, wall_s: float, errors: List[int]) -> GenerateOutput:
        """The result: each request's tokens and their count (one read), and log-probs when scored (a second)."""
        tokens = torch.cat([rollout.generated.unsqueeze(1), rollout.output_tokens], 1).cpu()
        lengths = tokens[:, 0]
        per_request = lambda values: [values[b, : int(lengths[b])].tolist() for b in range(lengths.shape[0])]  # noqa: E731
        logprobs = raw_logprobs = None
        if rollout.output_scores is not None:
            scores = rollout.output_scores.cpu()
            logprobs, raw_logprobs = per_request(scores[:, :, 0]), per_request(scores[:, :, 1])
        return GenerateOutput(per_request(tokens[:, 1:]), lengths.clone(), rollout.finish_s, rollout.steps,
                              wall_s, rollout.prefill_s, rollout.spot.result or None, errors, logprobs, raw_logprobs)

    def _prefill(self, prompt_tokens, prompt_lens, lens_host, block_table, sampling):
        """The prompts' KV and the first token of each request, drawn from the prompt's last logits (offset 0, node
        0): ``(first_tokens int64 [B], failed bool [B], prefill_hidden [B, L, H], offsets int64 [B], first_scores
        float32 [B, 2] (sampling, raw log-probs) or None)``."""
        B, dev = prompt_tokens.shape[0], self.device
        # generate checked the prompts; their lengths on the host let a mixed batch replay each bucket's graph
        replayed = self.prefill_graphs.run(prompt_tokens, prompt_lens, block_table, lens_host)
        logits, hidden = replayed if replayed is not None else self._eager_prefill(prompt_tokens, prompt_lens,
                                                                                    block_table)
        offsets = torch.zeros(B, dtype=torch.int64, device=dev)
        # Unvalidated: the one-node trees are the engine's and RequestSampling checked the parameters; a check
        # would read the device and stall the host until the prefill's forward ends.
        first = verify_tree(logits.unsqueeze(1), torch.zeros(B, 1, dtype=torch.int64, device=dev),
                            torch.full((B, 1), -1, dtype=torch.int32, device=dev),
                            torch.ones(B, dtype=torch.int32, device=dev), max_depth=0, validate=False,
                            return_logprobs=self.logprobs, return_raw_logprobs=self.logprobs,
                            **sampling.verify_kwargs(torch.arange(B, device=dev), offsets))
        # failed: requests whose logits held NaN/+inf (verify_tree's error flag): they emit nothing more.
        failed = first.error.bool()
        first_tokens = first.tokens[:, 0].to(torch.int64).clamp(min=0)  # a failed request's -1 never reaches a drafter
        offsets += 1
        scores = torch.stack([first.logprobs[:, 0], first.raw_logprobs[:, 0]], 1) if self.logprobs else None
        return first_tokens, failed, hidden, offsets, scores

    def _eager_prefill(self, prompt_tokens, prompt_lens, block_table):
        """The target's prefill without its checks where it has one (``prefill_fresh``: generate checked the token
        ids and lengths, and the engine built the cache and the table), so that nothing reads the device."""
        fresh = getattr(self.target, "prefill_fresh", None)
        if fresh is not None:  # tables of slots_per_request > L, the request's own: padding writes its own tail
            return fresh(prompt_tokens, prompt_lens, self.cache, block_table, padding_to_tail=True)
        B = prompt_tokens.shape[0]
        return self.target.prefill(prompt_tokens, prompt_lens.to(torch.int32), self.cache, block_table,
                                   torch.zeros(B, dtype=torch.int32, device=self.device))

    def _start(self, prompt_tokens, prompt_lens, lens_host, max_new, block_table, sampling,
               eos_token_id) -> RolloutState:
        """Prefill, the drafter's start, and the rollout's state; reads nothing from the device, so the host prepares
        the first step while the GPU still runs the prefill. Which requests finished at their first token (EOS, or
        logits the prefill's verify flagged) the host learns with the first step's outcome
        (:meth:`RolloutState.settle_start`); until then they ride along as finished rows."""
        start_time = time.perf_counter()
        B, dev = prompt_tokens.shape[0], self.device
        first_tokens, failed, hidden, offsets, first_scores = self._prefill(prompt_tokens, prompt_lens, lens_host,
                                                                            block_table, sampling)
        output_tokens = torch.full((B, max(max_new) + self.max_width + 1), -1, dtype=torch.int64, device=dev)
        output_tokens[:, 0] = first_tokens
        output_scores = None
        if first_scores is not None:  # the same columns as output_tokens
            output_scores = torch.zeros((*output_tokens.shape, 2), dtype=torch.float32, device=dev)
            output_scores[:, 0] = first_scores
        generated = (~failed).to(torch.int64)
        max_new_dev = ints_on_device(max_new, dev)
        done = (generated >= max_new_dev) | failed
        if eos_token_id is not None:
            done |= first_tokens == eos_token_id
        bucket = self.prefill_graphs.replayed_bucket(B, prompt_tokens.shape[1])  # the drafter's start graph's too
        start_drafter(self.tree_drafter, prompt_tokens, prompt_lens, first_tokens, hidden, self.graphs, bucket)
        features = None
        if self.rollout_buffer is not None:  # last column: write sink for masked scatters
            features = FeatureCapture(prompt_tokens, hidden, self.max_seq_len + self.max_width + 2)
        prefill_s = time.perf_counter() - start_time
        prefill_end = None
        if torch.device(dev).type == "cuda":  # the first step's time starts at the prefill's end (_step_seconds)
            prefill_end = torch.cuda.Event(enable_timing=True)
            prefill_end.record()
        return RolloutState(
            block_table=block_table, context_lens=prompt_lens.to(torch.int32).clone(), offsets=offsets,
            root_tokens=first_tokens.clone(), output_tokens=output_tokens, generated=generated,
            max_new_tokens=max_new_dev, active_rows=[b for b in range(B) if max_new[b] > 1],  # one token: done
            context_lens_host=list(lens_host), done=done, start_time=start_time, prefill_s=prefill_s,
            start_batch_size=B, finish_s=[0.0] * B, errors=[], output_scores=output_scores, sampling=sampling,
            eos_token_id=eos_token_id, features=features,
            spot=SpotSession(self.spot_trainer, self.spot_batch_fraction, B, self.spot_switch_interval_s),
            progress=ProgressBar(sum(max_new), self.progress), last_end=prefill_end,
            start_outcome=RolloutState.stage_start(done, failed))

    def _step(self, rollout: RolloutState) -> None:
        """One turn of the loop: launch a step, then read the outcome of the step before it (overlapped steps: the
        GPU runs this step while the host reads, records and retires the last one); or read this one at once."""
        launched = self._launch(rollout)
        if rollout.pending is not None:
            self._finish_step(rollout, rollout.pending)
        rollout.pending = launched
        if not rollout.overlap:
            self._finish_pending(rollout)

    def _finish_pending(self, rollout: RolloutState) -> None:
        if rollout.pending is not None:
            pending, rollout.pending = rollout.pending, None
            self._finish_step(rollout, pending)

    def _launch(self, rollout: RolloutState) -> LaunchedStep:
        """select -> propose -> verify -> emit (budget, EOS) -> commit, all queued on the device; the outcome's
        transfer to the host is started, not waited for."""
        started = time.perf_counter()
        if rollout.trace is not None:  # probes count the rows they run: not those that ended at their first token
            rollout.settle_start()
        batch_size, rows = rollout.batch_size, rollout.active_on_device()
        strategy = self.static if self.selector is None else self.selector.select(batch_size)
        if self.spot_trainer is not None:
            self.tree_drafter.load_published(self.spot_trainer.holder)
        # A plain step defers the drafter's commit (trace probes and the counterfactual scorer read the live
        # histories: never then).
        deferred = (self.backlog is not None and rollout.trace is None and self.counterfactual is None
                    and self.tree_drafter.tree_width(strategy) == 1)
        if self.backlog is not None and self.backlog.size and (self.backlog.full or not deferred):
            self._catch_up(rollout)
        inputs = StepInputs(rows, rollout.active_block_table(), rollout.context_lens[rows], rollout.root_tokens[rows],
                            [] if deferred else self.tree_drafter.state_rows(rows), rollout.sampling,
                            rollout.offsets, max_context_len=rollout.max_context_len())
        if rollout.trace is not None:
            rollout.trace.append(probe_arms(self.step_runner, self.strategies, self.covers, inputs, self.device,
                                            lagging=rollout.lagging(rows)))
        scored = None  # every drafting arm's counts, scored on the histories before this step (counterfactual policy)
        if self.counterfactual is not None:
            scored = self.counterfactual.stage(rows, rollout.lagging(rows), rollout.generated[rows], self.graphs)
        result = self.step_runner.run(strategy, inputs)
        num_accepted = result.num_accepted.to(torch.int64)
        depth = strategy.num_steps if self.selector is not None else 0
        # emit, commit of the rollout's state, staging of the outcome (one Triton launch with step_kernel).
        start = rollout.generated[rows] if result.scores is not None else None  # a copy: emit advances generated
        emission, staged = rollout.finish_step(rows, result.emitted, num_accepted, result.error, result.context_lens,
                                               rollout.eos_token_id, depth, list(rollout.active_rows), extra=scored)
        if start is not None:
            rollout.record_scores(rows, start, emission.counts, result.scores)
        self._commit(rollout, inputs, result, num_accepted, emission, deferred)
        return LaunchedStep(strategy, result.width, result.replayed, staged, started)

    def _catch_up(self, rollout: RolloutState) -> None:
        """The drafter learns the deferred plain steps, one path per request (before it drafts, or when the backlog
        is full); device work only."""
        rows, path = self.backlog.take(rollout.output_tokens, rollout.generated)
        self.tree_drafter.commit(rows, self.tree_drafter.state_rows(rows), path, self.graphs)

    def _finish_step(self, rollout: RolloutState, step: LaunchedStep) -> None:
        """Read a launched step's outcome (the step's one device-to-host read), then record and retire."""
        rollout.settle_start()  # the start's outcome: queued before this step's, so already on the host
        forecast = getattr(self.selector, "forecast", None) is not None  # per-row counts only where one learns them
        counts = rollout.read_counts(step.staged, per_row=forecast)
        rollout.tokens_so_far = counts.generated
        elapsed_s = self._record(rollout, step, counts)
        if any(counts.finished):
            self._retire(rollout, step.staged.rows, counts, elapsed_s)
        rollout.spot.maybe_start(rollout.batch_size)
        if rollout.spot.threaded and not self.spot_overlap_steps:  # the trainer's thread works between steps now
            rollout.overlap = False  # (the step in flight is read next)

    def _commit(self, rollout: RolloutState, inputs: StepInputs, result: StepResult, num_accepted, emission,
                deferred: bool) -> None:
        """The accepted path becomes the drafter's context (or, ``deferred``, joins the backlog) and the captured
        features (the rollout's state was committed by :meth:`RolloutState.finish_step`, which reads nothing these
        change). Rows that had finished or failed now (``emission.keep`` bool ``[b]``) keep their state (an
        overlapped step may run them once more: a failed row's -1 token must not become its root); their drafter
        rows may take the path (never read again)."""
        if deferred:
            self.backlog.stash(inputs.rows, result.path_hidden[:, 0], rollout.generated, emission.counts)
        else:
            path = AcceptedPath(result.emitted, num_accepted, result.path_hidden)
            self.tree_drafter.commit(inputs.rows, inputs.drafter_state, path, self.graphs,
                                     new_state=result.drafter_state)
        if rollout.features is not None:
            rollout.features.record(inputs.rows, inputs.context_lens, num_accepted.masked_fill(emission.keep, -1),
                                    result.path_hidden, result.path_tokens)

    def _record(self, rollout: RolloutState, step: LaunchedStep, counts: StepCounts) -> float:
        """The selector's update, the step log and the progress bar; returns the seconds since the rollout started.
        A step's time is :meth:`_step_seconds`'."""
        batch_size = counts.was_done.count(False)  # rows that had finished before ride along and count for nothing
        now = time.perf_counter()
        step_s = self._step_seconds(rollout, step, now)
        elapsed_s = now - rollout.start_time
        if batch_size == 0:  # an overlapped step after the last request finished: no step of the rollout
            return elapsed_s
        if self.selector is not None:
            # The acceptance the selector learns is the lagging rows': the rollout ends when they finish.
            lagging = counts.lagging_rows or None
            self.selector.update(step.strategy, batch_size, counts.tried, step_s,
                                 counts.lagging_accepted_per_depth if lagging else counts.accepted_per_depth,
                                 accepted_rows=lagging, batch_progress=counts.progress,
                                 **self._running_rows(step, counts))
            if counts.extra is not None:  # the arms the step did not run, scored on the histories
                for arm, accepted, scored_rows in self.counterfactual.unpack(counts.extra):
                    if arm != step.strategy:
                        self.selector.observe_counterfactual(arm, batch_size, accepted, accepted_rows=scored_rows)
        record = StepLog(len(rollout.steps), batch_size, str(step.strategy), step.width, counts.emitted,
                         counts.emitted / batch_size, step_s, elapsed_s, step.replayed)
        rollout.steps.append(record)
        log.debug("step %d batch %d %s T=%d emitted %d acc %.2f %.0f tok/s", record.step, batch_size, step.strategy,
                  step.width, counts.emitted, record.accepted_length, record.tokens_per_s)
        rollout.progress.update(counts.generated, record)
        return elapsed_s

    @staticmethod
    def _running_rows(step: LaunchedStep, counts: StepCounts) -> dict:
        """The selector's forecast's arguments: the step's rows still running after it and their accepted drafts
        (none when the counts were read without them: a selector without a forecast is not given them)."""
        if counts.row_tokens is None:
            return {}
        still = [i for i, (finished, done) in enumerate(zip(counts.finished, counts.was_done)) if not (finished or done)]
        rows, drafted = step.staged.rows, step.strategy.num_steps > 0
        return {"running_rows": [rows[i] for i in still],
                "rows_accepted": [counts.row_tokens[i] - 1 for i in still] if drafted else None}

    @staticmethod
    def _step_seconds(rollout: RolloutState, step: LaunchedStep, now: float) -> float:
        """A step's time. On the GPU's clock (CUDA): from the end of the step before it (or of the prefill) to its own
        end, so a gap the host's preparation of this step left on the GPU is this step's. Read on the host's clock
        instead, overlapped steps would charge a step with the next one's preparation (a plain step followed by a
        drafting one measured like the drafting step: docs/RUNTIME.md, "Step times"). On the CPU: from the step's
        launch, or the previous read if later, to its read."""
        end, previous = step.staged.ready, rollout.last_end
        host_s = now - max(step.started, rollout.last_read_s)
        rollout.last_read_s, rollout.last_end = now, end
        if end is None or previous is None:
            return host_s
        return previous.elapsed_time(end) / 1e3  # both recorded and passed: no wait

    def _retire(self, rollout: RolloutState, rows: List[int], counts: StepCounts, elapsed_s: float) -> None:
        """Finished requests leave the batch; their features go to the buffer (after the spot trainer, if it runs)."""
        clean = rollout.retire(rows, counts, elapsed_s)
        if rollout.features is not None:
            if rollout.spot.running:
                rollout.deferred += clean
            else:
                self._add_to_buffer(rollout, clean)

    def _finish(self, rollout: RolloutState) -> float:
        """Stop the spot trainer, flush the deferred features, load the last published drafter; returns wall time."""
        rollout.settle_start()  # a rollout of one-token requests runs no step
        if rollout.steps:
            rollout.progress.update(rollout.tokens_so_far, rollout.steps[-1], force=True)
        rollout.spot.stop()
        wall_s = time.perf_counter() - rollout.start_time
        if rollout.features is not None and rollout.deferred:
            self._add_to_buffer(rollout, rollout.deferred)
        if self.spot_trainer is not None:
            self.tree_drafter.load_published(self.spot_trainer.holder)
        return wall_s

    def _add_to_buffer(self, rollout: RolloutState, requests: List[int]) -> None:
        """Finished ``requests``' captured sequences go to the rollout buffer; their host context lengths are exact
        (read with the step they finished at, unchanged since)."""
        lengths = [rollout.context_lens_host[r] for r in requests]
        rollout.features.add_to_buffer(self.rollout_buffer, requests, lengths, self.rollout_step)
