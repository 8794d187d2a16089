"""``linear``: ``y = x @ weight^T + bias``, a model's projection, with a kernel for the few rows of a decoding step.

Backends: ``torch`` (the reference, :mod:`tlt_kernels.reference.linear`: ``F.linear``, the vendor BLAS on a GPU) and
``triton`` (:mod:`tlt_kernels._triton.linear`: row tiles of 16 on the tensor cores, narrow column tiles). There is
no CUDA C++ backend. ``auto`` takes Triton where it was measured faster than cuBLAS (:func:`few_rows_kernel_applies`:
a CUDA device, bf16 / fp16, at most ``FEW_ROWS_MAX_ROWS`` rows, at most ``FEW_ROWS_MAX_WEIGHTS`` weights) and the
reference everywhere else, the CPU included.
"""
from __future__ import annotations

from typing import Optional

import torch

from .._backend import register_op
from .._validation import FLOAT_ACTIVATIONS, check_tensor, check_unit_last_stride, dense

_LINEAR = register_op(
    "linear",
    {
        "torch": "tlt_kernels.reference.linear:linear",
        "triton": "tlt_kernels._triton.linear:linear",
    },
    preference=("triton", "torch"),
)

# Where the Triton kernel beat cuBLAS on an H200 (tools/skinny_linear_probe, docs/MODELS.md): up to 16 rows (one row
# tile), and weights up to 2^21 (SmolLM2's projections: 1.02-1.35x); a 4864-deep or 3M-weight projection walks K on
# too few programs and lost (0.64-0.97x).
FEW_ROWS_MAX_ROWS = 16
FEW_ROWS_MAX_WEIGHTS = 1 << 21


def few_rows_kernel_applies(device: torch.device, dtype: torch.dtype, rows: int, in_features: int,
                            out_features: int) -> bool:
    """Whether ``backend="auto"`` runs the Triton kernel for ``rows`` rows of ``in_features`` into ``out_features``."""
    return (device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) and rows <= FEW_ROWS_MAX_ROWS
            and in_features * out_features <= FEW_ROWS_MAX_WEIGHTS)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
           backend: str = "auto") -> torch.Tensor:
    """``x @ weight^T + bias``: the products summed in fp32 and rounded once to x's dtype, the bias added before the
    rounding (Triton; torch's own linear on a GPU; on the CPU, strided bf16 rows take a torch path that rounds its
    partial sums). Backends differ in the order of the sum, so their outputs may differ in the last bit.

    Args:
        x: ``[..., K]`` bf16 / fp16 / fp32, last dim contiguous (leading dims may be strided).
        weight: ``[N, K]`` of x's dtype and device, last dim contiguous (e.g. a row block of a packed projection).
        bias: None or ``[N]`` of x's dtype.
        backend: ``"auto"``, ``"torch"`` or ``"triton"``.

    Returns:
        A new contiguous ``[..., N]`` tensor of x's dtype.
    """
    check_tensor("x", x, dtype=FLOAT_ACTIVATIONS)
    check_unit_last_stride("x", x)
    check_tensor("weight", weight, dtype=x.dtype, ndim=2, device=x.device)
    check_unit_last_stride("weight", weight)
    K, N = x.shape[-1], weight.shape[0]
    if weight.shape[1] != K:
        raise ValueError(f"weight has {weight.shape[1]} input features, expected x's last dim K={K}")
    if bias is not None:
        check_tensor("bias", bias, dtype=x.dtype, shape=(N,), device=x.device)
    rows = x.numel() // K if K else 0
    if backend == "auto" and not few_rows_kernel_applies(x.device, x.dtype, rows, K, N):
        backend = "torch"
    _, fn = _LINEAR.resolve(backend, x.device)
    return fn(x, weight, dense(bias))
