"""The run of record of a suite on a card: ``bench/results/<card>/<suite>.json``.

``python -m bench <suite> --record`` writes one file per suite and card; a later ``--record`` run replaces it (git
keeps the history), so the folder holds exactly one run per suite and card, the one the report
(``python -m bench report``) turns into docs/PERFORMANCE.md and the README's Performance table.

A record holds: ``suite``, ``card``, ``command``, ``commit``, ``date``, ``status``, ``versions`` (torch, triton,
cuda, driver, device, python, tlt_kernels), ``dtype``, ``copy_bandwidth``, ``rows`` (as the harness derives them:
``case``, ``impl``, ``ms``, ``bytes_moved``, ``gbps``, ``pct_hbm_floor``, ``speedup_vs`` and the suite's extra
columns), ``peers`` (each peer library measured in the same run: version, or why it was unavailable, and its
impls), ``units`` (what each row column means) and ``notes``. Records converted from the former run log carry
``source``.

A suite too long for one call is recorded in parts (``--record-merge``, :func:`merge_part`): every part is a run of
the same commit on the same card, each case's rows come from the one run that measured them (so every ratio in a row
is between impls of the same run), and the record lists the runs in ``runs`` (command, date, versions, copy
bandwidth, cases); each row names its run by index in ``run``.
"""
from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any, Dict, List, Optional

RESULTS_DIR = Path(__file__).resolve().parent / "results"

# What each row column holds; a suite's own columns are described in its module docstring.
UNITS: Dict[str, str] = {
    "ms": "milliseconds per call, median of many timed runs",
    "bytes_moved": "the minimal bytes the op must read and write (each suite says what it counts)",
    "gbps": "bytes_moved / time, in GB/s",
    "pct_hbm_floor": "percent of the HBM floor: time of a device-to-device copy of bytes_moved (copy timed in the same run) over the op's time",
    "speedup_vs": "per other impl of the same case: ms(other) / ms(this); > 1 means this impl is faster",
    "tflops": "tensor-core TFLOP/s achieved",
    "pct_roofline": "percent of max(HBM floor, tensor-core floor)",
    "tokens_per_s": "generated tokens per second over the whole rollout",
    "speedup_vs_plain": "rollout time of plain decoding over this row's, same run",
    "tail_speedup_vs_plain": "the same over the tail (batch < B/4)",
    "speedup_vs_best_static": "time of the best static strategy as deployed (frozen drafter) over this row's",
    "accept_rate": "fraction of drafted tokens accepted",
}

# Files of bench/results/<card>/ that are records of other kinds (test and sanitizer runs), not suites.
OTHER_RECORDS = ("gpu_tests", "sanitizer")


def card_slug(device_name: Optional[str]) -> str:
    """A short name for a card: 'NVIDIA H100 80GB HBM3' -> 'h100', 'NVIDIA H200' -> 'h200'; no GPU -> 'cpu'."""
    if not device_name:
        return "cpu"
    match = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", device_name.upper())
    if match:
        return match.group(1).lower()
    return re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-") or "gpu"


def driver_version() -> Optional[str]:
    """The NVIDIA driver's version from nvidia-smi; None where it is not installed."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.strip().splitlines()
    return lines[0].strip() if out.returncode == 0 and lines else None


def _peers(result: Dict[str, Any]) -> Dict[str, Any]:
    """Each peer library the suite tried, with its version (or why it failed) and the impls measured beside ours."""
    peer_impls = sorted({r["impl"] for r in result["rows"] if not r["impl"].startswith("tlt")})
    peers: Dict[str, Any] = {}
    for name, version in (result.get("peers") or {}).items():
        peers[name] = {"version": version, "impls": [i for i in peer_impls if i.startswith(name)]}
    peers["impls"] = peer_impls
    return peers


def build_record(result: Dict[str, Any], driver: Optional[str] = None) -> Dict[str, Any]:
    """The record of one suite run, from :func:`bench.harness.run_suite`'s ``data``."""
    env = result["env"]
    columns = {k for r in result["rows"] for k in r}
    return {
        "suite": result["suite"],
        "card": card_slug(env.get("gpu")),
        "command": env.get("command"),
        "commit": env.get("git_commit"),
        "date": env.get("date"),
        "status": result["status"],
        "versions": {
            "torch": env.get("torch"), "triton": env.get("triton"), "cuda": env.get("cuda"), "driver": driver,
            "device": env.get("gpu") or env.get("cpu"), "python": env.get("python"),
            "tlt_kernels": env.get("tlt_kernels"),
        },
        "dtype": result.get("dtype"),
        "small": result.get("small"),
        "copy_bandwidth": result.get("copy_bandwidth"),
        "rows": result["rows"],
        "peers": _peers(result),
        "units": {k: v for k, v in UNITS.items() if k in columns},
        "notes": result.get("notes", []),
    }


def record_path(root: Path, card: str, suite: str) -> Path:
    return Path(root) / card / f"{suite}.json"


def write_record(record: Dict[str, Any], root: Path = RESULTS_DIR) -> Path:
    """Replace ``<root>/<card>/<suite>.json`` with ``record``; returns the path."""
    path = record_path(root, record["card"], record["suite"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


def load_records(root: Path = RESULTS_DIR) -> Dict[str, Dict[str, Dict[str, Any]]]:
    """``{card: {suite: record}}`` for every ``<root>/<card>/<name>.json``, test/sanitizer records included."""
    records: Dict[str, Dict[str, Dict[str, Any]]] = {}
    for path in sorted(Path(root).glob("*/*.json")):
        records.setdefault(path.parent.name, {})[path.stem] = json.loads(path.read_text())
    return records


def flat_rows(record: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The record's rows as flat dicts: the case's parameters beside ``impl``, ``ms`` and the other columns."""
    out = []
    for row in record.get("rows", []):
        flat = dict(row.get("case", {}))
        flat.update({k: v for k, v in row.items() if k != "case"})
        out.append(flat)
    return out


# What every part of a record made in parts must share with the others.
_PART_KEYS = ("suite", "card", "commit", "dtype", "small")
# The per-run fields of a record, kept per part in ``runs``.
_RUN_KEYS = ("command", "date", "versions", "copy_bandwidth")


def case_key(case: Dict[str, Any]) -> str:
    """A case's identity (its parameters, key order ignored): rows with the same key are compared."""
    return json.dumps(case, sort_keys=True)


def _runs_of(record: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The record's runs: its ``runs``, or itself as the only one (a record made in one call)."""
    if record.get("runs"):
        return [dict(r) for r in record["runs"]]
    cases = {case_key(r["case"]) for r in record["rows"]}
    return [dict({k: record.get(k) for k in _RUN_KEYS}, cases=len(cases))]


def merge_part(old: Optional[Dict[str, Any]], new: Dict[str, Any]) -> Dict[str, Any]:
    """``new`` (one run) added to the run of record ``old`` as a part: its cases' rows replace any rows ``old`` had for
    them. No ``old``: ``new`` as it is. Raises ValueError naming the field when they are not parts of one recording
    (another suite, card, commit, dtype or size)."""
    if old is None:
        return new
    for key in _PART_KEYS:
        if old.get(key) != new.get(key):
            raise ValueError(f"--record-merge: the run of record's {key} is {old.get(key)!r}, this run's "
                             f"{new.get(key)!r}; record the suite anew with --record alone")
    runs = _runs_of(old)
    old_rows = [dict(r, run=r.get("run", 0)) for r in old["rows"]]
    new_cases = {case_key(r["case"]) for r in new["rows"]}
    kept = [r for r in old_rows if case_key(r["case"]) not in new_cases]
    runs.append(dict({k: new.get(k) for k in _RUN_KEYS}, cases=len(new_cases)))
    merged = dict(old, runs=runs, rows=kept + [dict(r, run=len(runs) - 1) for r in new["rows"]])
    merged["peers"] = _merged_peers(old.get("peers") or {}, new.get("peers") or {})
    merged["units"] = dict(old.get("units") or {}, **(new.get("units") or {}))
    merged["notes"] = list(dict.fromkeys((old.get("notes") or []) + (new.get("notes") or [])))
    merged["status"] = "ok" if old.get("status") == new.get("status") == "ok" else new.get("status")
    return merged


def _merged_peers(old: Dict[str, Any], new: Dict[str, Any]) -> Dict[str, Any]:
    """Both parts' peers: each library with the versions its parts ran (one, normally) and the impls measured."""
    peers: Dict[str, Any] = {}
    for name in dict.fromkeys([*old, *new]):
        if name == "impls":
            continue
        a, b = old.get(name) or {}, new.get(name) or {}
        versions = list(dict.fromkeys(v for v in (a.get("version"), b.get("version")) if v is not None))
        peers[name] = {"version": versions[0] if len(versions) == 1 else versions,
                       "impls": sorted(set(a.get("impls", [])) | set(b.get("impls", [])))}
    peers["impls"] = sorted(set(old.get("impls", [])) | set(new.get("impls", [])))
    return peers
