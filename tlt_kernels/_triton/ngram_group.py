"""Triton n-gram chain drafting across a request's group, in one launch (``ngram_propose(..., siblings=)``).

One program per request scans its sources in rank order -- its own history, then each sibling row of
``siblings[b]`` -- backwards in tiles, and keeps, per n-gram size ``n``, the first-ranked source's most recent end of
an occurrence of the request's ``n``-suffix (:mod:`tlt_kernels.reference.ngram_group` has the rule). A source stops
scanning once it has an occurrence of ``MAX_N`` (its most recent, found first), and the request stops once any source
has one (later sources rank lower). The drafts are the up-to-``K`` tokens after the chosen occurrence, read from the
source row. No scratch, no atomics, no host sync: CUDA-graph safe and deterministic.
"""
from __future__ import annotations

from typing import Tuple

import torch
import triton
import triton.language as tl

from .ngram import _match_tile_in, _scan_block, _scan_warps, _store_continuation


@triton.jit
def _source_recent_ends(src_ptr, src_len, q_ptr, q_len, MIN_N: tl.constexpr, MAX_N: tl.constexpr,
                        BLOCK_SIZE: tl.constexpr, N_POW2: tl.constexpr):
    """``best [N_POW2]``: per n in [MIN_N, MAX_N], the most recent end of an n-occurrence in the source (-1: none)."""
    nvec = tl.arange(0, N_POW2)
    best = tl.full([N_POW2], -1, dtype=tl.int64)
    offs = tl.arange(0, BLOCK_SIZE).to(tl.int64)
    hi = src_len - 2
    keep = hi >= 0
    while keep:
        e = hi - (BLOCK_SIZE - 1) + offs
        m = _match_tile_in(src_ptr, src_len, q_ptr, q_len, e, MAX_N)
        for n in tl.static_range(MIN_N, MAX_N + 1):
            best = tl.where(nvec == n, tl.maximum(best, tl.max(tl.where(m >= n, e, -1), axis=0)), best)
        hi -= BLOCK_SIZE
        keep = (hi >= 0) & (tl.max(tl.where(nvec == MAX_N, best, -1), axis=0) < 0)
    return best


@triton.jit
def _ngram_group_kernel(
    Tokens_ptr, Lengths_ptr, Siblings_ptr, Drafts_ptr, NumDrafts_ptr,
    stride_tb, stride_sb, stride_db, S, K,
    MIN_N: tl.constexpr, MAX_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, N_POW2: tl.constexpr, BLOCK_K: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    q_ptr = Tokens_ptr + b * stride_tb
    q_len = tl.load(Lengths_ptr + b).to(tl.int64)
    nvec = tl.arange(0, N_POW2)
    chosen_end = tl.full([N_POW2], -1, dtype=tl.int64)  # per n: the first-ranked source's most recent end
    chosen_row = tl.full([N_POW2], 0, dtype=tl.int64)
    s = 0
    searching = True
    while searching:
        sibling = tl.load(Siblings_ptr + b * stride_sb + s - 1, mask=s > 0, other=-1).to(tl.int64)
        row = tl.where(s == 0, b, sibling)
        usable = (row >= 0) & ((s == 0) | (row != b))
        row = tl.where(usable, row, b)
        src_len = tl.where(usable, tl.load(Lengths_ptr + row).to(tl.int64), 0)
        best = _source_recent_ends(Tokens_ptr + row * stride_tb, src_len, q_ptr, q_len, MIN_N, MAX_N, BLOCK_SIZE,
                                   N_POW2)
        take = (chosen_end < 0) & (best >= 0)
        chosen_end = tl.where(take, best, chosen_end)
        chosen_row = tl.where(take, row, chosen_row)
        s += 1
        searching = (s <= S) & (tl.max(tl.where(nvec == MAX_N, chosen_end, -1), axis=0) < 0)
    found = (chosen_end >= 0) & (nvec >= MIN_N) & (nvec <= MAX_N)
    n_star = tl.max(tl.where(found, nvec, 0), axis=0)
    e_star = tl.max(tl.where((nvec == n_star) & (n_star > 0), chosen_end, -1), axis=0)
    r_star = tl.max(tl.where(nvec == n_star, chosen_row, 0), axis=0)
    src_len = tl.load(Lengths_ptr + r_star).to(tl.int64)
    _store_continuation(Tokens_ptr + r_star * stride_tb, src_len, e_star, Drafts_ptr + b * stride_db,
                        NumDrafts_ptr + b, K, BLOCK_K)


@torch.library.custom_op("tlt::ngram_propose_group", mutates_args=())
def _ngram_group_op(tokens: torch.Tensor, lengths: torch.Tensor, siblings: torch.Tensor, k: int, min_n: int,
                    max_n: int) -> Tuple[torch.Tensor, torch.Tensor]:
    B, L = tokens.shape
    drafts = torch.empty(B, k, dtype=torch.int64, device=tokens.device)
    num = torch.empty(B, dtype=torch.int32, device=tokens.device)
    if B == 0:
        return drafts, num
    tokens = tokens if tokens.stride(1) == 1 else tokens.contiguous()
    siblings = siblings if siblings.shape[1] > 0 else torch.full((B, 1), -1, dtype=siblings.dtype, device=tokens.device)
    _ngram_group_kernel[(B,)](
        tokens, lengths, siblings, drafts, num, tokens.stride(0), siblings.stride(0), drafts.stride(0),
        siblings.shape[1], k, MIN_N=min_n, MAX_N=max_n, BLOCK_SIZE=_scan_block(L),
        N_POW2=triton.next_power_of_2(max_n + 1), BLOCK_K=triton.next_power_of_2(k), num_warps=_scan_warps(L),
    )
    return drafts, num


@_ngram_group_op.register_fake
def _(tokens, lengths, siblings, k, min_n, max_n):
    B = tokens.shape[0]
    return tokens.new_empty(B, k, dtype=torch.int64), tokens.new_empty(B, dtype=torch.int32)


def ngram_propose_group(tokens, lengths, siblings, k, min_n, max_n):
    """See :func:`tlt_kernels.ngram_propose` (``siblings=``): ``(drafts int64 [B, k], num_drafts int32 [B])``."""
    return _ngram_group_op(tokens, lengths, siblings, k, min_n, max_n)
