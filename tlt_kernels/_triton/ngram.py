"""Triton n-gram (prompt-lookup) drafting.

Matching is indexed by the *end* ``e`` of an earlier occurrence: ``m(e)`` = length of the common
suffix of ``h[:e+1]`` and ``h`` (capped at MAX_N), so position ``e <= len-2`` ends an occurrence of
every ``n <= m(e)``. One comparison pass over the MAX_N tokens before each end serves every n.

Because ``m`` is capped at MAX_N, the longest matching n is ``n* = max_e m(e)`` (when ``>= MIN_N``)
and its most recent occurrence is the largest ``e`` with ``m(e) = n*``: the lexicographic maximum
of ``(m(e), e)``. That maximum is associative, so ``ngram_propose`` splits each history into CHUNK
positions per program (grid ``(num_chunks, B)``: thousands of independent programs keep enough loads
in flight to stream HBM) and each program writes one int64 key ``m << 40 | e`` (-1: no occurrence
with ``m >= MIN_N``) to a ``[B, num_chunks]`` scratch that every program writes, so it needs no
initialization. A second one-program-per-request kernel takes the maximum key and gathers the k
drafts. Two launches, no atomics, no host synchronization: CUDA-graph safe and deterministic.

Sizing (H100/H200, 132 SMs, ~4 TB/s, ~0.6-0.8 us DRAM latency): Little's law wants ~3 MB in flight,
i.e. >= ~24 KB per SM; we aim for 32-64 KB. A CHUNK=1024, 4-warp program issues all its tile loads
(8 KB of int64 from DRAM; every warp instruction reads 256 contiguous bytes) before any compare. The
sm_90 build takes 61 registers per thread at MAX_N=4 (int64; 38 for int32), so 8 programs fit per
SM: ~64 KB in flight per SM, and B=256, L=8192 is 2048 programs, ~2 waves. The MAX_N-1 shifted
reloads of the tile should hit L1. CHUNK, NUM_WARPS and MIN_PROGRAMS are module constants so they can
be swept on the GPU (``python -m bench ngram --sweep``).

``ngram_propose_tree`` (and the ``rowscan`` baseline of ``ngram_propose``, kept for same-machine
comparisons) use one program per request that scans its history backwards in tiles and stops once
MAX_N has matched.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

# Tuning knobs of the chunked ngram_propose (see the module docstring for the reasoning).
# 512 x 4 warps: the fastest (or within noise of it) at every history length of the sweep, where 1024 x 4 was
# slower throughout (figures: docs/DRAFTERS.md, "N-gram drafter").
CHUNK = 512  # history positions (ends) per program; a power of two
NUM_WARPS = 4  # warps per chunk program
MIN_CHUNK = 128  # CHUNK is halved down to this while the grid has fewer than MIN_PROGRAMS programs
MIN_PROGRAMS = 1024  # ~8 programs per SM on 132 SMs: small batches still spread over the GPU
FINAL_WARPS = 1  # the per-request combine kernel only reduces num_chunks keys and gathers k tokens
KEY_SHIFT = 40  # key = m << KEY_SHIFT | e; positions below 2**40


@triton.jit
def _ngram_chunk_kernel(
    Tokens_ptr, Lengths_ptr, Keys_ptr,
    stride_tb, num_chunks,
    MIN_N: tl.constexpr, MAX_N: tl.constexpr, N_POW2: tl.constexpr, CHUNK: tl.constexpr, KEY_SHIFT: tl.constexpr,
):
    """Keys[b, c] = max over ends e of chunk c with m(e) >= MIN_N of ``m(e) << KEY_SHIFT | e``; -1 if none."""
    c = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    row_ptr = Tokens_ptr + b * stride_tb
    length = tl.load(Lengths_ptr + b).to(tl.int64)
    start = c.to(tl.int64) * CHUNK
    j = tl.arange(0, CHUNK)  # local end index; int32 keeps the per-element registers small
    i = tl.arange(0, N_POW2)  # distance back from the end
    ok = j <= length - 2 - start  # the end leaves at least one token to propose
    # One [N_POW2, CHUNK] load: row i holds h[e - i]. It depends only on bounds, never on a compare,
    # so every load of the tile is in flight at once; rows i > 0 re-read the tile shifted (L1/L2 hits).
    # Only chunk 0 can reach before the row start.
    in_row = ok[None, :] & (i[:, None] < MAX_N) & ((j[None, :] >= i[:, None]) | (c > 0))
    tile = tl.load(row_ptr + start + (j[None, :] - i[:, None]), mask=in_row, other=0)
    suf_pos = length - 1 - i  # the suffix read backwards: h[len - 1 - i]
    suf = tl.load(row_ptr + tl.maximum(suf_pos, 0), mask=i < MAX_N, other=0)
    eq = in_row & (suf_pos >= 0)[:, None] & (tile == suf[:, None])
    # m(e) = index of the first mismatching row (rows >= MAX_N never match, capping m at MAX_N).
    m = tl.min(tl.where(eq, N_POW2, i[:, None]), axis=0)
    # m * CHUNK + j orders (m, e) lexicographically within the chunk, in int32.
    local = tl.max(tl.where(ok & (m >= MIN_N), m * CHUNK + j, -1), axis=0)
    key = (local // CHUNK).to(tl.int64) << KEY_SHIFT | (start + local % CHUNK)
    tl.store(Keys_ptr + b * num_chunks + c, tl.where(local >= 0, key, -1))


@triton.jit
def _store_continuation(row_ptr, length, e_star, drafts_ptr, num_ptr, K, BLOCK_K: tl.constexpr):
    """Write the up-to-K tokens after end ``e_star`` (-1 = no occurrence) as one request's drafts, -1 padded."""
    count = tl.where(e_star >= 0, tl.minimum(length - e_star - 1, K), 0)
    j = tl.arange(0, BLOCK_K).to(tl.int64)
    tok = tl.load(row_ptr + e_star + 1 + j, mask=j < count, other=-1).to(tl.int64)
    tl.store(drafts_ptr + j, tl.where(j < count, tok, -1), mask=j < K)
    tl.store(num_ptr, count.to(tl.int32))


@triton.jit
def _ngram_combine_kernel(
    Tokens_ptr, Lengths_ptr, Keys_ptr, Drafts_ptr, NumDrafts_ptr,
    stride_tb, stride_db, num_chunks, K,
    KEY_SHIFT: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Per request: (n*, e*) = max key over chunks; drafts = h[e*+1 : min(e*+1+K, len)], -1 padded."""
    b = tl.program_id(0).to(tl.int64)
    row_ptr = Tokens_ptr + b * stride_tb
    length = tl.load(Lengths_ptr + b).to(tl.int64)
    cs = tl.arange(0, BLOCK_C)
    best = tl.full([BLOCK_C], -1, dtype=tl.int64)
    c0 = 0
    while c0 < num_chunks:  # a while loop: the CPU interpreter cannot range() over a runtime bound
        best = tl.maximum(best, tl.load(Keys_ptr + b * num_chunks + c0 + cs, mask=c0 + cs < num_chunks, other=-1))
        c0 += BLOCK_C
    key = tl.max(best, axis=0)
    e_star = tl.where(key >= 0, key & ((1 << KEY_SHIFT) - 1), -1)
    _store_continuation(row_ptr, length, e_star, Drafts_ptr + b * stride_db, NumDrafts_ptr + b, K, BLOCK_K)


@triton.jit
def _match_tile_in(src_ptr, src_len, q_ptr, q_len, e, MAX_N: tl.constexpr):
    """``m(e)``: the common suffix of ``src[:e+1]`` and the query history (capped at MAX_N), for a tile of ends
    ``e`` (int64 [BLOCK]); 0 outside ``0 <= e <= src_len - 2``. The source is the query's own history except when
    drafting from a request's group (:mod:`tlt_kernels._triton.ngram_group`)."""
    ok = (e >= 0) & (e <= src_len - 2)
    m = tl.zeros(e.shape, dtype=tl.int32)
    run = ok
    for i in tl.static_range(MAX_N):
        # q[len-1-i] (the suffix read backwards) vs src[e-i]; a mismatch ends the run for good. The load
        # is masked by bounds only (not by `run`) so the MAX_N loads do not wait on each other.
        suf_pos = q_len - 1 - i
        suf = tl.load(q_ptr + tl.maximum(suf_pos, 0))
        tok = tl.load(src_ptr + (e - i), mask=ok & (e - i >= 0), other=0)
        run = run & (e - i >= 0) & (suf_pos >= 0) & (tok == suf)
        m += run.to(tl.int32)
    return m


@triton.jit
def _match_tile(row_ptr, length, e, MAX_N: tl.constexpr):
    """``m(e)`` for a tile of ends ``e`` (int64 [BLOCK]) of the request's own history; 0 outside
    ``0 <= e <= len-2``."""
    return _match_tile_in(row_ptr, length, row_ptr, length, e, MAX_N)


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
def _ngram_rowscan_kernel(
    Tokens_ptr, Lengths_ptr, Drafts_ptr, NumDrafts_ptr,
    stride_tb, stride_db, K,
    MIN_N: tl.constexpr, MAX_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, N_POW2: tl.constexpr, BLOCK_K: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    row_ptr = Tokens_ptr + b * stride_tb
    length = tl.load(Lengths_ptr + b).to(tl.int64)
    n_star, e_star = _longest_match(row_ptr, length, MIN_N, MAX_N, BLOCK_SIZE, N_POW2)
    _store_continuation(row_ptr, length, e_star, Drafts_ptr + b * stride_db, NumDrafts_ptr + b, K, BLOCK_K)


@triton.jit
def _recent_match_ends(row_ptr, length, n_star, rvec, R: tl.constexpr, MAX_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                       R_POW2: tl.constexpr):
    """The R most recent ends with m(e) >= n*, newest first (ends[r] = -1: no branch r)."""
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
    return ends


@triton.jit
def _branch_prefix_owner(row_ptr, length, ends, rvec, end_f, j_f, K, R: tl.constexpr, R_POW2: tl.constexpr,
                         K_POW2: tl.constexpr):
    """canon[f]: the first branch r2 whose first ``j_f + 1`` tokens equal those of flattened position f (its own
    branch when no earlier one shares that prefix); positions sharing a canon branch are one tree node."""
    # same[f, r2]: branch r2 shares the first j_f + 1 tokens of (r_f, j_f).
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
    return tl.min(tl.where(same & (rvec[None, :] < R), rvec[None, :], R_POW2), axis=1)


@triton.jit
def _node_parents(f, canon, node, j_f, K):
    """Parent node of each flattened position: new node (r, j > 0) hangs under the node standing for
    (canon[f - 1], j - 1); the first token of a branch (j = 0) hangs under the root."""
    canon_prev = tl.sum(tl.where(f[None, :] == f[:, None] - 1, canon[None, :], 0), axis=1)
    up = canon_prev * K + (j_f - 1).to(tl.int32)
    par_f = tl.sum(tl.where(f[None, :] == up[:, None], node[None, :], 0), axis=1)
    return tl.where(j_f == 0, 0, par_f)


@triton.jit
def _store_ngram_tree(row_ptr, length, b, Parents_ptr, DraftTokens_ptr, NumNodes_ptr, stride_pb, stride_db, node, is_new,
                      par_f, tok_f, T, T_POW2: tl.constexpr):
    """Write request b's every output position once (node p takes the f with node[f] == p; the root holds the last
    history token), and its node count."""
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

    # Pass 2: the branches' ends.
    rvec = tl.arange(0, R_POW2)
    ends = _recent_match_ends(row_ptr, length, n_star, rvec, R, MAX_N, BLOCK_SIZE, R_POW2)

    # Continuation token (r, j) = h[ends[r] + 1 + j], present while j < min(K, len - ends[r] - 1).
    # Flattened branch-major: f = r * K + j, the reference's node insertion order.
    f = tl.arange(0, F_POW2)
    r_f = f // K
    j_f = (f % K).to(tl.int64)
    end_f = tl.sum(tl.where(r_f[:, None] == rvec[None, :], ends[None, :], 0), axis=1)  # ends[r_f]
    valid_f = (f < R * K) & (end_f >= 0) & (j_f < length - end_f - 1)
    tok_f = tl.load(row_ptr + end_f + 1 + j_f, mask=valid_f, other=0).to(tl.int64)

    canon = _branch_prefix_owner(row_ptr, length, ends, rvec, end_f, j_f, K, R, R_POW2, K_POW2)
    is_new = valid_f & (canon == r_f)
    node = tl.cumsum(is_new.to(tl.int32), axis=0) * is_new.to(tl.int32)  # 1-based ids of new nodes
    par_f = _node_parents(f, canon, node, j_f, K)
    _store_ngram_tree(row_ptr, length, b, Parents_ptr, DraftTokens_ptr, NumNodes_ptr, stride_pb, stride_db, node, is_new,
                      par_f, tok_f, T, T_POW2)


def _scan_block(L: int) -> int:
    return max(16, min(2048, triton.next_power_of_2(L)))


def _scan_warps(L: int) -> int:
    return 8 if L >= 2048 else 4


def chunk_config(B: int, L: int, chunk: Optional[int] = None, num_warps: Optional[int] = None) -> Tuple[int, int]:
    """``(chunk, num_warps)`` for the chunked kernel: the module defaults unless given.

    The default chunk is CHUNK, capped at the history length (rounded up to a power of two) and
    halved down to MIN_CHUNK while ``B * ceil(L / chunk) < MIN_PROGRAMS``, so a small batch of
    long histories still spreads over every SM.
    """
    if chunk is None:
        chunk = min(CHUNK, max(16, triton.next_power_of_2(L)))
        while chunk > MIN_CHUNK and B * triton.cdiv(L, chunk) < MIN_PROGRAMS:
            chunk //= 2
    elif chunk < 16 or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two >= 16, got {chunk}")
    if num_warps is None:
        num_warps = NUM_WARPS if chunk >= 128 * NUM_WARPS else max(1, chunk // 128)
    elif num_warps < 1 or num_warps & (num_warps - 1):
        raise ValueError(f"num_warps must be a power of two >= 1, got {num_warps}")
    return chunk, num_warps


def ngram_propose_out(
    tokens: torch.Tensor, lengths: torch.Tensor, min_n: int, max_n: int, drafts: torch.Tensor, num_drafts: torch.Tensor,
    chunk: Optional[int] = None, num_warps: Optional[int] = None,
) -> None:
    """Write into ``drafts int64 [B, k]`` and ``num_drafts int32 [B]`` (inputs as in :func:`ngram_propose`).

    ``chunk`` (a power of two >= 16) and ``num_warps`` override :func:`chunk_config` (for sweeps).
    Allocates an ``int64 [B, ceil(L / chunk)]`` scratch from the caching allocator (graph-safe).
    """
    B, L = tokens.shape
    k = drafts.shape[1]
    if tokens.stride(1) != 1:
        tokens = tokens.contiguous()
    chunk, num_warps = chunk_config(B, L, chunk, num_warps)
    if chunk * (max_n + 1) >= 2**31 or L >= 2**KEY_SHIFT:
        raise ValueError(f"chunk * (max_n + 1) must be < 2**31 and L < 2**{KEY_SHIFT}, got chunk={chunk}, max_n={max_n}, L={L}")
    if B > 65535:  # grid axis 1 holds the batch
        raise ValueError(f"ngram_propose supports at most 65535 requests per call, got B={B}")
    num_chunks = triton.cdiv(L, chunk)
    keys = torch.empty(B, num_chunks, dtype=torch.int64, device=tokens.device)
    _ngram_chunk_kernel[(num_chunks, B)](
        tokens, lengths, keys, tokens.stride(0), num_chunks,
        MIN_N=min_n, MAX_N=max_n, N_POW2=triton.next_power_of_2(max_n), CHUNK=chunk, KEY_SHIFT=KEY_SHIFT,
        num_warps=num_warps,
    )
    _ngram_combine_kernel[(B,)](
        tokens, lengths, keys, drafts, num_drafts, tokens.stride(0), drafts.stride(0), num_chunks, k,
        KEY_SHIFT=KEY_SHIFT, BLOCK_C=min(triton.next_power_of_2(num_chunks), 1024), BLOCK_K=triton.next_power_of_2(k),
        num_warps=FINAL_WARPS,
    )


def ngram_propose_rowscan_out(tokens: torch.Tensor, lengths: torch.Tensor, min_n: int, max_n: int, drafts: torch.Tensor, num_drafts: torch.Tensor) -> None:
    """The previous design (one program per request, backward tile scan with early exit), as a baseline."""
    B, L = tokens.shape
    k = drafts.shape[1]
    if tokens.stride(1) != 1:
        tokens = tokens.contiguous()
    _ngram_rowscan_kernel[(B,)](
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


def empty_tree_outputs(tokens: torch.Tensor, k: int, num_branches: int):
    """Uninitialized tree outputs (also the fake-tensor shapes): ``(parents int32 [B, T], draft_tokens int64 [B, T],
    num_nodes int32 [B])``, ``T = 1 + num_branches * k``."""
    B, T = tokens.shape[0], 1 + num_branches * k
    return (tokens.new_empty(B, T, dtype=torch.int32), tokens.new_empty(B, T, dtype=torch.int64),
            tokens.new_empty(B, dtype=torch.int32))


def tree_launch_config(L: int, k: int, num_branches: int, max_n: int) -> dict:
    """The tree kernels' block sizes and warps for histories of ``L`` positions (self-only and group alike)."""
    return dict(R=num_branches, MAX_N=max_n, BLOCK_SIZE=_scan_block(L), N_POW2=triton.next_power_of_2(max_n + 1),
                R_POW2=triton.next_power_of_2(num_branches), K_POW2=triton.next_power_of_2(k),
                F_POW2=triton.next_power_of_2(num_branches * k), T_POW2=triton.next_power_of_2(1 + num_branches * k),
                num_warps=_scan_warps(L))


@torch.library.custom_op("tlt::ngram_propose_tree", mutates_args=())
def _ngram_propose_tree_op(
    tokens: torch.Tensor, lengths: torch.Tensor, k: int, num_branches: int, min_n: int, max_n: int
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B, L = tokens.shape
    parents, draft, num = empty_tree_outputs(tokens, k, num_branches)
    if tokens.stride(1) != 1:
        tokens = tokens.contiguous()
    _ngram_tree_kernel[(B,)](
        tokens, lengths, parents, draft, num, tokens.stride(0), parents.stride(0), draft.stride(0), k,
        parents.shape[1], MIN_N=min_n, **tree_launch_config(L, k, num_branches, max_n),
    )
    return parents, draft, num


@_ngram_propose_tree_op.register_fake
def _(tokens, lengths, k, num_branches, min_n, max_n):
    return empty_tree_outputs(tokens, k, num_branches)


def ngram_propose(tokens, lengths, k, min_n, max_n):
    return _ngram_propose_op(tokens, lengths, k, min_n, max_n)


def ngram_propose_tree(tokens, lengths, k, num_branches, min_n, max_n):
    return _ngram_propose_tree_op(tokens, lengths, k, num_branches, min_n, max_n)
