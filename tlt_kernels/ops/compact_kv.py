"""``compact_kv``: move the accepted path's K/V to contiguous cache slots, every layer, in place."""
from __future__ import annotations

from typing import List, Sequence, Union

import torch

from .._backend import register_op
from .._validation import capturing, check_tensor, dense

_COMPACT = register_op(
    "compact_kv",
    {
        "torch": "tlt_kernels.reference.compact_kv:compact_kv",
        "triton": "tlt_kernels._triton.compact_kv:compact_kv",
        "cuda": "tlt_kernels._cuda.compact_kv:compact_kv",
    },
    # Triton first: it wins at small batch and CUDA at large (docs/CUDA_NOTES.md, "Backend order"); Triton stays
    # first until a size-aware choice is worth the complexity.
    preference=("triton", "cuda", "torch"),
)

Caches = Union[torch.Tensor, Sequence[torch.Tensor]]
_INT = (torch.int32, torch.int64)


def _as_layers(name: str, caches: Caches) -> List[torch.Tensor]:
    layers = [caches] if isinstance(caches, torch.Tensor) else list(caches)
    if not layers:
        raise ValueError(f"{name} must be a tensor or a non-empty list of tensors (one per layer)")
    first = check_tensor(name if isinstance(caches, torch.Tensor) else f"{name}[0]", layers[0])
    for i, t in enumerate(layers):
        label = name if isinstance(caches, torch.Tensor) else f"{name}[{i}]"
        check_tensor(label, t, ndim=4, shape=tuple(first.shape) if i else None, device=first.device)
        if t.dtype != first.dtype:
            raise TypeError(f"{label} has dtype {t.dtype}, expected {first.dtype} like {name}[0] (all layers share one dtype)")
        if not t.is_contiguous():
            raise ValueError(f"{label} must be contiguous ([num_blocks, block_size, Hkv, D] row-major), got strides {t.stride()}")
    return layers


def _validate_values(block_table, context_lens, accepted_nodes, num_accepted, num_blocks, block_size):
    """Value checks (host sync): the path is valid and every touched slot maps to a real block.

    One host copy, then whole-batch tensor checks (a per-request Python loop cost milliseconds at B in the
    hundreds); the error names the first bad request and, within it, the first failing check in the order
    num_accepted, context_lens, root, increasing path, table capacity, block ids."""
    B, P = accepted_nodes.shape
    W = block_table.shape[1]
    if B == 0:
        return
    host = torch.cat([accepted_nodes.to(torch.int64), num_accepted.to(torch.int64).reshape(B, 1),
                      context_lens.to(torch.int64).reshape(B, 1), block_table.to(torch.int64)], 1).cpu()
    nodes, nacc, ctx, table = host[:, :P], host[:, P], host[:, P + 1], host[:, P + 2:]
    capacity = W * block_size
    col = torch.arange(P)
    n = nacc.clamp(0, P - 1)
    on_path = col.unsqueeze(0) <= n.unsqueeze(1)
    last = nodes.gather(1, n.unsqueeze(1)).squeeze(1)
    # Slots read (ctx + node) then written (ctx + depth) on each path, in the order the checks report them.
    slots = torch.cat([ctx.unsqueeze(1) + nodes, ctx.unsqueeze(1) + col.unsqueeze(0)], 1)
    touched = torch.cat([on_path, on_path], 1)
    pages = table.gather(1, torch.div(slots, block_size, rounding_mode="floor").clamp(0, max(W - 1, 0))) if W else \
        torch.full_like(slots, -1)
    bad_page = touched & ((pages < 0) | (pages >= num_blocks))
    checks = [  # [B] masks, in reporting order
        (nacc < 0) | (nacc >= P),
        ctx < 0,
        nodes[:, 0] != 0,
        (on_path[:, 1:] & (nodes[:, 1:] <= nodes[:, :-1])).any(1),
        ctx + last >= capacity,
        bad_page.any(1),
    ]
    failed = torch.stack(checks, 1)
    if not bool(failed.any()):
        return
    b = int(failed.any(1).nonzero()[0, 0])
    which = int(failed[b].nonzero()[0, 0])
    nb, cb = int(nacc[b]), int(ctx[b])
    if which == 0:
        raise ValueError(f"num_accepted[{b}] = {nb} is outside [0, {P - 1}] (accepted_nodes has {P} columns)")
    if which == 1:
        raise ValueError(f"context_lens[{b}] = {cb} is negative")
    path = nodes[b, : nb + 1]
    if which == 2:
        raise ValueError(f"accepted_nodes[{b}, 0] = {int(path[0])}, expected 0 (the root starts every path)")
    if which == 3:
        raise ValueError(f"accepted_nodes[{b}, :{nb + 1}] = {path.tolist()} must be strictly increasing (a root-to-leaf path in topological order)")
    if which == 4:
        raise ValueError(
            f"request {b}: node {int(path[-1])} sits at slot {cb + int(path[-1])} but block_table holds only "
            f"{capacity} slots ({W} blocks x block_size {block_size})"
        )
    s = int(slots[b][bad_page[b]][0])
    raise ValueError(f"block_table[{b}, {s // block_size}] = {int(table[b, s // block_size])} is outside [0, {num_blocks}) (needed for slot {s})")


def compact_kv(
    k_cache: Caches,
    v_cache: Caches,
    block_table,
    context_lens,
    accepted_nodes,
    num_accepted,
    validate: bool = True,
    backend: str = "auto",
) -> torch.Tensor:
    """Move the K/V of each request's accepted path to contiguous slots, in place, for every layer.

    Node ``i`` of request ``b``'s draft tree sits at slot ``context_lens[b] + i``; slot ``s`` is
    ``cache[block_table[b, s // block_size], s % block_size]``. For ``d = 0..num_accepted[b]`` the
    K/V of ``accepted_nodes[b, d]`` moves from slot ``context_lens[b] + accepted_nodes[b, d]`` to slot
    ``context_lens[b] + d``. All other slots are left untouched.

    Args:
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]`` contiguous tensors, or lists/tuples of
            them (one per layer; all the same shape and dtype).
        block_table: ``int32 [B, max_blocks]`` page ids of each request.
        context_lens: ``int32 [B]`` tokens in the cache before the tree (the root's slot).
        accepted_nodes: ``int32 [B, P]`` accepted path (node 0 first, strictly increasing, -1 padded),
            as returned by :func:`tlt_kernels.verify_tree`.
        num_accepted: ``int32 [B]`` accepted drafts; the path is ``accepted_nodes[b, :num_accepted[b]+1]``.
        validate: check the path and block ids (host sync; skipped under CUDA-graph capture).
        backend: ``"auto"``, ``"torch"``, ``"triton"`` or ``"cuda"``.

    Returns:
        ``int32 [B]`` new context lengths ``context_lens + num_accepted + 1`` (root and accepted drafts
        are now cached; the final sampled token becomes the next root).
    """
    ks = _as_layers("k_cache", k_cache)
    vs = _as_layers("v_cache", v_cache)
    if len(ks) != len(vs):
        raise ValueError(f"k_cache has {len(ks)} layers but v_cache has {len(vs)}")
    dev = ks[0].device
    if vs[0].shape != ks[0].shape or vs[0].dtype != ks[0].dtype or vs[0].device != dev:
        raise ValueError(
            f"v_cache ({tuple(vs[0].shape)}, {vs[0].dtype}, {vs[0].device}) must match k_cache "
            f"({tuple(ks[0].shape)}, {ks[0].dtype}, {dev})"
        )
    check_tensor("accepted_nodes", accepted_nodes, dtype=_INT, ndim=2, device=dev)
    B = accepted_nodes.shape[0]
    if accepted_nodes.shape[1] < 1:
        raise ValueError("accepted_nodes needs at least one column (the root)")
    check_tensor("block_table", block_table, dtype=_INT, ndim=2, shape=(B, None), device=dev)
    check_tensor("context_lens", context_lens, dtype=_INT, shape=(B,), device=dev)
    check_tensor("num_accepted", num_accepted, dtype=_INT, shape=(B,), device=dev)
    num_blocks, block_size = ks[0].shape[:2]
    if validate and not capturing(dev):
        _validate_values(block_table, context_lens, accepted_nodes, num_accepted, num_blocks, block_size)
    _, fn = _COMPACT.resolve(backend, dev)
    return fn(ks, vs, dense(block_table), dense(context_lens), dense(accepted_nodes), dense(num_accepted))
