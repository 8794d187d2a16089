"""The selector's acceptance forecast (tlt_kernels/runtime/forecast.py): its terms, its rule, the selector's use of
it, and what it wins back on the simulated static batches without giving up the loss budget's bound."""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tlt_kernels.runtime import Strategy, StrategySelector
from tlt_kernels.runtime.forecast import AcceptanceForecast
from tlt_kernels.runtime.static_batch import (StaticBatch, lagging_feedback, run_static_batch, selector_observer,
                                              static_batches)

DEPTHS = [0, 2, 4]  # plain decoding, s2k1v3-like, s4k1v5-like


def _forecast(**kw) -> AcceptanceForecast:
    forecast = AcceptanceForecast(**kw)
    forecast.bind(DEPTHS)
    return forecast


def test_a_request_forecast_is_its_rate_shrunk_toward_the_pool_less_the_bound():
    forecast = _forecast(shrink=2.0, confidence=-0.5)
    forecast.observe(1, [0, 1], [2, 0])
    forecast.observe(1, [0, 1], [2, 1])
    pooled = 5 / 4
    own = np.array([4.0, 1.0])
    expected = (own + 2.0 * pooled) / (2 + 2.0) - 0.5 / math.sqrt(3)
    assert forecast.tokens_per_step(1) == pytest.approx(1 + expected.min())
    assert forecast.tokens_per_step(2) is None  # no running request drafted with it


def test_the_batch_waits_for_its_slowest_running_request_until_it_leaves():
    forecast = _forecast(confidence=0.0)
    for _ in range(20):
        forecast.observe(1, [3, 7], [2, 0])
    slow = forecast.tokens_per_step(1)
    forecast.observe(0, [3], None)  # request 7 finished at a plain step
    fast = forecast.tokens_per_step(1)
    assert slow < 1.3 and fast == pytest.approx(3.0)  # the pool is the running requests' alone


def test_rows_beyond_the_first_allocation_grow_the_statistics():
    forecast = _forecast(confidence=0.0)
    forecast.observe(2, [100, 5000], [4, 4])
    assert forecast.tokens_per_step(2) == pytest.approx(5.0)
    forecast.new_rollout()
    assert forecast.tokens_per_step(2) is None


@pytest.mark.parametrize("tokens, arm_s, overrides", [(2.0, 1.5, True), (2.0, 1.95, False), (2.0, None, False)])
def test_an_arm_overrides_plain_decoding_only_beyond_the_margin(tokens, arm_s, overrides):
    forecast = _forecast(confidence=0.0, margin=0.05)
    for _ in range(8):
        forecast.observe(1, [0, 1], [1, 1])
    assert forecast.tokens_per_step(1) == pytest.approx(tokens)
    seconds = {0: 1.0, 1: arm_s, 2: 1.0}
    chosen = forecast.choose([0, 1, 2], seconds.get, plain=0)
    assert chosen == (1 if overrides else None) and forecast.overrides == int(overrides)
    assert forecast.choose([0, 2], seconds.get, plain=0) is None  # arm 1 unavailable; arm 2 never drafted


def test_a_single_running_request_is_left_to_the_ledger():
    """With one request running, the loss budget's progress is that request's own acceptance, exactly: a forecast
    from its few steps adds noise, not evidence, so it overrides nothing."""
    forecast = _forecast(confidence=0.0)
    for _ in range(8):
        forecast.observe(2, [5], [4])
    assert forecast.tokens_per_step(2) == pytest.approx(5.0)
    assert forecast.choose([0, 1, 2], lambda arm: 1.0, plain=0) is None


@pytest.mark.parametrize("kwargs, name", [({"shrink": 0}, "shrink"), ({"shrink": -1.0}, "shrink"),
                                          ({"confidence": math.nan}, "confidence"), ({"margin": -0.1}, "margin"),
                                          ({"margin": True}, "margin")])
def test_bad_settings_raise_naming_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        AcceptanceForecast(**kwargs)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 4), min_size=3, max_size=3), st.booleans()), min_size=1,
                max_size=30))
def test_with_no_bound_the_forecast_lies_between_the_running_requests_rates(steps):
    """With ``confidence = 0`` each request's forecast is a weighted mean of its own rate and the pool's, so the
    batch's forecast lies between the lowest request's rate and the pool's, within ``[1, 1 + depth]``."""
    forecast = _forecast(confidence=0.0, shrink=3.0)
    accepted_sum, drafted = np.zeros(3), np.zeros(3)
    for accepted, draft in steps:
        if draft:
            forecast.observe(2, [0, 1, 2], accepted)
            accepted_sum += accepted
            drafted += 1
        else:
            forecast.observe(0, [0, 1, 2], None)
    value = forecast.tokens_per_step(2)
    if not drafted.any():
        assert value is None
        return
    own, pooled = accepted_sum / drafted, accepted_sum.sum() / drafted.sum()
    assert 1 + own.min() - 1e-9 <= value <= 1 + pooled + 1e-9 and 1 <= value <= 5


def test_the_selector_checks_the_rows_acceptance():
    sel = StrategySelector([Strategy(2, 1, 3)], seed=0, forecast=AcceptanceForecast())
    with pytest.raises(ValueError, match="rows_accepted"):
        sel.update(Strategy(2, 1, 3), 2, 3, 1e-3, [1, 0], running_rows=[0, 1], rows_accepted=[1])
    with pytest.raises(ValueError, match="rows_accepted"):
        sel.update(Strategy(2, 1, 3), 2, 3, 1e-3, [1, 0], running_rows=[0, 1], rows_accepted=[1, 3])
    with pytest.raises(ValueError, match="rows_accepted"):
        sel.update(Strategy(2, 1, 3), 3, 3, 1e-3, [1, 0], running_rows=[0, 1, 2], rows_accepted=[1, math.nan, 0])
    fresh = StrategySelector([Strategy(2, 1, 3)], seed=0, forecast=AcceptanceForecast())
    with pytest.raises(ValueError, match="running_rows"):
        fresh.update(Strategy(2, 1, 3), 2, 3, 1e-3, [1, 0], running_rows=[-1, 1], rows_accepted=[1, 1])
    with pytest.raises(TypeError, match="forecast"):
        StrategySelector([Strategy(2, 1, 3)], forecast=0.05)


def test_the_selector_overrides_a_vetoed_draft_where_every_request_accepts():
    """The budget vetoes drafts once its allowance is spent; where every running request keeps accepting, the
    forecast's arm runs instead, and a new rollout forgets the requests."""
    arm = Strategy(2, 1, 3)
    table = {Strategy.off(): [(1, 1e-3), (64, 1e-3)], arm: [(1, 1.2e-3), (64, 1.2e-3)]}
    sel = StrategySelector([arm], seed=0, cost_table=table, loss_budget=0.0, forecast=AcceptanceForecast())
    sel.new_rollout(max_tokens=100)
    assert sel.select(4) == Strategy.off()  # no plain step timed yet: the budget allows no draft
    sel.update(Strategy.off(), 4, 4, 1e-3, running_rows=[0, 1, 2, 3])
    for _ in range(4):  # drafts the budget never allowed, told as if the policy had run them
        sel.update(arm, 4, 12, 1.2e-3, [4, 4], accepted_rows=4, batch_progress=3, running_rows=[0, 1, 2, 3],
                   rows_accepted=[2, 2, 2, 2])
    assert sel.select(4) == arm and sel.forecast.overrides == 1
    sel.new_rollout(max_tokens=100)
    assert sel.select(4) == Strategy.off()


def _ratio(batch: StaticBatch, forecast: bool, seeds=range(4)) -> float:
    """Plain decoding's wall time over the 2%-budgeted cost policy's (with the forecast or not), summed over seeds."""
    arms = (Strategy.off(), Strategy.parse("s2k1v3"), Strategy.parse("s5k4v16"))
    table = {a: [(n, batch.cost(a, n)) for n in (1, len(batch.alphas))] for a in arms}
    total, plain = 0.0, 0.0
    for seed in seeds:
        sel = StrategySelector(arms, seed=seed, cost_table=table, loss_budget=0.02,
                               forecast=AcceptanceForecast() if forecast else None)
        sel.new_rollout(max_tokens=batch.budget)
        total += run_static_batch(batch, sel.select, selector_observer(sel), lagging_feedback, seed)
        plain += run_static_batch(batch, lambda b: Strategy.off(), seed=seed)
    return plain / total


def test_the_forecast_wins_back_a_uniform_batch_and_keeps_the_bound_where_plain_decoding_is_best():
    """A uniform batch's drafts start from a tie, which spends the budget before drafting pays; the requests' own
    acceptance tells the tie from a request that never catches up, so the forecast wins part of it back. Where no
    arm pays (requests that differ), it overrides nothing the budget would regret."""
    eagle_like, _, uniform = static_batches(batch_sizes=(32,), budget=128)
    assert _ratio(uniform, forecast=True) > 1.05 * _ratio(uniform, forecast=False)
    assert _ratio(eagle_like, forecast=True) > 0.97


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([1, 3, 8]), st.integers(0, 2), st.booleans()), min_size=1, max_size=40),
       st.sampled_from([None, 0.02]))
def test_a_forecast_decides_alike_on_equal_streams_and_is_inert_without_rows(stream, budget):
    """Two selectors with forecasts fed the same per-row observations make the same choices (no hidden state but
    the stream); one never given rows chooses exactly as a selector without a forecast."""
    arms = [Strategy(2, 1, 3), Strategy(4, 1, 5)]
    table = {Strategy.off(): [(1, 1e-3), (8, 1.2e-3)], arms[0]: [(1, 1.2e-3), (8, 1.5e-3)],
             arms[1]: [(1, 1.4e-3), (8, 1.9e-3)]}

    def run(forecast: bool, rows: bool):
        sel = StrategySelector(arms, seed=3, cost_table=table, loss_budget=budget,
                               forecast=AcceptanceForecast() if forecast else None)
        sel.new_rollout(max_tokens=64)
        picks = []
        for batch, accepted, slow in stream:
            s = sel.select(batch)
            picks.append(s)
            per_row = [min(accepted, s.num_steps)] * batch
            if slow and s.num_steps:
                per_row[0] = 0
            kwargs = {"running_rows": list(range(batch)), "rows_accepted": per_row if s.num_steps else None}
            sel.update(s, batch, batch + sum(per_row), 1e-3 * (1 + s.num_steps / 4),
                       [sum(1 for a in per_row if a > d) for d in range(s.num_steps)] or None,
                       **(kwargs if rows else {}))
        return picks

    assert run(True, True) == run(True, True)
    assert run(True, False) == run(False, False)
