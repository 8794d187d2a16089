"""Triton n-gram (prompt-lookup) drafting: one program per request, the history scanned once.

Matching is indexed by the *end* ``e`` of an earlier occurrence: ``m(e)`` = length of the common
suffix of ``h[:e+1]`` and ``h`` (capped at MAX_N), so position ``e <= len-2`` ends an occurrence of
every ``n <= m(e)``. A tile of ends needs only the MAX_N tokens before each end (shifted loads that hit
L1), and one comparison pass serves every n at once. Tiles run from the end of the history backwards
and stop as soon as MAX_N has matched (the most recent occurrence of the longest n is then known);
otherwise the whole history is read about once.
"""
from __future__ import annotations

from typing import Tuple

import torch
import triton
import triton.language as tl


@triton.jit
def _match_tile(row_ptr, length, e, MAX_N: tl.constexpr):
    """``m(e)`` for a tile of ends ``e`` (int64 [BLOCK]); 0 outside ``0 <= e <= len-2``."""
    ok = (e >= 0) & (e <= length - 2)
    m = tl.zeros(e.shape, dtype=tl.int32)
    run = ok
    for i in tl.static_range(MAX_N):
        # h[len-1-i] (the suffix read backwards) vs h[e-i]; a mismatch ends the run for good.
        suf_pos = length - 1 - i
        suf = tl.load(row_ptr + tl.maximum(suf_pos, 0)).to(tl.int64)
        tok = tl.load(row_ptr + (e - i), mask=run & (e - i >= 0), other=0).to(tl.int64)
        run = run & (e - i >= 0) & (suf_pos >= 0) & (tok == suf)
        m += run.to(tl.int32)
    return m


@triton.jit
def _longest_match(row_ptr, length, MIN_N: tl.constexpr, MAX_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, N_POW2: tl.constexpr):
    """``(n*, e*)``: the longest n in [MIN_N, MAX_N] with an occurrence and its most recent end (0, -1 if none)."""
    nvec = tl.arange(0, N_POW2)
    best = tl.full([N_POW2], -1, dtype=tl.int64)  # best[n] = most recent end of an n-occurrence
    offs = tl.arange(0, BLOCK_SIZE).to(tl.int64)
    hi = length - 2
    keep = hi >= 0
    while keep:
        e = hi - (BLOCK_SIZE - 1) + offs
        m = _match_tile(row_ptr, length, e, MAX_N)
        # One 1-D reduction per n keeps registers at O(BLOCK_SIZE), not O(BLOCK_SIZE * MAX_N).
        for n in tl.static_range(MIN_N, MAX_N + 1):
            tile_best = tl.max(tl.where(m >= n, e, -1), axis=0)
            best = tl.where(nvec == n, tl.maximum(best, tile_best), best)
        hi -= BLOCK_SIZE
        found_max = tl.max(tl.where(nvec == MAX_N, best, -1), axis=0) >= 0
        keep = (hi >= 0) & (found_max == 0)
    usable = (best >= 0) & (nvec >= MIN_N) & (nvec <= MAX_N)
    n_star = tl.max(tl.where(usable, nvec, 0), axis=0)
    e_star = tl.max(tl.where((nvec == n_star) & (n_star > 0), best, -1), axis=0)
    return n_star, e_star


@triton.jit
def _ngram_propose_kernel(
    Tokens_ptr, Lengths_ptr, Drafts_ptr, NumDrafts_ptr,
    stride_tb, stride_db, K,
    MIN_N: tl.constexpr, MAX_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, N_POW2: tl.constexpr, BLOCK_K: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    row_ptr = Tokens_ptr + b * stride_tb
    length = tl.load(Lengths_ptr + b).to(tl.int64)
    n_star, e_star = _longest_match(row_ptr, length, MIN_N, MAX_N, BLOCK_SIZE, N_POW2)
    count = tl.where(e_star >= 0, tl.minimum(length - e_star - 1, K), 0)
    j = tl.arange(0, BLOCK_K).to(tl.int64)
    tok = tl.load(row_ptr + e_star + 1 + j, mask=j < count, other=-1).to(tl.int64)
    tl.store(Drafts_ptr + b * stride_db + j, tl.where(j < count, tok, -1), mask=j < K)
    tl.store(NumDrafts_ptr + b, count.to(tl.int32))


@triton.jit
def _ngram_tree_kernel(
    Tokens_ptr, Lengths_ptr, Parents_ptr, DraftTokens_ptr, NumNodes_ptr,
    stride_tb, stride_pb, stride_db, K, T,
    R: tl.constexpr, MIN_N: tl.constexpr, MAX_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, N_POW2: tl.constexpr,
    R_POW2: tl.constexpr, K_POW2: tl.constexpr, F_POW2: tl.constexpr, T_POW2: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    row_ptr = Tokens_ptr + b * stride_tb
    length = tl.load(Lengths_ptr + b).to(tl.int64)
    n_star, e_star = _longest_match(row_ptr, length, MIN_N, MAX_N, BLOCK_SIZE, N_POW2)

    # Pass 2: the R most recent ends with m(e) >= n*, newest first (ends[r] = -1: no branch r).
    rvec = tl.arange(0, R_POW2)
    ends = tl.full([R_POW2], -1, dtype=tl.int64)
    cnt = tl.where(n_star > 0, 0, R)  # nothing to collect without a match
    offs = tl.arange(0, BLOCK_SIZE).to(tl.int64)
    hi = length - 2
    while (cnt < R) & (hi >= 0):
        e = hi - (BLOCK_SIZE - 1) + offs
        hit = _match_tile(row_ptr, length, e, MAX_N) >= n_star
        for _ in tl.static_range(R):
            e_max = tl.max(tl.where(hit, e, -1), axis=0)
            take = (e_max >= 0) & (cnt < R)
            ends = tl.where((rvec == cnt) & take, e_max, ends)
            cnt += take.to(tl.int32)
            hit = hit & (e != e_max)
        hi -= BLOCK_SIZE

    # Continuation token (r, j) = h[ends[r] + 1 + j], present while j < min(K, len - ends[r] - 1).
    # Flattened branch-major: f = r * K + j, the reference's node insertion order.
    f = tl.arange(0, F_POW2)
    r_f = f // K
    j_f = (f % K).to(tl.int64)
    end_f = tl.sum(tl.where(r_f[:, None] == rvec[None, :], ends[None, :], 0), axis=1)  # ends[r_f]
    valid_f = (f < R * K) & (end_f >= 0) & (j_f < length - end_f - 1)
    tok_f = tl.load(row_ptr + end_f + 1 + j_f, mask=valid_f, other=0).to(tl.int64)

    # same[f, r2]: branch r2 shares the first j_f + 1 tokens of (r_f, j_f). canon[f] = first such r2.
    jj = tl.arange(0, K_POW2).to(tl.int64)
    end3 = end_f[:, None, None]
    end_r2 = ends[None, :, None]
    j3 = jj[None, None, :]
    ok_a = (end3 >= 0) & (j3 < length - end3 - 1) & (j3 < K)
    ok_b = (end_r2 >= 0) & (j3 < length - end_r2 - 1) & (j3 < K)
    tok_a = tl.load(row_ptr + end3 + 1 + j3, mask=ok_a, other=0).to(tl.int64)
    tok_b = tl.load(row_ptr + end_r2 + 1 + j3, mask=ok_b, other=0).to(tl.int64)
    eq = (tok_a == tok_b) & ok_a & ok_b
    in_prefix = j3 <= j_f[:, None, None]
    same = tl.min(tl.where(in_prefix, eq.to(tl.int32), 1), axis=2) > 0
    canon = tl.min(tl.where(same & (rvec[None, :] < R), rvec[None, :], R_POW2), axis=1)
    is_new = valid_f & (canon == r_f)
    node = tl.cumsum(is_new.to(tl.int32), axis=0) * is_new.to(tl.int32)  # 1-based ids of new nodes

    # Parent of new node (r, j > 0) is the node standing for (canon[f - 1], j - 1).
    canon_prev = tl.sum(tl.where(f[None, :] == f[:, None] - 1, canon[None, :], 0), axis=1)
    up = canon_prev * K + (j_f - 1).to(tl.int32)
    par_f = tl.sum(tl.where(f[None, :] == up[:, None], node[None, :], 0), axis=1)
    par_f = tl.where(j_f == 0, 0, par_f)

    # Write every output position once: node p takes the f with node[f] == p.
    p = tl.arange(0, T_POW2)
    pick = (node[None, :] == p[:, None]) & is_new[None, :]
    par_p = tl.sum(tl.where(pick, par_f[None, :], 0), axis=1)
    tok_p = tl.sum(tl.where(pick, tok_f[None, :], 0), axis=1)
    last = tl.load(row_ptr + tl.maximum(length - 1, 0)).to(tl.int64)
    par_p = tl.where(p == 0, -1, par_p)
    tok_p = tl.where(p == 0, tl.where(length > 0, last, 0), tok_p)
    tl.store(Parents_ptr + b * stride_pb + p, par_p.to(tl.int32), mask=p < T)
    tl.store(DraftTokens_ptr + b * stride_db + p, tok_p, mask=p < T)
    tl.store(NumNodes_ptr + b, (1 + tl.sum(is_new.to(tl.int32), axis=0)).to(tl.int32))


def _scan_block(L: int) -> int:
    return max(16, min(2048, triton.next_power_of_2(L)))


def _scan_warps(L: int) -> int:
    return 8 if L >= 2048 else 4


def ngram_propose_out(tokens: torch.Tensor, lengths: torch.Tensor, min_n: int, max_n: int, drafts: torch.Tensor, num_drafts: torch.Tensor) -> None:
    """Write into ``drafts int64 [B, k]`` and ``num_drafts int32 [B]`` (inputs as in :func:`ngram_propose`)."""
    B, L = tokens.shape
    k = drafts.shape[1]
    if tokens.stride(1) != 1:
        tokens = tokens.contiguous()
    _ngram_propose_kernel[(B,)](
        tokens, lengths, drafts, num_drafts, tokens.stride(0), drafts.stride(0), k,
        MIN_N=min_n, MAX_N=max_n, BLOCK_SIZE=_scan_block(L), N_POW2=triton.next_power_of_2(max_n + 1),
        BLOCK_K=triton.next_power_of_2(k), num_warps=_scan_warps(L),
    )


@torch.library.custom_op("tlt::ngram_propose", mutates_args=())
def _ngram_propose_op(tokens: torch.Tensor, lengths: torch.Tensor, k: int, min_n: int, max_n: int) -> Tuple[torch.Tensor, torch.Tensor]:
    B = tokens.shape[0]
    drafts = torch.empty(B, k, dtype=torch.int64, device=tokens.device)
    num = torch.empty(B, dtype=torch.int32, device=tokens.device)
    ngram_propose_out(tokens, lengths, min_n, max_n, drafts, num)
    return drafts, num


@_ngram_propose_op.register_fake
def _(tokens, lengths, k, min_n, max_n):
    B = tokens.shape[0]
    return tokens.new_empty(B, k, dtype=torch.int64), tokens.new_empty(B, dtype=torch.int32)


@torch.library.custom_op("tlt::ngram_propose_tree", mutates_args=())
def _ngram_propose_tree_op(
    tokens: torch.Tensor, lengths: torch.Tensor, k: int, num_branches: int, min_n: int, max_n: int
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B, L = tokens.shape
    T = 1 + num_branches * k
    dev = tokens.device
    parents = torch.empty(B, T, dtype=torch.int32, device=dev)
    draft = torch.empty(B, T, dtype=torch.int64, device=dev)
    num = torch.empty(B, dtype=torch.int32, device=dev)
    if tokens.stride(1) != 1:
        tokens = tokens.contiguous()
    _ngram_tree_kernel[(B,)](
        tokens, lengths, parents, draft, num, tokens.stride(0), parents.stride(0), draft.stride(0), k, T,
        R=num_branches, MIN_N=min_n, MAX_N=max_n, BLOCK_SIZE=_scan_block(L), N_POW2=triton.next_power_of_2(max_n + 1),
        R_POW2=triton.next_power_of_2(num_branches), K_POW2=triton.next_power_of_2(k),
        F_POW2=triton.next_power_of_2(num_branches * k), T_POW2=triton.next_power_of_2(T), num_warps=_scan_warps(L),
    )
    return parents, draft, num


@_ngram_propose_tree_op.register_fake
def _(tokens, lengths, k, num_branches, min_n, max_n):
    B = tokens.shape[0]
    T = 1 + num_branches * k
    return (tokens.new_empty(B, T, dtype=torch.int32), tokens.new_empty(B, T, dtype=torch.int64), tokens.new_empty(B, dtype=torch.int32))


def ngram_propose(tokens, lengths, k, min_n, max_n):
    return _ngram_propose_op(tokens, lengths, k, min_n, max_n)


def ngram_propose_tree(tokens, lengths, k, num_branches, min_n, max_n):
    return _ngram_propose_tree_op(tokens, lengths, k, num_branches, min_n, max_n)
