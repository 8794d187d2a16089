"""Triton rotary embedding of q and k in one launch: grid ``(B*T, Hq + Hkv)``, a program rotates one head of one
token with the token's ``cos``/``sin``. Each product and the sum are rounded to the dtype, as the reference's
half-precision torch ops round them."""
from __future__ import annotations

from typing import Tuple

import torch
import triton
import triton.language as tl


@triton.jit
def _rotary_kernel(Q_ptr, K_ptr, Cos_ptr, Sin_ptr, QOut_ptr, KOut_ptr, HQ, HK, D,
                   BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    half = D // 2
    partner = tl.where(cols < half, cols + half, cols - half)  # rotate_half: (-x2, x1)
    sign = tl.where(cols < half, -1.0, 1.0)
    c = tl.load(Cos_ptr + token * D + cols, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(Sin_ptr + token * D + cols, mask=mask, other=0.0).to(tl.float32)
    # A program is a q head (head < HQ) or a k head: the other tensor's loads and stores are masked off.
    is_q = head < HQ
    q_off = (token * HQ + head) * D
    k_off = (token * HK + head - HQ) * D
    in_q = mask & is_q
    in_k = mask & (head >= HQ)
    x = tl.load(Q_ptr + q_off + cols, mask=in_q, other=0.0).to(tl.float32) + \
        tl.load(K_ptr + k_off + cols, mask=in_k, other=0.0).to(tl.float32)
    partner_x = tl.load(Q_ptr + q_off + partner, mask=in_q, other=0.0).to(tl.float32) + \
        tl.load(K_ptr + k_off + partner, mask=in_k, other=0.0).to(tl.float32)
    dtype = QOut_ptr.dtype.element_ty
    a = (x * c).to(dtype).to(tl.float32)
    b = (partner_x * sign * s).to(dtype).to(tl.float32)
    out = (a + b).to(dtype)
    tl.store(QOut_ptr + q_off + cols, out, mask=in_q)
    tl.store(KOut_ptr + k_off + cols, out, mask=in_k)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``q: [B, T, Hq, D]``, ``k: [B, T, Hkv, D]``, ``cos, sin: [B, T, D]``, all contiguous, one dtype."""
    B, T, HQ, D = q.shape
    HK = k.shape[2]
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    if B * T and HQ + HK:
        _rotary_kernel[(B * T, HQ + HK)](q, k, cos, sin, q_out, k_out, HQ, HK, D,
                                         BLOCK=triton.next_power_of_2(D))
    return q_out, k_out
