"""CLI: ``python -m bench <suite|all> [suite ...] [--small] [--out DIR] [--device cuda|cpu] [--dtype bf16|fp16]
[--record [DIR]] [--progress] [--git-commit SHA] [suite flags ...]`` and ``python -m bench report [--check]``.

Each suite's parameters are flags (its module's ``FLAGS``, see :mod:`bench.flags`): ``python -m bench e2e --help``
lists the e2e suite's, e.g. ``python -m bench e2e --batch 64 --drift 0``. Name the suites first, then the flags; a
flag that no named suite declares is a usage error.

Writes ``DIR/<suite>.json`` and ``DIR/<suite>.md`` per suite and ``DIR/summary.md`` for the whole
invocation, and prints the Markdown. With ``--record`` each suite that completes also replaces its run of record,
``bench/results/<card>/<suite>.json`` (:mod:`bench.records`); ``report`` regenerates docs/PERFORMANCE.md and the
README's Performance table from those records (:mod:`bench.report`). A suite that raises is reported as failed and the next one
runs; the exit status is 1 when any suite failed, 2 on a usage error. On SIGTERM (``timeout`` at a
deadline) the running suite stops, its report keeps the rows it measured (status ``stopped``), the
summary is written, no further suite starts, and the exit status is 124.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import pkgutil
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from .flags import Flag, add_suite_flags, suite_values

from .records import RESULTS_DIR

DEFAULT_OUT = Path(__file__).resolve().parent / "out"


@dataclass
class SuiteSpec:
    name: str
    module: str
    run: Optional[Callable] = None
    error: Optional[str] = None  # why the module could not be used (import error, missing SUITE/run)
    flags: Tuple[Flag, ...] = ()  # the suite's parameters (its module's FLAGS)


def discover(package: str = "bench.suites") -> Dict[str, SuiteSpec]:
    """``{SUITE: spec}`` for every module of ``package``; a broken module is kept, under its file name."""
    pkg = importlib.import_module(package)
    specs: Dict[str, SuiteSpec] = {}
    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        modname = f"{package}.{info.name}"
        fallback = info.name.replace("_", "-")
        try:
            mod = importlib.import_module(modname)
        except Exception:
            specs[fallback] = SuiteSpec(fallback, modname, error=f"importing {modname} failed:\n{traceback.format_exc()}")
            continue
        name, run = getattr(mod, "SUITE", None), getattr(mod, "run", None)
        if not isinstance(name, str) or not callable(run):
            specs[fallback] = SuiteSpec(fallback, modname, error=f"{modname} must define SUITE (a str) and run(ctx)")
            continue
        if name in specs:
            specs[f"{name} ({modname})"] = SuiteSpec(name, modname, error=f"SUITE {name!r} is defined by both {specs[name].module} and {modname}")
            continue
        specs[name] = SuiteSpec(name, modname, run=run, flags=tuple(getattr(mod, "FLAGS", ())))
    return specs


def _lookup(specs: Dict[str, SuiteSpec], wanted: str) -> Optional[SuiteSpec]:
    if wanted in specs:
        return specs[wanted]
    norm = wanted.replace("_", "-")
    for spec in specs.values():  # also accept the module's file name
        if spec.name == norm or spec.module.rsplit(".", 1)[-1].replace("_", "-") == norm:
            return spec
    return None


def _parser(chosen: Sequence["SuiteSpec"] = (), add_help: bool = True) -> argparse.ArgumentParser:
    """The CLI's options, plus the flags of the ``chosen`` suites (one group per suite)."""
    p = argparse.ArgumentParser(
        prog="python -m bench", description="Benchmark tlt-kernels against its peers.", add_help=add_help,
        epilog="python -m bench SUITE --help lists that suite's flags. `python -m bench report [--check]` regenerates "
               "docs/PERFORMANCE.md and the README's Performance table from the runs of record in "
               "bench/results/<card>/<suite>.json (see --record).")
    p.add_argument("suites", nargs="*", help="suite names, or 'all' (see --list)")
    p.add_argument("--small", action="store_true", help="tiny sizes (always on for the CPU)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when available")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--list", action="store_true", help="list the suites and exit")
    p.add_argument("--record", nargs="?", type=Path, const=RESULTS_DIR, default=None, metavar="DIR",
                   help=f"make this run the run of record: replace DIR/<card>/<suite>.json for each suite that "
                        f"completes (default DIR {RESULTS_DIR}); then `python -m bench report` regenerates "
                        "docs/PERFORMANCE.md and the README table from the records. Without it only --out is written")
    p.add_argument("--record-merge", action="store_true",
                   help="with --record: add this run to the suite's run of record as a part (a suite too long for "
                        "one call, e.g. tree-attention's long-tail cases in several calls): the same commit and card, "
                        "its cases' rows replaced, the others kept, each row naming its run")
    p.add_argument("--progress", action="store_true",
                   help="print every row and note as it is recorded (a run cut off by a time limit keeps them in the log)")
    p.add_argument("--git-commit", metavar="SHA", default=None,
                   help="the commit to report (a copy of the tree without .git); default: asked of git")
    add_suite_flags(p, [(s.name, s.flags) for s in chosen])
    return p


def _choose(specs: Dict[str, SuiteSpec], names: Sequence[str]) -> Optional[List[SuiteSpec]]:
    """The named suites ('all': every one), deduplicated in order; None after printing an error for an unknown name."""
    chosen: List[SuiteSpec] = []
    for wanted in names:
        if wanted == "all":
            chosen += list(specs.values())
            continue
        spec = _lookup(specs, wanted)
        if spec is None:
            print(f"error: unknown suite {wanted!r}; available: {', '.join(specs)} (or 'all')", file=sys.stderr)
            return None
        chosen.append(spec)
    return list({id(s): s for s in chosen}.values())


def main(argv: Optional[List[str]] = None, specs: Optional[Dict[str, SuiteSpec]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["report"]:
        from .report import main as report_main

        return report_main(argv[1:])
    # First the suite names and the common options (the suites' flags are not known yet), then every flag against
    # the named suites' (a usage error, exit 2, for a flag none of them declares).
    args = _parser(add_help=False).parse_known_args(argv)[0]
    if not args.suites:
        _parser().parse_args(argv)  # --help, or a usage error for a flag of no suite
    device = _device(args.device)
    if device is None:
        return 2

    from .harness import parse_dtype

    specs = discover() if specs is None else specs
    chosen = _choose(specs, args.suites)
    if chosen is None:
        return 2
    args = _parser(chosen).parse_args(argv)
    if args.list:
        for name, spec in specs.items():
            print(f"{name:24s} {spec.module}" + ("  (BROKEN: " + spec.error.splitlines()[0] + ")" if spec.error else ""))
        return 0
    if not args.suites:
        print(f"error: name a suite or 'all'; available: {', '.join(specs)}", file=sys.stderr)
        return 2
    if args.record_merge and args.record is None:
        print("error: --record-merge adds a part to a run of record: it needs --record", file=sys.stderr)
        return 2

    status, reports, stopped = _run_suites(chosen, device, parse_dtype(args.dtype), args)
    failed = _write_summary(args.out, chosen, status, reports)
    if stopped:
        return 124
    return 1 if failed else 0


def _device(name: Optional[str]):
    """The device ``--device`` names (default: cuda when available); None, after an error, for CUDA without one."""
    import torch

    if name == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return None
    device = torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu" and not torch.cuda.is_available():
        # Like tests/conftest.py: Triton kernels run in the CPU interpreter. This must happen before
        # any @triton.jit function is defined, i.e. before the suites are imported. With a GPU the kernels may
        # already be compiled for it (a test process), so CPU runs there take the torch references instead.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return device


def _run_suites(chosen: Sequence[SuiteSpec], device, dtype, args):
    """Runs the suites in order until one is stopped by SIGTERM: ``(summary rows, Markdown reports, stopped)``."""
    status = []
    reports: List[str] = []
    stop = _StopOnSigterm()
    with stop:
        for spec in chosen:
            if stop.signalled:
                break
            status.append(_run_one(spec, device, dtype, args, reports, stop))
    return status, reports, stop.signalled


def _write_summary(out: Path, chosen: Sequence[SuiteSpec], status, reports: List[str]) -> List[str]:
    """Writes and prints the summary table (``out/summary.md`` with every report); returns the failed suites."""
    table = ["| suite | status | rows | seconds |", "|---|---|---|---|"]
    table += [f"| {n} | {s} | {r} | {t:.1f} |" for n, s, r, t in status]
    skipped = [s.name for s in chosen[len(status):]]
    if skipped:
        table.append("")
        table.append(f"Not started (stopped by SIGTERM): {', '.join(skipped)}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.md").write_text("# Benchmark summary\n\n" + "\n".join(table) + "\n\n" + "\n".join(reports))
    print("\n".join(table))
    print(f"reports in {out}")
    failed = [n for n, s, _, _ in status if s != "ok"]
    if failed:
        print(f"FAILED suites: {', '.join(failed)}", file=sys.stderr)
    return failed


class _StopOnSigterm:
    """While active, SIGTERM sets ``signalled`` and, when it arrives inside a suite's ``run(ctx)`` (``armed``),
    raises :class:`~bench.harness.SuiteStopped` there (once), so the harness writes the report of what the suite
    measured instead of the process dying with nothing written. Outside a suite (writing a report) it only stops
    the loop before the next suite."""

    def __init__(self):
        self.signalled = False
        self.armed = False
        self._previous = None

    def _handler(self, signum, frame):
        first = not self.signalled
        self.signalled = True
        if first and self.armed:
            from .harness import SuiteStopped

            raise SuiteStopped(f"stopped by signal {signum}, e.g. timeout at GPU_CHECK_DEADLINE")

    def __enter__(self):
        try:
            self._previous = signal.signal(signal.SIGTERM, self._handler)
        except ValueError:  # not the main thread: no handler, the old behaviour
            self._previous = None
        return self

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
        return False


def _run_one(spec: SuiteSpec, device, dtype, args, reports: List[str], stop: _StopOnSigterm):
    """Run one suite; returns its summary row ``(name, status, rows, seconds)`` and appends its Markdown."""
    from .harness import run_suite

    print(f"== running suite {spec.name} on {device} ...", flush=True)
    t0 = time.perf_counter()
    run = spec.run
    if run is None:
        err = spec.error

        def run(ctx, err=err):  # report the broken module as a failed suite
            raise RuntimeError(err)

    def armed(ctx, run=run):
        stop.armed = True
        try:
            run(ctx)
        finally:
            stop.armed = False

    res = run_suite(spec.name, armed, device, dtype, args.small, out_dir=args.out, params=suite_values(args, spec.flags),
                    show_progress=args.progress, git_commit=args.git_commit)
    print(res.markdown, flush=True)
    recorded = args.record is None or _record(res, args.record, args.record_merge)
    reports.append(res.markdown)
    status = res.status if recorded or res.status != "ok" else "not recorded"
    return spec.name, status, len(res.data["rows"]), time.perf_counter() - t0


def _record(res, root: Path, merge: bool = False) -> bool:
    """Replace the suite's run of record with this run, or with ``merge`` add it as a part (bench.records.merge_part);
    a failed or stopped run is never recorded. Returns whether the run was recorded."""
    from .records import build_record, driver_version, merge_part, record_path, write_record

    if res.status != "ok":
        print(f"not recorded: suite {res.suite} {res.status}", file=sys.stderr)
        return False
    record = build_record(res.data, driver=driver_version())
    if merge:
        path = record_path(root, record["card"], record["suite"])
        try:
            record = merge_part(json.loads(path.read_text()) if path.exists() else None, record)
        except ValueError as err:
            print(f"not recorded: {err}", file=sys.stderr)
            return False
    path = write_record(record, root)
    print(f"recorded {path}" + (f" (part {len(record.get('runs') or [None])})" if merge else ""), flush=True)
    return True


if __name__ == "__main__":
    sys.exit(main())
