"""The loss budget's fraction swept over the selector suite's static batches: ``python -m tools.static_batch_budget_sweep``.

Per simulated static batch of ``python -m bench selector`` (tlt_kernels/runtime/static_batch.py: a launch-bound small
target's uniform batches, a GRPO-like batch, an n-gram long tail, a 7B-class target with a good drafter) and per
budget (``--budgets``, ``none`` for no budget): the cost policy under the engine's lagging feedback, cold (a fresh
selector told the rollout's length) and warm (after the kind's next batch), as wall-time ratios to plain decoding,
mean over ``--seeds`` seeds (a seed fixes the batch's text; every row of a seed meets the same one); with
``--forecast`` each budget's column is followed by the same budget with the requests' acceptance forecast
(``StrategySelector(forecast=)``). Prints a Markdown table (docs/RUNTIME.md, "The loss budget", "The forecast").
"""
from __future__ import annotations

import argparse

from bench.flags import loss_budgets
from bench.suites.selector import STATIC_BATCH_ARMS, _cold_run, _static_batch_family, _warm_run, exact_cost_table
from tlt_kernels.runtime import Strategy
from tlt_kernels.runtime.static_batch import lagging_feedback, run_static_batch


def _row(batch, warm_up, arms, seeds, budgets, forecast: bool = False) -> str:
    """One batch's line: its best static arm, then cold / warm per budget (and, with ``forecast``, per budget with
    the forecast: none for no budget), each as a ratio to plain decoding."""
    table = exact_cost_table(batch, arms)
    static = {a: sum(run_static_batch(batch, lambda b, a=a: a, seed=s) for s in seeds) for a in arms}
    plain = static[Strategy.off()]
    best = min(static, key=static.get)
    cells = [f"{plain / static[best]:.3f} ({best})"]
    for budget, with_forecast in _columns(budgets, forecast):
        cold = sum(_cold_run(batch, arms, table, s, lagging_feedback, budget, with_forecast) for s in seeds)
        warm = sum(_warm_run(batch, warm_up, arms, table, s, budget, with_forecast) for s in seeds)
        cells.append(f"{plain / cold:.3f} / {plain / warm:.3f}")
    return f"| {batch.name} | " + " | ".join(cells) + " |"


def _columns(budgets, forecast: bool):
    """``(budget, with the forecast)`` per column: each budget, then (``forecast``) the budgeted ones again with it."""
    return [(b, f) for b in budgets for f in ((False, True) if forecast and b is not None else (False,))]


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m tools.static_batch_budget_sweep", description=__doc__.split("\n")[0])
    ap.add_argument("--budgets", type=loss_budgets, default=loss_budgets("none,0.005,0.01,0.02,0.03"),
                    help="comma-separated loss budgets, 'none' for no budget (default none,0.005,0.01,0.02,0.03)")
    ap.add_argument("--seeds", type=int, default=8, help="seeds per batch (default 8)")
    ap.add_argument("--forecast", action="store_true", help="also each budget with the requests' forecast")
    args = ap.parse_args()
    arms = tuple(Strategy.parse(a) for a in STATIC_BATCH_ARMS)
    seeds = range(args.seeds)
    names = [("none" if b is None else f"{b:g}") + (" + forecast" if f else "")
             for b, f in _columns(args.budgets, args.forecast)]
    print("| batch | best static arm | " + " | ".join(f"budget {n}, cold / warm" for n in names) + " |")
    print("|---|---|" + "---|" * len(names))
    for batch, warm_up in zip(_static_batch_family(0), _static_batch_family(1)):
        print(_row(batch, warm_up, arms, seeds, args.budgets, args.forecast), flush=True)


if __name__ == "__main__":
    main()
