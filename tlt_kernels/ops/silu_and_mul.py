"""``silu_and_mul``: the SwiGLU activation ``silu(gate) * up`` in one launch.

Backends: ``torch`` (the reference) and ``triton``; no CUDA C++ backend (a launch-bound elementwise op). Not a
``torch.library`` custom op: the model calls it only in its inference path.
"""
from __future__ import annotations

import torch

from .._backend import register_op
from .._validation import check_tensor, dense
from .rms_norm import FLOATS

_SILU_AND_MUL = register_op(
    "silu_and_mul",
    {"torch": "tlt_kernels.reference.silu_and_mul:silu_and_mul",
     "triton": "tlt_kernels._triton.silu_and_mul:silu_and_mul"},
    preference=("triton", "torch"),
)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """``F.silu(gate) * up``: silu in fp32 rounded to the dtype, then the product rounded to the dtype.

    Args:
        gate, up: ``[..., I]``, same shape, fp32 / fp16 / bf16.
        backend: ``"auto"`` (Triton on CUDA, the reference on the CPU), ``"torch"`` or ``"triton"``.
    Returns:
        ``[..., I]`` in gate's dtype.
    """
    check_tensor("gate", gate, dtype=FLOATS)
    check_tensor("up", up, dtype=gate.dtype, shape=tuple(gate.shape), device=gate.device)
    _, fn = _SILU_AND_MUL.resolve(backend, gate.device)
    return fn(dense(gate), dense(up))
