"""The engine's ``drafter=`` argument turned into a :class:`~tlt_kernels.drafter.base.Drafter`, once, at construction."""
from __future__ import annotations

import torch

from .base import Drafter, NoDrafter
from .eagle import EagleDrafter
from .eagle_rollout import EagleRolloutDrafter, eagle_tree_width
from .ngram_drafter import NGramDrafter
from .ngram_rollout import NGramRolloutDrafter, ngram_tree_width
from .union import UnionDrafter

_EXPECTED = "None, 'ngram', an NGramDrafter, an EagleDrafter, a Drafter, or a pair of them"

# The drafter names tree_width() accepts, for the public helper of that name.
_TREE_WIDTH_BY_NAME = {"none": lambda strategy: 1, "ngram": ngram_tree_width, "eagle": eagle_tree_width}


def as_drafter(spec, device: torch.device) -> Drafter:
    """``None`` -> :class:`NoDrafter`; ``"ngram"`` or an :class:`NGramDrafter` (its ``min_n``/``max_n``) -> an
    :class:`NGramRolloutDrafter`; an :class:`EagleDrafter` (on ``device``) -> an :class:`EagleRolloutDrafter`; an
    object with the :class:`Drafter` methods is used as it is; a pair ``(primary, secondary)`` of those -> a
    :class:`~tlt_kernels.drafter.union.UnionDrafter` (both trees verified as one, e.g. ``[eagle, "ngram"]``)."""
    if spec is None:
        return NoDrafter()
    if isinstance(spec, (list, tuple)):
        if len(spec) != 2 or any(part is None for part in spec):
            raise ValueError(f"drafter: a pair (primary, secondary) of drafters unites their trees, got {spec!r}")
        return UnionDrafter(as_drafter(spec[0], device), as_drafter(spec[1], device))
    if isinstance(spec, str):
        if spec != "ngram":
            raise ValueError(f"drafter must be {_EXPECTED}, got {spec!r}")
        return NGramRolloutDrafter()
    if isinstance(spec, NGramDrafter):
        return NGramRolloutDrafter(spec.min_n, spec.max_n)
    if isinstance(spec, EagleDrafter):
        return EagleRolloutDrafter(spec, device)
    if isinstance(spec, Drafter):
        return spec
    raise TypeError(f"drafter must be {_EXPECTED}, got {type(spec).__name__}")


def tree_width(strategy, drafter_kind: str) -> int:
    """Nodes ``T`` of the tree verified per request under ``strategy`` (root included) for a drafter named
    ``drafter_kind``: ``"eagle"``: ``num_verify`` (EAGLE-2 selection keeps exactly that many). ``"ngram"``: a chain
    of ``min(num_steps, num_verify - 1)`` drafts for ``topk == 1``, else ``topk`` branches of
    ``(num_verify - 1) // topk`` drafts each. ``"none"`` or plain decoding: 1. A drafter object answers with its
    own ``tree_width(strategy)``."""
    if drafter_kind not in _TREE_WIDTH_BY_NAME:
        raise ValueError(f"drafter_kind must be one of {sorted(_TREE_WIDTH_BY_NAME)}, got {drafter_kind!r}")
    return _TREE_WIDTH_BY_NAME[drafter_kind](strategy)
