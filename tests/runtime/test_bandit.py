"""The model-free bandits alone, driven through the Policy interface (bind / choose / observe)."""
import random

import pytest

from tlt_kernels.runtime import BucketedEpsilonGreedy, DiscountedThompson, SlidingWindowUCB, Strategy
from tlt_kernels.runtime.policies import MAX_REWARD

ARMS = [Strategy.off(), Strategy(1, 1, 2), Strategy(3, 1, 4)]


def _bound(policy, window=4, seed=0):
    policy.bind(ARMS, num_buckets=2, rng=random.Random(seed), window=window)
    return policy


@pytest.mark.parametrize("make", [BucketedEpsilonGreedy, SlidingWindowUCB, DiscountedThompson])
def test_every_arm_is_tried_once_then_the_best_reward_wins(make):
    pol = _bound(make() if make is not BucketedEpsilonGreedy else make(epsilon=0.0), window=32)
    seen = []
    for step in range(1, 4):
        a = pol.choose(0, 8, [0, 1, 2], step)
        seen.append(a)
        pol.observe(0, a, 8, emitted=8.0 * (1 + a), elapsed=0.01, accepted=None, step=step)
    assert seen == [0, 1, 2]
    picks = []
    for step in range(4, 40):
        a = pol.choose(0, 8, [0, 1, 2], step)
        pol.observe(0, a, 8, emitted=8.0 * (1 + a), elapsed=0.01, accepted=None, step=step)
        picks.append(a)
    assert picks.count(2) >= 0.8 * len(picks)
    assert pol.choose(1, 8, [1, 2], 40) == 1  # buckets keep separate statistics: bucket 1 starts over


def test_epsilon_greedy_keeps_the_window_median_and_respects_groups():
    pol = _bound(BucketedEpsilonGreedy(epsilon=0.0, groups={4: [ARMS[1]], 64: [ARMS[2]]}), window=3)
    for step, elapsed in enumerate([0.01, 0.02, 0.04, 0.08], 1):
        pol.observe(0, 1, 2, emitted=2.0, elapsed=elapsed, accepted=None, step=step)
    assert list(pol.recent_rewards[0][1]) == [100.0, 50.0, 25.0] and pol.median_reward[0][1] == 50.0
    assert pol.plays[0][1] == 4
    assert pol.choose(0, 2, [0, 1, 2], 5) in (0, 1)  # batch 2 -> the group of key 4: plain decoding and s1k1v2
    with pytest.raises(ValueError, match="epsilon"):
        BucketedEpsilonGreedy(epsilon=1.5)
    with pytest.raises(ValueError, match="not in the selector"):
        _bound(BucketedEpsilonGreedy(groups={4: [Strategy(5, 1, 6)]}))


def test_ucb_counts_only_the_window_and_thompson_discounts():
    ucb = _bound(SlidingWindowUCB(), window=2)
    for step in range(1, 4):
        ucb.observe(0, 1, 4, emitted=4.0, elapsed=0.01 * step, accepted=None, step=step)
    assert ucb.window_plays[0][1] == 2 and ucb.bucket_plays[0] == 3
    assert ucb.window_reward_sum[0][1] == pytest.approx(400.0 / 2 + 400.0 / 3)
    ts = _bound(DiscountedThompson(), window=4)
    ts.observe(0, 1, 4, emitted=4.0, elapsed=0.01, accepted=None, step=1)
    ts.observe(0, 2, 4, emitted=4.0, elapsed=0.01, accepted=None, step=2)
    ts.observe(0, 1, 4, emitted=4.0, elapsed=1e-300, accepted=None, step=3)  # capped reward: stays finite
    assert ts.weight[0][1] == pytest.approx(0.75 ** 2 + 1.0)
    assert ts.reward_sum[0][1] == pytest.approx(400.0 * 0.75 ** 2 + MAX_REWARD)
