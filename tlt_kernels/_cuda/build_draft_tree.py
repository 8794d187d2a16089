"""CUDA backend of :func:`tlt_kernels.build_draft_tree`: tree and packed mask in one ``_C.build_draft_tree`` launch.

One CTA of 128 threads per request holds its candidates in registers (up to 16 each, so
``N <= 2048``). Greedy frontier selection takes ``num_verify - 1`` rounds of one block-wide max over
packed ``(ordered score, ~index)`` keys (best score, ties to the lower index, exactly as the
reference) with one barrier per round; then a block scan numbers the kept candidates and each kept
candidate walks its ancestor chain to write its mask row.
"""
from __future__ import annotations

from typing import Tuple

import torch

from ..reference.build_draft_tree import empty_draft_tree_outputs
from . import extension, ptr, stream_handle

__all__ = ["build_draft_tree", "build_draft_tree_out", "check_inputs", "MAX_CANDIDATES"]

MAX_CANDIDATES = 2048  # _C.BUILD_TREE_MAX_CANDIDATES


def check_inputs(cand_scores: torch.Tensor, num_verify: int) -> None:
    """What the CUDA kernel adds to the op's validation (metadata only; works on CPU tensors)."""
    N = cand_scores.shape[1]
    if N > MAX_CANDIDATES:
        raise ValueError(f"the CUDA build_draft_tree kernel takes up to {MAX_CANDIDATES} candidates per request, got N={N}; "
                         "use backend='triton'")
    if num_verify < 1:
        raise ValueError(f"num_verify must be >= 1, got {num_verify}")


def build_draft_tree_out(cand_parents, cand_tokens, cand_scores, root_tokens, parents, draft_tokens, cand_index,
                         num_nodes, tree_mask=None) -> None:
    """Write the tree into preallocated contiguous ``parents/cand_index int32 [B, V]``, ``draft_tokens int64
    [B, V]``, ``num_nodes int32 [B]`` and optionally ``tree_mask int32 [B, V, ceil(V/32)]``."""
    B, N = cand_scores.shape
    V = parents.shape[1]
    dev = cand_scores.device
    if dev.type != "cuda":
        raise ValueError(f"build_draft_tree (cuda backend) needs CUDA tensors, got {dev}")
    check_inputs(cand_scores, V)
    for name, t in (("parents", parents), ("draft_tokens", draft_tokens), ("cand_index", cand_index),
                    ("num_nodes", num_nodes), ("tree_mask", tree_mask)):
        if t is not None and not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got strides {tuple(t.stride())}")
    if B == 0:
        return
    rowmajor = lambda t: t if t.stride(-1) == 1 else t.contiguous()  # noqa: E731
    cand_parents, cand_tokens, cand_scores = rowmajor(cand_parents), rowmajor(cand_tokens), rowmajor(cand_scores)
    root_tokens = root_tokens.contiguous()
    with torch.cuda.device(dev):
        extension().build_draft_tree(
            cand_parents=ptr(cand_parents), cand_tokens=ptr(cand_tokens), cand_scores=ptr(cand_scores),
            root_tokens=ptr(root_tokens), parents=ptr(parents), draft_tokens=ptr(draft_tokens),
            cand_index=ptr(cand_index), num_nodes=ptr(num_nodes), tree_mask=ptr(tree_mask),
            cp_stride_b=int(cand_parents.stride(0)), ct_stride_b=int(cand_tokens.stride(0)),
            cs_stride_b=int(cand_scores.stride(0)), batch=B, num_cand=N, num_verify=V, stream=stream_handle(dev),
        )


@torch.library.custom_op("tlt::build_draft_tree_cuda", mutates_args=())
def _build_draft_tree_op(
    cand_parents: torch.Tensor, cand_tokens: torch.Tensor, cand_scores: torch.Tensor, num_verify: int,
    root_tokens: torch.Tensor, return_mask: bool,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    parents, tokens, cand_index, num_nodes, mask = empty_draft_tree_outputs(cand_scores, num_verify, return_mask)
    build_draft_tree_out(cand_parents, cand_tokens, cand_scores, root_tokens, parents, tokens, cand_index, num_nodes,
                         mask if return_mask else None)
    return parents, tokens, cand_index, num_nodes, mask


@_build_draft_tree_op.register_fake
def _(cand_parents, cand_tokens, cand_scores, num_verify, root_tokens, return_mask):
    return empty_draft_tree_outputs(cand_scores, num_verify, return_mask)


def build_draft_tree(cand_parents, cand_tokens, cand_scores, num_verify, root_tokens, return_mask=False):
    """CUDA backend of :func:`tlt_kernels.build_draft_tree` (inputs validated by the op): returns
    ``(parents int32 [B, V], draft_tokens int64 [B, V], cand_index int32 [B, V], num_nodes int32 [B],
    tree_mask int32 [B, V, ceil(V/32)] | None)``."""
    parents, tokens, cand_index, num_nodes, mask = _build_draft_tree_op(
        cand_parents, cand_tokens, cand_scores, int(num_verify), root_tokens, bool(return_mask))
    return parents, tokens, cand_index, num_nodes, (mask if return_mask else None)
