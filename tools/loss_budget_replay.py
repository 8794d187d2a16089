"""The selector's loss budget replayed on the real-model traces: ``python -m tools.loss_budget_replay``.

Per trace of the selector suite's ``REAL_TRACES`` (every arm probed at every step of a real rollout) and per budget
(``--budgets``, ``none`` for no budget): the default selector cold (a fresh one on the timed rollout, the engine's
start-up cost table) and warm (after the warm-up rollout; ``--told``: each rollout told its length, as the engine
tells it), scored as the suite's per-step rows (``_same_work_s``:
the time to emit each step's best arm's tokens at the replay's efficiency there), as a ratio to plain decoding's.
Prints one line per trace and the mean and minimum per budget (docs/RUNTIME.md, "The loss budget").
"""
from __future__ import annotations

import argparse
import glob
import os

from bench.flags import loss_budgets
from bench.suites.selector import (REAL_TRACES, TRACES_DIR, _same_work_s, replay_cold_and_warm, replay_static,
                                   trace_cost_table)
from tlt_kernels.runtime import CostTable, Strategy, StrategySelector
from tlt_kernels.runtime.simulate import load_trace


def _scores(path: str, table: CostTable, budgets, told: bool) -> dict:
    """``{budget: (cold, warm)}`` ratios to plain decoding, and ``"best"``: the best static arm's."""
    records = load_trace(path)
    timed = [r for r in records if r.get("rollout") == 1]
    arms = sorted({Strategy.parse(k) for r in records for k in r["arms"]}, key=str)
    plain_s = _same_work_s(replay_static(timed, Strategy.off()))
    out = {"best": max(plain_s / _same_work_s(replay_static(timed, a)) for a in arms)}
    for budget in budgets:
        def fresh():
            return StrategySelector([a for a in arms if not a.is_off], seed=0, cost_table=table, loss_budget=budget)
        out[budget] = tuple(plain_s / _same_work_s(res) for res in replay_cold_and_warm(records, fresh, told))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tools.loss_budget_replay", description=__doc__.split("\n")[0])
    ap.add_argument("--budgets", type=loss_budgets, default=(None, 0.0, 0.01, 0.02, 0.03),
                    help="comma-separated fractions or none (default none,0,0.01,0.02,0.03)")
    ap.add_argument("--told", action="store_true",
                    help="tell each rollout its length, as the engine tells its selector at each generate")
    args = ap.parse_args(argv)
    budgets = args.budgets
    totals = {b: ([], []) for b in budgets}
    for name, _ in REAL_TRACES:
        directory = os.path.join(TRACES_DIR, name)
        for path in sorted(glob.glob(os.path.join(directory, "*-B*.json"))):
            scores = _scores(path, trace_cost_table(directory, os.path.basename(path).split("-")[0]), budgets,
                             args.told)
            cells = []
            for b in budgets:
                totals[b][0].append(scores[b][0])
                totals[b][1].append(scores[b][1])
                cells.append(f"{scores[b][0]:.3f}/{scores[b][1]:.3f}")
            print(f"{name}/{os.path.basename(path)[:-5]}: best static {scores['best']:.3f}; cold/warm per budget "
                  f"{', '.join(f'{b}: {c}' for b, c in zip(budgets, cells))}")
    for b, (cold, warm) in totals.items():
        print(f"budget {b}: cold mean {sum(cold) / len(cold):.3f} min {min(cold):.3f}; "
              f"warm mean {sum(warm) / len(warm):.3f} min {min(warm):.3f}")


if __name__ == "__main__":
    main()
