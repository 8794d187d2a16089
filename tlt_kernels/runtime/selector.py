"""Per-batch strategy selection for adaptive speculative decoding.

Typical loop (no host synchronization is added: the step time comes from CUDA events that are read
on a later call, once ``cudaEventQuery`` says they are done)::

    sel = StrategySelector([Strategy.off(), Strategy(3, 1, 4), Strategy(5, 4, 16)], available=pool.covers)
    while running:
        s = sel.select(batch_size)
        start.record(); out = step(s); end.record()
        sel.update(s, batch_size, out.num_emitted, (start, end), out.accepted_per_position)

``num_emitted`` (0-d tensor) and ``accepted_per_position`` (``[num_steps]`` tensor: entry ``i`` counts
the requests of the batch whose accepted path has at least ``i + 1`` draft tokens) may be CUDA tensors;
they are copied to pinned memory asynchronously and folded in when ready.

Determinism: all randomness comes from ``random.Random(seed)``; pending observations are folded in
first-in first-out, stopping at the first one not yet ready, so ranks that saw the same observations in
the same order make the same decisions. Ranks whose observations can differ (data parallel) pass
``decision_hook`` (e.g. a broadcast from rank 0) to agree on the strategy.
"""
from __future__ import annotations

import bisect
import math
import numbers
import random
import warnings
from collections import deque
from typing import Callable, Dict, List, Optional, Sequence

from .forecast import AcceptanceForecast
from .loss_budget import LossBudget, check_loss_budget
from .policies import CostTable, Policy, make_policy
from .strategy import Pending, Strategy, as_pending

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 1024)
DEFAULT_POLICY = "cost"
# The loss to plain decoding a rollout may risk, as a fraction of its time (docs/RUNTIME.md, "The loss budget"); None:
# no budget.
DEFAULT_LOSS_BUDGET = None
_NUMBER = (int, float)
_INF = math.inf


def check_batch_size(batch_size, where: str) -> int:
    """``batch_size`` as an int >= 1, or a ValueError naming ``where`` (a bool or a float is not a batch size)."""
    if type(batch_size) is int and batch_size >= 1:
        return batch_size
    if isinstance(batch_size, numbers.Integral) and not isinstance(batch_size, bool) and batch_size >= 1:
        return int(batch_size)
    raise ValueError(f"{where}: batch_size must be an int >= 1 (requests in the step), got {batch_size!r}")


def check_accepted_rows(rows, batch_size: int) -> int:
    """``rows`` (the lagging rows an update's acceptance counts cover) as an int in ``[1, batch_size]``, or a
    ValueError naming ``accepted_rows``."""
    if isinstance(rows, bool) or not isinstance(rows, numbers.Integral) or not 1 <= rows <= batch_size:
        raise ValueError(f"accepted_rows must be an int in [1, batch_size={batch_size}], got {rows!r}")
    return int(rows)


def _scalar(value):
    """A 1-element list (what a ``[1]`` tensor's ``tolist()`` gives) as its element; anything else unchanged."""
    return value[0] if type(value) is list and len(value) == 1 else value


def _host_counts(counts) -> list:
    """``counts`` (a list, tuple or CPU tensor) as a list, or a ValueError naming ``accepted_per_position``."""
    if isinstance(counts, (list, tuple)):
        return list(counts)
    if getattr(counts, "device", None) is not None and getattr(counts, "ndim", None) == 1:
        if counts.device.type != "cpu":
            raise ValueError("accepted_per_position must be host counts (a list or a CPU tensor), got a tensor on "
                             f"{counts.device}: reading it here would synchronize with the device")
        return counts.tolist()
    raise ValueError(f"accepted_per_position must be a list, tuple or 1-D CPU tensor of counts, got {counts!r}")


class StrategySelector:
    """Chooses a :class:`Strategy` for each decoding step from observed throughput.

    Args:
        strategies: the arms; ``Strategy.off()`` is added when missing (plain decoding is always an arm).
        policy: ``"cost"`` (default, see docs/RUNTIME.md for the benchmark that chose it), ``"counterfactual"``
            (for a drafter that scores every arm's drafts at every step: :meth:`observe_counterfactual`), ``"beg"``,
            ``"ucb"``, ``"thompson"``, or a :class:`~tlt_kernels.runtime.policies.Policy` instance.
        batch_buckets: increasing upper bounds of batch-size buckets (statistics are kept per bucket);
            sizes above the last bound share the last bucket. Default :data:`DEFAULT_BUCKETS`.
        window: memory of the policies in steps (sliding window length / ``1 / (1 - discount)``).
        seed: seed of the policy's private ``random.Random``.
        available: ``available(strategy, batch_size) -> bool``; arms for which it is False (no captured
            graph for that size) are not chosen. Plain decoding is used when nothing is available.
        decision_hook: ``hook(strategy, batch_size) -> strategy`` applied to every decision, e.g. a
            broadcast from rank 0 when ranks may observe different timings.
        loss_budget: the most a rollout's speculative steps may lose against plain decoding, as a fraction of the
            rollout's time (:mod:`~tlt_kernels.runtime.loss_budget`): a speculative choice of the policy that could
            exceed it runs plain decoding instead (counted in ``budget.vetoed``). Default
            :data:`DEFAULT_LOSS_BUDGET`; None: every choice is the policy's.
        forecast: an :class:`~tlt_kernels.runtime.forecast.AcceptanceForecast`, or None (default): where the
            policy or the loss budget chose plain decoding, the drafting arm whose slowest running request's
            forecast rate beats plain decoding's by its margin runs instead (counted in ``forecast.overrides``). It
            learns from :meth:`update`'s ``running_rows`` and ``rows_accepted`` and needs a policy that predicts
            step times (:meth:`~tlt_kernels.runtime.policies.Policy.step_seconds`: the cost policy).
        **policy_kwargs: options of the named policy (e.g. ``cost_table=`` for ``"cost"``,
            ``epsilon=`` for ``"beg"``).

    Garbage measurements: an observation whose emitted count, elapsed time or accepted counts cannot come from a
    real step (NaN or infinite values, negative counts, accepted counts above the batch or growing with depth) is
    ignored, so no policy ever sees it: it is counted in
    :attr:`rejected` (by field in :attr:`rejected_reasons`) and the first one per selector raises a
    ``RuntimeWarning``. A zero or negative finite ``elapsed_s``, an ``accepted_per_position`` of the wrong length,
    a strategy that is not an arm and a ``batch_size`` that is not an int >= 1 are the caller's errors and raise
    ``ValueError``.
    """

    def __init__(self, strategies: Sequence[Strategy], policy=DEFAULT_POLICY,
                 batch_buckets: Optional[Sequence[int]] = None, window: int = 32, seed: int = 0, *,
                 available: Optional[Callable[[Strategy, int], bool]] = None,
                 decision_hook: Optional[Callable[[Strategy, int], Strategy]] = None,
                 loss_budget: Optional[float] = DEFAULT_LOSS_BUDGET,
                 forecast: Optional[AcceptanceForecast] = None, **policy_kwargs):
        arms: List[Strategy] = []
        for s in strategies:
            if not isinstance(s, Strategy):
                raise TypeError(f"strategies must be Strategy objects, got {type(s).__name__}: {s!r}")
            if s not in arms:
                arms.append(s)
        if Strategy.off() not in arms:
            arms.insert(0, Strategy.off())
        self.strategies = tuple(arms)
        self._index: Dict[Strategy, int] = {s: i for i, s in enumerate(arms)}
        self._off = self._index[Strategy.off()]
        buckets = tuple(DEFAULT_BUCKETS if batch_buckets is None else batch_buckets)
        if not buckets or any(int(b) != b or b < 1 for b in buckets) or list(buckets) != sorted(set(buckets)):
            raise ValueError(f"batch_buckets must be strictly increasing positive ints, got {buckets}")
        self.batch_buckets = buckets
        if not isinstance(window, int) or window < 2:
            raise ValueError(f"window must be an int >= 2, got {window!r}")
        self.window = window
        self.seed = seed
        self.rng = random.Random(seed)
        self.policy: Policy = make_policy(policy, **policy_kwargs)
        self.policy.bind(self.strategies, len(buckets), self.rng, window)
        self.available = available
        self.decision_hook = decision_hook
        self.step = 0
        self._pending: deque = deque()
        self._all = list(range(len(arms)))
        self._allowed_cache: Dict[int, List[int]] = {}
        self._bucket_cache: Dict[int, int] = {}
        self._depth = [s.num_steps for s in arms]
        self.budget = self._loss_budget(check_loss_budget(loss_budget), policy_kwargs.get("cost_table"))
        if forecast is not None and not isinstance(forecast, AcceptanceForecast):
            raise TypeError(f"forecast must be an AcceptanceForecast or None, got {type(forecast).__name__}")
        self.forecast = forecast
        if forecast is not None:
            forecast.bind(self._depth)
        self.rejected = 0  # garbage observations ignored (see the class docstring)
        self.rejected_reasons: Dict[str, int] = {}  # the same, by the field that was garbage
        self._warned = False

    # -- helpers -------------------------------------------------------------------------------
    def _loss_budget(self, fraction: Optional[float], table) -> Optional[LossBudget]:
        """The ledger of ``loss_budget`` (None without one); its reserves start from the policy's cost table."""
        if fraction is None:
            return None
        table = getattr(self.policy, "cost_table", None) or table
        if table is not None and not isinstance(table, CostTable):
            table = CostTable(table)
        def plain(batch_size: int) -> Optional[float]:
            return table.predict(self.strategies[self._off], batch_size)

        def ratio(arm: int, batch_size: int) -> Optional[float]:
            spec, plain_s = table.predict(self.strategies[arm], batch_size), plain(batch_size)
            return spec / plain_s if spec is not None and plain_s else None
        return LossBudget(fraction, [s.num_steps for s in self.strategies], len(self.batch_buckets),
                          None if table is None else ratio, None if table is None else plain)

    def bucket(self, batch_size: int) -> int:
        """Index of the bucket holding ``batch_size``."""
        i = self._bucket_cache.get(batch_size)
        if i is None:
            i = bisect.bisect_left(self.batch_buckets, batch_size)
            i = self._bucket_cache[batch_size] = i if i < len(self.batch_buckets) else len(self.batch_buckets) - 1
        return i

    def _allowed(self, batch_size: int) -> List[int]:
        if self.available is None:
            return self._all
        allowed = self._allowed_cache.get(batch_size)
        if allowed is None:
            allowed = [i for i, s in enumerate(self.strategies) if self.available(s, batch_size)] or [self._off]
            self._allowed_cache[batch_size] = allowed
        return allowed

    def invalidate_available(self) -> None:
        """Call after graphs were captured or evicted so ``available`` is asked again."""
        self._allowed_cache.clear()

    # -- API ----------------------------------------------------------------------------------
    def select(self, batch_size: int) -> Strategy:
        """The strategy for the next step of a batch of ``batch_size`` requests."""
        if type(batch_size) is not int or batch_size < 1:
            batch_size = check_batch_size(batch_size, "StrategySelector.select")
        if self._pending:
            self._drain()
        self.step += 1
        bucket = self.bucket(batch_size)
        a = self.policy.choose(bucket, batch_size, self._allowed(batch_size), self.step)
        if self.budget is not None and not self.budget.allows(a, bucket, batch_size):
            a = self._off
        if self.forecast is not None and not self._depth[a]:
            a = self._forecast_override(bucket, batch_size, a)
        s = self.strategies[a]
        if self.decision_hook is not None:
            s = self.decision_hook(s, batch_size)
            if s not in self._index:
                raise ValueError(f"decision_hook returned {s}, which is not one of the selector's strategies")
        return s

    def _forecast_override(self, bucket: int, batch_size: int, plain: int) -> int:
        """The forecast's arm where it beats plain decoding (arm ``plain``) at the policy's predicted step times,
        else ``plain``."""
        def step_seconds(arm: int) -> Optional[float]:
            return self.policy.step_seconds(bucket, arm, batch_size)
        arm = self.forecast.choose(self._allowed(batch_size), step_seconds, plain)
        return plain if arm is None else arm

    def new_rollout(self, max_tokens: Optional[int] = None) -> None:
        """A new batch of requests starts (:class:`~tlt_kernels.engine.SpeculativeEngine` calls it once per
        ``generate``, with the most new tokens any request may take as ``max_tokens``): the last batch's ready
        observations are folded in, then the policy is told (:meth:`~tlt_kernels.runtime.policies.Policy.new_rollout`)
        and the loss budget, which bounds the loss by a fraction of the rollout's projected time from its first step
        when given ``max_tokens`` (:mod:`~tlt_kernels.runtime.loss_budget`)."""
        if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0):
            raise ValueError(f"max_tokens must be a non-negative int or None, got {max_tokens!r}")
        self._drain()
        self.policy.new_rollout()
        if self.budget is not None:
            self.budget.new_rollout(max_tokens)
        if self.forecast is not None:
            self.forecast.new_rollout()

    def update(self, strategy: Strategy, batch_size: int, emitted_tokens, elapsed_s,
               accepted_per_position=None, accepted_rows: Optional[int] = None,
               batch_progress: Optional[int] = None, running_rows: Optional[Sequence[int]] = None,
               rows_accepted: Optional[Sequence[int]] = None) -> None:
        """Record one step's outcome (garbage measurements are ignored and counted: see the class docstring).

        Args:
            strategy: the strategy that ran.
            batch_size: requests in the step (before padding), an int >= 1.
            emitted_tokens: tokens emitted by the whole batch (int, 0-d tensor, or pending handle).
            elapsed_s: step seconds: float, a ``(start, end)`` CUDA event pair, or a pending handle.
            accepted_per_position: optional ``[num_steps]`` counts, entry ``i`` = requests whose accepted
                path has at least ``i + 1`` draft tokens (list, tensor, or pending handle).
            accepted_rows: how many requests ``accepted_per_position`` counts over, an int in ``[1, batch_size]``
                (default: the whole batch). A static batch finishes when its lagging requests do, so
                :class:`~tlt_kernels.engine.SpeculativeEngine` passes their counts: the acceptance the policy
                learns is theirs, with their number as its sample size; the step time is the whole batch's.
            batch_progress: how far the step moved the batch's end (its most tokens left before the step less the
                most a request still running has left after it), an int >= 0, or None; the loss budget's progress
                where given (else its estimate from the lagging rows' counts). The policy does not use it.
            running_rows: the requests still running after the step (distinct ints >= 0, stable within a rollout,
                which they only leave), or None; for the ``forecast`` only (ignored without one).
            rows_accepted: with ``running_rows`` and a drafting strategy, each one's accepted drafts in the step
                (host ints in ``[0, num_steps]``, in the same order).
        """
        arm = self._index.get(strategy)
        if arm is None:
            raise ValueError(f"update got strategy {strategy}, which is not one of the selector's strategies")
        if type(batch_size) is not int or batch_size < 1:
            batch_size = check_batch_size(batch_size, f"StrategySelector.update({strategy})")
        if accepted_rows is not None:
            accepted_rows = check_accepted_rows(accepted_rows, batch_size)
        if batch_progress is not None and (type(batch_progress) is not int or batch_progress < 0):
            raise ValueError(f"batch_progress must be an int >= 0 or None, got {batch_progress!r}")
        if self.budget is not None:
            self.budget.launched(arm, self.bucket(batch_size), batch_size)
        if self.forecast is not None and running_rows is not None:
            self.forecast.observe(arm, running_rows, rows_accepted)
        # Fast path (plain numbers, nothing queued): fold in now, the same as queue + drain would.
        if (not self._pending and type(elapsed_s) in _NUMBER and type(emitted_tokens) in _NUMBER
                and (accepted_per_position is None or type(accepted_per_position) is list)):
            acc, d = accepted_per_position, self._depth[arm]
            # The common case inline (NaN fails every comparison); anything it doubts goes through _fold's checks.
            ok = 0 <= emitted_tokens < _INF and 0 < elapsed_s < _INF
            if ok and d and acc is not None:
                ok, prev = len(acc) == d, accepted_rows or batch_size
                for x in acc:
                    if not 0 <= x <= prev:
                        ok = False
                        break
                    prev = x
            if ok:
                if self.budget is not None:
                    self.budget.release()
                self._observe(arm, batch_size, float(emitted_tokens), float(elapsed_s), acc if d else None,
                              self.step, accepted_rows, batch_progress)
            else:
                self._fold(arm, batch_size, emitted_tokens, elapsed_s, acc, self.step, accepted_rows, batch_progress)
            return
        obs = (arm, batch_size, as_pending(emitted_tokens), as_pending(elapsed_s),
               as_pending(accepted_per_position), self.step, accepted_rows, batch_progress)
        self._pending.append(obs)
        self._drain()

    def observe_counterfactual(self, strategy: Strategy, batch_size: int, accepted_per_position,
                               accepted_rows: Optional[int] = None) -> None:
        """Record what speculative ``strategy`` would have accepted on a step that ran another arm: a deterministic
        drafter scores the drafts the arm would have proposed against the tokens the batch emitted (docs/RUNTIME.md,
        "The counterfactual policy"). Only the ``"counterfactual"`` policy learns from it; others ignore it.

        Args:
            strategy: a speculative arm of the selector (not the one the step ran: :meth:`update` has its counts).
            batch_size: requests in the step, an int >= 1.
            accepted_per_position: ``[num_steps]`` host counts (list, tuple or CPU tensor; a device tensor would need
                a host sync here), entry ``i`` = counted requests whose drafts would have had at least ``i + 1``
                accepted.
            accepted_rows: how many requests the counts are over, an int in ``[1, batch_size]`` (default: the batch).

        Counts that cannot come from a step (NaN, negative, above the rows or growing with depth) are ignored and
        counted in :attr:`rejected`, as :meth:`update`'s are. Observations are folded in at once, ahead of any
        pending :meth:`update`: the policy's means do not depend on their order.
        """
        arm = self._index.get(strategy)
        if arm is None or not self._depth[arm]:
            raise ValueError(f"observe_counterfactual takes a speculative arm of the selector, got {strategy}")
        batch_size = check_batch_size(batch_size, f"StrategySelector.observe_counterfactual({strategy})")
        rows = batch_size if accepted_rows is None else check_accepted_rows(accepted_rows, batch_size)
        acc = _host_counts(accepted_per_position)
        if len(acc) != self._depth[arm]:
            raise ValueError(f"accepted_per_position for {strategy} must have num_steps={self._depth[arm]} entries, "
                             f"got {len(acc)}")
        why = self._garbage(arm, rows, 0, 1.0, acc)
        if why is not None:
            self._reject(strategy, batch_size, why)
            return
        self.policy.observe_counterfactual(arm, [float(x) for x in acc], rows)

    def _observe(self, arm: int, b: int, em: float, el: float, acc, step: int, rows: Optional[int],
                 progress: Optional[int] = None) -> None:
        """Hand a checked observation to the policy (``accepted_rows`` only when given: a policy written before it
        existed still works without it) and to the loss budget (with ``batch_progress``)."""
        if self.budget is not None:
            self.budget.observe(arm, self.bucket(b), b, em, el, acc, rows, progress)
        if rows is None:
            self.policy.observe(self.bucket(b), arm, b, em, el, acc, step)
        else:
            self.policy.observe(self.bucket(b), arm, b, em, el, acc, step, accepted_rows=rows)

    def observe_ready(self) -> int:
        """Fold in pending observations that are ready; returns how many remain pending."""
        self._drain()
        return len(self._pending)

    def _drain(self) -> None:
        q = self._pending
        while q:
            arm, b, em, el, acc, step, rows, progress = q[0]
            if ((isinstance(em, Pending) and not em.ready()) or (isinstance(el, Pending) and not el.ready())
                    or (isinstance(acc, Pending) and not acc.ready())):
                return
            q.popleft()
            if isinstance(em, Pending):
                em = em.get()
            if isinstance(el, Pending):
                el = el.get()
            if isinstance(acc, Pending):
                acc = acc.get()
            self._fold(arm, b, _scalar(em), _scalar(el), acc, step, rows, progress)

    def _fold(self, arm: int, b: int, em, el, acc, step: int, rows: Optional[int] = None,
              progress: Optional[int] = None) -> None:
        """Validate one observation, then hand it to the policy; the one entry point of every policy's data."""
        if self.budget is not None:
            self.budget.release()  # whatever comes of the observation, its step is no longer in flight
        s = self.strategies[arm]
        d = s.num_steps
        if acc is not None and d and len(acc) != d:
            raise ValueError(f"accepted_per_position for {s} must have num_steps={d} entries, got {len(acc)}")
        if el <= 0:  # a finite time <= 0 is a caller's error (swapped events or clock readings), not a measurement
            raise ValueError(f"elapsed_s must be > 0 seconds, got {el} for {s}")
        why = self._garbage(arm, rows or b, em, el, acc if d else None)
        if why is not None:
            self._reject(s, b, why)
            return
        self._observe(arm, b, float(em), float(el), acc if d else None, step, rows, progress)

    def _garbage(self, arm: int, b: int, em, el, acc) -> Optional[str]:
        """Why the observation cannot come from a real step, or None. NaN fails every comparison below."""
        if not 0 <= em < math.inf:
            return f"emitted_tokens={em!r} is not a finite count >= 0"
        if not el < math.inf:
            return f"elapsed_s={el!r} is not a finite number of seconds"
        if acc is not None:
            prev, slack = b, 1e-9 * b  # counts of requests reaching depth i + 1 cannot grow with i
            for i, x in enumerate(acc):
                if not 0 <= x <= prev + slack:
                    return (f"accepted_per_position[{i}]={x!r} is outside [0, {prev}] (at most the batch_size and "
                            "the previous entry)")
                prev = x
        return None

    def _reject(self, s: Strategy, b: int, why: str) -> None:
        field = why.split("=", 1)[0].split("[", 1)[0]
        self.rejected += 1
        self.rejected_reasons[field] = self.rejected_reasons.get(field, 0) + 1
        if not self._warned:
            self._warned = True
            warnings.warn(f"StrategySelector ignored a garbage observation of {s} at batch_size={b}: {why}; later ones "
                          "are ignored silently and counted in StrategySelector.rejected", RuntimeWarning, stacklevel=4)

    def __repr__(self) -> str:
        return (f"StrategySelector(policy={self.policy.name!r}, arms={[str(s) for s in self.strategies]}, "
                f"buckets={len(self.batch_buckets)}, window={self.window}, seed={self.seed})")
