"""Benchmark harness: timing, the HBM floor, peer comparison and the JSON / Markdown report.

A suite is a module ``bench/suites/<name>.py`` defining ``SUITE = "<name-with-dashes>"`` and
``run(ctx)``; it times each implementation of each case with :meth:`BenchContext.time_ms` and
records a row with :meth:`BenchContext.add`. The harness derives, per row:

* ``pct_hbm_floor`` = 100 * (bytes_moved / copy_bandwidth) / ms: how close the kernel comes to the
  time a device-to-device copy of the same bytes takes (100% = as fast as a copy; the copy is
  measured in the same run, on the same card, so no datasheet figure enters the report);
* ``speedup_vs[other]`` = ms(other) / ms(this) for every other impl of the same case
  (> 1: this impl is faster).

Timing is the median of many runs: ``triton.testing.do_bench`` (which flushes L2 between runs) on
CUDA, CUDA events without Triton, ``time.perf_counter`` on the CPU, where numbers are smoke tests
only (small sizes, Triton in its interpreter).
"""
from __future__ import annotations

import datetime as _dt
import importlib
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch

from .records import case_key

COPY_BYTES = 1 << 30  # the copy that defines the HBM floor: 1 GiB (256 MiB when small)
COPY_BYTES_SMALL = 256 << 20

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

# Measured once per device per process, so `python -m bench all` pays for it once.
_COPY_BW_CACHE: Dict[str, float] = {}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {name!r}") from None


def _json_value(v: Any) -> Any:
    """Make an ``extra`` / ``case`` value JSON-friendly (tensors and numpy scalars become numbers)."""
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        return v.item()
    if isinstance(v, (list, tuple)):
        return [_json_value(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _json_value(x) for k, x in v.items()}
    if hasattr(v, "item"):  # numpy scalar
        return v.item()
    return str(v)


@dataclass
class Row:
    case: Dict[str, Any]
    impl: str
    ms: float
    bytes_moved: Optional[int] = None
    extra: Dict[str, Any] = field(default_factory=dict)


def time_cpu_ms(fn: Callable[[], Any], reps: int = 5, budget_s: float = 1.0) -> float:
    """Median wall time of ``fn()`` in ms: one warm-up call, then up to ``reps`` runs within ``budget_s``."""
    fn()
    times = []
    start = time.perf_counter()
    while len(times) < reps:
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
        if len(times) >= 3 and time.perf_counter() - start > budget_s:
            break
    return statistics.median(times)


def measure_copy_bandwidth(device: torch.device, nbytes: int, time_ms: Callable[[Callable[[], Any]], float]) -> float:
    """Bytes/s (read + write) of an ``nbytes`` device-to-device copy timed by ``time_ms`` (median ms of a callable)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src))
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / (ms * 1e-3)


def capture_graph(fn: Callable[[], Any]) -> "torch.cuda.CUDAGraph":
    """A CUDA graph of one ``fn()`` call, after one warm-up call on a side stream (lazy initialization and autotuning
    stay out of the capture)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def time_cuda_events_ms(fn: Callable[[], Any], warmup: int = 10, reps: int = 50) -> float:
    """Median of ``reps`` runs timed with CUDA events, after ``warmup`` calls (used without Triton)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def _git_commit(given: Optional[str] = None) -> Optional[str]:
    # The GPU machine gets a copy of the working tree without .git: the caller passes the commit (--git-commit).
    if given:
        return given
    root = Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        if sha.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True, text=True, timeout=10)
        return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def environment(device: torch.device, git_commit: Optional[str] = None) -> Dict[str, Any]:
    """Everything needed to reproduce or compare a figure: card, software versions, commit (``git_commit`` when
    given, else asked of git), date, command."""
    env: Dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(shlex.quote(a) for a in [Path(sys.executable).name, "-m", "bench", *sys.argv[1:]]),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device_type": device.type,
        "triton_interpret": os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception:
        env["triton"] = None
    try:
        import tlt_kernels

        env["tlt_kernels"] = tlt_kernels.__version__
        env["tlt_cuda_extension"] = tlt_kernels.cuda_extension_available()
    except Exception as exc:  # the harness must still report a broken package
        env["tlt_kernels"] = f"import failed: {type(exc).__name__}: {exc}"
    env["git_commit"] = _git_commit(git_commit)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env["gpu"] = props.name
        env["sm_count"] = props.multi_processor_count
        env["compute_capability"] = f"{props.major}.{props.minor}"
        env["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
    else:
        env["cpu"] = platform.processor() or platform.machine()
        env["cpu_threads"] = torch.get_num_threads()
    return env


class BenchContext:
    """What a suite's ``run(ctx)`` sees. See the module docstring for the derived columns.

    Args:
        suite: the suite's name (for the report).
        device: where the suite runs.
        dtype: the activation dtype the suite should use (bf16 by default).
        small: tiny sizes; forced on when ``device`` is not CUDA.
        copy_bandwidth: bytes/s override (tests); by default measured lazily on CUDA, None on CPU.
        params: the suite's parameters (its flags, see :mod:`bench.flags`); None: every flag's default.
        show_progress: print every row and note as it is recorded (``--progress``).
    """

    def __init__(
        self,
        suite: str,
        device: "torch.device | str" = "cpu",
        dtype: torch.dtype = torch.bfloat16,
        small: bool = False,
        copy_bandwidth: Optional[float] = None,
        params: Any = None,
        show_progress: bool = False,
    ):
        self.suite = suite
        self.params = params
        self.show_progress = bool(show_progress)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype = dtype
        self.small = bool(small) or self.device.type != "cuda"
        self._copy_bw = copy_bandwidth
        self.rows: List[Row] = []
        self.notes: List[str] = []
        self._peers: Dict[str, Any] = {}
        self.peer_versions: Dict[str, str] = {}  # peer -> its version, or why it was unavailable (for the record)
        self._keys = set()

    # -- timing -------------------------------------------------------------------------------
    def time_ms(self, fn: Callable[[], Any]) -> float:
        """Median milliseconds of one ``fn()`` call (see the module docstring for the method)."""
        if self.device.type == "cuda":
            with torch.cuda.device(self.device):
                try:
                    from triton.testing import do_bench
                except Exception:
                    return time_cuda_events_ms(fn)
                return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))
        return time_cpu_ms(fn)

    def time_graph_ms(self, fn: Callable[[], Any]) -> float:
        """Median ms of replaying a CUDA graph of ``fn`` (warmed up on a side stream, then captured): the GPU
        time an engine sees when it replays the op inside its step graph, without Python dispatch."""
        if self.device.type != "cuda":
            raise RuntimeError("time_graph_ms needs a CUDA device")
        graph = capture_graph(fn)
        torch.cuda.synchronize()
        return self.time_ms(graph.replay)

    @property
    def copy_bytes(self) -> int:
        return COPY_BYTES_SMALL if self.small else COPY_BYTES

    @property
    def copy_bandwidth(self) -> Optional[float]:
        """Bytes/s (read + write) of a large device-to-device copy on this device; None on the CPU."""
        if self._copy_bw is not None or self.device.type != "cuda":
            return self._copy_bw
        key = f"{self.device}:{self.copy_bytes}"
        if key not in _COPY_BW_CACHE:
            _COPY_BW_CACHE[key] = measure_copy_bandwidth(self.device, self.copy_bytes, self.time_ms)
        self._copy_bw = _COPY_BW_CACHE[key]
        return self._copy_bw

    # -- recording ----------------------------------------------------------------------------
    def add(self, case: Dict[str, Any], impl: str, ms: float, bytes_moved: Optional[int] = None, **extra) -> None:
        """Record one measurement. ``case`` identifies the problem; rows sharing it are compared."""
        if not isinstance(case, dict):
            raise TypeError(f"case must be a dict of case parameters, got {type(case).__name__}")
        if not isinstance(impl, str) or not impl:
            raise ValueError(f"impl must be a non-empty string, got {impl!r}")
        try:
            ms = float(ms)
        except (TypeError, ValueError):
            raise TypeError(f"ms must be a number, got {type(ms).__name__}") from None
        if not math.isfinite(ms) or ms <= 0:
            raise ValueError(f"ms must be a positive finite time, got {ms} (suite {self.suite!r}, impl {impl!r}, case {case})")
        if bytes_moved is not None:
            if isinstance(bytes_moved, bool) or int(bytes_moved) != bytes_moved or bytes_moved < 0:
                raise ValueError(f"bytes_moved must be a non-negative integer or None, got {bytes_moved!r}")
            bytes_moved = int(bytes_moved)
        case = {str(k): _json_value(v) for k, v in case.items()}
        key = (case_key(case), impl)
        if key in self._keys:
            raise ValueError(f"duplicate row: impl {impl!r} already recorded for case {case}")
        self._keys.add(key)
        self.rows.append(Row(case, impl, ms, bytes_moved, {k: _json_value(v) for k, v in extra.items()}))
        self.progress(f"{impl} {case} {ms:.4g} ms")

    def note(self, text: str) -> None:
        self.notes.append(str(text))
        self.progress(f"note: {text}")

    def progress(self, text: str) -> None:
        """Print ``text`` now when ``show_progress`` (``--progress``): a run cut off by a time limit keeps what it
        measured in the log (the JSON and the report are written at the end)."""
        if self.show_progress:
            print(f"   [{self.suite}] {text}", flush=True)

    def try_import(self, name: str):
        """Import an optional peer (e.g. ``"flashinfer"``); None when it fails, with the reason noted."""
        if name in self._peers:
            return self._peers[name]
        try:
            mod = importlib.import_module(name)
        except Exception as exc:
            self.note(f"peer {name} unavailable: {type(exc).__name__}: {exc}")
            self.peer_versions[name] = f"unavailable: {type(exc).__name__}: {exc}"
            mod = None
        else:
            self.note(f"peer {name} {getattr(mod, '__version__', '(version unknown)')} available")
            self.peer_versions[name] = str(getattr(mod, "__version__", "version unknown"))
        self._peers[name] = mod
        return mod

    # -- derived columns ----------------------------------------------------------------------
    def derived_rows(self) -> List[Dict[str, Any]]:
        """The rows as dicts with ``gbps``, ``pct_hbm_floor`` and ``speedup_vs`` filled in."""
        by_case: Dict[str, List[Row]] = {}
        for r in self.rows:
            by_case.setdefault(case_key(r.case), []).append(r)
        bw = self.copy_bandwidth
        out = []
        for r in self.rows:
            d: Dict[str, Any] = {"case": r.case, "impl": r.impl, "ms": r.ms, "bytes_moved": r.bytes_moved}
            d["gbps"] = r.bytes_moved / (r.ms * 1e6) if r.bytes_moved is not None else None
            d["pct_hbm_floor"] = 100.0 * (r.bytes_moved / bw) / (r.ms * 1e-3) if (r.bytes_moved is not None and bw) else None
            d["speedup_vs"] = {o.impl: o.ms / r.ms for o in by_case[case_key(r.case)] if o is not r}
            d.update(r.extra)
            out.append(d)
        return out


# -- reports ------------------------------------------------------------------------------------
def _fmt(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def speedup_text(ratio: float, other: str) -> str:
    """``ratio`` = ms(other) / ms(this) as words: '2.00x faster than other' / '1.25x slower than other'."""
    if ratio >= 1.0:
        return f"{ratio:.2f}x faster than {other}"
    return f"{1.0 / ratio:.2f}x slower than {other}"


def geomean(xs: List[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def render_markdown(result: Dict[str, Any]) -> str:
    """One suite's report: environment line, the table, peer summary, notes, and a failure if any."""
    env = result["env"]
    lines = [f"## {result['suite']}", ""]
    if env.get("device_type") == "cuda":
        where = f"{env.get('gpu')} ({env.get('sm_count')} SMs, CUDA {env.get('cuda')})"
    else:
        interp = ", Triton in its interpreter" if env.get("triton_interpret") else ""
        where = f"CPU ({env.get('cpu')}, {env.get('cpu_threads')} threads{interp}; smoke-test timings, not measurements)"
    bw = result.get("copy_bandwidth")
    bw_text = f"copy bandwidth {bw / 1e9:.0f} GB/s ({result['copy_bytes'] >> 20} MiB d2d copy, read+write)" if bw else "no HBM floor (CPU)"
    lines.append(
        f"{where}; dtype {result['dtype']}; small={result['small']}; {bw_text}; torch {env.get('torch')}, "
        f"triton {env.get('triton')}, tlt-kernels {env.get('tlt_kernels')} @ {env.get('git_commit')}; {env.get('date')}"
    )
    lines += ["", f"`{env.get('command')}`", ""]
    rows = result["rows"]
    if rows:
        case_cols: List[str] = []
        extra_cols: List[str] = []
        fixed = {"case", "impl", "ms", "bytes_moved", "gbps", "pct_hbm_floor", "speedup_vs"}
        for r in rows:
            case_cols += [k for k in r["case"] if k not in case_cols]
            extra_cols += [k for k in r if k not in fixed and k not in extra_cols]
        has_bytes = any(r["gbps"] is not None for r in rows)
        has_floor = any(r["pct_hbm_floor"] is not None for r in rows)
        header = case_cols + ["impl", "ms"] + ["GB/s"] * has_bytes + ["% HBM floor"] * has_floor
        header += extra_cols + ["vs others (same case)"]
        lines.append("| " + " | ".join(header) + " |")
        lines.append("|" + "|".join("---" for _ in header) + "|")
        for r in rows:
            pct = r["pct_hbm_floor"]
            cells = [_fmt(r["case"].get(c)) for c in case_cols]
            cells += [r["impl"], _fmt(r["ms"])] + [_fmt(r["gbps"])] * has_bytes
            cells += [f"{pct:.1f}" if pct is not None else ""] * has_floor
            cells += [_fmt(r.get(c)) for c in extra_cols]
            cells.append(_comparisons(r))
            lines.append("| " + " | ".join(cells) + " |")
        summary = _peer_summary(rows)
        if summary:
            lines += ["", "Geometric-mean speedup over the cases both impls ran:", ""]
            lines += summary
    else:
        lines.append("(no rows recorded)")
    if result.get("notes"):
        lines += ["", "Notes:", ""] + [f"- {n}" for n in result["notes"]]
    if result["status"] == "stopped":
        lines += ["", f"**Suite STOPPED** after {result['seconds']:.1f} s ({result['error'].strip()}): the rows above are "
                  "the cases it finished; the rest were not run."]
    elif result["status"] != "ok":
        lines += ["", f"**Suite FAILED** after {result['seconds']:.1f} s:", "", "```", result["error"].rstrip(), "```"]
    return "\n".join(lines) + "\n"


MAX_COMPARISONS = 6


def _comparisons(row: Dict[str, Any]) -> str:
    """The row's speed-ups, ours against peers: a tlt-* row lists the non-tlt impls of its case and
    vice versa (all others when that leaves none); at most MAX_COMPARISONS, the JSON has every one."""
    sv = row["speedup_vs"]
    mine = row["impl"].startswith("tlt")
    shown = {k: v for k, v in sv.items() if k.startswith("tlt") != mine} or sv
    items = list(shown.items())
    text = "; ".join(speedup_text(v, k) for k, v in items[:MAX_COMPARISONS])
    if len(items) > MAX_COMPARISONS:
        text += f"; ... {len(items) - MAX_COMPARISONS} more in the JSON"
    return text


def _peer_summary(rows: List[Dict[str, Any]]) -> List[str]:
    """'tlt-x is G x faster than peer (min..max over N cases)' for each tlt impl vs each other impl."""
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    ours = [i for i in impls if i.startswith("tlt")]
    out = []
    for mine in ours:
        for other in impls:
            if other == mine:
                continue
            ratios = [r["speedup_vs"][other] for r in rows if r["impl"] == mine and other in r["speedup_vs"]]
            if not ratios:
                continue
            g = geomean(ratios)
            n = len(ratios)
            out.append(f"- {mine}: {speedup_text(g, other)} (ms({other}) / ms({mine}) from {min(ratios):.2f} to {max(ratios):.2f} over {n} case{'s' * (n > 1)})")
    return out


@dataclass
class SuiteResult:
    suite: str
    status: str  # "ok" | "failed" | "stopped"
    data: Dict[str, Any]
    markdown: str


class SuiteStopped(BaseException):
    """Raised inside a running suite when the process is told to stop (``python -m bench`` turns SIGTERM, e.g.
    ``timeout`` at gpu_check's deadline, into it): the suite's report is still written with the rows it measured.
    A ``BaseException``, like ``KeyboardInterrupt``, so a suite's ``except Exception`` (a peer that fails) does not
    swallow it."""


def run_suite(suite: str, run: Callable[[BenchContext], None], device: torch.device, dtype: torch.dtype, small: bool,
              out_dir: Optional[Path] = None, copy_bandwidth: Optional[float] = None, params: Any = None,
              show_progress: bool = False, git_commit: Optional[str] = None) -> SuiteResult:
    """Run one suite, never raising: a failure is recorded (with its traceback) next to the partial rows, and a
    :class:`SuiteStopped` as status ``"stopped"`` with the rows measured before it. ``params``, ``show_progress``:
    see :class:`BenchContext`; ``git_commit``: the commit to report (default: asked of git)."""
    ctx = BenchContext(suite, device, dtype, small, copy_bandwidth=copy_bandwidth, params=params,
                       show_progress=show_progress)
    t0 = time.perf_counter()
    error = None
    stopped = False
    try:
        run(ctx)
    except SuiteStopped as exc:
        stopped, error = True, f"{exc}\n"
    except Exception:
        error = traceback.format_exc()
    try:
        rows = ctx.derived_rows()
        bw = ctx.copy_bandwidth
    except Exception:  # e.g. the device died mid-suite; keep the report
        error = (error or "") + "while deriving columns:\n" + traceback.format_exc()
        rows, bw = [], None
    data = {
        "suite": suite,
        "status": "stopped" if stopped else "ok" if error is None else "failed",
        "error": error,
        "seconds": time.perf_counter() - t0,
        "dtype": str(dtype).replace("torch.", ""),
        "small": ctx.small,
        "copy_bandwidth": bw,
        "copy_bytes": ctx.copy_bytes,
        "env": environment(ctx.device, git_commit),
        "rows": rows,
        "peers": ctx.peer_versions,
        "notes": ctx.notes,
    }
    md = render_markdown(data)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"{suite}.json").write_text(json.dumps(data, indent=1) + "\n")
        (out_dir / f"{suite}.md").write_text(md)
    return SuiteResult(suite, data["status"], data, md)
