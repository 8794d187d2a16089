"""``build_draft_tree``: EAGLE-2-style selection of the draft-tree nodes to verify."""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .._backend import register_op
from .._validation import capturing, check_tensor, dense


class DraftTree(NamedTuple):
    parents: torch.Tensor  # int32 [B, V], tlt_kernels.tree format
    draft_tokens: torch.Tensor  # int64 [B, V]; node 0 = root token
    cand_index: torch.Tensor  # int32 [B, V]; candidate of each node, -1 for the root and padding
    num_nodes: torch.Tensor  # int32 [B]
    tree_mask: Optional[torch.Tensor] = None  # int32 [B, V, ceil(V/32)] when return_mask=True


_BUILD = register_op(
    "build_draft_tree",
    {
        "torch": "tlt_kernels.reference.build_draft_tree:build_draft_tree",
        "triton": "tlt_kernels._triton.build_draft_tree:build_draft_tree",
        "cuda": "tlt_kernels._cuda.build_draft_tree:build_draft_tree",
    },
    # CUDA first: faster than Triton on every tree-building case (docs/CUDA_NOTES.md, "Backend order").
    preference=("cuda", "triton", "torch"),
)


def _validate_candidates(cand_parents: torch.Tensor, cand_scores: torch.Tensor) -> None:
    """Value checks (host sync): parents in ``[-1, own index)``, no NaN scores."""
    B, N = cand_parents.shape
    par = cand_parents.cpu().to(torch.int64)
    idx = torch.arange(N)
    bad = (par < -1) | (par >= idx)
    if bad.any():
        b, c = (int(v) for v in bad.nonzero()[0])
        raise ValueError(
            f"cand_parents[{b}, {c}] = {int(par[b, c])}: a candidate's parent must be -1 (the root) or an "
            f"earlier candidate index in [0, {c}) (candidates must be in topological order)"
        )
    nan = torch.isnan(cand_scores).cpu()
    if nan.any():
        b, c = (int(v) for v in nan.nonzero()[0])
        raise ValueError(f"cand_scores[{b}, {c}] is NaN; use -inf to mark an unusable candidate")


def build_draft_tree(
    cand_parents,
    cand_tokens,
    cand_scores,
    num_verify: int,
    root_tokens,
    return_mask: bool = False,
    validate: bool = True,
    backend: str = "auto",
) -> DraftTree:
    """Keep the ``num_verify - 1`` best draft candidates, ancestor-closed, as a token tree.

    Greedy frontier selection: repeatedly take the best-scoring usable candidate whose parent is the
    root or already taken (ties -> lower candidate index). With cumulative log-probabilities (never
    increasing along a path) this is plain top-(num_verify-1); for any scores it stays
    ancestor-closed. Node 0 is the root; nodes 1.. are the kept candidates in candidate-index order
    (topological, since a parent's index is smaller than its child's).

    Args:
        cand_parents: ``int32 [B, N]``, parent's candidate index, ``-1`` = child of the root; must be
            ``< `` the candidate's own index.
        cand_tokens: ``int64 [B, N]`` candidate tokens.
        cand_scores: ``float32 [B, N]`` cumulative log-probabilities; ``-inf`` = unusable/padding
            (its descendants are unusable too); NaN is an error.
        num_verify: tree size ``V >= 1`` (root included).
        root_tokens: ``int64 [B]``, token of each root (the last accepted token).
        return_mask: also return the bit-packed ancestor mask (see :func:`tlt_kernels.pack_tree_mask`).
        validate: check the values of ``cand_parents``/``cand_scores`` (host sync; skipped under
            CUDA-graph capture).
        backend: ``"auto"``, ``"torch"``, ``"triton"`` or ``"cuda"`` (``N <= 2048``).

    Returns:
        :class:`DraftTree` ``(parents int32 [B, V], draft_tokens int64 [B, V], cand_index int32 [B, V],
        num_nodes int32 [B], tree_mask int32 [B, V, ceil(V/32)] or None)``. When fewer than ``V - 1``
        candidates are usable, ``num_nodes[b] < V`` and the padding nodes hold parent 0, token 0,
        cand_index -1 and an all-zero mask row (valid as a tree; ignored via ``num_nodes``).
    """
    check_tensor("cand_scores", cand_scores, dtype=torch.float32, ndim=2)
    B, N = cand_scores.shape
    dev = cand_scores.device
    check_tensor("cand_parents", cand_parents, dtype=torch.int32, shape=(B, N), device=dev)
    check_tensor("cand_tokens", cand_tokens, dtype=torch.int64, shape=(B, N), device=dev)
    check_tensor("root_tokens", root_tokens, dtype=torch.int64, shape=(B,), device=dev)
    if isinstance(num_verify, bool) or not isinstance(num_verify, int):
        raise TypeError(f"num_verify must be a Python int, got {type(num_verify).__name__}")
    if num_verify < 1:
        raise ValueError(f"num_verify must be >= 1 (the root counts), got {num_verify}")
    if validate and not capturing(dev):
        _validate_candidates(cand_parents, cand_scores)
    _, fn = _BUILD.resolve(backend, dev)
    parents, tokens, cand_index, num_nodes, mask = fn(
        dense(cand_parents), dense(cand_tokens), dense(cand_scores), num_verify, dense(root_tokens), return_mask)
    return DraftTree(parents, tokens, cand_index, num_nodes, mask)
