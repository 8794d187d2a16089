"""Same-run A/B of tree attention's Triton merge forms on the suite's long-tail cases (7B, bf16), graph-replayed with
the L2 flushed before each replay, every side's output checked against the first side's:

* ``walk``: the merge as before the split-parallel kernel (``WIDE_MERGE_MIN_SPLITS`` out of reach): in the partial
  kernel at <= ``FUSED_MERGE_MAX_ROWS`` rows, else the merge kernel walking the splits one after another;
* ``default``: the rule as shipped (the split-parallel merge kernel from ``WIDE_MERGE_MIN_SPLITS`` splits, else the
  walks above);
* ``wide``: the split-parallel merge kernel at every split count and row count (``WIDE_MERGE_MIN_SPLITS = 2``).

    python -m tools.merge_ab [--reps 30] [--out FILE]

Prints one line per case and writes the rows as JSON (GPU only). Each side's time is the better of two medians of
``--reps`` replays, the sides alternated.
"""
from __future__ import annotations

import torch

from bench.suites.tree_attention import HEAD_DIM, LONG_TAIL_CASES, MODELS, PAGE, _make_inputs
from tlt_kernels._triton import tree_attention as tk
from tlt_kernels.ops import tree_attention as op
from tools.ab_timing import run_ab, side_differences, time_module_sides

SIDES = {
    "walk": dict(WIDE_MERGE_MIN_SPLITS=1 << 30),
    "default": dict(WIDE_MERGE_MIN_SPLITS=tk.WIDE_MERGE_MIN_SPLITS),
    "wide": dict(WIDE_MERGE_MIN_SPLITS=2),
}


def measure_case(B, L, T, flush, reps):
    """One case's row: each side's time (us) and its largest difference from the first side's output."""
    Hq, Hkv = MODELS["qwen2.5-7b"]
    inp = _make_inputs(B, L, T, Hq, Hkv, HEAD_DIM, torch.bfloat16, "cuda")
    q, k, v = inp["q"], inp["k_cache"], inp["v_cache"]
    plan = op.plan_tree_attention(inp["parents"], inp["context_lens"], inp["block_table"], num_q_heads=Hq,
                                  num_kv_heads=Hkv, head_dim=HEAD_DIM, block_size=PAGE, max_context_len=L)
    outs, us = time_module_sides(tk, SIDES, lambda out: plan.run(q, k, v, out=out, backend="triton"), q, flush, reps)
    diffs, nan = side_differences(outs)
    return dict(B=B, L=L, T=T, splits=plan.num_splits, us={s: round(t, 2) for s, t in us.items()},
                max_diff=diffs, nan=nan)


def main(argv=None) -> int:
    return run_ab(__doc__.split("\n\n")[0], LONG_TAIL_CASES, measure_case, default_reps=30, argv=argv)


if __name__ == "__main__":
    raise SystemExit(main())
