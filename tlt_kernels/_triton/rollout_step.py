"""Triton rollout step: a decoding step's token bookkeeping (emit, commit, the staging vector) in one launch.

The torch path (:meth:`tlt_kernels.engine.state.RolloutState.emit`, ``commit`` and ``stage_counts``) takes about 45
small kernels per step; on a GPU each launch costs host time, which bounds the step of a small model. This kernel
does the same in one launch, with the same results (checked against the torch path in
``tests/engine/test_rollout_step_kernel.py``).

Grid ``(1,)``: one program holds the step's ``b`` rows (``BLOCK_B``) and ``T`` tree columns (``BLOCK_T``), so the
sums over rows are plain ``tl.sum`` and no atomics are needed. The rows are distinct, so no two lanes touch one
request's state. The only cross-lane dependency is the total of ``generated`` over all ``B`` requests, which needs
this step's updates: they are stored, the program's threads synchronize, then all ``B`` are loaded.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

MAX_ROWS = 1024  # one program holds every row: beyond this the tile would not fit a thread block's registers


class StepOutputs(NamedTuple):
    """The kernel's outputs: ``values`` int64 ``[staged_length(b, depth)]`` (the staging vector, laid out as
    ``RolloutState.stage_counts`` builds it), ``counts`` int64 ``[b]``, ``finished`` / ``failed`` / ``was_done`` /
    ``keep`` bool ``[b]``."""

    values: torch.Tensor
    counts: torch.Tensor
    finished: torch.Tensor
    failed: torch.Tensor
    was_done: torch.Tensor
    keep: torch.Tensor


# The compiled variant depends only on the dtypes and the block sizes: no specialization on the ints' values (b == 1,
# multiples of 16) or the pointers' alignment, which change with the batch from step to step. Each new variant is a
# JIT compile of hundreds of milliseconds in the middle of a rollout.
_INT_ARGS = ["b", "T", "B", "depth", "eos", "stride_e0", "stride_e1", "stride_o0", "stride_o1"]
_POINTER_ARGS = ["Rows", "Emitted", "NumAcc", "Error", "NewCtx", "Out", "Generated", "MaxNew", "Done", "CtxLens",
                 "Offsets", "Roots", "Values", "Counts", "Finished", "Failed", "WasDone", "Keep"]


@triton.jit(do_not_specialize=_INT_ARGS, do_not_specialize_on_alignment=_POINTER_ARGS)
def _rollout_step_kernel(
    Rows, Emitted, NumAcc, Error, NewCtx,
    Out, Generated, MaxNew, Done, CtxLens, Offsets, Roots,
    Values, Counts, Finished, Failed, WasDone, Keep,
    b, T, B, depth, eos, stride_e0, stride_e1, stride_o0, stride_o1,
    HAS_EOS: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_ALL: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    i = tl.arange(0, BLOCK_B)
    in_b = i < b
    j = tl.arange(0, BLOCK_T).to(tl.int64)
    row = tl.load(Rows + i, mask=in_b, other=0).to(tl.int64)
    n_acc = tl.load(NumAcc + i, mask=in_b, other=0).to(tl.int64)
    # A row that finished at an earlier step (overlapped steps) changes nothing; a failed one emits nothing.
    was_done = (tl.load(Done + row, mask=in_b, other=0) != 0) & in_b
    failed = (tl.load(Error + i, mask=in_b, other=0) != 0) & ~was_done & in_b
    keep = was_done | failed
    gen = tl.load(Generated + row, mask=in_b, other=0)
    max_new = tl.load(MaxNew + row, mask=in_b, other=0)
    tile = in_b[:, None] & (j[None, :] < T)
    emitted = tl.load(Emitted + i[:, None].to(tl.int64) * stride_e0 + j[None, :] * stride_e1, mask=tile, other=-1)

    # Budget: the accepted tokens and the target's, up to what the request may still generate.
    counts = tl.minimum(n_acc + 1, max_new - gen)
    finished = keep
    if HAS_EOS:
        # EOS: the first EOS among the tokens to emit is the last one emitted, and the request finishes.
        is_eos = (emitted == eos) & (j[None, :] < counts[:, None]) & tile
        first_eos = tl.min(tl.where(is_eos, j[None, :], T), axis=1)
        counts = tl.minimum(counts, first_eos + 1)
        finished = finished | (first_eos < T)
    counts = tl.where(keep | ~in_b, 0, counts)

    # Emit: output_tokens[row, gen + j] for j < counts (the sink column W - 1 is never written: it stays -1).
    out = Out + row[:, None] * stride_o0 + (gen[:, None] + j[None, :]) * stride_o1
    tl.store(out, tl.maximum(emitted, 0), mask=tile & (j[None, :] < counts[:, None]))
    gen = gen + counts
    finished = (finished | (gen >= max_new)) & in_b
    tl.store(Generated + row, gen, mask=in_b)
    tl.store(Done + row, finished, mask=in_b)

    # Commit: rows that keep their state (finished before, or failed: its -1 token must not become the root) keep
    # context length, Philox counter and root; the others take the accepted path's (root = emitted[num_accepted]).
    commit = in_b & ~keep
    tl.store(CtxLens + row, tl.load(NewCtx + i, mask=commit, other=0), mask=commit)
    tl.store(Offsets + row, tl.load(Offsets + row, mask=commit, other=0) + 1, mask=commit)
    root = tl.sum(tl.where(j[None, :] == n_acc[:, None], emitted, 0), axis=1)
    tl.store(Roots + row, root, mask=commit)

    tl.store(Counts + i, counts, mask=in_b)
    tl.store(Finished + i, finished, mask=in_b)
    tl.store(Failed + i, failed, mask=in_b)
    tl.store(WasDone + i, was_done, mask=in_b)
    tl.store(Keep + i, keep, mask=in_b)
    _stage(Values, NewCtx, Generated, i, in_b, commit, n_acc, counts, max_new - gen + counts, finished, failed,
           was_done, b, B, depth, BLOCK_ALL, BLOCK_D)


@triton.jit
def _stage(Values, NewCtx, Generated, i, in_b, live, n_acc, counts, left, finished, failed, was_done, b, B, depth,
           BLOCK_ALL: tl.constexpr, BLOCK_D: tl.constexpr):
    """The staging vector: finished, failed, was_done, new context lengths (``[b]`` each), emitted tokens, tried
    tokens (accepted + 1 of the live rows), generated tokens of all ``B``, rows reaching each depth 1..depth; with
    ``depth`` > 0 then the lagging rows (live rows with the most tokens ``left`` before the step), how many of them
    reached each depth, and how far the step moved the batch's end."""
    tl.store(Values + i, finished.to(tl.int64), mask=in_b)
    tl.store(Values + b + i, failed.to(tl.int64), mask=in_b)
    tl.store(Values + 2 * b + i, was_done.to(tl.int64), mask=in_b)
    tl.store(Values + 3 * b + i, tl.load(NewCtx + i, mask=in_b, other=0).to(tl.int64), mask=in_b)
    tl.store(Values + 4 * b, tl.sum(counts, axis=0))
    tl.store(Values + 4 * b + 1, tl.sum(tl.where(live, n_acc + 1, 0), axis=0))
    # Every thread's update of ``generated`` is visible to the whole program after the barrier (one thread block).
    tl.debug_barrier()
    every = tl.arange(0, BLOCK_ALL)
    tl.store(Values + 4 * b + 2, tl.sum(tl.load(Generated + every, mask=every < B, other=0), axis=0))
    d = tl.arange(0, BLOCK_D).to(tl.int64)
    reached = live[:, None] & (n_acc[:, None] >= d[None, :] + 1)
    tl.store(Values + 4 * b + 3 + d, tl.sum(reached.to(tl.int64), axis=0), mask=d < depth)
    most_left = tl.max(tl.where(live, left, -1), axis=0)  # -1: no live row
    lagging = live & (left == most_left)
    tl.store(Values + 4 * b + 3 + depth, tl.sum(lagging.to(tl.int64), axis=0), mask=depth > 0)
    lagging_reached = lagging[:, None] & (n_acc[:, None] >= d[None, :] + 1)
    tl.store(Values + 4 * b + 4 + depth + d, tl.sum(lagging_reached.to(tl.int64), axis=0), mask=d < depth)
    # How far the step moved the batch's end: the most tokens left before it less the most a live row that did not
    # finish has left after it (engine/state.py's end_progress).
    after = tl.max(tl.where(live & ~finished, left - counts, 0), axis=0)
    tl.store(Values + 4 * b + 4 + 2 * depth, tl.maximum(most_left, 0) - after, mask=depth > 0)


def staged_length(b: int, depth: int) -> int:
    """Length of a step's staging vector: 4 entries per row, 3 totals, and with drafts ``2 * depth + 2`` counts."""
    return 4 * b + 3 + (2 * depth + 2 if depth > 0 else 0)


def _num_warps(cells: int) -> int:
    """Warps for a ``[BLOCK_B, BLOCK_T]`` tile of int64: about 16 elements a thread, 1 to 16 warps."""
    return max(1, min(16, triton.next_power_of_2(cells) // 512))


def block_sizes(b: int, T: int, B: int, depth: int, block_rows: Optional[int] = None,
                block_tokens: Optional[int] = None) -> tuple:
    """``(BLOCK_B, BLOCK_T, BLOCK_ALL, BLOCK_D)`` of a launch: the caller's bounds when given (an engine passes its
    own, so that every step of every rollout runs one compiled variant), else the smallest powers of two."""
    for name, value, need in (("block_rows", block_rows, B), ("block_tokens", block_tokens, max(T, depth))):
        if value is not None and (value < need or value & (value - 1)):
            raise ValueError(f"rollout_step: {name} must be a power of two >= {need}, got {value}")
    block_all = triton.next_power_of_2(B) if block_rows is None else block_rows
    block_t = triton.next_power_of_2(T) if block_tokens is None else block_tokens
    block_b = triton.next_power_of_2(b) if block_rows is None else min(block_all, MAX_ROWS)
    block_d = triton.next_power_of_2(max(depth, 1)) if block_tokens is None else block_t
    return block_b, block_t, block_all, block_d


def rollout_step(rows, emitted, num_accepted, error, new_context_lens, eos_token_id: Optional[int], depth: int,
                 output_tokens, generated, max_new_tokens, done, context_lens, offsets, root_tokens,
                 block_rows: Optional[int] = None, block_tokens: Optional[int] = None) -> StepOutputs:
    """Launch the step's bookkeeping. Inputs of ``b`` rows: ``rows`` int64 ``[b]`` (distinct requests),
    ``emitted`` int64 ``[b, T]``, ``num_accepted`` int32/int64 ``[b]``, ``error`` bool/int ``[b]``,
    ``new_context_lens`` int32 ``[b]``. State of ``B`` requests, updated in place: ``output_tokens`` int64
    ``[B, W]``, ``generated`` / ``max_new_tokens`` int64 ``[B]``, ``done`` bool ``[B]``, ``context_lens`` int32
    ``[B]``, ``offsets`` / ``root_tokens`` int64 ``[B]``. No host read: the caller stages ``values`` to the host.
    ``block_rows`` (a power of two >= ``B``) and ``block_tokens`` (>= ``T`` and ``depth``) fix the tile, so
    steps of any ``b``, ``T`` and depth below them share one compiled kernel; default: fitted to this call."""
    b, T = emitted.shape
    B = generated.shape[0]
    assert 1 <= b <= MAX_ROWS and rows.shape == (b,), (b, tuple(rows.shape))
    assert T >= 1 and depth >= 0 and generated.is_contiguous() and done.dtype == torch.bool
    block_b, block_t, block_all, block_d = block_sizes(b, T, B, depth, block_rows, block_tokens)
    dev = emitted.device
    values = torch.empty(staged_length(b, depth), dtype=torch.int64, device=dev)
    counts = torch.empty(b, dtype=torch.int64, device=dev)
    flags = torch.empty(4, b, dtype=torch.bool, device=dev)  # finished, failed, was_done, keep: one allocation
    _rollout_step_kernel[(1,)](
        rows, emitted, num_accepted, error, new_context_lens,
        output_tokens, generated, max_new_tokens, done, context_lens, offsets, root_tokens,
        values, counts, flags[0], flags[1], flags[2], flags[3],
        b, T, B, depth, 0 if eos_token_id is None else int(eos_token_id),
        emitted.stride(0), emitted.stride(1), output_tokens.stride(0), output_tokens.stride(1),
        HAS_EOS=eos_token_id is not None, BLOCK_B=block_b, BLOCK_T=block_t, BLOCK_ALL=block_all, BLOCK_D=block_d,
        num_warps=_num_warps(block_b * block_t),
    )
    return StepOutputs(values, counts, flags[0], flags[1], flags[2], flags[3])
