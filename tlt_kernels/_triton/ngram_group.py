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

from .ngram import (_match_tile_in, _node_parents, _scan_block, _scan_warps, _store_continuation,
                    _store_ngram_tree, empty_tree_outputs, tree_launch_config)


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
def _source_row(Siblings_ptr, Lengths_ptr, b, stride_sb, s):
    """``(row, length)`` of source ``s`` of request ``b`` (0: its own history); an empty slot, or the request
    itself listed as a sibling, gives a source of length 0."""
    sibling = tl.load(Siblings_ptr + b * stride_sb + s - 1, mask=s > 0, other=-1).to(tl.int64)
    row = tl.where(s == 0, b, sibling)
    usable = (row >= 0) & ((s == 0) | (row != b))
    row = tl.where(usable, row, b)
    return row, tl.where(usable, tl.load(Lengths_ptr + row).to(tl.int64), 0)


@triton.jit
def _group_longest(Tokens_ptr, Lengths_ptr, Siblings_ptr, b, stride_tb, stride_sb, S, q_ptr, q_len,
                   MIN_N: tl.constexpr, MAX_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, N_POW2: tl.constexpr):
    """``(n*, e*, row*)``: the longest n with an occurrence in any source, and the first-ranked source's most recent
    end of it (0, -1, b when none)."""
    nvec = tl.arange(0, N_POW2)
    chosen_end = tl.full([N_POW2], -1, dtype=tl.int64)  # per n: the first-ranked source's most recent end
    chosen_row = tl.full([N_POW2], 0, dtype=tl.int64)
    s = 0
    searching = True
    while searching:
        row, src_len = _source_row(Siblings_ptr, Lengths_ptr, b, stride_sb, s)
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
    row_star = tl.max(tl.where(nvec == n_star, chosen_row, 0), axis=0)
    return n_star, e_star, tl.where(e_star >= 0, row_star, b)


@triton.jit
def _ngram_group_kernel(
    Tokens_ptr, Lengths_ptr, Siblings_ptr, Drafts_ptr, NumDrafts_ptr,
    stride_tb, stride_sb, stride_db, S, K,
    MIN_N: tl.constexpr, MAX_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, N_POW2: tl.constexpr, BLOCK_K: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    q_ptr = Tokens_ptr + b * stride_tb
    q_len = tl.load(Lengths_ptr + b).to(tl.int64)
    _, e_star, row = _group_longest(Tokens_ptr, Lengths_ptr, Siblings_ptr, b, stride_tb, stride_sb, S, q_ptr, q_len,
                                    MIN_N, MAX_N, BLOCK_SIZE, N_POW2)
    _store_continuation(Tokens_ptr + row * stride_tb, tl.load(Lengths_ptr + row).to(tl.int64), e_star,
                        Drafts_ptr + b * stride_db, NumDrafts_ptr + b, K, BLOCK_K)


@triton.jit
def _group_ranked_ends(Tokens_ptr, Lengths_ptr, Siblings_ptr, b, stride_tb, stride_sb, S, q_ptr, q_len, n_star, rvec,
                       R: tl.constexpr, MAX_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, R_POW2: tl.constexpr):
    """``(rows, ends)`` ``[R_POW2]``: the first R occurrences of the n*-suffix in (source, most recent) order; end
    -1 where there are fewer."""
    ends = tl.full([R_POW2], -1, dtype=tl.int64)
    rows = tl.full([R_POW2], 0, dtype=tl.int64) + b
    cnt = tl.where(n_star > 0, 0, R)  # nothing to collect without a match
    offs = tl.arange(0, BLOCK_SIZE).to(tl.int64)
    s = 0
    while (cnt < R) & (s <= S):
        row, src_len = _source_row(Siblings_ptr, Lengths_ptr, b, stride_sb, s)
        src_ptr = Tokens_ptr + row * stride_tb
        hi = src_len - 2
        while (cnt < R) & (hi >= 0):
            e = hi - (BLOCK_SIZE - 1) + offs
            hit = _match_tile_in(src_ptr, src_len, q_ptr, q_len, e, MAX_N) >= n_star
            for _ in tl.static_range(R):
                e_max = tl.max(tl.where(hit, e, -1), axis=0)
                take = (e_max >= 0) & (cnt < R)
                ends = tl.where((rvec == cnt) & take, e_max, ends)
                rows = tl.where((rvec == cnt) & take, row, rows)
                cnt += take.to(tl.int32)
                hit = hit & (e != e_max)
            hi -= BLOCK_SIZE
        s += 1
    return rows, ends


@triton.jit
def _group_prefix_owner(Tokens_ptr, stride_tb, rows, lens, ends, rvec, row_f, len_f, end_f, j_f, K,
                        R: tl.constexpr, R_POW2: tl.constexpr, K_POW2: tl.constexpr):
    """canon[f]: the first branch r2 whose first ``j_f + 1`` tokens equal those of flattened position f (branches
    read from their own source rows)."""
    j3 = tl.arange(0, K_POW2).to(tl.int64)[None, None, :]
    end3, row3, len3 = end_f[:, None, None], row_f[:, None, None], len_f[:, None, None]
    end_r2, row_r2, len_r2 = ends[None, :, None], rows[None, :, None], lens[None, :, None]
    ok_a = (end3 >= 0) & (j3 < len3 - end3 - 1) & (j3 < K)
    ok_b = (end_r2 >= 0) & (j3 < len_r2 - end_r2 - 1) & (j3 < K)
    tok_a = tl.load(Tokens_ptr + row3 * stride_tb + end3 + 1 + j3, mask=ok_a, other=0).to(tl.int64)
    tok_b = tl.load(Tokens_ptr + row_r2 * stride_tb + end_r2 + 1 + j3, mask=ok_b, other=0).to(tl.int64)
    eq = (tok_a == tok_b) & ok_a & ok_b
    same = tl.min(tl.where(j3 <= j_f[:, None, None], eq.to(tl.int32), 1), axis=2) > 0
    return tl.min(tl.where(same & (rvec[None, :] < R), rvec[None, :], R_POW2), axis=1)


@triton.jit
def _ngram_group_tree_kernel(
    Tokens_ptr, Lengths_ptr, Siblings_ptr, Parents_ptr, DraftTokens_ptr, NumNodes_ptr,
    stride_tb, stride_sb, stride_pb, stride_db, S, K, T,
    R: tl.constexpr, MIN_N: tl.constexpr, MAX_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, N_POW2: tl.constexpr,
    R_POW2: tl.constexpr, K_POW2: tl.constexpr, F_POW2: tl.constexpr, T_POW2: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    q_ptr = Tokens_ptr + b * stride_tb
    q_len = tl.load(Lengths_ptr + b).to(tl.int64)
    n_star, _, _ = _group_longest(Tokens_ptr, Lengths_ptr, Siblings_ptr, b, stride_tb, stride_sb, S, q_ptr, q_len,
                                  MIN_N, MAX_N, BLOCK_SIZE, N_POW2)
    rvec = tl.arange(0, R_POW2)
    rows, ends = _group_ranked_ends(Tokens_ptr, Lengths_ptr, Siblings_ptr, b, stride_tb, stride_sb, S, q_ptr, q_len,
                                    n_star, rvec, R, MAX_N, BLOCK_SIZE, R_POW2)
    lens = tl.load(Lengths_ptr + rows).to(tl.int64)
    # Continuation token (r, j) = src_r[ends[r] + 1 + j], flattened branch-major (f = r * K + j).
    f = tl.arange(0, F_POW2)
    r_f = f // K
    j_f = (f % K).to(tl.int64)
    pick = r_f[:, None] == rvec[None, :]
    end_f = tl.sum(tl.where(pick, ends[None, :], 0), axis=1)
    row_f = tl.sum(tl.where(pick, rows[None, :], 0), axis=1)
    len_f = tl.sum(tl.where(pick, lens[None, :], 0), axis=1)
    valid_f = (f < R * K) & (end_f >= 0) & (j_f < len_f - end_f - 1)
    tok_f = tl.load(Tokens_ptr + row_f * stride_tb + end_f + 1 + j_f, mask=valid_f, other=0).to(tl.int64)
    canon = _group_prefix_owner(Tokens_ptr, stride_tb, rows, lens, ends, rvec, row_f, len_f, end_f, j_f, K, R, R_POW2,
                                K_POW2)
    is_new = valid_f & (canon == r_f)
    node = tl.cumsum(is_new.to(tl.int32), axis=0) * is_new.to(tl.int32)  # 1-based ids of new nodes
    par_f = _node_parents(f, canon, node, j_f, K)
    _store_ngram_tree(q_ptr, q_len, b, Parents_ptr, DraftTokens_ptr, NumNodes_ptr, stride_pb, stride_db, node, is_new,
                      par_f, tok_f, T, T_POW2)


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


@torch.library.custom_op("tlt::ngram_propose_tree_group", mutates_args=())
def _ngram_group_tree_op(tokens: torch.Tensor, lengths: torch.Tensor, siblings: torch.Tensor, k: int,
                         num_branches: int, min_n: int, max_n: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B, L = tokens.shape
    parents, draft, num = empty_tree_outputs(tokens, k, num_branches)
    if B == 0:
        return parents, draft, num
    tokens = tokens if tokens.stride(1) == 1 else tokens.contiguous()
    siblings = siblings if siblings.shape[1] > 0 else torch.full((B, 1), -1, dtype=siblings.dtype, device=tokens.device)
    _ngram_group_tree_kernel[(B,)](
        tokens, lengths, siblings, parents, draft, num, tokens.stride(0), siblings.stride(0), parents.stride(0),
        draft.stride(0), siblings.shape[1], k, parents.shape[1], MIN_N=min_n,
        **tree_launch_config(L, k, num_branches, max_n),
    )
    return parents, draft, num


@_ngram_group_tree_op.register_fake
def _(tokens, lengths, siblings, k, num_branches, min_n, max_n):
    return empty_tree_outputs(tokens, k, num_branches)


def ngram_propose_tree_group(tokens, lengths, siblings, k, num_branches, min_n, max_n):
    """See :func:`tlt_kernels.ngram_propose_tree` (``siblings=``): ``(parents, draft_tokens, num_nodes)``."""
    return _ngram_group_tree_op(tokens, lengths, siblings, k, num_branches, min_n, max_n)
