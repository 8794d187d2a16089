"""A static batch's rollout, simulated: what the engine's selector sees and what the batch's wall time is.

:mod:`.simulate` scores a choice by its throughput at one acceptance shared by every request. A static batch
(``SpeculativeEngine.generate``) ends when its last request does, and requests differ: a few accept long drafts,
most accept little. So the wall time, not the batch's mean throughput, is the score here, and each request ``i``
accepts with its own base acceptance ``alphas[i]`` (:func:`~.simulate.alpha_eff` per request). A run's seed fixes
the batch's text (:class:`BatchText`: which tokens are hard to draft, where copy phases lie), so static arms and
selectors run on one seed meet the same text and differ only by their choices.

After each step the selector learns acceptance counts through a *feedback rule*, a function
``(reach int [b], left_before int [b], depth) -> (accepted_per_position, accepted_rows or None)``:

* :func:`batch_feedback`: every running request's counts (a throughput view);
* :func:`lagging_feedback`: the engine's rule: the counts of the requests with the most tokens left before the step
  (the lagging ones), over as many rows;
* :func:`critical_feedback`: of the lagging requests, the one that accepted fewest drafts, as one row: the batch's
  most tokens left fall by at most its tokens. Exact for one step, but after plain steps every request ties, so
  the first speculative step's row is the worst of the whole batch: the rule undervalues an arm tried once after
  plain decoding (docs/RUNTIME.md, "Static batches").

:data:`SMALL_MODEL_COST` is a launch-bound small target's step time (docs/RUNTIME.md gives the measurements);
:func:`grpo_batch` a GRPO rollout's batch (uneven lengths, low acceptance, n-gram step times);
:func:`good_drafter_batches` a 7B-class target's uniform batches with a drafter that pays at every size;
:func:`ngram_tail_batch` a long-tailed batch whose n-gram acceptance comes in copy phases (:class:`CopyPhases`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

from .simulate import StepCost, alpha_eff
from .strategy import Strategy

#: a small target on a fast GPU: every step costs about the same whatever the batch (launch-bound), a draft depth
#: of a one-layer drafter ~13% of it
SMALL_MODEL_COST = StepCost(t0=1.14e-3, kv=0.0, tok=1e-7, flop=1e-6, knee=2048, d0=0.15e-3, d_tok=1e-7,
                            tree_overhead=0.06e-3)
#: the same target drafting n-grams in a GRPO rollout: a draft depth ~3% of the step (docs/DRAFTERS.md, bench rl)
NGRAM_MODEL_COST = StepCost(t0=1.35e-3, kv=0.0, tok=1e-8, flop=1e-7, knee=4096, d0=0.045e-3, d_tok=1e-8,
                            tree_overhead=0.0)
#: what a rollout's first step costs beyond its arm's step: the engine's step clock runs from the prefill's end, so
#: the first step also carried the host's preparation of it while the engine's start read the device (up to 143ebb3;
#: the rollout record's budgeted rows: their first two plain steps averaged 1.34-1.78 ms against 1.08-1.31 ms for
#: plain steps of the same batch sizes, same run); kept as the case the ledger must survive
FIRST_STEP_S = 0.6e-3

Feedback = Callable[[np.ndarray, np.ndarray, int], Tuple[List[int], Optional[int]]]


def batch_feedback(reach: np.ndarray, left_before: np.ndarray, depth: int) -> Tuple[List[int], Optional[int]]:
    """Rows reaching each depth among all running requests (no ``accepted_rows``: the whole batch)."""
    return [int((reach > j).sum()) for j in range(depth)], None


def lagging_feedback(reach: np.ndarray, left_before: np.ndarray, depth: int) -> Tuple[List[int], Optional[int]]:
    """Rows reaching each depth among the requests with the most tokens left, and how many those are."""
    lagging = left_before == left_before.max()
    return [int(((reach > j) & lagging).sum()) for j in range(depth)], int(lagging.sum())


def critical_feedback(reach: np.ndarray, left_before: np.ndarray, depth: int) -> Tuple[List[int], Optional[int]]:
    """Whether the critical request (the lagging one that accepted fewest drafts) reached each depth, as one row."""
    critical = int(reach[left_before == left_before.max()].min())
    return [int(critical > j) for j in range(depth)], 1


@dataclass(frozen=True)
class CopyPhases:
    """Acceptance that comes in phases, as n-gram drafts' does: text repeating text the matcher can follow (a *copy
    phase*) is drafted at acceptance ``copy_alpha``, other text at its request's own base acceptance. Along each
    request's tokens the phases are a two-state Markov chain: a copy phase starts at a token with probability
    ``p_start`` and ends with ``p_stop``, from the chain's stationary law (copying with probability
    ``p_start / (p_start + p_stop)``). The phases belong to the text, so every arm meets the same ones."""

    p_start: float
    p_stop: float
    copy_alpha: float = 0.9

    def __post_init__(self):
        if not (0.0 < self.p_start <= 1.0 and 0.0 < self.p_stop <= 1.0 and 0.0 <= self.copy_alpha <= 1.0):
            raise ValueError(f"CopyPhases: p_start and p_stop must be in (0, 1] and copy_alpha in [0, 1], got "
                             f"{self.p_start}, {self.p_stop}, {self.copy_alpha}")

    def draw(self, rng: np.random.Generator, n: int, length: int) -> np.ndarray:
        """``bool [n, length]``: whether token ``p`` of request ``i`` lies in a copy phase."""
        copying = np.empty((n, length), dtype=bool)
        copying[:, 0] = rng.random(n) < self.p_start / (self.p_start + self.p_stop)
        flips = rng.random((n, length))
        for p in range(1, length):
            prev = copying[:, p - 1]
            copying[:, p] = prev ^ (flips[:, p] < np.where(prev, self.p_stop, self.p_start))
        return copying


@dataclass
class StaticBatch:
    """``len(alphas)`` requests of ``budget`` tokens each (or ``budgets[i]``: requests that stop early, as at an EOS),
    request ``i`` at base acceptance ``alphas[i]``; step times from ``cost`` with log-normal noise ``noise`` on what
    the selector observes; with ``copy_phases`` (:class:`CopyPhases`) each request also has phases of
    ``copy_alpha``; the first step of a run costs ``first_step_s`` more (:data:`FIRST_STEP_S`)."""

    name: str
    alphas: Sequence[float]
    budget: int
    cost: StepCost = field(default_factory=lambda: SMALL_MODEL_COST)
    noise: float = 0.03
    budgets: Optional[Sequence[int]] = None
    copy_phases: Optional[CopyPhases] = None
    first_step_s: float = FIRST_STEP_S

    def __post_init__(self):
        if self.budgets is not None and (len(self.budgets) != len(self.alphas)
                                         or not all(1 <= b <= self.budget for b in self.budgets)):
            raise ValueError(f"StaticBatch {self.name!r}: budgets must give each of the {len(self.alphas)} requests "
                             f"1..budget={self.budget} tokens")

    def initial_left(self) -> np.ndarray:
        """``int64 [len(alphas)]``: each request's tokens to emit."""
        if self.budgets is None:
            return np.full(len(self.alphas), self.budget, dtype=np.int64)
        return np.asarray(self.budgets, dtype=np.int64).copy()


def run_static_batch(batch: StaticBatch, choose: Callable[[int], Strategy],
                     observe: Optional[Callable[..., None]] = None, feedback: Feedback = lagging_feedback,
                     seed: int = 0, counterfactual=None) -> float:
    """Simulated seconds until every request of ``batch`` has its tokens, with ``choose(batch_size) -> Strategy``
    per step; ``observe(strategy, batch_size, emitted, seconds, accepted_per_position, accepted_rows, progress,
    running_rows=, rows_accepted=)`` gets what ``feedback`` makes of each step, how far the step moved the batch's end
    (its most tokens left less the most left after it, as the engine measures it), and the requests still running
    after it with their accepted drafts (what the engine reads per row: ``StrategySelector(forecast=)``).

    ``seed`` fixes the batch's text (:class:`BatchText`), the same whatever the choices, and the noise of the
    observed step times (a stream of its own): two runs with one seed differ only by what their choices do.
    ``counterfactual`` (a :class:`~.simulate.CounterfactualDelay`, or None): after each step, every arm of its
    ``arms`` the step did not run is scored on the same text through ``feedback`` and handed over once known, as a
    drafter that scores every arm's drafts would (the ``"counterfactual"`` policy learns from it)."""
    text_seed, noise_seed = np.random.SeedSequence(seed).spawn(2)
    text = BatchText.draw(batch, np.random.default_rng(text_seed))
    noise = np.random.default_rng(noise_seed)
    budgets = batch.initial_left()
    left = budgets.copy()
    seconds, extra_s = 0.0, batch.first_step_s  # the first step's extra, then none
    while (left > 0).any():
        running = np.nonzero(left > 0)[0]
        strategy = choose(len(running))
        done = budgets[running] - left[running]
        reach = text.reach(strategy, running, done)
        step_s, extra_s = batch.cost(strategy, len(running)) + extra_s, 0.0
        seconds += step_s
        before = left[running].copy()
        emitted = np.minimum(reach + 1, before)
        left[running] -= emitted
        if observe is not None:
            accepted, rows = feedback(reach, before, strategy.num_steps)
            observed_s = step_s * math.exp(batch.noise * noise.standard_normal())
            progress = int(before.max() - (before - emitted).max())
            still = left[running] > 0
            observe(strategy, len(running), float(emitted.sum()), observed_s, accepted, rows, progress,
                    running_rows=running[still].tolist(), rows_accepted=reach[still].tolist())
        if counterfactual is not None:
            counterfactual.step(strategy, [(arm, len(running), *feedback(text.reach(arm, running, done), before,
                                                                           arm.num_steps))
                                           for arm in counterfactual.arms])
    return seconds


@dataclass
class BatchText:
    """What a batch's text fixes, whatever the arm (common random numbers: arms and selectors are compared on the
    same text): per request ``i`` and token ``p``, a uniform ``u[i, p]`` that decides every draft of that token
    (a draft at depth ``j`` is accepted when ``u < alpha_eff(strategy, alpha)[j]``: a token hard for one
    configuration is hard for every one, a wider tree accepts it more often), and ``alpha[i, p]``, the request's
    base acceptance or, in a copy phase, the phases' ``copy_alpha``. Both ``[n, budget + 1]``: the last column
    serves drafts past the budget, which emit nothing."""

    u: np.ndarray
    alpha: np.ndarray

    @classmethod
    def draw(cls, batch: StaticBatch, rng: np.random.Generator) -> "BatchText":
        n, length = len(batch.alphas), batch.budget + 1
        u = rng.random((n, length))
        alpha = np.repeat(np.asarray(batch.alphas, dtype=np.float64)[:, None], length, axis=1)
        if batch.copy_phases is not None:
            alpha[batch.copy_phases.draw(rng, n, length)] = batch.copy_phases.copy_alpha
        return cls(u, alpha)

    def reach(self, strategy: Strategy, rows: np.ndarray, emitted: np.ndarray) -> np.ndarray:
        """Accepted drafts of requests ``rows`` that have ``emitted`` tokens each: ``[b]`` ints in
        ``[0, num_steps]``, draft ``j`` (0-based) guessing token ``emitted + j`` of its request."""
        depth = strategy.num_steps
        if depth == 0:
            return np.zeros(len(rows), dtype=np.int64)
        pos = np.minimum(emitted[:, None] + np.arange(depth), self.u.shape[1] - 1)
        alphas = self.alpha[rows[:, None], pos]
        values, index = np.unique(alphas, return_inverse=True)  # few distinct levels: one alpha_eff call each
        accept = np.array([alpha_eff(strategy, a) for a in values])[index.reshape(alphas.shape), np.arange(depth)]
        hits = self.u[rows[:, None], pos] < accept
        return np.cumprod(hits, axis=1).sum(axis=1)


def selector_observer(selector) -> Callable[..., None]:
    """``observe`` for :func:`run_static_batch` that feeds a :class:`~.selector.StrategySelector`."""
    def observe(strategy, batch_size, emitted, seconds, accepted, rows, progress, running_rows=None,
                rows_accepted=None):
        # rows None: the counts are the whole batch's; the progress is the engine's measure (plain steps: none)
        selector.update(strategy, batch_size, emitted, seconds, accepted, accepted_rows=rows,
                        batch_progress=progress if strategy.num_steps else None, running_rows=running_rows,
                        rows_accepted=rows_accepted)
    return observe


def static_batches(batch_sizes: Sequence[int] = (1, 4, 32), budget: int = 128, seed: int = 0) -> List[StaticBatch]:
    """Per batch size: acceptance spread like a trained EAGLE drafter's (Beta(2, 3) per request), like n-gram
    drafts on chat (80% of requests near 0.08, 20% near 0.75), and one level for all (0.5)."""
    out = []
    for size in batch_sizes:
        rng = np.random.default_rng(seed + size)
        mixed = np.where(rng.random(size) < 0.2, rng.beta(6, 2, size), rng.beta(1, 12, size))
        out += [StaticBatch(f"static batch B={size}, eagle-like", rng.beta(2, 3, size), budget),
                StaticBatch(f"static batch B={size}, ngram-like", mixed, budget),
                StaticBatch(f"static batch B={size}, uniform 0.5", np.full(size, 0.5), budget)]
    return out


def good_drafter_batches(batch_sizes: Sequence[int] = (16, 64), budget: int = 128, seed: int = 0) -> List[StaticBatch]:
    """Per batch size: a 7B-class target (:class:`~.simulate.StepCost`'s defaults: a draft depth ~7% of the step, a
    wide tree FLOP-bound at large batches) with a drafter that pays, acceptance Beta(7, 3) per request (mean 0.7,
    requests alike): a uniform-length benchmark where speculation gains at every size, the case a loss budget must
    not give away (docs/RUNTIME.md, "The loss budget")."""
    out = []
    for size in batch_sizes:
        rng = np.random.default_rng(seed * 100 + size)
        out.append(StaticBatch(f"static batch B={size}, 7B, good drafter", rng.beta(7, 3, size), budget, StepCost()))
    return out


def grpo_batch(size: int = 64, budget: int = 256, seed: int = 0) -> StaticBatch:
    """A GRPO rollout's batch at temperature 1 with n-gram drafts, as ``python -m bench rl`` runs it on the default
    model: half the responses run to the token budget, the others stop at a uniform point of it (an EOS), and the
    acceptance is low and uneven (Beta(1, 6) per request: mean 0.14, a tenth of the requests below 0.02); n-gram
    step times (:data:`NGRAM_MODEL_COST`)."""
    rng = np.random.default_rng(seed)
    budgets = np.where(rng.random(size) < 0.5, budget, rng.integers(budget // 10, budget, size))
    return StaticBatch(f"static batch B={size}, GRPO-like (n-gram, T = 1)", rng.beta(1, 6, size), budget,
                       NGRAM_MODEL_COST, budgets=[int(b) for b in budgets])


def ngram_tail_batch(size: int = 32, budget: int = 256, seed: int = 0) -> StaticBatch:
    """The rollout suite's long-tailed batch with n-gram drafts: log-normal lengths (median 33 tokens, sigma 1, the
    longest at the budget), text the matcher cannot follow at Beta(1, 12) acceptance, and copy phases
    (:class:`CopyPhases`: a repetition the matcher follows, accepted at 0.9, entered with probability 0.03 a token and
    left with 0.06), as the real model's traces show them (docs/RUNTIME.md); n-gram step times."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.round(np.exp(math.log(33) + rng.standard_normal(size))), 1, budget).astype(np.int64)
    lengths[np.argmax(lengths)] = budget
    return StaticBatch(f"static batch B={size}, long tail (n-gram copy phases)", rng.beta(1, 12, size), budget,
                       NGRAM_MODEL_COST, budgets=[int(b) for b in lengths], copy_phases=CopyPhases(0.03, 0.06))
