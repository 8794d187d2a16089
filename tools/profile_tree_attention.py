"""Where tree attention's time goes per CTA: the ops timed over a scan of context lengths at one batch
shape, then a least-squares fit per implementation of

    ms(L) = waves * (fixed + tiles(L) * per_tile),   waves = ceil(CTAs / SMs), tiles(L) = (L + T) / 128

so a cost paid once per CTA (prologue, tree tile, epilogue, launch) separates from the streaming cost per
128-token tile (per_tile at 132 concurrent CTAs; its bytes are 64 KB per KV head at D=128, bf16; 32 KB, e4m3).

    python -m tools.profile_tree_attention [--model 7b] [--B 64] [--T 16] [--L 1024,2048,4096,8192,16384] [--graph]
                                           [--caches bf16|e4m3]

Prints one JSON line per (impl, L) and one per fit. Impls: tlt-triton, tlt-cuda sm90 (the sm_90 kernel forced on),
tlt-cuda sm90 ws (its warp-specialized build, cp.async copies), tlt-cuda sm90 ws tma (the same with TMA copies of
whole context tiles), tlt-cuda mma.sync (forced off). ``--caches e4m3``: the same over e4m3 caches (bytes and tile
bytes counted at one byte a value; no warp-specialized rows, that build does not read fp8). GPU only. Under Nsight
Compute, e.g. ``ncu --kernel-name regex:tree_attention_sm90_kernel --launch-count 2 --section WarpStateStats
--section SourceCounters python -m tools.profile_tree_attention --L 4096 --caches e4m3``, it profiles the launches
of one case.
"""
from __future__ import annotations

import argparse
import json
import math
import sys

import torch

from bench.harness import BenchContext
from bench.suites.tree_attention import HEAD_DIM, MODELS, case_inputs


def fit_fixed_and_per_tile(points):
    """Least squares of ``1e3 * ms / waves = fixed + tiles * per_tile`` over ``points`` = ``[(waves, tiles, ms)]``
    (two or more): ``(fixed_us, per_tile_us, max_abs_residual_us)``."""
    xs = torch.tensor([t for _, t, _ in points], dtype=torch.float64)
    ys = torch.tensor([1e3 * ms / w for w, _, ms in points], dtype=torch.float64)
    A = torch.stack([torch.ones_like(xs), xs], 1)
    sol = torch.linalg.lstsq(A, ys[:, None]).solution
    fixed, per_tile = sol.flatten().tolist()
    return fixed, per_tile, (A @ sol - ys[:, None]).abs().max().item()


def _parse_args(argv):
    """The command line's options."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="7b", choices=["7b", "32b"])
    ap.add_argument("--B", type=int, default=64)
    ap.add_argument("--T", type=int, default=16)
    ap.add_argument("--L", default="1024,2048,4096,8192,16384")
    ap.add_argument("--graph", action="store_true", help="time CUDA-graph replays instead of eager calls")
    ap.add_argument("--caches", default="bf16", choices=["bf16", "e4m3"], help="the K/V caches' storage")
    return ap.parse_args(argv)


def _impls(dev, fp8: bool = False) -> list:
    """The implementations to time: ``(row, backend, sm_90 path, its warp-specialized build, TMA copies in it)``;
    over ``fp8`` caches none of the warp-specialized build (it does not read them)."""
    from tlt_kernels._backend import backend_unavailable_reason

    impls = [("tlt-triton", "triton", None, False, False)]
    if backend_unavailable_reason("cuda", dev) is not None:
        return impls
    lockstep = ("tlt-cuda sm90", "cuda", True, False, False)
    mma_sync = ("tlt-cuda mma.sync", "cuda", False, False, False)
    ws = [("tlt-cuda sm90 ws", "cuda", True, True, False), ("tlt-cuda sm90 ws tma", "cuda", True, True, True)]
    return impls + [lockstep] + ([] if fp8 else ws) + [mma_sync]


def _model_name(args) -> str:
    """The suite's name of ``--model``."""
    return "qwen2.5-7b" if args.model == "7b" else "qwen2.5-32b"


def _cache_bytes(args) -> int:
    """Bytes per stored K or V value."""
    return 1 if args.caches == "e4m3" else 2


def _time_context_length(ctx, args, L, sms, impls, points) -> None:
    """Times every impl at context ``L``: one JSON line each, its (waves, tiles, ms) point appended to ``points``."""
    import tlt_kernels._cuda.tree_attention as ct

    inp, plan_for = case_inputs(_model_name(args), args.B, L, args.T, ctx.device,
                                torch.float8_e4m3fn if args.caches == "e4m3" else None)
    plan = plan_for()
    Hkv = inp["k_cache"].shape[2]
    out = torch.empty_like(inp["q"])
    nbytes = args.B * (L + args.T) * Hkv * HEAD_DIM * 2 * _cache_bytes(args) + 2 * inp["q"].numel() * 2
    for name, backend, sm90, ws, tma in impls:
        with ct.forced_switches(SM90=ct.CONTEXT_SM90 if sm90 is None else sm90, WARP_SPECIALIZED=ws, TMA=tma):
            if backend == "cuda" and ct._use_context_sm90(plan, inp["q"], inp["k_cache"], inp["v_cache"]) != sm90:
                continue

            def fn():
                plan.run(inp["q"], inp["k_cache"], inp["v_cache"], out=out, backend=backend)

            ms = ctx.time_graph_ms(fn) if args.graph else ctx.time_ms(fn)
        ctas = args.B * Hkv * plan.num_splits
        tiles = (L + args.T) / 128 / plan.num_splits
        points[name].append((math.ceil(ctas / sms), tiles, ms))
        # Tensor-core work: S = Q K^T and P V over the context and the tree, every query row (wide trees are
        # bound by it, not by the bytes).
        flops = 4 * args.B * (L + args.T) * inp["q"].shape[2] * args.T * HEAD_DIM
        print(json.dumps(dict(impl=name, B=args.B, L=L, T=args.T, model=args.model, ms=round(ms, 4),
                              pct_floor=round(100 * nbytes / ctx.copy_bandwidth / (ms * 1e-3), 1),
                              tflops=round(flops / (ms * 1e-3) / 1e12, 1),
                              splits=plan.num_splits, graph=args.graph)), flush=True)


def main(argv=None) -> int:
    args = _parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    ctx = BenchContext("tree-attention", dev, torch.bfloat16, small=False)
    Hkv = MODELS[_model_name(args)][1]
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    impls = _impls(dev, fp8=args.caches == "e4m3")
    points = {name: [] for name, *_ in impls}
    for L in (int(x) for x in args.L.split(",")):
        _time_context_length(ctx, args, L, sms, impls, points)
    for name, pts in points.items():
        if len(pts) < 2:
            continue
        fixed, per_tile, resid = fit_fixed_and_per_tile(pts)
        tile_bytes = 128 * HEAD_DIM * 2 * _cache_bytes(args)
        print(json.dumps(dict(fit=name, fixed_us_per_cta=round(fixed, 2), per_tile_us=round(per_tile, 3),
                              per_tile_pct_copy_bw=round(100 * tile_bytes * min(args.B * Hkv, sms) / ctx.copy_bandwidth
                                                         / (per_tile * 1e-6), 1),
                              max_resid_us=round(resid, 2))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
