"""The interface every policy of :class:`~tlt_kernels.runtime.selector.StrategySelector` implements.

A policy sees arms as indices into the selector's strategy list and keeps its statistics per batch-size bucket (a
batch of 4 and a batch of 256 have different best arms). The reward is the step's throughput,
``emitted_tokens / elapsed_s``. Policies draw randomness only from the ``random.Random`` they are bound to, so equal
seeds and equal observations give equal decisions.
"""
from __future__ import annotations

import random
from typing import List, Optional, Sequence

from ..strategy import Strategy

# Rewards (tokens/s) are capped so that squares and discounted sums of them stay finite floats: a legal but
# extreme step (a 1e-300 s timing) must not overflow a policy's statistics. Real throughputs are far below it.
MAX_REWARD = 1e100


class Policy:
    """Interface. ``bind`` is called once by the selector; ``choose``/``observe`` then per step."""

    name = "policy"

    def bind(self, arms: Sequence[Strategy], num_buckets: int, rng: random.Random, window: int) -> None:
        """Size the statistics for ``arms`` and ``num_buckets`` buckets; ``window`` is the memory in steps."""
        self.arms = list(arms)
        self.num_buckets = num_buckets
        self.rng = rng
        self.window = window

    def choose(self, bucket: int, batch_size: int, allowed: List[int], step: int) -> int:
        """Index of the arm to play, one of ``allowed`` (never empty)."""
        raise NotImplementedError

    def new_rollout(self) -> None:
        """A new batch of requests starts (the engine calls it once per rollout); by default nothing changes."""

    def step_seconds(self, bucket: int, arm: int, batch_size: int) -> Optional[float]:
        """The predicted step time of ``arm`` at ``batch_size`` in seconds, or None where the policy keeps none (the
        default: only the cost policy models step times)."""
        return None

    def observe(self, bucket: int, arm: int, batch_size: int, emitted: float, elapsed: float,
                accepted: Optional[Sequence[float]], step: int, accepted_rows: Optional[int] = None) -> None:
        """Fold in one step: ``emitted`` tokens over the batch in ``elapsed`` seconds; ``accepted[i]`` = requests
        whose accepted path has at least ``i + 1`` draft tokens (``[num_steps]`` floats), or None; counted over
        ``accepted_rows`` requests of the batch (None: all ``batch_size``)."""
        raise NotImplementedError

    def observe_counterfactual(self, arm: int, accepted: Sequence[float], rows: int) -> None:
        """Fold in what speculative arm ``arm`` would have accepted on a step it did not run (``accepted[i]``: of
        ``rows`` counted requests, those with at least ``i + 1`` drafts accepted). By default nothing: a policy that
        learns from its own plays ignores it (only :class:`~.counterfactual.CounterfactualPolicy` uses it)."""


def throughput_reward(emitted: float, elapsed: float) -> float:
    """Tokens per second of one step, capped at :data:`MAX_REWARD`."""
    tokens_per_s = emitted / elapsed
    return tokens_per_s if tokens_per_s < MAX_REWARD else MAX_REWARD


def first_unseen(counts: List[float], allowed: List[int]) -> int:
    """The first allowed arm with a zero count, or -1."""
    for a in allowed:
        if counts[a] == 0:
            return a
    return -1
