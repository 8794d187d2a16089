"""The selector's loss budget (tlt_kernels/runtime/loss_budget.py): the ledger's terms, its rule, and the bound it
keeps on synthetic rollouts where drafting loses or pays."""
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tlt_kernels.runtime import CallbackValue, Strategy, StrategySelector
from tlt_kernels.runtime.loss_budget import (FIRST_RESERVE, REFRESH_STEPS, LossBudget, check_loss_budget,
                                             step_progress)

ARMS = [Strategy.parse("s2k1v3"), Strategy.parse("s4k1v5")]
PLAIN_S = 1e-3


def _selector(budget, **kw):
    return StrategySelector(ARMS, seed=0, loss_budget=budget, **kw)


def _first_step(budget: LossBudget, bucket: int = 0) -> None:
    """The rollout's first step, a plain one of 9 s: it carries the gap after the prefill, so it times nothing."""
    budget.observe(0, bucket, 1, 1, 9.0, None, None)
    assert budget.plain_time(bucket) is None


def _rollout(sel, steps, batch, cost_ratio, accept, tied_rows=False):
    """``steps`` steps of a synthetic target: plain steps take PLAIN_S, a drafting step ``cost_ratio`` times that.
    Each depth position of a drafting step is reached by ``accept`` of the batch (a fraction, counted over the whole
    batch); with ``tied_rows``, the batch's rows all tie for the most tokens left and are counted as the lagging rows,
    and every row but one reaches the first two positions. Returns (seconds, plain seconds for the same progress,
    drafting steps)."""
    seconds = plain_seconds = 0.0
    drafting = 0
    for _ in range(steps):
        s = sel.select(batch)
        if s.is_off:
            sel.update(s, batch, batch, PLAIN_S)
            seconds += PLAIN_S
            plain_seconds += PLAIN_S
            continue
        drafting += 1
        counts = ([batch - 1] * 2 + [0] * (s.num_steps - 2)) if tied_rows else [accept * batch] * s.num_steps
        rows = batch if tied_rows else None
        elapsed = cost_ratio * PLAIN_S
        sel.update(s, batch, batch + sum(counts), elapsed, counts, accepted_rows=rows)
        seconds += elapsed
        plain_seconds += step_progress(batch + sum(counts), batch, counts, rows) * PLAIN_S
    return seconds, plain_seconds, drafting


@pytest.mark.parametrize("value", [-0.1, 1.0, 2, float("nan"), "0.01", True])
def test_bad_budget_names_the_argument(value):
    with pytest.raises(ValueError, match="loss_budget"):
        check_loss_budget(value)
    with pytest.raises(ValueError, match="loss_budget"):
        _selector(value)


def test_no_budget_is_none():
    assert check_loss_budget(None) is None
    assert _selector(None).budget is None
    assert check_loss_budget(0) == 0.0


@pytest.mark.parametrize("budget", [0.0, 0.01, 0.03])
@pytest.mark.parametrize("batch", [1, 7, 64])
def test_losing_drafts_cost_at_most_the_budget(budget, batch):
    """Drafts never accepted, drafting steps 1.6x a plain step: the rollout is at most ``budget`` (plus one step's
    worst case) slower than plain decoding, where the selector alone loses more."""
    seconds, plain_seconds, _ = _rollout(_selector(budget), 400, batch, 1.6, 0.0)
    assert seconds <= plain_seconds * (1 + budget) + 0.6 * PLAIN_S
    free_seconds, free_plain, _ = _rollout(_selector(None), 400, batch, 1.6, 0.0)
    assert free_seconds / free_plain > seconds / plain_seconds


def test_paying_drafts_run_after_the_first_steps():
    """Drafts that always pay (2.3 tokens per step at 1.2x the time): after the plain steps that fund the first
    draft, drafting runs most steps and the rollout beats plain decoding."""
    sel = _selector(0.02)
    seconds, plain_seconds, drafting = _rollout(sel, 400, 8, 1.2, 0.9)
    assert drafting >= 300
    assert plain_seconds / seconds > 1.5
    assert sel.budget.loss < 0  # gains banked


def test_zero_budget_drafts_only_on_banked_gains():
    sel = _selector(0.0)
    _, _, drafting = _rollout(sel, 100, 4, 1.5, 0.0)
    assert drafting == 0
    assert sel.budget.vetoed > 0


def test_first_draft_waits_for_its_reserve():
    """Without a cost table an arm never timed reserves FIRST_RESERVE plain steps: at a 2% budget the first draft
    comes after about FIRST_RESERVE / 0.02 plain steps."""
    sel = _selector(0.02)
    first = None
    for step in range(200):
        s = sel.select(1)
        if not s.is_off:
            first = step
            break
        sel.update(s, 1, 1, PLAIN_S)
    assert first is not None and abs(first - FIRST_RESERVE / 0.02) <= 2


def test_cost_table_sets_the_first_reserve():
    """A start-up table that says the arm costs 1.25x plain decoding: the first draft comes after 0.25 / budget
    plain steps."""
    table = {Strategy.off(): [(1, PLAIN_S)], ARMS[0]: [(1, 1.25 * PLAIN_S)], ARMS[1]: [(1, 1.25 * PLAIN_S)]}
    sel = _selector(0.05, cost_table=table)
    steps = 0
    while sel.select(1).is_off:
        sel.update(Strategy.off(), 1, 1, PLAIN_S)
        steps += 1
        assert steps < 100
    assert abs(steps - 0.25 / 0.05) <= 1


def test_reserves_in_flight_hold_the_budget():
    """Observations not yet ready: each launched drafting step holds its reserve until it is folded in."""
    sel = _selector(0.5)
    for _ in range(20):
        sel.update(Strategy.off(), 1, 1, PLAIN_S)  # 20 ms elapsed: room for 10 ms of reserves
    sel.select(1)
    for _ in range(9):  # 9 steps in flight, each reserving one plain step
        sel.update(ARMS[0], 1, 1, CallbackValue(lambda: None))
    assert sel.budget.allows(1, sel.bucket(1), 1)  # 9 ms + 1 ms <= 10 ms
    sel.update(ARMS[0], 1, 1, CallbackValue(lambda: None))
    assert not sel.budget.allows(1, sel.bucket(1), 1)
    assert len(sel.budget.in_flight) == 10


def test_a_garbage_observation_frees_its_reserve():
    sel = _selector(0.5)
    sel.update(Strategy.off(), 1, 1, PLAIN_S)
    with pytest.warns(RuntimeWarning):
        sel.update(ARMS[0], 1, math.nan, PLAIN_S, [0, 0])
    assert not sel.budget.in_flight
    with pytest.raises(ValueError, match="elapsed_s"):
        sel.update(ARMS[0], 1, 1, -1.0, [0, 0])
    assert not sel.budget.in_flight


def test_new_rollout_starts_the_ledger_over_and_keeps_the_arms_step_times():
    sel = _selector(0.02)
    _rollout(sel, 200, 4, 1.6, 0.0)
    assert sel.budget.elapsed > 0 and sel.budget.loss > 0
    bucket = sel.bucket(4)
    drafted = [i for i, s in enumerate(sel.strategies) if s.num_steps and sel.budget.times[bucket][i]]
    assert drafted
    sel.new_rollout(max_tokens=1000)
    assert sel.budget.elapsed == 0 and sel.budget.loss == 0
    assert sel.budget.plain_time(bucket) is None  # plain step times are the rollout's own
    assert all(sel.budget.times[bucket][i] for i in drafted)  # the arms' times stay for their reserves
    assert sel.select(4).is_off  # no draft before the rollout's first plain step is timed
    sel.update(Strategy.off(), 4, 4, 3 * PLAIN_S)  # the first step, with the prefill's gap: no sample
    assert sel.budget.plain_time(bucket) is None and sel.select(4).is_off
    sel.update(Strategy.off(), 4, 4, PLAIN_S)
    assert sel.budget.plain_time(bucket) == pytest.approx(PLAIN_S)


def test_plain_time_is_the_lower_median_of_the_rollouts_plain_steps_after_its_first():
    budget = LossBudget(0.1, [0, 2], num_buckets=1)
    _first_step(budget)
    for seconds in (1.2, 1.0):
        budget.observe(0, 0, 1, 1, seconds, None, None)
    assert budget.plain_time(0) == 1.0  # of two, the lower: the side that over-counts a loss
    budget.observe(0, 0, 1, 1, 1.1, None, None)
    assert budget.plain_time(0) == 1.1


def test_an_earlier_rollouts_slow_plain_steps_credit_no_gains():
    """A warm selector whose plain steps of the rollout before took 1.3 ms, now 1 ms, with drafts that cost 1.05 ms
    and are never accepted: measured against the old plain time every draft would look like a gain and the rollout
    would draft throughout (5% slower than plain decoding); against this rollout's own it loses at most the budget."""
    sel = _selector(0.02)
    sel.new_rollout(max_tokens=400)
    for _ in range(400):
        sel.update(Strategy.off(), 4, 4, 1.3 * PLAIN_S)
    sel.new_rollout(max_tokens=400)
    seconds, plain_seconds, drafting = _rollout(sel, 400, 4, 1.05, 0.0)
    assert drafting > 0
    assert seconds <= plain_seconds / (1 - 0.02) + 0.05 * PLAIN_S  # 2% of the rollout's time, one step's slack


def test_a_speculative_step_faster_than_t0_gains_nothing_it_did_not_accept():
    """A slow first plain step (1.5 s) then a draft of 1.1 s that moved the batch one token: plain decoding took at
    most 1.1 s then, so the draft lost nothing and gained nothing (not 0.4 s); one that moved it two tokens gained
    at most 1.1 s."""
    budget = LossBudget(0.1, [0, 2], num_buckets=1)
    _first_step(budget)
    budget.observe(0, 0, 1, 1, 1.5, None, None)
    budget.observe(1, 0, 1, 1, 1.1, None, None, progress=1)
    assert budget.loss == 0.0
    budget.observe(1, 0, 1, 2, 1.1, None, None, progress=2)
    assert budget.loss == pytest.approx(-1.1)


def test_a_stale_plain_time_is_refreshed_by_a_plain_step():
    """Drafts that always pay run most steps, but never more than REFRESH_STEPS in a row in a bucket: then a plain
    step times the baseline again."""
    sel = _selector(0.02)
    sel.new_rollout(max_tokens=2000)
    run = longest = plain_steps = 0
    for _ in range(1000):
        s = sel.select(8)
        if s.is_off:
            sel.update(s, 8, 8, PLAIN_S)
            run, plain_steps = 0, plain_steps + 1
            continue
        counts = [8] * s.num_steps
        sel.update(s, 8, 8 + sum(counts), 1.2 * PLAIN_S, counts, accepted_rows=8)
        run += 1
        longest = max(longest, run)
    assert longest == REFRESH_STEPS
    assert 1000 // (REFRESH_STEPS + 1) <= plain_steps <= 1000 // REFRESH_STEPS + 2


def test_a_borrowed_plain_time_scales_with_the_cost_tables_plain_steps():
    budget = LossBudget(0.1, [0, 2], num_buckets=6, plain_cost=lambda batch_size: (1 + batch_size) * 1e-3)
    _first_step(budget)
    budget.observe(0, 1, 2, 2, 3.0, None, None)  # bucket 1, batch size 2: 3 s
    assert budget.plain_time(1, batch_size=2) == 3.0  # its own
    assert budget.plain_time(3, batch_size=8) == pytest.approx(3.0 * 9 / 3)
    assert budget.plain_time(3) == 3.0  # no batch size: unscaled


def test_plain_time_of_an_untimed_bucket_is_the_nearest_timed_one():
    budget = LossBudget(0.1, [0, 2], num_buckets=6)
    _first_step(budget, bucket=3)
    for bucket, seconds in ((1, 1.0), (5, 5.0)):
        budget.observe(0, bucket, 1, 1, seconds, None, None)
    assert budget.plain_time(1) == 1.0
    assert budget.plain_time(2) == 1.0
    assert budget.plain_time(3) == 1.0  # a tie: the lower bucket
    assert budget.plain_time(4) == 5.0
    assert budget.plain_time(0) == 1.0


def test_progress_counts_the_lagging_rows():
    """A drafting step's progress is 1 + the counted rows' mean accepted drafts: 2 rows of a batch of 8 that
    accepted 2 drafts each moved the batch 3 plain steps."""
    budget = LossBudget(0.1, [0, 2], num_buckets=1)
    _first_step(budget)
    budget.observe(0, 0, 8, 8, 1.0, None, None)
    budget.observe(1, 0, 8, 30, 2.0, [2, 2], 2)
    assert budget.loss == pytest.approx(2.0 - 3 * 1.0)


def test_decision_hook_sees_the_budgets_choice():
    seen = []
    sel = _selector(0.0, decision_hook=lambda s, b: seen.append(s) or s)
    sel.select(1)
    assert seen == [Strategy.off()]


def test_step_progress_is_the_slowest_lagging_rows_and_the_batchs_mean_without_rows():
    """With the lagging rows counted (``rows`` given) a step moves the batch's end by the fewest tokens any of them
    got; counts over the whole batch give the mean; no counts, the emitted tokens per request."""
    assert step_progress(30, 8, [8, 8, 3], 8) == 3.0  # every lagging row reached depth 2, not all depth 3
    assert step_progress(30, 8, [7, 7, 7], 8) == 1.0  # one lagging row accepted nothing
    assert step_progress(30, 8, [2, 2], 2) == 3.0
    assert step_progress(30, 8, [0, 0], 2) == 1.0
    assert step_progress(30, 8, [8, 4], None) == pytest.approx(1.0 + 12 / 8)
    assert step_progress(20, 8, None, None) == pytest.approx(20 / 8)


@pytest.mark.parametrize("max_tokens", [None, 400])
def test_a_tied_batchs_slowest_row_bounds_the_loss(max_tokens):
    """A tied batch whose drafts the rows' mean says pay (2.75 tokens at 1.5x) but that never move the batch's end
    (one row accepts nothing): the loss stays within the budget (plus one step's worst case), told the rollout's length
    or not."""
    sel = _selector(0.02)
    sel.new_rollout(max_tokens=max_tokens)
    seconds, plain_seconds, drafting = _rollout(sel, 400, 8, 1.5, None, tied_rows=True)
    assert seconds <= plain_seconds * 1.02 + 0.5 * PLAIN_S
    assert drafting >= 1  # the budget let it try


def test_told_its_length_a_rollout_may_draft_after_its_first_plain_step():
    """The allowance is the fraction of the rollout's projected time (elapsed + plain steps to go): told 128 tokens,
    a 2% budget covers a 1.25x arm's reserve right after the first timed plain step (the second: the first carries
    the prefill's gap); not told, only after 0.25 / 0.02 plain steps."""
    table = {Strategy.off(): [(1, PLAIN_S)], ARMS[0]: [(1, 1.25 * PLAIN_S)], ARMS[1]: [(1, 1.25 * PLAIN_S)]}
    first = {}
    for told in (128, None):
        sel = _selector(0.02, cost_table=table)
        sel.new_rollout(max_tokens=told)
        steps = 0
        while sel.select(1).is_off:
            sel.update(Strategy.off(), 1, 1, PLAIN_S)
            steps += 1
            assert steps < 100
        first[told] = steps
    assert first[128] == 2
    assert abs(first[None] - 0.25 / 0.02) <= 1


@pytest.mark.parametrize("value", [-1, 2.5, "128", True])
def test_new_rollout_names_a_bad_max_tokens(value):
    with pytest.raises(ValueError, match="max_tokens"):
        _selector(0.02).new_rollout(max_tokens=value)


def test_remaining_counts_down_by_the_progress():
    budget = LossBudget(0.02, [0, 2], num_buckets=1)
    budget.new_rollout(max_tokens=11)
    _first_step(budget)  # plain: one
    budget.observe(0, 0, 4, 4, 1.0, None, None)  # plain: one
    budget.observe(1, 0, 4, 12, 1.5, [4, 4], 4)  # every lagging row reached depth 2: three
    assert budget.remaining == 6
    budget.observe(1, 0, 4, 12, 1.5, [4, 4], 4)
    budget.observe(1, 0, 4, 12, 1.5, [4, 4], 4)
    assert budget.remaining == 0  # never below zero


def test_a_measured_progress_replaces_the_estimate():
    """The engine measures how far a step moved the batch's end (``batch_progress``): a lagging row that accepted
    everything, with a row one token behind it that accepted nothing, moved the end by two, not three."""
    budget = LossBudget(0.1, [0, 2], num_buckets=1)
    budget.new_rollout(max_tokens=20)
    _first_step(budget)
    budget.observe(0, 0, 4, 4, 1.0, None, None)
    budget.observe(1, 0, 4, 6, 2.0, [1, 1], 1, progress=2)
    assert budget.loss == pytest.approx(2.0 - 2 * 1.0)
    assert budget.remaining == 20 - 2 - 2
    sel = _selector(0.1)
    sel.update(Strategy.off(), 4, 4, 5 * PLAIN_S)  # the first step: no sample
    sel.update(Strategy.off(), 4, 4, PLAIN_S)
    sel.update(ARMS[0], 4, 6, 2 * PLAIN_S, [1, 1], accepted_rows=1, batch_progress=1)
    assert sel.budget.loss == pytest.approx(PLAIN_S)


@pytest.mark.parametrize("value", [-1, 1.5, "2", True])
def test_a_bad_batch_progress_names_the_argument(value):
    with pytest.raises(ValueError, match="batch_progress"):
        _selector(0.02).update(ARMS[0], 4, 6, PLAIN_S, [1, 1], accepted_rows=1, batch_progress=value)


@settings(max_examples=60, deadline=None)
@given(plain_ms=st.floats(0.5, 2.0), ratio=st.floats(1.02, 2.0), gap_ms=st.sampled_from([0.0, 0.3, 1.0]),
       batch=st.sampled_from([1, 4, 16, 64]), tokens=st.sampled_from([64, 128, 300]),
       budget=st.sampled_from([0.01, 0.02, 0.05]), accept=st.sampled_from([0.0, 0.05, 0.2]), warm=st.booleans(),
       seed=st.integers(0, 2**16))
def test_the_bound_holds_whatever_the_step_costs_and_the_first_steps_gap(plain_ms, ratio, gap_ms, batch, tokens,
                                                                         budget, accept, warm, seed):
    """Exact step times (a plain step ``plain_ms``, a draft ``ratio`` times it, the rollout's first step ``gap_ms``
    more), drafts that every lagging row accepts at each depth with probability ``accept`` (at most 0.2: rarely worth
    a draft's cost), measured progress: a rollout told its length takes at most ``1 / (1 - budget)`` of plain
    decoding's time (the budget is a fraction of the rollout's own time), plus one draft's worst case."""
    plain_s, gap_s = plain_ms * 1e-3, gap_ms * 1e-3
    rnd = random.Random(seed)
    table = {s: [(1, plain_s * (1 if s.is_off else ratio))] for s in [Strategy.off(), *ARMS]}
    sel = _selector(budget, cost_table=table)

    def rollout() -> float:
        sel.new_rollout(max_tokens=tokens)
        seconds, left, extra_s = 0.0, tokens, gap_s
        while left > 0:
            s = sel.select(batch)
            reach = 0
            while reach < s.num_steps and rnd.random() < accept:
                reach += 1
            step_s, extra_s = plain_s * (1 if s.is_off else ratio) + extra_s, 0.0
            progress = min(1 + reach, left)
            counts = [batch if j < reach else 0 for j in range(s.num_steps)]
            sel.update(s, batch, batch * (1 + reach), step_s, counts or None, accepted_rows=batch if counts else None,
                       batch_progress=progress if s.num_steps else None)
            seconds, left = seconds + step_s, left - progress
        return seconds

    if warm:
        rollout()
    plain_seconds = tokens * plain_s + gap_s
    assert rollout() <= plain_seconds / (1 - budget) + (ratio - 1) * plain_s + 1e-12
