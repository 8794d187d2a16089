"""Change detection of the cost policy: a bank of Bernoulli CUSUMs on the played arm's accepted draft tokens.

Rule: per step the played arm's ``trials`` draft tokens (requests reaching each position), ``hits`` of them
accepted, are compared with the arm's own predicted rate ``p = expected / trials``. For every shift ``s`` two
one-sided sums (floored at 0) add the log-likelihood ratio of ``p + s`` and of ``p - s`` against ``p``,
``hits log(p1/p) + (trials - hits) log((1-p1)/(1-p))``; any sum above ``threshold`` nats is an alarm, after which
every sum restarts from 0. A bias below ``s / 2`` drifts its sums down, so small model errors never alarm.

Once the evidence since the last alarm (``support``, discounted steps) reaches ``min_support``, an arm with fewer
than ``min_trials`` discounted steps of its own is not tested: its prediction is the shared model's, so its
surprise is the model's misfit for that arm, not a change over time. docs/RUNTIME.md has the derivation.
"""
from __future__ import annotations

import math
from typing import List, Sequence

# The CUSUM bank's shifts of acceptance (absolute): the small one catches small changes, the large one alarms
# sooner on large ones.
DEFAULT_SHIFTS = (0.1, 0.3)


class ChangeDetector:
    """Interface: ``observe`` returns whether acceptance changed; ``changes`` lists the steps of alarms."""

    changes: List[int]

    def observe(self, step: int, own_steps: float, trials: float, hits: float, expected: float) -> bool:
        """Test one step of the played arm: ``own_steps`` = its discounted steps in memory before this one,
        ``trials``/``hits`` = draft tokens tried/accepted, ``expected`` = accepted tokens it predicted."""
        raise NotImplementedError


class NoChangeDetector(ChangeDetector):
    """Never alarms (change detection disabled)."""

    def __init__(self):
        self.changes = []

    def observe(self, step, own_steps, trials, hits, expected):
        return False


class CusumChangeDetector(ChangeDetector):
    """Bank of two-sided Bernoulli CUSUMs (module docstring).

    Args:
        threshold: alarm level in nats (> 0).
        shifts: acceptance shifts the sums are tuned to, each in (0, 1).
        min_trials: skip an arm with fewer own discounted steps than this once ``min_support`` is reached (0: test
            every play).
        min_support: discounted steps since the last alarm (or the start) below which every play is tested.
        gamma: discount per step of ``support``.
    """

    def __init__(self, threshold: float, shifts: Sequence[float] = DEFAULT_SHIFTS, min_trials: float = 1.0,
                 min_support: float = 8.0, gamma: float = 1.0 - 1.0 / 32):
        if not threshold > 0:
            raise ValueError(f"detect must be a positive CUSUM threshold or None, got {threshold}")
        if not shifts or not all(0.0 < s < 1.0 for s in shifts):
            raise ValueError(f"the CUSUM shifts must be in (0, 1) (a non-empty tuple), got {shifts!r}")
        self.threshold = threshold
        self.shifts = tuple(shifts)
        self.min_trials = min_trials
        self.min_support = min_support
        self.gamma = gamma
        self.sums = [0.0] * (2 * len(self.shifts))  # one-sided sums: (up, down) per shift
        self.support, self.t_support = 0.0, 0  # discounted steps observed since the last alarm
        self.changes: List[int] = []

    def observe(self, step, own_steps, trials, hits, expected):
        support = self.support * self.gamma ** (step - self.t_support)
        self.support, self.t_support = support + 1.0, step
        if not trials > 0.0:
            return False
        if self.min_trials and not own_steps >= self.min_trials and not support < self.min_support:
            return False  # a barely played arm once the level rests on enough steps: its surprise is misfit
        if not self._add_evidence(trials, hits, expected / trials):
            return False
        self.changes.append(step)
        self.sums = [0.0] * len(self.sums)
        self.support = 0.0
        return True

    def _add_evidence(self, trials: float, hits: float, p: float) -> bool:
        """Add one step's log-likelihood ratios to every sum; True when one is above the threshold."""
        p = 0.02 if p < 0.02 else (0.98 if p > 0.98 else p)
        log, sums, alarm, i = math.log, self.sums, False, 0
        log_p, log_q, misses = log(p), log(1.0 - p), trials - hits
        for s in self.shifts:
            hi = p + s if p + s < 0.995 else 0.995
            lo = p - s if p - s > 0.005 else 0.005
            up = sums[i] + hits * (log(hi) - log_p) + misses * (log(1.0 - hi) - log_q)
            down = sums[i + 1] + hits * (log(lo) - log_p) + misses * (log(1.0 - lo) - log_q)
            sums[i] = up if up > 0.0 else 0.0
            sums[i + 1] = down if down > 0.0 else 0.0
            if up > self.threshold or down > self.threshold:
                alarm = True
            i += 2
        return alarm
