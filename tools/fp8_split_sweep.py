"""Tree attention's Triton kernel over e4m3 caches at the long-tail shapes where it trails FlashInfer's XQA fp8: the
split length and the key tile swept at each case, XQA fp8 beside them; graph replays with the L2 flushed.

    python -m tools.fp8_split_sweep [--reps 40] [--out FILE] [--cases B,L,T;...] [--splits 128,256,...]

Prints one JSON line per (case, split length, key tile) with its time over the default's (the split planned for e4m3
caches) and over XQA fp8's, and writes them all as JSON (GPU only; XQA fp8 needs FlashInfer 0.6.18+, else its column
is None)."""
from __future__ import annotations

from unittest import mock

import torch

import tlt_kernels._triton.tree_attention as tk
from bench.suites.tree_attention import case_inputs, xqa_call
from tools.ab_timing import graph_us, sweep_main

CASES = "1,4096,1;2,4096,1;4,4096,1;8,4096,1;16,4096,1;1,16384,1;2,16384,1;16,16384,1;16,4096,4;16,16384,8"
SPLITS = "128,192,256,384,512,768,1024,2048"


def measure(fi, B, L, T, splits, flush, reps):
    inp, plan = case_inputs("qwen2.5-7b", B, L, T, kv_dtype=torch.float8_e4m3fn)  # plan(): the library's split
    q, k8, v8, out = inp["q"], inp["k_cache"], inp["v_cache"], torch.empty_like(inp["q"])
    default = plan()
    want = default.run(q, k8, v8, backend="triton").float()
    base = min(graph_us(lambda: default.run(q, k8, v8, out=out, backend="triton"), flush, reps)
               for _ in range(2))
    call = None if fi is None else xqa_call(fi, inp, L)
    xqa = min(graph_us(call, flush, reps) for _ in range(2)) if call else None
    rows = []
    for split_len in splits:
        p = plan(split_len)
        for min_split in (0, 1 << 30):  # 128-key tiles at every split, or never (rows <= 32 only)
            with mock.patch.object(tk, "FP8_WIDE_TILE_MIN_SPLIT", min_split):
                got = p.run(q, k8, v8, out=torch.full_like(out, float("nan")), backend="triton")
                err = (got.float() - want).abs().max().item()
                us = min(graph_us(lambda: p.run(q, k8, v8, out=out, backend="triton"), flush, reps)
                         for _ in range(2))
            rows.append(dict(B=B, L=L, T=T, split_len=split_len, splits=p.num_splits, keys=128 if min_split == 0 else 64,
                             us=round(us, 2), default_us=round(base, 2), default_split=default.split_len,
                             xqa_us=None if xqa is None else round(xqa, 2), over_default=round(us / base, 3),
                             over_xqa=None if xqa is None else round(us / xqa, 3), max_err=err))
    return rows


def main(argv=None) -> int:
    try:
        import flashinfer as fi
    except ImportError:
        fi = None

    def _measure(args, B, L, T, splits, flush):
        return measure(fi, B, L, T, [s for s in splits if s < L + 64], flush, args.reps)

    return sweep_main(__doc__.split("\n\n")[0], CASES, SPLITS, _measure, argv=argv)


if __name__ == "__main__":
    raise SystemExit(main())
