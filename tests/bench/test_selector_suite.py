"""The selector suite: its replay of the recorded real-model traces (bench/traces/h200_smollm2*) and its simulated
static batches."""
import os
import statistics

import pytest

from bench.suites import selector


class _Rows:
    def __init__(self):
        self.rows, self.notes = [], []

    def add(self, case, impl, ms, **extra):
        self.rows.append((case["workload"], impl, ms, extra))

    def note(self, text):
        self.notes.append(text)


@pytest.fixture(scope="module")
def real_rows():
    ctx = _Rows()
    selector._real_model_traces(ctx)
    return ctx


# Draws of the probes' timing noise a real trace's bounds are judged over: one replay is one draw, and on a row near a
# bound the draw decides (a selector row's highest and lowest of eight draws of 2% noise are ~5% apart at the median;
# docs/RUNTIME.md).
NOISE_DRAWS = 8
SCORES = ("vs_off", "vs_best_static", "vs_off_per_step", "vs_best_static_per_step")
# Scored where a trace counts the lagging rows (every set but the first, h200_smollm2).
LAGGING_SCORES = ("vs_off_lagging", "vs_best_static_lagging")


@pytest.fixture(scope="module")
def noisy_rows():
    """The real-trace rows with each score the mean over :data:`NOISE_DRAWS` draws of timing noise
    (``selector.jittered``)."""
    from tlt_kernels.runtime.simulate import load_trace

    ctx = _Rows()
    for name, _ in selector.REAL_TRACES:
        directory = os.path.join(selector.TRACES_DIR, name)
        for path in selector.real_trace_paths(name):
            table = selector.trace_cost_table(directory, os.path.basename(path).split("-")[0])
            records = load_trace(path)
            draws = []
            for seed in range(NOISE_DRAWS):
                jittered = selector.jittered(records, seed)
                draws.append(selector.real_trace_scores(jittered, table))
                if os.path.basename(path).startswith("ngram-"):
                    draws[-1].update(selector.counterfactual_rows(jittered, table))
            case = {"workload": f"real trace {name}/{os.path.basename(path)[:-5]}"}
            for impl in draws[0]:
                keys = SCORES + (LAGGING_SCORES if "vs_off_lagging" in draws[0][impl] else ())
                ctx.add(case, impl, None, **{k: statistics.mean(d[impl][k] for d in draws) for k in keys})
    return ctx


def test_every_recorded_real_trace_gives_static_and_selector_rows(real_rows):
    traces = sorted(f"{name}/{n[:-5]}" for name, _ in selector.REAL_TRACES
                    for n in os.listdir(os.path.join(selector.TRACES_DIR, name)) if "-B" in n)
    assert len(traces) == 25
    cases = sorted({w for w, *_ in real_rows.rows})
    assert [c.split(" ")[2] for c in cases] == traces
    for case in cases:
        rows = {impl: (ms, extra) for w, impl, ms, extra in real_rows.rows if w == case}
        arms = {"off", "s2k1v3", "s4k1v5", "s5k4v16"} | ({"s4k2v8"} if "h200_smollm2_drafted/" in case else set())
        selectors = {"cost, cold", "cost, warm"}
        if "/ngram-" in case:
            selectors |= {"counterfactual, cold", "counterfactual, warm"}
        assert set(rows) == {f"static {arm}" for arm in arms} | selectors
        assert rows["static off"][1]["vs_off"] == 1.0
        assert max(extra["vs_best_static"] for impl, (ms, extra) in rows.items() if impl.startswith("static")) == 1.0
        assert rows["static off"][1]["vs_off_per_step"] == 1.0
        assert max(extra["vs_best_static_per_step"] for impl, (ms, extra) in rows.items()
                   if impl.startswith("static")) == 1.0
        lagging = "h200_smollm2/" not in case  # the first set counts the whole batch only
        assert all(("vs_off_lagging" in extra) == lagging for ms, extra in rows.values()), case
        if lagging:
            assert rows["static off"][1]["vs_off_lagging"] == 1.0
            assert max(extra["vs_best_static_lagging"] for impl, (ms, extra) in rows.items()
                       if impl.startswith("static")) == 1.0
        for ms, extra in rows.values():  # ms is the same work at each row's rate: inverse to vs_off
            assert ms * extra["vs_off"] == pytest.approx(rows["static off"][0], rel=1e-3)
    assert [n.split(":")[1].strip() for n in real_rows.notes] == [f"bench/traces/{name}" for name, _ in
                                                                  selector.REAL_TRACES]


# Traces where the default selector is known to stay below 0.85 of the best static arm (and the reason): a target
# not met, kept visible by the strict xfail below rather than by a lower floor for every trace.
KNOWN_SHORT = {
    "h200_smollm2_lagging/ngram-uniform-B1": "one request whose n-gram acceptance is ~0 for 60 steps, then comes in "
                                             "bursts: the selector spends the dry stretch speculating (its optimistic "
                                             "prior decays slowly) and the bursts on plain decoding, which observes "
                                             "no acceptance (0.83 of s5k4v16, 0.99x plain decoding)",
}


# Trace sets where the default selector is known to lose more than 2% against plain decoding (and the reason): the
# 2% bound is a target not met there, kept visible by the strict xfail below.
KNOWN_BELOW_PLAIN = {
    "h200_smollm2_weak_eagle": "a drafter no arm of which beats plain decoding in the engine: at B = 1 the cold "
                               "selector, drafting until its prior decays, replays 2.6% below plain decoding step by "
                               "step (3.6% on the recorded times); by the lagging rows' progress B = 4 is 4.3-4.8% "
                               "below and the tail 1.6-3.3%: the first plays' drafts (1.3-1.7x a plain step) move "
                               "the rows the batch waits for too little, though by every row's tokens they pay",
    "h200_smollm2_sampled": "n-gram drafts at temperature 1, where a draft is accepted with the target's probability "
                            "of it (every arm 0.81-1.07x plain decoding in the engine): at B = 4 the selector replays "
                            "2.3-2.5% below plain decoding cold and warm (by the lagging rows' progress 2.7-3.2%, and "
                            "3.0-3.1% at B = 16), speculating in 40% of its steps on drafts that return less than "
                            "they cost",
}


def _trace_set(workload: str) -> str:
    """The directory under bench/traces of a real-trace row's workload ("real trace SET/NAME (N steps)")."""
    return workload.split(" ")[2].split("/")[0]


def _below_plain(workload: str) -> bool:
    return _trace_set(workload) in KNOWN_BELOW_PLAIN


def _selector_rows(real_rows, known_short: bool):
    rows = [(w, impl, extra) for w, impl, _, extra in real_rows.rows if impl.startswith("cost")]
    return [r for r in rows if (r[0].split(" ")[2] in KNOWN_SHORT) == known_short]


def test_the_default_selector_on_the_real_traces(noisy_rows):
    """Cold and warm, over the draws of timing noise, never below plain decoding by more than 2%, and never below
    0.85 of the best static arm: a warm selector that settled on plain decoding in the warm-up rollout and never
    probed sat there through the whole timed rollout of eagle-uniform-B1 (0.74 of the best static arm)."""
    real_rows = noisy_rows
    assert {w.split(" ")[2] for w, _, _ in _selector_rows(real_rows, known_short=True)} == set(KNOWN_SHORT)
    for workload, impl, extra in _selector_rows(real_rows, known_short=False) + _selector_rows(real_rows, True):
        if _below_plain(workload):
            continue
        assert extra["vs_off"] >= 0.98, (workload, impl, extra)
        assert extra["vs_off_per_step"] >= 0.98, (workload, impl, extra)
        assert extra.get("vs_off_lagging", 1.0) >= 0.98, (workload, impl, extra)
    for workload, impl, extra in _selector_rows(real_rows, known_short=False):
        assert extra["vs_best_static"] >= 0.85, (workload, impl, extra)


@pytest.mark.xfail(strict=True, reason="; ".join(f"{k}: {v}" for k, v in KNOWN_SHORT.items()))
def test_the_default_selector_on_the_known_short_traces(noisy_rows):
    rows = _selector_rows(noisy_rows, known_short=True)
    for workload, impl, extra in rows:
        assert extra["vs_best_static"] >= 0.85, (workload, impl, extra)


@pytest.mark.xfail(strict=True, reason="; ".join(f"{k}: {v}" for k, v in KNOWN_BELOW_PLAIN.items()))
def test_the_default_selector_on_the_traces_known_below_plain(noisy_rows):
    rows = [r for r in _selector_rows(noisy_rows, known_short=False) if _below_plain(r[0])]
    assert {_trace_set(w) for w, _, _ in rows} == set(KNOWN_BELOW_PLAIN)
    for workload, impl, extra in rows:  # their 0.85-of-the-best floor is asserted with every other trace's above
        assert min(extra["vs_off"], extra["vs_off_per_step"], extra["vs_off_lagging"]) >= 0.98, (workload, impl, extra)


# Traces where the counterfactual policy is known to stay below 0.97 of the best static arm by the lagging rows'
# progress, over the draws of timing noise (and the reason): req 5's 3% bound, not met there.
COUNTERFACTUAL_SHORT = {
    "h200_smollm2_lagging/ngram-uniform-B1": "cold, 0.962 of s5k4v16: the lone request's drafts are accepted ~never "
                                             "for 60 steps, then in bursts; the mean over the rollout so far turns "
                                             "to drafting well after the bursts start",
    "h200_smollm2_lagging/ngram-uniform-B4": "warm 0.936, cold 0.966: the warm-up rollout's mean picks s5k4v16, "
                                             "which drafts through the timed rollout's 30-step dry stretch",
    "h200_smollm2_sampled/ngram-uniform-B1": "cold, 0.958 (warm 0.970): at temperature 1 every arm is within 16% "
                                             "of plain decoding, and the mean needs steps to rank them",
}


def _counterfactual_rows(rows):
    return [(w, impl, extra) for w, impl, _, extra in rows.rows if impl.startswith("counterfactual")]


def test_the_counterfactual_policy_on_the_n_gram_traces(noisy_rows):
    """Cold and warm, over the draws of timing noise, never more than 2% below plain decoding by any score, and by the
    lagging rows' progress within 3% of the best static arm outside :data:`COUNTERFACTUAL_SHORT`."""
    rows = _counterfactual_rows(noisy_rows)
    assert len(rows) == 2 * 17  # cold and warm on every n-gram trace
    for workload, impl, extra in rows:
        assert min(extra["vs_off"], extra["vs_off_per_step"], extra.get("vs_off_lagging", 1.0)) >= 0.98, \
            (workload, impl, extra)
        if workload.split(" ")[2] not in COUNTERFACTUAL_SHORT:
            assert extra.get("vs_best_static_lagging", 1.0) >= 0.97, (workload, impl, extra)


@pytest.mark.xfail(strict=True, reason="; ".join(f"{k}: {v}" for k, v in COUNTERFACTUAL_SHORT.items()))
def test_the_counterfactual_policy_on_the_traces_known_short(noisy_rows):
    rows = [r for r in _counterfactual_rows(noisy_rows) if r[0].split(" ")[2] in COUNTERFACTUAL_SHORT]
    assert {w.split(" ")[2] for w, _, _ in rows} == set(COUNTERFACTUAL_SHORT)
    for workload, impl, extra in rows:
        assert extra["vs_best_static_lagging"] >= 0.97, (workload, impl, extra)


def test_trace_rate_is_tokens_over_seconds_of_the_picks():
    records = [{"arms": {"off": {"emitted": 2, "step_time": 0.5}, "s2k1v3": {"emitted": 4, "step_time": 1.0}}}] * 2
    assert selector._trace_rate(records, ["off", "s2k1v3"]) == pytest.approx(6 / 1.5)


def test_per_step_score_weighs_each_step_by_its_own_time():
    """A two-step tail: a wide first step where s5k4v16 is the better arm, then one request where plain decoding is.
    Per step, an arm is scored by the time to emit each step's best arm's tokens at its own rate at that step."""
    from tlt_kernels.runtime import Strategy

    trace = [
        {"batch_size": 64, "arms": {"off": {"emitted": 64, "step_time": 0.002},
                                    "s5k4v16": {"emitted": 160, "step_time": 0.004}}},
        {"batch_size": 1, "arms": {"off": {"emitted": 1, "step_time": 0.001},
                                   "s5k4v16": {"emitted": 1, "step_time": 0.0011}}},
    ]
    spec, plain = (selector.replay_static(trace, Strategy.parse(a)) for a in ("s5k4v16", "off"))
    assert selector._same_work_s(spec) == pytest.approx(0.004 + 0.0011)  # the best per step: s5k4v16, then off
    assert selector._same_work_s(plain) == pytest.approx(160 * 0.002 / 64 + 0.001)
    assert selector._trace_rate(trace, spec.picks) == pytest.approx(161 / 0.0051)


def test_static_batch_rows_cover_every_batch_with_statics_rules_and_a_warm_selector():
    """One seed: per simulated batch, the static arms (the best at vs_best_static 1), the three feedback rules, the
    warm selector, the loss-budgeted selector, the budgeted one with the forecast and the counterfactual policy, cold
    and warm; the wall-time ratios agree with the rows' ms; the warm-up batch is another of the same kind."""
    ctx = _Rows()
    selector._static_batches(ctx, (0,))
    timed, warm_up = selector._static_batch_family(0), selector._static_batch_family(1)
    assert [b.name for b in timed] == [b.name for b in warm_up]
    assert any(list(a.alphas) != list(b.alphas) for a, b in zip(timed, warm_up))
    by_workload = {}
    for workload, impl, ms, extra in ctx.rows:
        by_workload.setdefault(workload, {})[impl] = (ms, extra)
    assert list(by_workload) == [b.name for b in timed]
    for rows in by_workload.values():
        assert sorted(rows) == sorted([f"static {a}" for a in selector.STATIC_BATCH_ARMS] + [
            "cost, batch feedback", "cost, lagging (the engine's) feedback", "cost, critical feedback",
            "cost, lagging feedback, warm", selector.BUDGET_ROW, f"{selector.BUDGET_ROW}, warm", selector.FORECAST_ROW,
            f"{selector.FORECAST_ROW}, warm", selector.COUNTERFACTUAL_ROW, f"{selector.COUNTERFACTUAL_ROW}, warm"])
        assert max(e["vs_best_static"] for i, (_, e) in rows.items() if i.startswith("static")) == 1.0
        for ms, extra in rows.values():
            assert ms * extra["vs_off"] == pytest.approx(rows["static off"][0], rel=1e-3)
    assert "a seed fixes the batch's text" in ctx.notes[0]


def test_forecast_cost_rows_time_the_per_row_updates_against_the_policy_alone():
    """The host-cost rows: the cost policy, with the 2% budget, and with the forecast on top, each given every row's
    acceptance (valid per-row arguments: the forecast checks them) over batch sizes that change every step."""
    ctx = _Rows()
    selector._forecast_cost_rows(ctx)
    impls = [impl for _, impl, _, _ in ctx.rows]
    assert impls == ["cost", "cost, 2% loss budget", "cost, 2% loss budget, forecast"]
    assert all(ms > 0 for _, _, ms, _ in ctx.rows)
    assert {workload for workload, _, _, _ in ctx.rows} == {"cpu: select+update, per-row acceptance"}


def test_lagging_rate_is_the_lagging_rows_mean_tokens_over_seconds():
    """A step's progress is what its lagging rows gained on average: at B = 4 with two lagging rows, one accepting two
    drafts and one none, s2k1v3 moves them by 1 + (1 + 1) / 2 = 2 tokens however many the other rows accepted."""
    step = {"batch_size": 4, "arms": {
        "off": {"emitted": 4, "step_time": 0.001, "accepted": [], "lagging_rows": 2, "lagging_accepted": []},
        "s2k1v3": {"emitted": 10, "step_time": 0.002, "accepted": [3, 3], "lagging_rows": 2,
                   "lagging_accepted": [1, 1]}}}
    assert selector._lagging_rate([step, step], ["off", "s2k1v3"]) == pytest.approx((1 + 2) / 0.003)
    assert selector._trace_rate([step, step], ["off", "s2k1v3"]) == pytest.approx((4 + 10) / 0.003)
    bare = {"batch_size": 4, "arms": {"off": {"emitted": 4, "step_time": 0.001}}}  # a trace of the first set
    assert selector._lagging_rate([step, bare], ["s2k1v3", "off"]) is None


def test_counterfactual_cost_rows_time_the_policy_with_every_arm_handed_over():
    ctx = _Rows()
    selector._counterfactual_cost_rows(ctx)
    assert [impl for _, impl, _, _ in ctx.rows] == ["cost", "counterfactual"]
    assert all(ms > 0 for _, _, ms, _ in ctx.rows)
    assert {workload for workload, _, _, _ in ctx.rows} == {"cpu: select+update, every arm's counterfactual"}
