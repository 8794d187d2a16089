"""A prototype rule for static batches, in simulation only: ``python -m tools.forecast_override_probe``.

The loss budget prices a draft by how far it moved the batch's end, so a uniform batch's first drafts, which start
from a tie and move the end by one token, spend the allowance before drafting pays (docs/RUNTIME.md, "The loss
budget"). This probe tries what the ledger does not keep: each request's own acceptance per arm. Its *forecast* of
an arm is the slowest running request's expected tokens per step under it (each request's accepted drafts per draft
step, shrunk toward the arm's pooled mean with ``--shrink`` pseudo-steps, plus ``--confidence / sqrt(steps + 1)``,
negative for a lower bound), per second of the arm's step. Where the budgeted selector picks plain decoding, the
*override* runs the best-forecast arm instead when its forecast beats plain decoding's by ``--margin``: a tie's
spread is then told from a request that never catches up (its forecast stays low). The static batches of
``python -m bench selector``. Prints a Markdown table of wall-time ratios to plain decoding, cold, mean over ``--seeds`` seeds.
"""
from __future__ import annotations

import argparse

import numpy as np

from bench.suites.selector import STATIC_BATCH_ARMS, _static_batch_family, exact_cost_table
from tlt_kernels.runtime import Strategy, StrategySelector
from tlt_kernels.runtime.static_batch import lagging_feedback, run_static_batch, selector_observer

ARMS = tuple(Strategy.parse(a) for a in STATIC_BATCH_ARMS)
OFF = Strategy.off()


class Forecast:
    """Per request and drafting arm: draft steps and accepted drafts, and the arm the forecast prefers."""

    def __init__(self, batch, shrink: float, confidence: float, margin: float):
        n = len(batch.alphas)
        self.batch, self.shrink, self.confidence, self.margin = batch, shrink, confidence, margin
        self.steps = {a: np.zeros(n) for a in ARMS if a.num_steps}
        self.accepted = {a: np.zeros(n) for a in ARMS if a.num_steps}
        self.left = batch.initial_left().copy()  # tokens left per request, as run_static_batch keeps them
        self.last = None

    def feedback(self, reach, left_before, depth):
        """The engine's lagging feedback, keeping which requests ran and their accepted drafts for :meth:`observe`."""
        running = np.nonzero(self.left > 0)[0]  # run_static_batch's running rows, in its order
        self.last = (running, reach)
        self.left[running] -= np.minimum(reach + 1, left_before)
        return lagging_feedback(reach, left_before, depth)

    def observe(self, strategy: Strategy) -> None:
        if strategy.num_steps:
            running, reach = self.last
            self.steps[strategy][running] += 1
            self.accepted[strategy][running] += reach

    def rate(self, arm: Strategy, batch_size: int) -> float:
        """The slowest request's forecast tokens per second under ``arm`` (0 before the arm ran)."""
        running = self.left > 0
        steps, accepted = self.steps[arm][running], self.accepted[arm][running]
        if steps.max(initial=0) == 0:
            return 0.0
        pooled = accepted.sum() / steps.sum()
        per_request = (accepted + self.shrink * pooled) / (steps + self.shrink) + self.confidence / np.sqrt(steps + 1)
        return (1.0 + per_request.min()) / self.batch.cost(arm, batch_size)

    def override(self, batch_size: int):
        """The best-forecast arm if it beats plain decoding by the margin, else None."""
        best = max(self.steps, key=lambda a: self.rate(a, batch_size))
        plain = 1.0 / self.batch.cost(OFF, batch_size)
        return best if self.rate(best, batch_size) > (1 + self.margin) * plain else None


def _run(batch, seed: int, budget, forecast_args) -> float:
    """Seconds of ``batch`` under a fresh cost-policy selector (exact table, told the rollout's length); with
    ``forecast_args``, the override on top."""
    table = exact_cost_table(batch, ARMS)
    selector = StrategySelector(ARMS, seed=seed, cost_table=table, loss_budget=budget)
    if budget is not None:
        selector.new_rollout(max_tokens=int(batch.initial_left().max()))
    forecast = Forecast(batch, *forecast_args) if forecast_args else None
    to_selector = selector_observer(selector)

    def choose(batch_size):
        arm = selector.select(batch_size)
        return (forecast.override(batch_size) or arm) if forecast and not arm.num_steps else arm

    def observe(strategy, *args):
        if forecast:
            forecast.observe(strategy)
        to_selector(strategy, *args)

    return run_static_batch(batch, choose, observe, forecast.feedback if forecast else lagging_feedback, seed)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m tools.forecast_override_probe", description=__doc__.split("\n")[0])
    ap.add_argument("--shrink", type=float, default=4.0, help="pseudo-steps of the pooled mean (default 4)")
    ap.add_argument("--confidence", type=float, default=-0.3, help="per-request bound's width (default -0.3)")
    ap.add_argument("--margin", type=float, default=0.05, help="gain over plain decoding to override (default 0.05)")
    ap.add_argument("--seeds", type=int, default=8, help="seeds per batch (default 8)")
    args = ap.parse_args()
    forecast_args = (args.shrink, args.confidence, args.margin)
    rows = [("no budget", None, None), ("2% budget", 0.02, None), ("override + 2%", 0.02, forecast_args),
            ("override + 1%", 0.01, forecast_args)]
    print("| batch | best static arm | " + " | ".join(name for name, _, _ in rows) + " |")
    print("|---|---|" + "---|" * len(rows))
    seeds = range(args.seeds)
    for batch in _static_batch_family(0):
        static = {a: sum(run_static_batch(batch, lambda b, a=a: a, seed=s) for s in seeds) for a in ARMS}
        plain = static[OFF]
        cells = [f"{plain / min(static.values()):.3f}"]
        cells += [f"{plain / sum(_run(batch, s, budget, fa) for s in seeds):.3f}" for _, budget, fa in rows]
        print(f"| {batch.name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
