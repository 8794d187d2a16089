"""Workload simulator: model sanity, oracle, trace record/replay, and the selector against the oracle."""
import json

import numpy as np
import pytest

from tlt_kernels.runtime import Strategy, StrategySelector
from tlt_kernels.runtime.simulate import (
    DEFAULT_ARMS,
    StepCost,
    Workload,
    evaluate,
    expected_tokens,
    load_trace,
    reconvergence_steps,
    record_trace,
    replay_selector,
    run_oracle,
    run_static,
    standard_workloads,
)


def test_acceptance_and_cost_models():
    s = Strategy(5, 1, 6)
    assert expected_tokens(Strategy.off(), 0.9) == 1.0
    assert 1.0 < expected_tokens(s, 0.5) < expected_tokens(s, 0.9) <= 6.0
    assert expected_tokens(Strategy(5, 4, 16), 0.7) > expected_tokens(s, 0.7)  # a tree beats a chain
    cost = StepCost()
    # Small batches: verifying more tokens is nearly free, so a deep tree wins; large: plain decoding.
    deep = Strategy(8, 8, 32)
    assert expected_tokens(deep, 0.8) / cost(deep, 1) > 3 / cost(Strategy.off(), 1)
    assert expected_tokens(deep, 0.8) / cost(deep, 256) < 1 / cost(Strategy.off(), 256)


def test_oracle_beats_every_static_arm_on_phase_shifts():
    wl = [w for w in standard_workloads(small=True) if w.name == "phase-shift-mixed"][0]
    orc = run_oracle(wl, DEFAULT_ARMS)
    assert orc.oracle_fraction == pytest.approx(1.0)
    for a in DEFAULT_ARMS:
        assert run_static(wl, a, DEFAULT_ARMS).oracle_fraction < 0.97
    assert orc.phase_changes == [150, 300, 450]


def test_long_tail_batch_shrinks_to_zero():
    wl = [w for w in standard_workloads(small=True) if w.name.startswith("long-tail")][0]
    res = run_static(wl, Strategy.off(), DEFAULT_ARMS)
    nreq, med, sig, cap = wl.long_tail
    assert res.steps <= cap and res.tokens > nreq


def test_reconvergence_metric():
    from tlt_kernels.runtime.simulate import RunResult

    eff = [1.0] * 100 + [0.5] * 30 + [1.0] * 70
    res = RunResult(0, 1, 200, eff, [1.0] * 200, [100], {})
    # The window starting 28 steps after the change holds 2 bad steps of 20: mean 0.95.
    assert reconvergence_steps(res, level=0.95, span=20) == 28


def test_trace_record_json_replay(tmp_path):
    wl = Workload("t", alpha=lambda t: 0.8 if t < 60 else 0.4, phase=lambda t: int(t >= 60), steps=120,
                  batch_size=lambda t: 4 if t % 2 else 128)
    arms = [Strategy.off(), Strategy(3, 1, 4), Strategy(6, 4, 16)]
    recs = record_trace(wl, arms, seed=0)
    for r in recs[::7]:
        r["arms"].pop("s6k4v16")  # not captured at this step: must not be chosen
    p = tmp_path / "trace.json"
    p.write_text(json.dumps(recs))
    back = load_trace(str(p))
    sel = StrategySelector(arms[1:], policy="thompson", seed=0)
    res = replay_selector(back, sel)
    assert res.steps == 120 and res.phase_changes == [60]
    assert 0.5 < res.oracle_fraction <= 1.0
    assert len(res.picks) == 120 and all(p in r["arms"] for p, r in zip(res.picks, back))
    assert {k: res.picks.count(k) for k in set(res.picks)} == res.choices
    with pytest.raises(ValueError, match="non-empty"):
        bad = tmp_path / "bad.json"
        bad.write_text("[]")
        load_trace(str(bad))


def _mk(policy):
    def f(arms, table, seed):
        kw = {"cost_table": table} if policy == "cost" else {}
        return StrategySelector(arms, policy=policy, seed=seed, **kw)
    return f


@pytest.mark.parametrize("name", ["phase-shift-mixed", "phase-shift-B256", "long-tail-256"])
def test_default_selector_against_oracle(name):
    wl = [w for w in standard_workloads(small=True) if w.name == name][0]
    r = evaluate(wl, _mk("cost"))
    # Small CPU-sized runs (600 steps): looser than the benchmark's targets, but a regression detector.
    assert r["vs_oracle"] >= 0.93, r
    assert r["vs_off"] >= 0.98, r
    if name == "phase-shift-mixed":
        assert r["vs_best_static"] >= 1.1, r
        assert r["reconverge_steps"] <= 50, r


@pytest.mark.parametrize("policy", ["beg", "ucb", "thompson"])
def test_other_policies_run_and_beat_plain_decoding(policy):
    wl = [w for w in standard_workloads(small=True) if w.name == "phase-shift-B8"][0]
    r = evaluate(wl, _mk(policy))
    assert r["vs_off"] > 1.5 and 0 < r["vs_oracle"] <= 1.0 + 1e-9, r
    assert np.isfinite(r["sim_us_per_step"])


def test_settle_metric():
    from tlt_kernels.runtime.simulate import RunResult, settle_steps

    eff = [1.0] * 100 + [0.5] * 30 + [1.0] * 5 + [0.9] + [1.0] * 64
    res = RunResult(0, 1, 200, eff, [1.0] * 200, [100], {})
    # The streak of 5 good steps is broken by the 0.9 step; the next 10-step streak starts at 136.
    assert settle_steps(res, tol=0.01, run=10) == 36
    never = RunResult(0, 1, 200, [1.0] * 100 + [0.95] * 100, [1.0] * 200, [100], {})
    assert settle_steps(never) == 100  # a 5%-worse arm never settles: the phase's length


@pytest.mark.parametrize("name", ["phase-shift-B64", "phase-shift-B128", "phase-shift-mixed",
                                  "drafter-warmup-B16", "target-drift-B48", "long-tail-256"])
def test_selector_targets_on_short_runs(name):
    """The adaptive selector's targets (vs_oracle, vs_off, re-convergence) where a 600-step, one-seed CPU run can
    show them (batch 1-32 need the 2400-step benchmark: start-up exploration weighs too much in 600 steps)."""
    wl = [w for w in standard_workloads(small=True) if w.name == name][0]
    # The benchmark's targets are means over seeds; one 600-step seed of the long tail swings +-3% (0.95-1.02
    # over seeds 0-7), so that workload is averaged over four seeds here.
    r = evaluate(wl, _mk("cost"), seeds=(0, 1, 2, 3) if name == "long-tail-256" else (0,))
    assert r["vs_oracle"] >= 0.97, r
    assert r["vs_off"] >= 0.98, r
    if r["reconverge_steps"] is None:  # no phase changes
        return
    assert r["reconverge_steps"] <= 50, r
    if name == "phase-shift-mixed":
        assert r["vs_best_static"] >= 1.10, r
    else:
        # Strict settle (10 choices within 1% of the oracle): at batch 128 the best arms are within 1-3%
        # of each other and the model-weighted estimates (model_sd) take longer to separate near-ties
        # than the arms' own counts did (109 steps on this run; 118 worst on the 3-seed benchmark).
        assert r["settle_steps"] <= (120 if name == "phase-shift-B128" else 50), r


def test_a_replay_feeds_the_lagging_rows_acceptance_where_the_trace_counts_it():
    """As the engine feeds its selector: an engine trace's lagging rows (most tokens left) and their acceptance,
    with ``accepted_rows=``; a record without them gives the whole batch's counts."""
    from tlt_kernels.runtime.simulate import replay_trace

    arm = {"step_time": 1e-3, "emitted": 10, "accepted": [4, 2]}
    records = [{"batch_size": 6, "arms": {"s2k1v3": dict(arm, lagging_rows=2, lagging_accepted=[2, 1])}},
               {"batch_size": 6, "arms": {"s2k1v3": dict(arm)}}]
    seen = []
    replay_trace(records, lambda b, arms: arms[0], lambda *a, **kw: seen.append((a[4], kw)))
    assert seen == [([2, 1], {"accepted_rows": 2}), ([4, 2], {})]
    bad = [{"batch_size": 6, "arms": {"s2k1v3": dict(arm, lagging_rows=float("nan"))}}]
    with pytest.raises(ValueError, match="lagging_rows"):
        replay_trace(bad, lambda b, arms: arms[0])
