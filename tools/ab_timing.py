"""What the same-run A/B tools share (``split_rule_ab``, ``merge_ab``, ``hoist_tree_ab``, ``skinny_linear_probe``,
the split sweeps ``fp8_split_sweep`` and ``small_model_split_sweep``, and ``fp8_config_sweep``): graph replays timed
with the L2 flushed before each, sides that differ by module settings timed alternately, and the command lines that
time every case, print one JSON line per row and write them all as JSON."""
from __future__ import annotations

import argparse
import json
import time
from typing import Callable, Dict, Iterable, Tuple
from unittest import mock

import torch

from bench.harness import capture_graph

L2_FLUSH_BYTES = 256 * 1024 * 1024


def graph_us(fn, flush: torch.Tensor, reps: int) -> float:
    """Median microseconds of replaying a CUDA graph of ``fn``, the L2 flushed before each replay."""
    graph = capture_graph(fn)
    times = []
    for _ in range(reps):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def time_module_sides(module, sides: Dict[str, dict], run: Callable, like: torch.Tensor, flush: torch.Tensor,
                      reps: int) -> Tuple[Dict[str, torch.Tensor], Dict[str, float]]:
    """Each side's output and time (us): ``run(out)`` with ``module``'s settings ``sides[side]`` (patched for that
    side's call and capture only), into an output poisoned with NaN like ``like``; each time the better of two medians
    of ``reps`` graph replays, the sides alternated."""
    outs = {side: torch.full_like(like, float("nan")) for side in sides}
    for side, out in outs.items():
        with mock.patch.multiple(module, **sides[side]):
            run(out)
    us = {side: float("inf") for side in sides}
    for _ in range(2):
        for side, out in outs.items():
            with mock.patch.multiple(module, **sides[side]):  # the side's settings for this timing only
                us[side] = min(us[side], graph_us(lambda o=out: run(o), flush, reps))
    return outs, us


def side_differences(outs: Dict[str, torch.Tensor]) -> Tuple[Dict[str, float], bool]:
    """Each side's largest difference from the first side's output, and whether any output holds a NaN."""
    first = next(iter(outs.values())).float()
    diffs = {side: (out.float() - first).abs().max().item() for side, out in outs.items()}
    return diffs, any(out.isnan().any().item() for out in outs.values())


def run_ab(description: str, cases: Iterable, measure: Callable, default_reps: int, argv=None) -> int:
    """``--reps`` / ``--out``; ``measure(*case, flush, reps)`` returns a row (dict) or a list of rows per case."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--reps", type=int, default=default_reps, help="replays per median")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit(f"{parser.prog} needs a CUDA GPU")
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device="cuda")
    rows, t0 = [], time.time()
    for case in cases:
        got = measure(*case, flush, args.reps)
        for row in got if isinstance(got, list) else [got]:
            rows.append(row)
            print(json.dumps(row), f"t={time.time() - t0:.0f}s", flush=True)
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def sweep_main(description: str, cases: str, splits: str, measure: Callable, add_arguments=None, argv=None) -> int:
    """The split sweeps' command line: ``--reps``, ``--out``, ``--cases "B,L,T;..."`` (default ``cases``) and
    ``--splits "S,..."`` (default ``splits``), plus what ``add_arguments(parser)`` adds; ``measure(args, B, L, T,
    splits, flush)`` returns a case's rows, printed as JSON lines as they come and written to ``--out``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--reps", type=int, default=40, help="replays per median")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    parser.add_argument("--cases", default=cases, help="cases as B,L,T;...")
    parser.add_argument("--splits", default=splits, help="split lengths as S,...")
    if add_arguments is not None:
        add_arguments(parser)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit(f"{parser.prog} needs a CUDA GPU")
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device="cuda")
    split_lens = [int(s) for s in args.splits.split(",")]
    return time_cases(args.cases, lambda B, L, T: measure(args, B, L, T, split_lens, flush), args.out)


def time_cases(cases: str, measure_case: Callable, out=None) -> int:
    """The sweeps' loop: ``measure_case(B, L, T)``'s rows for each case of ``cases`` (``"B,L,T;..."``), printed as
    JSON lines as they come and written to ``out`` (a path, or None)."""
    rows = []
    for case in cases.split(";"):
        B, L, T = (int(x) for x in case.split(","))
        for row in measure_case(B, L, T):
            rows.append(row)
            print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()
    if out:
        with open(out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0
