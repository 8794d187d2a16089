"""Step-time model of the cost policy: the start-up :class:`CostTable` corrected online per (bucket, arm).

Rule: the predicted step time of arm ``a`` at batch size ``B`` in bucket ``k`` is ``table(a, B) * ratio[k][a]``,
``ratio`` the discounted mean (factor ``gamma`` per observation of that bucket and arm) of observed / table time;
the first observation replaces the prior ratio. The prior ratio is 1 until the arm is observed in some bucket; from
then on (``borrow``, default) a bucket that has not observed the arm borrows the ratio of the nearest bucket that has
(the lower one on a tie): the table's error for an arm at one batch size is the best guess of its error at the next
(a start-up table is timed between device synchronizations, the engine's steps overlap the host's work), and a
shrinking batch enters a new bucket every few steps. An arm without a table entry uses the discounted mean observed
time itself, and must be observed once in each bucket before it can be predicted there.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

from ..strategy import Strategy
from .cost_table import CostTable

# Floor of a time ratio: a positive time must not underflow to 0.0 and divide by zero later.
TINY_RATIO = 1e-300
# The count of a borrowed ratio: above 0 (the ratio is used) and below any own count (an own observation replaces it).
BORROWED = 1e-9


class StepTimeModel:
    """Per-(bucket, arm) correction of the table's step times.

    Args:
        arms: the selector's arms (index = arm).
        cost_table: the start-up table, or None (then every arm is timed online).
        num_buckets: batch-size buckets of the selector.
        gamma: discount per observation of a (bucket, arm), ``1 - 1 / window``.
        borrow: an arm's unobserved buckets borrow the ratio of its nearest observed bucket (module docstring).

    Attributes:
        count[bucket][arm]: discounted number of observations (0: never observed; :data:`BORROWED`: a borrowed ratio).
        ratio[bucket][arm]: observed / table step time, or observed seconds for an arm without a table entry.
        lender[bucket][arm]: the bucket a borrowed ratio comes from, else None.
    """

    def __init__(self, arms: Sequence[Strategy], cost_table: Optional[CostTable], num_buckets: int, gamma: float,
                 borrow: bool = True):
        self.arms = list(arms)
        self.cost_table = cost_table
        self.gamma = gamma
        self.borrow = borrow
        self.count = [[0.0] * len(arms) for _ in range(num_buckets)]
        self.ratio = [[0.0] * len(arms) for _ in range(num_buckets)]
        self.lender: List[List[Optional[int]]] = [[None] * len(arms) for _ in range(num_buckets)]
        self._borrowers: List[Dict[int, List[int]]] = [{} for _ in arms]  # per arm: lender -> the buckets it lends to
        self._rate: Dict[int, List[float]] = {}  # batch size -> [B / table seconds] per arm (0: no entry)
        self._secs: Dict[int, List[float]] = {}  # batch size -> [table seconds] per arm (0: no entry)

    def _fill_tables(self, batch_size: int) -> List[float]:
        secs = [0.0] * len(self.arms)
        if self.cost_table is not None:
            for a, s in enumerate(self.arms):
                secs[a] = self.cost_table.predict(s, batch_size) or 0.0
        self._secs[batch_size] = secs
        rate = self._rate[batch_size] = [batch_size / t if t else 0.0 for t in secs]
        return rate

    def table_rates(self, batch_size: int) -> List[float]:
        """``batch_size / table seconds`` per arm (0.0 for an arm without a table entry), cached per batch size."""
        return self._rate.get(batch_size) or self._fill_tables(batch_size)

    def table_seconds(self, batch_size: int) -> List[float]:
        """Table seconds per arm (0.0 for an arm without a table entry), cached per batch size."""
        secs = self._secs.get(batch_size)
        if secs is None:
            self._fill_tables(batch_size)
            secs = self._secs[batch_size]
        return secs

    def seconds(self, bucket: int, arm: int, batch_size: int) -> Optional[float]:
        """The arm's step time at ``batch_size``: the table's, corrected by the bucket's (own or borrowed) ratio
        where observed; None for an arm neither in the table nor observed."""
        base, n, ratio = self.table_seconds(batch_size)[arm], self.count[bucket][arm], self.ratio[bucket][arm]
        if base:
            return base * ratio if n > 0 else base
        return ratio if n > 0 else None

    def observe(self, bucket: int, arm: int, batch_size: int, elapsed: float) -> None:
        """Fold one step of ``elapsed`` seconds into the (bucket, arm) ratio, and lend it to the buckets that borrow
        the arm's ratio from this one."""
        base = self.table_seconds(batch_size)[arm]
        v = elapsed / base if base else elapsed
        if not TINY_RATIO <= v <= 1.0 / TINY_RATIO:  # legal extremes stay finite and nonzero in the discounted mean
            v = TINY_RATIO if v < TINY_RATIO else 1.0 / TINY_RATIO
        counts, ratios = self.count[bucket], self.ratio[bucket]
        first = self.lender[bucket][arm] is not None or counts[arm] == 0
        if first:  # the first own observation replaces the prior (or the borrowed ratio)
            ratios[arm], counts[arm], self.lender[bucket][arm] = v, 1.0, None
        else:
            n = counts[arm]
            ratios[arm] += (v - ratios[arm]) / (n * self.gamma + 1.0)
            counts[arm] = n * self.gamma + 1.0
        if self.borrow and base:
            if first:
                self._lend(arm)  # a new observed bucket: each borrower takes its nearest one again
            else:
                for k in self._borrowers[arm].get(bucket, ()):
                    self.ratio[k][arm] = ratios[arm]

    def _lend(self, arm: int) -> None:
        """Every bucket that has not observed ``arm`` borrows the ratio of the nearest bucket that has (the lower one
        on a tie)."""
        buckets = range(len(self.count))
        observed = [k for k in buckets if self.count[k][arm] > BORROWED and self.lender[k][arm] is None]
        borrowers: Dict[int, List[int]] = {}
        for k in buckets:
            if self.count[k][arm] > BORROWED and self.lender[k][arm] is None:
                continue
            source = min(observed, key=lambda j: (abs(j - k), j))
            self.lender[k][arm], self.count[k][arm], self.ratio[k][arm] = source, BORROWED, self.ratio[source][arm]
            borrowers.setdefault(source, []).append(k)
        self._borrowers[arm] = borrowers
