"""What a rollout carries from step to step (:class:`RolloutState`) and the step's token bookkeeping: emitting
up to each request's budget and EOS, committing the accepted path, and the one host transfer per step."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, NamedTuple, Optional, Tuple

import torch

from ..ops.rollout_step import MAX_ROWS as KERNEL_MAX_ROWS, can_run_on as kernel_can_run_on, rollout_step
from .records import StepLog


def ints_on_device(values: List[int], device: torch.device) -> torch.Tensor:
    """``values`` (host ints: request rows, token budgets) as int64 ``[len(values)]`` on ``device``, without a sync:
    on CUDA the copy goes through pinned memory, non-blocking (a copy from pageable memory would wait for the stream
    to drain)."""
    host = torch.tensor(values, dtype=torch.int64)
    if device.type == "cuda":
        host = host.pin_memory()  # the caching host allocator keeps it alive until the copy ran
    return host.to(device, non_blocking=True)


class Emission(NamedTuple):
    """One step's emitted counts: ``counts`` int64 ``[b]`` (0 for a failed or already finished row), ``finished``
    bool ``[b]`` (budget reached, EOS emitted, failed, or finished before), ``failed`` bool ``[b]`` (the target's
    logits held NaN/+inf on the row's path this step), ``was_done`` bool ``[b]`` (the row had finished at an earlier
    step whose outcome the host had not read when this step was launched: the step changes nothing of it),
    ``keep`` bool ``[b]`` (``was_done | failed``: the rows whose state the commit keeps), ``left`` int64 ``[b]``
    (tokens each row had left of its budget before the step; None from the step kernel, which stages its own)."""

    counts: torch.Tensor
    finished: torch.Tensor
    failed: torch.Tensor
    was_done: torch.Tensor
    keep: torch.Tensor
    left: Optional[torch.Tensor] = None


class StagedCounts(NamedTuple):
    """A step's outcome on its way to the host: ``values`` (int64, pinned host memory on CUDA, written by a
    non-blocking copy), ``ready`` (a CUDA event recorded after the copy; None on the CPU), the step's ``rows``
    (host list), its per-depth ``depth`` and how many ``extra`` values end the vector (the counterfactual counts)."""

    values: torch.Tensor
    ready: Any
    rows: List[int]
    depth: int
    extra: int = 0


class LaunchedStep(NamedTuple):
    """A step whose work is queued on the device and whose outcome is on its way to the host: its ``strategy``,
    tree ``width``, whether it ``replayed`` graphs, the ``staged`` outcome and when it was ``started``."""

    strategy: Any
    width: int
    replayed: bool
    staged: StagedCounts
    started: float


class StepCounts(NamedTuple):
    """The host's copy of a step's outcome (one transfer): ``finished`` / ``failed`` / ``was_done`` lists of ``b``
    bools (Python lists: the host's bookkeeping then costs no tensor op), ``emitted`` tokens, ``tried`` (accepted + 1
    summed over rows that neither failed nor had finished), ``generated`` tokens so far, ``accepted_per_depth`` (rows
    whose path reached depth 1..num_steps; None when nobody asked), ``lagging_rows`` (live rows with the most tokens
    left before the step: a static batch finishes when they do) and ``lagging_accepted_per_depth`` (how many of them
    reached each depth) and ``progress`` (how far the step moved the batch's end: the live rows' most tokens left
    before it less the most any of them that did not finish has left after it; all three None when nobody asked)
    and, when asked for (``read_counts(per_row=True)``), ``row_tokens``: the tokens each of the step's rows committed,
    its context's growth (accepted drafts + 1; 0 for a row that failed or had finished before); ``extra``: the values
    staged after the outcome (:class:`~tlt_kernels.engine.counterfactual.CounterfactualScorer`'s), else None."""

    finished: List[bool]
    failed: List[bool]
    was_done: List[bool]
    emitted: int
    tried: int
    generated: int
    accepted_per_depth: Optional[list]
    lagging_rows: Optional[int] = None
    lagging_accepted_per_depth: Optional[list] = None
    progress: Optional[int] = None
    row_tokens: Optional[List[int]] = None
    extra: Optional[List[int]] = None


def most_left(left: torch.Tensor, live: Optional[torch.Tensor] = None) -> torch.Tensor:
    """bool ``[b]``: the rows (of ``live`` ones, bool ``[b]``; None: all) with the most tokens ``left`` (int64 ``[b]``):
    the lagging rows, which a static batch finishes with (the step kernel stages its own by the same rule)."""
    if live is None:
        return left == left.max()
    return live & (left == torch.where(live, left, torch.full_like(left, -1)).max())


def end_progress(emission: Emission, live: torch.Tensor) -> torch.Tensor:
    """int64 ``[1]``: how far a step moved its batch's end (a static batch ends with its slowest request): the
    ``live`` rows' (bool ``[b]``) most tokens left before the step less the most that any of them that did not finish
    has left after it (0 where none is left). The loss budget's exact progress (the step kernel stages the same)."""
    zero = torch.zeros_like(emission.left)
    before = torch.where(live, emission.left, zero).max()
    after = torch.where(live & ~emission.finished, emission.left - emission.counts, zero).max()
    return (before - after).view(1)


@dataclass
class RolloutState:
    """A rollout of ``B`` requests. Device tensors: ``block_table`` int32 ``[B, blocks]`` (their KV blocks),
    ``context_lens`` int32 ``[B]`` (committed tokens), ``offsets`` int64 ``[B]`` (Philox counter, one per step),
    ``root_tokens`` int64 ``[B]`` (last emitted token), ``output_tokens`` int64 ``[B, W]`` (generated tokens, -1 past
    them; column ``W - 1`` is a write sink), ``generated`` int64 ``[B]``, ``max_new_tokens`` int64 ``[B]``.
    Host (Python lists, kept up to date from the step's one transfer): ``active_rows`` (requests still running),
    ``context_lens_host`` (``context_lens`` of every request, exact for the running ones: the eager attention
    plan's ``max_context_len``, which it would otherwise read from the device), ``finish_s`` (seconds from the start
    at which each request finished), ``errors`` (failed requests), ``steps`` (the step log), ``deferred`` (finished
    requests whose features wait for the spot trainer to stop before entering the buffer); and the rollout's
    sampling parameters, EOS id, feature capture, spot-training session, progress bar and trace."""

    block_table: torch.Tensor
    context_lens: torch.Tensor
    offsets: torch.Tensor
    root_tokens: torch.Tensor
    output_tokens: torch.Tensor
    generated: torch.Tensor
    max_new_tokens: torch.Tensor
    active_rows: List[int]
    context_lens_host: List[int]
    start_time: float
    prefill_s: float
    start_batch_size: int
    finish_s: List[float]
    errors: List[int]
    sampling: Any = None  # RequestSampling: per-request sampling parameters
    eos_token_id: Optional[int] = None
    features: Any = None  # FeatureCapture for the rollout buffer, or None
    spot: Any = None  # SpotSession
    progress: Any = None  # ProgressBar
    trace: Optional[list] = None  # where probe records go (generate's ``trace``)
    steps: List[StepLog] = field(default_factory=list)
    deferred: List[int] = field(default_factory=list)
    done: Optional[torch.Tensor] = None  # bool [B] on the device: finished, as the device knows it
    overlap: bool = False  # launch a step before reading the previous one's outcome (SpeculativeEngine.overlap_steps)
    # finish_step in one Triton launch: True, False, or None = on CUDA tensors only (SpeculativeEngine.step_kernel)
    step_kernel: Optional[bool] = None
    # The step kernel's (block_rows, block_tokens): the engine's bounds, so that one compiled variant serves every
    # step of every rollout (None: fitted to each step, a new JIT compile whenever the batch crosses a power of two)
    step_blocks: Optional[Tuple[int, int]] = None
    pending: Optional[LaunchedStep] = None  # the launched step whose outcome the host has not read
    tokens_so_far: int = 0  # tokens generated over the batch, as of the last step the host read
    last_read_s: float = 0.0  # perf_counter when the host last read a step's outcome
    # CUDA event (timing) at the end of the last step read, or of the prefill: the next step's time starts there
    last_end: Any = None
    # float32 [B, W, 2]: the sampling and raw log-probs of output_tokens' tokens (same columns), or None (not scored)
    output_scores: Optional[torch.Tensor] = None
    # The start's outcome on its way to the host (done and failed flags of every request after its first token),
    # read with the first step's (settle_start); None once read
    start_outcome: Optional[StagedCounts] = None
    _active_on_device: Optional[torch.Tensor] = None
    _active_block_table: Optional[torch.Tensor] = None
    _aranges: dict = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        """Requests still running."""
        return len(self.active_rows)

    def active_on_device(self) -> torch.Tensor:
        """The device copy of ``active_rows`` (made again only when requests finish; :func:`ints_on_device`)."""
        if self._active_on_device is None:
            self._active_on_device = ints_on_device(self.active_rows, self.generated.device)
            self._active_block_table = None
        return self._active_on_device

    def active_block_table(self) -> torch.Tensor:
        """``block_table`` of the running rows, gathered again only when requests finish (the table is constant)."""
        if self._active_block_table is None:
            self._active_block_table = self.block_table[self.active_on_device()]
        return self._active_block_table

    def max_context_len(self) -> int:
        """An upper bound of the running requests' contexts from the host copy (no device read): exact, plus the
        tree width of a launched step the host has not read yet (it adds at most that many tokens)."""
        growth = self.pending.width if self.pending is not None else 0
        return max(self.context_lens_host[row] for row in self.active_rows) + growth

    def arange(self, start: int, end: int, device) -> torch.Tensor:
        """``torch.arange(start, end)`` on ``device``, made once per rollout (a constant: no launch per step)."""
        key = (start, end, str(device))
        if key not in self._aranges:
            self._aranges[key] = torch.arange(start, end, device=device)
        return self._aranges[key]

    @classmethod
    def stage_start(cls, done: torch.Tensor, failed: torch.Tensor) -> StagedCounts:
        """Start copying which requests finished at their first token (``done`` bool ``[B]``) and which of them
        failed (``failed`` bool ``[B]``) to the host, without waiting (:meth:`settle_start` reads it)."""
        B = done.shape[0]
        return cls._to_host(torch.cat([done, failed]).to(torch.int64), list(range(B)), 0)

    def settle_start(self) -> None:
        """Requests that finished at their first token (a budget of one, EOS, or logits the prefill's verify flagged)
        leave the batch, finished at the prefill's end; failed ones join :attr:`errors`. Read once, before the first
        step's outcome (the copy was queued before that step, so this waits for nothing more). The steps launched
        before it ran such rows as finished ones (``Emission.was_done``: nothing emitted, no state changed)."""
        staged, self.start_outcome = self.start_outcome, None
        if staged is None:
            return
        if staged.ready is not None:
            staged.ready.synchronize()
        flags = staged.values.tolist()
        B = len(staged.rows)
        ended = [b for b in range(B) if flags[b]]
        for b in ended:
            self.finish_s[b] = self.prefill_s
        self.errors += [b for b in range(B) if flags[B + b]]
        leaving = set(ended)
        if any(row in leaving for row in self.active_rows):
            self.active_rows = [row for row in self.active_rows if row not in leaving]
            self._active_on_device = None

    def emit(self, rows, emitted, num_accepted, failed, eos_token_id) -> Emission:
        """Write each row's accepted tokens (``emitted`` int64 ``[b, T]``, ``num_accepted`` int64 ``[b]``) up to
        its budget, cut after EOS; ``failed`` bool ``[b]`` rows, and rows that finished at an earlier step, emit
        nothing. Marks the rows that finish in :attr:`done`."""
        width = emitted.shape[1]
        j = self.arange(0, width, emitted.device).unsqueeze(0)
        was_done = self.done[rows]
        failed = failed & ~was_done
        budget_left = self.max_new_tokens[rows]
        left = budget_left - self.generated[rows]
        counts = torch.minimum(num_accepted + 1, left)
        if eos_token_id is not None:
            is_eos = (emitted == eos_token_id) & (j < counts.unsqueeze(1))
            first_eos = torch.where(is_eos, j, torch.full_like(j, width)).min(1).values
            counts = torch.minimum(counts, first_eos + 1)
        counts = counts.masked_fill(failed | was_done, 0)
        self._write_columns(self.output_tokens, rows, self.generated[rows], counts, emitted.clamp(min=0), fill=-1)
        self.generated[rows] += counts
        finished = (self.generated[rows] >= budget_left) | failed | was_done
        if eos_token_id is not None:
            finished |= first_eos < width
        self.done[rows] = finished
        return Emission(counts, finished, failed, was_done, failed | was_done, left)

    def record_scores(self, rows, start, counts, scores) -> None:
        """Store a step's log-probs (``scores`` float32 ``[b, T, 2]``, aligned with ``emitted``) beside the tokens
        :meth:`emit` wrote: row ``r``'s first ``counts[r]`` at columns ``start[r]`` on (``start`` int64 ``[b]``:
        ``generated`` before the step), the rest into the sink column. Device ops only."""
        self._write_columns(self.output_scores, rows, start, counts, scores.to(self.output_scores.dtype), fill=0.0)

    def _write_columns(self, table, rows, start, counts, values, fill) -> None:
        """``table[rows[r], start[r] + j] = values[r, j]`` for ``j < counts[r]`` (``values`` ``[b, T, ...]``); the
        other writes go to the table's last column, a sink reset to ``fill``. Device ops only (no data-dependent
        shape)."""
        j = self.arange(0, values.shape[1], values.device).unsqueeze(0)
        sink = table.shape[1] - 1
        positions = torch.where(j < counts.unsqueeze(1), start.unsqueeze(1) + j, torch.full_like(j, sink))
        out_rows = table[rows]
        out_rows.scatter_(1, positions.view(*positions.shape, *[1] * (values.dim() - 2)).expand_as(values), values)
        out_rows[:, sink] = fill
        table[rows] = out_rows

    def commit(self, rows, new_context_lens, emitted, num_accepted, keep) -> None:
        """The accepted path becomes context: new context lengths, the next Philox counter, the new root token;
        ``keep`` bool ``[b]`` rows (finished before, or failed) keep theirs."""
        self.context_lens[rows] = torch.where(keep, self.context_lens[rows], new_context_lens)
        self.offsets[rows] += (~keep).to(torch.int64)
        roots = emitted.gather(1, num_accepted.unsqueeze(1)).squeeze(1)
        self.root_tokens[rows] = torch.where(keep, self.root_tokens[rows], roots)

    def lagging(self, rows: torch.Tensor) -> torch.Tensor:
        """bool ``[b]``: which of the running ``rows`` (int64 ``[b]``) have the most tokens left, finished ones left out
        (the rows a static batch waits for; :meth:`stage_counts` counts their acceptance for the selector)."""
        return most_left(self.max_new_tokens[rows] - self.generated[rows], ~self.done[rows])

    def stage_counts(self, emission: Emission, num_accepted, new_context_lens, rows: List[int],
                     depth: int, extra: Optional[torch.Tensor] = None) -> StagedCounts:
        """Start the step's one device-to-host transfer: everything the host needs, concatenated, copied without
        blocking into pinned memory (each blocking read stalls the CPU until the GPU drains, so the next step's
        launches could not overlap this step's kernels). :meth:`read_counts` waits for it. ``depth`` > 0 also
        counts acceptance per draft depth; ``extra`` (int64) travels at the end."""
        live = ~emission.keep
        parts = [emission.finished.to(torch.int64), emission.failed.to(torch.int64),
                 emission.was_done.to(torch.int64), new_context_lens.to(torch.int64),
                 emission.counts.sum().view(1), (num_accepted + 1).masked_fill(~live, 0).sum().view(1),
                 self.generated.sum().view(1)]
        if depth > 0:
            reached = num_accepted.unsqueeze(1) >= self.arange(1, depth + 1, num_accepted.device)
            parts.append((reached & live.unsqueeze(1)).sum(0))
            lagging = most_left(emission.left, live)
            parts += [lagging.sum().view(1), (reached & lagging.unsqueeze(1)).sum(0), end_progress(emission, live)]
        return self._to_host(torch.cat(parts), rows, depth, extra)

    @staticmethod
    def _to_host(values: torch.Tensor, rows: List[int], depth: int,
                 extra: Optional[torch.Tensor] = None) -> StagedCounts:
        """Start copying the staging vector ``values`` (int64), then ``extra`` (int64, or None), to pinned host memory,
        non-blocking, and record an event after it (CUDA); on the CPU it is already there."""
        num_extra = 0
        if extra is not None:
            values, num_extra = torch.cat([values, extra]), extra.numel()
        if values.device.type != "cuda":
            return StagedCounts(values, None, rows, depth, num_extra)
        host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        host.copy_(values, non_blocking=True)
        ready = torch.cuda.Event(enable_timing=True)  # also the step's end on the GPU's clock (the step's time)
        ready.record()
        return StagedCounts(host, ready, rows, depth, num_extra)

    def finish_step(self, rows, emitted, num_accepted, error, new_context_lens, eos_token_id, depth: int,
                    active_rows: List[int], use_kernel: Optional[bool] = None, extra: Optional[torch.Tensor] = None):
        """A step's bookkeeping once verify ran: :meth:`emit`, :meth:`commit` (rows in ``Emission.keep`` keep their
        state) and :meth:`stage_counts`, in that order; returns ``(Emission, StagedCounts)``. ``rows`` int64
        ``[b]`` (device), ``emitted`` int64 ``[b, T]``, ``num_accepted`` int64 ``[b]``, ``error`` bool or int
        ``[b]`` (verify failed), ``new_context_lens`` int32 ``[b]``; ``active_rows`` the host's list of the rows.

        ``use_kernel`` (default: the rollout's :attr:`step_kernel`; ``None`` there means on CUDA tensors; at most
        1024 rows, on a device the kernel runs on) does all three in one Triton launch
        (:func:`tlt_kernels.ops.rollout_step.rollout_step`; on the CPU only under Triton's interpreter), with the same
        results. Neither path reads the device: the staging vector goes to the host by a non-blocking copy, with
        ``extra`` (int64, or None) at its end (:attr:`StepCounts.extra`)."""
        if use_kernel is None:
            # More rows than the kernel's one program holds (a shape: no device read), or a device it cannot run on:
            # the torch path.
            wanted = emitted.is_cuda if self.step_kernel is None else self.step_kernel
            use_kernel = wanted and emitted.shape[0] <= KERNEL_MAX_ROWS and kernel_can_run_on(emitted.device)
        if not use_kernel:
            failed = error if error.dtype == torch.bool else error != 0
            emission = self.emit(rows, emitted, num_accepted, failed, eos_token_id)
            self.commit(rows, new_context_lens, emitted, num_accepted, emission.keep)
            return emission, self.stage_counts(emission, num_accepted, new_context_lens, active_rows, depth, extra)
        out = rollout_step(rows, emitted, num_accepted, error, new_context_lens, eos_token_id, depth,
                           self.output_tokens, self.generated, self.max_new_tokens, self.done, self.context_lens,
                           self.offsets, self.root_tokens, *(self.step_blocks or ()))
        emission = Emission(out.counts, out.finished, out.failed, out.was_done, out.keep)
        return emission, self._to_host(out.values, active_rows, depth, extra)

    def read_counts(self, staged: StagedCounts, per_row: bool = False) -> StepCounts:
        """The host's copy of a staged step's outcome (waits for that step's transfer only). Also updates
        ``context_lens_host`` of the step's rows that were still running; ``per_row`` also returns each row's
        committed tokens (``StepCounts.row_tokens``), from the same read."""
        if staged.ready is not None:
            staged.ready.synchronize()
        host = staged.values.tolist()
        extra = None
        if staged.extra:
            host, extra = host[:-staged.extra], host[-staged.extra:]
        b = len(staged.rows)
        finished, failed, was_done = ([bool(v) for v in host[k * b:(k + 1) * b]] for k in range(3))
        new_lens = host[3 * b: 4 * b]
        row_tokens = self._row_tokens(staged.rows, was_done, new_lens) if per_row else None
        for row, done_before, context_len in zip(staged.rows, was_done, new_lens):
            if not done_before:
                self.context_lens_host[row] = context_len
        emitted, tried, generated = host[4 * b: 4 * b + 3]
        depth = staged.depth
        if depth == 0:
            return StepCounts(finished, failed, was_done, emitted, tried, generated, None, row_tokens=row_tokens,
                              extra=extra)
        lagging = host[4 * b + 3 + depth: 4 * b + 5 + 2 * depth]
        return StepCounts(finished, failed, was_done, emitted, tried, generated, host[4 * b + 3: 4 * b + 3 + depth],
                          lagging[0], lagging[1:-1], lagging[-1], row_tokens, extra)

    def _row_tokens(self, rows: List[int], was_done: List[bool], new_lens: List[int]) -> List[int]:
        """Each row's context growth at a step whose new context lengths are ``new_lens`` (read in step order, so
        ``context_lens_host`` still holds the step before's); 0 for rows done before."""
        before = self.context_lens_host
        return [0 if done else new - before[row] for row, done, new in zip(rows, was_done, new_lens)]

    def retire(self, rows: List[int], counts: StepCounts, elapsed_s: float) -> List[int]:
        """Drop the step's ``rows`` that finished at this step from ``active_rows`` (rows that had finished before
        left at their own step); returns the ones that finished without an error (host lists)."""
        ended = [(row, failed) for row, finished, failed, done_before in
                 zip(rows, counts.finished, counts.failed, counts.was_done) if finished and not done_before]
        for row, _ in ended:
            self.finish_s[row] = elapsed_s
        self.errors += [row for row, failed in ended if failed]
        leaving = {row for row, _ in ended}
        self.active_rows = [row for row in self.active_rows if row not in leaving]
        self._active_on_device = None
        return [row for row, failed in ended if not failed]  # a failed row's features: NaN
