"""A pool of CUDA graphs, one per (name, batch size), sharing one memory pool and one capture stream.

Why one shared pool: graphs captured into private pools each keep their own activation memory (N
graphs hold about the sum of theirs), while graphs captured largest-first into one pool reuse the
largest graph's blocks (about the largest one's). That reuse is only safe because nothing outside a
graph reads its pool memory after the replay: every graph copies its results into *static output
buffers allocated outside the pool* (and reads *static input buffers* allocated outside it), so graphs
may be replayed in any order.

Layout of static buffers: for each name, inputs and outputs are allocated once at the largest batch
size; smaller sizes use prefix views (dim 0 of every tensor is ``batch_size * k`` for a per-tensor
constant ``k``, e.g. ``B`` or ``B * num_verify``; tensors whose dim 0 does not scale with the batch are
shared whole). A batch is padded to the smallest captured size >= its size: the caller's inputs are
copied into the prefix, the padded rows keep the last valid values (so page tables stay in bounds),
and the outputs are returned as prefix views (valid until the next replay of that name).

Memory accounting (``pool_bytes``): the growth of the device's reserved bytes across each capture
(and the drop across each eviction), every reading taken after ``synchronize()`` and ``empty_cache()``.
The emptying matters: warm-up leaves its eager blocks cached, and entering ``torch.cuda.graph`` empties
the cache, so a baseline read with them still cached cancels the pool's growth. Static input/output
buffers and warm-up memory are allocated (or released) before the first reading, so they are excluded;
the pool counter ignores whatever else the process allocates later. ``estimated_bytes`` predicts the same
quantity before capture: the keys run eagerly once more, in capture order, on the capture stream, from
an emptied cache, and the peak growth of reserved bytes is taken (the caching allocator makes the same
block decisions for a fresh graph pool as for that stream's empty regular pool); with private pools it
is the sum of that peak per key.

``GraphPool(backend=FakeGraphBackend(...))`` runs the same bookkeeping on the CPU for tests.
"""
from __future__ import annotations

import bisect
import gc
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence, Tuple

import torch

Inputs = Sequence[torch.Tensor]


def cuda_device(device=None) -> torch.device:
    """``device`` with its index: None and ``"cuda"`` are the current CUDA device, so the backend's device compares
    equal to its tensors' (``cuda:<i>``); a device that is not a CUDA device raises ValueError."""
    d = torch.device("cuda") if device is None else torch.device(device)
    if d.type != "cuda":
        raise ValueError(f"CudaGraphBackend needs a CUDA device, got device={device!r}")
    return d if d.index is not None else torch.device("cuda", torch.cuda.current_device())


class CudaGraphBackend:
    """Real backend: one ``torch.cuda.graph_pool_handle()`` and one capture stream for all graphs.

    ``shared_pool=False`` gives every graph torch's default private pool instead (the baseline the
    benchmark compares against); everything else, the measurement included, is identical.
    """

    def __init__(self, device=None, *, shared_pool: bool = True):
        self.device = cuda_device(device)
        self.shared_pool = shared_pool
        self.pool = torch.cuda.graph_pool_handle() if shared_pool else None
        self.stream = torch.cuda.Stream(self.device)

    def reserved_bytes(self) -> int:
        return torch.cuda.memory_reserved(self.device)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def empty_cache(self) -> None:
        # Releases cached blocks of the regular pools and of graph pools no live graph uses; the
        # segments of a pool that live graphs still use stay reserved.
        with torch.cuda.device(self.device):
            torch.cuda.empty_cache()

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak_reserved_bytes(self) -> int:
        return torch.cuda.max_memory_reserved(self.device)

    def run_eager(self, fn: Callable[[], Any], iters: int = 1) -> None:
        """Run ``fn`` ``iters`` times on the capture stream (the stream its graph will be captured on,
        so per-stream lazy state such as the cuBLAS workspace is created outside any graph pool)."""
        cur = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(cur)
        with torch.cuda.stream(self.stream):
            for _ in range(iters):
                out = fn()
                del out
        cur.wait_stream(self.stream)

    def warmup(self, fn: Callable[[], Any], iters: int) -> int:
        """Run ``fn`` eagerly ``iters`` times; return the peak extra allocated bytes of the last run
        (earlier runs absorb lazy initialization)."""
        if iters > 1:
            self.run_eager(fn, iters - 1)
        self.synchronize()
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.run_eager(fn)
        self.synchronize()
        return torch.cuda.max_memory_allocated(self.device) - base

    def capture(self, fn: Callable[[], Any]):
        g = torch.cuda.CUDAGraph()
        # Note: entering torch.cuda.graph synchronizes and empties the allocator cache. "thread_local": an
        # unsafe CUDA call on another thread (an engine's spot-trainer thread) must not invalidate this capture;
        # the capturing thread itself is still checked.
        # Python's collector is paused while capturing: a dead engine's graphs freed by a collection mid-capture
        # would be destroyed while the stream captures, which CUDA forbids and which invalidates the capture.
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(g, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
                fn()
        finally:
            if collecting:
                gc.enable()
        return g

    def renew_pool(self) -> None:
        """Capture later graphs into a fresh memory pool: after a failed capture torch may still hold the old
        pool as being recorded to ("beginAllocateToPool: already recording"), which would fail the retry."""
        if self.shared_pool:
            self.pool = torch.cuda.graph_pool_handle()

    def replay(self, g) -> None:
        g.replay()

    def release(self, g) -> None:
        # reset() drops the graph's use of its pool; a pool's segments are freed (by empty_cache) only
        # once no graph uses it, so evicting one graph of a shared pool frees nothing.
        g.reset()
        del g
        gc.collect()
        self.empty_cache()


class FakeGraphBackend:
    """CPU stand-in: "capture" keeps the closure, "replay" calls it; device memory is modeled after
    torch's caching allocator so the pool's accounting can be tested.

    ``graph_bytes(key)`` gives the memory one eager run or one graph of ``key`` needs. Model:

    * an eager run leaves its blocks cached (reserved) until ``empty_cache()``; later eager runs reuse
      them, so the cache holds the largest run since the last ``empty_cache()``;
    * ``capture`` first empties the cache (as entering ``torch.cuda.graph`` does), then the graph's
      pool holds its bytes: one shared pool (``shared=True``) keeps the high-water mark of its graphs
      until the last of them is released; private pools add up and go with their graph;
    * ``external_bytes``: everything else the device holds (weights, static buffers); tests may change it.
    """

    def __init__(self, graph_bytes: Callable[[Hashable], int], shared: bool = True):
        self.graph_bytes = graph_bytes
        self.shared = shared
        self.shared_pool = shared
        self.live: Dict[int, int] = {}
        self.external_bytes = 0
        self.cached_bytes = 0
        self._shared_hwm = 0
        self._peak = 0
        self.captures = 0
        self.replays = 0
        self._key: Hashable = None

    def reserved_bytes(self) -> int:
        pool = (self._shared_hwm if self.live else 0) if self.shared else sum(self.live.values())
        return self.external_bytes + self.cached_bytes + pool

    def _touch(self) -> None:
        self._peak = max(self._peak, self.reserved_bytes())

    def synchronize(self) -> None:
        pass

    def empty_cache(self) -> None:
        self.cached_bytes = 0
        if not self.live:
            self._shared_hwm = 0

    def reset_peak(self) -> None:
        self._peak = self.reserved_bytes()

    def peak_reserved_bytes(self) -> int:
        return self._peak

    def run_eager(self, fn, iters: int = 1) -> None:
        for _ in range(iters):
            fn()
        self.cached_bytes = max(self.cached_bytes, self.graph_bytes(self._key))
        self._touch()

    def warmup(self, fn, iters):
        self.run_eager(fn, iters)
        return self.graph_bytes(self._key)

    def renew_pool(self) -> None:
        """Nothing to renew: the model has no pool state a failed capture could leave behind."""

    def capture(self, fn):
        self.empty_cache()
        self.captures += 1
        handle = (self.captures, fn)
        nbytes = self.graph_bytes(self._key)
        self.live[self.captures] = nbytes
        self._shared_hwm = max(self._shared_hwm, nbytes)
        self._touch()
        return handle

    def replay(self, g) -> None:
        self.replays += 1
        g[1]()

    def release(self, g) -> None:
        self.live.pop(g[0], None)
        self.empty_cache()


@dataclass
class _Entry:
    name: Hashable
    fn: Callable[..., Any]
    example_inputs: Callable[[int], Inputs]
    sizes: List[int]
    static_in: Optional[List[torch.Tensor]] = None  # allocated at the largest size
    fill_in: Optional[List[torch.Tensor]] = None  # pristine copy of the example inputs (run(fill_rest=True))
    static_out: Dict[int, Any] = field(default_factory=dict)  # batch size -> output structure (views)
    graphs: Dict[int, Any] = field(default_factory=dict)
    warm_peak: Dict[int, int] = field(default_factory=dict)


def _flatten(out) -> Tuple[List[torch.Tensor], Callable[[List[torch.Tensor]], Any]]:
    if isinstance(out, torch.Tensor):
        return [out], lambda ts: ts[0]
    if isinstance(out, (tuple, list)):
        kind = type(out)
        return list(out), lambda ts: kind(ts)
    if isinstance(out, dict):
        keys = list(out)
        return [out[k] for k in keys], lambda ts: dict(zip(keys, ts))
    raise TypeError(f"graph callables must return a tensor, a tuple/list or a dict of tensors, got {type(out).__name__}")


def _prefix(t: torch.Tensor, batch: int, full_batch: int) -> torch.Tensor:
    """The rows of ``t`` (allocated for ``full_batch``) that belong to ``batch`` requests."""
    if t.dim() == 0 or t.shape[0] % full_batch:
        return t
    return t[: t.shape[0] // full_batch * batch]


class GraphPool:
    """Captured step functions keyed by ``(name, batch_size)``, e.g. ``name`` = a :class:`Strategy`.

    Args:
        memory_budget_bytes: cap on the pool's reserved bytes; past it, least-recently-used graphs are
            evicted and their batches run eagerly. None: no cap.
        device: CUDA device (default: current).
        warmup_iters: eager runs before capturing each graph (lazy inits, autotuning, cuBLAS workspaces).
        backend: :class:`CudaGraphBackend` (default) or :class:`FakeGraphBackend` for CPU tests.

    Usage::

        pool = GraphPool()
        for s in strategies:
            pool.add(s, step_fn[s], batch_sizes=[1, 2, 4, ..., 256], example_inputs=make_inputs[s])
        pool.capture()                      # all graphs, largest batch first, one pool, one stream
        logits = pool.run(s, inputs)        # pads to the nearest captured size >= batch
    """

    def __init__(self, memory_budget_bytes: Optional[int] = None, *, device=None, warmup_iters: int = 2,
                 backend=None):
        if memory_budget_bytes is not None and memory_budget_bytes < 0:
            raise ValueError(f"memory_budget_bytes must be >= 0 or None, got {memory_budget_bytes}")
        self.memory_budget_bytes = memory_budget_bytes
        self.warmup_iters = warmup_iters
        self.backend = backend if backend is not None else CudaGraphBackend(device)
        self._entries: Dict[Hashable, _Entry] = {}
        self._lru: "OrderedDict[Tuple[Hashable, int], None]" = OrderedDict()
        self._graph_bytes: Dict[Tuple[Hashable, int], int] = {}
        self._pool_bytes = 0
        self._estimated_for: Optional[Tuple[Tuple[Hashable, int], ...]] = None
        self.hits = self.misses = self.evictions = 0
        self.capture_seconds = 0.0
        self._rows_used = self._rows_padded = 0
        self.estimated_bytes: Optional[int] = None

    # -- registration ---------------------------------------------------------------------------
    def add(self, name: Hashable, fn: Callable[..., Any], batch_sizes: Sequence[int],
            example_inputs: Callable[[int], Inputs]) -> None:
        """Register ``fn(*inputs) -> tensor | tuple | dict`` for ``batch_sizes``.

        ``example_inputs(B)`` returns valid inputs for a batch of ``B`` (called once, at the largest B,
        to allocate the static input buffers, which start as a copy of it). ``fn`` must not depend on
        anything but its inputs and tensors it closes over (weights, KV cache), and must not synchronize.
        """
        if name in self._entries:
            raise ValueError(f"graph name {name!r} is already registered")
        sizes = sorted({int(b) for b in batch_sizes})
        if not sizes or sizes[0] < 1:
            raise ValueError(f"batch_sizes for {name!r} must be positive ints, got {list(batch_sizes)}")
        self._entries[name] = _Entry(name, fn, example_inputs, sizes)

    def keys(self) -> List[Tuple[Hashable, int]]:
        """Every registered (name, batch size), largest batch first (the capture order)."""
        ks = [(n, b) for n, e in self._entries.items() for b in e.sizes]
        order = {n: i for i, n in enumerate(self._entries)}
        return sorted(ks, key=lambda k: (-k[1], order[k[0]]))

    # -- capture --------------------------------------------------------------------------------
    def _static_inputs(self, e: _Entry) -> List[torch.Tensor]:
        if e.static_in is None:
            ex = e.example_inputs(e.sizes[-1])
            ex = [ex] if isinstance(ex, torch.Tensor) else list(ex)
            # Allocated with the regular allocator (we are not capturing), i.e. outside the graph pool.
            e.static_in = [t.clone() for t in ex]
        return e.static_in

    def _pristine(self, e: _Entry) -> List[torch.Tensor]:
        """The example inputs at the largest size, freshly made (the static buffers may hold replayed data)."""
        ex = e.example_inputs(e.sizes[-1])
        return [t.clone() for t in ([ex] if isinstance(ex, torch.Tensor) else list(ex))]

    def _inputs_for(self, e: _Entry, b: int) -> List[torch.Tensor]:
        return [_prefix(t, b, e.sizes[-1]) for t in self._static_inputs(e)]

    def _settled_reserved(self) -> int:
        """Reserved device bytes once queued work is done and cached blocks nothing uses are released."""
        self.backend.synchronize()
        self.backend.empty_cache()
        return self.backend.reserved_bytes()

    def _static_outputs(self, e: _Entry, b: int) -> List[torch.Tensor]:
        """Flat output buffers for batch ``b`` (allocated outside the pool, once, at the largest size)."""
        big = e.sizes[-1]
        if b not in e.static_out:
            if big not in e.static_out:
                # Shapes from one eager run at the largest size.
                flat, rebuild = _flatten(e.fn(*self._inputs_for(e, big)))
                e.static_out[big] = rebuild([torch.empty_like(t) for t in flat])
            flat, rebuild = _flatten(e.static_out[big])
            e.static_out[b] = rebuild([_prefix(t, b, big) for t in flat])
        return _flatten(e.static_out[b])[0]

    def _check_keys(self, keys: Optional[Sequence[Tuple[Hashable, int]]]) -> List[Tuple[Hashable, int]]:
        keys = self.keys() if keys is None else list(keys)
        for name, b in keys:
            if name not in self._entries or b not in self._entries[name].sizes:
                raise KeyError(f"({name!r}, {b}) is not registered; call add() first")
        return keys

    def warmup(self, keys: Optional[Sequence[Tuple[Hashable, int]]] = None) -> int:
        """Prepare ``keys`` (default: all registered) for capture; returns the estimated pool bytes.

        Runs each key eagerly ``warmup_iters`` times (lazy inits, autotuning, the capture stream's cuBLAS
        workspace; the last run's peak allocation orders the capture), allocates the static buffers,
        then estimates the pool: one more eager run per key, in capture order, from an emptied cache;
        the estimate is the peak growth of reserved bytes (per key and summed for private pools), the
        same quantity :meth:`pool_bytes` measures across capture into an empty pool.
        """
        keys = self._check_keys(keys)
        for name, b in keys:
            e = self._entries[name]
            if b not in e.warm_peak:
                inp = self._inputs_for(e, b)
                self.backend._key = (name, b)
                e.warm_peak[b] = self.backend.warmup(lambda: e.fn(*inp), self.warmup_iters)
        for name, b in keys:
            self._static_outputs(self._entries[name], b)
        order = self._capture_order(keys)
        if self._estimated_for != tuple(order):
            groups = [order] if getattr(self.backend, "shared_pool", True) else [[k] for k in order]
            self.estimated_bytes = sum(self._eager_reserved_growth(g) for g in groups)
            self._estimated_for = tuple(order)
            self.backend.empty_cache()
        return self.estimated_bytes

    def _capture_order(self, keys: Sequence[Tuple[Hashable, int]]) -> List[Tuple[Hashable, int]]:
        # Largest eager peak first (ties: larger batch), so later graphs fit in blocks the pool holds.
        return sorted(keys, key=lambda k: (-self._entries[k[0]].warm_peak[k[1]], -k[1]))

    def _eager_reserved_growth(self, keys: Sequence[Tuple[Hashable, int]]) -> int:
        base = self._settled_reserved()
        self.backend.reset_peak()
        for name, b in keys:
            e = self._entries[name]
            inp = self._inputs_for(e, b)
            self.backend._key = (name, b)
            self.backend.run_eager(lambda: e.fn(*inp))
        self.backend.synchronize()
        return max(0, self.backend.peak_reserved_bytes() - base)

    def capture(self, keys: Optional[Sequence[Tuple[Hashable, int]]] = None) -> None:
        """Capture ``keys`` (default: all registered) into the shared pool, largest first.

        "Largest" is the eager peak memory measured at warm-up (ties: larger batch), so every later
        graph fits in blocks the pool already holds. Calls :meth:`warmup` first.
        """
        keys = self._check_keys(keys)
        self.warmup(keys)
        t0 = time.perf_counter()
        for name, b in self._capture_order(keys):
            e = self._entries[name]
            if b in e.graphs:
                continue
            inp = self._inputs_for(e, b)
            out_flat = self._static_outputs(e, b)

            def body(e=e, inp=inp, out_flat=out_flat):
                res, _ = _flatten(e.fn(*inp))
                for dst, src in zip(out_flat, res):
                    dst.copy_(src)

            # Both readings settled: capture empties the cache on entry, so an unsettled "before" would
            # count cached blocks that vanish, cancelling the pool's growth.
            before = self._settled_reserved()
            self.backend._key = (name, b)
            e.graphs[b] = self.backend.capture(body)
            grown = self._settled_reserved() - before
            self._graph_bytes[(name, b)] = grown
            self._pool_bytes += grown
            self._lru[(name, b)] = None
            if self.memory_budget_bytes is not None and self.pool_bytes() > self.memory_budget_bytes:
                self.evict((name, b))  # this graph pushed the pool over budget: it runs eagerly instead
        self.backend.synchronize()
        self.capture_seconds += time.perf_counter() - t0

    # -- budget ---------------------------------------------------------------------------------
    def pool_bytes(self) -> int:
        """Device memory the captured graphs hold: reserved-bytes growth across every capture minus the
        drop across every eviction (see the module docstring); static buffers are not included."""
        return max(0, self._pool_bytes)

    def set_memory_budget(self, memory_budget_bytes: Optional[int]) -> None:
        """Change the budget; evicts least-recently-replayed graphs until the pool fits (or none is left)."""
        self.memory_budget_bytes = memory_budget_bytes
        if memory_budget_bytes is None:
            return
        while self._lru and self.pool_bytes() > memory_budget_bytes:
            self.evict(next(iter(self._lru)))

    def evict(self, key: Tuple[Hashable, int]) -> None:
        """Drop one graph (its batches then run on the next larger captured size, or eagerly)."""
        name, b = key
        g = self._entries[name].graphs.pop(b)
        self._lru.pop(key, None)
        self._graph_bytes.pop(key, None)
        before = self._settled_reserved()
        self.backend.release(g)
        del g
        self._pool_bytes -= before - self._settled_reserved()
        self.evictions += 1

    # -- replay ---------------------------------------------------------------------------------
    def padded_size(self, name: Hashable, batch_size: int) -> Optional[int]:
        """The captured size a batch of ``batch_size`` would replay at (None: runs eagerly)."""
        e = self._entries.get(name)
        if e is None or not e.graphs:
            return None
        sizes = sorted(e.graphs)
        i = bisect.bisect_left(sizes, batch_size)
        return sizes[i] if i < len(sizes) else None

    def captured_sizes(self, name: Hashable) -> List[int]:
        """Batch sizes with a live graph for ``name`` (ascending)."""
        e = self._entries.get(name)
        return sorted(e.graphs) if e is not None else []

    def replay_padding(self, name: Hashable, batch_size: int) -> None:
        """Replay the graph a batch of ``batch_size`` would use on its registered example inputs (every row
        padding), e.g. to time it at start-up. Not counted as a hit."""
        e = self._entries.get(name)
        p = self.padded_size(name, batch_size)
        if p is None:
            raise KeyError(f"no captured graph of {name!r} covers batch size {batch_size}")
        if e.fill_in is None:
            e.fill_in = self._pristine(e)
        for dst, src in zip(self._inputs_for(e, p), e.fill_in):
            dst.copy_(src[:p])
        self.backend.replay(e.graphs[p])

    def covers(self, name: Hashable, batch_size: int) -> bool:
        """Whether a captured graph can run this batch (for ``StrategySelector(available=pool.covers)``)."""
        return self.padded_size(name, batch_size) is not None

    def run(self, name: Hashable, inputs: Inputs, batch_size: Optional[int] = None, fill_rest: bool = False):
        """Run ``name`` on ``inputs`` (a batch of ``batch_size``, default ``inputs[0].shape[0]``).

        Replays the smallest captured graph >= the batch (a hit) after copying the inputs into the
        prefix of its static buffers, and returns prefix views of its static outputs; without one
        (never captured, evicted, too large) it calls the function eagerly (a miss).

        ``fill_rest``: inputs may have fewer rows than ``batch_size``; the static rows past them are
        reset to the example inputs' rows (e.g. harmless padding requests) instead of keeping whatever
        an earlier replay left there. On a miss the function then runs on the given rows only.
        """
        e = self._entries.get(name)
        if e is None:
            raise KeyError(f"graph name {name!r} is not registered; registered: {list(self._entries)}")
        inputs = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)
        b = int(inputs[0].shape[0]) if batch_size is None else int(batch_size)
        p = self.padded_size(name, b)
        if p is None:
            self.misses += 1
            return e.fn(*inputs)
        static = self._inputs_for(e, p)
        if len(inputs) != len(static):
            raise ValueError(f"{name!r} was registered with {len(static)} inputs, got {len(inputs)}")
        if fill_rest and e.fill_in is None:
            e.fill_in = self._pristine(e)
        for i, (dst, src) in enumerate(zip(static, inputs)):
            if src.shape[1:] != dst.shape[1:] or src.shape[0] > dst.shape[0]:
                raise ValueError(
                    f"input {i} of {name!r} has shape {tuple(src.shape)}; the graph for batch {p} takes at most "
                    f"{tuple(dst.shape)}"
                )
            n = src.shape[0]
            dst[:n].copy_(src)
            if fill_rest and n < p:
                dst[n:].copy_(e.fill_in[i][n:p])
        self.backend.replay(e.graphs[p])
        self.hits += 1
        self._rows_used += b
        self._rows_padded += p
        self._lru.move_to_end((name, p))
        flat, rebuild = _flatten(e.static_out[p])
        return rebuild([_prefix(t, b, p) for t in flat])

    def stats(self) -> dict:
        """Graphs, bytes, hit/miss counts, capture seconds, and padding waste (padded rows / replayed rows)."""
        return {
            "graphs": len(self._lru),
            "registered": sum(len(e.sizes) for e in self._entries.values()),
            "pool_bytes": self.pool_bytes(),
            "estimated_bytes": self.estimated_bytes,
            "max_capture_growth_bytes": max(self._graph_bytes.values(), default=0),
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
            "capture_seconds": self.capture_seconds,
            "padding_waste": (1 - self._rows_used / self._rows_padded) if self._rows_padded else 0.0,
        }
