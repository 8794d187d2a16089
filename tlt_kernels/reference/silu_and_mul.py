"""Reference SwiGLU activation (pure torch): ``silu(gate) * up``, silu rounded to the dtype before the product, as
``F.silu(gate) * up`` computes it."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``gate, up: [..., I]`` -> ``[..., I]``."""
    return F.silu(gate) * up
