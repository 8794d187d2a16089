"""Counterfactual chain acceptance on plain steps, replayed on the selector suite's real traces:
``python -m tools.counterfactual_replay``.

The idea: a deterministic drafter (the n-gram one) could score, on a plain step, the chain it would have proposed
against the tokens plain decoding emits next. At temperature 0 the matched prefix is what verifying that chain
accepts; under sampling a one-hot draft is accepted with the target's probability of its token, which is the
probability that plain decoding emits it, so the count has the same law. A selector would then learn the chain arms'
acceptance on plain steps without probing them. Before building that into the engine, this replays it: each n-gram
trace of ``REAL_TRACES`` records every arm's outcome at every step, so after each plain step the replay hands the
default cost policy the deepest chain arm's recorded counts (the lagging rows', as the engine feeds them) as an
observation of acceptance alone (:meth:`~tlt_kernels.runtime.policies.cost_model.CostModelPolicy.observe_acceptance`:
no step time). Rows: the default selector without and with the counterfactual, the latter also without probes and
with a 2% loss budget; cold (a fresh selector on the timed rollout) and warm (after the warm-up rollout), scored per
step (``_same_work_s``) against plain decoding. Prints one line per trace, then each row's mean and minimum against
the best static arm and its minimum against plain decoding (docs/RUNTIME.md, "Counterfactual acceptance on plain
steps").
"""
from __future__ import annotations

import argparse
import glob
import os

from bench.suites.selector import REAL_TRACES, TRACES_DIR, _same_work_s, replay_static, trace_cost_table
from tlt_kernels.runtime import Strategy, StrategySelector
from tlt_kernels.runtime.simulate import load_trace, replay_selector

# Row name -> (feed the counterfactual, StrategySelector options).
ROWS = {
    "default": (False, {}),
    "counterfactual": (True, {}),
    "counterfactual, no probes": (True, {"probe_every": None}),
    "counterfactual, 2% budget": (True, {"loss_budget": 0.02}),
}


def deepest_chain(record: dict):
    """``(strategy, counts, rows)`` of the record's deepest chain arm (one candidate per level): its lagging rows'
    ``accepted_per_position`` and their number where recorded, else the whole batch's and None; None without one."""
    chains = [(Strategy.parse(name), o) for name, o in record["arms"].items()]
    chains = [(s, o) for s, o in chains if s.num_steps > 0 and s.topk == 1]
    if not chains:
        return None
    strategy, o = max(chains, key=lambda c: c[0].num_steps)
    if o.get("lagging_rows") and o.get("lagging_accepted"):
        return strategy, o["lagging_accepted"], o["lagging_rows"]
    return strategy, o["accepted"], None


def replay(records, selector: StrategySelector, counterfactual: bool):
    """``simulate.replay_selector``, plus (``counterfactual``) the deepest chain arm's counts after each plain step.

    ``replay_trace`` observes every record in order, so the wrapped ``update`` walks the records alongside it."""
    if not counterfactual:
        return replay_selector(records, selector)
    step = iter(records)
    update = selector.update

    def update_then_counterfactual(strategy, batch_size, *args, **kwargs):
        update(strategy, batch_size, *args, **kwargs)
        record = next(step)  # advance on every step: the walk must stay aligned with replay_trace's
        chain = deepest_chain(record) if strategy.is_off else None
        if chain is not None:  # straight to the policy: a recorded trace's counts are a real step's
            arm, counts, rows = chain
            selector.policy.observe_acceptance(selector.strategies.index(arm), batch_size, counts,
                                               selector.step, rows)

    selector.update = update_then_counterfactual
    try:
        return replay_selector(records, selector)
    finally:
        del selector.update  # the next replay (warm: the timed rollout after the warm-up) wraps it afresh


def scores(path: str, table) -> dict:
    """``{row: (cold, warm)}`` ratios to plain decoding on one trace, and ``"best"``: the best static arm's."""
    records = load_trace(path)
    timed = [r for r in records if r.get("rollout") == 1]
    warm_up = [r for r in records if r.get("rollout") != 1]
    arms = sorted({Strategy.parse(k) for r in records for k in r["arms"]}, key=str)
    plain_s = _same_work_s(replay_static(timed, Strategy.off()))
    out = {"best": max(plain_s / _same_work_s(replay_static(timed, a)) for a in arms)}
    for row, (counterfactual, options) in ROWS.items():
        def fresh():
            return StrategySelector([a for a in arms if not a.is_off], seed=0, cost_table=table, **options)
        cold = replay(timed, fresh(), counterfactual)
        warm = fresh()
        replay(warm_up, warm, counterfactual)
        warm.new_rollout()  # as the engine does at each generate
        out[row] = (plain_s / _same_work_s(cold), plain_s / _same_work_s(replay(timed, warm, counterfactual)))
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m tools.counterfactual_replay", description=__doc__.split("\n")[0])
    ap.add_argument("--traces", default=None, help="only trace files whose path contains this text (default: all)")
    args = ap.parse_args(argv)
    per_trace = {}
    for name, _ in REAL_TRACES:
        directory = os.path.join(TRACES_DIR, name)
        for path in sorted(glob.glob(os.path.join(directory, "ngram-*-B*.json"))):  # deterministic drafts only
            if args.traces and args.traces not in path:
                continue
            drafter = os.path.basename(path).split("-")[0]
            per_trace[f"{name}/{os.path.basename(path)[:-5]}"] = s = scores(path, trace_cost_table(directory, drafter))
            cells = ", ".join(f"{row} {s[row][0]:.3f}/{s[row][1]:.3f}" for row in ROWS)
            print(f"{name}/{os.path.basename(path)[:-5]}: best static {s['best']:.3f}; cold/warm {cells}")
    for row in ROWS:
        vs_best = [(s[row][0] / s["best"], s[row][1] / s["best"]) for s in per_trace.values()]
        if not vs_best:
            break
        print(f"{row}: vs best static cold mean {sum(c for c, _ in vs_best) / len(vs_best):.3f} min "
              f"{min(c for c, _ in vs_best):.3f}, warm mean {sum(w for _, w in vs_best) / len(vs_best):.3f} min "
              f"{min(w for _, w in vs_best):.3f}; vs plain min cold {min(s[row][0] for s in per_trace.values()):.3f} "
              f"warm {min(s[row][1] for s in per_trace.values()):.3f}")
    return per_trace


if __name__ == "__main__":
    main()
