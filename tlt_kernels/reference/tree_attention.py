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

NaN: a NaN in the K or V of a slot a row attends reaches that row, as in plain attention; slots a row does not
attend (past ``context_lens``, padding nodes' slots, other requests' pages, the tree slots of non-ancestors) never
reach it, whatever they hold.
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
        ``[B, T, Hq, D]``; rows at or past ``num_nodes[b]`` are zeros. A NaN in a slot a row attends reaches that row
        (as in plain attention); slots a row does not attend never do.
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
        if n == 0:
            continue
        k, v = gather_request_kv(k_cache, v_cache, block_table, b, C + n)
        k = k.float().repeat_interleave(G, dim=1)  # [C+n, Hq, D]
        v = v.float().repeat_interleave(G, dim=1)
        anc = tree_ancestor_mask(parents[b : b + 1, :n])[0]
        out[b, :n] = _attend_request(q[b, :n].float(), k, v, anc, scale)
    return out.to(q.dtype if out_dtype is None else out_dtype)


def _attend_request(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, anc: torch.Tensor, scale: float) -> torch.Tensor:
    """One request: ``q [n, Hq, D]``, ``k, v [C + n, Hq, D]`` (context slots, then the tree's), ``anc bool [n, n]``.

    Plain attention of each node over exactly the slots it sees. The tree part's P V is summed per row over that row's
    slots only: a shared product would multiply the V of a slot a row does not see by a zero weight, and 0 * NaN = NaN.
    """
    n = q.shape[0]
    C = k.shape[0] - n
    visible = torch.cat([anc.new_ones(n, C), anc], dim=1)
    scores = torch.einsum("ihd,shd->his", q, k) * scale  # [Hq, n, C+n]
    p = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
    o = torch.einsum("his,shd->ihd", p[..., :C], v[:C])
    tree = p[..., C:, None] * v[C:].transpose(0, 1)[:, None]  # [Hq, n (row), n (slot), D]
    return o + torch.where(anc[None, :, :, None], tree, 0.0).sum(dim=2).transpose(0, 1)


def run_torch(plan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor, sm_scale: float,
              v_scale: float = 1.0) -> torch.Tensor:
    """``torch`` backend of a tree-attention plan (shapes as in ``TreeAttentionPlan``); writes and returns ``out``.

    Caches of any float dtype (fp8 included) are read in fp32; ``v_scale`` multiplies V (a cache's dequantization
    scale; K's is folded into ``sm_scale`` by the op).

    No host synchronization: the context is padded to ``plan.num_splits * plan.split_len`` slots and masked by
    ``plan.context_lens``. Unused slots (past the context, padding nodes, pages of other requests) may hold anything,
    NaN included, and never reach the output; a NaN in a slot a row attends reaches that row. A used slot whose page id
    is out of range (a table nobody could check, see ``ops.tree_attention``) is never read: its request's rows are NaN.
    """
    B, T, Hq, D = q.shape
    Hkv, G = plan.num_kv_heads, plan.group
    dev = q.device
    L = plan.num_splits * plan.split_len
    ctx = plan.context_lens.long()
    node_ok = torch.arange(T, device=dev)[None, :] < plan.num_nodes.long()[:, None]  # [B, T]
    ctx_ok = torch.arange(L, device=dev)[None, :] < ctx[:, None]  # [B, L]
    # Logical slots: padded context 0..L-1, then the tree at ctx + j.
    slots = torch.cat([torch.arange(L, device=dev).expand(B, L), ctx[:, None] + torch.arange(T, device=dev)], dim=1)
    k, v, bad_request = _gather_used_slots(plan, k_cache, v_cache, slots, torch.cat([ctx_ok, node_ok], dim=1))
    v = v * v_scale
    tree_ok = unpack_tree_mask(plan.tree_mask, T)  # [B, T, T]
    mask = torch.cat([ctx_ok[:, None, :].expand(B, T, L), tree_ok], dim=2)  # [B, T, L+T]

    qf = q.float().reshape(B, T, Hkv, G, D)
    scores = torch.einsum("btkgd,bskd->bkgts", qf, k) * sm_scale  # [B, Hkv, G, T, L+T]
    # A padding row of a request without context sees nothing: softmax gives NaN there, zeroed at the end.
    p = scores.masked_fill(~mask[:, None, None], float("-inf")).softmax(dim=-1)
    o = torch.einsum("bkgts,bskd->btkgd", p[..., :L], v[:, :L]) + _tree_pv(p[..., L:], v[:, L:], tree_ok)
    o = torch.where(bad_request[:, None, None, None], float("nan"), o.reshape(B, T, Hq, D))
    out.copy_(torch.where(node_ok[:, :, None, None], o, 0.0).to(out.dtype))
    return out


def _gather_used_slots(plan, k_cache, v_cache, slots, slot_ok):
    """fp32 K and V ``[B, S, Hkv, D]`` of each request's logical ``slots [B, S]``, zeros where ``slot_ok`` is False
    (those may hold anything), and ``bad [B]``: a used slot lies past the table or its page id is outside
    ``[0, num_blocks)``. Such slots read page 0 instead, so no index is ever out of bounds."""
    bs = plan.block_size
    num_blocks = min(k_cache.shape[0], v_cache.shape[0])
    # One extra column of -1: slots past the table's width land on it and count as out of range.
    table = torch.nn.functional.pad(plan.block_table.long(), (0, 1), value=-1)
    pages = table.gather(1, (slots // bs).clamp(max=table.shape[1] - 1))
    page_ok = (pages >= 0) & (pages < num_blocks)
    pages = torch.where(page_ok, pages, 0)
    keep = slot_ok[:, :, None, None]
    k = torch.where(keep, k_cache[pages, slots % bs].float(), 0.0)
    v = torch.where(keep, v_cache[pages, slots % bs].float(), 0.0)
    return k, v, (slot_ok & ~page_ok).any(dim=1)


def _tree_pv(p: torch.Tensor, v: torch.Tensor, tree_ok: torch.Tensor) -> torch.Tensor:
    """P V of the tree slots, each row over the slots it sees: ``p [B, Hkv, G, T, T]``, ``v [B, T, Hkv, D]``, ``tree_ok
    bool [B, T, T]`` -> ``[B, T, Hkv, G, D]``. Rows see different slots, and a shared product would multiply a slot's
    V by the zero weight of rows that do not see it (0 * NaN = NaN). So the product runs on V with its non-finite
    entries zeroed; then a column of a row that sees an inf there gets that inf, and one that sees a NaN gets NaN."""
    finite = v.isfinite()
    o = torch.einsum("bkgtj,bjkd->btkgd", p, torch.where(finite, v, 0.0))
    sees = tree_ok.float()

    def seen(flags):  # [B, T, Hkv, 1, D]: a slot the row sees has the flag in this column
        return (torch.einsum("btj,bjkd->btkd", sees, flags.float()) > 0)[:, :, :, None]

    o = o + torch.where(seen(v == math.inf), math.inf, 0.0) + torch.where(seen(v == -math.inf), -math.inf, 0.0)
    return torch.where(seen(v.isnan()), math.nan, o)
