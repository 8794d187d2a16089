"""Same-run A/B of tree attention's Triton kernel over an fp8 (e4m3) V cache read as bytes against read as 32-bit words
(``FP8_V_WORDS``), on the suite's long-tail cases where the word read applies (T <= 4 at 7B: row tiles of at most
``FP8_V_WORDS_MAX_BLOCK_M``), graph-replayed with the L2 flushed before each replay; the two outputs must be equal bit
for bit.

    python -m tools.fp8_words_ab [--reps 30] [--out FILE]

Prints one line per case and writes the rows as JSON (GPU only). Each side's time is the better of two medians of
``--reps`` replays, the sides alternated.
"""
from __future__ import annotations

import torch

from bench.suites.tree_attention import HEAD_DIM, LONG_TAIL_CASES, MODELS, PAGE, _make_inputs
from tlt_kernels._triton import tree_attention as tk
from tlt_kernels.ops import tree_attention as op
from tools.ab_timing import run_ab, time_module_sides

HQ, HKV = MODELS["qwen2.5-7b"]
SIDES = {"bytes": dict(FP8_V_WORDS=False), "words": dict(FP8_V_WORDS=True)}
CASES = [(B, L, T) for B, L, T in LONG_TAIL_CASES
         if tk.kernel_config(HEAD_DIM, T * (HQ // HKV))[0] <= tk.FP8_V_WORDS_MAX_BLOCK_M]


def measure_case(B, L, T, flush, reps):
    """One case's row: the byte and word reads' times (us) and whether their outputs are the same bits."""
    inp = _make_inputs(B, L, T, HQ, HKV, HEAD_DIM, torch.bfloat16, "cuda")
    q = inp["q"]
    k, v = (inp[name].to(torch.float8_e4m3fn) for name in ("k_cache", "v_cache"))
    plan = op.plan_tree_attention(inp["parents"], inp["context_lens"], inp["block_table"], num_q_heads=HQ,
                                  num_kv_heads=HKV, head_dim=HEAD_DIM, block_size=PAGE, max_context_len=L)
    outs, us = time_module_sides(tk, SIDES, lambda out: plan.run(q, k, v, out=out, backend="triton"), q, flush, reps)
    return dict(B=B, L=L, T=T, splits=plan.num_splits, us={s: round(t, 2) for s, t in us.items()},
                same_bits=torch.equal(outs["bytes"], outs["words"]), nan=bool(outs["words"].isnan().any()))


def main(argv=None) -> int:
    return run_ab(__doc__.split("\n\n")[0], CASES, measure_case, default_reps=30, argv=argv)


if __name__ == "__main__":
    raise SystemExit(main())
