"""What a rollout returns: the per-step log (:class:`StepLog`), the result (:class:`GenerateOutput`), and the
progress bar drawn from the step records; :func:`tail_steps` picks the long tail's steps out of a log."""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch


@dataclass
class StepLog:
    """One decoding step: ``batch_size`` requests, ``strategy``, ``tree_width`` nodes each,
    ``emitted`` tokens in all, ``accepted_length`` = emitted / batch_size (drafts accepted + 1),
    ``seconds`` the step took (on CUDA the GPU's clock from the previous step's end to its own, the host's gaps before
    it included: ``SpeculativeEngine._step_seconds``), ``elapsed_s`` since the rollout started (host clock), ``graph``
    (replayed or eager)."""

    step: int
    batch_size: int
    strategy: str
    tree_width: int
    emitted: int
    accepted_length: float
    seconds: float
    elapsed_s: float
    graph: bool

    @property
    def tokens_per_s(self) -> float:
        return self.emitted / self.seconds if self.seconds > 0 else float("inf")


def tail_steps(steps: List[StepLog], num_requests: int) -> List[StepLog]:
    """The steps run with fewer than a quarter of the rollout's ``num_requests`` requests left (its long tail)."""
    return [step for step in steps if 4 * step.batch_size < num_requests]


@dataclass
class GenerateOutput:
    """Result of :meth:`SpeculativeEngine.generate`.

    ``tokens``: one list of generated ids per request (EOS included when hit). ``lengths``: int64
    ``[B]``. ``finish_s``: seconds from the start at which each request finished. ``steps``: the
    per-step log. ``wall_s``: rollout wall time (prefill included). ``spot``: spot-trainer stats
    (None when it did not run). ``errors``: the requests stopped because the target's logits on their path held
    NaN/+inf or only -inf (``verify_tree``'s error flag; a diverged policy): their ``tokens`` end before the step that
    failed, and they never enter the rollout buffer. ``generate`` also warns when the list is not empty.
    ``logprobs`` / ``raw_logprobs`` (engines built with ``logprobs=True``, else None): per request, one float per
    token of ``tokens``: its log-probability under the sampling distribution it was drawn from (temperature, top-k,
    top-p; 0 for greedy requests) and under the raw ``log_softmax`` of the target's logits
    (:func:`~tlt_kernels.verify_tree`'s ``return_logprobs`` / ``return_raw_logprobs``).
    """

    tokens: List[List[int]]
    lengths: torch.Tensor
    finish_s: List[float]
    steps: List[StepLog]
    wall_s: float
    prefill_s: float
    spot: Optional[dict] = None
    errors: List[int] = field(default_factory=list)
    logprobs: Optional[List[List[float]]] = None
    raw_logprobs: Optional[List[List[float]]] = None

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.wall_s if self.wall_s > 0 else float("inf")

    def strategies_by_batch(self) -> Dict[int, Dict[str, int]]:
        """``{batch_size: {strategy: steps}}`` over the rollout."""
        out: Dict[int, Dict[str, int]] = {}
        for s in self.steps:
            d = out.setdefault(s.batch_size, {})
            d[s.strategy] = d.get(s.strategy, 0) + 1
        return out

    def mean_accepted_length(self) -> float:
        """Tokens per request-step over the whole rollout (1.0 for plain decoding)."""
        rows = sum(s.batch_size for s in self.steps)
        return sum(s.emitted for s in self.steps) / rows if rows else 0.0


class ProgressBar:
    """A one-line progress bar on stderr, redrawn at most every ``interval`` seconds."""

    def __init__(self, total: int, enabled: bool, interval: float = 0.25):
        self.total, self.enabled, self.interval = total, enabled, interval
        self.last = 0.0

    def update(self, done: int, rec: StepLog, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if not force and now - self.last < self.interval:
            return
        self.last = now
        frac = done / max(1, self.total)
        bar = "#" * int(frac * 24)
        sys.stderr.write(
            f"\r[{bar:<24}] {done}/{self.total} tok | batch {rec.batch_size:>4} | {rec.strategy:<10} | "
            f"acc {rec.accepted_length:4.2f} | {rec.tokens_per_s:8.0f} tok/s"
        )
        if force:
            sys.stderr.write("\n")
        sys.stderr.flush()
