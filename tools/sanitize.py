"""Run GPU tests under NVIDIA compute-sanitizer and record the result as data.

    python tools/sanitize.py --out bench/results/<card>/sanitizer.json [--budget-s 480]

Each check is one pytest selection run as ``compute-sanitizer --tool <tool> python -m pytest ...`` with the caching
allocator off (``PYTORCH_NO_CUDA_MEMORY_CACHING=1``: every tensor is its own allocation, so memcheck sees an access
past a tensor's end instead of landing inside a cached block). memcheck runs over the CUDA and Triton kernels' test
files; racecheck over the CUDA kernels that share data through shared memory (verify_tree's and compact_kv's block
reductions and staging, tree attention's tiles). The record holds the command, commit, date, versions and, per check,
the sanitizer's error count and pytest's summary line. Exits non-zero if any check reports an error or a failed test.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parent.parent

# The CUDA acceptance kernels' test files (verify_tree, compact_kv, build_draft_tree, their shared glue).
ACCEPTANCE_CUDA_TESTS = [
    "tests/ops/test_verify_tree_cuda.py",
    "tests/ops/test_compact_kv_cuda.py",
    "tests/ops/test_build_draft_tree_cuda.py",
    "tests/ops/test_acceptance_cuda_glue.py",
]

# (tool, pytest arguments): small cases of every kernel; the sanitizers slow a launch by 10-100x.
CHECKS = [  # most recently changed kernels first: a budget that runs out skips the last ones
    # The partial kernel over fp8 caches: its staging ring (each thread refills only chunks it widened) and tree V.
    ("racecheck", ["tests/ops/test_tree_attention_fp8.py", "-k", "cuda_fp8_matches"]),
    ("memcheck", ["tests/ops/test_tree_attention_fp8.py", "-k", "cuda_fp8"]),
    ("memcheck", ["tests/ops/test_tree_attention_edge_cases.py", "-k", "nan_contract_on_cuda_paths or unchecked_out_of_range_page_on_cuda"]),
    ("memcheck", ["tests/ops/test_verify_tree_edge_cases.py", "-k", "cuda"]),
    ("racecheck", ["tests/ops/test_tree_attention_cuda.py", "-m", "not slow", "-k", "matches_reference"]),
    ("racecheck", ["tests/ops/test_compact_kv_cuda.py", "tests/ops/test_build_draft_tree_cuda.py", "-m", "not slow",
                   "-k", "compact_kv_exact or build_draft_tree_exact"]),
    ("memcheck", ["tests/ops/test_strides.py", "-k", "verify_tree or compact_kv or build_draft_tree"]),
    # Graph-capture tests are left out: without the caching allocator a capture's allocations are cudaMalloc calls,
    # which capture forbids, so they fail for the sanitizer's setting, not the kernels.
    ("memcheck", [*ACCEPTANCE_CUDA_TESTS, "-m", "not slow", "-k", "not graph"]),
    ("memcheck", ["tests/ops/test_tree_attention_cuda.py", "-m", "not slow", "-k", "not graph"]),
    ("racecheck", ["tests/ops/test_verify_tree_cuda.py", "-m", "not slow", "-k", "same_tokens"]),
    ("memcheck", ["tests/ops/test_verify_tree_triton.py", "-m", "not slow"]),
    ("memcheck", ["tests/ops/test_verify_tree.py", "-k", "same_tokens_as_reference and triton"]),
    # Triton kernels under memcheck: the edge-case paths (NaN rows, strided views, out-of-range page ids: clamped in
    # the context loop, so never read) and the strided launchers.
    ("memcheck", ["tests/ops/test_tree_attention_edge_cases.py", "-k",
                  "triton and (views or nan_in_an_attended_slot or unchecked_out_of_range_page_is_never_read)"]),
    ("memcheck", ["tests/ops/test_strides.py", "-k", "compact_kv or ngram"]),
]


def find_sanitizer() -> Optional[str]:
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        candidate = Path(root or "/nonexistent") / "bin" / "compute-sanitizer"
        if candidate.exists():
            return str(candidate)
    return None


def run_check(sanitizer: str, tool: str, pytest_args: List[str], timeout_s: float) -> Dict:
    cmd = [sanitizer, "--tool", tool, "--target-processes", "all", "--error-exitcode", "99",
           sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args]
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1")
    start = time.perf_counter()
    # A session of its own, so a timeout stops the sanitizer and the python it runs (which holds the GPU) together.
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, rc = proc.communicate(timeout=timeout_s)[0], proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, rc = proc.communicate()[0], None
    # memcheck: "ERROR SUMMARY: N errors"; racecheck: "RACECHECK SUMMARY: N hazards displayed (E errors, W warnings)".
    errors = [int(n) for n in re.findall(r"ERROR SUMMARY: (\d+) error", out)]
    errors += [int(n) for n in re.findall(r"RACECHECK SUMMARY: \d+ hazards? displayed \((\d+) error", out)]
    summary = [line for line in out.splitlines() if re.search(r"\d+ (passed|failed)", line) and "SUMMARY" not in line]
    return {
        "tool": tool, "pytest_args": pytest_args, "command": " ".join(cmd[:5] + ["python", "-m", "pytest"] + pytest_args),
        "seconds": round(time.perf_counter() - start, 1), "exit_code": rc, "timed_out": rc is None,
        "sanitizer_errors": sum(errors) if errors else None, "pytest": summary[-1].strip() if summary else None,
        "tail": out[-3000:] if (rc not in (0, None) or sum(errors or [0])) else "",
    }


def versions() -> Dict[str, str]:
    import torch
    import triton
    props = torch.cuda.get_device_properties(0)
    return {"torch": torch.__version__, "triton": triton.__version__, "cuda": str(torch.version.cuda),
            "device": props.name, "python": sys.version.split()[0]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the JSON record to write")
    parser.add_argument("--budget-s", type=float, default=480.0, help="seconds for all checks; later ones are skipped")
    parser.add_argument("--check-s", type=float, default=150.0, help="seconds one check may run (then: timed out)")
    parser.add_argument("--checks", default=None, help="comma-separated indices into CHECKS to run (default: all)")
    args = parser.parse_args()
    sanitizer = find_sanitizer()
    if sanitizer is None:
        print("compute-sanitizer not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin)", file=sys.stderr)
        return 2
    deadline = time.perf_counter() + args.budget_s
    rows = []
    chosen = [CHECKS[int(i)] for i in args.checks.split(",")] if args.checks else CHECKS
    for tool, pytest_args in chosen:
        left = deadline - time.perf_counter()
        if left < 20:
            rows.append({"tool": tool, "pytest_args": pytest_args, "skipped": "budget spent"})
            continue
        rows.append(run_check(sanitizer, tool, pytest_args, min(left, args.check_s)))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "tail"}), flush=True)
    record = {
        "suite": "sanitizer", "command": " ".join(["python", "tools/sanitize.py", *sys.argv[1:]]),
        "commit": os.environ.get("TLT_GIT_COMMIT"), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": versions(), "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    bad = [r for r in rows if r.get("sanitizer_errors") or r.get("exit_code") not in (0, None) or r.get("timed_out")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
