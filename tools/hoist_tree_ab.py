"""Same-run A/B of where tree attention's Triton partial kernel loads the tree's operands (``HOIST_TREE_MAX_BYTES``):

* ``after``: after the context loop, as before;
* ``hoisted``: before the loop where ``hoists_tree`` says so (the default), also over one-byte caches (which the
  default keeps after the loop: ``HOIST_TREE_ONE_BYTE``), else after.

Cases: SmolLM2-135M's shapes (9 / 3 heads, D = 64; contexts of a chat rollout), then the tree-attention suite's 7B
long-tail and main cases with trees of at most 16 nodes (D = 128), bf16, and the long-tail cases with T <= 4 over
e4m3 caches (``qwen2.5-7b fp8``: bf16 rows), pages of 16, each plan the library's default for its context and cache.

    python -m tools.hoist_tree_ab [--reps 30] [--out FILE]

Prints one line per case and writes the rows as JSON (GPU only). Each side's time is the better of two medians of
``--reps`` graph replays (L2 flushed before each), the sides alternated; every side's output is checked against the
first side's.
"""
from __future__ import annotations

import torch

from bench.suites.tree_attention import CASES, HEAD_DIM, LONG_TAIL_CASES, MODELS, PAGE, _make_inputs
from tlt_kernels._triton import tree_attention as tk
from tlt_kernels.ops import tree_attention as op
from tools.ab_timing import run_ab, side_differences, time_module_sides

SIDES = {
    "after": dict(HOIST_TREE_MAX_BYTES=0),
    "hoisted": dict(HOIST_TREE_MAX_BYTES=tk.HOIST_TREE_MAX_BYTES, HOIST_TREE_ONE_BYTE=True),
}
SMOLLM2 = (9, 3, 64)  # query heads, KV heads, head dim
SMALL_CASES = [("smollm2", B, L, T) for B in (1, 4, 32) for L in (128, 256, 512, 1024) for T in (1, 3, 5, 16)]
LARGE_CASES = [("qwen2.5-7b", B, L, T) for B, L, T in LONG_TAIL_CASES + CASES if T <= 16]
FP8_CASES = [("qwen2.5-7b fp8", B, L, T) for B, L, T in LONG_TAIL_CASES if T <= 4]


def measure_case(model, B, L, T, flush, reps):
    """One case's row: each side's time (us) and its largest difference from the first side's output."""
    name, _, kv = model.partition(" ")
    Hq, Hkv, D = SMOLLM2 if name == "smollm2" else (*MODELS[name], HEAD_DIM)
    inp = _make_inputs(B, L, T, Hq, Hkv, D, torch.bfloat16, "cuda")
    q, k, v = inp["q"], inp["k_cache"], inp["v_cache"]
    if kv == "fp8":
        k, v = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
    plan = op.plan_tree_attention(inp["parents"], inp["context_lens"], inp["block_table"], num_q_heads=Hq,
                                  num_kv_heads=Hkv, head_dim=D, block_size=PAGE, max_context_len=L, kv_dtype=k.dtype)
    outs, us = time_module_sides(tk, SIDES, lambda out: plan.run(q, k, v, out=out, backend="triton"), q, flush, reps)
    diffs, nan = side_differences(outs)
    return dict(model=model, B=B, L=L, T=T, splits=plan.num_splits, us={s: round(t, 2) for s, t in us.items()},
                hoisted_over_after=round(us["hoisted"] / us["after"], 3), max_diff=diffs,
                nan=nan)


def main(argv=None) -> int:
    return run_ab(__doc__.split("\n\n")[0], SMALL_CASES + LARGE_CASES + FP8_CASES, measure_case, default_reps=30, argv=argv)


if __name__ == "__main__":
    raise SystemExit(main())
