"""The loss budget's fraction swept over the selector suite's static batches: ``python -m tools.static_batch_budget_sweep``.

Per simulated static batch of ``python -m bench selector`` (tlt_kernels/runtime/static_batch.py: a launch-bound small
target's uniform batches, a GRPO-like batch, an n-gram long tail, a 7B-class target with a good drafter) and per
budget (``--budgets``, ``none`` for no budget): the cost policy under the engine's lagging feedback, cold (a fresh
selector told the rollout's length) and warm (after the kind's next batch), as wall-time ratios to plain decoding,
mean over ``--seeds`` seeds (a seed fixes the batch's text; every row of a seed meets the same one). Prints a
Markdown table (docs/RUNTIME.md, "The loss budget").
"""
from __future__ import annotations

import argparse

from bench.flags import loss_budgets
from bench.suites.selector import STATIC_BATCH_ARMS, _cold_run, _static_batch_family, _warm_run, exact_cost_table
from tlt_kernels.runtime import Strategy
from tlt_kernels.runtime.static_batch import lagging_feedback, run_static_batch


def _row(batch, warm_up, arms, seeds, budgets) -> str:
    """One batch's line: its best static arm, then cold / warm per budget, each as a ratio to plain decoding."""
    table = exact_cost_table(batch, arms)
    static = {a: sum(run_static_batch(batch, lambda b, a=a: a, seed=s) for s in seeds) for a in arms}
    plain = static[Strategy.off()]
    best = min(static, key=static.get)
    cells = [f"{plain / static[best]:.3f} ({best})"]
    for budget in budgets:
        cold = sum(_cold_run(batch, arms, table, s, lagging_feedback, budget) for s in seeds)
        warm = sum(_warm_run(batch, warm_up, arms, table, s, budget) for s in seeds)
        cells.append(f"{plain / cold:.3f} / {plain / warm:.3f}")
    return f"| {batch.name} | " + " | ".join(cells) + " |"


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m tools.static_batch_budget_sweep", description=__doc__.split("\n")[0])
    ap.add_argument("--budgets", type=loss_budgets, default=loss_budgets("none,0.005,0.01,0.02,0.03"),
                    help="comma-separated loss budgets, 'none' for no budget (default none,0.005,0.01,0.02,0.03)")
    ap.add_argument("--seeds", type=int, default=8, help="seeds per batch (default 8)")
    args = ap.parse_args()
    arms = tuple(Strategy.parse(a) for a in STATIC_BATCH_ARMS)
    seeds = range(args.seeds)
    names = ["none" if b is None else f"{b:g}" for b in args.budgets]
    print("| batch | best static arm | " + " | ".join(f"budget {n}, cold / warm" for n in names) + " |")
    print("|---|---|" + "---|" * len(names))
    for batch, warm_up in zip(_static_batch_family(0), _static_batch_family(1)):
        print(_row(batch, warm_up, arms, seeds, args.budgets), flush=True)


if __name__ == "__main__":
    main()
