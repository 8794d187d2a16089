"""Acceptance model of the cost policy: one model shared by every arm and bucket, corrected by each arm's counts.

Rule. The probability that a request which accepted ``j-1`` draft tokens of arm ``a`` accepts the ``j``-th is
``alpha_aj = 1 - (1 - c_j)**E_a`` (``c_j`` one candidate's acceptance at depth ``j``, ``E_a`` the arm's effective
independent candidates per level), additive on the complementary log-log scale:
``cloglog(alpha_aj) = level + depth_offset[j] + width_offset[group(a)]``.

* ``level`` (one scalar, the drafter/target agreement) is tracked fast: its variance grows by ``1/gamma`` per step.
  ``width_offset`` is shared by arms with equal ``min(topk, (num_verify - 1) / num_steps)`` (prior mean
  ``offset_mean * log(width)``); ``depth_offset`` (depth 1 = 0) is the depth profile. Offsets are never forgotten.
* Fitted online by Fisher scoring of the binomial likelihood of ``accepted_per_position``: the precision-weighted
  mean of the positions' Newton steps updates ``(level, width_offset)`` by a Kalman step with their full
  covariance; ``r_j - r_1`` updates ``depth_offset[j]``.
* Each arm's own discounted per-position counts and the model are combined by precision: the model weighs
  ``k_j = 1 / ((model_sd^2 + Var(level)) I_j)`` step-units, ``I_j = e^2 q / p`` (``e = exp(eta)``, ``q = 1 - p``).
* ``tokens[a] = 1 + sum_i prod_{j<=i} alpha_aj`` with the arm's width offset raised by ``ucb`` standard deviations
  (its conditional sd given the level plus :data:`UNPLAYED_DRIFT` per step since the arm was played, capped at
  the prior): the optimistic expected tokens per request per step that the choice uses.

docs/RUNTIME.md has the derivation and the measurements behind the constants.
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

from ..strategy import Strategy

# Variance (cloglog^2) per step since an arm was last played added to its optimism: a mis-ranked near-tie is
# re-tried after ~(sd / ucb)^2 / UNPLAYED_DRIFT steps rather than never.
UNPLAYED_DRIFT = 1e-4
# Prior variance of the level (cloglog^2); also its cap while it grows, and what an alarm resets it to.
LEVEL_PRIOR_VAR = 1.0
# The model's weight against an arm's own counts is capped (in step-units).
MAX_MODEL_WEIGHT = 1000.0
# The cloglog range a position's acceptance is predicted and scored in (alpha from 0.0067 to ~1): below it
# 1 - exp(-e) rounds to 0, and a prediction of 0 over an unreached position (no own trials) is 0 / 0.
ETA_MIN, ETA_MAX = -5.0, 3.0
# The level's range: past it no offset (each within +-3) brings a position back into [ETA_MIN, ETA_MAX], and a level
# that drifted on (a drafter that accepts nothing for thousands of steps) would take as many to come back.
LEVEL_MIN, LEVEL_MAX = ETA_MIN - 6.0, ETA_MAX + 6.0


def cloglog(p: float) -> float:
    """``log(-log(1 - p))`` for ``p`` in (0, 1)."""
    return math.log(-math.log(1.0 - p))


def candidates_per_level(s: Strategy) -> float:
    """``min(topk, (num_verify - 1) / num_steps)`` (at least 1), rounded: arms with equal values share an offset."""
    return round(min(s.topk, max(1.0, (s.num_verify - 1) / s.num_steps)), 6)


class SharedAcceptanceModel:
    """The shared cloglog model, each arm's own counts and the optimistic expected tokens (module docstring).

    Args:
        arms: the selector's arms (index = arm); plain decoding has depth 0 and group -1.
        window: memory in steps; ``gamma = 1 - 1 / window`` discounts the counts and grows the level's variance.
        prior_accept: single-candidate acceptance before any observation, in (0, 1).
        model_sd: the model's misfit for one arm (cloglog sd, > 0).
        offset_prior: prior sd of the width and depth offsets (> 0).
        offset_mean: prior mean of a width offset, in multiples of ``log(width)``.
        ucb: optimism of ``tokens``, in standard deviations of the arm's width offset (>= 0).

    Attributes:
        tokens[a]: optimistic expected tokens per request per step of arm ``a`` (what the choice uses).
        level, width_offset[g], depth_offset[j]: the model; group[a]: arm ``a``'s width group (-1: plain).
    """

    def __init__(self, arms: Sequence[Strategy], window: int, prior_accept: float, model_sd: float,
                 offset_prior: float, offset_mean: float, ucb: float):
        num_arms = len(arms)
        self.window = window
        self.gamma = 1.0 - 1.0 / window
        self.ucb = ucb
        self.misfit_var = model_sd ** 2
        self.offset_var_prior = offset_prior ** 2
        self.depth = [s.num_steps for s in arms]
        depths = max(self.depth) + 1
        # Each arm's own discounted sums over steps of per-request fractions: own_accepts[j] = P(reach j),
        # own_trials[j] = P(reach j-1); t_arm[a] = the step they were last updated.
        self.own_accepts = [[0.0] * depths for _ in range(num_arms)]
        self.own_trials = [[0.0] * depths for _ in range(num_arms)]
        self.t_arm = [0] * num_arms
        self.level, self.t_level = cloglog(prior_accept), 0
        self.depth_offset = [0.0] * depths
        self.depth_offset_var = [0.0, 0.0] + [self.offset_var_prior] * (depths - 2)  # depth 1 anchors the level
        widths = sorted({candidates_per_level(s) for s in arms if not s.is_off})
        self.group = [widths.index(candidates_per_level(s)) if not s.is_off else -1 for s in arms]
        self.width_offset = [offset_mean * math.log(w) for w in widths]
        # Covariance of (level, width_offset[0..G-1]).
        self.cov = [[0.0] * (len(widths) + 1) for _ in range(len(widths) + 1)]
        self.cov[0][0] = LEVEL_PRIOR_VAR
        for g in range(len(widths)):
            self.cov[g + 1][g + 1] = self.offset_var_prior
        self.tokens = [1.0] * num_arms
        self.observed_tokens: List[Optional[float]] = [None] * num_arms  # used when accepted counts are not given
        self.refresh_all(0)

    def model_variance(self, step: int) -> float:
        """Variance (cloglog^2) of the model's prediction for an arm: the misfit plus the level's current variance
        (grown since the level was last fitted, capped at its prior)."""
        v = self.cov[0][0] / self.gamma ** (step - self.t_level)
        return self.misfit_var + (v if v < LEVEL_PRIOR_VAR else LEVEL_PRIOR_VAR)

    def own_weight(self, a: int, step: int) -> float:
        """Discount of arm ``a``'s own counts: ``gamma`` per step since they were updated."""
        return self.gamma ** (step - self.t_arm[a])

    def alphas(self, a: int, step: int, up: float = 0.0) -> List[float]:
        """Per-position acceptance of arm ``a`` (``[num_steps]`` floats; the readable form of :meth:`refresh`): its
        own counts and the model (width offset raised by ``up``; level as of the last :meth:`refresh_all`)
        combined by precision."""
        own = self.own_weight(a, step)
        accepts, trials, var = self.own_accepts[a], self.own_trials[a], self.model_variance(step)
        width_factor = math.exp(self.width_offset[self.group[a]] + up)
        out = []
        for j in range(1, self.depth[a] + 1):
            e = self._hazard[j] * width_factor  # exp(level + depth_offset[j]) as of the last full refresh
            q = math.exp(-e)
            p = 1.0 - q
            k = min(p / (var * e * e * q + 1e-12), MAX_MODEL_WEIGHT)  # the model's weight, 1 / (sd^2 I)
            out.append((own * accepts[j] + k * p) / (own * trials[j] + k))
        return out

    def refresh_all(self, step: int) -> None:
        """Recompute every arm's ``tokens`` at the current level."""
        level = self.level
        self._hazard = [math.exp(min(max(level + d, ETA_MIN), ETA_MAX)) for d in self.depth_offset]  # exp(eta)
        self.level_refreshed = level
        # What every arm's refresh shares, computed once: the model's variance and Var(width_offset[g] | level).
        var, cov = self.model_variance(step), self.cov
        c00, c0 = cov[0][0], cov[0]
        conditional_var = [cov[i][i] - c0[i] * c0[i] / c00 for i in range(1, len(cov))]
        for a in range(len(self.tokens)):
            self.refresh(a, step, var, conditional_var)

    def refresh(self, a: int, step: int, var: Optional[float] = None,
                conditional_var: Optional[List[float]] = None) -> None:
        """Recompute ``tokens[a]`` on the hazards of the last :meth:`refresh_all`. ``var`` (:meth:`model_variance`)
        and ``conditional_var`` (``Var(width_offset[g] | level)`` per group) may be passed when shared."""
        d = self.depth[a]
        if d == 0:
            return
        if self.observed_tokens[a] is not None:
            self.tokens[a] = self.observed_tokens[a]
            return
        i = self.group[a] + 1
        dt = step - self.t_arm[a]
        up = 0.0
        if self.ucb:
            if conditional_var is None:
                cov = self.cov
                offset_var = cov[i][i] - cov[0][i] * cov[0][i] / cov[0][0]
            else:
                offset_var = conditional_var[i - 1]
            offset_var = offset_var if offset_var > 0.0 else 0.0
            up = self.ucb * math.sqrt(min(offset_var + UNPLAYED_DRIFT * dt, self.offset_var_prior))
        own = self.gamma ** dt
        if var is None:
            var = self.model_variance(step)
        self.tokens[a] = self._expected_tokens(a, d, own, var, math.exp(self.width_offset[i - 1] + up))

    def _expected_tokens(self, a: int, d: int, own: float, var: float, width_factor: float) -> float:
        accepts, trials, hazard, exp = self.own_accepts[a], self.own_trials[a], self._hazard, math.exp
        reach = total = 1.0
        for j in range(1, d + 1):
            e = hazard[j] * width_factor
            q = exp(-e)
            p = 1.0 - q
            k = p / (var * e * e * q + 1e-12)
            if k > MAX_MODEL_WEIGHT:
                k = MAX_MODEL_WEIGHT
            reach *= (own * accepts[j] + k * p) / (own * trials[j] + k)
            total += reach
        return total

    def score_positions(self, arm: int, accepted: Sequence[float], batch_size: int, step: int,
                        own: float) -> Tuple[float, float, float, float, float]:
        """One pass over the played arm's positions: the Fisher-scoring statistics of the shared model and the
        depth-offset updates, and the change detector's inputs.

        Position ``j`` is ``n`` trials (requests that reached ``j-1``) with ``k`` successes; with ``e = exp(eta)``,
        ``p = 1 - exp(-e)``, the Newton step in ``eta`` is ``r_j = (k - n p) / (n e (1-p))``, precision
        ``w_j = n e^2 (1-p) / p``. ``own`` is the arm's own-count discount at this step.

        Returns ``(sum_w, sum_wr, trials, hits, expected)``: the precisions' sum and the precision-weighted sum of
        the Newton steps (for :meth:`fit_level`), the draft tokens tried, accepted, and predicted accepted by the
        arm's own prediction (model and own counts by precision).
        """
        depth_offset, depth_var = self.depth_offset, self.depth_offset_var
        accepts, trials, var = self.own_accepts[arm], self.own_trials[arm], self.model_variance(step)
        base = self.level + self.width_offset[self.group[arm]]
        exp = math.exp
        sum_w = sum_wr = r1 = w1 = 0.0
        tried = hits = expected = 0.0
        prev = float(batch_size)
        j = 0
        for k in accepted:
            j += 1
            n = prev
            prev = k = float(k)
            if n <= 0.0:
                break
            eta = base + depth_offset[j]
            eta = ETA_MIN if eta < ETA_MIN else (ETA_MAX if eta > ETA_MAX else eta)
            e = exp(eta)
            q = exp(-e)
            if q < 1e-6:
                q = 1e-6
            p = 1.0 - q
            model_weight = p / (var * e * e * q)
            if model_weight > MAX_MODEL_WEIGHT:
                model_weight = MAX_MODEL_WEIGHT
            tried += n
            hits += k
            expected += n * (own * accepts[j] + model_weight * p) / (own * trials[j] + model_weight)
            r = (k - n * p) / (n * e * q)
            r = -2.0 if r < -2.0 else (2.0 if r > 2.0 else r)
            w = n * e * e * q / p
            sum_w += w
            sum_wr += w * r
            if j == 1:
                r1, w1 = r, w
            else:  # depth offsets: r_j - r_1 is what the level and the arm's offset do not explain
                vd = depth_var[j]
                vt = vd + 1.0 / w + 1.0 / w1
                x = depth_offset[j] + vd / vt * (r - r1)
                depth_offset[j] = -3.0 if x < -3.0 else (3.0 if x > 3.0 else x)
                depth_var[j] = vd - vd * vd / vt
        return sum_w, sum_wr, tried, hits, expected

    def grow_level_variance(self, step: int) -> None:
        """The level's variance grows by ``1/gamma`` per step since it was last fitted (capped at its prior)."""
        dt = step - self.t_level
        if dt:
            cov = self.cov
            cov[0][0] = min(cov[0][0] / self.gamma ** dt, LEVEL_PRIOR_VAR)
            self.t_level = step

    def fit_level(self, arm: int, sum_w: float, sum_wr: float) -> None:
        """Kalman update of ``(level, width_offset)`` by the mean Newton step ``sum_wr / sum_w`` observed through
        ``level + width_offset[group(arm)]`` with precision ``sum_w`` (> 0)."""
        rbar = sum_wr / sum_w
        cov, i = self.cov, 1 + self.group[arm]
        cov_h = [row[0] + row[i] for row in cov]
        gain_den = cov_h[0] + cov_h[i] + 1.0 / sum_w
        gain = [v / gain_den for v in cov_h]
        self.level = min(max(self.level + gain[0] * rbar, LEVEL_MIN), LEVEL_MAX)
        offsets = self.width_offset
        for c in range(len(offsets)):
            x = offsets[c] + gain[c + 1] * rbar
            offsets[c] = -3.0 if x < -3.0 else (3.0 if x > 3.0 else x)
        for r, kr in enumerate(gain):
            cov[r] = [x - kr * ch for x, ch in zip(cov[r], cov_h)]

    def add_own_counts(self, arm: int, accepted: Sequence[float], batch_size: int, step: int, own: float) -> None:
        """Discount arm ``arm``'s own counts by ``own`` and add this step's per-request fractions."""
        accepts, trials = self.own_accepts[arm], self.own_trials[arm]
        inv_b = 1.0 / batch_size
        prev = 1.0
        for j in range(1, self.depth[arm] + 1):
            r = accepted[j - 1] * inv_b
            accepts[j] = accepts[j] * own + r
            trials[j] = trials[j] * own + prev
            prev = r
        self.t_arm[arm] = step

    def add_observed_tokens(self, arm: int, tokens_per_request: float, step: int) -> None:
        """Without accepted counts: ``tokens[arm]`` is the discounted mean of observed tokens per request."""
        self.t_arm[arm] = step
        o = self.observed_tokens[arm]
        w = self.window
        self.observed_tokens[arm] = self.tokens[arm] = (
            tokens_per_request if o is None else (1 - 1 / w) * o + tokens_per_request / w)

    def reset_level(self, prior_accept: float) -> None:
        """The level back to its prior, ``cloglog(prior_accept)``, its variance at least the prior's (as
        :meth:`forget` leaves it); the offsets and their covariance with the level are kept. Call
        :meth:`refresh_all` before the next choice."""
        self.level = cloglog(prior_accept)
        self.cov[0][0] = max(self.cov[0][0], LEVEL_PRIOR_VAR)

    def forget(self, keep: float) -> None:
        """After a detected change: keep a fraction ``keep`` of the arms' own counts, reset the level's variance to
        its prior and drop observed-token fallbacks; the offsets (how arms differ) are kept."""
        for rows in (self.own_accepts, self.own_trials):
            for r in rows:
                for j in range(len(r)):
                    r[j] *= keep
        self.cov[0][0] = max(self.cov[0][0], LEVEL_PRIOR_VAR)
        self.observed_tokens = [None] * len(self.tokens)
