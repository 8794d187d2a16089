"""Each request's own acceptance, to price a draft where the loss budget would not (``StrategySelector(forecast=)``).

A static batch ends with its slowest request. The loss budget (:mod:`.loss_budget`) prices a draft by how far the last
drafting steps moved the batch's end, so a uniform batch's first drafts, which start from a tie (every request has the
same tokens left) and move the end by one token, spend the allowance before drafting pays (docs/RUNTIME.md, "The loss
budget"). The ledger cannot tell that tie from a slow request that never catches up; the requests' own acceptance
can: under an arm that pays, every running request accepts drafts, so the slowest one's rate beats plain decoding,
while a request that never catches up keeps its own forecast, and the batch's, low.

Terms, per rollout (:meth:`AcceptanceForecast.new_rollout` starts over):

* a request's ``steps`` and ``accepted`` under a drafting arm: the draft steps it ran under that arm and the drafts
  it accepted in them, summed;
* the arm's ``pooled`` rate: the running requests' accepted drafts over their draft steps under it;
* a request's *forecast* under the arm: ``(accepted + shrink * pooled) / (steps + shrink) + confidence / sqrt(steps
  + 1)``, its own rate shrunk toward the pooled one (a request seen for a few steps is mostly the pool), plus a
  bound's width (``confidence`` < 0: a lower bound, tighter with more steps);
* the arm's forecast tokens per step: one plus the lowest forecast among the running requests (the request the batch
  waits for, whichever it is), and its forecast rate: that over the arm's step time.

Rule (:meth:`AcceptanceForecast.choose`): where the selector would run plain decoding, the drafting arm with the best
forecast rate runs instead if that rate beats plain decoding's (one token a step over its step time) by ``margin``.
An arm no running request has drafted with has no forecast: the budget's probes give the evidence. A single running
request is left to the ledger, whose progress is then that request's acceptance exactly: a forecast from its first
steps would add noise, not evidence.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from .._validation import check_real

# Pseudo-steps of the pooled rate in a request's forecast: after a handful of its own steps, a request's rate
# dominates (values chosen on the selector suite's static batches: docs/RUNTIME.md, "The forecast").
DEFAULT_SHRINK = 4.0
# The bound's width, in accepted drafts per step at one step (a lower bound: the override needs evidence).
DEFAULT_CONFIDENCE = -0.3
# The gain over plain decoding a forecast must show before it overrides (step times are medians of noisy steps).
DEFAULT_MARGIN = 0.05
_WHERE = "AcceptanceForecast"


class AcceptanceForecast:
    """Per request and drafting arm: draft steps and accepted drafts of the current rollout (module docstring).

    Args:
        shrink: pseudo-steps of the arm's pooled rate in each request's forecast, > 0.
        confidence: accepted drafts per step added at one step, shrinking as ``1 / sqrt(steps + 1)``; negative
            for a lower bound.
        margin: the fraction by which the best forecast rate must beat plain decoding's to override it, >= 0.
    """

    def __init__(self, shrink: float = DEFAULT_SHRINK, confidence: float = DEFAULT_CONFIDENCE,
                 margin: float = DEFAULT_MARGIN):
        self.shrink = check_real(_WHERE, "shrink", shrink, 0.0, strict=True)  # > 0: a request not yet drafted is the pool
        self.confidence = check_real(_WHERE, "confidence", confidence, -math.inf)
        self.margin = check_real(_WHERE, "margin", margin, 0.0)
        self.depths: List[int] = []
        self.overrides = 0  # plain choices replaced by a forecast arm, over the forecast's life

    def bind(self, depths: Sequence[int]) -> None:
        """Size the statistics for arms of ``num_steps`` ``depths`` (0: plain decoding); the selector calls it once."""
        self.depths = list(depths)
        self.new_rollout()

    def new_rollout(self) -> None:
        """A new batch: no request has run yet."""
        size = 8  # request rows held before the first growth (:meth:`_grow` doubles it)
        self.steps = np.zeros((len(self.depths), size))
        self.accepted = np.zeros((len(self.depths), size))
        self.running = np.zeros(0, dtype=np.int64)
        self._tokens: Dict[int, Optional[float]] = {}  # arm -> forecast tokens per step (cached until the data moves)

    def observe(self, arm: int, rows: Sequence[int], accepted: Optional[Sequence[int]]) -> None:
        """One step of ``arm``: ``rows`` (distinct ints >= 0) are the requests still running after it and
        ``accepted`` their accepted drafts in it (ints in ``[0, num_steps]``; ignored for plain decoding); rows absent
        have finished (requests only leave a rollout). A ValueError names ``rows_accepted`` when they do not fit."""
        drafted = self.depths[arm] > 0 and len(rows) > 0
        changed = len(rows) != len(self.running)  # requests only leave: a new count is a new set
        if not (drafted or changed):
            return  # a plain step, no request left: nothing to learn
        counts = self._checked(arm, len(rows), accepted) if drafted else None
        index = np.asarray(rows, dtype=np.int64)
        if changed:
            if len(rows) and index.min() < 0:
                raise ValueError(f"running_rows must be ints >= 0, got {list(rows)}")
            self._tokens.clear()
            if len(rows) and index.max() >= self.steps.shape[1]:
                self._grow(int(index.max()) + 1)
        self.running = index
        if not drafted:
            return
        self.steps[arm][index] += 1  # a row view, then a 1-D index: half the cost of a 2-D fancy index
        self.accepted[arm][index] += counts
        self._tokens.pop(arm, None)

    def _checked(self, arm: int, num_rows: int, accepted) -> np.ndarray:
        """``accepted`` as float64 ``[num_rows]``, or a ValueError naming ``rows_accepted`` unless its values lie in
        ``[0, depth]`` (a NaN fails: an array's min and max carry it, where Python's could skip it)."""
        counts = None if accepted is None else np.asarray(accepted, dtype=np.float64)
        if counts is None or counts.shape != (num_rows,):
            raise ValueError(f"rows_accepted must give one count per running row ({num_rows}) for a drafting step, "
                             f"got {None if counts is None else counts.shape}")
        if not 0 <= counts.min() <= counts.max() <= self.depths[arm]:
            raise ValueError(f"rows_accepted must be ints in [0, num_steps={self.depths[arm]}], got {counts.tolist()}")
        return counts

    def _grow(self, rows: int) -> None:
        size = max(rows, 2 * self.steps.shape[1])
        pad = ((0, 0), (0, size - self.steps.shape[1]))
        self.steps, self.accepted = np.pad(self.steps, pad), np.pad(self.accepted, pad)

    def tokens_per_step(self, arm: int) -> Optional[float]:
        """The arm's forecast tokens per step (one plus the lowest running request's forecast), or None before any
        running request drafted with it."""
        if arm in self._tokens:
            return self._tokens[arm]
        value = None
        if len(self.running):
            steps, accepted = self.steps[arm][self.running], self.accepted[arm][self.running]
            if steps.max() > 0:
                pooled = accepted.sum() / steps.sum()
                forecast = ((accepted + self.shrink * pooled) / (steps + self.shrink)
                            + self.confidence / np.sqrt(steps + 1.0))
                value = 1.0 + float(forecast.min())
        self._tokens[arm] = value
        return value

    def choose(self, allowed: Sequence[int], step_seconds: Callable[[int], Optional[float]], plain: int) -> Optional[int]:
        """The drafting arm of ``allowed`` with the best forecast rate if it beats plain decoding's (arm ``plain``)
        by the margin, else None; ``step_seconds(arm)`` is an arm's step time (None: unknown, no override)."""
        if len(self.running) < 2:  # one request: the ledger's progress is its acceptance already
            return None
        plain_s = step_seconds(plain)
        if not plain_s:
            return None
        best, best_rate = None, (1.0 + self.margin) / plain_s
        for arm in allowed:
            if not self.depths[arm]:
                continue
            tokens = self.tokens_per_step(arm)
            seconds = step_seconds(arm) if tokens is not None else None
            if seconds and tokens / seconds > best_rate:
                best, best_rate = arm, tokens / seconds
        if best is not None:
            self.overrides += 1
        return best
