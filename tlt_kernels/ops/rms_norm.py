"""``rms_norm``: RMSNorm of the last dim with an optional fused residual add (transformers' Llama rounding).

Backends: ``torch`` (the reference, :mod:`tlt_kernels.reference.rms_norm`) and ``triton``
(:mod:`tlt_kernels._triton.rms_norm`, one launch instead of the reference's handful of elementwise kernels). There is
no CUDA C++ backend: PyTorch's own fused ``torch.nn.functional.rms_norm`` (different rounding) or a later CUDA
backend are the alternatives. ``auto`` picks Triton on a GPU and the torch reference on CPU tensors.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .._backend import register_op
from .._validation import FLOAT_ACTIVATIONS, check_float, check_tensor, check_unit_last_stride, dense

_RMS_NORM = register_op(
    "rms_norm",
    {
        "torch": "tlt_kernels.reference.rms_norm:rms_norm",
        "triton": "tlt_kernels._triton.rms_norm:rms_norm",
    },
    preference=("triton", "torch"),
)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: Optional[torch.Tensor] = None,
    *,
    backend: str = "auto",
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``weight * rmsnorm(h)`` of ``h = x`` or ``h = x + residual``, and ``h`` (the next residual stream).

    Rounding as transformers' Llama RMSNorm: ``h`` in x's dtype; ``hf = h.float()``;
    ``normed = (hf * rsqrt(mean(hf * hf, -1) + eps)).to(x.dtype)``; ``out = weight * normed`` in x's dtype.

    Args:
        x: ``[..., H]`` bf16 / fp16 / fp32, last dim contiguous (leading dims may be strided, e.g. a slice).
        weight: ``[H]`` of x's dtype.
        eps: added to the mean of squares (a Python float >= 0).
        residual: None, or a tensor of x's shape and dtype (last dim contiguous).
        backend: ``"auto"``, ``"torch"`` or ``"triton"``.

    Returns:
        ``(out, residual_out)``: ``out`` a new tensor of x's shape and dtype; ``residual_out`` is ``x + residual``
        (a new tensor) or, when ``residual`` is None, ``x`` itself (no copy).
    """
    check_tensor("x", x, dtype=FLOAT_ACTIVATIONS)
    check_unit_last_stride("x", x)
    check_tensor("weight", weight, dtype=x.dtype, shape=(x.shape[-1],), device=x.device)
    if residual is not None:
        check_tensor("residual", residual, dtype=x.dtype, shape=tuple(x.shape), device=x.device)
        check_unit_last_stride("residual", residual)
    eps = check_float("eps", eps)
    _, fn = _RMS_NORM.resolve(backend, x.device)
    return fn(x, dense(weight), eps, residual)
