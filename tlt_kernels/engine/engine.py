"""``SpeculativeEngine``: adaptive speculative decoding of a rollout batch with a long tail.

One decoding step over the ``b`` requests still running::

    s = selector.select(b)                                   # strategy for this batch size
    tree = drafter(s)                                        # n-gram or EAGLE token tree, width T(s)
    logits, hidden = target.forward_tree(tree)               # replayed from the GraphPool (T, padded b)
    res = verify_tree(logits, tree, seed, offset)            # lossless acceptance, counter-based RNG
    ctx = compact_kv(cache, res.accepted_nodes)              # accepted path -> contiguous slots
    drafter.commit(hidden[accepted], res.tokens)             # EAGLE: target features of the path
    selector.update(s, b, emitted, step_seconds, accepted_per_position)

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

import gc
import logging
import math
import numbers
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Union

import torch

from .._backend import BACKENDS
from .._validation import devices_equal
from ..models.kv_cache import PagedKVCache
from ..models.llama import check_token_ids
from ..ops.compact_kv import compact_kv
from ..ops.verify_tree import verify_tree
from ..runtime.strategy import Strategy

log = logging.getLogger("tlt_kernels.engine")

Prompts = Union[torch.Tensor, Sequence[Union[Sequence[int], torch.Tensor]]]


_BACKEND_NAMES = ("auto",) + tuple(BACKENDS)

# EagleState's fields, in the order the drafter graphs take them.
EAGLE_FIELDS = ("block_table", "context_lens", "last_hidden", "root_tokens")


def tree_width(strategy: Strategy, drafter_kind: str) -> int:
    """Nodes ``T`` of the tree verified per request under ``strategy`` (root included).

    ``"eagle"``: ``num_verify`` (EAGLE-2 selection keeps exactly that many). ``"ngram"``: a chain of
    ``min(num_steps, num_verify - 1)`` drafts for ``topk == 1``, else ``topk`` branches of
    ``(num_verify - 1) // topk`` drafts each. ``"none"`` or plain decoding: 1.
    """
    if strategy.is_off or drafter_kind == "none":
        return 1
    if drafter_kind == "eagle":
        return strategy.num_verify
    if strategy.topk <= 1:
        return 1 + min(strategy.num_steps, strategy.num_verify - 1)
    per = max(1, (strategy.num_verify - 1) // strategy.topk)
    return 1 + strategy.topk * per


def _int(v, low: int) -> bool:
    return not isinstance(v, bool) and isinstance(v, numbers.Integral) and v >= low


def _check_sizes(max_batch_size, max_seq_len, block_size, backend) -> None:
    """The engine's capacity arguments: ints (a float would reach the cache's shapes) and a known backend name."""
    if not (_int(max_batch_size, 1) and _int(max_seq_len, 2)):
        raise ValueError(f"max_batch_size must be an int >= 1 and max_seq_len an int >= 2, got {max_batch_size!r}, "
                         f"{max_seq_len!r}")
    if not _int(block_size, 1):
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r} (tokens per KV block)")
    if backend not in _BACKEND_NAMES:
        raise ValueError(f"backend={backend!r} is not one of {_BACKEND_NAMES}")


def _on_device(drafter, device: torch.device):
    """``drafter`` if its weights are on ``device`` (compared after normalization), else a ValueError naming both."""
    dd = next(drafter.parameters()).device
    if not devices_equal(dd, device):
        raise ValueError(f"the EagleDrafter is on {dd} but the target is on {device}; move it with .to()")
    return drafter


@dataclass
class StepLog:
    """One decoding step: ``batch_size`` requests, ``strategy``, ``tree_width`` nodes each,
    ``emitted`` tokens in all, ``accepted_length`` = emitted / batch_size (drafts accepted + 1),
    ``seconds`` of wall time, ``elapsed_s`` since the rollout started, ``graph`` (replayed or eager)."""

    step: int
    batch_size: int
    strategy: str
    tree_width: int
    emitted: int
    accepted_length: float
    seconds: float
    elapsed_s: float
    graph: bool

    @property
    def tokens_per_s(self) -> float:
        return self.emitted / self.seconds if self.seconds > 0 else float("inf")


@dataclass
class GenerateOutput:
    """Result of :meth:`SpeculativeEngine.generate`.

    ``tokens``: one list of generated ids per request (EOS included when hit). ``lengths``: int64
    ``[B]``. ``finish_s``: seconds from the start at which each request finished. ``steps``: the
    per-step log. ``wall_s``: rollout wall time (prefill included). ``spot``: spot-trainer stats
    (None when it did not run). ``errors``: the requests stopped because the target's logits on their path held
    NaN/+inf or only -inf (``verify_tree``'s error flag; a diverged policy): their ``tokens`` end before the step that
    failed, and they never enter the rollout buffer. ``generate`` also warns when the list is not empty.
    """

    tokens: List[List[int]]
    lengths: torch.Tensor
    finish_s: List[float]
    steps: List[StepLog]
    wall_s: float
    prefill_s: float
    spot: Optional[dict] = None
    errors: List[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.wall_s if self.wall_s > 0 else float("inf")

    def strategies_by_batch(self) -> Dict[int, Dict[str, int]]:
        """``{batch_size: {strategy: steps}}`` over the rollout."""
        out: Dict[int, Dict[str, int]] = {}
        for s in self.steps:
            d = out.setdefault(s.batch_size, {})
            d[s.strategy] = d.get(s.strategy, 0) + 1
        return out

    def mean_accepted_length(self) -> float:
        """Tokens per request-step over the whole rollout (1.0 for plain decoding)."""
        rows = sum(s.batch_size for s in self.steps)
        return sum(s.emitted for s in self.steps) / rows if rows else 0.0


class _Progress:
    """A one-line progress bar on stderr, redrawn at most every ``interval`` seconds."""

    def __init__(self, total: int, enabled: bool, interval: float = 0.25):
        self.total, self.enabled, self.interval = total, enabled, interval
        self.last = 0.0

    def update(self, done: int, rec: StepLog, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if not force and now - self.last < self.interval:
            return
        self.last = now
        frac = done / max(1, self.total)
        bar = "#" * int(frac * 24)
        sys.stderr.write(
            f"\r[{bar:<24}] {done}/{self.total} tok | batch {rec.batch_size:>4} | {rec.strategy:<10} | "
            f"acc {rec.accepted_length:4.2f} | {rec.tokens_per_s:8.0f} tok/s"
        )
        if force:
            sys.stderr.write("\n")
        sys.stderr.flush()


class SpeculativeEngine:
    """Adaptive speculative decoding over a paged KV cache.

    Args:
        target: :class:`~tlt_kernels.models.LlamaForCausalLM` (or anything with the same
            ``prefill`` / ``forward_tree`` / ``config`` / ``dtype`` / ``device``).
        drafter: ``None`` (plain decoding only), ``"ngram"``, an
            :class:`~tlt_kernels.drafter.NGramDrafter` (its ``min_n``/``max_n`` are used; the
            engine makes a fresh one per rollout), or an :class:`~tlt_kernels.drafter.EagleDrafter`.
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
        backend: tree-attention backend of the verify forward (``"auto"``, ``"torch"``, ``"triton"``, ``"cuda"``).
        fuse_step: capture the whole decoding step (draft, verify forward, accept, KV compaction, drafter
            extension) as one graph per (strategy, padded batch size) instead of one graph per part:
            one launch per step instead of three. Plain decoding and the EAGLE drafter only.
        progress: draw a progress bar on stderr. Per-step records go to the ``tlt_kernels.engine``
            logger (DEBUG) and to :attr:`GenerateOutput.steps`.
    """

    def __init__(self, target, drafter=None, selector=None, graph_pool=None, *, max_batch_size: int = 256,
                 max_seq_len: int = 2048, block_size: int = 16, spot_trainer=None, rollout_buffer=None,
                 spot_batch_fraction: float = 0.25, backend: str = "auto", progress: bool = False, fuse_step: bool = False):
        from ..drafter import EagleDrafter, NGramDrafter

        _check_sizes(max_batch_size, max_seq_len, block_size, backend)
        self.target = target
        self.device = target.device
        if drafter is None:
            self.drafter_kind, self.drafter = "none", None
            self._ngram_n = (1, 4)
        elif isinstance(drafter, str):
            if drafter != "ngram":
                raise ValueError(f"drafter must be None, 'ngram', an NGramDrafter or an EagleDrafter, got {drafter!r}")
            self.drafter_kind, self.drafter, self._ngram_n = "ngram", None, (1, 4)
        elif isinstance(drafter, NGramDrafter):
            self.drafter_kind, self.drafter, self._ngram_n = "ngram", None, (drafter.min_n, drafter.max_n)
        elif isinstance(drafter, EagleDrafter):
            self.drafter_kind, self.drafter = "eagle", _on_device(drafter, self.device)
        else:
            raise TypeError(f"drafter must be None, 'ngram', an NGramDrafter or an EagleDrafter, got {type(drafter).__name__}")
        if selector is None:
            selector = Strategy.off()
        if isinstance(selector, Strategy):
            self.selector, self.static = None, selector
            strategies = [selector]
        else:
            self.selector, self.static = selector, None
            strategies = list(selector.strategies)
        if self.drafter_kind == "none" and any(not s.is_off for s in strategies):
            raise ValueError(f"strategies {[str(s) for s in strategies if not s.is_off]} need a drafter; pass drafter='ngram' or an EagleDrafter")
        self.strategies = strategies
        self.widths = sorted({1} | {tree_width(s, self.drafter_kind) for s in strategies})
        self.max_width = self.widths[-1]
        self.max_batch_size, self.max_seq_len, self.block_size = max_batch_size, max_seq_len, block_size
        self.backend = backend
        self.progress = progress
        self.spot_trainer, self.rollout_buffer = spot_trainer, rollout_buffer
        self.spot_batch_fraction = spot_batch_fraction
        self.rollout_step = 0

        # Every request row covers prompt + generated + the widest tree (tree nodes sit past the context).
        self.slots_per_request = max_seq_len + self.max_width + 1
        blocks = -(-self.slots_per_request // block_size)
        # +1 row: a sink request that padded graph rows write into, so they never touch a live request.
        self.cache = PagedKVCache(target.config, (max_batch_size + 1) * blocks, block_size, device=self.device, dtype=target.dtype)
        self.sink_table, _ = self.cache.allocate(1, self.slots_per_request)
        if self.drafter_kind == "eagle":
            from ..drafter import DrafterKVCache

            dd = next(self.drafter.parameters()).dtype
            self.drafter_cache = DrafterKVCache(self.drafter.config, 1 + max_batch_size * blocks, block_size, device=self.device, dtype=dd)
        self.graph_pool = graph_pool
        self.graph_error: Optional[str] = None
        self.graph_retry_error: Optional[str] = None  # a capture failure that the retry recovered from
        self._captured = False
        if fuse_step and self.drafter_kind == "ngram":
            raise ValueError("fuse_step=True supports plain decoding and the EAGLE drafter (the n-gram drafter's "
                             "histories are updated outside the step); use fuse_step=False with drafter='ngram'")
        self.fuse_step = fuse_step

    # -- CUDA graphs --------------------------------------------------------------------------------
    def _verify_fn(self, tokens, parents, num_nodes, block_table, context_lens):
        return self.target.forward_tree(tokens, parents, num_nodes, self.cache, block_table, context_lens,
                                        validate=False, backend=self.backend)

    def _pad_inputs(self, T: int, p: int):
        """Padding rows of the verify graph (its example inputs): a 1-node tree at slot 0 of the sink
        request, whose K/V nobody reads."""
        dev = self.device
        tk = torch.zeros(p, T, dtype=torch.int64, device=dev)
        pa = torch.zeros(p, T, dtype=torch.int32, device=dev)
        pa[:, 0] = -1
        nn_ = torch.ones(p, dtype=torch.int32, device=dev)
        tb = self.sink_table.expand(p, -1).clone()
        cl = torch.zeros(p, dtype=torch.int32, device=dev)
        return tk, pa, nn_, tb, cl

    # EAGLE drafter graphs: inputs are the drafter state rows (block_table, context_lens, last_hidden,
    # root_tokens), plus (features, next_tokens, num_new) for extend. Padded rows point at the drafter
    # cache's write-sink block 0 with zero context and num_new = 0, so they read garbage nobody uses and
    # write only the sink.
    def _draft_key(self, s: Strategy):
        return None if tree_width(s, self.drafter_kind) == 1 else ("draft", s.num_steps, s.topk, s.num_verify)

    def _draft_fn(self, s: Strategy):
        from ..drafter.eagle import EagleState

        def fn(block_table, context_lens, last_hidden, root_tokens):
            tree = self.drafter.draft(EagleState(block_table, context_lens, last_hidden, root_tokens), self.drafter_cache,
                                      s.num_steps, s.topk, s.num_verify).tree
            return tree.draft_tokens, tree.parents.to(torch.int32), tree.num_nodes.to(torch.int32)

        return fn

    def _extend_fn(self, block_table, context_lens, last_hidden, root_tokens, features, next_tokens, num_new):
        from ..drafter.eagle import EagleState

        st = EagleState(block_table, context_lens, last_hidden, root_tokens)
        # No check (no host sync): every row holds slots_per_request slots, more than a request ever commits.
        self.drafter.extend(st, self.drafter_cache, features, next_tokens, num_new, validate=False)
        return st.context_lens, st.last_hidden, st.root_tokens

    def _pad_eagle(self, p: int, T: Optional[int] = None):
        """``p`` padding rows of drafter state (the drafter graphs' example inputs), plus extend's inputs when ``T``."""
        dev = self.device
        H = self.drafter.config.hidden_size
        dd = next(self.drafter.parameters()).dtype
        nb = -(-self.slots_per_request // self.drafter_cache.block_size)
        out = [torch.zeros(p, nb, dtype=torch.int32, device=dev), torch.zeros(p, dtype=torch.int32, device=dev),
               torch.zeros(p, H, dtype=dd, device=dev), torch.zeros(p, dtype=torch.int64, device=dev)]
        if T is not None:
            out += [torch.zeros(p, T, H, dtype=dd, device=dev), torch.zeros(p, T, dtype=torch.int64, device=dev),
                    torch.zeros(p, dtype=torch.int32, device=dev)]
        return out

    def _graph_size(self, name, b: int) -> Optional[int]:
        if not self._captured or name is None or not self.graph_pool.covers(name, b):
            return None
        return self.graph_pool.padded_size(name, b)

    def capture_graphs(self, batch_sizes: Optional[Sequence[int]] = None) -> dict:
        """Capture the verify forward of every tree width for ``batch_sizes`` (default: powers of two up
        to ``max_batch_size``, and ``max_batch_size``) into the graph pool.

        Failures are not fatal: a failed capture is retried once (:meth:`_capture_pool`); if that fails too, the
        engine falls back to eager verification and records why in :attr:`graph_error`. Returns the pool's
        ``stats()`` (or ``{"error": ...}``).
        """
        if self.graph_pool is None:
            raise ValueError("capture_graphs needs a graph_pool (SpeculativeEngine(..., graph_pool=GraphPool()))")
        if batch_sizes is None:
            batch_sizes = sorted({1 << i for i in range(int(math.log2(self.max_batch_size)) + 1)} | {self.max_batch_size})
        sizes = [b for b in batch_sizes if 1 <= b <= self.max_batch_size]
        try:
            registered = getattr(self.graph_pool, "_entries", {})
            if self.fuse_step:
                for st in self.strategies:
                    name = self._step_key(st)
                    if name not in registered:
                        self.graph_pool.add(name, self._step_fn(st), sizes, lambda B, st=st: self._pad_step(B, st))
                self._capture_pool()
                self._captured = True
                return self._after_capture()
            for T in self.widths:
                name = ("verify", T)
                if name not in registered:
                    self.graph_pool.add(name, self._verify_fn, sizes, lambda B, T=T: self._pad_inputs(T, B))
            if self.drafter_kind == "eagle":
                # The drafter's multi-step tree draft and its KV extension are dozens of small kernels each:
                # eager, they cost more than the verify forward itself. One graph per strategy (draft) and per
                # tree width (extend: the accepted path is at most T pairs), padded like the verify graphs.
                for st in self.strategies:
                    name = self._draft_key(st)
                    if name is not None and name not in registered:
                        self.graph_pool.add(name, self._draft_fn(st), sizes, self._pad_eagle)
                for T in self.widths:
                    name = ("extend", T)
                    if name not in registered:
                        self.graph_pool.add(name, self._extend_fn, sizes, lambda B, T=T: self._pad_eagle(B, T=T))
            self._capture_pool()
            self._captured = True
        except Exception as exc:  # pragma: no cover - depends on the device and backends
            self.graph_error = f"{type(exc).__name__}: {exc}"
            log.warning("CUDA graph capture failed, verifying eagerly: %s", self.graph_error)
            self._captured = False
            return {"error": self.graph_error}
        return self._after_capture()

    def _capture_pool(self) -> None:
        """``graph_pool.capture()``, retried once after a failure. Keys captured before the failure are kept (the
        pool skips them). On an H200 one static strategy's capture was invalidated while the same strategy captured
        in a later engine of the same process (bench/RESULTS.md, 2026-11-26 08:43): a one-off, such as a first
        module load inside the capture, succeeds on the second try. The first error stays in
        :attr:`graph_retry_error`."""
        try:
            self.graph_pool.capture()
        except Exception as exc:
            self.graph_retry_error = f"{type(exc).__name__}: {exc}"
            log.warning("CUDA graph capture failed, retrying once: %s", self.graph_retry_error)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            gc.collect()
            self.graph_pool.capture()

    def _after_capture(self) -> dict:
        if self.selector is not None and self.selector.available is None:
            self.selector.available = self.covers
            self.selector.invalidate_available()
        return self.graph_pool.stats()

    def covers(self, strategy: Strategy, batch_size: int) -> bool:
        """Whether a captured graph verifies ``strategy`` at ``batch_size`` (``StrategySelector(available=)``)."""
        if not self._captured:
            return True
        if self.fuse_step:
            return self.graph_pool.covers(self._step_key(strategy), batch_size)
        return self.graph_pool.covers(("verify", tree_width(strategy, self.drafter_kind)), batch_size)

    def _graph_names(self, s: Strategy) -> list:
        """The graphs one step of strategy ``s`` replays."""
        if self.fuse_step:
            return [self._step_key(s)]
        T = tree_width(s, self.drafter_kind)
        names = [("verify", T)]
        if self.drafter_kind == "eagle":
            if self._draft_key(s) is not None:
                names.insert(0, self._draft_key(s))
            names.append(("extend", T))
        return names

    def _synced_seconds(self, fn):
        """``(seconds, fn())``: wall time between device synchronizations, so queued GPU work and launch costs are in."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        out = fn()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0, out

    def measure_cost_table(self, batch_sizes: Optional[Sequence[int]] = None, repeats: int = 5):
        """Step time of every strategy at every captured batch size, measured now by replaying the step's graphs
        on padding rows (median of ``repeats``, wall clock between device synchronizations, so launch costs are
        in): the start-up table of the ``"cost"`` selector policy, e.g.
        ``StrategySelector(arms, cost_table=engine.measure_cost_table(), available=engine.covers)``.
        Padding rows attend to an empty context, so long-context attention is not in the figures; the policy's
        online per-(bucket, arm) correction absorbs the difference. Returns a
        :class:`~tlt_kernels.runtime.policies.CostTable`."""
        from ..runtime.policies import CostTable

        if not self._captured:
            raise ValueError("measure_cost_table needs captured graphs: call capture_graphs() first")
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {repeats}")
        table = {}
        for s in self.strategies:
            names = self._graph_names(s)
            sizes = batch_sizes or self.graph_pool.captured_sizes(names[0])
            pts = []
            for b in sizes:
                if not all(self.graph_pool.covers(n, b) for n in names):
                    continue

                def replay(names=names, b=b):
                    for n in names:
                        self.graph_pool.replay_padding(n, b)

                times = [self._synced_seconds(replay)[0] for _ in range(repeats + 1)]
                times = sorted(times[1:])  # the first replay warms up
                pts.append((b, max(times[len(times) // 2], 1e-9)))
            if pts:
                table[s] = pts
        if not table:
            raise ValueError("no strategy has a captured graph at the requested batch sizes")
        return CostTable(table)

    def _probe_arms(self, act, roots, ngram, eagle_rows, table, ctx, samp, step_samp) -> dict:
        """One trace record: every strategy drafted, verified and accepted on the live rows without committing.
        Only cache slots past each request's context are written (tree nodes, then their compaction; the
        drafter's too), and the real step rewrites them before anything reads them. With ``fuse_step`` each
        probe replays the strategy's step graph, so the recorded step times are those of the real steps."""
        b = act.shape[0]
        arms = {}
        for s in self.strategies:
            if self._captured and not self.covers(s, b):
                continue
            fused = self.fuse_step and self._graph_size(self._step_key(s), b)

            def probe(s=s, fused=fused):
                if fused:
                    inputs = [table, ctx, roots[act], *step_samp, *(eagle_rows or [])]
                    num_acc = self.graph_pool.run(self._step_key(s), inputs, batch_size=fused, fill_rest=True)[1][:b]
                else:
                    tok, par, nn_ = self._draft(s, act, roots, ngram, eagle_rows)
                    lg, hid, _ = self._verify_forward(tok, par, nn_, table, ctx)
                    num_acc = self._accept(tok, par, nn_, lg, hid, table, ctx, samp)[1]
                nacc = num_acc.to(torch.int64)
                counts = [(nacc + 1).sum().view(1)] + [(nacc > j).sum().view(1) for j in range(s.num_steps)]
                return torch.cat(counts).tolist()

            seconds, host = self._synced_seconds(probe)
            arms[str(s)] = {"step_time": seconds, "emitted": host[0], "accepted": host[1:]}
        return {"batch_size": b, "arms": arms}

    # -- the fused step ----------------------------------------------------------------------------
    @staticmethod
    def _step_key(s: Strategy):
        return ("step", s.num_steps, s.topk, s.num_verify)

    def _accept(self, tokens, parents, num_nodes, logits, hidden, table, ctx, samp):
        """verify_tree + compact_kv + the accepted path's features: ``(emitted int64 [b, T], num_accepted int32 [b],
        new context_lens int32 [b], path_hidden [b, T, H], path_tokens int64 [b, T], error int32 [b])``."""
        T = tokens.shape[1]
        res = verify_tree(logits, tokens, parents, num_nodes, max_depth=T - 1, validate=False, **samp)
        new_ctx = compact_kv(self.cache.k, self.cache.v, table, ctx, res.accepted_nodes, res.num_accepted, validate=False)
        path = res.accepted_nodes.to(torch.int64).clamp(min=0)  # [b, T]
        path_hidden = hidden.gather(1, path.unsqueeze(2).expand(-1, -1, hidden.shape[-1]))
        return res.tokens.to(torch.int64), res.num_accepted, new_ctx, path_hidden, tokens.gather(1, path), res.error

    def _step_fn(self, s: Strategy):
        T = tree_width(s, self.drafter_kind)
        draft = self._draft_fn(s) if T > 1 else None

        def fn(table, ctx, roots, temperature, top_k, top_p, seed, offset, *eagle_rows):
            b = roots.shape[0]
            if draft is None:
                tokens = roots.unsqueeze(1)
                parents = torch.full((b, 1), -1, dtype=torch.int32, device=roots.device)
                n = torch.ones(b, dtype=torch.int32, device=roots.device)
            else:
                tokens, parents, n = draft(*eagle_rows)
                tokens = tokens.clone()
                tokens[:, 0] = roots
            logits, hidden = self._verify_fn(tokens, parents, n, table, ctx)
            samp = dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, offset=offset)
            outs = list(self._accept(tokens, parents, n, logits, hidden, table, ctx, samp))
            if eagle_rows:
                emitted, num_acc, path_hidden = outs[0], outs[1], outs[3]
                outs += list(self._extend_fn(*eagle_rows, path_hidden.to(eagle_rows[2].dtype), emitted.clamp(min=0),
                                             (num_acc + 1).to(torch.int32)))
            return outs

        return fn

    def _pad_step(self, p: int, s: Strategy):
        """Example inputs of a fused step: sink rows (the verify padding), neutral sampling (greedy), drafter sink rows."""
        dev = self.device
        _, _, _, table, ctx = self._pad_inputs(1, p)
        out = [table, ctx, torch.zeros(p, dtype=torch.int64, device=dev), torch.zeros(p, dtype=torch.float32, device=dev),
               torch.zeros(p, dtype=torch.int32, device=dev), torch.ones(p, dtype=torch.float32, device=dev),
               torch.zeros(p, dtype=torch.int64, device=dev), torch.zeros(p, dtype=torch.int64, device=dev)]
        if self.drafter_kind == "eagle":
            out += self._pad_eagle(p)
        return out

    def _verify_forward(self, tokens, parents, num_nodes, table, ctx):
        b, T = tokens.shape
        if self._captured:
            p = self.graph_pool.padded_size(("verify", T), b)
            if p is not None:
                logits, hidden = self.graph_pool.run(("verify", T), (tokens, parents, num_nodes, table, ctx), batch_size=p,
                                                     fill_rest=True)
                return logits[:b], hidden[:b], True
        logits, hidden = self._verify_fn(tokens, parents, num_nodes, table, ctx)
        return logits, hidden, False

    # -- drafting -----------------------------------------------------------------------------------
    def _draft(self, s: Strategy, act: torch.Tensor, roots: torch.Tensor, ngram, eagle_rows):
        b = act.shape[0]
        dev = self.device
        T = tree_width(s, self.drafter_kind)
        if T == 1:
            parents = torch.full((b, 1), -1, dtype=torch.int32, device=dev)
            return roots[act].unsqueeze(1), parents, torch.ones(b, dtype=torch.int32, device=dev)
        if self.drafter_kind == "ngram":
            if s.topk <= 1:
                tree = ngram.propose_chain_tree(T - 1)
            else:
                tree = ngram.propose_tree((T - 1) // s.topk, s.topk)
            tokens, parents, n = tree.draft_tokens[act], tree.parents[act], tree.num_nodes[act]
        else:
            name = self._draft_key(s)
            p = self._graph_size(name, b)
            if p is not None:
                tokens, parents, n = (t[:b] for t in self.graph_pool.run(name, eagle_rows, batch_size=p, fill_rest=True))
            else:
                tokens, parents, n = self._draft_fn(s)(*eagle_rows)
        tokens = tokens.clone()
        tokens[:, 0] = roots[act]
        return tokens, parents.to(torch.int32), n.to(torch.int32)

    # -- spot training ------------------------------------------------------------------------------
    def _start_spot(self, stop: threading.Event, result: dict) -> threading.Thread:
        trainer = self.spot_trainer

        def body():
            try:
                if trainer.device.type == "cuda":
                    side = torch.cuda.Stream(trainer.device)
                    with torch.cuda.stream(side):
                        st = trainer.run(stop=stop)
                else:
                    st = trainer.run(stop=stop)
                result.update(micro_steps=st.micro_steps, optimizer_steps=st.optimizer_steps, tokens=st.tokens,
                              seconds=st.elapsed_s, last_loss=st.last_loss, version=st.published_version)
            except Exception as exc:  # pragma: no cover - reported, never kills the rollout
                result["error"] = f"{type(exc).__name__}: {exc}"

        th = threading.Thread(target=body, name="tlt-spot-trainer", daemon=True)
        th.start()
        return th

    # -- generation ---------------------------------------------------------------------------------
    def _check_request_args(self, tokens_in, lens, max_new_tokens, eos_token_id) -> torch.Tensor:
        """generate's argument checks (once per rollout): returns ``max_new_tokens`` as int64 ``[B]`` on the CPU."""
        B = tokens_in.shape[0]
        if B > self.max_batch_size:
            raise ValueError(f"{B} prompts exceed max_batch_size={self.max_batch_size}")
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
        need = int((lens.cpu() + max_new.cpu()).max())
        if need > self.max_seq_len:
            raise ValueError(f"prompt + max_new_tokens reaches {need} tokens, above max_seq_len={self.max_seq_len}")
        return max_new.cpu()

    @torch.no_grad()
    def generate(self, prompts: Prompts, max_new_tokens, temperature=0.0, top_k=None, top_p=None, seed=0,
                 eos_token_id: Optional[int] = None, trace: Optional[list] = None) -> GenerateOutput:
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
        Returns:
            :class:`GenerateOutput`.
        """
        from ..models.reference_decode import _as_padded

        dev = self.device
        tokens_in, lens = _as_padded(prompts, dev)
        B, L = tokens_in.shape
        max_new = self._check_request_args(tokens_in, lens, max_new_tokens, eos_token_id)
        max_new_dev = max_new.to(dev)

        def per_req(name, v, dtype):
            if v is None:
                return None
            t = torch.as_tensor(v, dtype=dtype).flatten()
            if t.numel() == 1:
                t = t.expand(B).clone()
            if t.numel() != B:
                raise ValueError(f"{name} must be a scalar or have one entry per request ({B}), got {t.numel()}")
            return t.to(dev)

        temp = per_req("temperature", temperature, torch.float32)
        greedy = bool((temp == 0).all())
        topk_t = per_req("top_k", top_k, torch.int32)
        topp_t = per_req("top_p", top_p, torch.float32)
        seeds = per_req("seed", seed, torch.int64)
        offsets = torch.zeros(B, dtype=torch.int64, device=dev)

        def sampling(idx):
            pick = (lambda t: None if t is None else t[idx])
            return dict(temperature=None if greedy else temp[idx], top_k=pick(topk_t), top_p=pick(topp_t),
                        seed=seeds[idx], offset=offsets[idx])

        # The fused step graph always takes tensors: temperature 0 = greedy, top_k 0 and top_p 1 = off.
        topk_all = topk_t if topk_t is not None else torch.zeros(B, dtype=torch.int32, device=dev)
        topp_all = topp_t if topp_t is not None else torch.ones(B, dtype=torch.float32, device=dev)

        def step_sampling(idx):
            return temp[idx], topk_all[idx], topp_all[idx], seeds[idx], offsets[idx]

        table, _ = self.cache.allocate(B, self.slots_per_request)
        ngram = eagle_state = None
        t_start = time.perf_counter()
        try:
            # Prefill, then the first token from the prompt's last logits (offset 0, node 0).
            ctx = torch.zeros(B, dtype=torch.int32, device=dev)
            logits, hidden = self.target.prefill(tokens_in, lens.to(torch.int32), self.cache, table, ctx)
            ctx = lens.to(torch.int32).clone()
            all_idx = torch.arange(B, device=dev)
            res0 = verify_tree(logits.unsqueeze(1), torch.zeros(B, 1, dtype=torch.int64, device=dev),
                               torch.full((B, 1), -1, dtype=torch.int32, device=dev), **sampling(all_idx))
            # failed: requests whose logits held NaN/+inf (verify_tree's error flag): they emit nothing more.
            failed = res0.error.bool()
            first = res0.tokens[:, 0].to(torch.int64).clamp(min=0)  # a failed request's -1 never reaches a drafter
            offsets += 1
            roots = first.clone()
            width = int(max_new.max()) + self.max_width + 1
            out = torch.full((B, width), -1, dtype=torch.int64, device=dev)
            out[:, 0] = first
            n_gen = (~failed).to(torch.int64)
            done = (n_gen >= max_new_dev) | failed
            if eos_token_id is not None:
                done |= first == eos_token_id

            if self.drafter_kind == "ngram":
                from ..drafter import NGramDrafter

                ngram = NGramDrafter(B, self.max_seq_len + self.max_width + 1, dev, *self._ngram_n)
                ngram.reset(all_idx, tokens_in, lens)
                ngram.append(first.unsqueeze(1), torch.ones(B, dtype=torch.int32, device=dev))
            elif self.drafter_kind == "eagle":
                eagle_state = self.drafter.new_state(self.drafter_cache, B, self.slots_per_request)
                nxt = torch.zeros(B, L, dtype=torch.int64, device=dev)
                nxt[:, :-1] = tokens_in[:, 1:]
                nxt[all_idx, lens - 1] = first
                dd = eagle_state.last_hidden.dtype
                self.drafter.extend(eagle_state, self.drafter_cache, hidden.to(dd), nxt, lens.to(torch.int32))

            capture = self.rollout_buffer is not None
            if capture:
                S = self.max_seq_len + self.max_width + 2  # last column: write sink for masked scatters
                feats = torch.zeros(B, S, hidden.shape[-1], dtype=hidden.dtype, device=dev)
                ftoks = torch.zeros(B, S, dtype=torch.int64, device=dev)
                feats[:, :L] = hidden
                ftoks[:, :L] = tokens_in
            prefill_s = time.perf_counter() - t_start

            finish_s = [0.0] * B
            steps: List[StepLog] = []
            deferred: List[int] = []
            spot_stop, spot_result, spot_thread = threading.Event(), {}, None
            done_host, failed_host = torch.stack([done, failed]).cpu()  # one transfer
            for b_ in done_host.nonzero().flatten().tolist():
                finish_s[b_] = prefill_s
            errors: List[int] = failed_host.nonzero().flatten().tolist()
            active = (~done_host).nonzero().flatten()
            act = None
            bar = _Progress(int(max_new.sum()), self.progress)
            B0 = B
            step = 0
            while active.numel():
                t0 = time.perf_counter()
                b = active.numel()
                if act is None:  # the device copy of the active rows changes only when requests finish
                    act = active.to(dev)
                s = self.static if self.selector is None else self.selector.select(b)
                if self.drafter_kind == "eagle" and self.spot_trainer is not None:
                    self.drafter.maybe_update(self.spot_trainer.holder)
                eagle_rows = None if eagle_state is None else [getattr(eagle_state, f)[act] for f in EAGLE_FIELDS]
                ctx_old, table_act, max_new_act = ctx[act], table[act], max_new_dev[act]
                if trace is not None:
                    trace.append(self._probe_arms(act, roots, ngram, eagle_rows, table_act, ctx_old, sampling(act),
                                                  step_sampling(act)))
                T = tree_width(s, self.drafter_kind)
                fused = self.fuse_step and self._graph_size(self._step_key(s), b)
                new_eagle = None
                if fused:
                    inputs = [table_act, ctx_old, roots[act], *step_sampling(act), *(eagle_rows or [])]
                    outs = self.graph_pool.run(self._step_key(s), inputs, batch_size=fused, fill_rest=True)
                    emitted, num_acc, new_ctx, path_hidden, path_tokens, err, *new_eagle = (o[:b] for o in outs)
                    replayed = True
                else:
                    tok, par, nn_ = self._draft(s, act, roots, ngram, eagle_rows)
                    T = tok.shape[1]
                    lg, hid, replayed = self._verify_forward(tok, par, nn_, table_act, ctx_old)
                    emitted, num_acc, new_ctx, path_hidden, path_tokens, err = self._accept(
                        tok, par, nn_, lg, hid, table_act, ctx_old, sampling(act))
                nacc = num_acc.to(torch.int64)
                bad = err.bool()  # the target's logits on this request's path held NaN/+inf: it stops here
                ctx[act] = new_ctx
                offsets[act] += 1

                # Emit up to each request's budget; cut after EOS.
                j = torch.arange(T, device=dev).unsqueeze(0)
                n_emit = torch.minimum(nacc + 1, max_new_act - n_gen[act])
                if eos_token_id is not None:
                    is_eos = (emitted == eos_token_id) & (j < n_emit.unsqueeze(1))
                    first_eos = torch.where(is_eos, j, torch.full_like(j, T)).min(1).values
                    n_emit = torch.minimum(n_emit, first_eos + 1)
                    hit_eos = first_eos < T
                n_emit = n_emit.masked_fill(bad, 0)
                keep = j < n_emit.unsqueeze(1)
                pos = torch.where(keep, n_gen[act].unsqueeze(1) + j, torch.full_like(j, width - 1))
                rows = out[act]
                rows.scatter_(1, pos, emitted.clamp(min=0))
                rows[:, width - 1] = -1
                out[act] = rows
                n_gen[act] += n_emit
                roots[act] = emitted.gather(1, nacc.unsqueeze(1)).squeeze(1)

                if ngram is not None:  # the n-gram histories are kept for the whole batch
                    full_new = torch.zeros(B, T, dtype=torch.int64, device=dev)
                    full_num = torch.zeros(B, dtype=torch.int32, device=dev)
                    full_new[act] = emitted.clamp(min=0)
                    full_num[act] = (nacc + 1).to(torch.int32)
                    ngram.append(full_new, full_num, validate=False)  # 1 <= full_num <= T by construction
                if eagle_state is not None:
                    if new_eagle is None:
                        ext = (path_hidden.to(eagle_state.last_hidden.dtype), emitted.clamp(min=0), (nacc + 1).to(torch.int32))
                        p = self._graph_size(("extend", T), b)
                        if p is not None:
                            new_eagle = self.graph_pool.run(("extend", T), [*eagle_rows, *ext], batch_size=p, fill_rest=True)
                        else:
                            new_eagle = self._extend_fn(*eagle_rows, *ext)
                    for f, v in zip(EAGLE_FIELDS[1:], new_eagle):
                        getattr(eagle_state, f)[act] = v[:b]
                if capture:
                    # Committed positions ctx_old + j (j <= nacc) hold the path's features and tokens.
                    ok = j <= nacc.unsqueeze(1)
                    fpos = torch.where(ok, ctx_old.to(torch.int64).unsqueeze(1) + j, torch.full_like(j, S - 1))
                    fr, tr = feats[act], ftoks[act]
                    fr.scatter_(1, fpos.unsqueeze(2).expand(-1, -1, fr.shape[-1]), path_hidden.to(fr.dtype))
                    tr.scatter_(1, fpos, path_tokens)
                    feats[act], ftoks[act] = fr, tr

                fin = (n_gen[act] >= max_new_act) | bad
                if eos_token_id is not None:
                    fin |= hit_eos
                # One device-to-host transfer per step (each sync stalls the CPU until the GPU drains, so the
                # next step's launches cannot overlap this step's kernels): finished and failed flags, emitted
                # tokens, accepted + 1, tokens generated so far, and the per-depth acceptance counts for the selector.
                nd = s.num_steps if self.selector is not None else 0
                parts = [fin.to(torch.int64), bad.to(torch.int64), n_emit.sum().view(1),
                         (nacc + 1).masked_fill(bad, 0).sum().view(1), n_gen.sum().view(1)]
                if nd > 0:
                    parts.append((nacc.unsqueeze(1) >= torch.arange(1, nd + 1, device=dev)).sum(0))
                host = torch.cat(parts).tolist()
                fin_host = torch.tensor(host[:b], dtype=torch.bool)
                bad_host = torch.tensor(host[b : 2 * b], dtype=torch.bool)
                total, tried_total, generated = host[2 * b], host[2 * b + 1], host[2 * b + 2]
                dt = time.perf_counter() - t0
                elapsed = time.perf_counter() - t_start
                if self.selector is not None:
                    self.selector.update(s, b, tried_total, dt, host[2 * b + 3:] if nd > 0 else None)
                rec = StepLog(step, b, str(s), T, total, total / b, dt, elapsed, replayed)
                steps.append(rec)
                log.debug("step %d batch %d %s T=%d emitted %d acc %.2f %.0f tok/s", step, b, s, T, total, total / b, rec.tokens_per_s)
                bar.update(generated, rec)
                step += 1
                if bool(fin_host.any()):
                    finished = active[fin_host]
                    for r in finished.tolist():
                        finish_s[r] = elapsed
                    errors += active[bad_host].tolist()
                    clean = active[fin_host & ~bad_host].tolist()  # a failed request's features may hold NaN
                    if capture:
                        if spot_thread is None:
                            self._add_to_buffer(clean, feats, ftoks, ctx)
                        else:
                            deferred += clean
                    active = active[~fin_host]
                    act = None
                if (self.spot_trainer is not None and spot_thread is None and active.numel()
                        and active.numel() < self.spot_batch_fraction * B0 and self.spot_trainer.buffer.num_tokens > 0):
                    spot_thread = self._start_spot(spot_stop, spot_result)
            if steps:
                bar.update(int(n_gen.sum()), steps[-1], force=True)
            if spot_thread is not None:
                spot_stop.set()
                spot_thread.join()
            wall = time.perf_counter() - t_start
            if capture and deferred:
                self._add_to_buffer(deferred, feats, ftoks, ctx)
            if self.drafter_kind == "eagle" and self.spot_trainer is not None:
                self.drafter.maybe_update(self.spot_trainer.holder)
        finally:
            self.cache.free(table)
            if eagle_state is not None:
                self.drafter_cache.free(eagle_state.block_table)
        self.rollout_step += 1
        lengths = n_gen.cpu()
        out_h = out.cpu()
        errors = sorted(errors)
        if errors:
            warnings.warn(f"SpeculativeEngine.generate: the target's logits held NaN/+inf (or only -inf) for requests "
                          f"{errors}; they stopped at that step (GenerateOutput.errors)", RuntimeWarning, stacklevel=2)
        return GenerateOutput([out_h[b, : int(lengths[b])].tolist() for b in range(B)], lengths, finish_s, steps, wall,
                              prefill_s, spot_result or None, errors)

    def _add_to_buffer(self, reqs: List[int], feats, ftoks, ctx) -> None:
        if not reqs:
            return
        idx = torch.tensor(reqs, device=feats.device)
        n = ctx[idx].to(torch.int64)
        m = int(n.max())
        self.rollout_buffer.add(feats[idx, :m], ftoks[idx, :m], step=self.rollout_step, lengths=n.cpu())
