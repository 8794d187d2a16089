"""Tree attention's fixed cost per launch, from its time against the context length: ``python -m
tools.wave_cost_fit [--reps 30] [--out FILE]``.

For 7B geometry at T = 16 (112 query rows per KV head: one 128-row tile) and batch sizes around two waves of one
program per SM (B = 64: 256 programs on 132 SMs; B = 66: two full waves; B = 33: one wave, where the plan splits the
context), both backends' graph-replayed times (L2 flushed) at L = 1k-16k, bf16 caches, the plan's own split. Per
(B, backend) it fits ``time = intercept + slope * L`` over L >= 2048: the slope is the streaming rate (bytes per
token over it: the bandwidth while streaming), the intercept the cost paid whatever the context (per wave: prologue,
pipeline fill, epilogue), which is what keeps a short context below its HBM floor (docs/TREE_ATTENTION.md, "The fixed
cost per wave").
"""
from __future__ import annotations

import json

import numpy as np
import torch

from bench.suites.tree_attention import case_inputs
from tools.ab_timing import graph_us, run_ab

CASES = [(B, L) for B in (33, 64, 66) for L in (1024, 2048, 4096, 8192, 16384)]
BACKENDS = ("cuda", "triton")
MIN_FIT_L = 2048  # shorter contexts run split differently at B = 33; every fit uses the same lengths


def measure(B, L, flush, reps):
    """Case (7B, B, L, T = 16): each backend's median replay time (us) and the plan's split."""
    inp, plan_for = case_inputs("qwen2.5-7b", B, L, 16)
    plan, q, k, v = plan_for(), inp["q"], inp["k_cache"], inp["v_cache"]
    row = dict(B=B, L=L, split_len=plan.split_len, num_splits=plan.num_splits)
    for backend in BACKENDS:
        out = torch.full_like(q, float("nan"))  # poisoned: a row the kernel leaves unwritten shows as NaN
        row[backend] = round(graph_us(lambda o=out, be=backend: plan.run(q, k, v, out=o, backend=be), flush, reps), 2)
        row[f"{backend}_nan"] = bool(out.isnan().any())
    return row


def fit_fixed_cost(rows, min_length: int = MIN_FIT_L) -> list:
    """Per (B, backend) with at least two lengths >= ``min_length``: ``slope_us_per_token`` and ``intercept_us`` of
    the least-squares line through (L, time)."""
    fits = []
    for B in sorted({r["B"] for r in rows}):
        points = sorted((r["L"], r) for r in rows if r["B"] == B and r["L"] >= min_length)
        if len(points) < 2:
            continue
        lengths = np.array([L for L, _ in points], dtype=np.float64)
        for backend in BACKENDS:
            slope, intercept = np.polyfit(lengths, [r[backend] for _, r in points], 1)
            fits.append(dict(B=B, backend=backend, slope_us_per_token=round(float(slope), 5),
                             intercept_us=round(float(intercept), 1)))
    return fits


def main(argv=None) -> int:
    rows = []

    def measure_and_keep(B, L, flush, reps):
        rows.append(measure(B, L, flush, reps))
        return rows[-1]

    status = run_ab(__doc__.split("\n\n")[0], CASES, measure_and_keep, default_reps=30, argv=argv)
    for fit in fit_fixed_cost(rows):
        print(json.dumps(fit))
    return status


if __name__ == "__main__":
    raise SystemExit(main())
