"""The loss budget: what an adaptive rollout may lose against plain decoding (``StrategySelector(loss_budget=)``).

A policy that learns the drafts' acceptance online pays for what it learns: a speculative step whose drafts are
rejected costs more than the plain step it replaced, by most on a small target whose steps are launch-bound. The
budget bounds that loss per rollout whatever the policy believes: the rule of a conservative bandit (Wu et al.,
"Conservative Bandits", 2016), with plain decoding as the baseline. What it gains and costs on a real model:
docs/RUNTIME.md, "The loss budget".

Terms, per rollout (:meth:`LossBudget.new_rollout` starts over):

* ``elapsed``: the seconds of the rollout's steps observed so far.
* ``t0`` of a bucket: the lower median of its last plain step times in this rollout, its first step left out; where it
  has none yet, the nearest timed bucket's, scaled by the start-up cost table's plain step times at the two batch sizes
  where there is one. A ``t0`` too high credits drafts with gains they never made, so: the rollout's first step is no
  sample (the engine's step clock runs from the prefill's end, so it can also carry the host's preparation of it: it did
  while the engine's start read the device, up to 143ebb3); plain step times of earlier rollouts are stale (other
  contexts, other lengths), and so are a bucket's after ``REFRESH_STEPS`` speculative steps there since its last plain
  one: its next step is plain.
* a step's ``progress``: how far it moved the batch's end, in plain steps. A rollout is a static batch, which ends with
  its slowest request: the engine measures the fall of its most tokens left (``update(batch_progress=)``). Where the
  caller does not, it is estimated: where the counted requests are the lagging ones (``accepted_rows`` given: the
  engine's rule, those with the most tokens left), a step moves the end by the fewest tokens any of them got: one plus
  the number of leading draft positions that every counted request accepted (``accepted_per_position``). Counts over the
  whole batch (no ``accepted_rows``) give one plus their mean, a throughput view; no counts, the emitted tokens per
  request. A plain step's progress is one.
* a speculative step's ``loss``: ``elapsed_s - progress * min(t0, elapsed_s)``, the seconds it took beyond what plain
  decoding needs to move the batch as far (negative where its drafts paid; a speculative step does a plain step's work
  and more, so a ``t0`` above its own time is stale). With the measured fall of the batch's most tokens left, the
  progress summed over a rollout without EOS is the longest request's tokens, so the summed loss is the rollout's time
  beyond plain decoding's; the lagging rows' estimate can overstate a step (a row one token behind them that accepts
  nothing ends the fall earlier), so the ledger can under-count the loss by that much.
* ``remaining``: the rollout's most tokens per request (``new_rollout(max_tokens=)``) less the progress so far: plain
  decoding's steps still to go (an upper bound where requests may stop at an EOS); 0 when not told.
* an arm's ``reserve`` in a bucket: the most its next step can lose. At worst a step emits one token per request, as a
  plain step does, so the reserve is the arm's step time minus ``t0``: the median of its recent steps in the bucket;
  before it ran there, the start-up cost table's ratio to plain decoding; without one, ``FIRST_RESERVE * t0``.

Rule: a speculative arm may run only while ``loss + reserves of steps in flight + its reserve <= fraction * (elapsed +
remaining * t0)``, the fraction of the rollout's time were the rest decoded plainly; otherwise plain decoding runs.
Gains bank: a rollout whose drafts paid may explore more. No draft runs before a plain step of the rollout has been
timed (``t0``); then a rollout told its length may explore within the loss it may take over its whole length, one not
told stays plain until ``fraction * elapsed`` covers a reserve.
"""
from __future__ import annotations

import bisect
from collections import deque
from typing import Callable, Dict, List, Optional, Sequence

# An arm never timed, with no cost table: its step is assumed to cost up to two plain steps (what a deep tree costs on
# a launch-bound target; docs/RUNTIME.md, "The loss budget").
FIRST_RESERVE = 1.0
# Step times kept per (bucket, arm): a median over a few steps ignores the one that also flushed deferred commits.
TIME_SAMPLES = 8
# Speculative steps in a bucket after which its plain step time is stale and a plain step runs (one plain step in 64
# costs a drafter that gains 1.2x about 0.3% of its gain).
REFRESH_STEPS = 64


def check_loss_budget(fraction) -> Optional[float]:
    """``loss_budget`` as a float in [0, 1), or None (no budget); a ValueError naming the argument otherwise."""
    if fraction is None:
        return None
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 <= fraction < 1.0:
        raise ValueError(f"loss_budget must be a fraction in [0, 1) of the rollout's time, or None, got {fraction!r}")
    return float(fraction)


def _median(values, lower: bool = False) -> float:
    """The middle value; of an even count, the upper one, or with ``lower`` the lower one (the side of a plain step
    time that over-counts a loss, and of an arm's that over-reserves)."""
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2 if lower else len(ordered) // 2]


class LossBudget:
    """The ledger of one selector (see the module docstring for the terms and the rule).

    Args:
        fraction: the loss allowed, as a fraction of the rollout's elapsed time (0: speculate only on banked gains).
        depths: ``num_steps`` of every arm (0: plain decoding).
        num_buckets: the selector's batch-size buckets.
        table_ratio: ``table_ratio(arm, batch_size)``: the start-up cost table's step time of the arm over plain
            decoding's, or None without entries.
        plain_cost: ``plain_cost(batch_size)``: the start-up cost table's plain step time, or None without one.
    """

    def __init__(self, fraction: float, depths: Sequence[int], num_buckets: int,
                 table_ratio: Optional[Callable[[int, int], Optional[float]]] = None,
                 plain_cost: Optional[Callable[[int], Optional[float]]] = None):
        self.fraction = fraction
        self.depths = list(depths)
        self.table_ratio = table_ratio
        self.plain_cost = plain_cost
        self.times: List[List[deque]] = [[deque(maxlen=TIME_SAMPLES) for _ in depths] for _ in range(num_buckets)]
        self.plain = self.depths.index(0)
        self.in_flight: deque = deque()  # reserves of the steps launched and not yet observed, oldest first
        self.vetoed = 0  # speculative choices replaced by plain decoding, over the selector's life
        self.new_rollout()

    def new_rollout(self, max_tokens: Optional[int] = None) -> None:
        """A new batch of at most ``max_tokens`` new tokens per request (None: not told): its loss and elapsed time
        start at zero, and so do its plain step times (stale now); the arms' step times are kept for the reserves."""
        self.loss = 0.0
        self.elapsed = 0.0
        self.remaining = max(int(max_tokens), 0) if max_tokens is not None else 0
        for bucket_times in self.times:
            bucket_times[self.plain].clear()
        self._timed: List[int] = []  # buckets with plain step times in this rollout, sorted
        self._plain_batch: Dict[int, int] = {}  # bucket -> batch size of its last plain step
        self._since_plain = [0] * len(self.times)  # speculative steps per bucket since its last plain one
        self._first_step = True  # the rollout's first step is still to be observed

    def plain_time(self, bucket: int, batch_size: Optional[int] = None) -> Optional[float]:
        """``t0``: the bucket's lower median plain step time in this rollout, else the nearest timed bucket's (the lower
        one on a tie), scaled by ``plain_cost`` from its batch size to ``batch_size`` when both are known."""
        own = self.times[bucket][self.plain]
        if own:
            return _median(own, lower=True)
        if not self._timed:
            return None
        i = bisect.bisect_left(self._timed, bucket)
        near = min(self._timed[max(i - 1, 0): i + 1], key=lambda b: (abs(b - bucket), b))
        return _median(self.times[near][self.plain], lower=True) * self._plain_scale(near, batch_size)

    def _plain_scale(self, near: int, batch_size: Optional[int]) -> float:
        """The cost table's plain step time at ``batch_size`` over that at bucket ``near``'s last plain batch size
        (1 without a table or a batch size)."""
        if self.plain_cost is None or batch_size is None:
            return 1.0
        there, here = self.plain_cost(self._plain_batch[near]), self.plain_cost(batch_size)
        return here / there if here and there else 1.0

    def reserve(self, arm: int, bucket: int, batch_size: int, t0: float) -> float:
        """The most one step of ``arm`` can lose in ``bucket``, in seconds."""
        own = self.times[bucket][arm]
        if own:
            return max(_median(own) - t0, 0.0)
        ratio = self.table_ratio(arm, batch_size) if self.table_ratio is not None else None
        return t0 * (max(ratio - 1.0, 0.0) if ratio is not None else FIRST_RESERVE)

    def allows(self, arm: int, bucket: int, batch_size: int) -> bool:
        """Whether ``arm`` may run now (plain decoding always may); counts a refusal in :attr:`vetoed`."""
        if not self.depths[arm]:
            return True
        t0 = self.plain_time(bucket, batch_size)
        if t0 is not None and self._since_plain[bucket] < REFRESH_STEPS:
            spend = self.loss + sum(self.in_flight) + self.reserve(arm, bucket, batch_size, t0)
            if spend <= self.fraction * (self.elapsed + self.remaining * t0):
                return True
        self.vetoed += 1
        return False

    def launched(self, arm: int, bucket: int, batch_size: int) -> None:
        """A step of ``arm`` was issued (its observation may come later): hold its reserve until then."""
        t0 = self.plain_time(bucket, batch_size) if self.depths[arm] else None
        self.in_flight.append(0.0 if t0 is None else self.reserve(arm, bucket, batch_size, t0))

    def release(self) -> None:
        """The oldest step in flight was observed (or its observation dropped): its reserve is freed."""
        if self.in_flight:
            self.in_flight.popleft()

    def observe(self, arm: int, bucket: int, batch_size: int, emitted: float, elapsed: float,
                accepted: Optional[Sequence[float]], rows: Optional[int], progress: Optional[float] = None) -> None:
        """Fold in a checked observation (after :meth:`release`); ``progress``: how far the step moved the batch's
        end when the caller measured it (else :func:`step_progress` estimates it from the counts)."""
        self.elapsed += elapsed
        first, self._first_step = self._first_step, False
        if not first:  # the first step may also carry the host's preparation of it after the prefill: no sample
            self.times[bucket][arm].append(elapsed)
        if not self.depths[arm]:
            self._observe_plain(bucket, batch_size, sampled=not first)
            return
        self._since_plain[bucket] += 1
        if progress is None:
            progress = step_progress(emitted, batch_size, accepted, rows)
        self.remaining = max(self.remaining - progress, 0)
        t0 = self.plain_time(bucket, batch_size)
        if t0 is None:  # no plain step timed yet (a policy without the budget's veto ran first): count it all
            self.loss += elapsed
            return
        # A speculative step does a plain step's work and more, so plain decoding took at most its time now: a
        # t0 above it is stale, and would credit the step with a gain it did not make.
        self.loss += elapsed - progress * min(t0, elapsed)

    def _observe_plain(self, bucket: int, batch_size: int, sampled: bool) -> None:
        """A plain step moved the batch one token; ``sampled``: its time joined the bucket's plain step times."""
        self.remaining = max(self.remaining - 1, 0)
        if not sampled:
            return
        if len(self.times[bucket][self.plain]) == 1:
            bisect.insort(self._timed, bucket)
        self._plain_batch[bucket] = batch_size
        self._since_plain[bucket] = 0


def step_progress(emitted: float, batch_size: int, accepted: Optional[Sequence[float]], rows: Optional[int]) -> float:
    """How far a speculative step moved its batch, in plain steps. With ``rows`` (the counted rows are the lagging
    ones, the engine's rule: ``accepted[j]`` of them accepted ``j + 1`` drafts or more), one plus the leading draft
    positions that every one of them reached: the batch ends with its slowest request, and after plain steps every
    request ties for the most tokens left, so their mean would credit a uniform batch with drafts that only its
    faster requests accepted (docs/RUNTIME.md, "The loss budget"). Without ``rows`` (counts over the whole batch, a
    throughput view), one plus their mean; without counts, ``emitted / batch_size``."""
    if accepted is None:
        return emitted / batch_size
    if not rows:
        return 1.0 + sum(accepted) / batch_size
    every_row = 0
    for reached in accepted:
        if reached < rows:
            break
        every_row += 1
    return 1.0 + every_row
