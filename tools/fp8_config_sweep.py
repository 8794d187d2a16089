"""Tree attention's Triton kernel over e4m3 caches: the kernel configuration (key tile, warps, pipeline stages) swept
at the plan's split, against the default the library picks, XQA fp8 beside them; same-run, graph replays with the L2
flushed, the configs timed alternately.

    python -m tools.fp8_config_sweep [--reps 40] [--out FILE] [--cases "B,L,T;..."] [--configs "N:W:S;..."]

A config ``N:W:S`` forces ``CONFIG_OVERRIDE = (BLOCK_N, num_warps, num_stages)`` (the row tile stays the
library's). Prints one JSON line per (case, config) with its time over the default's and over XQA fp8's and its
largest difference from the default's output, and writes them all as JSON (GPU only; XQA fp8 needs FlashInfer
0.6.18+, else its column is None)."""
from __future__ import annotations

import argparse
from unittest import mock

import torch

import tlt_kernels._triton.tree_attention as tk
from bench.suites.tree_attention import case_inputs, xqa_call
from tools.ab_timing import L2_FLUSH_BYTES, graph_us, side_differences, time_cases, time_module_sides

# T = 4 / 8 cases: three where the H100 record at 7019f0d has XQA fp8 ahead of the default, two where it is behind.
CASES = "16,16384,8;16,65536,8;16,4096,4;16,16384,4;8,65536,8"
CONFIGS = "64:4:3;64:4:4;64:8:3;128:4:3;128:4:4;128:8:3;128:8:2"


def parse_configs(text: str):
    """``"N:W:S;..."`` as ``[(BLOCK_N, num_warps, num_stages), ...]``; ValueError naming the bad entry."""
    configs = []
    for entry in text.split(";"):
        parts = entry.split(":")
        if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"--configs: {entry!r} is not BLOCK_N:num_warps:num_stages")
        configs.append(tuple(int(p) for p in parts))
    return configs


def measure(fi, B, L, T, configs, flush, reps):
    """One row per config of case ``(B, L, T)`` (7B heads, e4m3 caches): its time, the default's, XQA fp8's."""
    inp, plan_for = case_inputs("qwen2.5-7b", B, L, T, kv_dtype=torch.float8_e4m3fn)
    q, k8, v8 = inp["q"], inp["k_cache"], inp["v_cache"]
    plan = plan_for()

    def run(out):
        return plan.run(q, k8, v8, out=out, backend="triton")

    sides, failed = {"default": {"CONFIG_OVERRIDE": None}}, []
    for cfg in configs:  # a config that does not compile (e.g. out of shared memory) is reported, not timed
        try:
            with mock.patch.object(tk, "CONFIG_OVERRIDE", cfg):
                run(torch.empty_like(q))
            sides["%d:%d:%d" % cfg] = {"CONFIG_OVERRIDE": cfg}
        except Exception as exc:  # noqa: BLE001 (Triton's compile errors have no common base)
            failed.append(dict(B=B, L=L, T=T, config="%d:%d:%d" % cfg, error=f"{type(exc).__name__}: {exc}"[:200]))
    outs, us = time_module_sides(tk, sides, run, torch.empty_like(q), flush, reps)
    diffs = side_differences(outs)[0]
    call = None if fi is None else xqa_call(fi, inp, L)
    xqa = min(graph_us(call, flush, reps) for _ in range(2)) if call else None
    block_m = tk.kernel_config(q.shape[-1], T * q.shape[2] // k8.shape[2], e4m3_split_len=plan.split_len)[0]
    return [dict(B=B, L=L, T=T, block_m=block_m, split_len=plan.split_len, config=side, us=round(us[side], 2),
                 over_default=round(us[side] / us["default"], 3),
                 over_xqa=None if xqa is None else round(us[side] / xqa, 3),
                 xqa_us=None if xqa is None else round(xqa, 2), max_diff=diffs[side],
                 nan=bool(outs[side].isnan().any()))
            for side in sides] + failed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=40, help="replays per median")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    parser.add_argument("--cases", default=CASES, help="cases as B,L,T;...")
    parser.add_argument("--configs", default=CONFIGS, help="configs as BLOCK_N:num_warps:num_stages;...")
    args = parser.parse_args(argv)
    configs = parse_configs(args.configs)
    if not torch.cuda.is_available():
        raise SystemExit(f"{parser.prog} needs a CUDA GPU")
    try:
        import flashinfer as fi
    except ImportError:
        fi = None
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device="cuda")
    return time_cases(args.cases, lambda B, L, T: measure(fi, B, L, T, configs, flush, args.reps), args.out)


if __name__ == "__main__":
    raise SystemExit(main())
