"""Triton EAGLE-2 draft-tree selection: one program per request, tree and packed mask in one launch.

The candidate vector (N <= a few thousand) lives in registers. Greedy frontier selection runs as
``num_verify - 1`` rounds of one max-reduction over packed (score, index) keys of the eligible
candidates; eligibility is maintained
incrementally (taking candidate c makes its children eligible: ``elig |= parent == c``), so no
gather is needed inside the loop. Then:

* node ids: kept candidates in index order, ``node = inclusive cumsum(kept)``;
* parent node of a kept candidate: ``node[parent]`` via an in-register gather;
* ancestor mask: every kept candidate walks up its parent chain (all candidates in lockstep, as many
  rounds as the deepest path), OR-ing ``1 << (node % 32)`` into word ``node // 32`` of its row.
Every output element (nodes, padding and root) is written exactly once.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ..reference.build_draft_tree import empty_draft_tree_outputs


@triton.jit
def _candidate_keys(CandParents_ptr, CandScores_ptr, b, stride_cp, stride_cs, c, N, BLOCK_N: tl.constexpr):
    """Request b's candidate parents, which candidates are usable (in range, score > -inf), and their int64
    selection keys."""
    in_range = c < N
    par = tl.load(CandParents_ptr + b * stride_cp + c, mask=in_range, other=-1)
    score = tl.load(CandScores_ptr + b * stride_cs + c, mask=in_range, other=float("-inf")).to(tl.float32)
    usable = in_range & (score != float("-inf"))

    # One int64 max per round finds the best score *and* breaks ties to the lowest index: the key is
    # (order-preserving int32 image of the score) << 32 | (BLOCK_N - 1 - c). Flipping the magnitude
    # bits of negative floats makes their signed-int order match the float order.
    score = tl.where(score == 0.0, 0.0, score)  # -0.0 ties with +0.0 as floats; make the bits agree
    bits = score.to(tl.int32, bitcast=True)
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    key = (ordered.to(tl.int64) << 32) | (BLOCK_N - 1 - c).to(tl.int64)
    return par, usable, key


@triton.jit
def _select_frontier(key, par, usable, c, V, BLOCK_N: tl.constexpr):
    """Greedy frontier selection: ``V - 1`` rounds, each taking the eligible candidate of the largest key
    (eligible: a root child, or a child of a taken candidate). Returns which candidates were taken."""
    NO_KEY: tl.constexpr = -9223372036854775808
    elig = usable & (par == -1)
    taken = c < 0
    # A while loop rather than range(V - 1): the CPU interpreter cannot take a runtime range bound.
    step = 0
    while step < V - 1:
        step += 1
        k_max = tl.max(tl.where(elig & (taken == 0), key, NO_KEY), axis=0)
        found = k_max != NO_KEY  # eligible scores are > -inf, so their keys are > NO_KEY
        best = (BLOCK_N - 1 - (k_max & 0xFFFFFFFF)).to(tl.int32)
        taken = taken | (found & (c == best))
        elig = elig | (found & usable & (par == best))
    return taken


@triton.jit
def _tree_nodes(taken, par):
    """Node ids (1-based, in candidate order; 0 for candidates not kept), the parent node of each candidate,
    and the node count (root included)."""
    kept = taken.to(tl.int32)
    node = tl.cumsum(kept, axis=0) * kept  # node id (1-based) of kept candidates, else 0
    par_safe = tl.maximum(par, 0)
    par_node = tl.where(par < 0, 0, tl.gather(node, par_safe, axis=0))
    num_nodes = 1 + tl.sum(kept, axis=0)
    return node, par_node, num_nodes


@triton.jit
def _store_tree(CandTokens_ptr, RootTokens_ptr, Parents_ptr, Tokens_ptr, CandIndex_ptr, NumNodes_ptr, b, stride_ct,
                stride_p, stride_t, stride_ci, c, taken, node, par_node, num_nodes, V, V_POW2: tl.constexpr):
    """Write request b's nodes, then its root and padding (positions no kept candidate owns) and node count.
    Returns the positions ``p`` and which of them were filled as root or padding."""
    out = b * stride_p
    tok = tl.load(CandTokens_ptr + b * stride_ct + c, mask=taken, other=0)
    tl.store(Parents_ptr + out + node, par_node, mask=taken)
    tl.store(Tokens_ptr + b * stride_t + node, tok, mask=taken)
    tl.store(CandIndex_ptr + b * stride_ci + node, c, mask=taken)
    # Root and padding (positions not owned by a kept candidate).
    p = tl.arange(0, V_POW2)
    fill = (p < V) & ((p == 0) | (p >= num_nodes))
    root_tok = tl.load(RootTokens_ptr + b)
    tl.store(Parents_ptr + out + p, tl.where(p == 0, -1, 0), mask=fill)
    tl.store(Tokens_ptr + b * stride_t + p, tl.where(p == 0, root_tok, 0), mask=fill)
    tl.store(CandIndex_ptr + b * stride_ci + p, tl.full([V_POW2], -1, tl.int32), mask=fill)
    tl.store(NumNodes_ptr + b, num_nodes)
    return p, fill


@triton.jit
def _store_ancestor_mask(Mask_ptr, b, stride_mb, stride_mr, c, taken, node, par, num_nodes, p, fill,
                         BLOCK_N: tl.constexpr, WORDS: tl.constexpr, WORDS_POW2: tl.constexpr):
    """Write request b's packed ancestor mask: a kept candidate's row has its own bit, its ancestors' and the
    root's; the root row only bit 0; padding rows zero."""
    w = tl.arange(0, WORDS_POW2)
    one = tl.full([BLOCK_N, WORDS_POW2], 1, tl.int32)
    # Row of candidate c: itself, its ancestors, and the root (bit 0 of word 0).
    row_bits = tl.where(w[None, :] == 0, one, 0)
    cur = tl.where(taken, c, -1)
    walking = num_nodes > 1
    while walking:  # as many rounds as the deepest path is long
        on = cur >= 0
        cur_node = tl.gather(node, tl.maximum(cur, 0), axis=0)
        bit = one << (cur_node % 32)[:, None]
        row_bits = row_bits | tl.where(on[:, None] & (w[None, :] == (cur_node // 32)[:, None]), bit, 0)
        cur = tl.where(on, tl.gather(par, tl.maximum(cur, 0), axis=0), -1)
        walking = tl.max(cur, axis=0) >= 0
    mrow = Mask_ptr + b * stride_mb
    m_ok = taken[:, None] & (w[None, :] < WORDS)
    tl.store(mrow + node[:, None].to(tl.int64) * stride_mr + w[None, :], row_bits, mask=m_ok)
    # Root row: only bit 0; padding rows: zero.
    root_row = tl.where(w[None, :] == 0, tl.where(p[:, None] == 0, 1, 0), 0)
    p_ok = fill[:, None] & (w[None, :] < WORDS)
    tl.store(mrow + p[:, None].to(tl.int64) * stride_mr + w[None, :], root_row.to(tl.int32), mask=p_ok)


@triton.jit
def _build_draft_tree_kernel(
    CandParents_ptr, CandTokens_ptr, CandScores_ptr, RootTokens_ptr,
    Parents_ptr, Tokens_ptr, CandIndex_ptr, NumNodes_ptr, Mask_ptr,
    N, V,
    stride_cp, stride_ct, stride_cs, stride_p, stride_t, stride_ci, stride_mb, stride_mr,
    BLOCK_N: tl.constexpr, V_POW2: tl.constexpr, WORDS: tl.constexpr, WORDS_POW2: tl.constexpr, WRITE_MASK: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_N)
    par, usable, key = _candidate_keys(CandParents_ptr, CandScores_ptr, b, stride_cp, stride_cs, c, N, BLOCK_N)
    taken = _select_frontier(key, par, usable, c, V, BLOCK_N)
    node, par_node, num_nodes = _tree_nodes(taken, par)
    p, fill = _store_tree(CandTokens_ptr, RootTokens_ptr, Parents_ptr, Tokens_ptr, CandIndex_ptr, NumNodes_ptr, b,
                          stride_ct, stride_p, stride_t, stride_ci, c, taken, node, par_node, num_nodes, V, V_POW2)
    if WRITE_MASK:
        _store_ancestor_mask(Mask_ptr, b, stride_mb, stride_mr, c, taken, node, par, num_nodes, p, fill, BLOCK_N, WORDS,
                             WORDS_POW2)


def build_draft_tree_out(cand_parents, cand_tokens, cand_scores, root_tokens, parents, draft_tokens, cand_index, num_nodes, tree_mask: Optional[torch.Tensor] = None) -> None:
    """Write the tree into preallocated ``parents/draft_tokens/cand_index [B, V]``, ``num_nodes [B]``
    and optionally ``tree_mask int32 [B, V, ceil(V/32)]`` (inputs as in :func:`build_draft_tree`)."""
    B, N = cand_scores.shape
    V = parents.shape[1]
    words = (V + 31) // 32
    mask_arg = tree_mask if tree_mask is not None else parents  # never touched when WRITE_MASK=False
    _build_draft_tree_kernel[(B,)](
        cand_parents, cand_tokens, cand_scores, root_tokens, parents, draft_tokens, cand_index, num_nodes, mask_arg,
        N, V,
        cand_parents.stride(0), cand_tokens.stride(0), cand_scores.stride(0), parents.stride(0), draft_tokens.stride(0),
        cand_index.stride(0), tree_mask.stride(0) if tree_mask is not None else 0, tree_mask.stride(1) if tree_mask is not None else 0,
        BLOCK_N=max(16, triton.next_power_of_2(N)), V_POW2=triton.next_power_of_2(V), WORDS=words,
        WORDS_POW2=triton.next_power_of_2(words), WRITE_MASK=tree_mask is not None,
        num_warps=4 if N <= 256 else 8,
    )


@torch.library.custom_op("tlt::build_draft_tree", mutates_args=())
def _build_draft_tree_op(
    cand_parents: torch.Tensor, cand_tokens: torch.Tensor, cand_scores: torch.Tensor, num_verify: int, root_tokens: torch.Tensor, return_mask: bool
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    parents, tokens, cand_index, num_nodes, mask = empty_draft_tree_outputs(cand_scores, num_verify, return_mask)
    build_draft_tree_out(cand_parents, cand_tokens, cand_scores, root_tokens, parents, tokens, cand_index, num_nodes, mask if return_mask else None)
    return parents, tokens, cand_index, num_nodes, mask


@_build_draft_tree_op.register_fake
def _(cand_parents, cand_tokens, cand_scores, num_verify, root_tokens, return_mask):
    return empty_draft_tree_outputs(cand_scores, num_verify, return_mask)


def build_draft_tree(cand_parents, cand_tokens, cand_scores, num_verify, root_tokens, return_mask=False):
    parents, tokens, cand_index, num_nodes, mask = _build_draft_tree_op(cand_parents, cand_tokens, cand_scores, num_verify, root_tokens, return_mask)
    return parents, tokens, cand_index, num_nodes, (mask if return_mask else None)
