"""The counterfactual policy (``"counterfactual"``): follow the leader over every arm's acceptance, for a drafter
that scores every arm's drafts at every step.

A deterministic drafter (the n-gram one) can score, on any step, the drafts each arm would have proposed against the
tokens the batch goes on to emit. At temperature 0 the matched prefix is what verifying them accepts. Under sampling,
one-hot candidates at a level are accepted exactly when the target's token is among them, and decoding draws that
token from the same distribution, so the count has the same law (docs/RUNTIME.md, "The counterfactual policy"). With
every arm observed at every step, no arm needs a first play or a probe, and the best static arm so far is known:
play it.

Terms:

* a step's *progress* under a speculative arm: its counted requests' mean tokens, ``1 + sum(accepted) / rows``
  (``accepted[i]``: requests whose accepted path has at least ``i + 1`` drafts; ``rows``: the requests counted,
  the lagging ones a static batch waits for where the caller counts them). Plain decoding's is 1;
* an arm's *tokens*: ``(prior_tokens * prior_weight + sum of progress) / (prior_weight + steps)`` over its observed
  steps, played or counterfactual, discounted by ``1 - 1 / memory`` per observation of the arm when ``memory`` is
  given;
* an arm's predicted rate: its tokens over its step time, the start-up :class:`~.cost_table.CostTable`'s (an arm
  without a table entry: its observed steps', :class:`~.step_time_model.StepTimeModel`). Observed times are not
  mixed in: a rollout's first step also holds the host's preparation of it, and one such plain step would make
  plain decoding look slower than it is.

Rule: play the allowed arm with the best predicted rate. The prior is plain decoding's one token, so an arm is played
only once its observed progress pays for its step time; the first steps are plain decoding's, with nothing lost to
exploring.

Without counterfactual observations (:meth:`CounterfactualPolicy.observe_counterfactual`) the policy learns only from
the arms it plays, starting with plain decoding, which observes no acceptance: it never drafts. Use the ``"cost"``
policy for a drafter that cannot score its drafts for free (EAGLE runs a forward pass to draft).
"""
from __future__ import annotations

from typing import List, Optional, Sequence

from ..._validation import check_real
from .base import Policy
from .cost_table import CostTable
from .step_time_model import StepTimeModel

_WHERE = "CounterfactualPolicy"


class CounterfactualPolicy(Policy):
    """Follow the leader: the arm with the best observed tokens per predicted second (module docstring).

    Args:
        cost_table: a :class:`CostTable`, a ``{strategy: [(B, seconds), ...]}`` dict, or None (arms timed online:
            an arm without a table entry must be played once in a bucket before it is predicted there).
        prior_tokens: tokens per step an arm is credited with before its observations, >= 1 (1: plain decoding's,
            so no arm is played on its prior alone).
        prior_weight: the prior's weight, in observed steps, > 0.
        memory: steps of memory (each observation of an arm discounts its earlier ones by ``1 - 1 / memory``), an int
            >= 2, or None (default): every observation counts alike, the whole run's mean.
        keep_on_rollout: fraction of the arms' observations kept when a new rollout starts, in [0, 1] (the rest is
            the prior again).
    """

    name = "counterfactual"

    def __init__(self, cost_table=None, prior_tokens: float = 1.0, prior_weight: float = 1.0,
                 memory: Optional[int] = None, keep_on_rollout: float = 1.0):
        self.prior_tokens = check_real(_WHERE, "prior_tokens", prior_tokens, 1.0)
        self.prior_weight = check_real(_WHERE, "prior_weight", prior_weight, 0.0, strict=True)  # steps
        if memory is not None and (isinstance(memory, bool) or not isinstance(memory, int) or memory < 2):
            raise ValueError(f"CounterfactualPolicy: memory must be an int >= 2 (steps) or None, got {memory!r}")
        self.memory = memory
        self.keep_on_rollout = check_real(_WHERE, "keep_on_rollout", keep_on_rollout, 0.0, 1.0)
        if cost_table is not None and not isinstance(cost_table, CostTable):
            cost_table = CostTable(cost_table)
        self.cost_table = cost_table

    def bind(self, arms, num_buckets, rng, window):
        super().bind(arms, num_buckets, rng, window)
        self.depth = [s.num_steps for s in arms]
        # Step times are corrected with the selector's window, as the cost policy corrects them.
        self.step_time = StepTimeModel(arms, self.cost_table, num_buckets, 1.0 - 1.0 / window)
        self.discount = 1.0 if self.memory is None else 1.0 - 1.0 / self.memory
        self.progress = [self.prior_tokens * self.prior_weight if d else 0.0 for d in self.depth]
        self.steps = [self.prior_weight if d else 0.0 for d in self.depth]
        self.counterfactuals = 0  # counterfactual observations folded in

    @property
    def tokens(self) -> List[float]:
        """Observed tokens per counted request per step of every arm (1 for plain decoding)."""
        return [p / n if d else 1.0 for p, n, d in zip(self.progress, self.steps, self.depth)]

    def predict(self, bucket: int, arm: int, batch_size: int) -> Optional[float]:
        """Predicted tokens per second of ``arm``'s counted requests, or None before the arm can be timed."""
        seconds = self.step_seconds(bucket, arm, batch_size)
        return None if seconds is None else batch_size * self.tokens[arm] / seconds

    def step_seconds(self, bucket: int, arm: int, batch_size: int) -> Optional[float]:
        """The start-up table's step time of ``arm`` where it has one, else the observed one
        (:meth:`StepTimeModel.seconds`)."""
        return self.step_time.table_seconds(batch_size)[arm] or self.step_time.seconds(bucket, arm, batch_size)

    def choose(self, bucket, batch_size, allowed, step):
        best, best_rate = allowed[0], -1.0
        for arm in allowed:
            seconds = self.step_seconds(bucket, arm, batch_size)
            if seconds is None:
                return arm  # untimed (no table entry): one play times it
            rate = (self.progress[arm] / self.steps[arm] if self.depth[arm] else 1.0) / seconds
            if rate > best_rate:
                best, best_rate = arm, rate
        return best

    def new_rollout(self) -> None:
        """A new batch: keep ``keep_on_rollout`` of every arm's observations, the rest returns to the prior."""
        keep = self.keep_on_rollout
        for arm, d in enumerate(self.depth):
            if d:
                self.progress[arm] = keep * self.progress[arm] + (1 - keep) * self.prior_tokens * self.prior_weight
                self.steps[arm] = keep * self.steps[arm] + (1 - keep) * self.prior_weight

    def observe(self, bucket, arm, batch_size, emitted, elapsed, accepted, step, accepted_rows=None):
        self.step_time.observe(bucket, arm, batch_size, elapsed)
        if not self.depth[arm]:
            return
        if accepted is None:  # no counts: the step's tokens per request are its progress
            self._add_progress(arm, emitted / batch_size)
        else:
            self._add(arm, accepted, accepted_rows or batch_size)

    def observe_counterfactual(self, arm: int, accepted: Sequence[float], rows: int) -> None:
        """Speculative arm ``arm``'s counterfactual counts of one step (``accepted[i]``: of the ``rows`` counted
        requests, those whose drafts would have had at least ``i + 1`` accepted), checked by the selector."""
        self.counterfactuals += 1
        self._add(arm, accepted, rows)

    def _add(self, arm: int, accepted: Sequence[float], rows: int) -> None:
        self._add_progress(arm, 1.0 + sum(accepted) / rows)

    def _add_progress(self, arm: int, tokens: float) -> None:
        self.progress[arm] = self.discount * self.progress[arm] + tokens
        self.steps[arm] = self.discount * self.steps[arm] + 1.0
