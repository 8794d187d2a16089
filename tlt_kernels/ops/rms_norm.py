"""``rms_norm``: RMSNorm with the residual add of a pre-norm decoder fused in (one launch instead of about eight).

Backends: ``torch`` (the reference) and ``triton``; no CUDA C++ backend (a launch-bound elementwise row op, which
Triton serves). Not a ``torch.library`` custom op: the model calls it only in its inference path (no autograd).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .._backend import register_op
from .._validation import check_tensor, dense

_RMS_NORM = register_op(
    "rms_norm",
    {"torch": "tlt_kernels.reference.rms_norm:rms_norm", "triton": "tlt_kernels._triton.rms_norm:rms_norm"},
    preference=("triton", "torch"),
)
FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: Optional[torch.Tensor] = None, *,
             backend: str = "auto") -> Tuple[torch.Tensor, torch.Tensor]:
    """``h = x + residual`` (or ``x``), then ``out = weight * (h * rsqrt(mean(h^2, -1) + eps))``.

    The mean and rsqrt are fp32; the normalised value is cast to the dtype before the weight product, and the add
    is rounded to the dtype: transformers' Llama RMSNorm after a residual add, to the last bit but for the fp32
    sum's reduction order.

    Args:
        x: ``[..., H]`` fp32 / fp16 / bf16.
        weight: ``[H]``, x's dtype.
        eps: added to the mean square.
        residual: None or ``[..., H]`` like ``x``.
        backend: ``"auto"`` (Triton on CUDA, the reference on the CPU), ``"torch"`` or ``"triton"``.
    Returns:
        ``(out, h)``, both ``[..., H]`` in x's dtype; ``h`` is the sum (``x`` itself without a residual), the next
        layer's residual.
    """
    check_tensor("x", x, dtype=FLOATS)
    if x.ndim < 1:
        raise ValueError("x must have at least one dimension (the features)")
    check_tensor("weight", weight, dtype=x.dtype, shape=(x.shape[-1],), device=x.device)
    if residual is not None:
        check_tensor("residual", residual, dtype=x.dtype, shape=tuple(x.shape), device=x.device)
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    _, fn = _RMS_NORM.resolve(backend, x.device)
    return fn(dense(x), dense(weight), float(eps), dense(residual))
