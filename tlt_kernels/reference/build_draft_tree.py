"""Reference EAGLE-2-style draft-tree selection (pure torch, CPU and GPU).

The drafter expands a candidate list per request; this keeps the ``num_verify - 1`` best candidates
(ancestor-closed) and lays them out as a token tree in the format of :mod:`tlt_kernels.tree`.

Selection is *greedy frontier selection*: repeatedly take the best-scoring candidate whose parent is
the root or already taken (ties -> lower candidate index), until ``num_verify - 1`` are taken or no
usable candidate is eligible. Because cumulative log-probabilities never increase along a path, this
equals plain top-k on the scores; defining it on the frontier keeps the result ancestor-closed for
any scores.
"""
from __future__ import annotations

import torch

from ..tree import tree_ancestor_mask_packed


def empty_draft_tree_outputs(cand_scores: torch.Tensor, num_verify: int, return_mask: bool):
    """Uninitialized kernel outputs on ``cand_scores``' device (also the fake-tensor shapes):
    ``parents int32 [B, V]``, ``draft_tokens int64 [B, V]``, ``cand_index int32 [B, V]``,
    ``num_nodes int32 [B]``, ``tree_mask int32 [B, V or 0, ceil(V/32)]`` with V = num_verify."""
    B, V = cand_scores.shape[0], num_verify
    new = cand_scores.new_empty
    return (new(B, V, dtype=torch.int32), new(B, V, dtype=torch.int64), new(B, V, dtype=torch.int32),
            new(B, dtype=torch.int32), new(B, V if return_mask else 0, (V + 31) // 32, dtype=torch.int32))


def select_candidates(cand_parents: torch.Tensor, cand_scores: torch.Tensor, num_select: int) -> torch.Tensor:
    """``bool [B, N]``: which candidates greedy frontier selection keeps (at most ``num_select``)."""
    B, N = cand_scores.shape
    dev = cand_scores.device
    par = cand_parents.to(torch.int64)
    # Column N is a sentinel for the root: always "taken", so root children are eligible at once.
    par = torch.where(par < 0, torch.full_like(par, N), par)
    taken = torch.zeros(B, N + 1, dtype=torch.bool, device=dev)
    taken[:, N] = True
    usable = ~torch.isneginf(cand_scores)
    neg_inf = torch.full_like(cand_scores, float("-inf"))
    rows = torch.arange(B, device=dev)
    for _ in range(min(num_select, N)):
        eligible = usable & ~taken[:, :N] & taken.gather(1, par)
        # argmax returns the first maximal index: ties go to the lower candidate index.
        best = torch.where(eligible, cand_scores, neg_inf).argmax(dim=1)
        found = eligible.any(dim=1)
        taken[rows, best] |= found
    return taken[:, :N]


def build_draft_tree(
    cand_parents: torch.Tensor,
    cand_tokens: torch.Tensor,
    cand_scores: torch.Tensor,
    num_verify: int,
    root_tokens: torch.Tensor,
    return_mask: bool = False,
):
    """See :func:`tlt_kernels.build_draft_tree`; returns ``(parents, draft_tokens, cand_index, num_nodes, tree_mask | None)``.

    Padding nodes (index >= ``num_nodes[b]``) hold parent 0, token 0 and cand_index -1.
    """
    B, N = cand_scores.shape
    dev = cand_scores.device
    V = num_verify
    kept = select_candidates(cand_parents, cand_scores, V - 1)
    # Kept candidates become nodes 1.. in candidate-index order (topological, as parent < child).
    node_of = torch.cumsum(kept.to(torch.int64), dim=1) * kept  # 0 for candidates not kept
    num_nodes = (1 + kept.sum(dim=1)).to(torch.int32)

    par = cand_parents.to(torch.int64)
    par_node = torch.where(par < 0, torch.zeros_like(par), node_of.gather(1, par.clamp(min=0)))
    # Scatter into V + 1 columns; column V swallows the candidates that were not kept.
    dst = torch.where(kept, node_of, torch.full_like(node_of, V))
    parents = torch.zeros(B, V + 1, dtype=torch.int64, device=dev).scatter_(1, dst, par_node)
    tokens = torch.zeros(B, V + 1, dtype=torch.int64, device=dev).scatter_(1, dst, cand_tokens.to(torch.int64))
    cand_idx = torch.arange(N, device=dev).expand(B, N)
    cand_index = torch.full((B, V + 1), -1, dtype=torch.int64, device=dev).scatter_(1, dst, cand_idx)
    parents, tokens, cand_index = parents[:, :V], tokens[:, :V], cand_index[:, :V]
    parents[:, 0] = -1
    tokens[:, 0] = root_tokens.to(torch.int64)
    cand_index[:, 0] = -1
    parents = parents.to(torch.int32)
    mask = tree_ancestor_mask_packed(parents, num_nodes) if return_mask else None
    return parents, tokens, cand_index.to(torch.int32), num_nodes, mask
