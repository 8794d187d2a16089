"""The cost policy's step-time model alone: the start-up table corrected online per (bucket, arm)."""
import math

import pytest

from tlt_kernels.runtime import CostTable, Strategy
from tlt_kernels.runtime.policies import StepTimeModel
from tlt_kernels.runtime.policies.step_time_model import TINY_RATIO

OFF, CHAIN = Strategy.off(), Strategy(3, 1, 4)
GAMMA = 1.0 - 1.0 / 32


def test_rates_come_from_the_table_and_are_cached():
    model = StepTimeModel([OFF, CHAIN], CostTable({OFF: [(1, 0.01), (8, 0.02)]}), num_buckets=2, gamma=GAMMA)
    rates = model.table_rates(8)
    assert rates == [8 / 0.02, 0.0]  # no table entry: 0
    assert model.table_rates(8) is rates
    assert model.table_seconds(4) == pytest.approx([0.01 + 0.01 * 3 / 7, 0.0])


def test_the_first_observation_replaces_the_prior_then_a_discounted_mean():
    model = StepTimeModel([OFF, CHAIN], CostTable({OFF: [(1, 0.01)], CHAIN: [(1, 0.02)]}), 2, GAMMA)
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
