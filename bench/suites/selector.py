"""Strategy selector on simulated workloads (a CPU simulation, so it runs anywhere).

Rows per workload: the oracle, the best static arm, plain decoding and each policy; ``ms`` is the
simulated time for the same work, so the harness's ratios are throughput ratios. Extras give the
fraction of the oracle, the gain over the best static arm and over plain decoding, and the worst
re-convergence after a phase change: ``reconverge_steps`` (steps until the 20-step mean reaches 95% of
the oracle) and the stricter ``settle_steps`` (steps until 10 consecutive choices are within 1% of the
oracle's throughput).
The ``engine trace`` case replays every policy (and every static arm) on a trace of a real rollout in which the
engine probed every arm at every step (``--trace path.json`` to replay a recorded one); the ``real trace`` cases
replay the default policy, cold and warm, and each static arm on the real-model traces of
``bench/traces/h200_smollm2*`` (``python -m bench rollout --write-traces``).
On the n-gram traces the ``counterfactual`` rows replay the ``"counterfactual"`` policy, given every arm it did not run
as the n-gram drafter's counterfactual would give them.
The last cases time ``select + update`` per policy on this CPU (``ms`` is milliseconds per step: the
median over 100-step chunks of 20000 steps, robust to other processes): ``cpu: select+update`` on a
stationary stream (the method of the earlier numbers), ``cpu: select+update, drifting`` on a stream whose
acceptance keeps moving, so the cost policy also recomputes every arm's prediction often (its worst case).

Sizes: 600 steps and one seed with ``--small`` (always on a CPU device), 2400 steps and three seeds
otherwise; ``--full`` forces the full run on a CPU and ``--seeds 8`` runs seeds 0-7 (the selector's changes are
judged on 8 seeds: 3 leave a 1% difference inside seed noise).
"""
from __future__ import annotations

import math
import os
import time
from typing import Dict

from ..flags import Flag, positive_int, values

SUITE = "selector"

FLAGS = (
    Flag("--trace", None, "also replay the policies on this engine trace (JSON, e.g. from e2e --write-trace) instead "
         "of one recorded now", replaces="TLT_SELECTOR_TRACE", metavar="PATH"),
    Flag("--full", False, "the full run (2400 steps per workload, --seeds seeds) even when small / on the CPU", bool,
         replaces="TLT_SELECTOR_FULL"),
    Flag("--seeds", 3, "seeds 0..N-1 per workload in the full run", positive_int, replaces="TLT_SELECTOR_SEEDS", metavar="N"),
)

POLICIES = ("beg", "ucb", "thompson", "cost")


def _factory(policy):
    from tlt_kernels.runtime import StrategySelector

    def make(arms, table, seed):
        kw = {"cost_table": table} if policy == "cost" else {}
        return StrategySelector(arms, policy=policy, seed=seed, **kw)
    return make


def _row_kwargs(arms, sizes, per_row: bool) -> dict:
    """``update``'s per-request arguments for each (arm, batch size): every row running, row ``i`` accepting ``i``
    drafts modulo the arm's depth plus one (none without ``per_row``)."""
    if not per_row:
        return {(s, b): {} for s in arms for b in sizes}
    return {(s, b): {"running_rows": list(range(b)),
                     "rows_accepted": [i % (s.num_steps + 1) for i in range(b)] if s.num_steps else None}
            for s in arms for b in sizes}


def _cpu_cost_us(policy, steps=20000, drifting=False, per_row=False, counterfactual=False, **policy_kwargs):
    """Median microseconds of one ``select + update`` over batch sizes 1, 16, 64, 256 in turn; ``per_row``: each
    update also carries every row's acceptance (a selector with a forecast: its worst case, as the running rows'
    number changes at every step); ``counterfactual``: each step also hands over every arm it did not run
    (``observe_counterfactual``, as the counterfactual policy is fed)."""
    import math

    from tlt_kernels.runtime import CostTable, StrategySelector
    from tlt_kernels.runtime.simulate import DEFAULT_ARMS, StepCost

    cost = StepCost()
    table = CostTable({s: [(b, cost(s, b)) for b in (1, 16, 64, 256)] for s in DEFAULT_ARMS})
    kw = {"cost_table": table} if policy in ("cost", "counterfactual") else {}
    sel = StrategySelector(DEFAULT_ARMS, policy=policy, seed=0, **kw, **policy_kwargs)
    sizes = (1, 16, 64, 256)
    obs = {}  # precomputed, so only the selector is timed
    rows = _row_kwargs(DEFAULT_ARMS, sizes, per_row)

    def observation(i, s, b):
        if not drifting:
            return 2 * b, 0.01 + 1e-5 * (i & 7), [max(1, b // 2)] * s.num_steps if s.num_steps else None
        key = (i % 1000, s, b)
        o = obs.get(key)
        if o is None:
            p, acc, reach = 0.55 + 0.35 * math.sin(i / 40.0), [], float(b)
            for _ in range(s.num_steps):
                reach = float(int(reach * p + 0.5))
                acc.append(reach)
            o = obs[key] = (b + sum(acc), cost(s, b) * (1.0 + 0.01 * ((i * 7) % 5)), acc if s.num_steps else None)
        return o

    def step(i):
        b = sizes[i & 3]
        s = sel.select(b)
        sel.update(s, b, *observation(i, s, b), **rows[s, b])
        if counterfactual:
            for a in DEFAULT_ARMS:
                if a.num_steps and a != s:
                    sel.observe_counterfactual(a, b, observation(i, a, b)[2])

    for i in range(1000):  # warm-up, and fills the observation cache
        step(i)
        for a in DEFAULT_ARMS:
            observation(i, a, sizes[i & 3])
    chunks = []
    for c in range(steps // 100):  # median over 100-step chunks: robust to other processes on the CPU
        t0 = time.perf_counter()
        for i in range(c * 100, c * 100 + 100):
            step(i)
        chunks.append((time.perf_counter() - t0) / 100)
    chunks.sort()
    return chunks[len(chunks) // 2] * 1e6


def _record_engine_trace(ctx):
    """A real rollout's trace: a small target trained here, the n-gram drafter, every arm probed at every step
    (``SpeculativeEngine.generate(trace=...)``), long-tailed response lengths."""
    import math

    import torch

    from tlt_kernels.engine import SpeculativeEngine
    from tlt_kernels.models import ModelConfig, load_corpus, train_tiny_target
    from tlt_kernels.models.train_tiny import sample_windows
    from tlt_kernels.runtime import Strategy, StrategySelector

    small = ctx.small
    cfg = ModelConfig.tiny() if small else ModelConfig.small()
    target = train_tiny_target(cfg, steps=30 if small else 300, device=ctx.device, batch_size=8 if small else 32,
                               seq_len=64 if small else 256)
    B, median, cap = (12, 32, 96) if small else (64, 48, 320)
    g = torch.Generator().manual_seed(0)
    prompts = sample_windows(load_corpus("base"), B, 32, g).to(ctx.device)
    lens = [int(min(cap, max(2, round(median * math.exp(float(z)))))) for z in torch.randn(B, generator=g)]
    arms = [Strategy(2, 1, 3), Strategy(4, 1, 5), Strategy(3, 2, 7)]
    eng = SpeculativeEngine(target, "ngram", StrategySelector(arms, seed=0), max_batch_size=B, max_seq_len=32 + cap)
    trace = []
    eng.generate(prompts, lens, trace=trace)
    return trace, f"recorded now: {cfg.num_layers}-layer target, n-gram drafter, B={B}, lengths median {median} max {max(lens)}, {ctx.device}"


def _trace_cost_table(trace):
    from statistics import median

    from tlt_kernels.runtime import CostTable, Strategy

    times = {}
    for r in trace:
        for name, o in r["arms"].items():
            times.setdefault(Strategy.parse(name), {}).setdefault(r["batch_size"], []).append(o["step_time"])
    return CostTable({s: [(b, median(ts)) for b, ts in by_b.items()] for s, by_b in times.items()})


# Engine traces recorded on a GPU and kept in the repository (every arm probed at every step by replaying its
# step graph): the selector suite replays them on any machine. How each was recorded: its entry below.
TRACES_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "traces")
RECORDED_TRACES = {
    "h200_e2e_b128_24layer.json": "H200 e2e rollout 2026-11-26 05:25 UTC (24-layer fp32 target, EAGLE drafter, B=128, "
                                  "fused step graphs: step times are graph replays)",
    "h200_e2e_b128_24layer_8arms.json": "H200 e2e rollout 2026-11-26 ~06:35 UTC (as above, eight arms s1k1v2..s8k4v32)",
    "h200_e2e_b256_24layer_8arms.json": "H200 e2e rollout 2026-11-26 ~06:43 UTC (as above, B=256, lengths up to 896)",
    "h200_e2e_b128_8arms_triton_attn.json": "H200 e2e rollout 2026-11-26 ~08:50 UTC (B=128, eight arms, the target's "
                                            "tree attention on the exact-fp32 Triton kernel: e2e --attn triton)",
}


def _engine_traces(ctx) -> None:
    """Policies replayed on the recorded GPU traces of ``bench/traces`` and on one more trace:
    ``--trace path.json``, or one recorded now."""
    from tlt_kernels.runtime.simulate import load_trace

    for name, origin in RECORDED_TRACES.items():
        _engine_trace(ctx, load_trace(os.path.join(TRACES_DIR, name)), f"bench/traces/{name}: {origin}", name[:-5])
    path = values(ctx, FLAGS).trace
    if path:
        _engine_trace(ctx, load_trace(path), f"loaded from {path}", os.path.basename(path))
    else:
        _engine_trace(ctx, *_record_engine_trace(ctx), "recorded now")


def size_oracle_fraction(trace, picks) -> float:
    """The issue's oracle for a trace: the best arm per batch size over the whole trace in hindsight (no per-step
    noise to exploit). Returns its time for its own tokens / the time the run that picked ``picks`` (one arm name
    per record) needs for the same tokens, at each step's efficiency."""
    totals = {}
    for r in trace:
        for k, o in r["arms"].items():
            e, t = totals.setdefault(r["batch_size"], {}).get(k, (0.0, 0.0))
            totals[r["batch_size"]][k] = (e + o["emitted"], t + o["step_time"])
    size_best = {b: max(v, key=lambda k: v[k][0] / v[k][1]) for b, v in totals.items()}
    own = need = 0.0
    for r, name in zip(trace, picks):
        o, c = r["arms"][size_best[r["batch_size"]]], r["arms"][str(name)]
        own += o["step_time"]
        need += o["emitted"] * c["step_time"] / c["emitted"]
    return own / need


def replay_static(records, arm):
    """A replay of ``records`` that plays ``arm`` at every step it was recorded at, plain decoding elsewhere."""
    from tlt_kernels.runtime import Strategy
    from tlt_kernels.runtime.simulate import replay_trace

    return replay_trace(records, lambda b, avail: arm if arm in avail else Strategy.off())


def _same_work_s(res) -> float:
    """A replay's time to emit, at each step, the tokens of that step's best recorded arm at the replay's own
    efficiency there (the engine-trace rows' "same work"): each step weighs by its own time, so a long tail's wide
    first steps do not set the score as they do a ratio of summed tokens to summed seconds."""
    return sum(t / e for t, e in zip(res.oracle_time, res.efficiency))


def _engine_trace(ctx, trace, origin: str, label: str) -> None:
    """Every policy and static arm replayed on one engine trace."""
    from tlt_kernels.runtime import Strategy, StrategySelector
    from tlt_kernels.runtime.simulate import replay_selector

    arms = sorted({Strategy.parse(k) for r in trace for k in r["arms"]}, key=str)
    case = {"workload": f"engine trace {label} ({len(trace)} steps)"}
    statics = {str(a): replay_static(trace, a) for a in arms}
    def same_work_ms(res):
        return 1e3 * _same_work_s(res)

    def vs_size_oracle(picks):
        return round(size_oracle_fraction(trace, picks), 4)

    best = min(statics.values(), key=same_work_ms)
    off = statics.get("off")
    for name, res in statics.items():
        ctx.add(case, f"static {name}", same_work_ms(res), vs_oracle=round(res.oracle_fraction, 4),
                vs_size_oracle=vs_size_oracle(res.picks))
    # The start-up table the engine measures (SpeculativeEngine.measure_cost_table) before a rollout, as the
    # simulated workloads get theirs: here the median probed step time per (arm, batch size) of the trace. The
    # policies still learn acceptance online.
    table = _trace_cost_table(trace)
    for p in POLICIES:
        kw = {"cost_table": table} if p == "cost" else {}
        res = replay_selector(trace, StrategySelector([a for a in arms if not a.is_off], policy=p, seed=0, **kw))
        ms = same_work_ms(res)
        ctx.add(case, p, ms, vs_oracle=round(res.oracle_fraction, 4), vs_size_oracle=vs_size_oracle(res.picks),
                vs_best_static=round(same_work_ms(best) / ms, 4),
                vs_off=round(same_work_ms(off) / ms, 4) if off else None, choices=str(res.choices))
    ctx.note(f"engine trace: {origin}; every arm probed at every step, so each policy is replayed against the "
             "per-step hindsight oracle of the trace (vs_oracle) and against the best arm per batch size over the trace (vs_size_oracle, the oracle of the selector's targets); the cost policy starts from the trace's median step time per (arm, batch size), what measure_cost_table gives the engine at start-up; ms = time "
             "to emit the oracle's tokens of every step at the run's per-step efficiency (the same work for every row)")


# A probe's step time varies from run to run: the log-normal sigma of the timing noise a real trace's replay is
# judged over (``jittered``; the selector suite's test averages its bounds over several draws).
TIMING_NOISE_SIGMA = 0.02

# Real-model traces: per drafter and workload, the warm-up rollout ("rollout": 0) and the timed one ("rollout": 1) of
# the rollout suite's adaptive rows, every arm probed per step, and each engine's start-up cost table
# (<drafter>-cost-table.json). One (directory under bench/traces, origin) per recorded set.
REAL_TRACES = (
    ("h200_smollm2", "H200, SmolLM2-135M-Instruct (bf16, the embedded default), held-out prompts, greedy, 128 new "
                     "tokens per request (tail: 64 requests, log-normal lengths), n-gram and trained EAGLE drafters; "
                     "recorded 2026-11-30 by `python -m bench rollout --write-traces` at c8d96bf (step times rounded "
                     "to 0.1 us; whole-batch acceptance counts)"),
    ("h200_smollm2_lagging", "the same model, prompts and length (tail: 32 requests), n-gram drafter; recorded "
                             "2026-11-30 with the engine and selector of 487fc44 (EAGLE prefill, ride_runs; at "
                             "6defebf, a commit of a session that did not land) with the lagging rows' counts the "
                             "engine's selector learns from (step times rounded to 0.1 us)"),
    ("h200_smollm2_drafted", "the same model, prompts and length (tail: 32 requests), n-gram drafter, arms s2k1v3, "
                             "s4k1v5, s4k2v8, s5k4v16; recorded 2026-12-02 at e1cc40c with the lagging rows' counts "
                             "and, per step, the rows that have a draft (drafted_rows, lagging_drafted_rows); the "
                             "B = 64 trace was not kept"),
    ("h200_smollm2_weak_eagle", "the same model, prompts and length (tail: 64 requests), an EAGLE drafter trained for "
                                "40 s only (heldout accepted length 1.77 greedy), so that no EAGLE arm beats plain "
                                "decoding in the engine (0.71-0.99x at B = 1, 4 and the tail in the same run); recorded "
                                "2026-12-03 at e71210a with the lagging rows' counts"),
    ("h200_smollm2_sampled", "the same model, prompts and length (tail: 64 requests), n-gram drafter, sampled at "
                             "temperature 1 (the RL rollout's setting: every arm within 0.81-1.07x plain decoding in "
                             "the engine, the adaptive engine 0.94-0.97x cold); recorded 2026-12-04 at e4400d3, "
                             "B = 4 and 16 in a second run a minute after the first (B = 1, the tail and the cost "
                             "table), same settings and machine"),
)


def _trace_rate(records, picks):
    """Tokens per second of a replay's ``picks`` (one arm name per record) over ``records``."""
    emitted = sum(r["arms"][p]["emitted"] for r, p in zip(records, picks))
    return emitted / sum(r["arms"][p]["step_time"] for r, p in zip(records, picks))


def _lagging_rate(records, picks):
    """Tokens per lagging row per second of a replay's ``picks`` over ``records``: each step's progress is the mean
    tokens of its lagging rows (the requests with the most tokens left, which a static batch waits for; ``1 +
    sum(lagging_accepted) / lagging_rows``), what the engine's selector learns from. None where a picked arm's record
    lacks the lagging counts (traces recorded before 2026-11-30)."""
    progress = seconds = 0.0
    for r, p in zip(records, picks):
        o = r["arms"][p]
        if not o.get("lagging_rows") or "lagging_accepted" not in o:
            return None
        progress += 1 + sum(o["lagging_accepted"]) / o["lagging_rows"]
        seconds += o["step_time"]
    return progress / seconds


def trace_cost_table(directory: str, drafter: str):
    """The engine's start-up cost table recorded beside a real trace set (``<drafter>-cost-table.json``)."""
    import json

    from tlt_kernels.runtime import CostTable, Strategy

    with open(os.path.join(directory, f"{drafter}-cost-table.json")) as f:
        return CostTable({Strategy.parse(k): [tuple(p) for p in v] for k, v in json.load(f).items()})


def replay_cold_and_warm(records, fresh, told: bool = False, counterfactual: bool = False):
    """A real trace's timed rollout (``"rollout": 1``) replayed by ``fresh()`` selectors: cold (a fresh one) and warm
    (one that replayed the warm-up rollout first, then was told of the new rollout as the engine tells it); returns
    the two replays' results. ``told``: each rollout is also told its length, as the engine tells a loss budget
    (``new_rollout(max_tokens=)``): its steps, which is how many tokens per request plain decoding replays.
    ``counterfactual``: the selectors also get the arms they did not run (``simulate.replay_selector``'s)."""
    from tlt_kernels.runtime.simulate import replay_selector

    timed = [r for r in records if r.get("rollout") == 1]
    warm_up = [r for r in records if r.get("rollout") != 1]
    cold = fresh()
    if told:
        cold.new_rollout(max_tokens=len(timed))
    cold_run = replay_selector(timed, cold, counterfactual)
    warm = fresh()
    if told:
        warm.new_rollout(max_tokens=len(warm_up))
    replay_selector(warm_up, warm, counterfactual)
    warm.new_rollout(max_tokens=len(timed) if told else None)  # as the engine does at each generate
    return cold_run, replay_selector(timed, warm, counterfactual)


def jittered(records, seed: int, sigma: float = TIMING_NOISE_SIGMA):
    """A copy of trace ``records`` whose step times are scaled by ``exp(sigma * N(0, 1))`` (``random.Random(seed)``):
    another draw of the probes' timing noise, as a re-run of the same rollout would give."""
    import copy
    import random

    rnd = random.Random(seed)
    out = copy.deepcopy(records)
    for r in out:
        for o in r["arms"].values():
            o["step_time"] *= math.exp(sigma * rnd.gauss(0.0, 1.0))
    return out


def real_trace_paths(name: str):
    """The trace files (``*-B*.json``, sorted) of real trace set ``name`` (a directory under :data:`TRACES_DIR`)."""
    import glob

    return sorted(glob.glob(os.path.join(TRACES_DIR, name, "*-B*.json")))


def real_trace_scores(records, table, label: str = "cost", counterfactual: bool = False,
                      **selector_kwargs) -> Dict[str, dict]:
    """Static arms and the default selector, cold (a fresh selector on the timed rollout, with the engine's start-up
    ``table``) and warm (the same selector over the warm-up rollout first, then told of the new rollout as the engine
    tells it), replayed on one real trace's ``records``. Per row name: ``ms`` (plain decoding's tokens of the timed
    rollout at the row's tokens per second) and three scores: over the whole rollout (tokens over seconds, ``vs_off``,
    ``vs_best_static``), step by step (``_same_work_s``: ``vs_off_per_step``, ``vs_best_static_per_step``) and, where
    the trace counts the lagging rows, by their progress (``_lagging_rate``: ``vs_off_lagging``,
    ``vs_best_static_lagging``). The first two count every row's tokens, which a static batch that waits for its
    lagging rows does not gain from. ``selector_kwargs``: ``StrategySelector`` arguments on top of the defaults (with
    ``loss_budget``, each rollout is told its length, as the engine tells it); ``label``: the selector rows' name
    (``"<label>, cold"``, ``"<label>, warm"``); ``counterfactual``: the selectors also get every arm they did not
    run, as an n-gram drafter's counterfactual would give them (``simulate.replay_selector``)."""
    from tlt_kernels.runtime import Strategy, StrategySelector

    timed = [r for r in records if r.get("rollout") == 1]
    arms = sorted({Strategy.parse(k) for r in records for k in r["arms"]}, key=str)
    runs = {f"static {a}": replay_static(timed, a) for a in arms}

    def selector():
        return StrategySelector([a for a in arms if not a.is_off], seed=0, cost_table=table, **selector_kwargs)

    runs[f"{label}, cold"], runs[f"{label}, warm"] = replay_cold_and_warm(
        records, selector, told="loss_budget" in selector_kwargs, counterfactual=counterfactual)
    rates = {name: _trace_rate(timed, res.picks) for name, res in runs.items()}
    per_step = {name: _same_work_s(res) for name, res in runs.items()}
    off_tokens = sum(r["arms"]["off"]["emitted"] for r in timed)
    best = max(v for k, v in rates.items() if k.startswith("static"))
    best_per_step = min(v for k, v in per_step.items() if k.startswith("static"))
    scores = {name: dict(ms=1e3 * off_tokens / rate, vs_off=round(rate / rates["static off"], 4),
                         vs_best_static=round(rate / best, 4),
                         vs_off_per_step=round(per_step["static off"] / per_step[name], 4),
                         vs_best_static_per_step=round(best_per_step / per_step[name], 4))
              for name, rate in rates.items()}
    lagging = {name: _lagging_rate(timed, res.picks) for name, res in runs.items()}
    if None not in lagging.values():
        best_lagging = max(v for k, v in lagging.items() if k.startswith("static"))
        for name, rate in lagging.items():
            scores[name].update(vs_off_lagging=round(rate / lagging["static off"], 4),
                                vs_best_static_lagging=round(rate / best_lagging, 4))
    return scores


def _real_model_trace(ctx, path: str, table, trace_set: str) -> None:
    """:func:`real_trace_scores` of one real trace, as rows."""
    from tlt_kernels.runtime.simulate import load_trace

    records = load_trace(path)
    timed = sum(1 for r in records if r.get("rollout") == 1)
    case = {"workload": f"real trace {trace_set}/{os.path.basename(path)[:-5]} ({timed} steps)"}
    rows = real_trace_scores(records, table)
    if os.path.basename(path).startswith("ngram-"):  # the n-gram drafter scores every arm's drafts for free
        rows.update(counterfactual_rows(records, table))
    for name, scores in rows.items():
        ms = scores.pop("ms")
        ctx.add(case, name, ms, **scores)


def counterfactual_rows(records, table) -> Dict[str, dict]:
    """:func:`real_trace_scores`' selector rows of the ``"counterfactual"`` policy given every arm it did not run
    (``"counterfactual, cold"``, ``"counterfactual, warm"``): what an n-gram drafter that scores every arm's drafts
    would give it (docs/RUNTIME.md, "The counterfactual policy")."""
    rows = real_trace_scores(records, table, label="counterfactual", counterfactual=True, policy="counterfactual")
    return {name: row for name, row in rows.items() if name.startswith("counterfactual")}


def _real_model_traces(ctx) -> None:
    for name, origin in REAL_TRACES:
        directory = os.path.join(TRACES_DIR, name)
        for path in real_trace_paths(name):
            drafter = os.path.basename(path).split("-")[0]
            _real_model_trace(ctx, path, trace_cost_table(directory, drafter), name)
        ctx.note(f"real traces: bench/traces/{name}: {origin}; ms = time to emit plain decoding's tokens of the timed "
                 "rollout at the row's tokens per second over the recorded steps (vs_off, vs_best_static); *_per_step: "
                 "the same ratios of the time to emit each step's best arm's tokens at the row's efficiency at that "
                 "step (as the engine-trace rows), which a long tail's wide first steps do not dominate; *_lagging "
                 "(traces with the lagging rows' counts): the ratios of the lagging rows' mean tokens per second, "
                 "the progress a static batch waits for")


STATIC_BATCH_ARMS = ("off", "s2k1v3", "s4k1v5", "s5k4v16")
# The loss budget of the static batches' budgeted rows (StrategySelector(loss_budget=)), and their name.
STATIC_BATCH_LOSS_BUDGET = 0.02
BUDGET_ROW = "cost, lagging feedback, 2% loss budget"
FORECAST_ROW = f"{BUDGET_ROW}, forecast"
COUNTERFACTUAL_ROW = "counterfactual, lagging feedback"


def exact_cost_table(batch, arms):
    """The static batch's own step costs for ``arms`` at the captured sizes: the exact table a cold selector starts
    from (the engine measures its own at start-up)."""
    from tlt_kernels.runtime import CostTable

    return CostTable({a: [(b, batch.cost(a, b)) for b in (1, 2, 4, 8, 16, 32, 64)] for a in arms})


def _static_batch_family(draw: int):
    """Every simulated static batch of the suite, the ``draw``-th batch of each kind (0: the kind's default batch)."""
    from tlt_kernels.runtime.static_batch import good_drafter_batches, grpo_batch, ngram_tail_batch, static_batches

    return (static_batches(seed=draw) + [grpo_batch(seed=draw), ngram_tail_batch(seed=draw)]
            + good_drafter_batches(seed=draw))


def _static_batches(ctx, seeds) -> None:
    """Static batches of a launch-bound small target (:mod:`tlt_kernels.runtime.static_batch`): the wall time of each
    static arm and of the cost policy under each feedback rule (a fresh selector per rollout, the cost table given),
    and warm under the engine's rule (the selector first runs another batch of the same kind, then is told of the
    new rollout, as the engine tells it at each generate)."""
    from tlt_kernels.runtime import Strategy
    from tlt_kernels.runtime.static_batch import batch_feedback, critical_feedback, lagging_feedback, run_static_batch

    arms = tuple(Strategy.parse(a) for a in STATIC_BATCH_ARMS)
    feedbacks = {"batch": batch_feedback, "lagging (the engine's)": lagging_feedback, "critical": critical_feedback}
    for batch, warm_up in zip(_static_batch_family(0), _static_batch_family(1)):
        table = exact_cost_table(batch, arms)
        seconds = {f"static {a}": sum(run_static_batch(batch, lambda b, a=a: a, seed=s) for s in seeds) for a in arms}
        for name, feedback in feedbacks.items():
            seconds[f"cost, {name} feedback"] = sum(_cold_run(batch, arms, table, s, feedback) for s in seeds)
        seconds["cost, lagging feedback, warm"] = sum(_warm_run(batch, warm_up, arms, table, s) for s in seeds)
        # the engine's rule and the loss budget told each rollout's length, as the engine tells it
        seconds[BUDGET_ROW] = sum(_cold_run(batch, arms, table, s, lagging_feedback, STATIC_BATCH_LOSS_BUDGET)
                                  for s in seeds)
        seconds[f"{BUDGET_ROW}, warm"] = sum(_warm_run(batch, warm_up, arms, table, s, STATIC_BATCH_LOSS_BUDGET)
                                             for s in seeds)
        seconds[FORECAST_ROW] = sum(_cold_run(batch, arms, table, s, lagging_feedback, STATIC_BATCH_LOSS_BUDGET, True)
                                    for s in seeds)
        seconds[f"{FORECAST_ROW}, warm"] = sum(_warm_run(batch, warm_up, arms, table, s, STATIC_BATCH_LOSS_BUDGET, True)
                                               for s in seeds)
        seconds[COUNTERFACTUAL_ROW] = sum(_cold_run(batch, arms, table, s, lagging_feedback, counterfactual=True)
                                          for s in seeds)
        seconds[f"{COUNTERFACTUAL_ROW}, warm"] = sum(_warm_run(batch, warm_up, arms, table, s, counterfactual=True)
                                                     for s in seeds)
        plain, best = seconds["static off"], min(seconds[f"static {a}"] for a in arms)
        for name, total in seconds.items():
            ctx.add({"workload": batch.name}, name, 1e3 * total / len(seeds), vs_off=round(plain / total, 4),
                    vs_best_static=round(best / total, 4))
    ctx.note("static batches: every request has 128 tokens (the GRPO-like batch: up to 256, half stopping early; the "
             "long tail: log-normal lengths up to 256, n-gram copy phases) and its own acceptance; the good-drafter "
             "batches run a 7B-class target's step times (StepCost's defaults), the others a small target's; a seed "
             "fixes the batch's text, so every row of a seed meets the same one; ms = the batch's simulated wall "
             "time (mean over the seeds), so vs_off and vs_best_static are wall-time ratios; the feedback rule is "
             "what the selector learns after each step; warm: the selector ran the kind's next batch first; "
             f"'{BUDGET_ROW}': StrategySelector(loss_budget={STATIC_BATCH_LOSS_BUDGET}) told each rollout's most "
             f"tokens per request, as the engine tells it; '{FORECAST_ROW}': the same with "
             f"StrategySelector(forecast=AcceptanceForecast()); '{COUNTERFACTUAL_ROW}': the counterfactual policy "
             "given every arm it did not run, scored on the same text (what an n-gram drafter's counterfactual "
             "gives; drafting-model acceptance in some batches here: a bound, not an engine's) "
             "(tlt_kernels/runtime/static_batch.py, tlt_kernels/runtime/loss_budget.py, "
             "tlt_kernels/runtime/forecast.py, tlt_kernels/runtime/policies/counterfactual.py)")


def _selector(arms, table, seed: int, loss_budget, forecast: bool, counterfactual: bool = False):
    """The cost policy over ``arms`` with ``table``, ``loss_budget`` and, with ``forecast``, the requests' forecast;
    ``counterfactual``: the counterfactual policy instead."""
    from tlt_kernels.runtime import StrategySelector
    from tlt_kernels.runtime.forecast import AcceptanceForecast

    return StrategySelector(arms, policy="counterfactual" if counterfactual else "cost", seed=seed, cost_table=table,
                            loss_budget=loss_budget, forecast=AcceptanceForecast() if forecast else None)


def _cold_run(batch, arms, table, seed: int, feedback, loss_budget=None, forecast: bool = False,
              counterfactual: bool = False) -> float:
    """Seconds of ``batch`` under a fresh selector learning through ``feedback``; with ``loss_budget``, told the
    rollout's length; with ``forecast``, the requests' acceptance forecast; ``counterfactual``: the counterfactual
    policy, given every arm it did not run."""
    from tlt_kernels.runtime.simulate import CounterfactualDelay
    from tlt_kernels.runtime.static_batch import run_static_batch, selector_observer

    selector = _selector(arms, table, seed, loss_budget, forecast, counterfactual)
    if loss_budget is not None:
        selector.new_rollout(max_tokens=int(batch.initial_left().max()))
    return run_static_batch(batch, selector.select, selector_observer(selector), feedback, seed,
                            CounterfactualDelay(selector) if counterfactual else None)


def _warm_run(batch, warm_up, arms, table, seed: int, loss_budget=None, forecast: bool = False,
              counterfactual: bool = False) -> float:
    """Seconds of ``batch`` under a selector that first ran ``warm_up`` (its own text) and was told of the new
    rollout; with ``loss_budget``, each rollout's length too; with ``forecast``, the requests' acceptance forecast;
    ``counterfactual``: the counterfactual policy, given every arm it did not run."""
    from tlt_kernels.runtime.simulate import CounterfactualDelay
    from tlt_kernels.runtime.static_batch import lagging_feedback, run_static_batch, selector_observer

    selector = _selector(arms, table, seed, loss_budget, forecast, counterfactual)
    told = loss_budget is not None
    if told:
        selector.new_rollout(max_tokens=int(warm_up.initial_left().max()))
    run_static_batch(warm_up, selector.select, selector_observer(selector), lagging_feedback, seed + 1000,
                     CounterfactualDelay(selector) if counterfactual else None)
    selector.new_rollout(max_tokens=int(batch.initial_left().max()) if told else None)
    return run_static_batch(batch, selector.select, selector_observer(selector), lagging_feedback, seed,
                            CounterfactualDelay(selector) if counterfactual else None)


def run(ctx) -> None:
    from tlt_kernels.runtime import DEFAULT_POLICY
    from tlt_kernels.runtime.simulate import DEFAULT_ARMS, evaluate, standard_workloads

    p = values(ctx, FLAGS)
    full = not ctx.small or bool(p.full)
    seeds = tuple(range(p.seeds)) if full else (0,)
    ctx.note(f"arms: {[str(a) for a in DEFAULT_ARMS]}; {'2400' if full else '600'} steps per workload, "
             f"seeds {list(seeds)}; default policy: {DEFAULT_POLICY}")
    for wl in standard_workloads(small=not full):
        res = evaluate(wl, {p: _factory(p) for p in POLICIES}, DEFAULT_ARMS, seeds)
        case = {"workload": wl.name}
        base = res.pop("_baselines")
        for name, sec in base.items():
            ctx.add(case, name, sec * 1e3)
        for p in POLICIES:
            r = res[p]
            ctx.add(case, p, r["sim_s"] * 1e3, vs_oracle=round(r["vs_oracle"], 4),
                    vs_best_static=round(r["vs_best_static"], 4), vs_off=round(r["vs_off"], 4),
                    reconverge_steps=r["reconverge_steps"], settle_steps=r["settle_steps"])
    _engine_traces(ctx)
    _real_model_traces(ctx)
    _static_batches(ctx, seeds)
    for p in POLICIES:
        ctx.add({"workload": "cpu: select+update"}, p, _cpu_cost_us(p) * 1e-3)
    for p in POLICIES:
        ctx.add({"workload": "cpu: select+update, drifting"}, p, _cpu_cost_us(p, drifting=True) * 1e-3)
    _forecast_cost_rows(ctx)
    _counterfactual_cost_rows(ctx)


def _counterfactual_cost_rows(ctx) -> None:
    """The host cost of the counterfactual policy given every arm it did not run at every step (six arms of
    ``DEFAULT_ARMS``, so five or six ``observe_counterfactual`` calls), against the cost policy (same run)."""
    case = {"workload": "cpu: select+update, every arm's counterfactual"}
    ctx.add(case, "cost", _cpu_cost_us("cost") * 1e-3)
    ctx.add(case, "counterfactual", _cpu_cost_us("counterfactual", counterfactual=True) * 1e-3)


def _forecast_cost_rows(ctx) -> None:
    """The host cost of the loss budget and of the forecast on top, against the cost policy alone (same run)."""
    from tlt_kernels.runtime.forecast import AcceptanceForecast

    case = {"workload": "cpu: select+update, per-row acceptance"}
    ctx.add(case, "cost", _cpu_cost_us("cost", per_row=True) * 1e-3)
    ctx.add(case, "cost, 2% loss budget", _cpu_cost_us("cost", per_row=True, loss_budget=0.02) * 1e-3)
    ctx.add(case, "cost, 2% loss budget, forecast",
            _cpu_cost_us("cost", per_row=True, loss_budget=0.02, forecast=AcceptanceForecast()) * 1e-3)
