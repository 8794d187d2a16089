"""The cost-model policy (``"cost"``, the selector's default): predicted throughput from a shared acceptance model
and a step-time model, with change detection.

Rule: play the arm maximizing ``B * tokens[a] / predicted step time``, where ``tokens[a]`` is the optimistic
expected tokens per request (:class:`~.acceptance_model.SharedAcceptanceModel`) and the step time the start-up
table corrected online per bucket, or in a bucket where the arm has not run yet by the nearest bucket where it has
(:class:`~.step_time_model.StepTimeModel`). A never-played speculative arm is
played once, the best predicted first, if it is the first of its width group or deeper than every arm played so far
(``explore_per_group``): only then does its first play measure a parameter the model lacks; otherwise it competes
on its prediction, and is played once only if it predicts within ``explore_margin`` of the best arm (a near-tie
only its own counts settle). With ``min_gain``, a played speculative arm wins only when it predicts more than
``1 + min_gain`` times plain decoding's throughput (off by default). With ``ride_runs`` (default), a step whose
counted requests accepted every draft is followed by the same arm: acceptance comes in runs (an n-gram drafter
following a repetition), which a windowed model mixes with the steps around them. After ``probe_every`` plain steps in
a row in a bucket the best-predicted speculative
arm is played once: plain decoding observes no acceptance, so without probes a selector that settled on it (a warm
selector after a low-acceptance rollout, say) would never see the acceptance rise. On an alarm of the change
detector (:mod:`.change_detector`) the model forgets (:meth:`~.acceptance_model.SharedAcceptanceModel.forget`), and
it forgets part of its counts (``keep_on_rollout``) and returns the level to its prior (``prior_level_on_rollout``)
when a new rollout starts: a batch's counts and level are its lagging requests', and the next batch's requests are
others; the new rollout's first plain-decoding choice per bucket is a probe (``probe_on_rollout``).
docs/RUNTIME.md has the derivation and measurements.
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence

from .acceptance_model import SharedAcceptanceModel
from .base import Policy
from .change_detector import ChangeDetector, CusumChangeDetector, NoChangeDetector
from .cost_table import CostTable
from .step_time_model import StepTimeModel

# How far (cloglog) the level may move before every arm's tokens are recomputed; in between only the played arm's
# are. The CPU cost's main knob (docs/RUNTIME.md).
LEVEL_REFRESH_TOLERANCE = 0.05


def _check_options(prior_accept, model_sd, detect, min_trials, min_support, keep_on_change, offset_prior, ucb,
                   offset_mean, explore_margin, min_gain, keep_on_rollout) -> None:
    if detect is not None and not detect > 0:
        raise ValueError(f"detect must be a positive CUSUM threshold or None, got {detect}")
    if not 0.0 <= keep_on_change <= 1.0:
        raise ValueError(f"keep_on_change must be in [0, 1], got {keep_on_change}")
    if not 0.0 <= keep_on_rollout <= 1.0:
        raise ValueError(f"keep_on_rollout must be in [0, 1], got {keep_on_rollout}")
    if not 0.0 < prior_accept < 1.0:
        raise ValueError(f"prior_accept must be in (0, 1), got {prior_accept}")
    if not (offset_prior > 0 and ucb >= 0):
        raise ValueError(f"offset_prior must be > 0 and ucb >= 0; got {offset_prior}, {ucb}")
    if not model_sd > 0:
        raise ValueError(f"model_sd must be > 0; got {model_sd}")
    if not min_trials >= 0:
        raise ValueError(f"min_trials must be >= 0 (discounted steps of the arm's own), got {min_trials}")
    if not min_support >= 0:
        raise ValueError(f"min_support must be >= 0 (discounted steps since the last alarm), got {min_support}")
    if not math.isfinite(offset_mean):
        raise ValueError(f"offset_mean must be a finite number (a multiple of log(width)), got {offset_mean!r}")
    if not 0.0 <= explore_margin <= 1.0:
        raise ValueError(f"explore_margin must be in [0, 1] (a fraction of the best prediction), got {explore_margin}")
    if not 0.0 <= min_gain <= 1.0:
        raise ValueError(f"min_gain must be in [0, 1] (a fraction of plain decoding's prediction), got {min_gain}")


class CostModelPolicy(Policy):
    """Pick the arm maximizing ``B * E[tokens per request] / predicted step time`` (module docstring).

    Args:
        cost_table: a :class:`CostTable`, a ``{strategy: [(B, seconds), ...]}`` dict, or None (arms timed online).
        prior_accept: single-candidate acceptance assumed before any observation, in (0, 1).
        model_sd: how far (cloglog sd) the shared model may be from an arm's true acceptance; sets the model's
            weight against the arm's own counts (smaller: trust the model more).
        detect: CUSUM alarm threshold in nats (None disables change detection).
        min_trials: once the level rests on ``min_support`` steps, the change test skips an arm with fewer than
            this many discounted steps of its own (0: always test).
        min_support: discounted steps since the last alarm (or the start) below which every play is tested.
        keep_on_change: fraction of the arms' own acceptance counts kept after an alarm, in [0, 1].
        offset_prior: prior standard deviation of the width and depth offsets (cloglog scale).
        ucb: optimism of the choice, in standard deviations of the arm's width offset (0: greedy).
        offset_mean: prior mean of a width group's offset, ``offset_mean * log(width)`` (1: ``width`` independent
            candidates, the optimistic bound; 0: every arm starts as a chain).
        explore_per_group: force a first play only of an arm that brings the model a new width group or depth, or
            is a near-tie; False: of every arm.
        explore_margin: the near-tie margin, a fraction of the best prediction in [0, 1].
        min_gain: a played speculative arm is chosen over plain decoding only when it predicts more than
            ``1 + min_gain`` times plain decoding's throughput, in [0, 1] (0: the best prediction wins). A static
            batch ends with its slowest request, which a batch's acceptance overstates (docs/RUNTIME.md, "Static
            batches"); the probes (``probe_every``) keep observing acceptance while the margin holds plain decoding.
        probe_every: after this many plain-decoding steps in a row in a bucket, play the best-predicted speculative
            arm once (a probe: plain decoding observes no acceptance, so a level that rose would go unseen);
            None: never.
        ride_runs: after a speculative step whose counted requests (``accepted_rows``, else the batch) all accepted
            every draft, play the same arm again when allowed, whatever the model predicts (docs/RUNTIME.md,
            "Static batches": acceptance in runs); False: every step is the model's choice.
        keep_on_rollout: fraction of the arms' own acceptance counts kept when a new rollout starts
            (:meth:`new_rollout`), in [0, 1]: the counts a rollout ends with are its lagging requests', which say
            little about the next batch's (1: keep them all).
        prior_level_on_rollout: when a new rollout starts, the shared level returns to ``prior_accept``'s, with the
            prior's variance (the offsets and step times are kept): the level a rollout ends with is its
            lagging requests' (False: keep it).
        probe_on_rollout: when a new rollout starts, the first choice of plain decoding in each bucket is a probe
            (as after ``probe_every`` plain steps; needs ``probe_every``): a selector that ended the last batch on
            plain decoding would otherwise wait ``probe_every`` steps to see the new requests' drafts.
        borrow_step_times: a bucket where an arm has not run predicts its step time with the table corrected by the
            nearest bucket where it has (:class:`~.step_time_model.StepTimeModel`); False: by the table alone.

    Attributes (after ``bind``): ``acceptance`` (:class:`SharedAcceptanceModel`), ``step_time``
    (:class:`StepTimeModel`), ``detector`` (:class:`ChangeDetector`); ``tokens`` and ``changes`` (steps of alarms).
    """

    name = "cost"

    def __init__(self, cost_table=None, prior_accept: float = 0.7, model_sd: float = 0.1,
                 detect: Optional[float] = 8.0, min_trials: float = 1.0, min_support: float = 8.0,
                 keep_on_change: float = 0.5, offset_prior: float = 0.5, ucb: float = 1.0, offset_mean: float = 1.0,
                 explore_per_group: bool = True, explore_margin: float = 0.05, probe_every: Optional[int] = 32,
                 min_gain: float = 0.0, ride_runs: bool = True, keep_on_rollout: float = 0.5,
                 probe_on_rollout: bool = True, prior_level_on_rollout: bool = True, borrow_step_times: bool = True):
        _check_options(prior_accept, model_sd, detect, min_trials, min_support, keep_on_change, offset_prior, ucb,
                       offset_mean, explore_margin, min_gain, keep_on_rollout)
        if probe_every is not None and (isinstance(probe_every, bool) or not isinstance(probe_every, int)
                                        or probe_every < 1):
            raise ValueError(f"probe_every must be an int >= 1 (plain steps in a row) or None, got {probe_every!r}")
        for name, flag in (("probe_on_rollout", probe_on_rollout), ("prior_level_on_rollout", prior_level_on_rollout),
                           ("borrow_step_times", borrow_step_times)):
            if not isinstance(flag, bool):
                raise ValueError(f"{name} must be a bool, got {flag!r}")
        if cost_table is not None and not isinstance(cost_table, CostTable):
            cost_table = CostTable(cost_table)
        self.cost_table = cost_table
        self.prior_accept = prior_accept
        self.model_sd = model_sd
        self.detect = detect
        self.min_trials = min_trials
        self.min_support = min_support
        self.keep_on_change = keep_on_change
        self.offset_prior = offset_prior
        self.ucb = ucb
        self.offset_mean = offset_mean
        self.explore_per_group = explore_per_group
        self.explore_margin = explore_margin
        self.probe_every = probe_every
        self.min_gain = min_gain
        self.ride_runs = bool(ride_runs)
        self.keep_on_rollout = keep_on_rollout
        self.probe_on_rollout = probe_on_rollout
        self.prior_level_on_rollout = prior_level_on_rollout
        self.borrow_step_times = borrow_step_times

    def bind(self, arms, num_buckets, rng, window):
        super().bind(arms, num_buckets, rng, window)
        self.acceptance = self._make_acceptance_model(arms, window)
        self.step_time = StepTimeModel(arms, self.cost_table, num_buckets, self.acceptance.gamma,
                                       borrow=self.borrow_step_times)
        self.detector = self._make_change_detector(self.acceptance.gamma)
        self.depth = [s.num_steps for s in arms]
        self.played = [False] * len(arms)  # speculative arms whose acceptance was observed at least once
        self.group_played = [False] * len(self.acceptance.width_offset)
        self.deepest_played = 0
        self.plain_run = [0] * num_buckets  # plain steps in a row per bucket (a probe resets it)
        self.riding = -1  # the arm whose last step had every draft accepted (ride_runs), else -1
        self.refresh_due = False  # new_rollout forgot counts: every arm's prediction is recomputed at the next choice

    def _make_acceptance_model(self, arms: Sequence, window: int) -> SharedAcceptanceModel:
        return SharedAcceptanceModel(arms, window, self.prior_accept, self.model_sd, self.offset_prior,
                                     self.offset_mean, self.ucb)

    def _make_change_detector(self, gamma: float) -> ChangeDetector:
        if self.detect is None:
            return NoChangeDetector()
        return CusumChangeDetector(self.detect, min_trials=self.min_trials, min_support=self.min_support, gamma=gamma)

    @property
    def tokens(self) -> List[float]:
        """Optimistic expected tokens per request per step of every arm (what the choice uses)."""
        return self.acceptance.tokens

    @property
    def changes(self) -> List[int]:
        """Steps at which a change in acceptance was detected."""
        return self.detector.changes

    def predict(self, bucket: int, a: int, batch_size: int) -> Optional[float]:
        """Predicted throughput (tokens/s) of arm ``a``, or None when it must be observed first (the readable form
        of what :meth:`choose` computes)."""
        rate = self.step_time.table_rates(batch_size)
        n, ratio = self.step_time.count[bucket][a], self.step_time.ratio[bucket][a]
        if not rate[a]:
            return batch_size * self.tokens[a] / ratio if n > 0 else None
        return rate[a] * self.tokens[a] / (ratio if n > 0 else 1.0)

    def step_seconds(self, bucket: int, arm: int, batch_size: int) -> Optional[float]:
        """The start-up table's step time of ``arm`` where it has one, else the observed one
        (:meth:`StepTimeModel.seconds`): the observed times carry a rollout's first step, whose time also holds the
        host's preparation of it, and one such step would make plain decoding look slower than it is."""
        return self.step_time.table_seconds(batch_size)[arm] or self.step_time.seconds(bucket, arm, batch_size)

    def new_rollout(self) -> None:
        """A new batch: keep ``keep_on_rollout`` of the arms' own counts and reset the level's variance (as after a
        detected change, :meth:`~.acceptance_model.SharedAcceptanceModel.forget`), so the new requests' first
        observations move the prediction; with ``prior_level_on_rollout`` the level itself returns to the prior's;
        ride no run of the last batch; with ``probe_on_rollout`` the first choice of plain decoding in each bucket
        is a probe. Step times, width and depth offsets are kept."""
        self.riding = -1
        if self.probe_on_rollout and self.probe_every is not None:
            self.plain_run = [self.probe_every] * len(self.plain_run)
        if self.keep_on_rollout < 1.0:
            self.acceptance.forget(self.keep_on_rollout)
            self.refresh_due = True  # the predictions are recomputed at the next choice's step
        if self.prior_level_on_rollout:
            # The last batch ended on its lagging requests, often in a stretch no draft fits: a level learned there
            # kept a warm selector on plain decoding through the new requests' drafts (docs/RUNTIME.md).
            self.acceptance.reset_level(self.prior_accept)
            self.refresh_due = True

    def choose(self, bucket, batch_size, allowed, step):
        if self.refresh_due:
            self.refresh_due = False
            self.acceptance.refresh_all(step)
        if self.riding >= 0 and self.riding in allowed:
            return self.riding  # a run of accepted drafts predicts the next step better than the windowed model
        rate = self.step_time.table_rates(batch_size)
        counts, ratios = self.step_time.count[bucket], self.step_time.ratio[bucket]
        tokens, played, depth = self.acceptance.tokens, self.played, self.depth
        best, best_v = -1, -1.0
        new, new_v = -1, -1.0  # the never-played arm with the best (prior) prediction whose first play is forced
        near, near_v = -1, -1.0  # the best never-played arm whose first play is optional (a near-tie)
        plain, plain_v = -1, -1.0
        for a in allowed:
            r = rate[a]
            if r:
                v = r * tokens[a] / ratios[a] if counts[a] > 0 else r * tokens[a]
            elif counts[a] > 0:
                v = batch_size * tokens[a] / ratios[a]
            else:
                return a
            if not depth[a]:
                plain, plain_v = a, v
            if depth[a] and not played[a]:
                if self._first_play_is_forced(a):
                    if v > new_v:
                        new, new_v = a, v
                    continue
                if v > near_v:
                    near, near_v = a, v
            if v > best_v:
                best, best_v = a, v
        if new >= 0:
            return new
        if near >= 0 and near_v >= (1.0 - self.explore_margin) * best_v:
            return near
        if self.min_gain and plain >= 0 and depth[best] and best_v <= (1.0 + self.min_gain) * plain_v:
            best = plain  # within the margin: plain decoding (the probes below keep observing)
        if self.depth[best] == 0 and self.probe_every is not None and self.plain_run[bucket] >= self.probe_every:
            return self._probe(bucket, allowed, batch_size, best)
        return best

    def _probe(self, bucket: int, allowed, batch_size: int, plain: int) -> int:
        """The best-predicted speculative arm among ``allowed`` (``plain`` when none has a prediction): plain
        decoding observes no acceptance, so without a probe a level that rose since would never be seen."""
        probe, probe_v = plain, -1.0
        for a in allowed:
            v = self.predict(bucket, a, batch_size) if self.depth[a] else None
            if v is not None and v > probe_v:
                probe, probe_v = a, v
        return probe

    def _first_play_is_forced(self, a: int) -> bool:
        """Whether never-played arm ``a``'s first play measures something the model lacks (a new width group or a
        depth past every played arm), or every first play is forced."""
        if not self.explore_per_group:
            return True
        return not (self.group_played[self.acceptance.group[a]] and self.depth[a] <= self.deepest_played)

    def observe(self, bucket, arm, batch_size, emitted, elapsed, accepted, step, accepted_rows=None):
        self.step_time.observe(bucket, arm, batch_size, elapsed)
        d = self.depth[arm]
        self.plain_run[bucket] = self.plain_run[bucket] + 1 if d == 0 else 0
        full = self.ride_runs and d > 0 and accepted is not None and len(accepted) == d \
            and accepted[-1] >= (accepted_rows or batch_size)
        self.riding = arm if full else -1
        if d == 0:
            return
        if accepted is None:
            self._mark_played(arm)
            self.acceptance.add_observed_tokens(arm, emitted / batch_size, step)
            return
        self.observe_acceptance(arm, batch_size, accepted, step, accepted_rows)

    def observe_acceptance(self, arm, batch_size, accepted, step, accepted_rows=None) -> None:
        """The acceptance half of :meth:`observe`: speculative arm ``arm``'s ``accepted`` counts (``[num_steps]``,
        as ``observe`` takes them) with no step time, e.g. drafts scored against the tokens plain steps emitted
        (``tools/counterfactual_replay.py``); the step-time model, probes and runs are left as they were."""
        d = self.depth[arm]
        if not d:
            raise ValueError(f"observe_acceptance takes a speculative arm, got {self.arms[arm]} (plain decoding)")
        if len(accepted) != d:
            raise ValueError(
                f"accepted_per_position for {self.arms[arm]} must have num_steps={d} entries, got {len(accepted)}"
            )
        model = self.acceptance
        own = model.own_weight(arm, step)
        self._mark_played(arm)
        trials = accepted_rows or batch_size  # the requests the counts are over: the fit's sample size
        changed = self._fit(arm, accepted, trials, step, own)
        model.add_own_counts(arm, accepted, trials, step, own)
        # Other arms move only through the shared model: refresh them all when the level moved enough to matter
        # (or on an alarm), else only the played arm (keeps select+update cheap).
        if changed or abs(model.level - model.level_refreshed) > LEVEL_REFRESH_TOLERANCE:
            model.refresh_all(step)
        else:
            model.refresh(arm, step)

    def _mark_played(self, arm: int) -> None:
        """Arm ``arm``'s acceptance has been observed: its width group and depth are no longer new to the model."""
        self.played[arm] = True
        self.group_played[self.acceptance.group[arm]] = True
        self.deepest_played = max(self.deepest_played, self.depth[arm])

    def _fit(self, arm: int, accepted: Sequence[float], batch_size: int, step: int, own: float) -> bool:
        """Change test and one Fisher-scoring step of the shared model; True on an alarm."""
        model = self.acceptance
        sum_w, sum_wr, trials, hits, expected = model.score_positions(arm, accepted, batch_size, step, own)
        changed = self.detector.observe(step, model.own_trials[arm][1] * own, trials, hits, expected)
        if changed:
            model.forget(self.keep_on_change)
        model.grow_level_variance(step)
        if not sum_w <= 0.0:
            model.fit_level(arm, sum_w, sum_wr)
        return changed
