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

from bench.suites.tree_attention import LONG_TAIL_CASES, case_inputs
from tlt_kernels._triton import tree_attention as tk
from tools.ab_timing import run_ab, side_differences, time_module_sides

SIDES = {
    "walk": dict(WIDE_MERGE_MIN_SPLITS=1 << 30),
    "default": dict(WIDE_MERGE_MIN_SPLITS=tk.WIDE_MERGE_MIN_SPLITS),
    "wide": dict(WIDE_MERGE_MIN_SPLITS=2),
}


def measure_case(B, L, T, flush, reps):
    """One case's row: each side's time (us) and its largest difference from the first side's output."""
    inp, plan_for = case_inputs("qwen2.5-7b", B, L, T)
    q, k, v = inp["q"], inp["k_cache"], inp["v_cache"]
    plan = plan_for()
    outs, us = time_module_sides(tk, SIDES, lambda out: plan.run(q, k, v, out=out, backend="triton"), q, flush, reps)
    diffs, nan = side_differences(outs)
    return dict(B=B, L=L, T=T, splits=plan.num_splits, us={s: round(t, 2) for s, t in us.items()},
                max_diff=diffs, nan=nan)


def main(argv=None) -> int:
    return run_ab(__doc__.split("\n\n")[0], LONG_TAIL_CASES, measure_case, default_reps=30, argv=argv)


if __name__ == "__main__":
    raise SystemExit(main())
