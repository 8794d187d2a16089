"""Where the adaptive engine loses time against the per-batch-size oracle, bin by bin (CPU; no GPU needed).

Reads the step logs the e2e suite writes with ``--write-steps steps.json`` and, for one adaptive row, prints per
batch-size bin (the oracle's bins, ``bench.suites.e2e.batch_bin``): the row's seconds there, what the best static
arm of that bin would have taken for the same tokens, the difference, the strategies the row played, and which arm
was best. Usage::

    python -m tools.selector_vs_oracle steps.json [--row "adaptive (warm)"] [--statics "(spot drafter)"]

``--statics``: the static rows to take the oracle over, by a substring of their names ("(spot drafter)": the arms
with the adaptive engine's drafter; "static-": every static row).
"""
from __future__ import annotations

import argparse
import json
from collections import Counter
from types import SimpleNamespace
from typing import Dict, List

from bench.suites.e2e import batch_bin, oracle_bins


def _run(steps: List[dict]) -> SimpleNamespace:
    return SimpleNamespace(steps=[SimpleNamespace(**s) for s in steps])


def compare(logs: Dict[str, List[dict]], row: str, statics: str) -> List[dict]:
    """One dict per bin of ``row`` (largest batch sizes first): batches (min, max), steps, seconds, oracle_s (None
    where no static row has the bin), lost_s, played (strategy -> steps), best (the bin's best static row)."""
    if row not in logs:
        raise KeyError(f"no row {row!r} in the step logs (rows: {sorted(logs)})")
    chosen = {k: _run(v) for k, v in logs.items() if k.startswith("static-") and statics in k}
    if not chosen:
        raise KeyError(f"no static row matches {statics!r} (rows: {sorted(logs)})")
    ref = _run(logs[row])
    bins = oracle_bins(chosen, ref)
    played: Dict[int, Counter] = {}
    for s in ref.steps:
        played.setdefault(batch_bin(s.batch_size), Counter())[s.strategy] += 1
    out = []
    for k in sorted(bins, reverse=True):
        e = bins[k]
        oracle = e["tokens"] / e["rate"] if e["rate"] > 0 else None
        out.append(dict(batches=(min(e["batches"]), max(e["batches"])), steps=sum(played[k].values()), seconds=e["seconds"],
                        oracle_s=oracle, lost_s=None if oracle is None else e["seconds"] - oracle,
                        played=dict(played[k].most_common()), best=e["best"]))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("steps", help="the JSON the e2e suite wrote with --write-steps")
    ap.add_argument("--row", default="adaptive (warm)")
    ap.add_argument("--statics", default="(spot drafter)")
    args = ap.parse_args(argv)
    with open(args.steps) as f:
        logs = json.load(f)
    rows = compare(logs, args.row, args.statics)
    print(f"{args.row} against the best static row per bin (static rows matching {args.statics!r})")
    print(f"{'batch':>9} {'steps':>5} {'s':>7} {'oracle':>7} {'lost':>7}  played | best")
    for r in rows:
        o = "-" if r["oracle_s"] is None else f"{r['oracle_s']:.3f}"
        lost = "-" if r["lost_s"] is None else f"{r['lost_s']:+.3f}"
        played = ", ".join(f"{k} x{v}" for k, v in r["played"].items())
        print(f"{r['batches'][0]:>4}-{r['batches'][1]:<4} {r['steps']:>5} {r['seconds']:7.3f} {o:>7} {lost:>7}  {played} | {r['best']}")
    lost = sum(r["lost_s"] for r in rows if r["lost_s"] is not None)
    print(f"total: {sum(r['seconds'] for r in rows):.3f} s in steps, {lost:+.3f} s against the oracle")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
