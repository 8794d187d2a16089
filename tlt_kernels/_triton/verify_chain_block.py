"""Block verification of draft chains in Triton: one program per request walks its chain once.

The rule, its terms and why it is lossless are in :mod:`tlt_kernels.reference.verify_chain_block`. The program
keeps each row's target distribution implicit as ``(m, s)``: ``p(x) = exp((l_x - m) / T') / s`` with ``m`` the row
max (and its argmax, for greedy requests) and ``s`` the normalizer, computed in tiles of ``BLOCK`` upcast to fp32;
the draft row is normalized by its fp32 sum ``qs``. For prefix ``i`` it reads row ``i - 1`` (already summarized by
the previous step) for the weight ``w_i`` and row ``i`` once more for the residual mass ``R_i``; it stops reading
rows once a weight is 0 (a draft with ``p(X_i) = 0``: a greedy mismatch or a masked token; no later prefix can be
accepted then). The final token's row is summarized again and sampled by inverse CDF in two passes (its total, then
the first tile whose running sum passes ``u * total``). Greedy requests read only the max pass. The coins are
Philox4x32-10, bit-identical to :mod:`tlt_kernels.rng`; nothing synchronizes with the host.

Eager calls launch directly; otherwise the launch runs inside the custom op ``tlt::verify_chain_block`` (fake
implementation for ``torch.compile``; capturable in a CUDA graph).
"""
from __future__ import annotations

from typing import Tuple

import torch
import triton
import triton.language as tl

from .._backend import direct_dispatch_ok
from ..reference.verify_chain_block import BlockVerifyResult, empty_block_outputs
from .philox import _philox_uniform

BLOCK_MAX = 1024  # vocabulary tile of the streaming passes (not yet timed on a GPU)


@triton.jit
def _row_max(row_ptr, V, BLOCK: tl.constexpr, NUM_TILES: tl.constexpr):
    """``(max, argmax)`` of a logits row (the lowest id among ties)."""
    m = -float("inf")
    arg = 0
    for tile in range(NUM_TILES):
        cols = tile * BLOCK + tl.arange(0, BLOCK)
        l = tl.load(row_ptr + cols, mask=cols < V, other=-float("inf")).to(tl.float32)
        tile_max = tl.max(l, 0)
        tile_arg = tl.argmax(l, 0).to(tl.int32) + tile * BLOCK
        arg = tl.where(tile_max > m, tile_arg, arg)
        m = tl.maximum(m, tile_max)
    return m, arg


@triton.jit
def _row_sums(row_ptr, q_ptr, V, m, inv_t, HAS_Q, BLOCK: tl.constexpr, NUM_TILES: tl.constexpr):
    """``(s, qs)``: the target row's normalizer and the draft row's sum (1 without a draft row)."""
    s = 0.0
    qs = 0.0
    for tile in range(NUM_TILES):
        cols = tile * BLOCK + tl.arange(0, BLOCK)
        l = tl.load(row_ptr + cols, mask=cols < V, other=-float("inf")).to(tl.float32)
        s += tl.sum(tl.exp((l - m) * inv_t), 0)
        qs += tl.sum(tl.load(q_ptr + cols, mask=(cols < V) & HAS_Q, other=0.0).to(tl.float32), 0)
    return s, tl.where(HAS_Q, qs, 1.0)


@triton.jit
def _final_tile(row_ptr, q_ptr, cols, V, m, inv_t, s, qs, w, use_residual):
    """One tile of the final token's distribution: ``max(w p - q, 0)`` (the residual) or ``p``."""
    l = tl.load(row_ptr + cols, mask=cols < V, other=-float("inf")).to(tl.float32)
    p = tl.exp((l - m) * inv_t) / s
    q = tl.load(q_ptr + cols, mask=(cols < V) & use_residual, other=0.0).to(tl.float32) / qs
    return tl.where(use_residual, tl.maximum(w * p - q, 0.0), p)


@triton.jit
def _tiles_total(row_ptr, q_ptr, V, m, inv_t, s, qs, w, use_residual, BLOCK: tl.constexpr,
                 NUM_TILES: tl.constexpr):
    """The mass of :func:`_final_tile`'s row (for ``use_residual``: ``R = sum max(w p - q, 0)``)."""
    total = 0.0
    for tile in range(NUM_TILES):
        cols = tile * BLOCK + tl.arange(0, BLOCK)
        total += tl.sum(_final_tile(row_ptr, q_ptr, cols, V, m, inv_t, s, qs, w, use_residual), 0)
    return total


@triton.jit
def _sample_tiles(row_ptr, q_ptr, V, m, inv_t, s, qs, w, use_residual, u, BLOCK: tl.constexpr,
                  NUM_TILES: tl.constexpr):
    """Inverse CDF: the first token whose running sum exceeds ``u * total`` (the last positive one if rounding
    leaves none), as :func:`tlt_kernels.reference.sampling.sample_inverse_cdf`."""
    target = u * _tiles_total(row_ptr, q_ptr, V, m, inv_t, s, qs, w, use_residual, BLOCK, NUM_TILES)
    carry = 0.0
    found = V
    last = 0
    for tile in range(NUM_TILES):
        cols = tile * BLOCK + tl.arange(0, BLOCK)
        r = _final_tile(row_ptr, q_ptr, cols, V, m, inv_t, s, qs, w, use_residual)
        cdf = carry + tl.cumsum(r, 0)
        found = tl.minimum(found, tl.min(tl.where((cdf > target) & (cols < V), cols, V), 0))
        last = tl.maximum(last, tl.max(tl.where(r > 0, cols, 0), 0))
        carry += tl.sum(r, 0)
    return tl.where(found < V, found, last)


@triton.jit
def _next_weight(w, px, qx):
    """``min(1, w p(x) / q(x))``: 0 when ``w p(x) = 0``, 1 when ``w p(x) >= q(x)`` (q(x) = 0 included)."""
    num = w * px
    ratio = num / tl.where(qx > 0, qx, 1.0)
    return tl.where(num <= 0, 0.0, tl.where(num >= qx, 1.0, ratio))


@triton.jit
def _stop_probability(w, mass):
    """``h = R / (R + 1 - w)``, 1 where the denominator is 0."""
    den = mass + (1.0 - w)
    return tl.where(den > 0, mass / tl.where(den > 0, den, 1.0), 1.0)


@triton.jit
def _verify_chain_block_kernel(L, Q, X, N, Temp, Seed, Offset, Tokens, NumAcc, stride_lb, stride_lr, stride_qb,
                               stride_qr, V, GAMMA: tl.constexpr, BLOCK: tl.constexpr, OUT_BLOCK: tl.constexpr,
                               NUM_TILES: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    n = tl.minimum(tl.maximum(tl.load(N + b).to(tl.int32), 0), GAMMA)
    temp = tl.load(Temp + b)
    sampled = temp > 0
    inv_t = 1.0 / tl.minimum(tl.maximum(temp, 1.1754943508222875e-38), 8.507059173023462e37)
    seed = tl.load(Seed + b)
    offset = tl.load(Offset + b)
    l_base = L + b * stride_lb
    q_base = Q + b * stride_qb
    # Row 0's summary; step i turns row i-1's summary into w_i and summarizes row i for R_i and step i+1.
    m, arg = _row_max(l_base, V, BLOCK, NUM_TILES)
    s = 1.0
    qs = 1.0
    if sampled:
        s, qs = _row_sums(l_base, q_base, V, m, inv_t, n > 0, BLOCK, NUM_TILES)
    w = 1.0
    tau = 0
    w_tau = 1.0
    for i in tl.static_range(1, GAMMA + 1):  # a static bound: the interpreter takes no tensor bounds in range()
        if i <= n:
            x = tl.load(X + b * GAMMA + i - 1)
            in_vocab = (x >= 0) & (x < V)
            xc = tl.minimum(tl.maximum(x, 0), V - 1)
            lx = tl.load(l_base + (i - 1) * stride_lr + xc).to(tl.float32)
            px = tl.where(sampled, tl.exp((lx - m) * inv_t) / s, tl.where(xc == arg, 1.0, 0.0))
            qx = tl.where(sampled, tl.load(q_base + (i - 1) * stride_qr + xc).to(tl.float32) / qs, px)
            # Once w is 0 it stays 0 and every later h is 0: the rows after it are not read (the summary is stale).
            w = tl.where(w > 0, _next_weight(w, tl.where(in_vocab, px, 0.0), qx), 0.0)
            mass = 0.0
            if (i < n) & (w > 0):
                row = l_base + i * stride_lr
                m, arg = _row_max(row, V, BLOCK, NUM_TILES)
                if sampled:
                    s, qs = _row_sums(row, q_base + i * stride_qr, V, m, inv_t, True, BLOCK, NUM_TILES)
                    mass = _tiles_total(row, q_base + i * stride_qr, V, m, inv_t, s, qs, w, True, BLOCK, NUM_TILES)
            h = tl.where(i == n, w, _stop_probability(w, mass))
            stop = _philox_uniform(seed, offset, tau * 0 + i, 0) < h  # node i (tensor-typed)
            tau = tl.where(stop, i, tau)
            w_tau = tl.where(stop, w, w_tau)
    # The final token from row tau: the argmax (greedy), else the residual r_tau (p where it has no mass) or the
    # bonus row p_{n+1} when every draft was kept.
    row = l_base + tau * stride_lr
    q_row = q_base + tau * stride_qr
    m, y = _row_max(row, V, BLOCK, NUM_TILES)
    if sampled:
        use_residual = tau < n
        s, qs = _row_sums(row, q_row, V, m, inv_t, use_residual, BLOCK, NUM_TILES)
        mass = _tiles_total(row, q_row, V, m, inv_t, s, qs, w_tau, use_residual, BLOCK, NUM_TILES)
        use_residual = use_residual & (mass > 0)
        u = _philox_uniform(seed, offset, tau, 1)
        y = _sample_tiles(row, q_row, V, m, inv_t, s, qs, w_tau, use_residual, u, BLOCK, NUM_TILES)
    cols = tl.arange(0, OUT_BLOCK)
    drafts = tl.load(X + b * GAMMA + cols, mask=cols < tau, other=-1)
    out = tl.where(cols == tau, y.to(tl.int64), drafts)
    tl.store(Tokens + b * (GAMMA + 1) + cols, out, mask=cols <= GAMMA)
    tl.store(NumAcc + b, tau)


def launch(logits, draft_tokens, draft_probs, num_drafts, temperature, seed, offset) -> Tuple[torch.Tensor, ...]:
    """``(tokens int64 [B, gamma+1], num_accepted int32 [B])``; ``logits`` / ``draft_probs`` with a unit vocabulary
    stride, the other inputs dense (:func:`tlt_kernels.ops.verify_chain_block` arranges both)."""
    tokens, num_accepted = empty_block_outputs(logits)
    B, width, V = logits.shape
    if B == 0:
        return tokens, num_accepted
    block = min(triton.next_power_of_2(V), BLOCK_MAX)
    probs = draft_probs if draft_probs.numel() else logits  # a valid pointer for gamma = 0 (never read)
    _verify_chain_block_kernel[(B,)](
        logits, probs, draft_tokens, num_drafts, temperature, seed, offset, tokens, num_accepted,
        logits.stride(0), logits.stride(1), probs.stride(0), probs.stride(1) if probs.dim() == 3 else 0,
        V, GAMMA=width - 1, BLOCK=block, NUM_TILES=triton.cdiv(V, block), OUT_BLOCK=triton.next_power_of_2(width),
        num_warps=4,
    )
    return tokens, num_accepted


@torch.library.custom_op("tlt::verify_chain_block", mutates_args=())
def _verify_chain_block_op(logits: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor,
                           num_drafts: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor,
                           offset: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    return launch(logits, draft_tokens, draft_probs, num_drafts, temperature, seed, offset)


@_verify_chain_block_op.register_fake
def _(logits, draft_tokens, draft_probs, num_drafts, temperature, seed, offset):
    return empty_block_outputs(logits)


def verify_chain_block_triton(logits, draft_tokens, draft_probs, num_drafts, temperature, seed,
                              offset) -> BlockVerifyResult:
    """Backend of :func:`tlt_kernels.ops.verify_chain_block.verify_chain_block` over already-checked inputs:
    ``draft_tokens int64 [B, gamma]``, ``num_drafts int32 [B]``, ``temperature float32 [B]``, ``seed`` /
    ``offset int64 [B]``, all dense."""
    args = (logits, draft_tokens, draft_probs, num_drafts, temperature, seed, offset)
    run = launch if direct_dispatch_ok(*args) else torch.ops.tlt.verify_chain_block
    return BlockVerifyResult(*run(*args))
