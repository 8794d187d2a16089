"""Probe: a few-row linear layer (``y = x @ W^T``, x ``[M, K]`` with M <= 64) on cuBLAS against Triton skinny kernels.

A decode step of a small model runs its projections at M = B x T rows: cuBLAS tiles N by 64 there, so a 960-wide
projection runs on 15 CTAs of a 132-SM card. Each shape runs as a chain of 30 distinct weights (a model's layers)
captured in one CUDA graph, the L2 flushed before each replay (the first version kept it, and the chain's weights
stayed in L2: docs/MODELS.md); the time per projection is the graph's median / 30.

  python -m tools.skinny_linear_probe --out probe.json [--ms 1,16] [--shapes smollm2] [--row-tile 16]

The whole grid (9 shapes, M in 1..32, ~24 configs each) takes about 7 minutes on an H200, most of it compiling;
the JSON is rewritten after every shape, so a run cut short keeps what it measured. Figures: docs/MODELS.md.
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch
import triton
import triton.language as tl

from tools.ab_timing import L2_FLUSH_BYTES, graph_us

SHAPES = {  # name: (K, N)
    "smollm2 qkv": (576, 960), "smollm2 o": (576, 576), "smollm2 gate_up": (576, 3072),
    "smollm2 down": (1536, 576), "qwen0.5b qkv": (896, 1152), "qwen0.5b gate_up": (896, 9728),
    "qwen0.5b down": (4864, 896), "qwen1.5b qkv": (1536, 2048), "qwen1.5b down": (8960, 1536),
}
LAYERS = 30


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, out_ptr, M, N, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr):
    pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * K + ks[None, :], mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0)
        w = tl.load(w_ptr + cols[:, None] * K + ks[None, :], mask=(cols[:, None] < N) & (ks[None, :] < K), other=0.0)
        if USE_DOT:
            acc += tl.dot(x, tl.trans(w))
        else:
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


def skinny(x, w, out, block_m, block_n, block_k, warps, stages):
    M, K = x.shape
    N = w.shape[0]
    use_dot = block_m >= 16
    grid = (triton.cdiv(N, block_n), triton.cdiv(M, block_m))
    _skinny_kernel[grid](x, w, out, M, N, K, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, USE_DOT=use_dot,
                         num_warps=warps, num_stages=stages)


_FLUSH = []  # the L2 flush buffer, made on first use (importing the module needs no GPU)


def per_layer_us(fn, reps=20):
    """Microseconds per projection of ``fn`` (a chain of ``LAYERS``), graph-replayed with the L2 flushed before each
    replay (``tools.ab_timing.graph_us``): a chain of small weights (30 x 0.66 MB) would otherwise stay in the 50 MB
    L2 across replays, which a model's 270 MB of weights never do."""
    if not _FLUSH:
        _FLUSH.append(torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device="cuda"))
    return graph_us(fn, _FLUSH[0], reps) / LAYERS


def configs(M, row_tile=None):
    block_ms = [row_tile] if row_tile else [1] if M == 1 else ([M] if M < 16 else [16, 32, 64][: 1 + (M > 16) + (M > 32)])
    for bm, bn, bk, warps, stages in itertools.product(block_ms, (8, 16, 32, 64), (128, 256), (2, 4), (1, 3)):
        if bm < 16 and bm * bn * bk > 32768:
            continue  # the broadcast product would spill
        if bm >= 16 and bn < 16:
            continue
        yield bm, bn, bk, warps, stages


def probe_shape(name, K, N, M, rows, row_tile=None):
    ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K**-0.5 for _ in range(LAYERS)]
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    outs = [torch.empty(M, N, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]
    ref = (x.float() @ ws[0].float().T)
    floor_us = (N * K * 2 + M * (K + N) * 2) / 4.8e12 * 1e6
    cublas = per_layer_us(lambda: [torch.matmul(x, w.T, out=o) for w, o in zip(ws, outs)])
    cublas_err = (outs[0].float() - ref).abs().max().item()
    row = {"shape": name, "K": K, "N": N, "M": M, "cublas_us": round(cublas, 2), "floor_us": round(floor_us, 2),
           "cublas_err": cublas_err}
    if M == 1:
        xv = x[0]
        row["mv_us"] = round(per_layer_us(lambda: [torch.mv(w, xv, out=o[0]) for w, o in zip(ws, outs)]), 2)
    best = None
    for cfg in configs(M, row_tile):
        try:
            us = per_layer_us(lambda: [skinny(x, w, o, *cfg) for w, o in zip(ws, outs)])
        except Exception as exc:  # noqa: BLE001 -- a config Triton cannot build is skipped
            print(name, M, cfg, "failed", type(exc).__name__)
            continue
        err = (outs[0].float() - ref).abs().max().item()
        if err > 4 * cublas_err + 1e-2:
            print(name, M, cfg, "wrong", err)
            continue
        if best is None or us < best[0]:
            best = (us, cfg, err)
    if best:
        row.update(triton_us=round(best[0], 2), triton_cfg=best[1], triton_err=best[2],
                   speedup=round(cublas / best[0], 3))
    print(json.dumps(row), flush=True)
    rows.append(row)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--ms", default="1,2,4,8,16,32", help="comma-separated row counts M")
    parser.add_argument("--shapes", default="", help="only the shapes whose name starts with this")
    parser.add_argument("--row-tile", type=int, default=None,
                        help="the Triton kernel's row tile at every M (>= 16: the tensor-core form; rows past M masked)")
    args = parser.parse_args()
    rows = []
    for name, (K, N) in SHAPES.items():
        if not name.startswith(args.shapes):
            continue
        for M in (int(m) for m in args.ms.split(",")):
            probe_shape(name, K, N, M, rows, args.row_tile)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
