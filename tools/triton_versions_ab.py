"""Versions of tree attention's Triton module timed in one process: a speed regression bisected over git history, or a
candidate change A/B'd against the installed kernel, in one device call (the GPU machine's copy has no .git).

    python -m tools.triton_versions_ab prepare REV[,REV...] [--dir DIR]          (here, in the git checkout)
    python -m tools.triton_versions_ab run [--dir DIR] [--cases 7b:64x4096x16,...] [--rounds 2] [--reps 40]
                                          [--out FILE]                                               (GPU)

``prepare`` writes ``tlt_kernels/_triton/tree_attention.py`` as it was at each REV (``worktree``: the file as it is
now, e.g. with a candidate patch applied) to ``DIR/<REV>.py``, its relative imports made absolute so it loads beside
the installed package (DIR defaults to an ignored folder; carry it to the GPU machine). ``run`` loads every
``DIR/*.py`` and, per case of the tree-attention suite's ``--cases`` syntax, plans once with the installed op and calls
each version's ``run_triton(plan, q, k, v, out, sm_scale)`` (bf16 rows, bf16 or ``--caches e4m3`` caches; one plan for
all: a version whose kernel wants another plan's fields, or reads no fp8, fails and is reported, not timed). Rows: each
version's largest difference from the installed module's output, and its time per round (graph replays, the L2
flushed before each, ``tools.ab_timing``; every version and the installed module once a round, so drift shows).

Used to find what slowed the T = 16 Triton rows (docs/TREE_ATTENTION.md, "What the page-id bounds check costs")."""
from __future__ import annotations

import argparse
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

MODULE_PATH = "tlt_kernels/_triton/tree_attention.py"
DEFAULT_DIR = ".peer/triton_versions"  # ignored by git where .peer/ is (../shared/peers/README.md)
_RELATIVE_IMPORT = re.compile(r"^(\s*)from (\.+)([\w.]*) import", re.M)


def absolute_imports(source: str, package: str = "tlt_kernels._triton") -> str:
    """``source`` of a module of ``package`` with its relative imports (``from .x``, ``from ..y``, ``from .``) made
    absolute, so a copy of it loads from any path."""
    def absolute(match):
        indent, dots, rest = match.groups()
        parts = package.split(".")
        base = parts[: len(parts) - (len(dots) - 1)]
        target = ".".join(base + ([rest] if rest else []))
        return f"{indent}from {target} import"

    return _RELATIVE_IMPORT.sub(absolute, source)


def module_source(rev: str, root: Path) -> str:
    """The Triton tree-attention module at git revision ``rev`` (``worktree``: as the file is now)."""
    if rev == "worktree":
        return (root / MODULE_PATH).read_text()
    return subprocess.run(["git", "show", f"{rev}:{MODULE_PATH}"], cwd=root, check=True, capture_output=True,
                          text=True).stdout


def prepare(revs, out_dir: Path, root: Path) -> list:
    """Writes each revision's module to ``out_dir/<rev>.py``; returns the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for rev in revs:
        path = out_dir / f"{re.sub(r'[^A-Za-z0-9_]', '_', rev)}.py"
        path.write_text(absolute_imports(module_source(rev, root)))
        paths.append(path)
    return paths


def load_versions(directory: Path) -> dict:
    """``{name: module}`` for every ``*.py`` in ``directory``, in name order."""
    versions = {}
    for path in sorted(directory.glob("*.py")):
        spec = importlib.util.spec_from_file_location(f"triton_version_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        versions[path.stem] = module
    return versions


def _case_rows(case, caches, versions, rounds, reps, flush) -> list:
    """One row per version (and the installed module, ``installed``) at ``case`` = ``(model, B, L, T, _)`` over
    ``caches`` (``bf16``, or ``e4m3``: the same values stored as e4m3, planned for them, scales 1)."""
    import torch

    import tlt_kernels._triton.tree_attention as installed
    from bench.suites.tree_attention import HEAD_DIM, case_inputs
    from tools.ab_timing import graph_us, side_differences

    model, B, L, T, _ = case
    inp, plan_for = case_inputs(model, B, L, T, kv_dtype=torch.float8_e4m3fn if caches == "e4m3" else None)
    plan = plan_for()
    q, k, v, scale = inp["q"], inp["k_cache"], inp["v_cache"], HEAD_DIM ** -0.5
    sides = {"installed": installed, **versions}
    rows, outs = {}, {}
    for name, module in sides.items():
        out = torch.full_like(q, float("nan"))
        rows[name] = dict(model=model, B=B, L=L, T=T, caches=caches, version=name, splits=plan.num_splits, us=[])
        try:
            module.run_triton(plan, q, k, v, out, scale)
            outs[name] = out
        except Exception as exc:  # noqa: BLE001 - an old version may not run today's plan: report it, time the rest
            rows[name]["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    for name, diff in side_differences(outs)[0].items():  # the installed module ran first: it is the reference
        rows[name]["max_diff"] = diff
    for _ in range(rounds):  # each round times every side once, so drift between rounds shows on all of them
        for name, module in sides.items():
            if "error" not in rows[name]:
                fn = (lambda m=module, o=outs[name]: m.run_triton(plan, q, k, v, o, scale))
                rows[name]["us"].append(round(graph_us(fn, flush, reps), 2))
    return list(rows.values())


def _parse_args(argv):
    """The command line: ``prepare REVS`` or ``run``."""
    from bench.suites.tree_attention import parse_cases

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="write the module at each git revision (here, in the checkout)")
    prep.add_argument("revs", help="comma-separated git revisions; worktree: the file as it is now")
    run = sub.add_parser("run", help="time every prepared version against the installed module (GPU)")
    run.add_argument("--cases", type=parse_cases, default=parse_cases("7b:64x4096x16,7b:64x16384x16"))
    run.add_argument("--caches", default="bf16", choices=["bf16", "e4m3"], help="the K/V caches' storage")
    run.add_argument("--rounds", type=int, default=2, help="timings of each version, alternated")
    run.add_argument("--reps", type=int, default=40, help="replays per median")
    run.add_argument("--out", default=None, help="write the rows as JSON here")
    for p in (prep, run):
        p.add_argument("--dir", default=DEFAULT_DIR, help="where the versions' files are")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = _parse_args(argv)
    if args.command == "prepare":
        for path in prepare(args.revs.split(","), Path(args.dir), Path.cwd()):
            print(path)
        return 0
    import torch

    from tools.ab_timing import L2_FLUSH_BYTES

    if not torch.cuda.is_available():
        print("run needs a CUDA GPU", file=sys.stderr)
        return 2
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device="cuda")
    versions, rows = load_versions(Path(args.dir)), []
    for case in args.cases:
        for row in _case_rows(case, args.caches, versions, args.rounds, args.reps, flush):
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
