"""Triton top-k log-probabilities: the row's log-softmax normaliser and its ``k`` largest logits in one pass.

Each logit becomes one int64 rank key (:mod:`.rank_keys`: its fp32 bits in an order-preserving integer, then its
column), so "the k largest keys" is exactly the reference's top k, ties and special values included, and a key decodes
back to its logit and column.

Grid ``(rows, splits)``: a program reads its share of the row's columns once, tile by tile, keeping the running max
and sum of exponentials (the online softmax) and the ``k`` largest keys seen. A tile whose largest key does not beat
the k-th kept one costs no selection. With one split the program writes the result; with several (a few rows, a wide
vocabulary: the row is spread over SMs) each writes its partial (max, sum, keys) and a second launch per row merges
them. Logits are upcast to fp32 as loaded (bf16 / fp16 arithmetic would read as zeros in the interpreter).

Eager calls launch directly; otherwise the launches run inside the custom op ``tlt::top_logprobs`` (fake
implementation for ``torch.compile``; no host sync).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from .._backend import cuda_sm_count, direct_dispatch_ok
from .rank_keys import MAX_KEY, MIN_KEY, key_index, key_value, largest, rank_keys

MAX_BLOCK = 4096  # columns per tile
CPU_SM_COUNT = 16  # splits for the interpreter (CPU tensors): enough to exercise the merge at small widths
SPLIT_PROGRAMS_PER_SM = 2  # split rows until the grid holds about this many programs per SM


@triton.jit
def _store_result(OutLogp, OutTok, TokenIds, row, best, slots, x_max, sum_exp, K: tl.constexpr,
                  HAS_IDS: tl.constexpr):
    log_sum = tl.log(sum_exp)
    logp = (key_value(best) - x_max) - log_sum  # log_softmax's order of operations
    keep = slots < K
    column = key_index(best)
    if HAS_IDS:  # a column stands for the token TokenIds[column]: mapped here, not by a gather after the launch
        column = tl.load(TokenIds + column, mask=keep, other=0)
    tl.store(OutLogp + row * K + slots, logp, mask=keep)
    tl.store(OutTok + row * K + slots, column, mask=keep)


@triton.jit
def _top_logprobs_kernel(X, stride_row, V, OutLogp, OutTok, TokenIds, PartMax, PartSum, PartKey, K: tl.constexpr,
                         KP: tl.constexpr, BLOCK: tl.constexpr, SPLIT_TILES: tl.constexpr, FINAL: tl.constexpr,
                         HAS_IDS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    slots = tl.arange(0, KP)
    best = tl.full([KP], MIN_KEY, tl.int64)
    x_max = tl.full([], float("-inf"), tl.float32)
    sum_exp = tl.full([], 0.0, tl.float32)
    # A constexpr trip count: the interpreter takes no tensor bounds in range(). The last split may run past the row.
    for tile in range(SPLIT_TILES):
        cols = (split * SPLIT_TILES + tile) * BLOCK + tl.arange(0, BLOCK)
        valid = cols < V
        x = tl.load(X + row * stride_row + cols, mask=valid, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(x_max, tl.max(x, 0))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # an all -inf prefix adds nothing (no inf - inf)
        sum_exp = sum_exp * tl.exp(x_max - shift) + tl.sum(tl.exp(x - shift), 0)
        x_max = new_max
        keys = tl.where(valid, rank_keys(x, cols), MIN_KEY)
        kth = tl.min(tl.where(slots < K, best, MAX_KEY), 0)
        if tl.max(keys, 0) > kth:  # else nothing of this tile enters the top k
            best = largest(tl.join(best, largest(keys, slots, K)), slots, K)
    if FINAL:
        _store_result(OutLogp, OutTok, TokenIds, row, best, slots, x_max, sum_exp, K, HAS_IDS)
    else:
        part = row * tl.num_programs(1) + split
        tl.store(PartMax + part, x_max)
        tl.store(PartSum + part, sum_exp)
        tl.store(PartKey + part * KP + slots, best)


@triton.jit
def _top_logprobs_merge_kernel(PartMax, PartSum, PartKey, OutLogp, OutTok, TokenIds, num_splits,
                               K: tl.constexpr, KP: tl.constexpr, SP: tl.constexpr, HAS_IDS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    splits = tl.arange(0, SP)
    valid = splits < num_splits
    part = row * num_splits + splits
    maxes = tl.load(PartMax + part, mask=valid, other=float("-inf"))
    x_max = tl.max(maxes, 0)
    shift = tl.where(x_max == float("-inf"), 0.0, x_max)
    sum_exp = tl.sum(tl.load(PartSum + part, mask=valid, other=0.0) * tl.exp(maxes - shift), 0)
    slots = tl.arange(0, KP)
    keys = tl.load(PartKey + part[:, None] * KP + slots[None, :], mask=valid[:, None], other=MIN_KEY)
    _store_result(OutLogp, OutTok, TokenIds, row, largest(keys, slots, K), slots, x_max, sum_exp, K, HAS_IDS)


def default_splits(rows: int, tiles: int, sm_count: int) -> int:
    """Programs per row: one when the rows alone fill the GPU, else enough to hold about
    ``SPLIT_PROGRAMS_PER_SM * sm_count`` programs, at most one per tile."""
    want = -(-SPLIT_PROGRAMS_PER_SM * sm_count // max(rows, 1))
    return max(1, min(tiles, want))


def top_logprobs_out(logits: torch.Tensor, k: int, logp: torch.Tensor, tokens: torch.Tensor,
                     num_splits: int = 0, token_ids: Optional[torch.Tensor] = None) -> None:
    """Launch into ``logp`` (float32) and ``tokens`` (int64), contiguous ``[..., k]``; ``logits [..., V]`` with a
    unit last stride; ``token_ids`` (contiguous int64 ``[V]`` or None) maps the columns to tokens.
    ``num_splits``: programs per row (0: :func:`default_splits`)."""
    V = logits.shape[-1]
    x = logits.reshape(-1, V)
    rows = x.shape[0]
    if rows == 0:
        return
    block = min(triton.next_power_of_2(V), MAX_BLOCK)
    tiles = triton.cdiv(V, block)
    if not num_splits:
        num_splits = default_splits(rows, tiles, cuda_sm_count(x.device) if x.is_cuda else CPU_SM_COUNT)
    num_splits = min(num_splits, tiles)
    split_tiles = triton.cdiv(tiles, num_splits)
    num_splits = triton.cdiv(tiles, split_tiles)  # no empty split
    kp = triton.next_power_of_2(k)
    final = num_splits == 1
    parts = _partials(rows, num_splits, kp, x.device) if not final else (logp, logp, tokens)
    warps = 8 if block >= 2048 else 4
    has_ids = token_ids is not None
    ids = token_ids if has_ids else tokens  # an unread pointer without ids
    _top_logprobs_kernel[(rows, num_splits)](x, x.stride(0), V, logp, tokens, ids, *parts, K=k, KP=kp, BLOCK=block,
                                             SPLIT_TILES=split_tiles, FINAL=final, HAS_IDS=has_ids, num_warps=warps)
    if not final:
        _top_logprobs_merge_kernel[(rows,)](*parts, logp, tokens, ids, num_splits, K=k, KP=kp,
                                           SP=triton.next_power_of_2(num_splits), HAS_IDS=has_ids, num_warps=1)


def _partials(rows: int, splits: int, kp: int, device) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (torch.empty(rows * splits, dtype=torch.float32, device=device),
            torch.empty(rows * splits, dtype=torch.float32, device=device),
            torch.empty(rows * splits * kp, dtype=torch.int64, device=device))


def _outputs(logits: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    shape = (*logits.shape[:-1], k)
    return (torch.empty(shape, dtype=torch.float32, device=logits.device),
            torch.empty(shape, dtype=torch.int64, device=logits.device))


@torch.library.custom_op("tlt::top_logprobs", mutates_args=())
def _top_logprobs_op(logits: torch.Tensor, k: int,
                     token_ids: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    logp, tokens = _outputs(logits, k)
    top_logprobs_out(logits, k, logp, tokens, token_ids=token_ids)
    return logp, tokens


@_top_logprobs_op.register_fake
def _(logits, k, token_ids=None):
    return _outputs(logits, k)


def top_logprobs(logits: torch.Tensor, k: int,
                 token_ids: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Backend of :func:`tlt_kernels.ops.top_logprobs.top_logprobs`: new contiguous ``[..., k]`` outputs."""
    if direct_dispatch_ok(logits, token_ids):  # plain eager: launch without the op's dispatch
        logp, tokens = _outputs(logits, k)
        top_logprobs_out(logits, k, logp, tokens, token_ids=token_ids)
        return logp, tokens
    return torch.ops.tlt.top_logprobs(logits, k, token_ids)
