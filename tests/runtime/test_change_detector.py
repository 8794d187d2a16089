"""The cost policy's change detector alone: a bank of Bernoulli CUSUMs with the min_trials/min_support skip."""
import pytest

from tlt_kernels.runtime.policies import CusumChangeDetector, NoChangeDetector

GAMMA = 1.0 - 1.0 / 32


def _detector(**kw):
    return CusumChangeDetector(8.0, gamma=GAMMA, **kw)


def test_a_stationary_stream_never_alarms():
    det = _detector()
    for step in range(1, 2001):
        assert not det.observe(step, own_steps=5.0, trials=100.0, hits=70.0, expected=70.0)
    assert det.changes == [] and det.sums == [0.0] * 4


def test_a_bias_below_half_the_smallest_shift_never_alarms():
    det = _detector(shifts=(0.1,))
    for step in range(1, 2001):  # accepted at 0.74 against a prediction of 0.70: below 0.1 / 2
        det.observe(step, own_steps=5.0, trials=100.0, hits=74.0, expected=70.0)
    assert det.changes == []


@pytest.mark.parametrize("hits", [30.0, 95.0])
def test_a_large_shift_alarms_at_once_and_restarts_the_sums(hits):
    det = _detector()
    for step in range(1, 11):
        det.observe(step, own_steps=5.0, trials=100.0, hits=70.0, expected=70.0)
    assert det.observe(11, own_steps=5.0, trials=100.0, hits=hits, expected=70.0)
    assert det.changes == [11] and det.sums == [0.0] * 4 and det.support == 0.0


def test_the_larger_shift_of_the_bank_alarms_sooner_on_few_trials():
    """A batch-1 step tries a few draft tokens: a 0.1-tuned sum alone needs many steps after a 0.45 -> 0.9 jump."""
    steps_to_alarm = {}
    for shifts in ((0.1,), (0.1, 0.3)):
        det = _detector(shifts=shifts)
        step = 0
        while not det.changes and step < 200:
            step += 1
            det.observe(step, own_steps=5.0, trials=4.0, hits=3.6, expected=1.8)
        steps_to_alarm[shifts] = step
    assert steps_to_alarm[(0.1, 0.3)] < steps_to_alarm[(0.1,)]


def test_a_barely_played_arm_is_skipped_once_the_level_rests_on_enough_steps():
    det = _detector(min_trials=1.0, min_support=8.0)
    # Support below min_support: every play is tested, a first play (own_steps 0) included.
    assert det.observe(1, own_steps=0.0, trials=100.0, hits=10.0, expected=90.0)
    for step in range(2, 22):
        det.observe(step, own_steps=5.0, trials=100.0, hits=70.0, expected=70.0)
    assert det.support >= 8.0
    assert not det.observe(22, own_steps=0.5, trials=100.0, hits=10.0, expected=90.0)  # skipped: misfit
    assert det.sums == [0.0] * 4  # the skipped step added no evidence
    assert det.observe(23, own_steps=1.0, trials=100.0, hits=10.0, expected=90.0)  # tested again
    always = _detector(min_trials=0.0)
    for step in range(1, 21):
        always.observe(step, own_steps=5.0, trials=100.0, hits=70.0, expected=70.0)
    assert always.observe(21, own_steps=0.0, trials=100.0, hits=10.0, expected=90.0)


def test_no_trials_adds_support_but_no_evidence():
    det = _detector()
    assert not det.observe(3, own_steps=5.0, trials=0.0, hits=0.0, expected=0.0)
    assert det.support == 1.0 and det.sums == [0.0] * 4


def test_disabled_detection_and_validation():
    none = NoChangeDetector()
    assert not none.observe(1, 0.0, 100.0, 0.0, 100.0) and none.changes == []
    with pytest.raises(ValueError, match="detect"):
        CusumChangeDetector(0.0)
    with pytest.raises(ValueError, match="shifts"):
        CusumChangeDetector(8.0, shifts=(0.1, 1.5))
    with pytest.raises(ValueError, match="shifts"):
        CusumChangeDetector(8.0, shifts=())
