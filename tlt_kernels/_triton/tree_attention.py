"""Triton backend of tree attention (flash-decoding over a paged cache, tree mask on the tree part).

Work split (see docs/TREE_ATTENTION.md): one program per (context split s, row chunk, kv head, request).
A program holds the ``M = T * G`` query rows of its KV head -- every tree node times every query
head that shares the KV head -- so each K/V tile is read from HBM once and feeds an ``[M, D] x
[D, BLOCK_N]`` tensor-core product. Rows beyond ``MAX_BLOCK_M`` are split into row chunks whose
programs are launched next to each other, so their re-reads of the same tile hit L2.

Deviation inside the plan's scratch contract (internal to this backend): the tree tokens are folded
into the *last non-empty* context split of each request instead of a separate slot ``S``, and a
request whose context fits one split writes ``out`` directly (no scratch traffic, no merge). The merge
only combines the ``ceil(context_lens[b] / split_len)`` slots a request actually used: from ``WIDE_MERGE_MIN_SPLITS``
splits in a merge kernel that reads them side by side; below it in the partial kernel, by the last split to finish
(counted in ``plan.split_counters``), where a program holds at most ``FUSED_MERGE_MAX_ROWS`` rows, else in a merge
kernel that walks them.

Online softmax in base 2: with ``qk_scale = sm_scale * log2(e)``, ``p = 2^(s*qk_scale - m)``;
the stored LSE is natural-log, ``(m + log2(l)) * ln(2)``, as the plan contract says.

NaN (the contract of ``ops.tree_attention.run``): a NaN score makes a row's sum ``l`` NaN, and a split writes a NaN
LSE for it (never the -inf of an empty split, which the merge would skip); the merge flags NaN LSEs and reads every
non-empty split's partial. Unattended slots are masked loads (``other=0``). A tree slot whose V holds NaN/inf joins
P V zeroed, with a NaN score for the rows that see it (``_tree_attend``). A page id outside ``[0, num_blocks)`` is read
as an in-range page and makes the program's rows NaN (``_checked_pages``; in the context loop ``_clamped_pages``, the
split's ids tested once after it by ``_pages_out_of_range``; over fp8 caches the first ``PAGE_SCAN`` before it).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .._backend import triton_interpret_enabled

LOG2E = 1.4426950408889634

# Largest row tile per head dim: the fp32 accumulator is BLOCK_M x D and must stay in registers.
MAX_BLOCK_M = {64: 128, 128: 128, 256: 64}

# (head_dim, BLOCK_M) -> (BLOCK_N, num_warps, num_stages[, maxnreg]), hand-picked for sm_90 (docs/TREE_ATTENTION.md,
# "Tuning").
# Retune from `python -m bench tree-attention`: BLOCK_N trades K/V tile size (bigger = fewer loop
# trips, better latency hiding) against registers for the [BLOCK_M, BLOCK_N] score tile. A 4th entry
# caps registers per thread (the `maxnreg` compile option), e.g. to fit two programs per SM.
PARTIAL_CONFIGS = {
    (64, 16): (64, 4, 3),
    (64, 32): (64, 4, 3),
    (64, 64): (64, 4, 3),
    (64, 128): (64, 8, 3),
    (128, 16): (64, 4, 3),
    (128, 32): (64, 4, 3),
    (128, 64): (64, 4, 3),
    # The sweep's winner at T=16, also ahead of the two-programs-per-SM configs (docs/TREE_ATTENTION.md,
    # "Measurements behind the defaults").
    (128, 128): (128, 8, 3),
    (256, 16): (32, 4, 2),
    (256, 32): (32, 4, 2),
    (256, 64): (32, 8, 2),
}
CHUNK_BLOCK_M = 64  # row tile when T * G exceeds MAX_BLOCK_M (D <= 128); see row_tile
MERGE_BLOCK_R = 16  # rows per program of the merge kernel
PAGE_SCAN = tl.constexpr(128)  # block-table entries per load of _pages_out_of_range's pass over a split's pages
MERGE_WARPS = 4
# The merge loop (_merge_rows) as (splits per trip, software-pipeline stages): inside the partial kernel, and in the
# merge kernel (each the measured best of (1, 1), (2, 1), (1, 3), (2, 2)).
FUSED_MERGE_LOOP = (2, 1)
MERGE_KERNEL_LOOP = (1, 3)
# Where a plan has at least WIDE_MERGE_MIN_SPLITS splits the merge kernel reads them in parallel, whatever the row
# count: one program per query row loads up to WIDE_MERGE_MAX_SPLITS splits' rows as one [splits, D] tile and reduces
# across it, a round trip per that many splits instead of one per split (a walk over the splits is a chain of L2
# round trips: at one or two requests it cost as much as the attention). Measured faster there than both walks, and
# slower below it (docs/TREE_ATTENTION.md, "The merge").
WIDE_MERGE_MIN_SPLITS = 16
WIDE_MERGE_MAX_SPLITS = 64
WIDE_MERGE_WARPS = 4
# (BLOCK_N, num_warps, num_stages[, BLOCK_M[, maxnreg]]) forced for every shape when set (BLOCK_M None =
# the default row tile); the benchmark's tuning sweep (python -m bench tree-attention --sweep) and the
# tests of the non-default configs (tests/ops/test_tree_attention_triton_variants.py) set it.
CONFIG_OVERRIDE = None
# Context-loop structure: 1 = unmasked whole tiles with the page ids prefetched one trip ahead, then a
# masked tail (default); 0 = the previous every-tile-masked loop, kept as the reference the pipelined loop is
# tested against (tests/ops/test_tree_attention_triton_variants.py).
PIPELINE = 1
# Split contexts merge in each request's last split to finish (needs the plan's ``split_counters``) where a program
# holds at most FUSED_MERGE_MAX_ROWS query rows and the plan has fewer than WIDE_MERGE_MIN_SPLITS splits, rather than
# in the merge kernel (measured faster there on an H200, slower with more rows, whose merge the kernel spreads over
# more programs: docs/TREE_ATTENTION.md). 0: always the merge kernel.
FUSED_MERGE = 1
FUSED_MERGE_MAX_ROWS = 16
# Over fp8 caches with bf16 queries, K widens to fp16 against fp16-scaled rows (_query_for_fp16_keys) where a KV head
# has at most this many query rows (T * G): measured faster there (T = 4), slower at 112 rows (T = 16), even at 56
# (H200, docs/TREE_ATTENTION.md); above it K widens to bf16.
FP16_KEYS_MAX_ROWS = tl.constexpr(32)
# Over e4m3 caches with bf16 queries, at these (head_dim, row tile) the rows split into two e4m3 parts
# (_query_as_fp8_pair) and the keys enter the products as stored, with no widening: measured faster at 64-row tiles
# (T = 8, and T >= 32 in 64-row chunks, at G = 5-7) and at 128 (T = 16); slower at 16/32-row tiles, as mma.sync
# products and as swapped wgmma ones (9b54f87, since removed) alike (H200, docs/TREE_ATTENTION.md). Elsewhere the
# keys widen as above.
FP8_KEY_PRODUCT_TILES = frozenset({(128, 64), (128, 128)})
# FA4-style lazy rescaling threshold (log2 units) for the unmasked context tiles; 0 = rescale every tile.
# Off: the block-wide max it branches on costs a cross-warp reduction and barrier per tile, more than the
# accumulator multiply it skips (docs/TREE_ATTENTION.md, "Measurements behind the defaults"). Kept, with its
# correctness tests (tests/ops/test_tree_attention_triton_variants.py), for a retune on another card.
LAZY_RESCALE = 0.0
# Where the tree's K tile (BLOCK_T slots x D values as cached) takes at most HOIST_TREE_MAX_BYTES and the program's
# accumulator (BLOCK_M rows x D) at most HOIST_TREE_MAX_ACC values, the tree's page ids, K/V and mask words are loaded
# before the context loop rather than after it: a short context's few tiles are a chain of memory round trips, and
# the tree's no longer adds two more at the end. Elsewhere the loads stay after the loop: held across it, the tree's
# operands compete with a large accumulator (64-row tiles at D = 128 were slower, 128-row ones overflowed shared
# memory) or spill (D = 256 in fp32); over one-byte (fp8) caches it gained nothing overall (0.94-1.06x), so it stays
# off there unless HOIST_TREE_ONE_BYTE. Measured: docs/TREE_ATTENTION.md, "Measurements behind the defaults".
HOIST_TREE_MAX_BYTES = 4096
HOIST_TREE_MAX_ACC = 32 * 128
HOIST_TREE_ONE_BYTE = False


def hoists_tree(block_t: int, block_m: int, head_dim: int, cache_dtype: torch.dtype) -> bool:
    """Whether the partial kernel loads the tree's operands before the context loop (see HOIST_TREE_MAX_BYTES)."""
    tile_bytes = block_t * head_dim * cache_dtype.itemsize
    return ((cache_dtype.itemsize > 1 or HOIST_TREE_ONE_BYTE) and tile_bytes <= HOIST_TREE_MAX_BYTES
            and block_m * head_dim <= HOIST_TREE_MAX_ACC)


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


@triton.jit
def _block_power_of_two(qf, finite, TOP: tl.constexpr, LIMIT: tl.constexpr):
    """``(2^-s, 2^s)`` for the fp32 block ``qf``: multiplying by ``2^-s`` puts its largest ``|x|`` among the ``finite``
    entries in ``[2^TOP, 2^(TOP+1))``, with ``|s| <= LIMIT``. Powers of two built from their bits, so scaling by them
    is exact."""
    amax = tl.max(tl.max(tl.where(finite, tl.abs(qf), 0.0), 1), 0)
    exponent = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # floor(log2(amax)) for a normal amax
    s = tl.minimum(tl.maximum(exponent - TOP, -LIMIT), LIMIT)
    return ((127 - s) << 23).to(tl.float32, bitcast=True), ((127 + s) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _query_for_fp16_keys(q, qk_scale):
    """bf16 rows ``q [BLOCK_M, D]`` as fp16, for products with fp8 keys widened to fp16 (one conversion per pair of
    values; bf16 takes three): scaled by ``2^-s`` so the block's largest finite ``|q|`` lands in ``[2^14, 2^15)``, and
    ``qk_scale * 2^s`` to undo it. Powers of two built from their bits, so the scaling is exact; the fp16 value is
    exact for every component within ``2^31`` of that largest one (fp16 keeps 8 significant bits down to ``2^-17`` of
    its range), and off by at most ``2^-39`` of it below that. NaN and inf components stay what they are."""
    qf = q.to(tl.float32)
    down, up = _block_power_of_two(qf, tl.abs(qf) < float("inf"), 14, 100)
    return (qf * down).to(tl.float16), qk_scale * up


@triton.jit
def _query_as_fp8_pair(q, qk_scale, INTERPRET: tl.constexpr):
    """bf16 rows ``q [BLOCK_M, D]`` as two e4m3 parts ``hi + lo`` for products with e4m3 keys as stored (no widening
    of K): scaled by ``2^-s`` so the block's largest finite ``|q|`` lands in ``[2^7, 2^8)``, ``hi`` the nearest e4m3
    value, ``lo`` the nearest to the remainder, and ``qk_scale * 2^s`` to undo the scaling. A bf16 value keeps 8
    significant bits and the remainder is a multiple of its last bit below half of ``hi``'s, so ``hi + lo`` is the
    value exactly wherever ``lo`` is not subnormal-rounded (components within ``2^9`` of that largest one); below, off
    by at most ``2^-10`` of the scaled largest. NaN and inf components become NaN (the scores they touch are NaN)."""
    qf = q.to(tl.float32)
    finite = tl.abs(qf) < float("inf")
    down, up = _block_power_of_two(qf, finite, 7, 126)  # |s| <= 126: 2^-s and 2^s both normal fp32 values
    scaled = tl.where(finite, qf * down, float("nan"))
    hi = _round_to_e4m3(scaled)
    lo = _round_to_e4m3(scaled - hi)
    if not INTERPRET:  # exact values: the casts do not round (the interpreter's products take fp32 rows)
        hi = hi.to(tl.float8e4nv)
        lo = lo.to(tl.float8e4nv)
    return hi, lo, qk_scale * up


@triton.jit
def _round_to_e4m3(x):
    """fp32 ``x`` (``|x| < 448`` or NaN) rounded to the nearest e4m3 value, ties to even, as fp32: 3 mantissa bits by
    integer rounding of the bits, multiples of ``2^-9`` below ``2^-6`` (e4m3's subnormals) by adding and removing
    ``1.5 * 2^14``, whose fp32 ulp is ``2^-9``. By hand because the CPU interpreter's cast to e4m3 misrounds where a
    value rounds up into the next binade (7.90625 to 4, and NaN to 384); the GPU's cast then only converts exact
    values."""
    bits = x.to(tl.int32, bitcast=True)
    normal = ((bits + ((1 << 19) - 1) + ((bits >> 20) & 1)) & ~((1 << 20) - 1)).to(tl.float32, bitcast=True)
    subnormal = (x + 24576.0) - 24576.0
    return tl.where(x != x, x, tl.where(tl.abs(x) < 0.015625, subnormal, normal))


@triton.jit
def _widen_tile(k, v, q_dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """A K/V tile as the products take it: K in q's dtype (fp16 over fp8 caches: ``_query_for_fp16_keys``); V in
    q's dtype, or in fp16 from an fp8 cache (then P V runs in fp16). Both widenings are exact (scales are folded
    outside). fp16 because an fp8 value becomes fp16 in one conversion per pair of values and bf16 only through
    three: the conversions, not the halved bytes, bound the kernel over fp8 caches (docs/TREE_ATTENTION.md). The CPU
    interpreter has no bf16 arithmetic: there both go to fp32 (on the GPU bf16/fp16 operands keep tensor cores)."""
    if INTERPRET:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    else:
        if v.dtype.is_fp8():
            v = v.to(tl.float16)
        else:
            v = v.to(q_dtype)
        if not q_dtype.is_fp8():  # e4m3 rows (_query_as_fp8_pair) take the keys as stored
            k = k.to(q_dtype)
    return k, v


@triton.jit
def _scores(q, q_lo, k, INTERPRET: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Raw scores ``q k^T [BM, BN]``. With rows split in two e4m3 parts (``_query_as_fp8_pair``: ``q`` the high part,
    ``q_lo`` the remainder; else ``q_lo`` is None) two fp8 products over the keys as stored, the remainder's first so
    the larger part rounds last."""
    if q_lo is not None:
        if INTERPRET:
            s = tl.dot(q_lo, tl.trans(k), input_precision="ieee")
            return tl.dot(q, tl.trans(k), s, input_precision="ieee")
        s = tl.dot(q_lo, tl.trans(k))
        return tl.dot(q, tl.trans(k), s)
    return tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)


@triton.jit
def _attend_tile(q, q_lo, k, v, visible, bias, m_i, l_i, acc, qk_scale, INTERPRET: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):
    """One online-softmax step: rows ``q [BM, D]`` against a K/V tile ``[BN, D]``; ``visible`` and ``bias`` (added to
    the visible scores: 0, or NaN to poison a row that sees that key) broadcast to [BM, BN]."""
    k, v = _widen_tile(k, v, q.dtype, INTERPRET)
    qk = _scores(q, q_lo, k, INTERPRET, DOT_PRECISION) * qk_scale
    qk = tl.where(visible, qk + bias, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _attend_full_tile(q, q_lo, k, v, m_i, l_i, acc, qk_scale, INTERPRET: tl.constexpr, LAZY_RESCALE: tl.constexpr,
                      DOT_PRECISION: tl.constexpr):
    """``_attend_tile`` for a tile whose keys are all visible: no mask, and the scale folded into the
    exponent's FMA (``m`` is tracked on the raw scores, ``qk_scale > 0`` keeps the max the same)."""
    k, v = _widen_tile(k, v, q.dtype, INTERPRET)
    return _softmax_pv(_scores(q, q_lo, k, INTERPRET, DOT_PRECISION), v, m_i, l_i, acc, qk_scale, LAZY_RESCALE,
                       DOT_PRECISION)


@triton.jit
def _softmax_pv(qk, v, m_i, l_i, acc, qk_scale, LAZY_RESCALE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Online-softmax update with raw scores ``qk [BM, BN]`` (all visible) and the tile's ``v [BN, D]``.

    ``LAZY_RESCALE = tau > 0`` (FA4): keep the stale running max unless some row's tile max exceeds it
    by more than ``tau`` (log2 units), so after the first tiles the ``acc`` / ``l`` rescale is skipped
    for the whole tile. Exact: ``p <= 2^tau`` (fine in fp32 and bf16), and ``o = acc / l``,
    ``lse = m + log2(l)`` hold for any ``m`` both were accumulated against.
    """
    m_tile = tl.max(qk, 1) * qk_scale
    if LAZY_RESCALE > 0:
        if tl.max(m_tile - m_i, 0) > LAZY_RESCALE:
            m_new = tl.maximum(m_i, m_tile)
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha
            acc = acc * alpha[:, None]
            m_i = m_new
        p = tl.exp2(qk * qk_scale - m_i[:, None])
        l_i = l_i + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        return m_i, l_i, acc
    else:
        m_new = tl.maximum(m_i, m_tile)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk * qk_scale - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        return m_new, l_i, acc


@triton.jit
def _to_out_dtype(x, out_dtype: tl.constexpr, INTERPRET: tl.constexpr, DROP_BITS: tl.constexpr):
    """fp32 -> the output dtype, rounding to nearest even (``DROP_BITS``: mantissa bits fp32 has over it)."""
    if INTERPRET and DROP_BITS > 0:
        # The interpreter truncates on this cast; round by hand so CPU results match the GPU's RTNE.
        bits = x.to(tl.int32, bitcast=True)
        bits = bits + ((1 << (DROP_BITS - 1)) - 1) + ((bits >> DROP_BITS) & 1)
        # NaN stays NaN (a payload near the top would otherwise carry into the sign or round to inf).
        x = tl.where(x != x, x, (bits & ~((1 << DROP_BITS) - 1)).to(tl.float32, bitcast=True))
    return x.to(out_dtype)


@triton.jit
def _checked_pages(pages, num_blocks):
    """Page ids outside ``[0, num_blocks)`` become page 0 and are flagged (int32 1). The host checks the table when it
    can (ops.tree_attention); a table it could not check (a replayed CUDA graph) must still never be read out of
    bounds, and its requests come out as NaN rows instead of silently wrong ones."""
    ok = (pages >= 0) & (pages < num_blocks)
    return tl.where(ok, pages, 0).to(tl.int64), (~ok).to(tl.int32)


@triton.jit
def _last_page(num_blocks):
    """``num_blocks - 1`` as a uint32 scalar (a tensor: num_blocks may arrive as a specialized constant)."""
    return (tl.zeros((), tl.int32) + (num_blocks - 1)).to(tl.uint32, bitcast=True)


@triton.jit
def _clamped_pages(pages, last_page):
    """The context loop's bound on page ids, where it repeats every tile: one unsigned minimum with ``last_page``
    (``_last_page``; a negative id is above every valid page as unsigned), so nothing out of range is read. No flag in
    the loop: further uses of the ids there cost it more than their instructions (docs/TREE_ATTENTION.md, "What the
    page-id bounds check costs"); ``_pages_out_of_range`` tests the split's ids once after the loop (over fp8 caches
    the first ``PAGE_SCAN`` before it)."""
    return tl.minimum(pages.to(tl.uint32, bitcast=True), last_page).to(tl.int64)


@triton.jit
def _page_ids_unsigned(bt_row, p0, stop):
    """Block-table entries ``p0 .. p0+PAGE_SCAN-1`` of ``bt_row`` (those below ``stop``, else 0) as uint32 [PAGE_SCAN]:
    a negative id reads above every valid page, so one unsigned maximum bounds both sides."""
    ids = p0 + tl.arange(0, PAGE_SCAN)
    return tl.load(bt_row + ids, mask=ids < stop, other=0).to(tl.uint32, bitcast=True)


@triton.jit
def _pages_out_of_range(bt_row, first, stop, last_page, INTERPRET: tl.constexpr):
    """int32 1 when a block-table entry ``first .. stop-1`` of ``bt_row`` is outside ``[0, last_page]``, else 0: the
    largest as unsigned, over loads of ``PAGE_SCAN`` entries."""
    largest = tl.zeros([PAGE_SCAN], dtype=tl.uint32)
    if INTERPRET:  # the interpreter takes no tensor bounds in range() (see _context_pipelined)
        p0 = first
        while p0 < stop:
            largest = tl.maximum(largest, _page_ids_unsigned(bt_row, p0, stop))
            p0 += PAGE_SCAN
    else:
        for p0 in range(first, stop, PAGE_SCAN):
            largest = tl.maximum(largest, _page_ids_unsigned(bt_row, p0, stop))
    return (tl.max(largest, 0) > last_page).to(tl.int32)


@triton.jit
def _context_tile(q, q_lo, k_head, v_head, bt_row, n0, end, offs_n, offs_d, stride_kp, stride_ks, stride_vp, stride_vs,
                  num_blocks, m_i, l_i, acc, qk_scale, PAGE_SIZE: tl.constexpr, INTERPRET: tl.constexpr,
                  DOT_PRECISION: tl.constexpr):
    """Context tokens ``n0 .. n0+BLOCK_N-1`` (those below ``end``): gather K/V through the block table, attend unmasked.
    Also returns 1 when a page id of the tile is out of range (see ``_checked_pages``), else 0."""
    tok = n0 + offs_n
    tok_ok = tok < end
    page, page_bad = _checked_pages(tl.load(bt_row + tok // PAGE_SIZE, mask=tok_ok, other=0), num_blocks)
    in_page = (tok % PAGE_SIZE).to(tl.int64)
    k = tl.load(k_head + (page * stride_kp + in_page * stride_ks)[:, None] + offs_d[None, :], mask=tok_ok[:, None], other=0.0)
    v = tl.load(v_head + (page * stride_vp + in_page * stride_vs)[:, None] + offs_d[None, :], mask=tok_ok[:, None], other=0.0)
    m_i, l_i, acc = _attend_tile(q, q_lo, k, v, tok_ok[None, :], 0.0, m_i, l_i, acc, qk_scale, INTERPRET, DOT_PRECISION)
    return m_i, l_i, acc, tl.max(page_bad, 0)


@triton.jit
def _full_context_tile(q, q_lo, k_head, v_head, pages, n0, offs_n, offs_d, stride_kp, stride_ks, stride_vp, stride_vs,
                       last_page, m_i, l_i, acc, qk_scale, PAGE_SIZE: tl.constexpr, INTERPRET: tl.constexpr,
                       LAZY_RESCALE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """A whole tile of context tokens ``n0 ..`` whose page ids ``pages [BLOCK_N]`` were loaded earlier: no masks; the
    ids bounded by ``_clamped_pages``."""
    page = _clamped_pages(pages, last_page)
    in_page = ((n0 + offs_n) % PAGE_SIZE).to(tl.int64)
    k = tl.load(k_head + (page * stride_kp + in_page * stride_ks)[:, None] + offs_d[None, :])
    v = tl.load(v_head + (page * stride_vp + in_page * stride_vs)[:, None] + offs_d[None, :])
    return _attend_full_tile(q, q_lo, k, v, m_i, l_i, acc, qk_scale, INTERPRET, LAZY_RESCALE, DOT_PRECISION)


@triton.jit
def _pipelined_tile(q, q_lo, k_head, v_head, bt_row, pages, n0, full_end, offs_n, offs_d, stride_kp, stride_ks,
                    stride_vp, stride_vs, last_page, m_i, l_i, acc, qk_scale, PAGE_SIZE: tl.constexpr,
                    BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr, LAZY_RESCALE: tl.constexpr,
                    DOT_PRECISION: tl.constexpr):
    """One trip of the unmasked context loop: load the page ids of the next tile (carried to the next trip, so
    the K/V loads' addresses never wait on a load of their own trip), then attend this tile. Returns the
    online-softmax state and the next tile's page ids."""
    nxt = n0 + BLOCK_N + offs_n
    pages_next = tl.load(bt_row + nxt // PAGE_SIZE, mask=nxt < full_end, other=0)
    m_i, l_i, acc = _full_context_tile(q, q_lo, k_head, v_head, pages, n0, offs_n, offs_d, stride_kp, stride_ks,
                                       stride_vp, stride_vs, last_page, m_i, l_i, acc, qk_scale, PAGE_SIZE, INTERPRET,
                                       LAZY_RESCALE, DOT_PRECISION)
    return m_i, l_i, acc, pages_next


@triton.jit
def _context_every_tile_masked(q, q_lo, k_head, v_head, bt_row, start, end, offs_n, offs_d, stride_kp, stride_ks,
                               stride_vp, stride_vs, num_blocks, m_i, l_i, acc, qk_scale, PAGE_SIZE: tl.constexpr,
                               BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Context tokens ``start .. end-1``, the legacy loop (``PIPELINE = 0``, the tests' reference for the pipelined loop):
    every tile masked, page ids looked up inside the tile. The pipeliner turns that lookup into an async copy too,
    and its wait for the lookup of tile i+1 (the newest group) drains the K/V copies of tile i+1 as well, so the
    loads of a tile never overlap the math of the previous one. Returns the softmax state and the page flag."""
    page_bad = tl.full((), 0, tl.int32)
    if INTERPRET:
        n0 = start
        while n0 < end:
            m_i, l_i, acc, tile_bad = _context_tile(q, q_lo, k_head, v_head, bt_row, n0, end, offs_n, offs_d, stride_kp,
                                                    stride_ks, stride_vp, stride_vs, num_blocks, m_i, l_i, acc, qk_scale,
                                                    PAGE_SIZE, INTERPRET, DOT_PRECISION)
            page_bad = page_bad | tile_bad
            n0 += BLOCK_N
    else:
        for n0 in range(start, end, BLOCK_N):
            m_i, l_i, acc, tile_bad = _context_tile(q, q_lo, k_head, v_head, bt_row, n0, end, offs_n, offs_d, stride_kp,
                                                    stride_ks, stride_vp, stride_vs, num_blocks, m_i, l_i, acc, qk_scale,
                                                    PAGE_SIZE, INTERPRET, DOT_PRECISION)
            page_bad = page_bad | tile_bad
    return m_i, l_i, acc, page_bad


@triton.jit
def _context_pipelined(q, q_lo, k_head, v_head, bt_row, start, end, offs_n, offs_d, stride_kp, stride_ks, stride_vp,
                       stride_vs, num_blocks, m_i, l_i, acc, qk_scale, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                       INTERPRET: tl.constexpr, LAZY_RESCALE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Context tokens ``start .. end-1``: whole tiles first, unmasked, then at most one masked tail tile. The page ids
    of tile i+1 are a plain load issued during tile i and carried to the next trip, so the K/V loads' addresses do not
    depend on a load of their own trip and the pipeliner keeps their async copies in flight across the previous
    tile's math. Returns the softmax state and the page flag (see ``_checked_pages``; over fp8 caches an out-of-range
    id among the first ``PAGE_SCAN`` makes ``l`` NaN instead, which makes the rows NaN the same way)."""
    full_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N
    # The page ids the loop reads are tested outside it (the loop only clamps them), after it; over fp8 caches the
    # first PAGE_SCAN before it, in flight with the first tile's ids, their flag carried by l (NaN: the rows come out
    # NaN) so the compiler keeps the test there (measured: docs/TREE_ATTENTION.md, "What the page-id bounds check
    # costs").
    first_page = start // PAGE_SIZE
    stop_page = (full_end + PAGE_SIZE - 1) // PAGE_SIZE
    last_page = _last_page(num_blocks)
    scan_from = first_page
    if k_head.dtype.element_ty.is_fp8():
        scan_from = first_page + PAGE_SCAN
        first_ids = _page_ids_unsigned(bt_row, first_page, stop_page)
        l_i = tl.where(tl.max(first_ids, 0) > last_page, float("nan"), l_i)
    pages = tl.load(bt_row + (start + offs_n) // PAGE_SIZE, mask=start + offs_n < full_end, other=0)
    if INTERPRET:
        # The interpreter cannot take tensor bounds in range() (numpy >= 2.4 refuses int() of its
        # 1-element scalars); a while loop is equivalent there. The GPU keeps the pipelined for loop.
        n0 = start
        while n0 < full_end:
            m_i, l_i, acc, pages = _pipelined_tile(q, q_lo, k_head, v_head, bt_row, pages, n0, full_end, offs_n, offs_d,
                                                   stride_kp, stride_ks, stride_vp, stride_vs, last_page, m_i, l_i, acc,
                                                   qk_scale, PAGE_SIZE, BLOCK_N, INTERPRET, LAZY_RESCALE,
                                                   DOT_PRECISION)
            n0 += BLOCK_N
    else:
        for n0 in range(start, full_end, BLOCK_N):
            m_i, l_i, acc, pages = _pipelined_tile(q, q_lo, k_head, v_head, bt_row, pages, n0, full_end, offs_n, offs_d,
                                                   stride_kp, stride_ks, stride_vp, stride_vs, last_page, m_i, l_i, acc,
                                                   qk_scale, PAGE_SIZE, BLOCK_N, INTERPRET, LAZY_RESCALE,
                                                   DOT_PRECISION)
    page_bad = _pages_out_of_range(bt_row, scan_from, stop_page, last_page, INTERPRET)
    if full_end < end:
        m_i, l_i, acc, tile_bad = _context_tile(q, q_lo, k_head, v_head, bt_row, full_end, end, offs_n, offs_d,
                                                stride_kp, stride_ks, stride_vp, stride_vs, num_blocks, m_i, l_i, acc,
                                                qk_scale, PAGE_SIZE, INTERPRET, DOT_PRECISION)
        page_bad = page_bad | tile_bad
    return m_i, l_i, acc, page_bad


@triton.jit
def _tree_loads(k_head, v_head, bt_row, mask_rows, ctx, n_nodes, row_ok, offs_d, stride_kp, stride_ks, stride_vp,
                stride_vs, num_blocks, take, PAGE_SIZE: tl.constexpr, BLOCK_T: tl.constexpr):
    """The tree part's operands: slots ``ctx + j`` of nodes ``j < n_nodes`` (none unless ``take``), ``k, v
    [BLOCK_T, D]``, which rows see which slot (``visible [BLOCK_M, BLOCK_T]``, from the rows' packed mask words
    ``mask_rows``) and the page flag of ``_context_tile``."""
    offs_j = tl.arange(0, BLOCK_T)
    j_ok = (offs_j < n_nodes) & take
    tok = ctx + offs_j
    page, page_bad = _checked_pages(tl.load(bt_row + tok // PAGE_SIZE, mask=j_ok, other=0), num_blocks)
    in_page = (tok % PAGE_SIZE).to(tl.int64)
    k = tl.load(k_head + (page * stride_kp + in_page * stride_ks)[:, None] + offs_d[None, :], mask=j_ok[:, None], other=0.0)
    v = tl.load(v_head + (page * stride_vp + in_page * stride_vs)[:, None] + offs_d[None, :], mask=j_ok[:, None], other=0.0)
    words = tl.load(mask_rows[:, None] + (offs_j // 32)[None, :], mask=row_ok[:, None] & j_ok[None, :], other=0)
    visible = ((words >> (offs_j % 32)[None, :]) & 1) != 0
    return k, v, visible, tl.max(page_bad, 0)


@triton.jit
def _tree_attend(q, q_lo, k, v, visible, m_i, l_i, acc, qk_scale, INTERPRET: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):
    """The tree part's online-softmax step over the operands of ``_tree_loads``.

    Rows see different slots of this one tile, so P V would multiply a slot's V by the zero P of rows that do not see
    it, and 0 * NaN = NaN. So a slot whose V holds a NaN/inf takes part with V zeroed and a NaN score instead: the rows
    that see it come out NaN (as in plain attention), the others never meet it."""
    # [BLOCK_T]: NaN where the slot's V has a NaN or an inf (|x| < inf is False for both), else 0.
    v_probe = tl.sum(tl.where(tl.abs(v.to(tl.float32)) < float("inf"), 0.0, float("nan")), 1)
    v = tl.where((v_probe == 0.0)[:, None], v, tl.zeros_like(v))
    return _attend_tile(q, q_lo, k, v, visible, v_probe[None, :], m_i, l_i, acc, qk_scale, INTERPRET, DOT_PRECISION)


@triton.jit
def _request_extent(ContextLens_ptr, NumNodes_ptr, b, split_len, num_splits):
    """Request ``b``'s context length, node count and context splits. The splits are clamped to the launched ones so a
    context past the plan's bound stays in bounds (the plan validates that bound; this only keeps an unvalidated
    misuse from reading or writing out of range)."""
    ctx = tl.load(ContextLens_ptr + b)
    n_nodes = tl.load(NumNodes_ptr + b)
    return ctx, n_nodes, tl.minimum(tl.maximum(tl.cdiv(ctx, split_len), 1), num_splits)


@triton.jit
def _load_query_rows(Q_ptr, b64, h, chunk, stride_qb, stride_qt, stride_qh, T: tl.constexpr, G: tl.constexpr,
                     HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, INTERPRET: tl.constexpr):
    """The program's query rows ``offs_m`` (row ``t * G + g``: node t, query head ``h * G + g``), which of them exist
    (``row_ok``), their node ``t`` and query head ``qh``, the head-dim offsets and the rows ``q [BLOCK_M, D]``."""
    offs_m = chunk * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < T * G
    t = offs_m // G
    qh = h * G + offs_m % G
    offs_d = tl.arange(0, HEAD_DIM)
    q_ptrs = Q_ptr + b64 * stride_qb + (t * stride_qt + qh * stride_qh).to(tl.int64)[:, None] + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
    if INTERPRET:
        q = q.to(tl.float32)
    return offs_m, row_ok, t, qh, offs_d, q


@triton.jit
def _attend_split(q, q_lo, K_ptr, V_ptr, BlockTable_ptr, TreeMask_ptr, b64, h, t, row_ok, offs_d, split, ctx, n_nodes,
                  n_splits_b, qk_scale, split_len, num_blocks, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs,
                  stride_vh, stride_bt, T: tl.constexpr, W: tl.constexpr, HEAD_DIM: tl.constexpr,
                  PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr,
                  INTERPRET: tl.constexpr, PIPELINE: tl.constexpr, LAZY_RESCALE: tl.constexpr,
                  DOT_PRECISION: tl.constexpr, HOIST_TREE: tl.constexpr):
    """The online-softmax state ``(m, l, acc)`` of the rows over this split's context tokens, plus the tree tokens
    when this is the request's last non-empty split, and the page flag (see ``_checked_pages``)."""
    # Finite start so a fully masked row (a padding node) yields p = 0, not exp2(-inf + inf) = NaN.
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    bt_row = BlockTable_ptr + b64 * stride_bt
    k_head = K_ptr + h * stride_kh
    v_head = V_ptr + h * stride_vh
    offs_n = tl.arange(0, BLOCK_N)

    # The tree part rides in the request's last non-empty split (slots ctx + j, ancestor mask). Its loads depend only
    # on ctx: with HOIST_TREE they are issued before the context loop, so their round trips overlap its first tiles'.
    is_last = split == n_splits_b - 1
    mask_rows = TreeMask_ptr + (b64 * T + t) * W
    if HOIST_TREE:
        tree_k, tree_v, visible, tree_bad = _tree_loads(k_head, v_head, bt_row, mask_rows, ctx, n_nodes, row_ok,
                                                        offs_d, stride_kp, stride_ks, stride_vp, stride_vs,
                                                        num_blocks, is_last, PAGE_SIZE, BLOCK_T)

    # Context part of this split: no mask besides the split's end.
    start = split * split_len
    end = tl.minimum(start + split_len, ctx)
    if PIPELINE == 0:
        m_i, l_i, acc, page_bad = _context_every_tile_masked(q, q_lo, k_head, v_head, bt_row, start, end, offs_n,
                                                             offs_d, stride_kp, stride_ks, stride_vp, stride_vs,
                                                             num_blocks, m_i, l_i, acc, qk_scale, PAGE_SIZE, BLOCK_N,
                                                             INTERPRET, DOT_PRECISION)
    else:
        m_i, l_i, acc, page_bad = _context_pipelined(q, q_lo, k_head, v_head, bt_row, start, end, offs_n, offs_d,
                                                     stride_kp, stride_ks, stride_vp, stride_vs, num_blocks, m_i, l_i,
                                                     acc, qk_scale, PAGE_SIZE, BLOCK_N, INTERPRET, LAZY_RESCALE,
                                                     DOT_PRECISION)

    if is_last:
        if not HOIST_TREE:
            tree_k, tree_v, visible, tree_bad = _tree_loads(k_head, v_head, bt_row, mask_rows, ctx, n_nodes, row_ok,
                                                            offs_d, stride_kp, stride_ks, stride_vp, stride_vs,
                                                            num_blocks, is_last, PAGE_SIZE, BLOCK_T)
        m_i, l_i, acc = _tree_attend(q, q_lo, tree_k, tree_v, visible, m_i, l_i, acc, qk_scale, INTERPRET,
                                     DOT_PRECISION)
        page_bad = page_bad | tree_bad
    return m_i, l_i, acc, page_bad


@triton.jit
def _store_split_rows(o, lse, Out_ptr, PartialOut_ptr, PartialLse_ptr, b64, h, t, qh, offs_m, offs_d, row_ok, split,
                      n_nodes, n_splits_b, num_splits, stride_ob, stride_ot, stride_oh, NUM_KV_HEADS: tl.constexpr,
                      T: tl.constexpr, G: tl.constexpr, HEAD_DIM: tl.constexpr, INTERPRET: tl.constexpr,
                      DROP_BITS: tl.constexpr):
    """Write a split's rows: straight to ``out`` when the request has one split, else its partial rows and LSEs
    into slot ``split`` of the scratch for the merge kernel."""
    if n_splits_b == 1:
        # The whole request was this program (split 0): write the final rows, zeros for padding nodes.
        if split == 0:
            _store_rows(o, Out_ptr, b64, t, qh, offs_d, row_ok, n_nodes, stride_ob, stride_ot, stride_oh, INTERPRET,
                        DROP_BITS)
    else:
        if split < n_splits_b:
            row = ((b64 * NUM_KV_HEADS + h) * (num_splits + 1) + split) * (T * G) + offs_m
            tl.store(PartialLse_ptr + row, lse, mask=row_ok)
            tl.store(PartialOut_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], o, mask=row_ok[:, None])


@triton.jit
def _tree_attn_partial_kernel(
    Q_ptr, K_ptr, V_ptr, Out_ptr, PartialOut_ptr, PartialLse_ptr, Counters_ptr,
    BlockTable_ptr, ContextLens_ptr, NumNodes_ptr, TreeMask_ptr,
    qk_scale, v_scale, split_len, num_splits, num_blocks,
    stride_qb, stride_qt, stride_qh,
    stride_kp, stride_ks, stride_kh,
    stride_vp, stride_vs, stride_vh,
    stride_ob, stride_ot, stride_oh,
    stride_bt,
    NUM_KV_HEADS: tl.constexpr,
    T: tl.constexpr,
    G: tl.constexpr,
    W: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_T: tl.constexpr,
    NUM_M_CHUNKS: tl.constexpr,
    INTERPRET: tl.constexpr,
    DROP_BITS: tl.constexpr,
    NUM_COUNTERS: tl.constexpr,
    FUSED_MERGE: tl.constexpr,
    MERGE_UNROLL: tl.constexpr,
    MERGE_STAGES: tl.constexpr,
    PIPELINE: tl.constexpr = 1,
    LAZY_RESCALE: tl.constexpr = 0.0,
    DOT_PRECISION: tl.constexpr = "tf32",
    FP8_KEY_PRODUCTS: tl.constexpr = 0,
    HOIST_TREE: tl.constexpr = 0,
):
    pid0 = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    b64 = b.to(tl.int64)

    ctx, n_nodes, n_splits_b = _request_extent(ContextLens_ptr, NumNodes_ptr, b, split_len, num_splits)
    # Row chunks of one split are adjacent in launch order so their K/V re-reads hit L2.
    split = pid0 // NUM_M_CHUNKS
    chunk = pid0 % NUM_M_CHUNKS

    offs_m, row_ok, t, qh, offs_d, q = _load_query_rows(Q_ptr, b64, h, chunk, stride_qb, stride_qt, stride_qh, T, G,
                                                        HEAD_DIM, BLOCK_M, INTERPRET)
    if FP8_KEY_PRODUCTS:  # e4m3 caches, bf16 rows (uses_fp8_key_products): q_lo is the rows' remainder
        q, q_lo, qk_scale = _query_as_fp8_pair(q, qk_scale, INTERPRET)
    else:
        q_lo = None
        if not INTERPRET:
            if K_ptr.dtype.element_ty.is_fp8():
                if q.dtype == tl.bfloat16 and T * G <= FP16_KEYS_MAX_ROWS:
                    q, qk_scale = _query_for_fp16_keys(q, qk_scale)
    m_i, l_i, acc, page_bad = _attend_split(q, q_lo, K_ptr, V_ptr, BlockTable_ptr, TreeMask_ptr, b64, h, t, row_ok,
                                            offs_d, split, ctx, n_nodes, n_splits_b, qk_scale, split_len, num_blocks,
                                            stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_bt,
                                            T, W, HEAD_DIM, PAGE_SIZE, BLOCK_M, BLOCK_N, BLOCK_T, INTERPRET, PIPELINE,
                                            LAZY_RESCALE, DOT_PRECISION, HOIST_TREE)
    o, lse = _split_result(acc * v_scale, m_i, l_i, page_bad != 0)
    _store_split_rows(o, lse, Out_ptr, PartialOut_ptr, PartialLse_ptr, b64, h, t, qh, offs_m, offs_d, row_ok, split,
                      n_nodes, n_splits_b, num_splits, stride_ob, stride_ot, stride_oh, NUM_KV_HEADS, T, G, HEAD_DIM,
                      INTERPRET, DROP_BITS)
    if FUSED_MERGE:
        _merge_if_last(Out_ptr, PartialOut_ptr, PartialLse_ptr, Counters_ptr, b64, h, chunk, t, qh, offs_m, offs_d,
                       row_ok, split, n_nodes, n_splits_b, num_splits, stride_ob, stride_ot, stride_oh, NUM_KV_HEADS, T,
                       G, HEAD_DIM, BLOCK_M, NUM_COUNTERS, MERGE_UNROLL, MERGE_STAGES, INTERPRET, DROP_BITS)


@triton.jit
def _merge_if_last(Out_ptr, PartialOut_ptr, PartialLse_ptr, Counters_ptr, b64, h, chunk, t, qh, offs_m, offs_d, row_ok,
                   split, n_nodes, n_splits_b, num_splits, stride_ob, stride_ot, stride_oh, NUM_KV_HEADS: tl.constexpr,
                   T: tl.constexpr, G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                   NUM_COUNTERS: tl.constexpr, MERGE_UNROLL: tl.constexpr, MERGE_STAGES: tl.constexpr,
                   INTERPRET: tl.constexpr, DROP_BITS: tl.constexpr):
    """The merge inside the partial kernel (no second launch): each split of a multi-split request counts its arrival
    at its row chunk's counter once its partial rows are stored; the last to arrive merges them into ``out`` and
    resets the counter to 0 for the next launch (a captured graph replays it)."""
    if n_splits_b > 1:
        if split < n_splits_b:
            tl.debug_barrier()  # every thread's partial stores happen before the release below publishes them
            counter = Counters_ptr + (b64 * NUM_KV_HEADS + h) * NUM_COUNTERS + chunk
            arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if arrived == n_splits_b - 1:
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
                base = (b64 * NUM_KV_HEADS + h) * (num_splits + 1) * (T * G) + offs_m
                o = _merge_rows(PartialOut_ptr, PartialLse_ptr, base, row_ok, offs_d, n_splits_b, T * G, HEAD_DIM,
                                BLOCK_M, MERGE_UNROLL, MERGE_STAGES, INTERPRET)
                _store_rows(o, Out_ptr, b64, t, qh, offs_d, row_ok, n_nodes, stride_ob, stride_ot, stride_oh,
                            INTERPRET, DROP_BITS)


@triton.jit
def _split_result(acc, m_i, l_i, page_bad):
    """A split's normalized rows and natural-log LSE. ``l == 0`` only for a row that saw no key (a padding node of a
    request without context): LSE -inf, output 0. A NaN score makes ``l`` NaN, hence both; ``page_bad`` makes every
    row NaN. Both stay NaN so the merge sees them: an LSE of -inf there would read as an empty split and drop them."""
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    o = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)
    return tl.where(page_bad, float("nan"), o), tl.where(page_bad, float("nan"), lse)


@triton.jit
def _merge_load(PartialOut_ptr, PartialLse_ptr, base, row_ok, offs_d, split, n_splits_b, ROWS: tl.constexpr,
                HEAD_DIM: tl.constexpr):
    """Split ``split``'s LSEs ``[R]`` and partial rows ``[R, D]`` (-inf and zeros past ``n_splits_b``; ``split`` may
    be a vector ``[R]`` of splits of one row, ``base`` then a scalar). Both loads
    depend on ``split`` only, so they are in flight together (and ahead, in a pipelined loop): an empty split's rows,
    undefined scratch, are read too and dropped by ``_merge_fold``."""
    rows = base + split * ROWS
    ok = row_ok & (split < n_splits_b)
    lse = tl.load(PartialLse_ptr + rows, mask=ok, other=float("-inf"), cache_modifier=".cg")
    part = tl.load(PartialOut_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :], mask=ok[:, None], other=0.0,
                   cache_modifier=".cg")
    return lse, part


@triton.jit
def _merge_fold(lse, part, m, acc, den, nan_rows):
    """Fold one split into the running ``(m, acc, den)``, rescaling as the max grows. An empty split (LSE -inf) drops
    out whatever its rows hold; every other one counts even when its weight underflows to 0, so a NaN in it reaches
    the row as in one softmax (0 * NaN = NaN). A NaN LSE (the split met a NaN) flags the row."""
    nan_rows = nan_rows | (lse != lse).to(tl.int32)
    lse = tl.where(lse == lse, lse, float("-inf"))
    live = lse > float("-inf")
    m_new = tl.maximum(m, lse)
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # no split seen yet: any finite reference
    alpha = tl.exp(m - m_ref)
    w = tl.where(live, tl.exp(lse - m_ref), 0.0)
    acc = acc * alpha[:, None] + w[:, None] * tl.where(live[:, None], part, 0.0)
    return m_new, acc, den * alpha + w, nan_rows


@triton.jit
def _merge_rows(PartialOut_ptr, PartialLse_ptr, base, row_ok, offs_d, n_splits_b, ROWS: tl.constexpr,
                HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, UNROLL: tl.constexpr, STAGES: tl.constexpr,
                INTERPRET: tl.constexpr):
    """``out = sum_s e^{lse_s - m} o_s / sum_s e^{lse_s - m}`` (``m = max_s lse_s``) of the rows ``base`` (split 0's
    scratch rows; split s is ``ROWS`` further per split), NaN where a split met a NaN. One pass with the running max
    rescaled as it grows, ``UNROLL`` splits per trip (their loads in flight together), the loop pipelined over
    ``STAGES``: the merge is a chain of loads, one round trip per trip at most."""
    tl.static_assert(UNROLL == 1 or UNROLL == 2, "the merge loop takes one or two splits per trip")
    m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, HEAD_DIM], dtype=tl.float32)
    den = tl.zeros([BLOCK_R], dtype=tl.float32)
    nan_rows = tl.zeros([BLOCK_R], dtype=tl.int32)
    if INTERPRET:  # see the partial kernel: no tensor bounds in range() under the interpreter
        s = 0
        while s < n_splits_b:
            lse, part = _merge_load(PartialOut_ptr, PartialLse_ptr, base, row_ok, offs_d, s, n_splits_b, ROWS, HEAD_DIM)
            m, acc, den, nan_rows = _merge_fold(lse, part, m, acc, den, nan_rows)
            s += 1
    else:
        for s in tl.range(0, n_splits_b, UNROLL, num_stages=STAGES):
            lse, part = _merge_load(PartialOut_ptr, PartialLse_ptr, base, row_ok, offs_d, s, n_splits_b, ROWS, HEAD_DIM)
            if UNROLL == 2:
                lse1, part1 = _merge_load(PartialOut_ptr, PartialLse_ptr, base, row_ok, offs_d, s + 1, n_splits_b,
                                          ROWS, HEAD_DIM)
            m, acc, den, nan_rows = _merge_fold(lse, part, m, acc, den, nan_rows)
            if UNROLL == 2:
                m, acc, den, nan_rows = _merge_fold(lse1, part1, m, acc, den, nan_rows)
    o = acc / tl.where(den > 0.0, den, 1.0)[:, None]
    return tl.where((nan_rows != 0)[:, None], float("nan"), o)


@triton.jit
def _tree_attn_merge_kernel(
    Out_ptr, PartialOut_ptr, PartialLse_ptr, ContextLens_ptr, NumNodes_ptr,
    split_len, num_splits,
    stride_ob, stride_ot, stride_oh,
    NUM_KV_HEADS: tl.constexpr,
    T: tl.constexpr,
    G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    MERGE_UNROLL: tl.constexpr,
    MERGE_STAGES: tl.constexpr,
    INTERPRET: tl.constexpr,
    DROP_BITS: tl.constexpr,
):
    rb = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    b64 = b.to(tl.int64)
    ctx, n_nodes, n_splits_b = _request_extent(ContextLens_ptr, NumNodes_ptr, b, split_len, num_splits)
    # Single-split requests were written by the partial kernel.
    if n_splits_b > 1:
        offs_r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = offs_r < T * G
        offs_d = tl.arange(0, HEAD_DIM)
        base = (b64 * NUM_KV_HEADS + h) * (num_splits + 1) * (T * G) + offs_r
        o = _merge_rows(PartialOut_ptr, PartialLse_ptr, base, row_ok, offs_d, n_splits_b, T * G, HEAD_DIM, BLOCK_R,
                        MERGE_UNROLL, MERGE_STAGES, INTERPRET)
        _store_rows(o, Out_ptr, b64, offs_r // G, h * G + offs_r % G, offs_d, row_ok, n_nodes, stride_ob, stride_ot,
                    stride_oh, INTERPRET, DROP_BITS)


@triton.jit
def _wide_merge_fold(PartialOut_ptr, PartialLse_ptr, row, offs_s, offs_d, n_splits_b, ROWS: tl.constexpr,
                     HEAD_DIM: tl.constexpr, m, acc, den, nan_row):
    """Fold the splits ``offs_s`` (``[S]``, those past ``n_splits_b`` dropped) of scratch row ``row`` (split 0's) into
    the running ``(m, acc [D], den)``: ``_merge_fold``'s rule, the splits taken side by side (their loads in flight
    together) and summed across the tile; a NaN LSE flags the row."""
    # Each split of the tile is one scratch row of this program's query row: every "row" of the load exists.
    lse, part = _merge_load(PartialOut_ptr, PartialLse_ptr, row, offs_s >= 0, offs_d, offs_s, n_splits_b, ROWS,
                            HEAD_DIM)
    nan_row = nan_row | tl.max((lse != lse).to(tl.int32), axis=0)
    lse = tl.where(lse == lse, lse, float("-inf"))
    live = lse > float("-inf")
    m_new = tl.maximum(m, tl.max(lse, axis=0))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # no live split yet: any finite reference
    alpha = tl.exp(m - m_ref)
    w = tl.where(live, tl.exp(lse - m_ref), 0.0)
    # A live split counts even when its weight underflows to 0, so a NaN in its rows reaches the output (0 * NaN).
    acc = acc * alpha + tl.sum(w[:, None] * tl.where(live[:, None], part, 0.0), axis=0)
    return m_new, acc, den * alpha + tl.sum(w, axis=0), nan_row


@triton.jit
def _tree_attn_wide_merge_kernel(
    Out_ptr, PartialOut_ptr, PartialLse_ptr, ContextLens_ptr, NumNodes_ptr,
    split_len, num_splits,
    stride_ob, stride_ot, stride_oh,
    NUM_KV_HEADS: tl.constexpr,
    T: tl.constexpr,
    G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SPLIT_BLOCK: tl.constexpr,
    INTERPRET: tl.constexpr,
    DROP_BITS: tl.constexpr,
):
    """The merge of one query row ``r`` (node ``r // G``, query head ``h * G + r % G``) of a KV head of a request:
    ``SPLIT_BLOCK`` splits per trip, read side by side (see ``WIDE_MERGE_MIN_SPLITS``)."""
    r = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    b64 = b.to(tl.int64)
    ctx, n_nodes, n_splits_b = _request_extent(ContextLens_ptr, NumNodes_ptr, b, split_len, num_splits)
    if n_splits_b > 1:  # single-split requests were written by the partial kernel
        row = (b64 * NUM_KV_HEADS + h) * (num_splits + 1) * (T * G) + r
        offs_s = tl.arange(0, SPLIT_BLOCK)
        offs_d = tl.arange(0, HEAD_DIM)
        m = tl.full([], float("-inf"), dtype=tl.float32)
        acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
        den = tl.zeros([], dtype=tl.float32)
        nan_row = tl.zeros([], dtype=tl.int32)
        s0 = 0
        while s0 < n_splits_b:  # one trip where the request has at most SPLIT_BLOCK splits
            m, acc, den, nan_row = _wide_merge_fold(PartialOut_ptr, PartialLse_ptr, row, s0 + offs_s, offs_d,
                                                    n_splits_b, T * G, HEAD_DIM, m, acc, den, nan_row)
            s0 += SPLIT_BLOCK
        o = acc / tl.where(den > 0.0, den, 1.0)
        o = tl.where(nan_row != 0, float("nan"), o)
        t = r // G
        o = tl.where(t < n_nodes, o, 0.0)  # zeros for padding nodes
        o_ptrs = Out_ptr + b64 * stride_ob + (t * stride_ot + (h * G + r % G) * stride_oh).to(tl.int64) + offs_d
        tl.store(o_ptrs, _to_out_dtype(o, Out_ptr.dtype.element_ty, INTERPRET, DROP_BITS))


@triton.jit
def _store_rows(o, Out_ptr, b64, t, qh, offs_d, row_ok, n_nodes, stride_ob, stride_ot, stride_oh,
                INTERPRET: tl.constexpr, DROP_BITS: tl.constexpr):
    """Final rows into ``out`` (node ``t``, query head ``qh``), zeros for padding nodes."""
    o = tl.where((t < n_nodes)[:, None], o, 0.0)
    o_ptrs = Out_ptr + b64 * stride_ob + (t * stride_ot + qh * stride_oh).to(tl.int64)[:, None] + offs_d[None, :]
    tl.store(o_ptrs, _to_out_dtype(o, Out_ptr.dtype.element_ty, INTERPRET, DROP_BITS), mask=row_ok[:, None])


def merges_splits_side_by_side(plan) -> bool:
    """Whether the merge kernel reads the plan's splits side by side (``WIDE_MERGE_MIN_SPLITS``)."""
    return plan.num_splits >= WIDE_MERGE_MIN_SPLITS


def merges_in_partial_kernel(plan, block_m: int, chunks: int) -> bool:
    """Whether the partial kernel merges the splits itself (see ``FUSED_MERGE``): more than one split but fewer than
    ``WIDE_MERGE_MIN_SPLITS``, rows of at most ``FUSED_MERGE_MAX_ROWS`` per program, and arrival counters in the plan
    for every row chunk (int32 ``[B, Hkv, >= chunks]``, contiguous: the kernel indexes them so)."""
    counters = plan.split_counters
    return (plan.num_splits > 1 and not merges_splits_side_by_side(plan) and bool(FUSED_MERGE)
            and block_m <= FUSED_MERGE_MAX_ROWS and counters is not None
            and counters.dtype == torch.int32 and counters.dim() == 3 and counters.is_contiguous()
            and tuple(counters.shape[:2]) == (plan.batch_size, plan.num_kv_heads) and counters.shape[2] >= chunks)


def uses_fp8_key_products(q_dtype: torch.dtype, k_dtype: torch.dtype, head_dim: int, block_m: int) -> bool:
    """Whether the partial kernel multiplies e4m3 keys as stored by the rows split into two e4m3 parts
    (``FP8_KEY_PRODUCT_TILES``; bf16 rows only: a bf16 value is the sum of its two parts, an fp16 one is not)."""
    return (q_dtype == torch.bfloat16 and k_dtype == torch.float8_e4m3fn
            and (head_dim, block_m) in FP8_KEY_PRODUCT_TILES)


def row_tile(head_dim: int, num_rows: int) -> int:
    """BLOCK_M for ``num_rows = T * G``: all rows in one program up to MAX_BLOCK_M, else chunks of 64.

    When the rows need several programs anyway (T = 32 / 64 with G = 7), 64-row chunks win the sweep
    (docs/TREE_ATTENTION.md, "Measurements behind the defaults"): half the registers per program, more
    programs in flight, and the chunks of one split run side by side, so their K/V re-reads come from L2.
    """
    block_m = min(MAX_BLOCK_M[head_dim], max(16, _next_pow2(num_rows)))
    if num_rows > block_m and head_dim <= 128:
        block_m = CHUNK_BLOCK_M
    return block_m


# fp32 inputs (an fp32 model's verify pass): exact fp32 products (``input_precision="ieee"``, no TF32) run on
# the FMA units with both operands in registers, which is register-hungry: ptxas for sm_90 (no GPU needed,
# tests/ops/test_tree_attention_triton_variants.py) spills 1.7 KB at 128 rows x 32 keys (D=64), none at 64 x 16.
# So: 16-key tiles, 8 warps, 2 stages, and row tiles of at most FP32_MAX_BLOCK_M[D] (more rows: chunks).
FP32_CONFIG = (16, 8, 2)  # (BLOCK_N, num_warps, num_stages)
FP32_MAX_BLOCK_M = {64: 64, 128: 32, 256: 16}


# Over e4m3 caches, row tiles of at most 32 rows (mma.sync products, K and V widened in registers) take 128-key tiles
# where a split holds at least FP8_WIDE_TILE_MIN_SPLIT tokens: measured faster than 64-key tiles with splits of 1k-16k
# tokens, no faster at 512 and slower at 256 (H200, docs/TREE_ATTENTION.md).
FP8_WIDE_TILE_CONFIGS = {(128, 16): (128, 4, 3), (128, 32): (128, 4, 3)}
FP8_WIDE_TILE_MIN_SPLIT = 1024


def kernel_config(head_dim: int, num_rows: int, fp32: bool = False, e4m3_split_len: Optional[int] = None):
    """``(BLOCK_M, num_row_chunks, BLOCK_N, num_warps, num_stages, maxnreg)`` for ``num_rows = T * G``;
    ``e4m3_split_len``: the plan's split length over e4m3 caches (``FP8_WIDE_TILE_CONFIGS``), else None."""
    block_m = row_tile(head_dim, num_rows)
    if fp32 and CONFIG_OVERRIDE is None:
        block_m = min(block_m, FP32_MAX_BLOCK_M[head_dim])
        return (block_m, -(-num_rows // block_m), *FP32_CONFIG, None)
    wide = FP8_WIDE_TILE_CONFIGS.get((head_dim, block_m))
    if CONFIG_OVERRIDE is None and wide and e4m3_split_len is not None and e4m3_split_len >= FP8_WIDE_TILE_MIN_SPLIT:
        return (block_m, -(-num_rows // block_m), *wide, None)
    if CONFIG_OVERRIDE is not None:
        block_n, warps, stages = CONFIG_OVERRIDE[:3]
        if len(CONFIG_OVERRIDE) > 3 and CONFIG_OVERRIDE[3] is not None:
            block_m = min(block_m, CONFIG_OVERRIDE[3])
        maxnreg = CONFIG_OVERRIDE[4] if len(CONFIG_OVERRIDE) > 4 else None
    else:
        block_n, warps, stages, *rest = PARTIAL_CONFIGS[(head_dim, block_m)]
        maxnreg = rest[0] if rest else None
    return block_m, -(-num_rows // block_m), block_n, warps, stages, maxnreg


def run_triton(plan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
               sm_scale: float, v_scale: float = 1.0) -> torch.Tensor:
    """Run a :class:`~tlt_kernels.ops.tree_attention.TreeAttentionPlan` with Triton; writes and returns ``out``.

    ``q``/``out`` ``[B, T, Hq, D]``, caches ``[num_blocks, block_size, Hkv, D]`` (q's bf16/fp16/fp32 dtype, or fp8
    with bf16/fp16 q, widened exactly as loaded, except e4m3 keys at ``FP8_KEY_PRODUCT_TILES``, multiplied as stored by
    the rows' two e4m3 parts; stride 1 along D; fp32 multiplies in exact fp32, see ``FP32_CONFIG``); ``v_scale``
    multiplies each row's output (V's dequantization scale). Launches the partial kernel and, when the plan has more
    than one split, the merge kernel, on the current stream; no host synchronization.
    """
    B, T, Hq, D = q.shape
    Hkv, G = plan.num_kv_heads, plan.group
    if B == 0:
        return out
    M = T * G
    interp = triton_interpret_enabled()
    fp32 = q.dtype == torch.float32
    e4m3_split_len = plan.split_len if k_cache.dtype == torch.float8_e4m3fn else None
    block_m, chunks, block_n, warps, stages, maxnreg = kernel_config(D, M, fp32, e4m3_split_len)
    # maxnreg is a compile option of the GPU backend only; the interpreter has no registers to cap.
    reg_cap = {} if (maxnreg is None or interp) else {"maxnreg": maxnreg}
    block_t = max(16, _next_pow2(T))
    drop_bits = {torch.bfloat16: 16, torch.float16: 13, torch.float32: 0}[out.dtype]
    counters = plan.split_counters
    fused = merges_in_partial_kernel(plan, block_m, chunks)
    _tree_attn_partial_kernel[(plan.num_splits * chunks, Hkv, B)](
        q, k_cache, v_cache, out, plan.partial_out, plan.partial_lse, counters if fused else plan.partial_lse,
        plan.block_table, plan.context_lens, plan.num_nodes, plan.tree_mask,
        sm_scale * LOG2E, v_scale, plan.split_len, plan.num_splits, min(k_cache.shape[0], v_cache.shape[0]),
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        plan.block_table.stride(0),
        NUM_KV_HEADS=Hkv, T=T, G=G, W=plan.tree_mask.shape[2], HEAD_DIM=D, PAGE_SIZE=plan.block_size,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_T=block_t, NUM_M_CHUNKS=chunks, INTERPRET=interp, DROP_BITS=drop_bits,
        NUM_COUNTERS=counters.shape[-1] if fused else 1, FUSED_MERGE=fused, MERGE_UNROLL=FUSED_MERGE_LOOP[0],
        MERGE_STAGES=FUSED_MERGE_LOOP[1], PIPELINE=PIPELINE, LAZY_RESCALE=LAZY_RESCALE,
        DOT_PRECISION="ieee" if fp32 else "tf32",
        FP8_KEY_PRODUCTS=uses_fp8_key_products(q.dtype, k_cache.dtype, D, block_m),
        HOIST_TREE=int(hoists_tree(block_t, block_m, D, k_cache.dtype)), num_warps=warps, num_stages=stages, **reg_cap,
    )
    if plan.num_splits > 1 and not fused:
        _launch_merge(plan, out, interp, drop_bits)
    return out


def _launch_merge(plan, out: torch.Tensor, interp: bool, drop_bits: int) -> None:
    """The merge kernel over the plan's scratch: one program per query row reading the splits side by side where the
    plan has at least ``WIDE_MERGE_MIN_SPLITS``, else one per MERGE_BLOCK_R rows of a KV head of a request."""
    B, T, _, D = out.shape
    Hkv, G = plan.num_kv_heads, plan.group
    if merges_splits_side_by_side(plan):
        _tree_attn_wide_merge_kernel[(T * G, Hkv, B)](
            out, plan.partial_out, plan.partial_lse, plan.context_lens, plan.num_nodes,
            plan.split_len, plan.num_splits,
            out.stride(0), out.stride(1), out.stride(2),
            NUM_KV_HEADS=Hkv, T=T, G=G, HEAD_DIM=D,
            SPLIT_BLOCK=min(WIDE_MERGE_MAX_SPLITS, _next_pow2(plan.num_splits)), INTERPRET=interp,
            DROP_BITS=drop_bits, num_warps=WIDE_MERGE_WARPS,
        )
        return
    _tree_attn_merge_kernel[(triton.cdiv(T * G, MERGE_BLOCK_R), Hkv, B)](
        out, plan.partial_out, plan.partial_lse, plan.context_lens, plan.num_nodes,
        plan.split_len, plan.num_splits,
        out.stride(0), out.stride(1), out.stride(2),
        NUM_KV_HEADS=Hkv, T=T, G=G, HEAD_DIM=D, BLOCK_R=MERGE_BLOCK_R,
        MERGE_UNROLL=MERGE_KERNEL_LOOP[0], MERGE_STAGES=MERGE_KERNEL_LOOP[1], INTERPRET=interp,
        DROP_BITS=drop_bits, num_warps=MERGE_WARPS,
    )
