"""Packed projections: several ``nn.Linear`` of one input (q/k/v, gate/up) as row blocks of one weight tensor, so a
decoding step runs one GEMM where it ran three (or two). A small model's step is bound by its launch count
(docs/MODELS.md), and each narrow GEMM costs a launch however few bytes it reads.

Each Linear's parameters become views of the packed tensor (no second copy of the weights), so in-place updates of
the parameters (an optimizer step, ``load_state_dict``) update it too. Anything that gives a parameter new storage
(``model.to(...)``, assigning ``.data``, sharding wrappers) breaks the views: :meth:`PackedLinears.valid` then says
so and the model runs the separate projections, which are always right.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F


class PackedLinears:
    """``linears`` (same input size, all with a bias or none) packed as one ``[sum(out), in]`` weight."""

    def __init__(self, linears: Sequence[nn.Linear]):
        self.linears = list(linears)
        if len({lin.in_features for lin in self.linears}) != 1:
            raise ValueError("packed linears must share their input size")
        if len({lin.bias is None for lin in self.linears}) != 1:
            raise ValueError("packed linears must all have a bias or none")
        self.sizes = [lin.out_features for lin in self.linears]
        with torch.no_grad():
            self.weight = torch.cat([lin.weight.detach() for lin in self.linears])
            for lin, block in zip(self.linears, self.weight.split(self.sizes)):
                lin.weight.data = block
            self.bias = None
            if self.linears[0].bias is not None:
                self.bias = torch.cat([lin.bias.detach() for lin in self.linears])
                for lin, block in zip(self.linears, self.bias.split(self.sizes)):
                    lin.bias.data = block
        self._pointers = self._current_pointers()

    def _current_pointers(self) -> Tuple[int, ...]:
        weights = tuple(lin.weight.data_ptr() for lin in self.linears)
        return weights + (tuple(lin.bias.data_ptr() for lin in self.linears) if self.bias is not None else ())

    def valid(self) -> bool:
        """Whether every parameter is still the view it was made (a pointer check: no device work)."""
        return self._current_pointers() == self._pointers

    def __call__(self, x: torch.Tensor) -> List[torch.Tensor]:
        """``[lin(x) for lin in linears]`` from one GEMM: views of its ``[..., sum(out)]`` output (last dim
        contiguous, leading dims strided)."""
        return list(F.linear(x, self.weight, self.bias).split(self.sizes, dim=-1))
