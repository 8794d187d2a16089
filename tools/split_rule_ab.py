"""Same-run A/B of tree attention's default split against the rule before it, on every tree-attention suite case
(main and long-tail) where the two choose differently: both backends, graph-replayed, L2 flushed before each replay.

The earlier rule (``previous_split_len``, the default before the balanced cap): rows in one program took the even
split at two programs per SM where its splits held >= 1024 tokens, else about one program per SM (lengths rounded
down); chunked rows as now.

    python -m tools.split_rule_ab [--reps 40] [--out FILE]

Prints one line per (case, backend) and writes the rows as JSON (GPU only). Each side's time is the better of two
medians of ``--reps`` replays, the sides alternated.
"""
from __future__ import annotations

import torch

from bench.suites.tree_attention import CASES, HEAD_DIM, LONG_TAIL_CASES, MODELS, case_inputs
from tlt_kernels.ops import tree_attention as op
from tools.ab_timing import graph_us, run_ab

SM_COUNT = 132  # the suite's cards (H100 / H200 SXM)


def previous_split_len(batch_size: int, num_kv_heads: int, max_context_len: int, num_rows: int) -> int:
    """The default split before the balanced cap (see the module docstring)."""
    chunked, programs = op._split_programs(batch_size, num_kv_heads, num_rows, HEAD_DIM)
    align = op._split_align(num_rows, HEAD_DIM)
    if not chunked:
        even = op._even_split_len(2, SM_COUNT, programs, chunked, max_context_len, align)
        if even >= 1024:
            return even
    want = op._clamp_splits(-(-SM_COUNT // programs), chunked, max_context_len)
    if want == 1:
        return op._whole_tiles(max_context_len, align)
    return max(op.MIN_SPLIT_LEN, max_context_len // want // align * align)


def changed_cases():
    """``(model, B, L, T, previous split_len, default split_len)`` of the suite's cases where the rules differ."""
    cases = [(m, *c) for m in MODELS for c in CASES] + [("qwen2.5-7b", *c) for c in LONG_TAIL_CASES]
    for model, B, L, T in cases:
        Hq, Hkv = MODELS[model]
        rows = T * (Hq // Hkv)
        old = previous_split_len(B, Hkv, L, rows)
        new = op.default_split_len(B, Hkv, L, SM_COUNT, rows, HEAD_DIM)
        if old != new:
            yield model, B, L, T, old, new


def measure_case(model, B, L, T, old_len, new_len, flush, reps):
    """Rows of one case: each backend, each rule's plan, sides alternated twice."""
    inp, plan_for = case_inputs(model, B, L, T)
    q, k, v = inp["q"], inp["k_cache"], inp["v_cache"]
    plans = {"previous": plan_for(old_len), "default": plan_for(new_len)}
    out = torch.empty_like(q)
    rows = []
    for backend in ("triton", "cuda"):
        us = {side: min(graph_us(lambda p=plan: p.run(q, k, v, out=out, backend=backend), flush, reps)
                        for _ in range(2)) for side, plan in plans.items()}
        rows.append(dict(model=model, B=B, L=L, T=T, backend=backend, previous_splits=plans["previous"].num_splits,
                         default_splits=plans["default"].num_splits, previous_us=round(us["previous"], 2),
                         default_us=round(us["default"], 2), ratio=round(us["default"] / us["previous"], 3)))
    return rows


def main(argv=None) -> int:
    return run_ab(__doc__.split("\n\n")[0], changed_cases(), measure_case, default_reps=40, argv=argv)


if __name__ == "__main__":
    raise SystemExit(main())
