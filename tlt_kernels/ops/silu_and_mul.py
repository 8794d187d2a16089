"""``silu_and_mul``: the activation of a gated MLP, ``silu(gate) * up``, with torch's rounding.

Backends: ``torch`` (the reference, :mod:`tlt_kernels.reference.silu_and_mul`) and ``triton``
(:mod:`tlt_kernels._triton.silu_and_mul`, one launch instead of two). There is no CUDA C++ backend: PyTorch's fused
kernels (``torch.compile``) or a later CUDA backend are the alternatives. ``auto`` picks Triton on a GPU and the
torch reference on CPU tensors.
"""
from __future__ import annotations

import torch

from .._backend import register_op
from .._validation import FLOAT_ACTIVATIONS, check_tensor, check_unit_last_stride

_SILU_AND_MUL = register_op(
    "silu_and_mul",
    {
        "torch": "tlt_kernels.reference.silu_and_mul:silu_and_mul",
        "triton": "tlt_kernels._triton.silu_and_mul:silu_and_mul",
    },
    preference=("triton", "torch"),
)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """``F.silu(gate) * up``: the SiLU computed in fp32 and rounded to the dtype, then the product in the dtype.

    Args:
        gate, up: ``[..., I]`` of one shape and dtype (bf16 / fp16 / fp32), last dim contiguous (leading dims may
            be strided, e.g. the two halves of one packed gate/up projection).
        backend: ``"auto"``, ``"torch"`` or ``"triton"``.

    Returns:
        A new tensor of gate's shape and dtype.
    """
    check_tensor("gate", gate, dtype=FLOAT_ACTIVATIONS)
    check_unit_last_stride("gate", gate)
    check_tensor("up", up, dtype=gate.dtype, shape=tuple(gate.shape), device=gate.device)
    check_unit_last_stride("up", up)
    _, fn = _SILU_AND_MUL.resolve(backend, gate.device)
    return fn(gate, up)
