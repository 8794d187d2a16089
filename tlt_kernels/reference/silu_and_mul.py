"""Reference SiLU-and-multiply of a gated MLP (pure torch, CPU and GPU): ``silu(gate) * up``.

Rounding as in ``F.silu(gate) * up``: the SiLU in fp32, rounded to the activation dtype, then the product in
that dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up``: a new tensor of gate's shape and dtype (``[..., I]`` bf16 / fp16 / fp32)."""
    return F.silu(gate) * up
