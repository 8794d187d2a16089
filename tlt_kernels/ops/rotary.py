"""``apply_rotary``: rotate-half rotary position embedding of q and k (transformers' Llama), one launch for both.

Backends: ``torch`` (the reference, :mod:`tlt_kernels.reference.rotary`) and ``triton``
(:mod:`tlt_kernels._triton.rotary`, one launch instead of the reference's dozen elementwise kernels). There is no
CUDA C++ backend: PyTorch's fused kernels (``torch.compile``) or a later CUDA backend are the alternatives.
``auto`` picks Triton on a GPU and the torch reference on CPU tensors.
"""
from __future__ import annotations

from typing import Tuple

import torch

from .._backend import register_op
from .._validation import FLOAT_ACTIVATIONS, check_tensor, check_unit_last_stride

_ROTARY = register_op(
    "apply_rotary",
    {
        "torch": "tlt_kernels.reference.rotary:apply_rotary",
        "triton": "tlt_kernels._triton.rotary:apply_rotary",
    },
    preference=("triton", "torch"),
)


def apply_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    backend: str = "auto",
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``x * cos + rotate_half(x) * sin`` for ``x`` in ``(q, k)``; ``rotate_half(x) = cat(-x[..., D/2:],
    x[..., :D/2])``.

    Rounding as torch in the activation dtype: each product rounded to it, then the sum.

    Args:
        q: ``[B, T, Hq, D]`` bf16 / fp16 / fp32, ``D`` even, last dim contiguous (other dims may be strided, e.g.
            a view of a packed qkv projection).
        k: ``[B, T, Hkv, D]`` of q's dtype (``Hkv`` may differ from ``Hq``), last dim contiguous.
        cos, sin: ``[B, T, D]`` of q's dtype, last dim contiguous (other dims may be strided or expanded).
        backend: ``"auto"``, ``"torch"`` or ``"triton"``.

    Returns:
        ``(q_out, k_out)``: new contiguous tensors of q's and k's shapes.
    """
    check_tensor("q", q, dtype=FLOAT_ACTIVATIONS, ndim=4)
    B, T, _, D = q.shape
    if D % 2:
        raise ValueError(f"q has an odd head dim D={D} (shape {tuple(q.shape)}); rotate-half needs D even")
    check_unit_last_stride("q", q)
    check_tensor("k", k, dtype=q.dtype, shape=(B, T, None, D), device=q.device)
    check_unit_last_stride("k", k)
    for name, t in (("cos", cos), ("sin", sin)):
        check_tensor(name, t, dtype=q.dtype, shape=(B, T, D), device=q.device)
        check_unit_last_stride(name, t)
    _, fn = _ROTARY.resolve(backend, q.device)
    return fn(q, k, cos, sin)
