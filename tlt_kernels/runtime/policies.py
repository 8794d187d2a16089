"""Bandit policies behind :class:`~tlt_kernels.runtime.selector.StrategySelector`.

Every policy sees arms as indices into the selector's strategy list and keeps its statistics per
batch-size bucket (a batch of 4 and a batch of 256 have different best arms). The reward is the
step's throughput, ``emitted_tokens / elapsed_s``. Policies draw randomness only from the
``random.Random`` they are bound to, so equal seeds and equal observations give equal decisions.

* :class:`BucketedEpsilonGreedy` (``"beg"``) -- TLT's tuner: a bucket maps to a verify-width group of
  arms; epsilon-greedy over sliding-window medians of throughput.
* :class:`SlidingWindowUCB` (``"ucb"``) -- UCB over the last ``window`` plays of the bucket.
* :class:`DiscountedThompson` (``"thompson"``) -- Gaussian Thompson sampling with discounted statistics.
* :class:`CostModelPolicy` (``"cost"``) -- predicted throughput = expected emitted tokens (from per-position
  acceptance learned online and shared across buckets) / step time (a table measured at start-up,
  corrected online per bucket).
"""
from __future__ import annotations

import bisect
import math
import numbers
import random
from collections import deque
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from .strategy import Strategy


class Policy:
    """Interface. ``bind`` is called once by the selector; ``choose``/``observe`` then per step."""

    name = "policy"

    def bind(self, arms: Sequence[Strategy], num_buckets: int, rng: random.Random, window: int) -> None:
        self.arms = list(arms)
        self.num_buckets = num_buckets
        self.rng = rng
        self.window = window

    def choose(self, bucket: int, batch_size: int, allowed: List[int], step: int) -> int:
        raise NotImplementedError

    def observe(self, bucket: int, arm: int, batch_size: int, emitted: float, elapsed: float,
                accepted: Optional[Sequence[float]], step: int) -> None:
        raise NotImplementedError


# Rewards (tokens/s) are capped so that squares and discounted sums of them stay finite floats: a legal but
# extreme step (a 1e-300 s timing) must not overflow a policy's statistics. Real throughputs are far below it.
MAX_REWARD = 1e100
# Floor of a time ratio: a positive time must not underflow to 0.0 and divide by zero later.
_TINY = 1e-300


def _reward(emitted: float, elapsed: float) -> float:
    r = emitted / elapsed
    return r if r < MAX_REWARD else MAX_REWARD


def _first_unseen(counts: List[float], allowed: List[int]) -> int:
    for a in allowed:
        if counts[a] == 0:
            return a
    return -1


class BucketedEpsilonGreedy(Policy):
    """TLT's adaptive tuner: per bucket, epsilon-greedy over sliding-window medians of throughput.

    Args:
        epsilon: exploration probability.
        groups: optional ``{max_batch_size: [strategies]}``: a bucket whose sizes are <= the smallest
            key >= them may only use that verify-width group (TLT's batch-size -> draft-token table).
            Plain decoding is always in every group. ``None``: every arm in every bucket.
    """

    name = "beg"

    def __init__(self, epsilon: float = 0.1, groups: Optional[Dict[int, Sequence[Strategy]]] = None):
        if not 0.0 <= epsilon <= 1.0:
            raise ValueError(f"epsilon must be in [0, 1], got {epsilon}")
        self.epsilon = epsilon
        self.groups = groups

    def bind(self, arms, num_buckets, rng, window):
        super().bind(arms, num_buckets, rng, window)
        A = len(arms)
        self.hist = [[deque(maxlen=window) for _ in range(A)] for _ in range(num_buckets)]
        self.med = [[0.0] * A for _ in range(num_buckets)]
        self.n = [[0] * A for _ in range(num_buckets)]
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
        a = _first_unseen(self.n[bucket], allowed)
        if a >= 0:
            return a
        if self.rng.random() < self.epsilon:
            return allowed[self.rng.randrange(len(allowed))]
        med = self.med[bucket]
        return max(allowed, key=med.__getitem__)

    def observe(self, bucket, arm, batch_size, emitted, elapsed, accepted, step):
        h = self.hist[bucket][arm]
        h.append(_reward(emitted, elapsed))
        self.n[bucket][arm] += 1
        s = sorted(h)
        m = len(s)
        self.med[bucket][arm] = s[m // 2] if m % 2 else 0.5 * (s[m // 2 - 1] + s[m // 2])


class SlidingWindowUCB(Policy):
    """SW-UCB (Garivier & Moulines 2011): means and counts over the bucket's last ``window`` plays.

    Rewards are normalized by the best windowed mean of the bucket so ``c`` is scale-free.
    """

    name = "ucb"

    def __init__(self, c: float = 0.3):
        if not (isinstance(c, (int, float)) and math.isfinite(c) and c >= 0):
            raise ValueError(f"c must be a finite number >= 0 (the exploration bonus scale), got {c!r}")
        self.c = c

    def bind(self, arms, num_buckets, rng, window):
        super().bind(arms, num_buckets, rng, window)
        A = len(arms)
        self.plays = [deque() for _ in range(num_buckets)]
        self.cnt = [[0] * A for _ in range(num_buckets)]
        self.sum = [[0.0] * A for _ in range(num_buckets)]
        self.t = [0] * num_buckets

    def choose(self, bucket, batch_size, allowed, step):
        cnt, sm = self.cnt[bucket], self.sum[bucket]
        a = _first_unseen(cnt, allowed)
        if a >= 0:
            return a
        best_mean = max(sm[a] / cnt[a] for a in allowed)
        log_t = math.log(min(self.t[bucket], self.window) + 1)
        c = self.c * best_mean
        return max(allowed, key=lambda a: sm[a] / cnt[a] + c * math.sqrt(log_t / cnt[a]))

    def observe(self, bucket, arm, batch_size, emitted, elapsed, accepted, step):
        r = _reward(emitted, elapsed)
        q = self.plays[bucket]
        q.append((arm, r))
        self.cnt[bucket][arm] += 1
        self.sum[bucket][arm] += r
        self.t[bucket] += 1
        if len(q) > self.window:
            old, r_old = q.popleft()
            cnt, sm = self.cnt[bucket], self.sum[bucket]
            cnt[old] -= 1
            if 2.0 * r_old < sm[old]:
                sm[old] -= r_old
            else:  # the leaving reward dominates the sum: subtracting it would cancel the others' bits
                sm[old] = math.fsum(x for a, x in q if a == old)


class DiscountedThompson(Policy):
    """Gaussian Thompson sampling; statistics decay by ``gamma = 1 - 1/window`` per play of the bucket."""

    name = "thompson"

    def __init__(self, min_rel_std: float = 0.02):
        if not (isinstance(min_rel_std, (int, float)) and math.isfinite(min_rel_std) and min_rel_std >= 0):
            raise ValueError(f"min_rel_std must be a finite number >= 0 (a fraction of the mean), got {min_rel_std!r}")
        self.min_rel_std = min_rel_std

    def bind(self, arms, num_buckets, rng, window):
        super().bind(arms, num_buckets, rng, window)
        A = len(arms)
        self.gamma = 1.0 - 1.0 / window
        self.n = [[0.0] * A for _ in range(num_buckets)]
        self.s = [[0.0] * A for _ in range(num_buckets)]
        self.ss = [[0.0] * A for _ in range(num_buckets)]
        self.last = [[0] * A for _ in range(num_buckets)]
        self.t = [0] * num_buckets

    def choose(self, bucket, batch_size, allowed, step):
        n = self.n[bucket]
        a = _first_unseen(n, allowed)
        if a >= 0:
            return a
        t, last, g = self.t[bucket], self.last[bucket], self.gamma
        s, ss = self.s[bucket], self.ss[bucket]
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

    def observe(self, bucket, arm, batch_size, emitted, elapsed, accepted, step):
        r = _reward(emitted, elapsed)
        self.t[bucket] += 1
        t = self.t[bucket]
        f = self.gamma ** (t - self.last[bucket][arm])
        self.last[bucket][arm] = t
        self.n[bucket][arm] = self.n[bucket][arm] * f + 1.0
        self.s[bucket][arm] = self.s[bucket][arm] * f + r
        self.ss[bucket][arm] = self.ss[bucket][arm] * f + r * r


def _cost_point(s: Strategy, point) -> Tuple[int, float]:
    """One ``(batch_size, seconds)`` entry of a cost table, validated: a NaN, infinite, zero or negative time or a
    batch size that is not an int >= 1 would poison every prediction made from it."""
    try:
        b, t = point
    except (TypeError, ValueError):
        raise ValueError(f"cost table entry {point!r} for {s} must be a (batch_size, seconds) pair") from None
    if isinstance(b, bool) or not isinstance(b, numbers.Integral) or b < 1:
        raise ValueError(f"cost table entry ({b!r}, {t!r}) for {s}: batch_size must be an int >= 1, got {b!r}")
    try:
        secs = float(t)
    except (TypeError, ValueError):
        secs = math.nan
    if not (math.isfinite(secs) and secs > 0):
        raise ValueError(f"cost table entry ({b!r}, {t!r}) for {s}: the step time must be a finite number of seconds "
                         f"> 0, got {t!r}")
    return int(b), secs


class CostTable:
    """Step time per (strategy, batch size), measured at start-up; linear interpolation in batch size.

    ``table[strategy] = [(batch_size, seconds), ...]``. Outside the measured range the nearest
    measured point is scaled linearly in batch size beyond the largest, held below the smallest.
    """

    def __init__(self, table: Dict[Strategy, Sequence[Tuple[int, float]]]):
        if not isinstance(table, Mapping):
            raise TypeError(f"cost table must be a {{Strategy: [(batch_size, seconds), ...]}} dict, got {type(table).__name__}")
        self.table = {}
        for s, pts in table.items():
            if not isinstance(s, Strategy):
                raise TypeError(f"cost table keys must be Strategy objects, got {type(s).__name__}: {s!r}")
            pts = sorted(_cost_point(s, p) for p in pts)
            if not pts:
                raise ValueError(f"cost table for {s} has no points")
            for (b0, t0), (b1, t1) in zip(pts, pts[1:]):
                if b0 == b1:
                    raise ValueError(f"cost table for {s} has two times for batch_size={b0} ({t0} and {t1} s); keep one")
            self.table[s] = ([b for b, _ in pts], [t for _, t in pts])

    @classmethod
    def measure(cls, step_fn: Callable[[Strategy, int], float], strategies: Sequence[Strategy],
                batch_sizes: Sequence[int], repeats: int = 5) -> "CostTable":
        """Build the table from ``step_fn(strategy, batch_size) -> seconds`` (median of ``repeats``).

        On the GPU ``step_fn`` would replay the captured graph between two CUDA events; in the simulator
        it returns a noisy draw of the workload's step cost.
        """
        tab = {}
        for s in strategies:
            pts = []
            for b in batch_sizes:
                ts = sorted(step_fn(s, b) for _ in range(repeats))
                pts.append((b, ts[len(ts) // 2]))
            tab[s] = pts
        return cls(tab)

    def __contains__(self, s: Strategy) -> bool:
        return s in self.table

    def predict(self, strategy: Strategy, batch_size: int) -> Optional[float]:
        entry = self.table.get(strategy)
        if entry is None:
            return None
        bs, ts = entry
        i = bisect.bisect_left(bs, batch_size)
        if i < len(bs) and bs[i] == batch_size:
            return ts[i]
        if i == 0:
            return ts[0]
        if i == len(bs):
            return ts[-1] * batch_size / bs[-1]
        b0, b1, t0, t1 = bs[i - 1], bs[i], ts[i - 1], ts[i]
        return t0 + (t1 - t0) * (batch_size - b0) / (b1 - b0)


def _cloglog(p: float) -> float:
    return math.log(-math.log(1.0 - p))


class CostModelPolicy(Policy):
    """Pick the arm maximizing ``B * E[tokens per request] / predicted step time``.

    * Acceptance: one model shared by every arm and every bucket (acceptance does not depend on batch
      size). The probability that a request which accepted ``j-1`` draft tokens of arm ``a`` also
      accepts the ``j``-th is ``alpha_aj = 1 - (1 - c_j)**E_a``: ``c_j`` is the acceptance of one
      candidate at depth ``j`` and ``E_a`` the arm's effective number of independent candidates per
      level (a tree fails at a level only when every candidate does). On the complementary log-log
      scale this is additive, ``cloglog(alpha_aj) = lvl + dep[j] + off[g(a)]``: ``lvl`` is one scalar
      tracked fast (memory ~``window`` steps); the depth offsets and the width offsets (one per group of
      arms with equal ``min(topk, (num_verify - 1) / num_steps)``, e.g. every chain) are kept (or
      forgotten over ``slow * window`` steps). A phase change seen through the played arm moves ``lvl``,
      and with it every other arm's prediction. Fitted online by Fisher scoring of the binomial
      likelihood of ``accepted_per_position`` (:meth:`observe`).
      ``E[tokens] = 1 + sum_i prod_{j<=i} alpha_j``.
    * Each arm's own discounted per-position counts correct the model where it is misspecified
      (:meth:`_alphas`), combined by precision: the model counts as
      ``k_j = 1 / ((model_sd^2 + Var(lvl)) * I_j)`` units, ``I_j = e^2 q / p`` the Fisher information on
      the cloglog scale (``e = exp(eta)``, ``q = 1 - p``), against the arm's counts, in which each step's
      per-request fractions weigh one unit (at most ~``window``). With ``model_sd = 0.1`` the model
      carries the prediction, so an arm played through a low-acceptance phase follows the level up at
      once instead of waiting ~100 steps for its stale counts to fade (the old fixed weight of one unit
      did). ``Var(lvl)`` (:meth:`_model_var`) grows while no speculative arm is played and is reset by an
      alarm, so a model that lost track of the level yields to the counts. Optionally (``follow > 0``)
      the counts are also discounted by how far the model's ``lvl + off`` moved since they were
      collected, ``n -> n / (1 + follow * n * d^2)`` (measured no better; off by default).
    * Step time: ``cost_table.predict(strategy, B)`` times a per-(bucket, arm) correction (discounted mean
      of observed / predicted); without a table, the discounted mean observed time of the (bucket, arm),
      exploring unobserved arms once.
    * Exploration: a never-played speculative arm is played once, the one with the best predicted throughput
      first (each play moves the shared level, so the arms tried later start from a better prediction; on the
      H200 engine trace this order, against the arms' list order, took the cost policy from .970 to .973 of
      the per-batch-size oracle), if it is the first of its width group or deeper than every arm played so
      far (``explore_per_group``), or if it predicts within ``explore_margin`` of the best arm (a near-tie
      that only its own counts can settle): an arm whose group offset and depth offsets are already
      measured adds little to the model by a forced play, so it competes on its optimistic prediction
      instead (forcing every arm cost the H200 traces 1-4% at B=128-256, where a deep tree's step is twice a
      chain's). After that the choice uses optimistic tokens,
      the arm's width offset raised by ``ucb`` standard deviations: the offset's conditional sd given the
      level plus a random walk of ``drift`` per step since the arm was last played (capped at the prior),
      so a mis-ranked arm is re-tried after ~``(sd / ucb)^2 / drift`` steps rather than never.
      ``explore`` adds the older relative bonus ``explore / sqrt(1 + n_eff)`` (off by default).
    * Change detection: a Bernoulli CUSUM compares the played arm's accepted draft tokens with its own
      prediction; on an alarm the arms' own counts are scaled by ``keep_on_change`` and the level's
      variance is reset to its prior (:meth:`_forget`), so the next observations move the level at once.
      Once the level rests on ``min_support`` steps, an arm with fewer than ``min_trials`` steps of its
      own in memory is not tested: its prediction is the shared model's, so its surprise is the model's
      misfit for that arm (e.g. tree offsets learned at B=128 do not hold for the requests left at
      B=64), which an alarm would turn into a level shift of every arm. Steps of alarms: ``self.changes``.

    Per step, ``choose`` is one pass over the allowed arms on cached tables (no allocation) and
    ``observe`` one pass over the played arm's positions that does the CUSUM, the Fisher scoring and
    the depth offsets together; other arms' optimistic tokens are recomputed only when the level moved by
    more than ``refresh_tol`` (or on an alarm).

    Args:
        cost_table: a :class:`CostTable`, a ``{strategy: [(B, s), ...]}`` dict, or None.
        prior_accept: single-candidate acceptance assumed before any observation.
        model_sd: how far (cloglog sd) the shared model may be from an arm's true acceptance; sets the
            model's weight against the arm's own counts (smaller: trust the model more). Replaces the
            former fixed ``prior_weight``.
        explore: relative optimism bonus scale (0 disables it; ``ucb`` explores).
        detect: CUSUM alarm threshold in nats (None disables change detection).
        detect_shift: change of acceptance (absolute) the CUSUM is tuned to detect, or a tuple of them: one
            pair of one-sided sums per shift (a CUSUM bank). The small shift catches small changes; the
            large one alarms several times sooner on large ones (at batch 1 a step tries only a few
            draft tokens, so a 0.1-tuned sum needs ~50 steps to reach ``detect`` after a 0.45 -> 0.9 jump).
        min_trials: the test skips an arm with fewer than this many (discounted) steps of its own in
            memory, once the level rests on ``min_support`` steps (0: always test). Such an arm's prediction
            is the shared model's, so its surprise says the model misfits this arm, not that acceptance
            changed over time; an alarm would reset the level's variance and one arm's misfit would move
            every arm (on the H200 engine trace, s5k4v16's second play at B=64, 14 steps after its first
            at B=128, alarmed, the level fell 0.7 cloglog and the well-measured s4k1v5 dropped below the
            deep trees: .956 of the per-batch-size oracle without the skip, .970 with these defaults).
            The surprise still updates the model by its Kalman gain.
        min_support: discounted speculative steps observed since the last alarm (or the start) below
            which ``min_trials`` does not apply: early on the level itself rests on the prior, and alarms
            on first plays are what corrects a wrong ``prior_accept`` (skipping them from the start,
            ``min_support=0``, gave the trace .979 but cost the simulated 600-step long tail .988 ->
            .973 over seeds 0-7; 6-8 keep every simulated workload where it was; see
            ``bench/selector_trace_sweep.py``).
        keep_on_change: fraction of the arms' own acceptance counts kept after an alarm.
        slow: memory of the width and depth offsets, in windows (None: kept; measured better, since
            how arms differ does not change when the drafter does).
        offset_prior: prior standard deviation of the width and depth offsets (cloglog scale).
        ucb: optimism of the choice, in standard deviations of the arm's offset (0: greedy).
        offset_mean: prior mean of a width group's offset, ``offset_mean * log(width)`` (1: ``width``
            independent candidates, the optimistic bound; 0: every arm starts as a chain).
        follow: weight of the model's movement in discounting an arm's own counts (0, the default: time
            decay only).
        level_in_weight: count the level's current variance in the model's weight (see above).
        drift: variance per step (cloglog^2) added to an unplayed arm's optimism (0: none).
        explore_per_group: force a first play only of an arm that brings the model a new width group or a new
            depth, or is a near-tie (``explore_margin``); False: of every arm. On the three H200 traces
            .973/.957/.949 -> .977/.970/.963 of the per-batch-size oracle, every simulated workload within
            0.0003 of its former mean or better (``bench/selector_trace_sweep.py``; RESULTS.md 2026-11-26).
        explore_margin: the near-tie margin (fraction of the best prediction). 0 lost the simulated drafter
            warm-up .994 -> .986 (the shared model misfits an arm by a few %); 0.1 lost it to .974.
        refresh_tol: how far (cloglog) the level may move before every arm's prediction is recomputed;
            in between only the played arm's is (0: every step). The CPU cost's main knob: 0.05 against
            0.03 saved ~1 us per step on the drifting stream with every simulated workload and the H200
            trace as good or better (0.08 lost up to 1% on drafter warm-up; bench/selector_trace_sweep.py).
    """

    name = "cost"

    def __init__(self, cost_table=None, prior_accept: float = 0.7, model_sd: float = 0.1,
                 explore: float = 0.0, detect: Optional[float] = 8.0, detect_shift=(0.1, 0.3),
                 min_trials: float = 1.0, min_support: float = 8.0, keep_on_change: float = 0.5, slow: Optional[float] = None,
                 offset_prior: float = 0.5, ucb: float = 1.0, offset_mean: float = 1.0,
                 follow: float = 0.0, drift: float = 1e-4, level_in_weight: bool = True,
                 refresh_tol: float = 0.05, explore_per_group: bool = True,
                 explore_margin: float = 0.05):
        if cost_table is not None and not isinstance(cost_table, CostTable):
            cost_table = CostTable(cost_table)
        if detect is not None and not detect > 0:
            raise ValueError(f"detect must be a positive CUSUM threshold or None, got {detect}")
        if not 0.0 <= keep_on_change <= 1.0:
            raise ValueError(f"keep_on_change must be in [0, 1], got {keep_on_change}")
        if not 0.0 < prior_accept < 1.0:
            raise ValueError(f"prior_accept must be in (0, 1), got {prior_accept}")
        if slow is not None and not slow >= 1.0:
            raise ValueError(f"slow must be >= 1 (windows) or None, got {slow}")
        if not (offset_prior > 0 and ucb >= 0 and explore >= 0):
            raise ValueError(f"offset_prior must be > 0 and ucb, explore >= 0; got {offset_prior}, {ucb}, {explore}")
        if not (model_sd > 0 and follow >= 0 and drift >= 0):
            raise ValueError(f"model_sd must be > 0 and follow, drift >= 0; got {model_sd}, {follow}, {drift}")
        if not min_trials >= 0:
            raise ValueError(f"min_trials must be >= 0 (discounted steps of the arm's own), got {min_trials}")
        if not min_support >= 0:
            raise ValueError(f"min_support must be >= 0 (discounted steps since the last alarm), got {min_support}")
        if not refresh_tol >= 0:
            raise ValueError(f"refresh_tol must be >= 0 (cloglog units), got {refresh_tol}")
        if not math.isfinite(offset_mean):
            raise ValueError(f"offset_mean must be a finite number (a multiple of log(width)), got {offset_mean!r}")
        if not 0.0 <= explore_margin <= 1.0:
            raise ValueError(f"explore_margin must be in [0, 1] (a fraction of the best prediction), got {explore_margin}")
        self.cost_table = cost_table
        self.prior_accept = prior_accept
        self.model_sd = model_sd
        self.explore = explore
        self.detect = detect
        shifts = tuple(detect_shift) if isinstance(detect_shift, (tuple, list)) else (detect_shift,)
        if not shifts or not all(0.0 < x < 1.0 for x in shifts):
            raise ValueError(f"detect_shift must be in (0, 1) (a float or a non-empty tuple), got {detect_shift!r}")
        self.detect_shift = shifts
        self.min_trials = min_trials
        self.min_support = min_support
        self.keep_on_change = keep_on_change
        self.slow = slow
        self.offset_prior = offset_prior
        self.ucb = ucb
        self.offset_mean = offset_mean
        self.follow = follow
        self.drift = drift
        self.level_in_weight = level_in_weight
        self.refresh_tol = refresh_tol
        self.explore_per_group = explore_per_group
        self.explore_margin = explore_margin

    def bind(self, arms, num_buckets, rng, window):
        super().bind(arms, num_buckets, rng, window)
        A = len(arms)
        self.gamma = 1.0 - 1.0 / window
        self.gamma_slow = 1.0 if self.slow is None else 1.0 - 1.0 / (window * self.slow)
        self._t2 = self.model_sd ** 2
        self.depth = [s.num_steps for s in arms]
        self.max_depth = max(self.depth)
        D = self.max_depth + 1
        # Each arm's own discounted sums over steps of per-request fractions: num[j] = P(reach j),
        # den[j] = P(reach j-1); eta_last[a] = the model's lvl + off for the arm when they were last updated.
        self.num = [[0.0] * D for _ in range(A)]
        self.den = [[0.0] * D for _ in range(A)]
        self.t_arm = [0] * A
        self.eta_last = [0.0] * A
        # Shared model: cloglog(alpha_aj) = lvl + dep[j] + off[a].
        self.var_prior = 1.0
        self.lvl, self.t_lvl = _cloglog(self.prior_accept), 0
        v0 = self.offset_prior ** 2
        self.dep = [0.0] * D
        self.var_dep = [0.0, 0.0] + [v0] * (D - 2)  # depth 1 anchors the level
        self.t_dep = [0] * D
        # Arms with the same candidates per level, min(topk, (num_verify - 1) / num_steps), share an
        # offset: e.g. every chain, whatever its depth.
        widths = sorted({self._width(s) for s in arms if not s.is_off})
        self.grp = [widths.index(self._width(s)) if not s.is_off else -1 for s in arms]
        G = len(widths)
        # Prior mean: w independent candidates, E = w (the optimistic bound; data pulls it down).
        self.off = [self.offset_mean * math.log(w) for w in widths]
        self._v0 = v0
        # Covariance of (lvl, off_0..off_{G-1}).
        self.P = [[0.0] * (G + 1) for _ in range(G + 1)]
        self.P[0][0] = self.var_prior
        for g in range(G):
            self.P[g + 1][g + 1] = v0
        self.tokens = [1.0] * A  # expected tokens per request per step used by the choice (optimistic)
        self.obs_tokens = [None] * A  # fallback when accepted_per_position is not given
        self.time_n = [[0.0] * A for _ in range(num_buckets)]
        self.time_v = [[0.0] * A for _ in range(num_buckets)]  # correction ratio, or seconds without table
        self.grp_played = [False] * G
        self.depth_played = 0
        self.n_arm = [0.0] * A  # discounted count of acceptance observations (at step t_arm)
        self.cusum = [0.0] * (2 * len(self.detect_shift))  # one-sided sums: (up, down) per shift
        self.support, self.t_support = 0.0, 0  # discounted speculative steps observed since the last alarm
        self.changes: List[int] = []  # steps at which a change in acceptance was detected
        self._rate: Dict[int, List[float]] = {}  # batch size -> [B / table seconds] per arm (0: no entry)
        self._secs: Dict[int, List[float]] = {}  # batch size -> [table seconds] per arm (0: no entry)
        self._refresh_all(0)

    @staticmethod
    def _width(s: Strategy) -> float:
        return round(min(s.topk, max(1.0, (s.num_verify - 1) / s.num_steps)), 6)

    def _tables(self, batch_size: int) -> List[float]:
        secs = [0.0] * len(self.arms)
        if self.cost_table is not None:
            for a, s in enumerate(self.arms):
                secs[a] = self.cost_table.predict(s, batch_size) or 0.0
        self._secs[batch_size] = secs
        rate = self._rate[batch_size] = [batch_size / t if t else 0.0 for t in secs]
        return rate

    def _model_var(self, step: int) -> float:
        """Variance (cloglog^2) of the model's prediction for an arm: its misfit ``model_sd^2`` plus the
        level's current variance (which grows while no speculative arm is played, and is reset by an
        alarm), so a model that has lost track of the level yields to the arms' own counts."""
        if not self.level_in_weight:
            return self._t2
        v = self.P[0][0] / self.gamma ** (step - self.t_lvl)
        return self._t2 + (v if v < self.var_prior else self.var_prior)

    def _own_weight(self, a: int, step: int) -> float:
        """Discount of arm ``a``'s own counts: time (``gamma`` per step) and the model's movement since."""
        fa = self.gamma ** (step - self.t_arm[a])
        d = self.lvl + self.off[self.grp[a]] - self.eta_last[a]
        return fa / (1.0 + self.follow * fa * self.den[a][1] * d * d)

    def _alphas(self, a: int, step: int, up: float = 0.0) -> List[float]:
        """Per-position acceptance of arm ``a`` (the readable form of what :meth:`_refresh` computes): its
        own counts and the shared model (offset raised by ``up``; level as of the last full refresh)
        combined by precision."""
        fs = self._own_weight(a, step)
        num, den, t2 = self.num[a], self.den[a], self._model_var(step)
        E = math.exp(self.off[self.grp[a]] + up)
        out = []
        for j in range(1, self.depth[a] + 1):
            e = self._haz[j] * E  # exp(lvl + dep[j]) as of the last full refresh
            q = math.exp(-e)
            p = 1.0 - q
            k = min(p / (t2 * e * e * q + 1e-12), 1000.0)  # the model's weight in requests, 1 / (sd^2 I)
            out.append((fs * num[j] + k * p) / (fs * den[j] + k))
        return out

    def _refresh_all(self, step: int) -> None:
        # exp(lvl + dep[j]): the single-candidate hazard per depth, shared by every arm's refresh.
        lvl = self.lvl
        self._haz = [math.exp(min(lvl + d, 3.0)) for d in self.dep]
        self._lvl_refreshed = lvl
        # What every arm's refresh shares, computed once: the model's variance and Var(off_g | lvl).
        t2, P = self._model_var(step), self.P
        p00, p0 = P[0][0], P[0]
        cv = [P[i][i] - p0[i] * p0[i] / p00 for i in range(1, len(P))]
        for a in range(len(self.arms)):
            self._refresh(a, step, t2, cv)

    def _refresh(self, a: int, step: int, t2: Optional[float] = None, cv: Optional[List[float]] = None) -> None:
        """Optimistic expected tokens of arm ``a`` (:meth:`_alphas` with the offset raised by ``ucb``
        standard deviations: ``Var(off | lvl) + drift * steps since played``, capped at the prior).
        ``t2`` (:meth:`_model_var`) and ``cv`` (``Var(off_g | lvl)`` per group) are passed by
        :meth:`_refresh_all`, which shares them across arms."""
        d = self.depth[a]
        if d == 0:
            return
        if self.obs_tokens[a] is not None:
            self.tokens[a] = self.obs_tokens[a]
            return
        i = self.grp[a] + 1
        dt = step - self.t_arm[a]
        u = 0.0
        if self.ucb:
            if cv is None:
                P = self.P
                var = P[i][i] - P[0][i] * P[0][i] / P[0][0]
            else:
                var = cv[i - 1]
            u = self.ucb * math.sqrt(min((var if var > 0.0 else 0.0) + self.drift * dt, self._v0))
        fa = self.gamma ** dt
        num, den, haz = self.num[a], self.den[a], self._haz
        if t2 is None:
            t2 = self._model_var(step)
        if self.follow:
            dd = self.lvl + self.off[i - 1] - self.eta_last[a]
            fs = fa / (1.0 + self.follow * fa * den[1] * dd * dd)
        else:
            fs = fa
        E = math.exp(self.off[i - 1] + u)
        exp = math.exp
        reach = total = 1.0
        for j in range(1, d + 1):
            e = haz[j] * E
            q = exp(-e)
            p = 1.0 - q
            k = p / (t2 * e * e * q + 1e-12)
            if k > 1000.0:
                k = 1000.0
            reach *= (fs * num[j] + k * p) / (fs * den[j] + k)
            total += reach
        self.tokens[a] = total

    def _predict(self, bucket: int, a: int, batch_size: int) -> Optional[float]:
        """Predicted throughput (tokens/s), or None when the arm must be explored first (readable form of
        what :meth:`choose` computes)."""
        rate = self._rate.get(batch_size) or self._tables(batch_size)
        n, v = self.time_n[bucket][a], self.time_v[bucket][a]
        if not rate[a]:
            return batch_size * self.tokens[a] / v if n > 0 else None
        return rate[a] * self.tokens[a] / (v if n > 0 else 1.0)

    def choose(self, bucket, batch_size, allowed, step):
        rate = self._rate.get(batch_size) or self._tables(batch_size)
        tn, tv = self.time_n[bucket], self.time_v[bucket]
        tokens, n_arm, depth = self.tokens, self.n_arm, self.depth
        best, best_v = -1, -1.0
        new, new_v = -1, -1.0  # the never-played speculative arm with the best (prior) prediction
        near, near_v = -1, -1.0  # the best never-played arm whose first play is optional (explore_per_group)
        k = self.explore
        for a in allowed:
            r = rate[a]
            if r:
                v = r * tokens[a] / tv[a] if tn[a] > 0 else r * tokens[a]
            elif tn[a] > 0:
                v = batch_size * tokens[a] / tv[a]
            else:
                return a
            if depth[a] and n_arm[a] == 0.0:
                if not (self.explore_per_group and self.grp_played[self.grp[a]] and depth[a] <= self.depth_played):
                    if v > new_v:
                        new, new_v = a, v
                    continue
                if v > near_v:  # measured offsets only: forced later if a near-tie of the best
                    near, near_v = a, v
            if k and depth[a]:
                v *= 1.0 + k / math.sqrt(1.0 + n_arm[a] * self.gamma ** (step - self.t_arm[a]))
            if v > best_v:
                best, best_v = a, v
        if new >= 0:
            return new
        return near if near >= 0 and near_v >= (1.0 - self.explore_margin) * best_v else best

    def observe(self, bucket, arm, batch_size, emitted, elapsed, accepted, step):
        g = self.gamma
        secs = self._secs.get(batch_size)
        if secs is None:
            self._tables(batch_size)
            secs = self._secs[batch_size]
        base = secs[arm]
        v = elapsed / base if base else elapsed
        if not _TINY <= v <= 1.0 / _TINY:  # legal extremes stay finite and nonzero in the discounted mean
            v = _TINY if v < _TINY else 1.0 / _TINY
        tn, tv = self.time_n[bucket], self.time_v[bucket]
        n = tn[arm]
        # Discounted mean with a fast start: the first observation replaces the prior.
        if n == 0:
            tv[arm] = v
        else:
            w = 1.0 / (n * g + 1.0)
            tv[arm] += w * (v - tv[arm])
        tn[arm] = n * g + 1.0
        d = self.depth[arm]
        if d == 0:
            return
        fa = g ** (step - self.t_arm[arm])
        self.n_arm[arm] = self.n_arm[arm] * fa + 1.0
        self.grp_played[self.grp[arm]] = True
        if d > self.depth_played:
            self.depth_played = d
        if accepted is None:
            self.t_arm[arm] = step
            t = emitted / batch_size
            o = self.obs_tokens[arm]
            self.obs_tokens[arm] = self.tokens[arm] = t if o is None else (1 - 1 / self.window) * o + t / self.window
            return
        if len(accepted) != d:
            raise ValueError(
                f"accepted_per_position for {self.arms[arm]} must have num_steps={d} entries, got {len(accepted)}"
            )
        changed = self._score(arm, accepted, batch_size, step, fa)
        # Own counts: discounted by time and by how far the model moved since they were last updated.
        eta = self.lvl + self.off[self.grp[arm]]
        num, den = self.num[arm], self.den[arm]
        if self.follow:
            dd = eta - self.eta_last[arm]
            fa = fa / (1.0 + self.follow * fa * den[1] * dd * dd)
        inv_b = 1.0 / batch_size
        prev = 1.0
        for j in range(1, d + 1):
            r = accepted[j - 1] * inv_b
            num[j] = num[j] * fa + r
            den[j] = den[j] * fa + prev
            prev = r
        self.eta_last[arm] = eta
        self.t_arm[arm] = step
        # Other arms move only through the shared model: refresh them all when the level moved enough
        # to matter (or on an alarm), else only the played arm, on the per-depth hazards of the last full
        # refresh (keeps select+update cheap).
        if changed or abs(self.lvl - self._lvl_refreshed) > self.refresh_tol:
            self._refresh_all(step)
        else:
            self._refresh(arm, step)

    def _score(self, arm: int, accepted: Sequence[float], batch_size: int, step: int, fa: float) -> bool:
        """One pass over the played arm's positions: change detection, then one Fisher-scoring step of the
        shared model. Returns whether the CUSUM alarmed.

        Position ``j`` is ``n`` trials (requests that reached ``j-1``) with ``k`` successes. With
        ``eta = lvl + dep[j] + off[arm]``, ``e = exp(eta)`` and ``p = 1 - exp(-e)``, the Newton step in
        ``eta`` is ``r_j = (k - n p) / (n e (1-p))`` with precision ``w_j = n e^2 (1-p) / p``.
        The precision-weighted mean of the ``r_j`` updates ``(lvl, off)`` by a Kalman step with their
        full covariance ``P`` (the level and an arm's offset are only identified jointly, through plays
        of different arms; a diagonal covariance would let whichever arm is explored first absorb the
        prior's error into its offset). ``r_j - r_1`` updates ``dep[j]`` (depth 1 is the anchor).

        Change detection (Bernoulli CUSUM): the step's draft tokens are ``n`` trials with ``k`` accepted
        against the arm's own predicted rate ``p`` (:meth:`_alphas` before this step). Two one-sided
        CUSUMs per shift of ``detect_shift`` add the log-likelihood ratio of rates ``p + shift`` and ``p - shift`` versus ``p``
        (``k log(p1/p) + (n-k) log((1-p1)/(1-p))``) and alarm above ``detect`` nats. A bias smaller than
        ``shift / 2`` has negative drift and never alarms, so the model's own small errors are tolerated
        at any batch size. It compares an arm with itself, so switching arms does not fire it.
        """
        dep, var_dep, t_dep, gs, v0 = self.dep, self.var_dep, self.t_dep, self.gamma_slow, self._v0
        num, den, t2 = self.num[arm], self.den[arm], self._model_var(step)
        g = self.grp[arm]
        base = self.lvl + self.off[g]
        fs = fa
        if self.follow:
            dd = base - self.eta_last[arm]
            fs = fa / (1.0 + self.follow * fa * den[1] * dd * dd)
        exp = math.exp
        W = R = r1 = w1 = 0.0
        tn = tk = te = 0.0  # CUSUM: trials, accepted, predicted accepted
        prev = float(batch_size)
        j = 0
        for k in accepted:
            j += 1
            n = prev
            prev = k = float(k)
            if n <= 0.0:
                break
            eta = base + dep[j]
            eta = -5.0 if eta < -5.0 else (3.0 if eta > 3.0 else eta)
            e = exp(eta)
            q = exp(-e)
            if q < 1e-6:
                q = 1e-6
            p = 1.0 - q
            # the arm's own prediction (model and own counts by precision), for the CUSUM
            km = p / (t2 * e * e * q)
            if km > 1000.0:
                km = 1000.0
            tn += n
            tk += k
            te += n * (fs * num[j] + km * p) / (fs * den[j] + km)
            r = (k - n * p) / (n * e * q)
            r = -2.0 if r < -2.0 else (2.0 if r > 2.0 else r)
            w = n * e * e * q / p
            W += w
            R += w * r
            if j == 1:
                r1, w1 = r, w
            else:  # depth offsets: r_j - r_1 is what the level and the arm's offset do not explain
                vd = var_dep[j]
                if gs != 1.0:
                    vd = min(vd / gs ** (step - t_dep[j]), v0)
                    t_dep[j] = step
                vt = vd + 1.0 / w + 1.0 / w1
                x = dep[j] + vd / vt * (r - r1)
                dep[j] = -3.0 if x < -3.0 else (3.0 if x > 3.0 else x)
                var_dep[j] = vd - vd * vd / vt
        changed = False
        sup = self.support * self.gamma ** (step - self.t_support)
        self.support, self.t_support = sup + 1.0, step
        if self.detect is not None and tn > 0.0 and (
                not self.min_trials or den[1] * fa >= self.min_trials or sup < self.min_support):
            p = te / tn
            p = 0.02 if p < 0.02 else (0.98 if p > 0.98 else p)
            log, cs, h, i = math.log, self.cusum, self.detect, 0
            lp, lq, tf = log(p), log(1.0 - p), tn - tk
            for s in self.detect_shift:
                hi = p + s if p + s < 0.995 else 0.995
                lo = p - s if p - s > 0.005 else 0.005
                ch = cs[i] + tk * (log(hi) - lp) + tf * (log(1.0 - hi) - lq)
                cl = cs[i + 1] + tk * (log(lo) - lp) + tf * (log(1.0 - lo) - lq)
                cs[i] = ch if ch > 0.0 else 0.0
                cs[i + 1] = cl if cl > 0.0 else 0.0
                if ch > h or cl > h:
                    changed = True
                i += 2
            if changed:
                self._forget(step)
        P, vp = self.P, self.var_prior
        dt = step - self.t_lvl
        if dt:
            # The level's variance grows as the memory decays, the offsets' far more slowly.
            P[0][0] = min(P[0][0] / self.gamma ** dt, vp)
            if gs != 1.0:
                f = gs ** dt
                for i in range(1, len(P)):
                    P[i][i] = min(P[i][i] / f, v0)
            self.t_lvl = step
        if W <= 0.0:
            return changed
        rbar = R / W
        # Kalman update of x = (lvl, off_0..off_{G-1}) with observation h.x, h = e_0 + e_{1+g}.
        i = 1 + g
        Ph = [row[0] + row[i] for row in P]
        S = Ph[0] + Ph[i] + 1.0 / W
        K = [v / S for v in Ph]
        self.lvl += K[0] * rbar
        off = self.off
        for c in range(len(off)):
            x = off[c] + K[c + 1] * rbar
            off[c] = -3.0 if x < -3.0 else (3.0 if x > 3.0 else x)
        for r_, kr in enumerate(K):
            P[r_] = [x - kr * ph for x, ph in zip(P[r_], Ph)]
        return changed

    def _forget(self, step: int) -> None:
        """After a detected change keep ``keep_on_change`` of the arms' own counts and reset the level's
        variance to its prior: the next observations move the shared level (and with it every arm's
        prediction) at once, while the per-arm and per-depth offsets -- how arms differ, which a change
        of drafter/target agreement does not alter -- are kept."""
        f = self.keep_on_change
        self.changes.append(step)
        self.cusum = [0.0] * len(self.cusum)
        self.support = 0.0
        for rows in (self.num, self.den):
            for r in rows:
                for j in range(len(r)):
                    r[j] *= f
        self.P[0][0] = max(self.P[0][0], self.var_prior)
        # Exploration counts are kept: a larger bonus for every arm after each alarm re-tries deep trees
        # at large batches, which costs more than it finds (measured on phase-shift-mixed).
        self.obs_tokens = [None] * len(self.arms)


POLICIES = {
    "beg": BucketedEpsilonGreedy,
    "ucb": SlidingWindowUCB,
    "thompson": DiscountedThompson,
    "cost": CostModelPolicy,
}


def make_policy(policy, **kwargs) -> Policy:
    if isinstance(policy, Policy):
        if kwargs:
            raise ValueError(f"policy options {sorted(kwargs)} given with a Policy instance; set them on the instance")
        return policy
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; expected one of {sorted(POLICIES)} or a Policy instance")
    return POLICIES[policy](**kwargs)
