"""Model-free bandit policies: epsilon-greedy over windowed medians, sliding-window UCB, discounted Thompson.

* :class:`BucketedEpsilonGreedy` (``"beg"``) -- TLT's tuner: a bucket maps to a verify-width group of arms;
  epsilon-greedy over sliding-window medians of throughput.
* :class:`SlidingWindowUCB` (``"ucb"``) -- UCB over the last ``window`` plays of the bucket.
* :class:`DiscountedThompson` (``"thompson"``) -- Gaussian Thompson sampling with discounted statistics.
"""
from __future__ import annotations

import bisect
import math
from collections import deque
from typing import Dict, List, Optional, Sequence

from ..strategy import Strategy
from .base import Policy, first_unseen, throughput_reward


class BucketedEpsilonGreedy(Policy):
    """TLT's adaptive tuner: per bucket, epsilon-greedy over sliding-window medians of throughput.

    Args:
        epsilon: exploration probability.
        groups: optional ``{max_batch_size: [strategies]}``: a bucket whose sizes are <= the smallest
            key >= them may only use that verify-width group (TLT's batch-size -> draft-token table).
            Plain decoding is always in every group. ``None``: every arm in every bucket.

    Attributes (per ``[bucket][arm]``): ``recent_rewards`` (the last ``window`` rewards), ``median_reward``,
    ``plays``.
    """

    name = "beg"

    def __init__(self, epsilon: float = 0.1, groups: Optional[Dict[int, Sequence[Strategy]]] = None):
        if not 0.0 <= epsilon <= 1.0:
            raise ValueError(f"epsilon must be in [0, 1], got {epsilon}")
        self.epsilon = epsilon
        self.groups = groups

    def bind(self, arms, num_buckets, rng, window):
        super().bind(arms, num_buckets, rng, window)
        num_arms = len(arms)
        self.recent_rewards = [[deque(maxlen=window) for _ in range(num_arms)] for _ in range(num_buckets)]
        self.median_reward = [[0.0] * num_arms for _ in range(num_buckets)]
        self.plays = [[0] * num_arms for _ in range(num_buckets)]
        self._group_keys = sorted(self.groups) if self.groups else None
        if self.groups:
            idx = {s: i for i, s in enumerate(arms)}
            off = idx[Strategy.off()]
            self._group_arms = {}
            for k, ss in self.groups.items():
                missing = [str(s) for s in ss if s not in idx]
                if missing:
                    raise ValueError(f"groups[{k}] names strategies not in the selector: {missing}")
                self._group_arms[k] = {idx[s] for s in ss} | {off}

    def _group(self, batch_size: int, allowed: List[int]) -> List[int]:
        if not self._group_keys:
            return allowed
        i = bisect.bisect_left(self._group_keys, batch_size)
        g = self._group_arms[self._group_keys[min(i, len(self._group_keys) - 1)]]
        sub = [a for a in allowed if a in g]
        return sub or allowed

    def choose(self, bucket, batch_size, allowed, step):
        allowed = self._group(batch_size, allowed)
        a = first_unseen(self.plays[bucket], allowed)
        if a >= 0:
            return a
        if self.rng.random() < self.epsilon:
            return allowed[self.rng.randrange(len(allowed))]
        median = self.median_reward[bucket]
        return max(allowed, key=median.__getitem__)

    def observe(self, bucket, arm, batch_size, emitted, elapsed, accepted, step, accepted_rows=None):
        rewards = self.recent_rewards[bucket][arm]
        rewards.append(throughput_reward(emitted, elapsed))
        self.plays[bucket][arm] += 1
        s = sorted(rewards)
        m = len(s)
        self.median_reward[bucket][arm] = s[m // 2] if m % 2 else 0.5 * (s[m // 2 - 1] + s[m // 2])


class SlidingWindowUCB(Policy):
    """SW-UCB (Garivier & Moulines 2011): means and counts over the bucket's last ``window`` plays.

    Rewards are normalized by the best windowed mean of the bucket so ``c`` is scale-free.

    Attributes: ``recent_plays[bucket]`` (``(arm, reward)`` of the last ``window`` plays), ``window_plays`` and
    ``window_reward_sum`` per ``[bucket][arm]`` over them, ``bucket_plays[bucket]`` (all plays).
    """

    name = "ucb"

    def __init__(self, c: float = 0.3):
        if not (isinstance(c, (int, float)) and math.isfinite(c) and c >= 0):
            raise ValueError(f"c must be a finite number >= 0 (the exploration bonus scale), got {c!r}")
        self.c = c

    def bind(self, arms, num_buckets, rng, window):
        super().bind(arms, num_buckets, rng, window)
        num_arms = len(arms)
        self.recent_plays = [deque() for _ in range(num_buckets)]
        self.window_plays = [[0] * num_arms for _ in range(num_buckets)]
        self.window_reward_sum = [[0.0] * num_arms for _ in range(num_buckets)]
        self.bucket_plays = [0] * num_buckets

    def choose(self, bucket, batch_size, allowed, step):
        cnt, sm = self.window_plays[bucket], self.window_reward_sum[bucket]
        a = first_unseen(cnt, allowed)
        if a >= 0:
            return a
        best_mean = max(sm[a] / cnt[a] for a in allowed)
        log_t = math.log(min(self.bucket_plays[bucket], self.window) + 1)
        c = self.c * best_mean
        return max(allowed, key=lambda a: sm[a] / cnt[a] + c * math.sqrt(log_t / cnt[a]))

    def observe(self, bucket, arm, batch_size, emitted, elapsed, accepted, step, accepted_rows=None):
        r = throughput_reward(emitted, elapsed)
        q = self.recent_plays[bucket]
        q.append((arm, r))
        self.window_plays[bucket][arm] += 1
        self.window_reward_sum[bucket][arm] += r
        self.bucket_plays[bucket] += 1
        if len(q) > self.window:
            old, r_old = q.popleft()
            cnt, sm = self.window_plays[bucket], self.window_reward_sum[bucket]
            cnt[old] -= 1
            if 2.0 * r_old < sm[old]:
                sm[old] -= r_old
            else:  # the leaving reward dominates the sum: subtracting it would cancel the others' bits
                sm[old] = math.fsum(x for a, x in q if a == old)


class DiscountedThompson(Policy):
    """Gaussian Thompson sampling; statistics decay by ``gamma = 1 - 1/window`` per play of the bucket.

    Attributes (per ``[bucket][arm]``, discounted as of ``last_play``): ``weight`` (count), ``reward_sum``,
    ``reward_sq_sum``; ``bucket_plays[bucket]``.
    """

    name = "thompson"

    def __init__(self, min_rel_std: float = 0.02):
        if not (isinstance(min_rel_std, (int, float)) and math.isfinite(min_rel_std) and min_rel_std >= 0):
            raise ValueError(f"min_rel_std must be a finite number >= 0 (a fraction of the mean), got {min_rel_std!r}")
        self.min_rel_std = min_rel_std

    def bind(self, arms, num_buckets, rng, window):
        super().bind(arms, num_buckets, rng, window)
        num_arms = len(arms)
        self.gamma = 1.0 - 1.0 / window
        self.weight = [[0.0] * num_arms for _ in range(num_buckets)]
        self.reward_sum = [[0.0] * num_arms for _ in range(num_buckets)]
        self.reward_sq_sum = [[0.0] * num_arms for _ in range(num_buckets)]
        self.last_play = [[0] * num_arms for _ in range(num_buckets)]
        self.bucket_plays = [0] * num_buckets

    def choose(self, bucket, batch_size, allowed, step):
        n = self.weight[bucket]
        a = first_unseen(n, allowed)
        if a >= 0:
            return a
        t, last, g = self.bucket_plays[bucket], self.last_play[bucket], self.gamma
        s, ss = self.reward_sum[bucket], self.reward_sq_sum[bucket]
        best, best_v = allowed[0], -math.inf
        gauss = self.rng.gauss
        for a in allowed:
            # Ratios are invariant under discounting; only the effective count shrinks with staleness.
            mean = s[a] / n[a]
            floor = self.min_rel_std * mean
            var = max(ss[a] / n[a] - mean * mean, floor * floor)  # products: float ** 2 raises on overflow
            n_eff = n[a] * g ** (t - last[a])
            v = mean + math.sqrt(var / max(n_eff, 1e-3)) * gauss(0.0, 1.0)
            if v > best_v:
                best, best_v = a, v
        return best

    def observe(self, bucket, arm, batch_size, emitted, elapsed, accepted, step, accepted_rows=None):
        r = throughput_reward(emitted, elapsed)
        self.bucket_plays[bucket] += 1
        t = self.bucket_plays[bucket]
        f = self.gamma ** (t - self.last_play[bucket][arm])
        self.last_play[bucket][arm] = t
        self.weight[bucket][arm] = self.weight[bucket][arm] * f + 1.0
        self.reward_sum[bucket][arm] = self.reward_sum[bucket][arm] * f + r
        self.reward_sq_sum[bucket][arm] = self.reward_sq_sum[bucket][arm] * f + r * r
