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
import random
from collections import deque
from typing import Callable, Dict, List, Optional, Sequence

from .policies import Policy, make_policy
from .strategy import Pending, Strategy, as_pending

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 1024)
DEFAULT_POLICY = "cost"
_NUMBER = (int, float)


class StrategySelector:
    """Chooses a :class:`Strategy` for each decoding step from observed throughput.

    Args:
        strategies: the arms; ``Strategy.off()`` is added when missing (plain decoding is always an arm).
        policy: ``"cost"`` (default, see docs/RUNTIME.md for the benchmark that chose it), ``"beg"``,
            ``"ucb"``, ``"thompson"``, or a :class:`~tlt_kernels.runtime.policies.Policy` instance.
        batch_buckets: increasing upper bounds of batch-size buckets (statistics are kept per bucket);
            sizes above the last bound share the last bucket. Default :data:`DEFAULT_BUCKETS`.
        window: memory of the policies in steps (sliding window length / ``1 / (1 - discount)``).
        seed: seed of the policy's private ``random.Random``.
        available: ``available(strategy, batch_size) -> bool``; arms for which it is False (no captured
            graph for that size) are not chosen. Plain decoding is used when nothing is available.
        decision_hook: ``hook(strategy, batch_size) -> strategy`` applied to every decision, e.g. a
            broadcast from rank 0 when ranks may observe different timings.
        **policy_kwargs: options of the named policy (e.g. ``cost_table=`` for ``"cost"``,
            ``epsilon=`` for ``"beg"``).
    """

    def __init__(self, strategies: Sequence[Strategy], policy=DEFAULT_POLICY,
                 batch_buckets: Optional[Sequence[int]] = None, window: int = 32, seed: int = 0, *,
                 available: Optional[Callable[[Strategy, int], bool]] = None,
                 decision_hook: Optional[Callable[[Strategy, int], Strategy]] = None, **policy_kwargs):
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

    # -- helpers -------------------------------------------------------------------------------
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
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if self._pending:
            self._drain()
        self.step += 1
        a = self.policy.choose(self.bucket(batch_size), batch_size, self._allowed(batch_size), self.step)
        s = self.strategies[a]
        if self.decision_hook is not None:
            s = self.decision_hook(s, batch_size)
            if s not in self._index:
                raise ValueError(f"decision_hook returned {s}, which is not one of the selector's strategies")
        return s

    def update(self, strategy: Strategy, batch_size: int, emitted_tokens, elapsed_s,
               accepted_per_position=None) -> None:
        """Record one step's outcome.

        Args:
            strategy: the strategy that ran.
            batch_size: requests in the step (before padding).
            emitted_tokens: tokens emitted by the whole batch (int, 0-d tensor, or pending handle).
            elapsed_s: step seconds: float, a ``(start, end)`` CUDA event pair, or a pending handle.
            accepted_per_position: optional ``[num_steps]`` counts, entry ``i`` = requests whose accepted
                path has at least ``i + 1`` draft tokens (list, tensor, or pending handle).
        """
        arm = self._index.get(strategy)
        if arm is None:
            raise ValueError(f"update got strategy {strategy}, which is not one of the selector's strategies")
        # Fast path (plain numbers, nothing queued): fold in now, the same as queue + drain would.
        if (not self._pending and type(elapsed_s) in _NUMBER and type(emitted_tokens) in _NUMBER
                and (accepted_per_position is None or type(accepted_per_position) is list)):
            if not elapsed_s > 0:
                raise ValueError(f"elapsed_s must be > 0 seconds, got {elapsed_s} for {strategy}")
            self.policy.observe(self.bucket(batch_size), arm, batch_size, float(emitted_tokens), float(elapsed_s),
                                accepted_per_position, self.step)
            return
        obs = (arm, batch_size, as_pending(emitted_tokens), as_pending(elapsed_s),
               as_pending(accepted_per_position), self.step)
        self._pending.append(obs)
        self._drain()

    def observe_ready(self) -> int:
        """Fold in pending observations that are ready; returns how many remain pending."""
        self._drain()
        return len(self._pending)

    def _drain(self) -> None:
        q = self._pending
        while q:
            arm, b, em, el, acc, step = q[0]
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
            if not el > 0:
                raise ValueError(f"elapsed_s must be > 0 seconds, got {el} for {self.strategies[arm]}")
            self.policy.observe(self.bucket(b), arm, b, float(em), float(el), acc, step)

    def __repr__(self) -> str:
        return (f"StrategySelector(policy={self.policy.name!r}, arms={[str(s) for s in self.strategies]}, "
                f"buckets={len(self.batch_buckets)}, window={self.window}, seed={self.seed})")
