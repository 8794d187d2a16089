"""Reward and rollout time per RL step from the rl suite's report (``bench/results/<card>/rl.json`` or ``--out``'s
``rl.json``), one line per way, as a PNG (CPU; needs matplotlib). Usage::

    python -m bench.plot_rl bench/results/h200/rl.json --out docs/rl_steps.png
"""
from __future__ import annotations

import argparse
import json
from typing import Dict, List, Tuple


def series(report: dict) -> Dict[str, List[Tuple[int, float, float]]]:
    """``{way: [(step, mean_reward, rollout_s), ...]}`` from the report's per-step rows, in step order."""
    out: Dict[str, List[Tuple[int, float, float]]] = {}
    for row in report["rows"]:
        step = row["case"].get("step")
        if isinstance(step, int):
            out.setdefault(row["impl"], []).append((step, row["mean_reward"], row["rollout_s"]))
    return {way: sorted(points) for way, points in out.items()}


def plot(points: Dict[str, List[Tuple[int, float, float]]], path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (reward_ax, time_ax) = plt.subplots(1, 2, figsize=(10, 3.6))
    for way, rows in points.items():
        steps = [r[0] for r in rows]
        reward_ax.plot(steps, [r[1] for r in rows], marker="o", label=way)
        time_ax.plot(steps, [r[2] for r in rows], marker="o", label=way)
    reward_ax.set(xlabel="RL step", ylabel="mean reward", title="reward")
    # Log scale: transformers' generate takes ~20x our engines' time, which would flatten their lines on a linear axis.
    time_ax.set(xlabel="RL step", ylabel="rollout seconds (log scale)", title="rollout time", yscale="log")
    time_ax.legend(fontsize="small", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return f"wrote {path}"


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("report", help="the rl suite's JSON report")
    ap.add_argument("--out", default="rl_steps.png")
    args = ap.parse_args(argv)
    with open(args.report) as f:
        msg = plot(series(json.load(f)), args.out)
    print(msg)
    return msg


if __name__ == "__main__":
    main()
