"""CUDA graph pool: memory of 4 strategies x 12 batch sizes in one shared pool vs the largest single
graph and vs torch's private pools, capture time, replay vs eager, and the pre-capture estimate.

Model: a 4-layer decoder stack with Qwen2.5-7B dims (hidden 3584, intermediate 18944, Hq 28, Hkv 4,
D 128), bf16, verify-shaped inputs (``B * num_verify`` rows). Attention is torch SDPA over each
request's verified tokens (causal) -- ``tlt_kernels.tree_attention``'s plan/run API was not available
when this suite was written; swap it in once it lands. On the CPU the suite times only the pool's
host-side bookkeeping with the fake backend.
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


def _reserved():
    torch.cuda.synchronize()
    return torch.cuda.memory_reserved()


def run(ctx) -> None:
    if ctx.device.type != "cuda":
        _cpu_bookkeeping(ctx)
        return
    from tlt_kernels.runtime import GraphPool

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
    big_s = strats[-1]
    big_b = sizes[-1]

    # 1) The largest single graph, alone in a private pool (warm-up outside the measurement).
    x_big = inputs[big_s](big_b)[0]
    fns[big_s](x_big)
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    before = _reserved()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out_big = fns[big_s](x_big)
    single = _reserved() - before
    del g, out_big
    gc.collect()
    torch.cuda.empty_cache()

    # 2) Private pools (torch's default), every graph.
    keep = []
    before = _reserved()
    t0 = time.perf_counter()
    for b in sorted(sizes, reverse=True):
        for s in strats:
            x = inputs[s](b)[0]
            fns[s](x)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                y = fns[s](x)
            keep.append((g, x, y))
    private_s = time.perf_counter() - t0
    private = _reserved() - before
    del keep, g, x, y
    gc.collect()
    torch.cuda.empty_cache()

    # 3) GraphPool: one pool, one stream, largest first, static buffers outside the pool.
    pool = GraphPool()
    for s in strats:
        pool.add(s, fns[s], sizes, inputs[s])
    t0 = time.perf_counter()
    pool.capture()
    total_s = time.perf_counter() - t0
    st = pool.stats()
    n = len(strats) * len(sizes)
    est_err = (st["estimated_bytes"] - st["pool_bytes"]) / max(st["pool_bytes"], 1)
    case = {"graphs": n, "what": "capture all"}
    ctx.add(case, "tlt-graph-pool", total_s * 1e3, pool_gib=round(st["pool_bytes"] / 2**30, 3),
            x_largest=round(st["pool_bytes"] / single, 3), capture_only_s=round(st["capture_seconds"], 2),
            estimate_gib=round(st["estimated_bytes"] / 2**30, 3), estimate_err=round(est_err, 3))
    ctx.add(case, "torch-private-pools", private_s * 1e3, pool_gib=round(private / 2**30, 3),
            x_largest=round(private / single, 3))
    ctx.note(f"largest single graph ({big_s}, B={big_b}): {single / 2**30:.3f} GiB")

    # 4) Replay (copy-in, replay, prefix views) vs eager launches, a few keys.
    for s in (strats[0], strats[1], big_s):
        for b in (1, 16, sizes[-1]):
            x = inputs[s](b)[0]
            case = {"strategy": str(s), "B": b}
            ctx.add(case, "tlt-graph-pool", ctx.time_ms(lambda: pool.run(s, (x,), batch_size=b)))
            ctx.add(case, "eager", ctx.time_ms(lambda: fns[s](x)))
    st = pool.stats()
    ctx.note(f"pool stats after replays: hits={st['hits']} misses={st['misses']} "
             f"padding_waste={st['padding_waste']:.3f}")
