"""Reference linear layer (pure torch, CPU and GPU): ``x @ weight^T + bias``, products summed in fp32 (or wider) and
rounded once to x's dtype, as torch's own ``F.linear`` does (the vendor BLAS on a GPU)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: ``[..., N]`` of x's dtype for ``x [..., K]``, ``weight [N, K]``, ``bias [N]``."""
    return F.linear(x, weight, bias)
