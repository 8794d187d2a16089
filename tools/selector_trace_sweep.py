"""Compare ``CostModelPolicy`` configurations on the recorded engine traces, the simulated workloads and CPU cost.

Reproduces the numbers behind the cost policy's defaults (>= 97% of the best-arm-per-batch-size
oracle on the recorded H200 trace without losing the simulated targets)::

    python -m tools.selector_trace_sweep                         # defaults vs no change-test skip, seeds 0-2
    python -m tools.selector_trace_sweep --seeds 8 --workers 2   # seeds 0-7
    python -m tools.selector_trace_sweep --config 'sd1=dict(model_sd=1.0)' --trace-only

Each ``--config NAME=EXPR`` is a Python expression giving the policy's keyword arguments (on top of the
defaults). Per config it prints: ``vs_size_oracle`` on every trace of ``bench/traces`` (the best arm per
batch size over the trace in hindsight, as in ``bench/suites/selector.py``), per simulated workload
``vs_oracle`` (mean over seeds), ``min`` (the lowest single seed), ``vs_best_static`` on phase-shift-mixed,
the lowest ``vs_off`` and the worst re-convergence, and ``select + update`` microseconds on this CPU,
measured interleaved with the other configs in the same process (the machine is shared: compare only
numbers of the same run).
"""
from __future__ import annotations

import argparse
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from typing import Dict, List

# What the defaults (min_trials=1, min_support=8: no change test on an arm with < 1 step of its own once the level
# rests on 8 steps) are compared with by default: the pre-2026-11-26 policy, which tested every play.
BASELINE = dict(min_trials=0.0)


def _parse_configs(items: List[str]) -> Dict[str, dict]:
    out = {}
    for it in items:
        name, _, expr = it.partition("=")
        if not expr:
            raise SystemExit(f"--config wants NAME=EXPR (e.g. sd1='dict(model_sd=1.0)'), got {it!r}")
        kw = eval(expr, {"dict": dict})  # a local analysis tool: the expression is the user's own
        if not isinstance(kw, dict):
            raise SystemExit(f"--config {name}: the expression must give a dict of keyword arguments, got {kw!r}")
        out[name] = kw
    return out


def vs_size_oracle(trace, kw: dict) -> float:
    """Cost policy with options ``kw`` replayed on ``trace`` (start-up table = the trace's median step time per
    (arm, batch size)), as a fraction of the best arm per batch size over the trace in hindsight."""
    from bench.suites.selector import _trace_cost_table, size_oracle_fraction
    from tlt_kernels.runtime import Strategy, StrategySelector
    from tlt_kernels.runtime.simulate import replay_selector

    arms = sorted({Strategy.parse(k) for r in trace for k in r["arms"]}, key=str)
    sel = StrategySelector([a for a in arms if not a.is_off], policy="cost", seed=0,
                           cost_table=_trace_cost_table(trace), **kw)
    return size_oracle_fraction(trace, replay_selector(trace, sel).picks)


def trace_scores(kw: dict, jitter: int = 0, sigma: float = 0.02) -> Dict[str, tuple]:
    """``{trace: (vs_size_oracle, mean, min over `jitter` copies with re-drawn timing noise)}``."""
    from bench.suites.selector import RECORDED_TRACES, TRACES_DIR, jittered
    from tlt_kernels.runtime.simulate import load_trace

    out = {}
    for name in RECORDED_TRACES:
        trace = load_trace(os.path.join(TRACES_DIR, name))
        js = [vs_size_oracle(jittered(trace, s, sigma), kw) for s in range(jitter)]
        out[name[:-5]] = (vs_size_oracle(trace, kw), sum(js) / len(js) if js else None, min(js) if js else None)
    return out


def _sim_one(args):
    """One workload, every config, each seed separately (so the lowest seed can be reported)."""
    wl_name, configs, seeds = args
    from tlt_kernels.runtime import StrategySelector
    from tlt_kernels.runtime.simulate import DEFAULT_ARMS, evaluate, standard_workloads

    wl = next(w for w in standard_workloads(small=False) if w.name == wl_name)
    makers = {n: (lambda arms, table, seed, kw=kw: StrategySelector(arms, policy="cost", seed=seed, cost_table=table,
                                                                    **kw)) for n, kw in configs.items()}
    per = {n: [] for n in configs}
    for s in seeds:
        res = evaluate(wl, makers, DEFAULT_ARMS, (s,))
        for n in configs:
            per[n].append(res[n])
    out = {}
    for n, rs in per.items():
        rc = [r["reconverge_steps"] for r in rs if r["reconverge_steps"] is not None]
        st = [r["settle_steps"] for r in rs if r.get("settle_steps") is not None]
        out[n] = {
            "vs_oracle": sum(r["vs_oracle"] for r in rs) / len(rs),
            "min": min(r["vs_oracle"] for r in rs),
            "vs_best_static": sum(r["vs_best_static"] for r in rs) / len(rs),
            "vs_off": sum(r["vs_off"] for r in rs) / len(rs),
            "reconv": max(rc) if rc else None,
            "settle": max(st) if st else None,
        }
    return wl_name, out


def sim_scores(configs: Dict[str, dict], seeds, workers: int = 1) -> Dict[str, Dict[str, dict]]:
    """``{workload: {config: scores}}`` over :func:`standard_workloads` (full size)."""
    from tlt_kernels.runtime.simulate import standard_workloads

    names = [w.name for w in standard_workloads(small=False)]
    jobs = [(n, configs, tuple(seeds)) for n in names]
    if workers > 1:
        with ProcessPoolExecutor(workers) as ex:
            res = dict(ex.map(_sim_one, jobs))
    else:
        res = dict(map(_sim_one, jobs))
    return {n: res[n] for n in names}


def cpu_cost(configs: Dict[str, dict], rounds: int = 3, steps: int = 20000) -> Dict[str, Dict[str, float]]:
    """Median ``select + update`` microseconds (stationary and drifting streams), configs interleaved."""
    from bench.suites.selector import _cpu_cost_us

    results = {n: {"stationary": [], "drifting": []} for n in configs}
    for _ in range(rounds):
        for n, kw in configs.items():
            results[n]["stationary"].append(_cpu_cost_us("cost", steps, **kw))
            results[n]["drifting"].append(_cpu_cost_us("cost", steps, drifting=True, **kw))
    return {n: {k: sorted(v)[len(v) // 2] for k, v in d.items()} for n, d in results.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", action="append", default=[], metavar="NAME=EXPR")
    ap.add_argument("--seeds", type=int, default=3, help="simulate seeds 0..N-1 (default 3)")
    ap.add_argument("--workers", type=int, default=1, help="processes for the simulated workloads")
    ap.add_argument("--jitter", type=int, default=10,
                    help="also replay N copies of each trace with 2%% log-normal timing noise (default 10; the trace's "
                         "repeated graph-replayed probes of one arm and batch size differ by ~1%%)")
    ap.add_argument("--trace-only", action="store_true")
    ap.add_argument("--no-cpu", action="store_true", help="skip the CPU-cost measurement")
    args = ap.parse_args(argv)
    configs = _parse_configs(args.config) if args.config else {"default": {}, "min_trials=0": dict(BASELINE)}
    names = list(configs)
    print("engine traces: vs_size_oracle; with --jitter: mean / lowest over re-drawn timing noise")
    rows = {n: trace_scores(configs[n], args.jitter) for n in names}
    traces = list(rows[names[0]])
    print("| config | " + " | ".join(traces) + " |")
    print("|---|" + "---|" * len(traces))
    for n in names:
        cells = [f"{v:.4f}" + (f" (jitter {m:.4f} / {lo:.4f})" if m is not None else "") for v, m, lo in rows[n].values()]
        print(f"| {n} | " + " | ".join(cells) + " |")
    sys.stdout.flush()
    if args.trace_only:
        return 0
    sims = sim_scores(configs, range(args.seeds), args.workers)
    print(f"\nsimulated workloads, seeds 0-{args.seeds - 1}: vs_oracle mean (lowest seed) / vs_off / re-converge (settle), worst seed")
    print("| workload | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for wl, per in sims.items():
        cells = []
        for n in names:
            r = per[n]
            c = f"{r['vs_oracle']:.4f} ({r['min']:.3f}) / {r['vs_off']:.2f}"
            if r["reconv"] is not None:
                c += f" / {r['reconv']} (settle {r['settle']})"
            if wl == "phase-shift-mixed":
                c += f" / vs best static {r['vs_best_static']:.3f}"
            cells.append(c)
        print(f"| {wl} | " + " | ".join(cells) + " |")
    sys.stdout.flush()
    if not args.no_cpu:
        cpu = cpu_cost(configs)
        print("\nselect + update us (median of 3 interleaved rounds): stationary / drifting")
        for n in names:
            print(f"- {n}: {cpu[n]['stationary']:.1f} / {cpu[n]['drifting']:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
