"""Triton rotate-half rotary embedding of q and k in one launch.

Grid ``(B * T,)``: a program loads the row's ``cos`` / ``sin`` once and rotates all ``Hq`` query heads and all
``Hkv`` key heads of that row as ``[heads, D/2]`` tiles (first and second halves apart). Strides of the batch,
token and head dims are passed, so views of one packed qkv projection are read in place; outputs are new
contiguous ``[B, T, H, D]`` tensors. bf16 / fp16 values are upcast to fp32 for the arithmetic; each product and
the sum are rounded to the activation dtype, torch's order (:mod:`tlt_kernels.reference.rotary`). Products and
sums of two values of that dtype are single fp32 operations that round to the same bits as torch's.

``rotary_to_cache`` is the same launch with the rotated k and the untouched v stored at their KV-cache rows instead
of new tensors (a decoding step's K/V write, without two more launches per layer).

Eager calls launch directly; otherwise the launch runs inside the custom op ``tlt::apply_rotary`` /
``tlt::rotary_to_cache`` / ``tlt::rotary_to_cache_into`` (the rotated q into a given buffer; fake implementations for
``torch.compile``; no host sync).
"""
from __future__ import annotations

from typing import Tuple

import torch
import triton
import triton.language as tl

from .._backend import direct_dispatch_ok
from .rounding import hand_round, round_to


@triton.jit
def _rotate_heads(X_ptr, stride_h, Out_ptr, out_stride_h, c1, c2, s1, s2, NH, HALF, NH_POW2: tl.constexpr,
                  HALF_POW2: tl.constexpr, HAND_ROUND: tl.constexpr):
    """Rotate ``NH`` heads of one row: ``X_ptr`` / ``Out_ptr`` point at head 0 (head strides ``stride_h`` /
    ``out_stride_h``); ``c1, c2, s1, s2`` are the fp32 ``[1, HALF_POW2]`` halves of cos / sin."""
    h = tl.arange(0, NH_POW2)[:, None].to(tl.int64)
    d = tl.arange(0, HALF_POW2)[None, :]
    m = (h < NH) & (d < HALF)
    dt = Out_ptr.dtype.element_ty
    x1 = tl.load(X_ptr + h * stride_h + d, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(X_ptr + h * stride_h + HALF + d, mask=m, other=0.0).to(tl.float32)
    # x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1): each product rounded to the dtype, then the sum.
    a1 = round_to(x1 * c1, dt, HAND_ROUND).to(tl.float32)
    b1 = round_to(-x2 * s1, dt, HAND_ROUND).to(tl.float32)
    a2 = round_to(x2 * c2, dt, HAND_ROUND).to(tl.float32)
    b2 = round_to(x1 * s2, dt, HAND_ROUND).to(tl.float32)
    o1 = round_to(a1 + b1, dt, HAND_ROUND)
    o2 = round_to(a2 + b2, dt, HAND_ROUND)
    out = Out_ptr + h * out_stride_h + d
    tl.store(out, o1, mask=m)
    tl.store(out + HALF, o2, mask=m)


@triton.jit
def _row_tables(Cos_row, Sin_row, HALF, HALF_POW2: tl.constexpr):
    """One row's cos / sin halves as fp32 ``[1, HALF_POW2]`` tiles ``(c1, c2, s1, s2)``."""
    d = tl.arange(0, HALF_POW2)[None, :]
    dm = d < HALF
    c1 = tl.load(Cos_row + d, mask=dm, other=0.0).to(tl.float32)
    c2 = tl.load(Cos_row + HALF + d, mask=dm, other=0.0).to(tl.float32)
    s1 = tl.load(Sin_row + d, mask=dm, other=0.0).to(tl.float32)
    s2 = tl.load(Sin_row + HALF + d, mask=dm, other=0.0).to(tl.float32)
    return c1, c2, s1, s2


# T (tokens per request) varies with each prefill's padded prompt length; specializing on it (T == 1, multiples of
# 16) would JIT-compile a new variant in the middle of a rollout. It only divides the row index.
_ROW_INT_ARGS = ["T"]


@triton.jit(do_not_specialize=_ROW_INT_ARGS)
def _rotary_kernel(
    Q_ptr, K_ptr, Cos_ptr, Sin_ptr, QOut_ptr, KOut_ptr, T, HQ, HKV, HALF,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sc_b, sc_t, ss_b, ss_t,
    HQ_POW2: tl.constexpr, HKV_POW2: tl.constexpr, HALF_POW2: tl.constexpr, HAND_ROUND: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    b = row // T
    t = row % T
    c1, c2, s1, s2 = _row_tables(Cos_ptr + b * sc_b + t * sc_t, Sin_ptr + b * ss_b + t * ss_t, HALF, HALF_POW2)
    _rotate_heads(Q_ptr + b * sq_b + t * sq_t, sq_h, QOut_ptr + row * HQ * 2 * HALF, 2 * HALF, c1, c2, s1, s2, HQ,
                  HALF, HQ_POW2, HALF_POW2, HAND_ROUND)
    _rotate_heads(K_ptr + b * sk_b + t * sk_t, sk_h, KOut_ptr + row * HKV * 2 * HALF, 2 * HALF, c1, c2, s1, s2, HKV,
                  HALF, HKV_POW2, HALF_POW2, HAND_ROUND)


@triton.jit
def _copy_heads(X_ptr, stride_h, Out_ptr, NH, D, NH_POW2: tl.constexpr, D_POW2: tl.constexpr):
    """Copy ``NH`` heads of one row (head stride ``stride_h``) to contiguous heads at ``Out_ptr``."""
    h = tl.arange(0, NH_POW2)[:, None].to(tl.int64)
    d = tl.arange(0, D_POW2)[None, :]
    m = (h < NH) & (d < D)
    tl.store(Out_ptr + h * D + d, tl.load(X_ptr + h * stride_h + d, mask=m, other=0.0), mask=m)


@triton.jit(do_not_specialize=_ROW_INT_ARGS)
def _rotary_cache_kernel(
    Q_ptr, K_ptr, V_ptr, Cos_ptr, Sin_ptr, Slots_ptr, QOut_ptr, KCache_ptr, VCache_ptr, T, HQ, HKV, HALF,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, sc_b, sc_t, ss_b, ss_t, so_b, so_t, so_h,
    HQ_POW2: tl.constexpr, HKV_POW2: tl.constexpr, HALF_POW2: tl.constexpr, HAND_ROUND: tl.constexpr,
):
    """:func:`_rotary_kernel` whose rotated k and untouched v go straight to their cache row ``Slots[row]``: the
    K/V write of a decoding step without two more launches per layer. The rotated q goes to ``QOut`` by its batch,
    token and head strides (a slice of a larger buffer is written in place)."""
    row = tl.program_id(0).to(tl.int64)
    b = row // T
    t = row % T
    c1, c2, s1, s2 = _row_tables(Cos_ptr + b * sc_b + t * sc_t, Sin_ptr + b * ss_b + t * ss_t, HALF, HALF_POW2)
    cache_row = tl.load(Slots_ptr + row) * HKV * 2 * HALF
    _rotate_heads(Q_ptr + b * sq_b + t * sq_t, sq_h, QOut_ptr + b * so_b + t * so_t, so_h, c1, c2, s1, s2, HQ,
                  HALF, HQ_POW2, HALF_POW2, HAND_ROUND)
    _rotate_heads(K_ptr + b * sk_b + t * sk_t, sk_h, KCache_ptr + cache_row, 2 * HALF, c1, c2, s1, s2, HKV, HALF,
                  HKV_POW2, HALF_POW2, HAND_ROUND)
    _copy_heads(V_ptr + b * sv_b + t * sv_t, sv_h, VCache_ptr + cache_row, HKV, 2 * HALF, HKV_POW2, 2 * HALF_POW2)


def _launch_shape(q: torch.Tensor, k: torch.Tensor) -> dict:
    """The kernels' compile-time sizes and warp count for ``q [B, T, Hq, D]`` / ``k [B, T, Hkv, D]``: power-of-two
    head and half-dim tiles; one warp for a tile of at most 256 values, 4 up to 4096, else 8."""
    hq2, hkv2 = triton.next_power_of_2(q.shape[2]), triton.next_power_of_2(k.shape[2])
    half2 = triton.next_power_of_2(q.shape[3] // 2)
    tile = max(hq2, hkv2) * half2
    return dict(HQ_POW2=hq2, HKV_POW2=hkv2, HALF_POW2=half2, HAND_ROUND=hand_round(q.dtype),
                num_warps=1 if tile <= 256 else 4 if tile <= 4096 else 8)


def apply_rotary_out(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     q_out: torch.Tensor, k_out: torch.Tensor) -> None:
    """Launch into ``q_out`` / ``k_out`` (new contiguous); ``q [B, T, Hq, D]``, ``k [B, T, Hkv, D]``,
    ``cos, sin [B, T, D]``, all with a unit last stride and even ``D`` (validated by
    :func:`tlt_kernels.ops.rotary.apply_rotary`)."""
    B, T, HQ, D = q.shape
    HKV = k.shape[2]
    if B * T == 0 or D == 0:
        return
    _rotary_kernel[(B * T,)](
        q, k, cos, sin, q_out, k_out, T, HQ, HKV, D // 2,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1), **_launch_shape(q, k),
    )


def _empty_outputs(q: torch.Tensor, k: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty(q.shape, dtype=q.dtype, device=q.device),
            torch.empty(k.shape, dtype=k.dtype, device=k.device))


@torch.library.custom_op("tlt::apply_rotary", mutates_args=())
def _apply_rotary_op(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    q_out, k_out = _empty_outputs(q, k)
    apply_rotary_out(q, k, cos, sin, q_out, k_out)
    return q_out, k_out


@_apply_rotary_op.register_fake
def _(q, k, cos, sin):
    return _empty_outputs(q, k)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Backend of :func:`tlt_kernels.ops.rotary.apply_rotary`: new contiguous ``(q_out, k_out)``."""
    if direct_dispatch_ok(q, k, cos, sin):  # plain eager: launch without the op's dispatch
        q_out, k_out = _empty_outputs(q, k)
        apply_rotary_out(q, k, cos, sin, q_out, k_out)
        return q_out, k_out
    return torch.ops.tlt.apply_rotary(q, k, cos, sin)


def rotary_to_cache_out(q, k, v, cos, sin, k_cache, v_cache, slots, q_out) -> None:
    """Launch: rotated q into ``q_out`` (``[B, T, Hq, D]``, any strides with a unit last one), rotated k and v into
    rows ``slots`` (int64 ``[B * T]``) of the contiguous ``[N, Hkv, D]`` caches (validated by
    :func:`tlt_kernels.ops.rotary.rotary_to_cache`)."""
    B, T, HQ, D = q.shape
    HKV = k.shape[2]
    if B * T == 0 or D == 0:
        return
    _rotary_cache_kernel[(B * T,)](
        q, k, v, cos, sin, slots, q_out, k_cache, v_cache, T, HQ, HKV, D // 2,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1),
        q_out.stride(0), q_out.stride(1), q_out.stride(2), **_launch_shape(q, k),
    )


@torch.library.custom_op("tlt::rotary_to_cache", mutates_args=("k_cache", "v_cache"))
def _rotary_to_cache_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    rotary_to_cache_out(q, k, v, cos, sin, k_cache, v_cache, slots, q_out)
    return q_out


@_rotary_to_cache_op.register_fake
def _(q, k, v, cos, sin, k_cache, v_cache, slots):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


@torch.library.custom_op("tlt::rotary_to_cache_into", mutates_args=("k_cache", "v_cache", "q_out"))
def _rotary_to_cache_into_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                             sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                             q_out: torch.Tensor) -> None:
    rotary_to_cache_out(q, k, v, cos, sin, k_cache, v_cache, slots, q_out)


@_rotary_to_cache_into_op.register_fake
def _(q, k, v, cos, sin, k_cache, v_cache, slots, q_out):
    return None


def rotary_to_cache(q, k, v, cos, sin, k_cache, v_cache, slots, q_out=None) -> torch.Tensor:
    """Backend of :func:`tlt_kernels.ops.rotary.rotary_to_cache`: the rotated q, new contiguous, or ``q_out``
    written in place."""
    if direct_dispatch_ok(q, k, v, cos, sin, k_cache, v_cache, slots, q_out):
        if q_out is None:
            q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        rotary_to_cache_out(q, k, v, cos, sin, k_cache, v_cache, slots, q_out)
        return q_out
    if q_out is None:
        return torch.ops.tlt.rotary_to_cache(q, k, v, cos, sin, k_cache, v_cache, slots)
    torch.ops.tlt.rotary_to_cache_into(q, k, v, cos, sin, k_cache, v_cache, slots, q_out)
    return q_out
