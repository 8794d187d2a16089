"""Replay selector configurations on the real-model traces (``bench/traces/h200_smollm2*``) and score them as issue 28's
req 5 reads them: against the best static arm (within 3%) and plain decoding (never more than 2% below), cold and warm.

    python -m tools.real_trace_replay                                     # the defaults, 8 draws of timing noise
    python -m tools.real_trace_replay --config 'budget=dict(loss_budget=0.02)' --rows
    python -m tools.real_trace_replay --config 'w128=dict(window=128)' --draws 4 --workers 2
    python -m tools.real_trace_replay --counterfactual --config 'cf=dict(policy="counterfactual")'

Each ``--config NAME=EXPR`` is a Python expression giving ``StrategySelector`` keyword arguments on top of the defaults
(``default`` is always run); a config with ``loss_budget`` is told each rollout's length, as the engine tells it. Each
score is the mean over ``--draws`` draws of 2% timing noise (``bench.suites.selector.jittered``, as
``tests/bench/test_selector_suite.py`` judges the default). ``--counterfactual`` replays the n-gram traces only, and
every selector also gets the arms it did not run, as the n-gram drafter's counterfactual would give them (the
``"counterfactual"`` policy learns from them; docs/RUNTIME.md, "The counterfactual policy"). Per config and score it
prints the mean and lowest
fraction of the best static arm, the rows more than 3% below it and the rows more than 2% below plain decoding.
Scores: ``per_step`` (every row's tokens, step by step) over all traces; ``lagging`` (the lagging rows' progress, the
one req 5 is judged on where a trace has it) over the sets that count the lagging rows. docs/RUNTIME.md, "The lagging
rows' progress", defines both.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from typing import Dict, List, Optional, Tuple

SCORES = ("per_step", "lagging")


def _parse_configs(items: List[str]) -> Dict[str, dict]:
    """``default`` (no keyword arguments) and each ``--config NAME=EXPR``, parsed as the trace sweep parses them."""
    from tools.selector_trace_sweep import _parse_configs as parse

    return {"default": {}, **parse(items)}


def _traces(ngram_only: bool = False) -> List[Tuple[str, str]]:
    """(directory, trace path) of every real trace (``ngram_only``: of the n-gram drafter's), in the suite's order."""
    from bench.suites import selector

    return [(os.path.join(selector.TRACES_DIR, name), path) for name, _ in selector.REAL_TRACES
            for path in selector.real_trace_paths(name)
            if not ngram_only or os.path.basename(path).startswith("ngram-")]


def replay_scores(records, table, kwargs: dict,
                  counterfactual: bool = False) -> Dict[str, Dict[str, Optional[Tuple[float, float]]]]:
    """Cold and warm: per score, (fraction of the best static arm, ratio to plain decoding), as the selector suite's
    real-trace rows give them (``real_trace_scores``), or None for ``lagging`` where the trace lacks the lagging rows'
    counts; ``counterfactual``: the selectors also get the arms they did not run."""
    from bench.suites import selector

    scores = selector.real_trace_scores(records, table, counterfactual=counterfactual, **kwargs)
    out = {}
    for label in ("cold", "warm"):
        row = scores[f"cost, {label}"]
        out[label] = {"per_step": (row["vs_best_static_per_step"], row["vs_off_per_step"]),
                      "lagging": (row["vs_best_static_lagging"], row["vs_off_lagging"])
                      if "vs_off_lagging" in row else None}
    return out


def _trace_rows(job) -> List[Tuple[str, str, Dict[str, Optional[Tuple[float, float]]]]]:
    """One (config, trace): rows (trace label, cold/warm, per score the means over the noise draws)."""
    directory, path, kwargs, draws, counterfactual = job
    from bench.suites import selector
    from tlt_kernels.runtime.simulate import load_trace

    records = load_trace(path)
    table = selector.trace_cost_table(directory, os.path.basename(path).split("-")[0])
    runs = [replay_scores(selector.jittered(records, seed), table, kwargs, counterfactual) for seed in range(draws)]
    label = f"{os.path.basename(directory)}/{os.path.basename(path)[:-5]}"
    rows = []
    for start in ("cold", "warm"):
        means = {}
        for score in SCORES:
            pairs = [run[start][score] for run in runs]
            means[score] = None if None in pairs else tuple(statistics.mean(p[i] for p in pairs) for i in (0, 1))
        rows.append((label, start, means))
    return rows


def summarize(rows) -> Dict[str, dict]:
    """Per score over the rows that have it: mean / lowest fraction of the best static arm, rows below 0.97 of it, rows
    below 0.98x plain decoding and the lowest ratio to plain decoding."""
    out = {}
    for score in SCORES:
        pairs = [means[score] for _, _, means in rows if means[score] is not None]
        if not pairs:
            continue
        best, plain = [p[0] for p in pairs], [p[1] for p in pairs]
        out[score] = dict(rows=len(pairs), mean=statistics.mean(best), lowest=min(best),
                          below_3pct=sum(b < 0.97 for b in best), below_plain=sum(o < 0.98 for o in plain),
                          lowest_vs_plain=min(plain))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", action="append", default=[], metavar="NAME=EXPR")
    ap.add_argument("--draws", type=int, default=8, help="draws of 2%% timing noise per trace (default 8)")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--rows", action="store_true", help="also print every trace's cold and warm row")
    ap.add_argument("--counterfactual", action="store_true",
                    help="n-gram traces only; selectors also get the arms they did not run (the n-gram drafter's "
                         "counterfactual)")
    args = ap.parse_args(argv)
    if args.draws < 1 or args.workers < 1:
        raise SystemExit("--draws and --workers must be >= 1")
    configs = _parse_configs(args.config)
    jobs = [(name, (d, p, kw, args.draws, args.counterfactual)) for name, kw in configs.items()
            for d, p in _traces(ngram_only=args.counterfactual)]
    with ProcessPoolExecutor(args.workers) as pool:
        results = list(pool.map(_trace_rows, [job for _, job in jobs]))
    for name in configs:
        rows = [row for (config, _), res in zip(jobs, results) if config == name for row in res]
        print(f"== {name}: {configs[name]}")
        for label, start, means in rows if args.rows else ():
            cells = "  ".join(f"{s} {m[0]:.3f} best / {m[1]:.3f}x plain" for s, m in means.items() if m)
            print(f"   {label:40s} {start}: {cells}")
        for score, s in summarize(rows).items():
            print(f"   {score:8s} ({s['rows']} rows): of the best static arm mean {s['mean']:.3f}, lowest "
                  f"{s['lowest']:.3f}, {s['below_3pct']} rows below 0.97; {s['below_plain']} rows below 0.98x plain "
                  f"(lowest {s['lowest_vs_plain']:.3f})")


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    main()
