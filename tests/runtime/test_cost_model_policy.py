"""The cost-model policy as a composition: its parts, the choice rule, its options (kept and removed)."""
import random

import pytest

from tlt_kernels.runtime import CostModelPolicy, Strategy
from tlt_kernels.runtime.policies import (
    CusumChangeDetector,
    NoChangeDetector,
    SharedAcceptanceModel,
    StepTimeModel,
    make_policy,
)

OFF, SHORT, DEEP = Strategy.off(), Strategy(2, 1, 3), Strategy(4, 1, 5)
ARMS = [OFF, SHORT, DEEP]


def _bound(**kw):
    pol = CostModelPolicy(**kw)
    pol.bind(ARMS, num_buckets=2, rng=random.Random(0), window=32)
    return pol


def test_the_policy_is_made_of_its_three_models():
    pol = _bound(cost_table={s: [(1, 0.01)] for s in ARMS})
    assert isinstance(pol.acceptance, SharedAcceptanceModel)
    assert isinstance(pol.step_time, StepTimeModel)
    assert isinstance(pol.detector, CusumChangeDetector)
    assert pol.tokens is pol.acceptance.tokens and pol.changes is pol.detector.changes
    assert isinstance(_bound(detect=None).detector, NoChangeDetector)


def test_an_arm_without_a_table_entry_is_timed_first():
    pol = _bound(cost_table={OFF: [(1, 0.01)], SHORT: [(1, 0.01)]})
    assert pol.predict(0, 2, 4) is None
    assert pol.choose(0, 4, [0, 1, 2], step=1) == 2
    pol.observe(0, 2, 4, emitted=8.0, elapsed=0.02, accepted=[3.0, 2.0, 1.0, 0.0], step=1)
    assert pol.predict(0, 2, 4) == pytest.approx(4 * pol.tokens[2] / 0.02)


def test_the_best_predicted_first_play_then_the_best_prediction():
    pol = _bound(cost_table={s: [(8, 0.01)] for s in ARMS})
    assert pol.choose(0, 8, [0, 1, 2], step=1) == 2  # the deeper chain predicts more tokens at equal cost
    pol.observe(0, 2, 8, emitted=20.0, elapsed=0.01, accepted=[6.0, 4.0, 2.0, 0.0], step=1)
    assert pol.played == [False, False, True] and pol.deepest_played == 4
    # SHORT's group and depths are measured: not forced, and no near-tie (fewer tokens, same cost).
    assert pol.choose(0, 8, [0, 1, 2], step=2) == 2


def test_accepted_counts_of_the_wrong_length_are_refused():
    pol = _bound()
    with pytest.raises(ValueError, match="accepted_per_position"):
        pol.observe(0, 1, 4, emitted=6.0, elapsed=0.01, accepted=[1.0], step=1)


def test_observed_tokens_are_used_without_accepted_counts():
    pol = _bound(cost_table={s: [(1, 0.01)] for s in ARMS})
    pol.observe(0, 1, 4, emitted=10.0, elapsed=0.01, accepted=None, step=1)
    assert pol.tokens[1] == 2.5


def test_a_bucket_where_an_arm_has_not_run_predicts_with_the_nearest_buckets_correction():
    table = {s: [(1, 0.01), (8, 0.01)] for s in ARMS}
    pol = _bound(cost_table=table)
    pol.observe(1, 2, 8, emitted=8.0, elapsed=0.015, accepted=[0.0, 0.0, 0.0, 0.0], step=1)  # 1.5x the table's
    assert pol.predict(0, 2, 1) == pytest.approx(pol.tokens[2] / 0.015)
    alone = _bound(cost_table=table, borrow_step_times=False)
    alone.observe(1, 2, 8, emitted=8.0, elapsed=0.015, accepted=[0.0, 0.0, 0.0, 0.0], step=1)
    assert alone.predict(0, 2, 1) == pytest.approx(alone.tokens[2] / 0.01)
    for bad in (None, 1, "yes"):
        with pytest.raises(ValueError, match="borrow_step_times"):
            CostModelPolicy(borrow_step_times=bad)


@pytest.mark.parametrize("option, value", [
    ("prior_accept", 1.0), ("model_sd", 0.0), ("detect", 0.0), ("min_trials", -1.0), ("min_support", -1.0),
    ("keep_on_change", 2.0), ("offset_prior", 0.0), ("offset_mean", float("nan")), ("explore_margin", 1.5),
    ("min_gain", -0.01), ("min_gain", 1.5),
])
def test_kept_options_are_validated(option, value):
    with pytest.raises(ValueError, match=option):
        CostModelPolicy(**{option: value})
    with pytest.raises(ValueError, match="offset_prior"):
        CostModelPolicy(ucb=-1.0)


@pytest.mark.parametrize("option", ["explore", "detect_shift", "slow", "follow", "drift", "level_in_weight",
                                    "refresh_tol"])
def test_removed_options_are_refused(option):
    """Options measured no better than the defaults (docs/RUNTIME.md) were removed; the defaults are constants."""
    with pytest.raises(TypeError, match=option):
        make_policy("cost", **{option: 0.0})


def _settle_on_plain(pol, steps: int) -> int:
    """Speculation that accepts nothing until plain decoding is chosen; then ``steps`` plain steps. Returns the step."""
    step = 1
    while True:
        arm = pol.choose(0, 4, [0, 1, 2], step=step)
        if arm == 0:
            break
        pol.observe(0, arm, 4, emitted=4.0, elapsed=0.012, accepted=[0.0] * ARMS[arm].num_steps, step=step)
        step += 1
        assert step < 200, "never settled on plain decoding"
    for _ in range(steps):
        assert pol.choose(0, 4, [0, 1, 2], step=step) == 0
        pol.observe(0, 0, 4, emitted=4.0, elapsed=0.01, accepted=[], step=step)
        step += 1
    return step


def test_plain_decoding_is_probed_after_probe_every_steps_and_a_risen_acceptance_is_taken():
    pol = _bound(cost_table={OFF: [(4, 0.01)], SHORT: [(4, 0.012)], DEEP: [(4, 0.014)]}, probe_every=8)
    step = _settle_on_plain(pol, 8)
    probe = pol.choose(0, 4, [0, 1, 2], step=step)
    assert probe in (1, 2)  # the best-predicted speculative arm, once
    assert pol.choose(0, 4, [0], step=step) == 0  # nothing speculative allowed: plain decoding
    for _ in range(20):  # the acceptance rose: every draft token accepted from now on
        arm = pol.choose(0, 4, [0, 1, 2], step=step)
        depth = ARMS[arm].num_steps
        pol.observe(0, arm, 4, emitted=4.0 * (depth + 1), elapsed=0.012, accepted=[4.0] * depth, step=step)
        step += 1
    assert pol.choose(0, 4, [0, 1, 2], step=step) != 0


def test_without_probes_plain_decoding_stays():
    pol = _bound(cost_table={OFF: [(4, 0.01)], SHORT: [(4, 0.012)], DEEP: [(4, 0.014)]}, probe_every=None)
    _settle_on_plain(pol, 100)  # asserts plain decoding at every step
    pol = _bound(cost_table={OFF: [(4, 0.01)], SHORT: [(4, 0.012)], DEEP: [(4, 0.014)]}, probe_every=8)
    step = _settle_on_plain(pol, 7)
    assert pol.choose(0, 4, [0, 1, 2], step=step) == 0  # 7 plain steps in a row: no probe yet
    assert pol.plain_run == [7, 0]


@pytest.mark.parametrize("value", [0, -1, 2.5, True])
def test_probe_every_is_validated(value):
    with pytest.raises(ValueError, match="probe_every"):
        CostModelPolicy(probe_every=value)


def test_a_drafter_that_accepts_nothing_for_thousands_of_steps_neither_breaks_the_model_nor_sinks_it():
    """Thousands of steps without an accepted draft drove the level so low that a position's predicted acceptance
    rounded to 0 over a position never reached (0 / 0: ZeroDivisionError mid-rollout, seen on the H200 with a
    random target). The model predicts in a bounded range and the level stays where acceptance can bring it back."""
    from tlt_kernels.runtime import StrategySelector
    from tlt_kernels.runtime.policies.acceptance_model import LEVEL_MIN

    sel = StrategySelector([OFF, SHORT, DEEP], seed=0)
    for _ in range(6000):  # 4,612 steps raised before the bounds
        arm = sel.select(8)
        sel.update(arm, 8, 8 * arm.num_steps, 1e-3, [0] * arm.num_steps if arm.num_steps else None)
    model = sel.policy.acceptance
    assert model.level == LEVEL_MIN
    assert all(1.0 <= t < 1.01 for t in model.tokens if t is not None)  # nothing accepted: no draft token expected
    plain_steps = 0
    for _ in range(300):  # every draft accepted from now on: speculation returns within a few probes
        arm = sel.select(8)
        plain_steps += arm.num_steps == 0
        sel.update(arm, 8, 8 * (arm.num_steps + 1), 1e-3, [8] * arm.num_steps if arm.num_steps else None)
    assert sel.select(8).num_steps > 0 and plain_steps < 150


def _played_short(min_gain: float, accepted: float):
    """A policy that played DEEP once (nothing accepted) and SHORT once at ``accepted`` of 4 rows per position
    (equal step costs)."""
    pol = _bound(cost_table={s: [(4, 0.01)] for s in ARMS}, min_gain=min_gain, probe_every=8)
    pol.observe(0, 2, 4, emitted=4.0, elapsed=0.01, accepted=[0.0] * 4, step=1)  # DEEP: nothing accepted
    pol.observe(0, 1, 4, emitted=4.0 + 2 * accepted, elapsed=0.01, accepted=[accepted] * 2, step=2)
    return pol


def test_min_gain_keeps_plain_decoding_unless_speculation_predicts_more_than_the_margin():
    """A played arm predicting a few % over plain decoding wins without the margin, loses within it, wins past it;
    the probes still play it after probe_every plain steps."""
    without, within = _played_short(0.0, 0.3), _played_short(0.5, 0.3)
    gains = [without.predict(0, a, 4) / without.predict(0, 0, 4) for a in (1, 2)]
    assert all(1.0 < g < 1.5 for g in gains), gains
    assert without.choose(0, 4, [0, 1, 2], step=3) != 0
    assert within.choose(0, 4, [0, 1, 2], step=3) == 0
    high = _played_short(0.5, 4.0)  # every row accepts every draft
    assert high.predict(0, 1, 4) > 1.5 * high.predict(0, 0, 4) and high.choose(0, 4, [0, 1, 2], step=3) != 0
    for step in range(3, 11):  # 8 plain steps in a row, then a probe of the best-predicted speculative arm
        assert within.choose(0, 4, [0, 1, 2], step=step) == 0
        within.observe(0, 0, 4, emitted=4.0, elapsed=0.01, accepted=[], step=step)
    assert within.choose(0, 4, [0, 1, 2], step=11) in (1, 2)


# DEEP's step costs three times the others': after _prefer_short the model chooses SHORT.
RIDE_TABLE = {OFF: [(8, 0.01)], SHORT: [(8, 0.01)], DEEP: [(8, 0.03)]}


def _prefer_short(pol):
    """Both chains played once, SHORT's acceptance high, so the model's choice is SHORT (DEEP costs 3x)."""
    pol.observe(0, 2, 8, emitted=10.0, elapsed=0.03, accepted=[2.0, 0.0, 0.0, 0.0], step=1)
    pol.observe(0, 1, 8, emitted=22.0, elapsed=0.01, accepted=[7.0, 7.0], step=2)
    assert pol.choose(0, 8, [0, 1, 2], step=3) == 1


def test_a_step_that_accepted_every_draft_is_followed_by_the_same_arm():
    """ride_runs: every counted request reached the arm's depth, so the arm plays again whatever the model predicts;
    a step short of that returns the choice to the model."""
    pol = _bound(cost_table={s: [(8, 0.01)] for s in ARMS})
    _prefer_short(pol)
    pol.observe(0, 2, 8, emitted=40.0, elapsed=0.03, accepted=[8.0, 8.0, 8.0, 8.0], step=3)
    assert pol.riding == 2 and pol.choose(0, 8, [0, 1, 2], step=4) == 2
    assert pol.choose(0, 8, [0, 1], step=4) == 1  # not allowed at this size: the model's choice
    pol.observe(0, 2, 8, emitted=30.0, elapsed=0.03, accepted=[8.0, 8.0, 8.0, 7.0], step=4)
    assert pol.riding == -1 and pol.choose(0, 8, [0, 1, 2], step=5) == 1


def test_a_run_counts_the_rows_the_feedback_names_and_can_be_turned_off():
    """Every lagging row (``accepted_rows``) accepting every draft is a run, though the rest of the batch did not;
    with ``ride_runs=False`` no step is."""
    for ride in (True, False):
        pol = _bound(cost_table=RIDE_TABLE, ride_runs=ride)
        _prefer_short(pol)
        pol.observe(0, 2, 8, emitted=20.0, elapsed=0.03, accepted=[3.0, 3.0, 3.0, 3.0], step=3, accepted_rows=3)
        assert pol.choose(0, 8, [0, 1, 2], step=4) == (2 if ride else 1)
    pol = _bound(cost_table={s: [(8, 0.01)] for s in ARMS})
    pol.observe(0, 1, 8, emitted=24.0, elapsed=0.01, accepted=None, step=1)  # tokens only: no counts, no run
    assert pol.riding == -1


def test_observe_acceptance_moves_the_acceptance_as_observe_does_and_nothing_else():
    """observe_acceptance is observe's acceptance half: the same counts give the same predicted tokens (and mark the
    arm played), while the step times, the plain-step run that triggers probes and the run riding stay as they were."""
    table = {s: [(4, 0.01)] for s in ARMS}
    stepped, scored = _bound(cost_table=table), _bound(cost_table=table)
    for pol in (stepped, scored):
        for step in (1, 2, 3):
            pol.observe(0, 0, 4, emitted=4.0, elapsed=0.01, accepted=None, step=step)
    counts = [4.0, 4.0, 4.0, 4.0]  # every draft accepted: observe would ride the arm
    stepped.observe(0, 2, 4, emitted=20.0, elapsed=0.03, accepted=counts, step=4)
    scored.observe_acceptance(2, 4, counts, step=4)
    assert scored.tokens == pytest.approx(stepped.tokens) and scored.tokens[2] > 1.5
    assert scored.played[2] and scored.deepest_played == 4
    assert scored.step_time.count[0][2] == 0 and stepped.step_time.count[0][2] == 1
    assert scored.plain_run[0] == 3 and stepped.plain_run[0] == 0
    assert scored.riding == -1 and stepped.riding == 2
    with pytest.raises(ValueError, match="accepted_per_position"):
        scored.observe_acceptance(1, 4, [1.0], step=5)
    with pytest.raises(ValueError, match="speculative arm"):
        scored.observe_acceptance(0, 4, [], step=5)
