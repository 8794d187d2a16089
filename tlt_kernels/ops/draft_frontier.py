"""``draft_frontier``: one expansion step's bookkeeping in an EAGLE-2 draft, in one launch.

A draft step expands the ``K`` frontier nodes of each request into ``C`` children each: ``child_logprobs`` and
``child_tokens`` are the top ``C`` of each node's next-token distribution (:func:`tlt_kernels.top_logprobs`). The step
then (1) records every child as a draft candidate, scored by its *cumulative* log-probability (parent's score plus
its own) and pointing at its parent's candidate index; (2) keeps the ``keep`` best children as the next frontier
(largest score first; equal scores by child index ``parent * C + c``, the lower first; ``-0.0`` as ``0.0`` and NaN
above ``+inf``, as :func:`tlt_kernels.top_logprobs` ranks); (3) builds the drafter's next input for each kept child:
its token's embedding row beside its parent's predicted feature. In torch that is about ten small launches per depth
(an add, a copy, a top-k, a division, gathers, an embedding, a concatenation); the Triton kernel does it in one.

Backends: ``torch`` (the reference, :mod:`tlt_kernels.reference.draft_frontier`) and ``triton``
(:mod:`tlt_kernels._triton.draft_frontier`; ``K * C <= TRITON_MAX_CHILDREN``, ``keep <= TRITON_MAX_KEEP``: each program
ranks every child and selects the kept ones one by one). ``auto`` picks Triton on a GPU within those limits.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .._backend import BackendUnavailableError, register_op
from .._validation import FLOAT_ACTIVATIONS, capturing, check_int, check_tensor, check_unit_last_stride

TRITON_MAX_CHILDREN = 1024  # K * C: every program ranks all of a request's children
TRITON_MAX_KEEP = 32  # the kept children are selected one by one

_DRAFT_FRONTIER = register_op(
    "draft_frontier",
    {
        "torch": "tlt_kernels.reference.draft_frontier:draft_frontier",
        "triton": "tlt_kernels._triton.draft_frontier:draft_frontier",
    },
    preference=("triton", "torch"),
)


class FrontierStep(NamedTuple):
    cand_parents: torch.Tensor  # int32 [B, K * C]: each child's parent's candidate index
    cand_scores: torch.Tensor  # float32 [B, K * C]: each child's cumulative log-probability
    scores: torch.Tensor  # float32 [B, keep]: the kept children's cumulative log-probabilities, best first
    tokens: torch.Tensor  # int64 [B, keep]
    cand_index: torch.Tensor  # int64 [B, keep]: first_index + child index
    parent_rows: torch.Tensor  # int64 [B, keep]: first_row + parent
    inputs: torch.Tensor  # [B, keep, 2H] in features' dtype: cat(embed_weight[tokens], features[parent])


def _check_shapes(parent_scores, parent_index, child_logprobs, child_tokens, features, embed_weight):
    check_tensor("child_logprobs", child_logprobs, dtype=torch.float32, ndim=3)
    B, K, C = child_logprobs.shape
    if C == 0:
        raise ValueError(f"child_logprobs needs at least one child per node, got shape {tuple(child_logprobs.shape)}")
    dev = child_logprobs.device
    check_tensor("child_tokens", child_tokens, dtype=torch.int64, shape=(B, K, C), device=dev)
    check_tensor("parent_scores", parent_scores, dtype=torch.float32, shape=(B, K), device=dev)
    check_tensor("parent_index", parent_index, dtype=torch.int64, shape=(B, K), device=dev)
    check_tensor("features", features, dtype=FLOAT_ACTIVATIONS, shape=(B, K, None), device=dev)
    if features.shape[2] == 0:
        raise ValueError("features needs at least one feature per node, got H = 0")
    check_tensor("embed_weight", embed_weight, dtype=FLOAT_ACTIVATIONS, shape=(None, features.shape[2]), device=dev)
    for name, t in (("child_logprobs", child_logprobs), ("child_tokens", child_tokens), ("features", features),
                    ("embed_weight", embed_weight)):
        check_unit_last_stride(name, t)


def _check_words(words: torch.Tensor, B: int, columns: int, device) -> None:
    """``ancestor_words`` holds the kept children's columns (``columns`` = ``first_row + K + keep``), in its bits."""
    check_tensor("ancestor_words", words, dtype=(torch.int32, torch.int64), ndim=2, device=device)
    bits = 8 * words.element_size()
    if words.shape[0] != B or words.shape[1] < columns or columns > bits or not words.is_contiguous():
        raise ValueError(f"ancestor_words must be contiguous [B={B}, >= first_row + K + keep = {columns}] with "
                         f"first_row + K + keep <= {bits} (its dtype's bits), got {words.dtype} of shape "
                         f"{tuple(words.shape)} and strides {words.stride()}")


def _check_tokens(child_tokens: torch.Tensor, vocab_size: int) -> None:
    """Every child token indexes a row of ``embed_weight`` (host sync)."""
    bad = (child_tokens < 0) | (child_tokens >= vocab_size)
    if bool(bad.any()):
        b, k, c = (int(v) for v in bad.nonzero()[0])
        raise ValueError(f"child_tokens[{b}, {k}, {c}] = {int(child_tokens[b, k, c])} is outside the embedding's rows "
                         f"[0, {vocab_size})")


def draft_frontier(parent_scores, parent_index, child_logprobs, child_tokens, features, embed_weight, keep: int,
                   first_index: int, first_row: int, *, ancestor_words: Optional[torch.Tensor] = None,
                   validate: bool = True, backend: str = "auto") -> FrontierStep:
    """Candidates, next frontier and next inputs of one EAGLE-2 draft step (module docstring).

    Args:
        parent_scores: float32 ``[B, K]``, the frontier's cumulative log-probabilities.
        parent_index: int64 ``[B, K]``, the frontier nodes' candidate indices (any strides).
        child_logprobs: float32 ``[B, K, C]``, each node's children's log-probabilities; unit last stride.
        child_tokens: int64 ``[B, K, C]``, their tokens (rows of ``embed_weight``); unit last stride.
        features: ``[B, K, H]`` fp32 / bf16 / fp16, each node's predicted feature; unit last stride.
        embed_weight: ``[V, H]`` fp32 / bf16 / fp16, the token embeddings (cast to ``features``' dtype).
        keep: ``0 <= keep <= K * C`` children to keep (0: the draft's last depth, no next frontier).
        first_index: candidate index of child 0 (the kept children's ``cand_index`` is ``first_index`` + child).
        first_row: row of parent 0 among the expanded nodes (``parent_rows`` is ``first_row`` + parent).
        ancestor_words: int32 / int64 ``[B, W]``, contiguous, the expanded nodes' ancestor sets as words of bits
            (column r: node r's word; bit j set: node j is node r or one of its ancestors), or None. Given, the kept
            child ``p`` (the expanded node ``first_row + K + p`` once the next step runs) gets its word written in
            place: its parent's word (column ``first_row + parent``) with its own bit. Needs ``first_row + K + keep
            <= min(W, bits of the dtype)``. What a draft's attention mask over its forest reads, with no gather and
            no bitwise op of its own per depth.
        validate: check that every child token is a row of ``embed_weight`` (host sync; skipped under CUDA-graph
            capture).
        backend: ``"auto"``, ``"torch"`` or ``"triton"``.

    Returns:
        :class:`FrontierStep`, new contiguous tensors.
    """
    _check_shapes(parent_scores, parent_index, child_logprobs, child_tokens, features, embed_weight)
    B, K, C = child_logprobs.shape
    check_int("keep", keep, 0)
    if keep > K * C:
        raise ValueError(f"keep must be <= the number of children K * C = {K * C}, got {keep}")
    check_int("first_index", first_index, 0)
    check_int("first_row", first_row, 0)
    if ancestor_words is not None:
        _check_words(ancestor_words, B, first_row + K + keep, child_logprobs.device)
    if validate and not capturing(child_tokens.device):
        _check_tokens(child_tokens, embed_weight.shape[0])
    fits = K * C <= TRITON_MAX_CHILDREN and keep <= TRITON_MAX_KEEP
    if backend == "auto" and not fits:
        backend = "torch"
    name, fn = _DRAFT_FRONTIER.resolve(backend, child_logprobs.device)
    if name == "triton" and not fits:
        raise BackendUnavailableError(f"draft_frontier: the triton backend takes K * C <= {TRITON_MAX_CHILDREN} and "
                                      f"keep <= {TRITON_MAX_KEEP}, got K * C = {K * C}, keep = {keep}")
    return FrontierStep(*fn(parent_scores, parent_index, child_logprobs, child_tokens, features, embed_weight, keep,
                            first_index, first_row, ancestor_words))
