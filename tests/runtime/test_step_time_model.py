"""The cost policy's step-time model alone: the start-up table corrected online per (bucket, arm)."""
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tlt_kernels.runtime import CostTable, Strategy
from tlt_kernels.runtime.policies import StepTimeModel
from tlt_kernels.runtime.policies.step_time_model import BORROWED, TINY_RATIO

OFF, CHAIN = Strategy.off(), Strategy(3, 1, 4)
GAMMA = 1.0 - 1.0 / 32


def test_rates_come_from_the_table_and_are_cached():
    model = StepTimeModel([OFF, CHAIN], CostTable({OFF: [(1, 0.01), (8, 0.02)]}), num_buckets=2, gamma=GAMMA)
    rates = model.table_rates(8)
    assert rates == [8 / 0.02, 0.0]  # no table entry: 0
    assert model.table_rates(8) is rates
    assert model.table_seconds(4) == pytest.approx([0.01 + 0.01 * 3 / 7, 0.0])


def test_the_first_observation_replaces_the_prior_then_a_discounted_mean():
    model = StepTimeModel([OFF, CHAIN], CostTable({OFF: [(1, 0.01)], CHAIN: [(1, 0.02)]}), 2, GAMMA, borrow=False)
    model.observe(bucket=1, arm=1, batch_size=1, elapsed=0.03)
    assert model.ratio[1][1] == pytest.approx(1.5) and model.count[1][1] == 1.0
    model.observe(1, 1, 1, 0.02)
    assert model.ratio[1][1] == pytest.approx(1.5 + (1.0 - 1.5) / (GAMMA + 1.0))
    assert model.count[1][1] == pytest.approx(GAMMA + 1.0)
    assert model.count[0] == [0.0, 0.0]  # buckets are separate


def test_without_a_table_the_ratio_holds_seconds():
    model = StepTimeModel([OFF, CHAIN], None, 1, GAMMA)
    assert model.table_rates(16) == [0.0, 0.0]
    model.observe(0, 0, 16, 0.25)
    assert model.ratio[0][0] == 0.25


def test_legal_extremes_stay_finite_and_nonzero():
    model = StepTimeModel([OFF], CostTable({OFF: [(1, 1.0)]}), 1, GAMMA)
    model.observe(0, 0, 1, 5e-324)
    assert model.ratio[0][0] == TINY_RATIO
    model.observe(0, 0, 1, 1e300)
    assert math.isfinite(model.ratio[0][0]) and model.ratio[0][0] > 0


def _four_buckets(borrow=True):
    return StepTimeModel([OFF, CHAIN], CostTable({OFF: [(1, 0.01)], CHAIN: [(1, 0.02)]}), 4, GAMMA, borrow=borrow)


def test_an_unobserved_bucket_borrows_the_ratio_of_the_nearest_observed_one():
    model = _four_buckets()
    model.observe(bucket=3, arm=1, batch_size=1, elapsed=0.03)  # ratio 1.5
    assert [model.ratio[k][1] for k in range(4)] == pytest.approx([1.5] * 4)
    assert [model.count[k][1] for k in range(4)] == [BORROWED] * 3 + [1.0]
    assert [model.lender[k][1] for k in range(4)] == [3, 3, 3, None]
    assert [model.count[k][0] for k in range(4)] == [0.0] * 4  # another arm's buckets are untouched
    model.observe(0, 1, 1, 0.01)  # ratio 0.5 in bucket 0: bucket 1 is nearer to it, bucket 2 to bucket 3
    assert [model.lender[k][1] for k in range(4)] == [None, 0, 3, None]
    assert [model.ratio[k][1] for k in range(4)] == pytest.approx([0.5, 0.5, 1.5, 1.5])


def test_a_tie_borrows_from_the_lower_bucket_and_a_lenders_updates_reach_its_borrowers():
    model = _four_buckets()
    model.observe(0, 1, 1, 0.01)
    model.observe(2, 1, 1, 0.03)
    assert [model.lender[k][1] for k in range(4)] == [None, 0, None, 2]  # bucket 1: 0 and 2 are as near
    model.observe(2, 1, 1, 0.02)
    updated = 1.5 + (1.0 - 1.5) / (GAMMA + 1.0)
    assert model.ratio[2][1] == pytest.approx(updated) and model.ratio[3][1] == pytest.approx(updated)
    assert model.ratio[1][1] == pytest.approx(0.5)


def test_the_first_own_observation_replaces_a_borrowed_ratio():
    model = _four_buckets()
    model.observe(3, 1, 1, 0.03)
    model.observe(1, 1, 1, 0.02)  # bucket 1 had borrowed 1.5: its own first step replaces it, as it replaces the prior
    assert model.ratio[1][1] == pytest.approx(1.0) and model.count[1][1] == 1.0 and model.lender[1][1] is None
    assert [model.lender[k][1] for k in range(4)] == [1, None, 1, None]


def test_without_borrowing_or_a_table_entry_an_unobserved_bucket_keeps_the_prior():
    model = _four_buckets(borrow=False)
    model.observe(3, 1, 1, 0.03)
    assert [model.count[k][1] for k in range(3)] == [0.0] * 3
    untabled = StepTimeModel([OFF, CHAIN], CostTable({OFF: [(1, 0.01)]}), 4, GAMMA)
    untabled.observe(3, 1, 1, 0.03)  # seconds, not a ratio: nothing another batch size could use
    assert [untabled.count[k][1] for k in range(3)] == [0.0] * 3 and untabled.ratio[3][1] == 0.03


@given(st.lists(st.tuples(st.integers(0, 5), st.floats(1e-4, 1.0)), min_size=1, max_size=40))
def test_borrowing_leaves_own_ratios_alone_and_gives_each_other_bucket_its_nearest_observed_ratio(steps):
    """Any sequence of (bucket, seconds) observations of one arm: the observed buckets' ratios are the discounted means
    of the model without borrowing, and every other bucket holds the ratio of its nearest observed bucket (the lower
    one on a tie)."""
    table = CostTable({OFF: [(1, 0.01)], CHAIN: [(1, 0.02)]})
    lending, alone = (StepTimeModel([OFF, CHAIN], table, 6, GAMMA, borrow=b) for b in (True, False))
    for bucket, seconds in steps:
        lending.observe(bucket, 1, 1, seconds)
        alone.observe(bucket, 1, 1, seconds)
    observed = sorted({bucket for bucket, _ in steps})
    for k in range(6):
        if k in observed:
            assert lending.lender[k][1] is None and lending.count[k][1] == pytest.approx(alone.count[k][1])
            assert lending.ratio[k][1] == pytest.approx(alone.ratio[k][1])
        else:
            source = min(observed, key=lambda j: (abs(j - k), j))
            assert lending.lender[k][1] == source and lending.count[k][1] == BORROWED
            assert lending.ratio[k][1] == pytest.approx(alone.ratio[source][1])
        assert lending.count[k][0] == 0.0  # the other arm was never observed: nothing to lend


def test_seconds_is_the_table_time_corrected_by_the_ratio_else_the_observed_time():
    """``seconds``: the table's time where unobserved, times the bucket's ratio once observed; an arm without a table
    entry has its observed seconds, or None before any."""
    model = StepTimeModel([OFF, CHAIN], CostTable({OFF: [(1, 0.01)]}), 1, GAMMA)
    assert model.seconds(0, 0, 1) == pytest.approx(0.01) and model.seconds(0, 1, 1) is None
    model.observe(0, 0, 1, 0.02)
    model.observe(0, 1, 1, 0.05)
    assert model.seconds(0, 0, 1) == pytest.approx(0.02) and model.seconds(0, 1, 1) == pytest.approx(0.05)


def test_the_cost_policy_prices_a_forecast_at_the_table_time_while_it_has_one():
    """What the forecast's override compares: the start-up table's step times (the observed ones also carry a
    rollout's first step), the observed time only for an arm the table lacks."""
    from tlt_kernels.runtime.policies import CostModelPolicy
    import random

    policy = CostModelPolicy(cost_table={OFF: [(1, 0.01)]})
    policy.bind([OFF, CHAIN], 1, random.Random(0), 32)
    policy.step_time.observe(0, 0, 1, 0.03)  # a first step with the host's preparation in it
    assert policy.step_seconds(0, 0, 1) == pytest.approx(0.01)
    assert policy.step_seconds(0, 1, 1) is None
    policy.step_time.observe(0, 1, 1, 0.02)
    assert policy.step_seconds(0, 1, 1) == pytest.approx(0.02)
