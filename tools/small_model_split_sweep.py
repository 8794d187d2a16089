"""Tree attention at a small model's shapes (SmolLM2-135M: 9 query heads, 3 KV heads, D = 64, pages of 16), where a
step of the rollout engine is a chain of latency-bound kernels: the split length swept at each case, beside the plan
the engine's graphs take (built during capture, so sized for the table's capacity, not the context).

    python -m tools.small_model_split_sweep [--reps 40] [--out FILE] [--cases B,L,T;...] [--splits 64,128,...]
        [--capacity 1024] [--backends triton,cuda] [--configs "64,4,3;32,2,2"]

Prints one JSON line per (case, backend, plan) with its time over the capture plan's, and writes them all as JSON
(GPU only). ``--configs`` adds Triton rows with the partial kernel's ``(BLOCK_N, num_warps, num_stages)`` forced
(``CONFIG_OVERRIDE``). Each time is the better of two medians of ``--reps`` graph replays, the L2 flushed before
each; every row's ``max_err`` is its output's largest difference from the torch reference's."""
from __future__ import annotations

from unittest import mock

import torch

from bench.suites.tree_attention import PAGE, _make_inputs
import tlt_kernels._triton.tree_attention as tk
from tlt_kernels.ops import tree_attention as op
from tools.ab_timing import graph_us, sweep_main

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 9, 3, 64  # SmolLM2-135M
CASES = "1,128,1;1,256,1;1,512,1;1,1024,1;1,256,3;1,256,16;4,256,1;4,512,3;32,256,1;32,512,3;32,256,16"
SPLITS = "64,128,192,256,512"


def _plan(inp, max_context_len: int, split_len=None):
    return op.plan_tree_attention(inp["parents"], inp["context_lens"], inp["block_table"], num_q_heads=NUM_Q_HEADS,
                                  num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, block_size=PAGE,
                                  max_context_len=max_context_len, split_len=split_len)


def _time(plan, inp, out, backend, flush, reps) -> float:
    run = lambda: plan.run(inp["q"], inp["k_cache"], inp["v_cache"], out=out, backend=backend)  # noqa: E731
    return min(graph_us(run, flush, reps) for _ in range(2))


def measure(B: int, L: int, T: int, splits, capacity: int, backends, flush, reps):
    """One case's rows: for each backend (``"triton"`` or ``"triton BLOCK_N,warps,stages"``, a forced config), the
    capture plan (``max_context_len`` = ``capacity``), the default plan for the real context, and every split
    length."""
    # The table holds `capacity` slots, as the engine's does; the context is L tokens.
    inp = _make_inputs(B, max(L, capacity), T, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, torch.bfloat16, "cuda")
    inp["context_lens"].fill_(L)
    want = _plan(inp, L).run(inp["q"], inp["k_cache"], inp["v_cache"], backend="torch").float()
    plans = [("capture", _plan(inp, capacity)), ("default", _plan(inp, L))]
    plans += [(f"split {s}", _plan(inp, capacity, s)) for s in splits if s < capacity + 64]
    rows = []
    for backend in backends:
        base = None
        kernel_backend, _, config = backend.partition(" ")
        override = tuple(int(x) for x in config.split(",")) if config else None
        for name, plan in plans:
            out = torch.full_like(inp["q"], float("nan"))
            try:
                with mock.patch.object(tk, "CONFIG_OVERRIDE", override):
                    got = plan.run(inp["q"], inp["k_cache"], inp["v_cache"], out=out, backend=kernel_backend).float()
                    us = _time(plan, inp, out, kernel_backend, flush, reps)
            except (RuntimeError, ValueError) as e:
                rows.append(dict(B=B, L=L, T=T, backend=backend, plan=name, error=str(e)[:200]))
                continue
            base = us if base is None else base
            rows.append(dict(B=B, L=L, T=T, backend=backend, plan=name, splits=plan.num_splits,
                             split_len=plan.split_len, us=round(us, 2), over_capture=round(us / base, 3),
                             max_err=(got - want).abs().max().item()))
    return rows


def _arguments(parser) -> None:
    parser.add_argument("--capacity", type=int, default=1024, help="slots per request of the engine's table")
    parser.add_argument("--backends", default="triton,cuda")
    parser.add_argument("--configs", default="", help="forced Triton configs BLOCK_N,warps,stages;...")


def _measure(args, B, L, T, splits, flush):
    backends = args.backends.split(",") + [f"triton {c}" for c in args.configs.split(";") if c]
    return measure(B, L, T, splits, args.capacity, backends, flush, args.reps)


def main(argv=None) -> int:
    return sweep_main(__doc__.split("\n\n")[0], CASES, SPLITS, _measure, _arguments, argv)


if __name__ == "__main__":
    raise SystemExit(main())
