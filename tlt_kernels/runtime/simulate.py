"""Workload simulator for the strategy selector: acceptance that changes over time, step cost that
depends on batch size and verify width, batches that shrink as responses finish, and trace replay.

The models are deliberately simple and documented so the benchmark numbers can be reasoned about:

* Acceptance: position ``j`` (1-based) of a chain is accepted, given ``j-1`` were, with probability
  ``alpha_j = alpha(t) * depth_decay**(j-1)``. A tree with ``w = min(topk, (num_verify-1)/num_steps)``
  candidates per level accepts with ``1 - (1 - alpha_j)**sqrt(w)`` (siblings are correlated, so the
  gain is sub-linear). Expected tokens per request per step: ``1 + sum_i prod_{j<=i} alpha_eff_j``.
* Step time (seconds), a roofline of one target forward plus ``num_steps`` drafter forwards::

      verify = t0 + kv * B * ctx(t) + tok * B * num_verify + flop * max(0, B * num_verify - knee)
      draft  = num_steps * (d0 + d_tok * B * topk) + tree_overhead   (0 for plain decoding)

  Below ``knee`` verified tokens the target is weight-bandwidth bound, so small batches verify extra
  tokens almost for free (deep trees win); above it every verified token costs compute (plain decoding
  wins). Observed times carry log-normal noise.
* Batches: a schedule ``batch_size(t)``, or a long tail where ``B0`` requests with log-normal response
  lengths each emit their accepted tokens per step and leave when done (256 -> 1).

The oracle knows the current acceptance and batch size and plays the arm with the highest expected
throughput ``B * E[tokens] / E[time]``. Scores use expected step times (the noise only reaches the
policy), so oracle ratios are not blurred by timing noise.
"""
from __future__ import annotations

import json
import math
import numbers
import random
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from .policies import CostTable
from .selector import StrategySelector
from .strategy import Strategy

DEFAULT_ARMS = (
    Strategy.off(),
    Strategy(1, 1, 2),
    Strategy(3, 1, 4),
    Strategy(5, 1, 6),
    Strategy(4, 4, 8),
    Strategy(6, 4, 16),
    Strategy(8, 8, 32),
)
#: batch sizes a graph pool would capture, and where the start-up cost table is measured
CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


@dataclass
class StepCost:
    """Roofline step-time model (seconds); defaults are roughly a 7B target with a 1-layer drafter on an H100."""

    t0: float = 7.0e-3
    kv: float = 6.0e-6  # per request per 1k tokens of context
    tok: float = 2.0e-6  # per verified token (sampling, tree bookkeeping)
    flop: float = 14.0e-6  # per verified token past the knee
    knee: int = 384
    d0: float = 0.45e-3
    d_tok: float = 1.0e-6
    tree_overhead: float = 0.4e-3

    def __call__(self, s: Strategy, batch_size: int, ctx_k: float = 1.0) -> float:
        T = batch_size * s.num_verify
        t = self.t0 + self.kv * batch_size * ctx_k + self.tok * T + self.flop * max(0, T - self.knee)
        if not s.is_off:
            t += s.num_steps * (self.d0 + self.d_tok * batch_size * s.topk) + self.tree_overhead
        return t


def alpha_eff(s: Strategy, alpha: float, depth_decay: float = 0.97) -> List[float]:
    """Per-position conditional acceptance of strategy ``s`` at base acceptance ``alpha``."""
    if s.is_off:
        return []
    w = min(s.topk, max(1.0, (s.num_verify - 1) / s.num_steps))
    e = math.sqrt(w)
    return [1.0 - (1.0 - min(alpha * depth_decay ** j, 0.999)) ** e for j in range(s.num_steps)]


def expected_tokens(s: Strategy, alpha: float, depth_decay: float = 0.97) -> float:
    total, reach = 1.0, 1.0
    for a in alpha_eff(s, alpha, depth_decay):
        reach *= a
        total += reach
    return total


@dataclass
class Workload:
    """A simulated rollout.

    Args:
        name: label in reports.
        alpha: base acceptance as a function of the step index.
        phase: phase id as a function of the step (phase changes are where re-convergence is measured).
        steps: steps to run (schedule workloads) or the cap on steps (long tail).
        batch_size: ``batch_size(step)`` for schedule workloads; None for a long tail.
        long_tail: ``(num_requests, median_len, sigma, max_len)`` of log-normal response lengths.
        ctx_k: context length (thousands of tokens) as a function of the step; scales attention cost.
        cost: the step-time model; ``noise`` the log-normal sigma of observed times.
    """

    name: str
    alpha: Callable[[int], float]
    phase: Callable[[int], int]
    steps: int
    batch_size: Optional[Callable[[int], int]] = None
    long_tail: Optional[tuple] = None
    ctx_k: Callable[[int], float] = lambda t: 1.0
    cost: StepCost = field(default_factory=StepCost)
    noise: float = 0.05
    depth_decay: float = 0.97

    def expected_time(self, s: Strategy, b: int, t: int) -> float:
        return self.cost(s, b, self.ctx_k(t))

    def oracle_arm(self, arms: Sequence[Strategy], b: int, t: int) -> Strategy:
        al = self.alpha(t)
        return max(arms, key=lambda s: expected_tokens(s, al, self.depth_decay) / self.expected_time(s, b, t))


def _segments(values, every):
    return lambda t: values[min(t // every, len(values) - 1)]


def standard_workloads(small: bool = False) -> List[Workload]:
    """Phase-shifting (per batch size and mixed), drafter warm-up, target drift, and long tail."""
    n = 600 if small else 2400
    seg = n // 4
    alphas = (0.85, 0.45, 0.9, 0.6)
    out = []
    for b in (1, 8, 32, 64, 128, 256):
        out.append(Workload(f"phase-shift-B{b}", alpha=_segments(alphas, seg), phase=lambda t, s=seg: t // s,
                            steps=n, batch_size=lambda t, b=b: b))
    sizes = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    rnd = random.Random(7)
    sched = [rnd.choice(sizes) for _ in range(n // 25 + 1)]  # the batch size changes every 25 steps
    out.append(Workload("phase-shift-mixed", alpha=_segments(alphas, seg), phase=lambda t, s=seg: t // s,
                        steps=n, batch_size=lambda t: sched[t // 25]))
    out.append(Workload("drafter-warmup-B16", alpha=lambda t: 0.3 + 0.6 * min(1.0, t / n), phase=lambda t: 0,
                        steps=n, batch_size=lambda t: 16))
    out.append(Workload("target-drift-B48", alpha=lambda t: 0.88 - 0.4 * min(1.0, t / n), phase=lambda t: 0,
                        steps=n, batch_size=lambda t: 48, ctx_k=lambda t: 1.0 + 3.0 * t / n))
    lt = (64, 150, 0.9, 1500) if small else (256, 500, 0.9, 6000)
    out.append(Workload("long-tail-256", alpha=_segments((0.8, 0.55), n), phase=lambda t, s=n: int(t >= s),
                        steps=10 * lt[3], long_tail=lt, ctx_k=lambda t: 1.0 + t / 1000.0))
    return out


@dataclass
class RunResult:
    tokens: float
    time_s: float
    steps: int
    efficiency: List[float]  # per step: expected throughput of the choice / the oracle's
    oracle_time: List[float]  # per step: the oracle's expected step time (weights for fixed-work scoring)
    phase_changes: List[int]
    choices: Dict[str, int]
    picks: List[str] = field(default_factory=list)  # trace replays: the arm chosen at every step

    @property
    def throughput(self) -> float:
        return self.tokens / self.time_s

    @property
    def oracle_fraction(self) -> float:
        """Throughput as a fraction of the oracle's for the same work: at every step the oracle's tokens
        must be produced, which takes ``oracle_time / efficiency``. Independent of how the schedule
        weights batch sizes, and <= 1 by construction."""
        ot = np.asarray(self.oracle_time)
        return float(ot.sum() / (ot / np.asarray(self.efficiency)).sum())


def _sample_reach(rng: np.random.Generator, eff: List[float], b: int) -> np.ndarray:
    """Accepted draft tokens per request, ``[b]`` ints in ``[0, len(eff)]``."""
    if not eff:
        return np.zeros(b, dtype=np.int64)
    ok = rng.random((b, len(eff))) < np.asarray(eff)
    return np.cumprod(ok, axis=1).sum(axis=1)


def run(workload: Workload, choose: Callable[[int, int], Strategy],
        observe: Optional[Callable[..., None]], arms: Sequence[Strategy], seed: int = 0) -> RunResult:
    """Simulate ``workload`` with ``choose(batch_size, step) -> Strategy``; ``observe(s, b, emitted, t_obs,
    accepted_per_position)`` receives noisy observations."""
    rng = np.random.default_rng(seed)
    wl = workload
    remaining = _response_lengths(rng, wl.long_tail) if wl.long_tail is not None else None
    tokens = time_s = 0.0
    eff_log: List[float] = []
    oracle_time: List[float] = []
    changes: List[int] = []
    choices: Dict[str, int] = {}
    last_phase = wl.phase(0)
    oracle_cache: Dict[tuple, tuple] = {}
    t = 0
    while t < wl.steps:
        if remaining is not None:
            active = remaining > 0
            b = int(active.sum())
            if b == 0:
                break
        else:
            active, b = None, wl.batch_size(t)
        ph = wl.phase(t)
        if ph != last_phase:
            changes.append(t)
            last_phase = ph
        s = choose(b, t)
        choices[str(s)] = choices.get(str(s), 0) + 1
        al = wl.alpha(t)
        best, best_time = _oracle_step(oracle_cache, wl, arms, al, b, t)
        oracle_time.append(best_time)
        reach = _sample_reach(rng, alpha_eff(s, al, wl.depth_decay), b)
        t_exp = wl.expected_time(s, b, t)
        eff_log.append(expected_tokens(s, al, wl.depth_decay) / t_exp / best)
        emitted = _emit(reach, b, remaining, active)
        tokens += emitted
        time_s += t_exp
        if observe is not None:
            t_obs = t_exp * math.exp(wl.noise * rng.standard_normal())
            observe(s, b, emitted, t_obs, [int((reach > j).sum()) for j in range(s.num_steps)])
        t += 1
    return RunResult(tokens, time_s, t, eff_log, oracle_time, changes, choices)


def _response_lengths(rng: np.random.Generator, long_tail: tuple) -> np.ndarray:
    """A long tail's response lengths: ``num_requests`` log-normal draws, clipped to ``[1, max_len]``."""
    nreq, med, sig, cap = long_tail
    return np.minimum(np.maximum(rng.lognormal(math.log(med), sig, nreq).astype(np.int64), 1), cap)


def _oracle_step(cache: Dict[tuple, tuple], wl: Workload, arms: Sequence[Strategy], al: float, b: int,
                 t: int) -> tuple:
    """The oracle's ``(expected throughput, expected step time)`` at acceptance ``al`` and batch size ``b``, cached
    per (acceptance, batch size, context length)."""
    key = (round(al, 4), b, round(wl.ctx_k(t), 2))
    best = cache.get(key)
    if best is None:
        o = max(arms, key=lambda a: expected_tokens(a, al, wl.depth_decay) / wl.expected_time(a, b, t))
        best = (expected_tokens(o, al, wl.depth_decay) / wl.expected_time(o, b, t), wl.expected_time(o, b, t))
        cache[key] = best
    return best


def _emit(reach: np.ndarray, b: int, remaining: Optional[np.ndarray], active: Optional[np.ndarray]) -> int:
    """Tokens emitted by one step (each request's accepted drafts plus one); a long tail's active requests emit at
    most what remains of their responses, which ``remaining`` loses (in place)."""
    if remaining is None:
        return int(reach.sum()) + b
    idx = np.nonzero(active)[0]
    got = np.minimum(reach + 1, remaining[idx])
    remaining[idx] -= got
    return int(got.sum())


def run_selector(workload: Workload, selector: StrategySelector, seed: int = 0) -> RunResult:
    return run(workload, lambda b, t: selector.select(b), selector.update, selector.strategies, seed)


def run_oracle(workload: Workload, arms: Sequence[Strategy], seed: int = 0) -> RunResult:
    return run(workload, lambda b, t: workload.oracle_arm(arms, b, t), None, arms, seed)


def run_static(workload: Workload, arm: Strategy, arms: Sequence[Strategy], seed: int = 0) -> RunResult:
    return run(workload, lambda b, t: arm, None, arms, seed)


def measure_cost_table(workload: Workload, arms: Sequence[Strategy], seed: int = 0,
                       sizes: Sequence[int] = CAPTURE_SIZES) -> CostTable:
    """The start-up table a real engine would get by timing each captured graph: noisy, at step 0's context."""
    rng = np.random.default_rng(seed + 99991)
    return CostTable.measure(
        lambda s, b: workload.expected_time(s, b, 0) * math.exp(workload.noise * rng.standard_normal()),
        arms, sizes, repeats=3,
    )


def reconvergence_steps(res: RunResult, level: float = 0.95, span: int = 20) -> Optional[int]:
    """Worst over phase changes of the steps until the mean efficiency over the next ``span`` steps
    first reaches ``level`` (None without phase changes)."""
    if not res.phase_changes:
        return None
    e = np.asarray(res.efficiency)
    csum = np.concatenate([[0.0], np.cumsum(e)])
    bounds = res.phase_changes + [len(e)]
    worst = 0
    for c, nxt in zip(res.phase_changes, bounds[1:]):
        lag = nxt - c
        for t in range(c, max(c, nxt - span) + 1):
            if (csum[min(t + span, len(e))] - csum[t]) / max(1, min(span, len(e) - t)) >= level:
                lag = t - c
                break
        worst = max(worst, lag)
    return worst


def settle_steps(res: RunResult, tol: float = 0.01, run: int = 10) -> Optional[int]:
    """Worst over phase changes of the steps until the choice is within ``tol`` of the oracle's
    throughput (the oracle's arm or one as good) for ``run`` consecutive steps; the phase's length when
    that never happens (None without phase changes). Stricter than :func:`reconvergence_steps`: a
    persistently 4%-worse arm, or exploring every few steps, never settles."""
    if not res.phase_changes:
        return None
    ok = np.asarray(res.efficiency) >= 1.0 - tol
    bounds = res.phase_changes + [len(ok)]
    worst = 0
    for c, nxt in zip(res.phase_changes, bounds[1:]):
        lag, streak = nxt - c, 0
        for t in range(c, nxt):
            streak = streak + 1 if ok[t] else 0
            if streak == run:
                lag = t - run + 1 - c
                break
        worst = max(worst, lag)
    return worst


# -- traces --------------------------------------------------------------------------------------
def record_trace(workload: Workload, arms: Sequence[Strategy], seed: int = 0) -> List[dict]:
    """What an engine logs when it times every arm at every step (e.g. shadow runs): one record per step,
    ``{"batch_size": B, "phase": p, "arms": {"s3k1v4": {"step_time": s, "emitted": n, "accepted": [...]}}}``.
    Schedule workloads only."""
    if workload.batch_size is None:
        raise ValueError("record_trace needs a schedule workload (batch_size(step)); long tails depend on the policy")
    rng = np.random.default_rng(seed)
    recs = []
    for t in range(workload.steps):
        b = workload.batch_size(t)
        al = workload.alpha(t)
        arms_rec = {}
        for s in arms:
            reach = _sample_reach(rng, alpha_eff(s, al, workload.depth_decay), b)
            arms_rec[str(s)] = {
                "step_time": workload.expected_time(s, b, t) * math.exp(workload.noise * rng.standard_normal()),
                "emitted": int(reach.sum()) + b,
                "accepted": [int((reach > j).sum()) for j in range(s.num_steps)],
            }
        recs.append({"batch_size": b, "phase": workload.phase(t), "arms": arms_rec})
    return recs


def load_trace(path: str) -> List[dict]:
    """Read a trace written by :func:`record_trace` or ``SpeculativeEngine.generate(trace=...)``; every record is
    checked, since one NaN step time would turn every later efficiency into NaN (ValueError naming the record)."""
    with open(path) as f:
        try:
            recs = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"trace {path} is not valid JSON: {exc}") from exc
    if not isinstance(recs, list) or not recs:
        raise ValueError(f"trace {path} must be a non-empty JSON list of step records")
    for i, r in enumerate(recs):
        if not isinstance(r, dict) or "batch_size" not in r or not isinstance(r.get("arms"), dict) or not r["arms"]:
            raise ValueError(f"trace {path} record {i} needs 'batch_size' and a non-empty 'arms' map")
        _check_trace_record(f"trace {path} record {i}", r)
    return recs


def _finite(x, low: float) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= low


def _check_trace_record(where: str, r: dict) -> None:
    """A record's batch size is an int >= 1, each arm's step time a finite number > 0 of seconds and its counts finite
    and >= 0; arm names parse as strategies; the optional counts of rows with a draft lie in [0, batch size]."""
    b = r["batch_size"]
    if isinstance(b, bool) or not isinstance(b, numbers.Integral) or b < 1:
        raise ValueError(f"{where}: batch_size must be an int >= 1, got {b!r}")
    for name, a in r["arms"].items():
        Strategy.parse(name)
        t, em = (a.get("step_time"), a.get("emitted")) if isinstance(a, dict) else (None, None)
        if not (_finite(t, 0.0) and t > 0):
            raise ValueError(f"{where}, arm {name}: step_time must be a finite number of seconds > 0, got {t!r}")
        if not _finite(em, 0.0):
            raise ValueError(f"{where}, arm {name}: emitted must be a finite count >= 0, got {em!r}")
        for key in ("accepted", "lagging_accepted"):
            acc = a.get(key)
            if acc is not None and not (isinstance(acc, list) and all(_finite(x, 0.0) for x in acc)):
                raise ValueError(f"{where}, arm {name}: {key} must be a list of finite counts >= 0, got {acc!r}")
        rows = a.get("lagging_rows")
        if rows is not None and not _finite(rows, 0.0):
            raise ValueError(f"{where}, arm {name}: lagging_rows must be a finite count >= 0, got {rows!r}")
    for key in ("drafted_rows", "lagging_drafted_rows"):  # n-gram traces: rows with a draft (engine.probe)
        n = r.get(key)
        if n is not None and not (_finite(n, 0.0) and n <= b):
            raise ValueError(f"{where}: {key} must be a count in [0, batch_size={b}], got {n!r}")


def replay_trace(records: List[dict], choose: Callable[[int, List[Strategy]], Strategy],
                 observe: Optional[Callable[..., None]] = None) -> RunResult:
    """Replay a trace: the policy picks among the arms recorded at each step and sees that arm's record:
    ``observe(strategy, batch_size, emitted, step_time, accepted)``, or, where the record counts the lagging rows
    (``lagging_rows``, ``lagging_accepted``: engine traces), their acceptance with ``accepted_rows=`` as the engine
    feeds its selector. Efficiency is against the per-step best recorded arm (a hindsight oracle)."""
    tokens = time_s = 0.0
    eff, otime, changes, choices, picks = [], [], [], {}, []
    last = records[0].get("phase", 0)
    for t, r in enumerate(records):
        _check_trace_record(f"trace step {t}", r)  # a NaN step time would make every later efficiency NaN
        if r.get("phase", 0) != last:
            changes.append(t)
            last = r.get("phase", 0)
        arms = {Strategy.parse(k): v for k, v in r["arms"].items()}
        s = choose(r["batch_size"], list(arms))
        if s not in arms:
            raise ValueError(f"trace step {t}: policy chose {s}, which the trace did not record")
        o = arms[s]
        tokens += o["emitted"]
        time_s += o["step_time"]
        best = max(arms.values(), key=lambda v: v["emitted"] / v["step_time"])
        eff.append((o["emitted"] / o["step_time"]) / (best["emitted"] / best["step_time"]))
        otime.append(best["step_time"])
        choices[str(s)] = choices.get(str(s), 0) + 1
        picks.append(str(s))
        if observe is None:
            continue
        if o.get("lagging_rows") and o.get("lagging_accepted"):
            observe(s, r["batch_size"], o["emitted"], o["step_time"], o["lagging_accepted"],
                    accepted_rows=o["lagging_rows"])
        else:
            observe(s, r["batch_size"], o["emitted"], o["step_time"], o.get("accepted"))
    return RunResult(tokens, time_s, len(records), eff, otime, changes, choices, picks)


def replay_selector(records: List[dict], selector: StrategySelector, counterfactual: bool = False) -> RunResult:
    """Replay with a selector; arms missing from a record count as "no graph captured" for that step.

    ``counterfactual``: after each step the selector also gets every other speculative arm's recorded counts, once
    :class:`CounterfactualDelay` says they are known, as a drafter that scores every arm's drafts would give them."""
    current: set = set()
    selector.available = lambda s, b: s in current

    def choose(b, arms):
        current.clear()
        current.update(arms)
        selector.invalidate_available()
        return selector.select(b)

    if not counterfactual:
        return replay_trace(records, choose, selector.update)
    delay = CounterfactualDelay(selector)
    step = iter(records)

    def observe(s, batch_size, *args, **kwargs):
        selector.update(s, batch_size, *args, **kwargs)
        record = next(step)
        arms = ((Strategy.parse(name), o) for name, o in record["arms"].items())
        delay.step(s, [_recorded_counts(arm, record["batch_size"], o) for arm, o in arms if arm in delay.arms])

    return replay_trace(records, choose, observe)


def _recorded_counts(s: Strategy, batch_size: int, o: dict):
    """``(strategy, batch_size, counts, rows)`` of a trace record's arm: its lagging rows' counts where recorded,
    else the whole batch's (``rows`` None)."""
    rows = o.get("lagging_rows") if o.get("lagging_accepted") else None
    return s, batch_size, o["lagging_accepted"] if rows else o["accepted"], rows


class CounterfactualDelay:
    """Counterfactual counts held until their drafts are scored, then handed to ``selector.observe_counterfactual``.

    An arm of ``num_steps`` drafts proposed at a step is known ``num_steps`` steps later: its last draft needs that
    many more tokens, and a plain step emits one (a speculative step may emit more: the delay is the longest).
    Counts still held when the simulation ends are dropped. ``arms``: the selector's speculative arms."""

    def __init__(self, selector: StrategySelector):
        self.selector = selector
        self.arms = [s for s in selector.strategies if s.num_steps]
        self.now, self.waiting = 0, []

    def step(self, played: Strategy, counts) -> None:
        """One step ran ``played``; ``counts``: ``(strategy, batch_size, accepted_per_position, accepted_rows)`` of
        the arms scored at it (the played one is skipped: ``update`` has its counts)."""
        self.now += 1
        self.waiting.extend((self.now + s.num_steps, s, b, c, r) for s, b, c, r in counts if s != played)
        due = [w for w in self.waiting if w[0] <= self.now]
        if due:
            self.waiting = [w for w in self.waiting if w[0] > self.now]
        for _, s, b, c, r in due:
            self.selector.observe_counterfactual(s, b, c, accepted_rows=r)


# -- evaluation ----------------------------------------------------------------------------------
def evaluate(workload: Workload, make_selector, arms: Sequence[Strategy] = DEFAULT_ARMS,
             seeds: Sequence[int] = (0,)) -> dict:
    """Score one selector factory ``make_selector(arms, cost_table, seed)`` (or a ``{name: factory}``
    dict, returning ``{name: scores}``; baselines are simulated once per seed).

    Scores (means over seeds): throughput relative to the oracle, the best static arm and plain
    decoding; the worst re-convergence; the simulation's wall time per step (selector included);
    ``reconverge_steps`` / ``settle_steps``: worst over seeds of :func:`reconvergence_steps` /
    :func:`settle_steps`; ``sim_s``: simulated seconds for the work. Schedule workloads score the same work
    (:attr:`RunResult.oracle_fraction`); long tails score the realized throughput of finishing every
    response (the work is the responses' total length)."""
    single = not isinstance(make_selector, dict)
    makers = {"_": make_selector} if single else make_selector
    acc = {k: {"vs_oracle": [], "vs_best_static": [], "vs_off": [], "reconv": [], "settle": [], "us": [], "sim_s": [],
               "choices": {}} for k in makers}
    base = {"oracle": [], "best-static": [], "off": []}
    for seed in seeds:
        table, score, orc, work_s = _seed_baselines(workload, arms, seed)
        best_static = max(score.values())
        base["oracle"].append(work_s)
        base["best-static"].append(work_s / best_static)
        base["off"].append(work_s / score["off"])
        for name, mk in makers.items():
            _score_selector(acc[name], workload, mk(arms, table, seed), seed, orc, best_static, score["off"], work_s)
    out = {name: _summary(a) for name, a in acc.items()}
    if single:
        return out["_"]
    out["_baselines"] = {k: float(np.mean(v)) for k, v in base.items()}
    return out


def _seed_baselines(workload: Workload, arms: Sequence[Strategy], seed: int):
    """One seed's baselines: ``(start-up cost table, each static arm's score relative to the oracle, the oracle's
    throughput (long tails; else None), the oracle's seconds for the work)``."""
    table = measure_cost_table(workload, arms, seed)
    statics = {str(a): run_static(workload, a, arms, seed) for a in arms}
    orc_run = run_oracle(workload, arms, seed)
    if workload.long_tail is not None:
        orc = orc_run.throughput
        score = {k: r.throughput / orc for k, r in statics.items()}
        return table, score, orc, orc_run.time_s
    score = {k: r.oracle_fraction for k, r in statics.items()}
    return table, score, None, float(np.sum(orc_run.oracle_time))


def _score_selector(a: dict, workload: Workload, selector, seed: int, orc: Optional[float], best_static: float,
                    off_score: float, work_s: float) -> None:
    """Simulates one selector on one seed and appends its scores to the tally ``a``."""
    t0 = time.perf_counter()
    res = run_selector(workload, selector, seed)
    a["us"].append((time.perf_counter() - t0) / max(res.steps, 1))
    for k, v in res.choices.items():
        a["choices"][k] = a["choices"].get(k, 0) + v
    mine = res.throughput / orc if workload.long_tail is not None else res.oracle_fraction
    a["vs_oracle"].append(mine)
    a["vs_best_static"].append(mine / best_static)
    a["vs_off"].append(mine / off_score)
    a["sim_s"].append(work_s / mine)
    r = reconvergence_steps(res)
    if r is not None:
        a["reconv"].append(r)
        a["settle"].append(settle_steps(res))


def _summary(a: dict) -> dict:
    """A selector's scores over the seeds (see :func:`evaluate`)."""
    return {
        "vs_oracle": float(np.mean(a["vs_oracle"])),
        "vs_best_static": float(np.mean(a["vs_best_static"])),
        "vs_off": float(np.mean(a["vs_off"])),
        "reconverge_steps": max(a["reconv"]) if a["reconv"] else None,
        "settle_steps": max(a["settle"]) if a["settle"] else None,
        "sim_us_per_step": float(np.mean(a["us"])) * 1e6,
        "sim_s": float(np.mean(a["sim_s"])),
        "choices": a["choices"],
    }
