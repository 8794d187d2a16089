"""Fused tree verification in Triton: one program walks one request's draft tree.

The program reads only the rows the walk visits (the root, then each accepted node), in tiles of
``BLOCK_SIZE`` upcast to fp32. A row's target distribution is kept implicit as
``(thr, mx, Z)``: ``p(t) = [key(l_t) >= thr] * exp((l_t - mx) / T') / Z`` (``mx`` the row max, ``T'`` the
temperature clamped to the normal float32 range; see :mod:`tlt_kernels.reference.sampling`) where ``key`` maps a
float to an int32 with the same order (-0.0 and +0.0 share a key). Then

* the top-k threshold is the largest key with ``count(key >= thr) >= k``, found by radix select on
  the key (8 histogram passes of 4 bits, exact, no sort; boundary ties are kept);
* the top-p threshold is the largest key with ``mass(key >= thr) >= top_p * Z`` (the same select
  weighted by mass; equivalent to the probability threshold because p is monotone in the logit);
* accepting a child needs only ``p(x)`` (one element) and its coin;
* a rejection writes the residual ``max(p - q, 0)`` (or ``p`` with ``x`` zeroed without draft
  probabilities) into one of two per-request fp32 scratch rows (``[B, 2, V]`` workspace, ping-pong: the
  pass that sums the residual also writes it, and it is adopted only if its mass is positive), which
  later tests and the final inverse-CDF sample read instead.

The coins are Philox4x32-10, bit-identical to :mod:`tlt_kernels.rng`. Nothing synchronizes with
the host; a request whose visited row holds NaN/+inf, is all -inf, or whose draft token / draft row is
unusable gets ``error = 1`` and an empty result, other requests are unaffected.
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl

from ..reference.verify_tree import empty_verify_outputs, make_verify_tree_op, scored_launch
from .philox import _philox_uniform


# Widest tile of the streaming passes without top-k/top-p (the radix select keeps 1024: its [BLOCK, 16] histogram
# lives in registers). Not yet timed on a GPU.
STREAM_BLOCK_MAX = 2048


@triton.jit
def _order_key(x):
    """Order-preserving int32 key of fp32 values: the radix select and the top-k/top-p thresholds work on it."""
    key = x.to(tl.int32, bitcast=True)
    # -0.0 keys as +0.0: they are equal floats, so ties at zero are kept as the reference keeps them.
    key = tl.where(key == -2147483648, 0, key)
    return tl.where(key >= 0, key, key ^ 0x7FFFFFFF)


@triton.jit
def _log2_weight(x, mx, ks):
    """(x - mx) * ks, ks = log2(e) / T': the max is subtracted before scaling, so it is <= 0 and never NaN for any
    T'. Where the row max reaches 2**102 both terms are halved first (exact there), since x - mx could pass the
    float32 range."""
    h = tl.where(mx >= 5.070602400912918e30, 0.5, 1.0)
    return (x * h - mx * h) * (ks / h)


@triton.jit
def _weight(x, mx, ks):
    """exp((x - mx) / T') as exp2(_log2_weight): in [0, 1], exactly 1 at the max."""
    return tl.exp2(_log2_weight(x, mx, ks))


@triton.jit
def _tile_probs(row_ptr, scr_ptr, offs, mask, has_res, S, thr, ks, mx, Z):
    """Normalized probabilities of one tile of the current distribution: the residual kept in the
    scratch row once a child was rejected (mass S), else the filtered softmax of the logits (mass Z)."""
    x = tl.load(row_ptr + offs, mask=mask, other=float("-inf")).to(tl.float32)
    if has_res != 0:
        p = tl.load(scr_ptr + offs, mask=mask, other=0.0) / S
    else:
        p = tl.where((_order_key(x) >= thr) & mask, _weight(x, mx, ks), 0.0) / Z
    return p


@triton.jit
def _mass_ge(row_ptr, V, thr, ks, mx, NUM_TILES: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """sum over tokens with key(l) >= thr of their weight (``_weight``)."""
    acc = 0.0
    for tile in range(NUM_TILES):
        start = tile * BLOCK_SIZE
        offs = start + tl.arange(0, BLOCK_SIZE)
        mask = offs < V
        x = tl.load(row_ptr + offs, mask=mask, other=float("-inf")).to(tl.float32)
        w = tl.where((_order_key(x) >= thr) & mask, _weight(x, mx, ks), 0.0)
        acc += tl.sum(w, axis=0)
    return acc


@triton.jit
def _radix_select(row_ptr, N, floor, ks, mx, need, BY_MASS: tl.constexpr, NUM_TILES: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr):
    """Largest key K with W(key >= K) >= need, and W(key >= K); W counts tokens (or sums their
    weights when BY_MASS) among the first ``N`` values at ``row_ptr`` with key >= floor
    (a row, ``N = V``, or its compacted top-p candidates; tiles past ``N`` are skipped).

    Radix select on the unsigned key, 4 bits per pass (8 passes, exact, no sort): at each level
    a 16-bin histogram of the next digit among tokens sharing the prefix picks the largest digit
    whose suffix still reaches ``need``.
    """
    bins = tl.arange(0, 16)
    prefix = (floor * 0).to(tl.int64)
    above = 0.0
    at = 0.0
    for level in tl.static_range(8):
        shift = 28 - 4 * level
        hist = tl.zeros([16], dtype=tl.float32)
        for tile in range(NUM_TILES):
            start = tile * BLOCK_SIZE
            if start < N:
                offs = start + tl.arange(0, BLOCK_SIZE)
                mask = offs < N
                x = tl.load(row_ptr + offs, mask=mask, other=float("-inf")).to(tl.float32)
                key = _order_key(x)
                ukey = key.to(tl.int64) + 2147483648
                live = mask & (key >= floor) & ((ukey >> (shift + 4)) == prefix)
                if BY_MASS:
                    w = tl.where(live, _weight(x, mx, ks), 0.0)
                else:
                    w = live.to(tl.float32)
                digit = ((ukey >> shift) & 15).to(tl.int32)
                hist += tl.sum(tl.where(digit[:, None] == bins[None, :], w[:, None], 0.0), axis=0)
        # suffix[d] = sum of hist[d'] for d' >= d
        suffix = tl.sum(tl.where(bins[None, :] >= bins[:, None], hist[None, :], 0.0), axis=1)
        d = tl.maximum(tl.max(tl.where(above + suffix >= need, bins, -1), axis=0), 0)
        at = tl.sum(tl.where(bins == d, hist, 0.0), axis=0)
        above += tl.sum(tl.where(bins > d, hist, 0.0), axis=0)
        prefix = prefix * 16 + d
    return (prefix - 2147483648).to(tl.int32), above + at


@triton.jit
def _top_p_candidates(row_ptr, cand_ptr, V, floor, ks, mx, tau, NUM_TILES: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """Compacts into ``cand_ptr`` the logits with key >= floor and weight (``_weight``) >= tau; returns their count.

    With ``tau = Z (1 - top_p) / V`` (Z the kept mass) every token below tau is outside the top-p set: all of
    them together weigh less than ``Z (1 - top_p)``, so the tokens at or above tau already reach ``top_p Z``
    and the threshold key is at least the smallest of theirs. The radix select over the candidates then gives
    the same key and kept mass as over the whole row, while its 8 passes read a few thousand values instead of
    V. Token order is kept (a prefix sum places each candidate), not that the select needs it.
    """
    cnt = (floor * 0).to(tl.int32)
    for tile in range(NUM_TILES):
        start = tile * BLOCK_SIZE
        offs = start + tl.arange(0, BLOCK_SIZE)
        mask = offs < V
        x = tl.load(row_ptr + offs, mask=mask, other=float("-inf")).to(tl.float32)
        keep = mask & (_order_key(x) >= floor) & (_weight(x, mx, ks) >= tau)
        pos = cnt + tl.cumsum(keep.to(tl.int32), axis=0) - 1
        tl.store(cand_ptr + pos, x, mask=keep)
        cnt += tl.sum(keep.to(tl.int32), axis=0)
    return cnt


@triton.jit
def _row_state(row_ptr, dq_ptr, want_q, cand_ptr, V, greedy, ks, top_k, top_p, NUM_TILES: tl.constexpr,
               BLOCK_SIZE: tl.constexpr, NUM_STREAM_TILES: tl.constexpr, STREAM_BLOCK: tl.constexpr,
               SCORES: tl.constexpr):
    """(bad, argmax, thr, mx, Z, qsum, Z1) of one row (mx: its max logit); thr/Z are only meaningful for sampled
    requests. With ``SCORES``, ``Z1`` is the raw normalizer ``sum _weight(l, max, log2 e)`` (temperature 1, no
    filter), summed online in the same pass (one more exp per element, no more bytes; none at temperature exactly 1,
    where it is the sampling sum before any filter); else 1.

    One pass gives the argmax, the bad flag, online the normalizer ``Z = sum _weight(l, max, ks)`` (the running
    sum rescaled when the tile max grows) and, when ``want_q`` (the node has children to test against its
    draft row ``dq_ptr``), the draft row's sum: a row without top-k / top-p is read once. Top-k and top-p add
    their radix passes and a normalizer pass over the kept tokens.
    """
    # At temperature exactly 1 (ks == log2 e) the raw normalizer is z's own sum, term for term: no second exp2.
    raw_apart = ks != 1.4426950408889634
    # bad: NaN/+inf present or every entry -inf; arg: lowest id of the max.
    best = float("-inf")
    arg = 0
    bad = 0
    z = 0.0
    z1 = 0.0
    qsum = 0.0
    for tile in range(NUM_STREAM_TILES):
        start = tile * STREAM_BLOCK
        offs = start + tl.arange(0, STREAM_BLOCK)
        mask = offs < V
        x = tl.load(row_ptr + offs, mask=mask, other=float("-inf")).to(tl.float32)
        qsum += tl.sum(tl.load(dq_ptr + offs, mask=mask & (want_q != 0), other=0.0).to(tl.float32), axis=0)
        bad = bad | tl.max(((x != x) | (x == float("inf"))).to(tl.int32), axis=0)
        xm = tl.where(x != x, float("-inf"), x)
        tile_best = tl.max(xm, axis=0)
        tile_arg = tl.min(tl.where((xm == tile_best) & mask, offs, V), axis=0)
        better = tile_best > best
        new_best = tl.where(better, tile_best, best)
        # z in the frame of new_best; an all -inf prefix (new_best = -inf) keeps z = 0.
        # Same expression as the later passes (_weight), so the last tile's terms match them bit for bit.
        finite = new_best > float("-inf")
        m_new = tl.where(finite, new_best, 0.0)
        z = tl.where(finite, z * _weight(tl.where(best > float("-inf"), best, m_new), m_new, ks), 0.0)
        z += tl.where(finite, tl.sum(_weight(xm, m_new, ks), axis=0), 0.0)
        if SCORES:
            if raw_apart:
                z1 = tl.where(finite, z1 * _weight(tl.where(best > float("-inf"), best, m_new), m_new,
                                                   1.4426950408889634), 0.0)
                z1 += tl.where(finite, tl.sum(_weight(xm, m_new, 1.4426950408889634), axis=0), 0.0)
        arg = tl.where(better, tile_arg, arg)
        best = new_best
    bad = bad | (best == float("-inf")).to(tl.int32)

    thr = arg * 0 - 2139095041  # key(-inf): keeps every token
    mx = best
    Z = tl.where(bad == 0, z, 1.0)
    Z1 = tl.where(bad == 0, tl.where(raw_apart, z1, z), 1.0)
    if (bad == 0) & (greedy == 0):
        if (top_k > 0) & (top_k < V):
            thr, _ = _radix_select(row_ptr, V, thr, ks, mx, top_k.to(tl.float32), False, NUM_TILES, BLOCK_SIZE)
            Z = _mass_ge(row_ptr, V, thr, ks, mx, NUM_STREAM_TILES, STREAM_BLOCK)
        if top_p <= 0.999:
            # Half the bound's tau: slack for the rounding of Z against the select's own sums (above 0.999 the
            # margin (1 - top_p) Z / 2 nears that rounding, and the whole row is selected from).
            n_cand = _top_p_candidates(row_ptr, cand_ptr, V, thr, ks, mx, 0.5 * Z * (1.0 - top_p) / V,
                                       NUM_STREAM_TILES, STREAM_BLOCK)
            tl.debug_barrier()  # the candidates are read by other threads than the ones that wrote them
            thr, Z = _radix_select(cand_ptr, n_cand, thr, ks, mx, top_p * Z, True, NUM_TILES, BLOCK_SIZE)
            tl.debug_barrier()  # before the scratch row is reused for residuals
        elif top_p < 1.0:
            thr, Z = _radix_select(row_ptr, V, thr, ks, mx, top_p * Z, True, NUM_TILES, BLOCK_SIZE)
    return bad, arg, thr, mx, Z, qsum, Z1


@triton.jit
def _wants_draft_sum(par_vec, t_idx, node, greedy, depth, max_depth):
    """1 if ``node``'s draft row will be tested against (a sampled request, below max depth, with a child among
    the tree's ``par_vec``), else 0: only then does its row pass also sum the draft row."""
    has_child = tl.max(((par_vec == node) & (t_idx > node)).to(tl.int32), axis=0) != 0
    return ((greedy == 0) & (depth < max_depth) & has_child).to(tl.int32)


@triton.jit
def _residual_pass(row_ptr, scr_ptr, dst_ptr, dq_ptr, V, has_res, S, thr, ks, mx, Z, qsum, tok,
                   HAS_Q: tl.constexpr, NUM_TILES: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """Mass of the residual after rejecting ``tok``: max(p - q, 0) with the draft row q, or p with
    ``tok`` zeroed without one, stored (unnormalized) into the scratch row ``dst_ptr`` in the same pass
    (the current distribution is read from the other row ``scr_ptr`` when it is a residual)."""
    acc = 0.0
    for tile in range(NUM_TILES):
        start = tile * BLOCK_SIZE
        offs = start + tl.arange(0, BLOCK_SIZE)
        mask = offs < V
        p = _tile_probs(row_ptr, scr_ptr, offs, mask, has_res, S, thr, ks, mx, Z)
        if HAS_Q:
            q = tl.load(dq_ptr + offs, mask=mask, other=0.0).to(tl.float32) / qsum
            r = tl.where(mask, tl.maximum(p - q, 0.0), 0.0)
        else:
            r = tl.where(mask & (offs != tok), p, 0.0)
        acc += tl.sum(r, axis=0)
        tl.store(dst_ptr + offs, r, mask=mask)
    return acc


@triton.jit
def _sampling_params(temp_ptr, top_k_ptr, top_p_ptr, b, HAS_TEMP: tl.constexpr, HAS_TOP_K: tl.constexpr,
                     HAS_TOP_P: tl.constexpr):
    """Request b's (greedy, ks, top_k, top_p): greedy 1 unless the temperature is > 0, ``ks = log2(e) / T'``,
    top_k 0 when off, top_p 1.0 when off."""
    temp = 0.0
    if HAS_TEMP:
        temp = tl.load(temp_ptr + b).to(tl.float32)
    # Greedy unless the temperature is > 0 (NaN too); T' = clamp(T, 2**-126, 2**126) keeps ks finite and normal.
    greedy = 1 - (temp > 0.0).to(tl.int32)
    temp = tl.where(greedy != 0, 1.0, tl.minimum(tl.maximum(temp, 1.1754943508222875e-38), 8.507059173023462e37))
    ks = 1.4426950408889634 / temp
    top_k = 0
    if HAS_TOP_K:
        top_k = tl.load(top_k_ptr + b).to(tl.int32)
    top_p = 1.0
    if HAS_TOP_P:
        top_p = tl.load(top_p_ptr + b).to(tl.float32)
    # Off unless < 1 (NaN too); at least 2**-126, which keeps only the maximal logits as any top_p <= 1 / V does.
    top_p = tl.where(top_p < 1.0, tl.maximum(top_p, 1.1754943508222875e-38), 1.0)
    return greedy, ks, top_k, top_p


@triton.jit
def _visit_node(logits_ptr, dprobs_ptr, b, node, depth, par_vec, t_idx, scr_base, V, max_depth, greedy, ks, top_k, top_p,
                stride_lb, stride_lt, stride_qb, stride_qt, HAS_Q: tl.constexpr, NUM_TILES: tl.constexpr,
                BLOCK_SIZE: tl.constexpr, NUM_STREAM_TILES: tl.constexpr, STREAM_BLOCK: tl.constexpr,
                SCORES: tl.constexpr):
    """The logits row of ``node`` (at ``depth``) and its ``_row_state`` (bad, argmax, thr, mx, Z, qsum, Z1); the draft
    row is summed only when the node's children will be tested against it (``_wants_draft_sum``)."""
    row_ptr = logits_ptr + b * stride_lb + node.to(tl.int64) * stride_lt
    want_q = node * 0
    if HAS_Q:
        want_q = _wants_draft_sum(par_vec, t_idx, node, greedy, depth, max_depth)
    # A visited row's top-p candidates go to scratch row 0: no residual is live when a row is visited.
    bad, arg, thr, mx, Z, qsum, Z1 = _row_state(row_ptr, dprobs_ptr + b * stride_qb + node.to(tl.int64) * stride_qt,
                                                want_q, scr_base, V, greedy, ks, top_k, top_p, NUM_TILES, BLOCK_SIZE,
                                                NUM_STREAM_TILES, STREAM_BLOCK, SCORES)
    return row_ptr, bad, arg, thr, mx, Z, qsum, Z1


@triton.jit
def _accept_child(x, j, arg, greedy, err, q_ready, row_ptr, scr_ptr, dq_ptr, has_res, S, thr, ks, mx, Z, qsum, t_idx,
                  coin_accept, HAS_Q: tl.constexpr):
    """The accept test of child ``j`` proposing token ``x``: greedy, ``x`` must be the row's argmax; sampled,
    ``u * q(x) < p(x)`` with the child's coin u, p the current distribution and q the draft row (``u < p(x)``
    without draft rows). Returns (accept, err, q_ready): the draft row's sum is checked when its first child is
    tested, and an error rejects."""
    accept = x == arg
    px = 0.0
    if greedy == 0:
        if HAS_Q:
            if q_ready == 0:  # qsum came with the row's pass; checked when its first child is tested
                err = err | ((qsum <= 0.0) | (qsum != qsum) | (qsum == float("inf"))).to(tl.int32)
                q_ready = 1
        if has_res != 0:
            px = tl.load(scr_ptr + x) / S
        else:
            lx = tl.load(row_ptr + x).to(tl.float32)
            px = tl.where(_order_key(lx) >= thr, _weight(lx, mx, ks), 0.0) / Z
        u = tl.sum(tl.where(t_idx == j, coin_accept, 0.0), axis=0)
        if HAS_Q:
            qx = tl.load(dq_ptr + x).to(tl.float32) / qsum
            accept = u * qx < px
        else:
            accept = u < px
    accept = accept & (err == 0)
    return accept, err, q_ready


@triton.jit
def _record_accepted(path_tokens, path_nodes, took, d_idx, depth, x, j):
    """Appends accepted child ``j`` (token ``x``) to the path: (path_tokens, path_nodes, took, depth + 1)."""
    path_tokens = tl.where(d_idx == depth, x, path_tokens)
    took += (d_idx == depth).to(tl.int32)
    depth += 1
    path_nodes = tl.where(d_idx == depth, j, path_nodes)
    return path_tokens, path_nodes, took, depth


@triton.jit
def _score_token(row_ptr, x, greedy, mx, Z, Z1, ks, d_idx, depth, lp_sampled, lp_raw):
    """Writes token ``x``'s log-probs under the current row into slot ``depth`` of ``(lp_sampled, lp_raw)``: the
    sampling law's ``log(_weight(l, mx, ks) / Z)`` (0 for greedy: a point mass) and the raw ``log(_weight(l, mx,
    log2 e) / Z1)``, as ``ln 2 * (log2 weight - log2 normalizer)`` (no exp/log round trip). One element of a row the
    walk already read: the target's law of the row, not a residual, since acceptance is lossless."""
    lx = tl.load(row_ptr + x).to(tl.float32)
    sampled = tl.where(greedy != 0, 0.0, 0.6931471805599453 * (_log2_weight(lx, mx, ks) - tl.log2(Z)))
    raw = 0.6931471805599453 * (_log2_weight(lx, mx, 1.4426950408889634) - tl.log2(Z1))
    lp_sampled = tl.where(d_idx == depth, sampled, lp_sampled)
    lp_raw = tl.where(d_idx == depth, raw, lp_raw)
    return lp_sampled, lp_raw


@triton.jit
def _reject_child(row_ptr, scr_ptr, scr_base, dq_ptr, res_i, has_res, S, thr, ks, mx, Z, qsum, x, V,
                  HAS_Q: tl.constexpr, NUM_STREAM_TILES: tl.constexpr, STREAM_BLOCK: tl.constexpr):
    """Writes the residual after rejecting token ``x`` into the scratch row not in use and adopts it if its mass is
    positive. Returns the residual state (res_i, scr_ptr, has_res, S)."""
    dst_ptr = scr_base + (1 - res_i) * V
    R = _residual_pass(row_ptr, scr_ptr, dst_ptr, dq_ptr, V, has_res, S, thr, ks, mx, Z, qsum, x,
                       HAS_Q, NUM_STREAM_TILES, STREAM_BLOCK)
    # Orders this pass's writes before every thread's later single-element reads of the row
    # (and before the next pass overwrites the row this one read).
    tl.debug_barrier()
    if R > 0.0:
        res_i = 1 - res_i
        scr_ptr = dst_ptr
        has_res = 1
        S = R
    return res_i, scr_ptr, has_res, S


@triton.jit
def _final_token(arg, greedy, err, cur, t_idx, coin_sample, row_ptr, scr_ptr, has_res, S, thr, ks, mx, Z, V,
                 NUM_STREAM_TILES: tl.constexpr, STREAM_BLOCK: tl.constexpr):
    """The token drawn at the walk's last node ``cur``: its argmax when greedy, else an inverse-CDF draw with the
    node's sample coin from the current distribution. Returns (token, err); no token of positive mass sets err."""
    final = arg
    if (greedy == 0) & (err == 0):
        u = tl.sum(tl.where(t_idx == cur, coin_sample, 0.0), axis=0)
        total = 0.0
        for tile in range(NUM_STREAM_TILES):
            start = tile * STREAM_BLOCK
            offs = start + tl.arange(0, STREAM_BLOCK)
            mask = offs < V
            p = _tile_probs(row_ptr, scr_ptr, offs, mask, has_res, S, thr, ks, mx, Z)
            total += tl.sum(p, axis=0)
        target = u * total
        carry = 0.0
        found = V
        last = V
        for tile in range(NUM_STREAM_TILES):
            start = tile * STREAM_BLOCK
            offs = start + tl.arange(0, STREAM_BLOCK)
            mask = offs < V
            p = _tile_probs(row_ptr, scr_ptr, offs, mask, has_res, S, thr, ks, mx, Z)
            cdf = tl.cumsum(p, axis=0) + carry
            # Positive mass only: cumsum and the tiles' carry are differently rounded sums, and a target in a
            # rounding gap between them must not land on a zero-probability token.
            found = tl.minimum(found, tl.min(tl.where((cdf > target) & mask & (p > 0.0), offs, V), axis=0))
            last = tl.where(tl.max(p, axis=0) > 0.0, tl.max(tl.where(p > 0.0, offs, -1), axis=0), last)
            carry += tl.sum(p, axis=0)
        final = tl.where(found < V, found, last)
        # No token of positive mass (no valid row leads here: its maximal logits weigh 1): flagged, never emitted.
        err = err | (final >= V).to(tl.int32)
    return final, err


@triton.jit
def _walk_tree(logits_ptr, dprobs_ptr, tokens_ptr, parents_ptr, b, n, zero, scr_base, res_i, scr_ptr, d_idx, path_tokens,
               path_nodes, tried, took, par_vec, t_idx, coin_accept, coin_sample, greedy, ks, top_k, top_p, V, max_depth,
               stride_lb, stride_lt, stride_qb, stride_qt, stride_tb, stride_pb, HAS_Q: tl.constexpr,
               NUM_TILES: tl.constexpr, BLOCK_SIZE: tl.constexpr, NUM_STREAM_TILES: tl.constexpr,
               STREAM_BLOCK: tl.constexpr, SCORES: tl.constexpr):
    """Walks request b's tree from the root, testing each child of the current node in order, descending into the
    first accepted one, then draws the final token (``_final_token``). ``res_i``/``scr_ptr`` name the scratch row
    in use, the path vectors are the per-depth outputs so far. Returns (err, depth, final token, path_tokens,
    path_nodes, tried, took, lp_sampled, lp_raw); with ``SCORES`` the last two hold each emitted token's log-probs
    (``_score_token``), else zeros."""
    cur = zero
    depth = zero
    lp_sampled = d_idx.to(tl.float32) * 0.0
    lp_raw = lp_sampled
    row_ptr, err, arg, thr, mx, Z, qsum, Z1 = _visit_node(logits_ptr, dprobs_ptr, b, cur, depth, par_vec, t_idx,
                                                          scr_base, V, max_depth, greedy, ks, top_k, top_p, stride_lb,
                                                          stride_lt, stride_qb, stride_qt, HAS_Q, NUM_TILES, BLOCK_SIZE,
                                                          NUM_STREAM_TILES, STREAM_BLOCK, SCORES)
    has_res = 0
    S = 1.0
    q_ready = 0
    # A while loop: the CPU interpreter cannot take a tensor bound in range(); the tile loops use
    # constexpr trip counts (NUM_TILES) so the GPU keeps pipelined for loops there.
    # Nodes are topologically ordered, so one scan over node indices meets every child of the
    # current node in increasing order, and the children of an accepted node all come after it.
    j = zero + 1
    while j < n:
        par = tl.load(parents_ptr + b * stride_pb + j)
        if (par == cur) & (depth < max_depth) & (err == 0):
            x = tl.load(tokens_ptr + b * stride_tb + j).to(tl.int32)
            tried += (d_idx == depth).to(tl.int32)
            err = err | ((x < 0) | (x >= V)).to(tl.int32)
            x = tl.minimum(tl.maximum(x, 0), V - 1)
            dq_ptr = dprobs_ptr + b * stride_qb + cur.to(tl.int64) * stride_qt
            accept, err, q_ready = _accept_child(x, j, arg, greedy, err, q_ready, row_ptr, scr_ptr, dq_ptr, has_res, S,
                                                 thr, ks, mx, Z, qsum, t_idx, coin_accept, HAS_Q)
            if accept:
                if SCORES:
                    lp_sampled, lp_raw = _score_token(row_ptr, x, greedy, mx, Z, Z1, ks, d_idx, depth, lp_sampled,
                                                      lp_raw)
                path_tokens, path_nodes, took, depth = _record_accepted(path_tokens, path_nodes, took, d_idx, depth, x, j)
                cur = j
                row_ptr, err, arg, thr, mx, Z, qsum, Z1 = _visit_node(logits_ptr, dprobs_ptr, b, j, depth, par_vec,
                                                                      t_idx, scr_base, V, max_depth, greedy, ks, top_k,
                                                                      top_p, stride_lb, stride_lt, stride_qb, stride_qt,
                                                                      HAS_Q, NUM_TILES, BLOCK_SIZE, NUM_STREAM_TILES,
                                                                      STREAM_BLOCK, SCORES)
                has_res = 0
                S = 1.0
                q_ready = 0
            elif (greedy == 0) & (err == 0):
                res_i, scr_ptr, has_res, S = _reject_child(row_ptr, scr_ptr, scr_base, dq_ptr, res_i, has_res, S, thr,
                                                           ks, mx, Z, qsum, x, V, HAS_Q, NUM_STREAM_TILES, STREAM_BLOCK)
        j += 1
    final, err = _final_token(arg, greedy, err, cur, t_idx, coin_sample, row_ptr, scr_ptr, has_res, S, thr, ks, mx, Z, V,
                              NUM_STREAM_TILES, STREAM_BLOCK)
    if SCORES:
        lp_sampled, lp_raw = _score_token(row_ptr, tl.minimum(tl.maximum(final, 0), V - 1), greedy, mx, Z, Z1, ks,
                                          d_idx, depth, lp_sampled, lp_raw)
    return err, depth, final, path_tokens, path_nodes, tried, took, lp_sampled, lp_raw


@triton.jit
def _store_outputs(out_tokens_ptr, out_num_ptr, out_nodes_ptr, out_err_ptr, out_stats_ptr, out_scores_ptr, b, err,
                   depth, final, d_idx, path_tokens, path_nodes, tried, took, lp_sampled, lp_raw, max_depth,
                   STATS: tl.constexpr, SCORES: tl.constexpr):
    """Writes request b's outputs: the accepted tokens with the final one at ``depth``, the accepted nodes, their
    count, the error flag, the per-depth (tried, took) stats and the emitted tokens' (sampled, raw) log-probs (0 past
    ``depth``); an erroring request gets an empty result."""
    ok = err == 0
    path_tokens = tl.where(d_idx == depth, final, path_tokens)
    path_tokens = tl.where(ok, path_tokens, -1)
    path_nodes = tl.where(ok | (d_idx == 0), path_nodes, -1)
    dmask = d_idx < max_depth + 1
    tl.store(out_tokens_ptr + b * (max_depth + 1) + d_idx, path_tokens, mask=dmask)
    tl.store(out_nodes_ptr + b * (max_depth + 1) + d_idx, path_nodes, mask=dmask)
    tl.store(out_num_ptr + b, tl.where(ok, depth, 0))
    tl.store(out_err_ptr + b, err)
    if STATS:
        smask = d_idx < max_depth
        base = out_stats_ptr + b * max_depth * 2 + d_idx * 2
        tl.store(base, tl.where(ok, tried, 0), mask=smask)
        tl.store(base + 1, tl.where(ok, took, 0), mask=smask)
    if SCORES:
        scored = ok & (d_idx <= depth)
        base = out_scores_ptr + b * (max_depth + 1) * 2 + d_idx * 2
        tl.store(base, tl.where(scored, lp_sampled, 0.0), mask=dmask)
        tl.store(base + 1, tl.where(scored, lp_raw, 0.0), mask=dmask)


@triton.jit
def _verify_tree_kernel(
    logits_ptr, dprobs_ptr, tokens_ptr, parents_ptr, num_nodes_ptr,
    temp_ptr, top_k_ptr, top_p_ptr, seed_ptr, offset_ptr, scratch_ptr,
    out_tokens_ptr, out_num_ptr, out_nodes_ptr, out_err_ptr, out_stats_ptr, out_scores_ptr,
    T, V, max_depth,
    stride_lb, stride_lt, stride_qb, stride_qt, stride_tb, stride_pb,
    HAS_Q: tl.constexpr, HAS_TEMP: tl.constexpr, HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr,
    STATS: tl.constexpr, SCORES: tl.constexpr, NODE_BLOCK: tl.constexpr, DEPTH_BLOCK: tl.constexpr, NUM_TILES: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    NUM_STREAM_TILES: tl.constexpr, STREAM_BLOCK: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    zero = tl.program_id(0) * 0  # an int32 tensor, so loop indices can be used as tensors
    n = tl.load(num_nodes_ptr + b)
    greedy, ks, top_k, top_p = _sampling_params(temp_ptr, top_k_ptr, top_p_ptr, b, HAS_TEMP, HAS_TOP_K, HAS_TOP_P)
    seed = tl.load(seed_ptr + b)
    offset = tl.load(offset_ptr + b)

    # Two scratch rows, ping-pong: a rejection writes its residual into the row not in use while summing it, and
    # adopts it only if its mass is positive (a zero residual keeps the current distribution).
    scr_base = scratch_ptr + b * 2 * V
    res_i = zero
    scr_ptr = scr_base

    d_idx = tl.arange(0, DEPTH_BLOCK)
    path_tokens = tl.full([DEPTH_BLOCK], -1, tl.int32)
    path_nodes = tl.where(d_idx == 0, 0, -1)
    tried = tl.zeros([DEPTH_BLOCK], tl.int32)
    took = tl.zeros([DEPTH_BLOCK], tl.int32)

    # Every coin of the request at once, across lanes, off the walk's serial path.
    t_idx = tl.arange(0, NODE_BLOCK)
    # Parents of the whole tree (T <= NODE_BLOCK): whether a node has children decides if its draft row is summed.
    par_vec = tl.load(parents_ptr + b * stride_pb + t_idx, mask=t_idx < n, other=-2)
    coin_accept = _philox_uniform(seed, offset, t_idx, 0)
    coin_sample = _philox_uniform(seed, offset, t_idx, 1)

    err, depth, final, path_tokens, path_nodes, tried, took, lp_sampled, lp_raw = _walk_tree(
        logits_ptr, dprobs_ptr, tokens_ptr, parents_ptr, b, n, zero, scr_base, res_i, scr_ptr, d_idx, path_tokens,
        path_nodes, tried, took, par_vec, t_idx, coin_accept, coin_sample, greedy, ks, top_k, top_p, V, max_depth,
        stride_lb, stride_lt, stride_qb, stride_qt, stride_tb, stride_pb, HAS_Q, NUM_TILES, BLOCK_SIZE, NUM_STREAM_TILES,
        STREAM_BLOCK, SCORES)
    _store_outputs(out_tokens_ptr, out_num_ptr, out_nodes_ptr, out_err_ptr, out_stats_ptr, out_scores_ptr, b, err, depth,
                   final, d_idx, path_tokens, path_nodes, tried, took, lp_sampled, lp_raw, max_depth, STATS, SCORES)


def _launch(logits, draft_tokens, parents, num_nodes, draft_probs, temperature, top_k, top_p, seed, offset,
            max_depth, return_stats, block_size=None, out=None, scores=None):
    """Launch the kernel; ``out`` optionally supplies (tokens, num, nodes, error, stats) buffers; ``scores``, a
    float32 ``[B, max_depth+1, 2]`` buffer, turns on the fused log-probs (sampled, raw) of the emitted tokens."""
    B, T, V = logits.shape
    dev = logits.device
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    draft_tokens = draft_tokens.contiguous()
    parents = parents.to(torch.int32).contiguous()
    if out is None:
        out = empty_verify_outputs(logits, max_depth, return_stats)
    out_tokens, out_num, out_nodes, out_err, out_stats = out
    scratch = torch.empty(B, 2, V, dtype=torch.float32, device=dev)  # ping-pong residual rows
    has_q = draft_probs is not None
    dprobs = (draft_probs if draft_probs.stride(-1) == 1 else draft_probs.contiguous()) if has_q else logits
    dummy_f = out_err  # never read when the matching flag is off
    if block_size is None:
        # 1024 x 8 warps keeps the [BLOCK, 16] radix histogram in registers (no spills on sm_90).
        block_size = min(1024, triton.next_power_of_2(V))
        # The streaming passes (row statistics, residual, sampling) carry no histogram: without top-k/top-p they
        # take 2048-wide tiles, half the dependent trips over a 152k row (one program walks a request, so a pass
        # is latency-bound, so the time goes with the tile count; figures: docs/CUDA_NOTES.md, "Backend order").
        # ptxas for sm_90 (8 warps): 2048 keeps 0 spills there, 4096 spills 104 B; with top-p the kernel already
        # spills 60 B at 1024 and 200 B at 2048, so it keeps 1024.
        plain = top_k is None and top_p is None
        stream_block = min(STREAM_BLOCK_MAX if plain else block_size, triton.next_power_of_2(V))
    else:
        stream_block = block_size  # tests: small tiles exercise the multi-tile and ragged-tile paths
    num_warps = 8 if block_size >= 1024 else 4
    if B > 0:
        _verify_tree_kernel[(B,)](
            logits, dprobs, draft_tokens, parents, num_nodes.to(torch.int32).contiguous(),
            # Read at index b: a view (a column, an expanded scalar) must be dense (the op already made it so).
            temperature.contiguous() if temperature is not None else dummy_f,
            top_k.contiguous() if top_k is not None else dummy_f,
            top_p.contiguous() if top_p is not None else dummy_f,
            seed.contiguous(), offset.contiguous(), scratch,
            out_tokens, out_num, out_nodes, out_err, out_stats if return_stats else out_err,
            scores if scores is not None else out_err,
            T, V, max_depth,
            logits.stride(0), logits.stride(1), dprobs.stride(0), dprobs.stride(1),
            draft_tokens.stride(0), parents.stride(0),
            HAS_Q=has_q, HAS_TEMP=temperature is not None, HAS_TOP_K=top_k is not None,
            HAS_TOP_P=top_p is not None, STATS=bool(return_stats), SCORES=scores is not None,
            NODE_BLOCK=triton.next_power_of_2(T), DEPTH_BLOCK=triton.next_power_of_2(max_depth + 1),
            NUM_TILES=triton.cdiv(V, block_size), BLOCK_SIZE=block_size,
            NUM_STREAM_TILES=triton.cdiv(V, stream_block), STREAM_BLOCK=stream_block, num_warps=num_warps,
        )
    return out_tokens, out_num, out_nodes, out_err, out_stats


_verify_tree_op, verify_tree_triton = make_verify_tree_op("tlt::verify_tree_triton", _launch)
verify_tree_triton.__doc__ = """Triton backend of :func:`tlt_kernels.verify_tree` (inputs already validated by the op)."""


_verify_tree_scored_op, verify_tree_triton_scored = make_verify_tree_op("tlt::verify_tree_triton_scored",
                                                                        scored_launch(_launch), scored=True)
verify_tree_triton.scored = verify_tree_triton_scored  # the op takes it when log-probs are asked for
