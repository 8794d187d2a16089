"""Rounding fp32 to the activation dtype the same way on the GPU and in Triton's CPU interpreter.

On the GPU ``x.to(tl.bfloat16)`` rounds to nearest even, like torch; the interpreter truncates that cast. The fused
elementwise kernels promise torch's bits, so under the interpreter they round to bf16 by hand first (the cast of the
already-rounded value is then exact). fp16 and fp32 need nothing: the interpreter's fp16 cast rounds to nearest even.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._backend import triton_interpret_enabled


def hand_round(dtype: torch.dtype) -> bool:
    """The ``HAND_ROUND`` argument of :func:`round_to` for outputs of ``dtype`` (read at each launch)."""
    return dtype == torch.bfloat16 and triton_interpret_enabled()


@triton.jit
def round_to(x, out_dtype: tl.constexpr, HAND_ROUND: tl.constexpr):
    """fp32 ``x`` rounded to nearest even in ``out_dtype`` (``HAND_ROUND``: bf16 under the interpreter)."""
    if HAND_ROUND:
        bits = x.to(tl.int32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        # NaN stays NaN (a payload near the top would otherwise carry into the sign or round to inf).
        x = tl.where(x != x, x, (bits & -65536).to(tl.float32, bitcast=True))
    return x.to(out_dtype)
