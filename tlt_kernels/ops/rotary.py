"""``apply_rotary``: rotary position embedding of q and k ("rotate half" pairing) in one launch.

Backends: ``torch`` (the reference) and ``triton``; no CUDA C++ backend (a launch-bound elementwise op). Not a
``torch.library`` custom op: the model calls it only in its inference path.
"""
from __future__ import annotations

from typing import Tuple

import torch

from .._backend import register_op
from .._validation import check_tensor, dense
from .rms_norm import FLOATS

_ROTARY = register_op(
    "apply_rotary",
    {"torch": "tlt_kernels.reference.rotary:apply_rotary", "triton": "tlt_kernels._triton.rotary:apply_rotary"},
    preference=("triton", "torch"),
)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                 backend: str = "auto") -> Tuple[torch.Tensor, torch.Tensor]:
    """``x * cos + rotate_half(x) * sin`` for ``x`` in ``(q, k)``, ``rotate_half(x) = cat(-x[..., D/2:],
    x[..., :D/2])``; each product and the sum rounded to the dtype (transformers' Llama ``apply_rotary_pos_emb``).

    Args:
        q: ``[B, T, Hq, D]``, D even, fp32 / fp16 / bf16.
        k: ``[B, T, Hkv, D]``, q's dtype.
        cos, sin: ``[B, T, D]``, q's dtype (angles of each token's position).
        backend: ``"auto"`` (Triton on CUDA, the reference on the CPU), ``"torch"`` or ``"triton"``.
    Returns:
        ``(q_rotated, k_rotated)``, new contiguous tensors of q's and k's shapes.
    """
    check_tensor("q", q, dtype=FLOATS, ndim=4)
    B, T, _, D = q.shape
    if D % 2:
        raise ValueError(f"q's head dim must be even (rotate-half pairs i with i + D/2), got D={D}")
    check_tensor("k", k, dtype=q.dtype, shape=(B, T, None, D), device=q.device)
    check_tensor("cos", cos, dtype=q.dtype, shape=(B, T, D), device=q.device)
    check_tensor("sin", sin, dtype=q.dtype, shape=(B, T, D), device=q.device)
    _, fn = _ROTARY.resolve(backend, q.device)
    return fn(dense(q), dense(k), dense(cos), dense(sin))
