"""Tree attention, pure torch: the contract every backend is tested against.

Request ``b`` has ``C = context_lens[b]`` tokens in its paged cache, followed by its ``n = num_nodes[b]``
draft-tree nodes at logical slots ``C .. C+n-1``. Logical slot ``s`` lives at
``cache[block_table[b, s // block_size], s % block_size]``. Query node ``i`` attends to

    every context slot ``0 .. C-1``  and  tree slot ``C + j`` iff node j is node i or an ancestor of i,

i.e. ``out[b, i, h] = softmax(q[b, i, h] . K^T * sm_scale + mask) V`` over those slots, with query head
``h`` reading KV head ``h // (Hq // Hkv)`` (GQA). Rows ``i >= n`` are zeros.

Two implementations:

* :func:`tree_attention_reference` -- a per-request loop (host reads, any device); the ground truth.
* :func:`run_torch` -- the ``torch`` backend of a :class:`~tlt_kernels.ops.tree_attention.TreeAttentionPlan`:
  the same math batched over a padded context of ``num_splits * split_len`` slots, with no host
  synchronization (so it can be captured in a CUDA graph). It materializes fp32 K/V of that size.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from ..tree import resolve_num_nodes, tree_ancestor_mask, unpack_tree_mask


def _gather_slots(cache: torch.Tensor, block_table_row: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``cache[num_blocks, block_size, H, D]`` at logical ``slots [L]`` of one request -> ``[L, H, D]``."""
    block_size = cache.shape[1]
    pages = block_table_row.long()[slots // block_size]
    return cache[pages, slots % block_size]


def gather_request_kv(k_cache, v_cache, block_table, b: int, length: int):
    """K and V of logical slots ``0 .. length-1`` of request ``b`` as ``[length, Hkv, D]`` (cache dtype)."""
    slots = torch.arange(length, device=k_cache.device)
    return _gather_slots(k_cache, block_table[b], slots), _gather_slots(v_cache, block_table[b], slots)


def request_mask(parents_row: torch.Tensor, context_len: int, num_nodes: int) -> torch.Tensor:
    """``bool [n, C + n]``: which of the request's slots each of its ``n`` nodes attends to."""
    anc = tree_ancestor_mask(parents_row[None, :num_nodes])[0]
    ctx = torch.ones(num_nodes, context_len, dtype=torch.bool, device=parents_row.device)
    return torch.cat([ctx, anc], dim=1)


def tree_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    parents: torch.Tensor,
    num_nodes: Optional[torch.Tensor] = None,
    sm_scale: Optional[float] = None,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """Reference tree attention (fp32 math).

    Args:
        q: ``[B, T, Hq, D]`` queries of the tree nodes.
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]`` paged caches, tree K/V already written.
        block_table: ``int32 [B, max_blocks]``; context_lens: ``int32 [B]``.
        parents: ``int32 [B, T]`` (see :mod:`tlt_kernels.tree`); num_nodes: ``int32 [B]`` or None (= T).
        sm_scale: softmax scale, default ``1 / sqrt(D)``.
        out_dtype: dtype of the result, default ``q.dtype`` (pass ``torch.float32`` for the unrounded result).

    Returns:
        ``[B, T, Hq, D]``; rows at or past ``num_nodes[b]`` are zeros.
    """
    B, T, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    G = Hq // Hkv
    scale = 1.0 / math.sqrt(D) if sm_scale is None else float(sm_scale)
    n_all = resolve_num_nodes(parents, num_nodes).tolist()
    ctx_all = context_lens.tolist()
    out = torch.zeros(B, T, Hq, D, dtype=torch.float32, device=q.device)
    for b in range(B):
        C, n = int(ctx_all[b]), int(n_all[b])
        k, v = gather_request_kv(k_cache, v_cache, block_table, b, C + n)
        k = k.float().repeat_interleave(G, dim=1)  # [C+n, Hq, D]
        v = v.float().repeat_interleave(G, dim=1)
        scores = torch.einsum("ihd,shd->his", q[b, :n].float(), k) * scale  # [Hq, n, C+n]
        mask = request_mask(parents[b], C, n)
        scores = scores.masked_fill(~mask, float("-inf"))
        out[b, :n] = torch.einsum("his,shd->ihd", scores.softmax(dim=-1), v)
    return out.to(q.dtype if out_dtype is None else out_dtype)


def run_torch(plan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """``torch`` backend of a tree-attention plan (shapes as in ``TreeAttentionPlan``); writes and returns ``out``.

    No host synchronization: the context is padded to ``plan.num_splits * plan.split_len`` slots and
    masked by ``plan.context_lens``; block-table entries past a request's used range are clamped
    before the gather (they may hold anything) and masked out; K/V of unused slots are zeroed, so NaN
    or garbage in freed pages never reaches the output.
    """
    B, T, Hq, D = q.shape
    Hkv, G, bs = plan.num_kv_heads, plan.group, plan.block_size
    dev = q.device
    L = plan.num_splits * plan.split_len
    ctx = plan.context_lens.long()
    table = plan.block_table.long()
    max_blocks = table.shape[1]

    # Logical slots: padded context 0..L-1, then the tree at ctx + j.
    ctx_slots = torch.arange(L, device=dev).expand(B, L)
    tree_slots = ctx[:, None] + torch.arange(T, device=dev)
    slots = torch.cat([ctx_slots, tree_slots], dim=1)  # [B, L+T]
    cols = torch.arange(L + T, device=dev)
    pages = table.gather(1, (slots // bs).clamp(max=max_blocks - 1)).clamp(0, k_cache.shape[0] - 1)
    flat = pages * bs + slots % bs
    k = k_cache.reshape(-1, Hkv, D)[flat].float()  # [B, L+T, Hkv, D]
    v = v_cache.reshape(-1, Hkv, D)[flat].float()

    ctx_ok = (cols[None, :] < ctx[:, None]) & (cols[None, :] < L)  # [B, L+T]
    node_ok = torch.arange(T, device=dev)[None, :] < plan.num_nodes.long()[:, None]  # [B, T]
    # Unused slots (freed pages, padding nodes) may hold anything, NaN included: a zero softmax weight
    # times a NaN V is still NaN, so zero their K/V before the matmuls instead of only masking scores.
    slot_ok = torch.cat([ctx_ok[:, :L], node_ok], dim=1)[:, :, None, None]  # [B, L+T, 1, 1]
    k = torch.where(slot_ok, k, 0.0)
    v = torch.where(slot_ok, v, 0.0)
    tree_ok = unpack_tree_mask(plan.tree_mask, T)  # [B, T, T]
    mask = torch.cat([ctx_ok[:, None, :L].expand(B, T, L), tree_ok], dim=2)  # [B, T, L+T]

    qf = q.float().view(B, T, Hkv, G, D)
    scores = torch.einsum("btkgd,bskd->bkgts", qf, k) * sm_scale  # [B, Hkv, G, T, L+T]
    scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
    # Padding rows are fully masked: softmax gives NaN there, replaced by the contract's zeros.
    p = torch.nan_to_num(scores.softmax(dim=-1), nan=0.0)
    o = torch.einsum("bkgts,bskd->btkgd", p, v).reshape(B, T, Hq, D)
    out.copy_(torch.where(node_ok[:, :, None, None], o, torch.zeros((), device=dev)).to(out.dtype))
    return out
