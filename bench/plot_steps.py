"""Tokens/s over the rollout from the e2e suite's step logs (``python -m bench e2e --write-steps steps.json``), as a PNG (CPU; needs
matplotlib). The tail is where the curves part: plain decoding's tokens/s falls with the batch, speculation's less.
Usage::

    python -m bench.plot_steps steps.json --rows "plain,static-s4k2v8,adaptive (warm)" --out tail.png
"""
from __future__ import annotations

import argparse
import json
from types import SimpleNamespace
from typing import Dict, List, Sequence

from bench.suites.e2e import _plot


def load_rows(logs: Dict[str, List[dict]], rows: Sequence[str]) -> Dict[str, SimpleNamespace]:
    """``{row: run}`` in the order given, each run with ``steps`` (``elapsed_s``, ``tokens_per_s``, ``batch_size``)
    and ``wall_s`` (the last step's end), the shape ``bench.suites.e2e._plot`` draws."""
    missing = [r for r in rows if r not in logs]
    if missing:
        raise KeyError(f"no rows {missing} in the step logs (rows: {sorted(logs)})")
    out = {}
    for r in rows:
        steps = [SimpleNamespace(elapsed_s=s["elapsed_s"], batch_size=s["batch_size"],
                                 tokens_per_s=s["emitted"] / s["seconds"] if s["seconds"] > 0 else float("inf"))
                 for s in logs[r]]
        out[r] = SimpleNamespace(steps=steps, wall_s=steps[-1].elapsed_s if steps else 0.0)
    return out


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("steps", help="step logs written by the e2e suite (--write-steps)")
    ap.add_argument("--rows", default="plain,adaptive", help="comma-separated row names")
    ap.add_argument("--out", default="e2e_tokens_per_s.png")
    args = ap.parse_args(argv)
    with open(args.steps) as f:
        logs = json.load(f)
    msg = _plot(load_rows(logs, [r.strip() for r in args.rows.split(",") if r.strip()]), args.out)
    print(msg)
    return msg


if __name__ == "__main__":
    main()
