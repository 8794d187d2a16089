"""CUDA graph pool: memory of 4 strategies x 12 batch sizes in one shared pool vs the largest single
graph and vs torch's private pools, capture time, replay vs eager, and the pre-capture estimate.

Model: a 4-layer decoder stack with Qwen2.5-7B dims (hidden 3584, intermediate 18944, Hq 28, Hkv 4,
D 128), bf16, verify-shaped inputs (``B * num_verify`` rows). Attention is torch SDPA over each
request's verified tokens (causal) -- ``tlt_kernels.tree_attention``'s plan/run API was not available
when this suite was written; swap it in once it lands. On the CPU the suite times only the pool's
host-side bookkeeping with the fake backend.

Every memory figure is ``GraphPool.pool_bytes`` of a fresh pool (see ``MEMORY_DEFINITION``), so the
largest graph alone, the shared pool and the private-pool baseline are measured by the same code.
"""
from __future__ import annotations

import gc
import time

import torch

SUITE = "graph-pool"

SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160)


def _strategies():
    from tlt_kernels.runtime import Strategy

    return [Strategy.off(), Strategy(3, 1, 4), Strategy(4, 4, 8), Strategy(6, 4, 16)]


def _model(ctx, layers, hidden, inter, hq, hkv, d):
    dev, dt = ctx.device, ctx.dtype
    gen = torch.Generator(device=dev).manual_seed(0)

    def w(*shape):
        return torch.randn(*shape, device=dev, dtype=dt, generator=gen) * shape[0] ** -0.5

    ws = [dict(qkv=w(hidden, (hq + 2 * hkv) * d), o=w(hq * d, hidden), up=w(hidden, 2 * inter),
               down=w(inter, hidden), n1=torch.ones(hidden, device=dev, dtype=dt),
               n2=torch.ones(hidden, device=dev, dtype=dt)) for _ in range(layers)]

    def rms(x, g):
        return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * g

    def make(nv):
        def fn(x):
            b = x.shape[0] // nv
            for p in ws:
                q, k, v = (rms(x, p["n1"]) @ p["qkv"]).split([hq * d, hkv * d, hkv * d], dim=-1)
                q = q.view(b, nv, hq, d).transpose(1, 2)
                k = k.view(b, nv, hkv, d).transpose(1, 2)
                v = v.view(b, nv, hkv, d).transpose(1, 2)
                a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                x = x + a.transpose(1, 2).reshape(b * nv, hq * d) @ p["o"]
                gt, up = (rms(x, p["n2"]) @ p["up"]).chunk(2, dim=-1)
                x = x + (torch.nn.functional.silu(gt) * up) @ p["down"]
            return x
        return fn
    return make


def _cpu_bookkeeping(ctx):
    from tlt_kernels.runtime import GraphPool
    from tlt_kernels.runtime.graph_pool import FakeGraphBackend

    pool = GraphPool(backend=FakeGraphBackend(lambda k: k[1]), warmup_iters=1)
    for s in _strategies():
        pool.add(s, lambda x: x, SIZES, lambda b, s=s: (torch.zeros(b * s.num_verify, 8),))
    t0 = time.perf_counter()
    pool.capture()
    cap = time.perf_counter() - t0
    s = _strategies()[2]
    x = torch.zeros(5 * s.num_verify, 8)
    ms = ctx.time_ms(lambda: pool.run(s, (x,), batch_size=5))
    ctx.add({"what": "host bookkeeping (fake backend)"}, "tlt-graph-pool", ms, capture_s=round(cap, 4))
    ctx.note("graph-pool: no CUDA device; only the pool's host-side cost (fake backend) was measured")


MEMORY_DEFINITION = (
    "pool_gib: growth of torch.cuda.memory_reserved() from just before the first capture to just after the "
    "last, both read after synchronize() + empty_cache() with every graph alive (GraphPool.pool_bytes); static "
    "input/output buffers and warm-up memory are allocated/released before the first reading, so excluded. "
    "The same GraphPool code measures the largest graph alone (fresh pool), every graph in one shared pool, "
    "and every graph in torch's private pools (CudaGraphBackend(shared_pool=False)). estimate_gib is "
    "computed before capture (eager run of the same keys in capture order on the capture stream from an "
    "emptied cache: peak reserved growth; summed per key for private pools); estimate_err = estimate / "
    "measured - 1. ms = warm-up + estimate + capture; capture_only_s = the capture loop alone."
)


def _measure(ctx, fns, inputs, keys, sizes, shared=True):
    """Capture ``keys`` into a fresh GraphPool; returns (pool, seconds for warm-up + estimate + capture)."""
    from tlt_kernels.runtime import GraphPool
    from tlt_kernels.runtime.graph_pool import CudaGraphBackend

    pool = GraphPool(backend=CudaGraphBackend(ctx.device, shared_pool=shared))
    for s in fns:
        if any(k[0] == s for k in keys):
            pool.add(s, fns[s], sizes, inputs[s])
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    pool.capture(keys)
    return pool, time.perf_counter() - t0


def _free() -> None:
    """Release pools the caller has dropped (a graph pool's segments go once no graph uses it)."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def _row(ctx, case, impl, pool, total_s, single=None):
    st = pool.stats()
    got, est = st["pool_bytes"], st["estimated_bytes"]
    extra = dict(pool_gib=round(got / 2**30, 3), capture_only_s=round(st["capture_seconds"], 2),
                 estimate_gib=round(est / 2**30, 3), estimate_err=round(est / max(got, 1) - 1, 3))
    if single:
        extra["x_largest"] = round(got / single, 3)
    ctx.add(case, impl, total_s * 1e3, **extra)
    return got


def run(ctx) -> None:
    if ctx.device.type != "cuda":
        _cpu_bookkeeping(ctx)
        return
    dims = (1, 512, 1024, 8, 2, 64) if ctx.small else (4, 3584, 18944, 28, 4, 128)
    sizes = SIZES[:6] if ctx.small else SIZES
    strats = _strategies()
    make = _model(ctx, *dims)
    hidden = dims[1]
    fns = {s: make(s.num_verify) for s in strats}
    inputs = {s: (lambda b, s=s: (torch.randn(b * s.num_verify, hidden, device=ctx.device, dtype=ctx.dtype),))
              for s in strats}
    ctx.note(f"model: layers={dims[0]} hidden={dims[1]} inter={dims[2]} Hq={dims[3]} Hkv={dims[4]} D={dims[5]}; "
             f"{len(strats)} strategies x {len(sizes)} sizes; attention: torch SDPA (tree_attention pending)")
    ctx.note(MEMORY_DEFINITION)
    big_s, big_b = strats[-1], sizes[-1]
    every = [(s, b) for s in strats for b in sizes]
    n = len(every)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    start = torch.cuda.memory_reserved()

    # 1) The largest graph alone, in a fresh pool.
    pool, total_s = _measure(ctx, fns, inputs, [(big_s, big_b)], sizes)
    single = _row(ctx, {"graphs": 1, "what": f"largest alone ({big_s}, B={big_b})"}, "tlt-graph-pool", pool, total_s)
    del pool
    _free()

    # 2) Every graph in one shared pool, largest first.
    case = {"graphs": n, "what": "capture all"}
    pool, total_s = _measure(ctx, fns, inputs, every, sizes)
    shared = _row(ctx, case, "tlt-graph-pool", pool, total_s, single)
    first = max(pool._graph_bytes, key=pool._graph_bytes.get)
    ctx.note(f"largest single graph ({big_s}, B={big_b}): {single / 2**30:.3f} GiB; in the shared pool the "
             f"largest capture growth was ({first[0]}, B={first[1]}): {pool._graph_bytes[first] / 2**30:.3f} GiB")
    if shared < single:
        ctx.note("INCONSISTENT: the shared pool measured smaller than its largest graph alone")

    # 3) Replay (copy-in, replay, prefix views) vs eager launches, a few keys.
    for s in (strats[0], strats[1], big_s):
        for b in (1, 16, sizes[-1]):
            x = inputs[s](b)[0]
            rcase = {"strategy": str(s), "B": b}
            ctx.add(rcase, "tlt-graph-pool", ctx.time_ms(lambda: pool.run(s, (x,), batch_size=b)))
            ctx.add(rcase, "eager", ctx.time_ms(lambda: fns[s](x)))
    st = pool.stats()
    ctx.note(f"pool stats after replays: hits={st['hits']} misses={st['misses']} "
             f"padding_waste={st['padding_waste']:.3f} pool_gib={st['pool_bytes'] / 2**30:.3f}")
    del x, pool
    _free()

    # 4) Every graph in torch's private pools (one per graph), measured by the same code.
    pool, total_s = _measure(ctx, fns, inputs, every, sizes, shared=False)
    _row(ctx, case, "torch-private-pools", pool, total_s, single)
    del pool
    _free()
    leaked = torch.cuda.memory_reserved() - start
    ctx.note(f"reserved after releasing every pool: {leaked / 2**20:+.1f} MiB vs the start (memory not handed "
             "back, e.g. per-stream library workspaces of the three capture streams)")
