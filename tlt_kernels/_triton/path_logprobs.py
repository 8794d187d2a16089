"""Triton log-probs of a verify walk's emitted tokens: one pass over each accepted-path row.

Grid ``(B, W)``: program ``(b, j)`` scores token ``j`` of request ``b`` when ``j <= num_accepted[b]`` and the request
is not flagged, else writes 0. It reads row ``accepted_nodes[b, j]`` of ``logits`` once, in column tiles, keeping an
online maximum ``M`` and the sums ``sum exp(l - M)`` and ``sum exp((l - M) / T')`` (rescaled when ``M`` grows), so one
pass gives both the raw log-softmax and the sampling one (temperature ``T' = clamp(T, 2**-126, 2**126)``, the
contract's scale: the max is subtracted before dividing). Greedy requests (``T`` not > 0) score 0 under their point
mass. Top-k and top-p (per request; off when ``k`` is not in ``[1, V)`` / ``top_p`` not < 1) find their thresholds
by bisection on the logits' order-preserving integer keys (signed zeros canonicalized), one pass per bit, only on
rows that use them: the k-th largest logit (ties kept), then the largest logit whose kept mass reaches ``top_p``
(:mod:`tlt_kernels.reference.sampling`'s contract, in float32: a tie at the boundary may differ from the float64
reference). bf16 / fp16 logits are upcast to fp32 (the CPU interpreter computes bf16 arithmetic as zeros).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

MAX_BLOCK = 4096  # columns per tile


@triton.jit
def _keys(l):
    """Order-preserving int32 keys of fp32 values (``-0.0`` as ``+0.0``); -inf maps below every finite value."""
    bits = (l + 0.0).to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _count_or_mass_at_least(row, V, x, run_max, inv_t, floor, use_mass: tl.constexpr, BLOCK: tl.constexpr):
    """Over the row's logits with key >= ``floor`` (the top-k cut): the count (or the weight ``exp((l - M) / T')``
    sum when ``use_mass``) of those with key >= ``x``."""
    cols = tl.arange(0, BLOCK)
    total = 0.0
    start = 0
    while start < V:
        l = tl.load(row + start + cols, mask=start + cols < V, other=float("-inf")).to(tl.float32)
        key = _keys(l)
        hit = (key >= x) & (key >= floor) & (start + cols < V)
        if use_mass:
            total += tl.sum(tl.where(hit, tl.exp((l - run_max) * inv_t), 0.0), axis=0)
        else:
            total += tl.sum(hit.to(tl.float32), axis=0)
        start += BLOCK
    return total


@triton.jit
def _largest_key_reaching(row, V, target, run_max, inv_t, floor, use_mass: tl.constexpr, BLOCK: tl.constexpr):
    """The largest key ``x`` whose count (or mass) of keys ``>= x`` reaches ``target``: a bisection over the int32
    key range, one pass over the row per step (33 steps)."""
    lo = tl.full([], -2147483648, tl.int64)
    hi = tl.full([], 2147483647, tl.int64)
    while lo < hi:
        mid = lo + (hi - lo + 1) // 2
        reached = _count_or_mass_at_least(row, V, mid.to(tl.int32), run_max, inv_t, floor, use_mass, BLOCK) >= target
        lo = tl.where(reached, mid, lo)
        hi = tl.where(reached, hi, mid - 1)
    return lo.to(tl.int32)


@triton.jit
def _row_sums(row, V, run_max_in, inv_t, floor, BLOCK: tl.constexpr):
    """One pass: ``(M, sum exp(l - M), sum over keys >= floor of exp((l - M) / T'))``; with ``run_max_in`` > -inf
    the max is taken as given."""
    cols = tl.arange(0, BLOCK)
    run_max = run_max_in
    sum_raw = 0.0
    sum_t = 0.0
    start = 0
    while start < V:  # a while loop: the CPU interpreter cannot range() over a runtime bound
        l = tl.load(row + start + cols, mask=start + cols < V, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(run_max, tl.max(l, axis=0))
        shift = tl.where(new_max == float("-inf"), 0.0, run_max - new_max)  # rescale the sums to the new max
        # -inf logits weigh 0, also while every logit so far is -inf (no -inf - -inf).
        diff = tl.where(l == float("-inf"), float("-inf"), l - new_max)
        kept = _keys(l) >= floor
        sum_raw = sum_raw * tl.exp(shift) + tl.sum(tl.exp(diff), axis=0)
        sum_t = sum_t * tl.exp(shift * inv_t) + tl.sum(tl.where(kept, tl.exp(diff * inv_t), 0.0), axis=0)
        run_max = new_max
        start += BLOCK
    return run_max, sum_raw, sum_t


@triton.jit
def _path_logprobs_kernel(Logits_ptr, Tokens_ptr, Nodes_ptr, NumAccepted_ptr, Error_ptr, Temp_ptr, TopK_ptr,
                          TopP_ptr, Sampled_ptr, Raw_ptr, stride_lb, stride_lt, stride_tok, stride_node, stride_out,
                          V, HAS_TEMP: tl.constexpr, HAS_TOPK: tl.constexpr, HAS_TOPP: tl.constexpr,
                          BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    scored = (j <= tl.load(NumAccepted_ptr + b)) & (tl.load(Error_ptr + b) == 0)
    if scored:
        node = tl.load(Nodes_ptr + b * stride_node + j).to(tl.int64)
        token = tl.load(Tokens_ptr + b * stride_tok + j).to(tl.int64)
        if HAS_TEMP:
            temp = tl.load(Temp_ptr + b).to(tl.float32)
        else:
            temp = 0.0
        # Greedy rows (temp not > 0) score no sampling law: 1 keeps their unused arithmetic finite.
        inv_t = tl.where(temp > 0, 1.0 / tl.minimum(tl.maximum(temp, 1.1754943508222875e-38), 8.507059173023462e37),
                         1.0)  # the clamp to [2**-126, 2**126]
        row = Logits_ptr + b * stride_lb + node * stride_lt
        floor = tl.full([], -2147483648, tl.int32)  # keys kept by top-k: all
        run_max, sum_raw, sum_t = _row_sums(row, V, float("-inf"), inv_t, floor, BLOCK)
        if HAS_TOPK:
            k = tl.load(TopK_ptr + b)
            if (temp > 0) & (k > 0) & (k < V):
                floor = _largest_key_reaching(row, V, k.to(tl.float32), run_max, inv_t, floor, False, BLOCK)
                run_max, sum_raw, sum_t = _row_sums(row, V, run_max, inv_t, floor, BLOCK)
        if HAS_TOPP:
            top_p = tl.maximum(tl.load(TopP_ptr + b).to(tl.float32), 1.1754943508222875e-38)
            if (temp > 0) & (top_p < 1.0):
                floor = tl.maximum(floor, _largest_key_reaching(row, V, top_p * sum_t, run_max, inv_t, floor, True,
                                                                BLOCK))
                run_max, sum_raw, sum_t = _row_sums(row, V, run_max, inv_t, floor, BLOCK)
        l_x = tl.load(row + token).to(tl.float32)
        picked = l_x - run_max
        raw = picked - tl.log(sum_raw)
        sampled = tl.where(_keys(l_x) >= floor, picked * inv_t - tl.log(sum_t), float("-inf"))
        tl.store(Raw_ptr + b * stride_out + j, raw)
        tl.store(Sampled_ptr + b * stride_out + j, tl.where(temp > 0, sampled, 0.0))
    else:
        tl.store(Raw_ptr + b * stride_out + j, 0.0)
        tl.store(Sampled_ptr + b * stride_out + j, 0.0)


def path_logprobs_out(logits, tokens, accepted_nodes, num_accepted, error, temperature: Optional[torch.Tensor],
                      top_k: Optional[torch.Tensor], top_p: Optional[torch.Tensor], sampled: torch.Tensor,
                      raw: torch.Tensor) -> None:
    """Launch into ``sampled`` / ``raw`` float32 ``[B, W]`` (see the module docstring); ``logits`` ``[B, T, V]``
    with a unit vocabulary stride."""
    B, W = tokens.shape
    if B == 0 or W == 0:
        return
    V = logits.shape[2]
    block = min(triton.next_power_of_2(V), MAX_BLOCK)
    unused = num_accepted  # any pointer: a HAS_* = False parameter is never loaded
    _path_logprobs_kernel[(B, W)](
        logits, tokens, accepted_nodes, num_accepted, error, unused if temperature is None else temperature,
        unused if top_k is None else top_k, unused if top_p is None else top_p, sampled, raw,
        logits.stride(0), logits.stride(1), tokens.stride(0), accepted_nodes.stride(0), sampled.stride(0), V,
        HAS_TEMP=temperature is not None, HAS_TOPK=top_k is not None, HAS_TOPP=top_p is not None, BLOCK=block,
        num_warps=4 if block >= 1024 else 1,
    )


@torch.library.custom_op("tlt::path_logprobs", mutates_args=())
def _path_logprobs_op(logits: torch.Tensor, tokens: torch.Tensor, accepted_nodes: torch.Tensor,
                      num_accepted: torch.Tensor, error: torch.Tensor, temperature: Optional[torch.Tensor],
                      top_k: Optional[torch.Tensor], top_p: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    sampled = torch.empty(tokens.shape, dtype=torch.float32, device=tokens.device)
    raw = torch.empty(tokens.shape, dtype=torch.float32, device=tokens.device)
    path_logprobs_out(logits, tokens, accepted_nodes, num_accepted, error, temperature, top_k, top_p, sampled, raw)
    return sampled, raw


@_path_logprobs_op.register_fake
def _(logits, tokens, accepted_nodes, num_accepted, error, temperature, top_k, top_p):
    return (torch.empty(tokens.shape, dtype=torch.float32, device=tokens.device),
            torch.empty(tokens.shape, dtype=torch.float32, device=tokens.device))


def path_logprobs(logits, tokens, accepted_nodes, num_accepted, error, temperature, top_k, top_p):
    """``(sampled, raw)`` float32 ``[B, W]``: the emitted tokens' log-probs (see the module docstring)."""
    return _path_logprobs_op(logits, tokens, accepted_nodes, num_accepted, error, temperature, top_k, top_p)
