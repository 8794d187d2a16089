"""``compact_kv``: move the accepted path's K/V to contiguous cache slots, every layer, in place."""
from __future__ import annotations

from typing import List, Sequence, Union

import torch

from .._backend import register_op
from .._validation import check_tensor

_COMPACT = register_op(
    "compact_kv",
    {
        "torch": "tlt_kernels.reference.compact_kv:compact_kv",
        "triton": "tlt_kernels._triton.compact_kv:compact_kv",
        "cuda": "tlt_kernels._cuda.compact_kv:compact_kv",
    },
    # Measured on an H200 (bench/RESULTS.md): Triton faster at B=64 (0.42 vs 0.46 ms), CUDA at B=256
    # (0.25 vs 0.35 ms); Triton stays first until a size-aware choice is worth the complexity.
    preference=("triton", "cuda", "torch"),
)

Caches = Union[torch.Tensor, Sequence[torch.Tensor]]
_INT = (torch.int32, torch.int64)


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _as_layers(name: str, caches: Caches) -> List[torch.Tensor]:
    layers = [caches] if isinstance(caches, torch.Tensor) else list(caches)
    if not layers:
        raise ValueError(f"{name} must be a tensor or a non-empty list of tensors (one per layer)")
    first = layers[0]
    for i, t in enumerate(layers):
        label = name if isinstance(caches, torch.Tensor) else f"{name}[{i}]"
        check_tensor(label, t, ndim=4, shape=tuple(first.shape) if i else None, device=first.device)
        if t.dtype != first.dtype:
            raise TypeError(f"{label} has dtype {t.dtype}, expected {first.dtype} like {name}[0] (all layers share one dtype)")
        if not t.is_contiguous():
            raise ValueError(f"{label} must be contiguous ([num_blocks, block_size, Hkv, D] row-major), got strides {t.stride()}")
    return layers


def _validate_values(block_table, context_lens, accepted_nodes, num_accepted, num_blocks, block_size):
    """Value checks (host sync): the path is valid and every touched slot maps to a real block."""
    B, P = accepted_nodes.shape
    nodes = accepted_nodes.cpu().to(torch.int64)
    nacc = num_accepted.cpu().to(torch.int64)
    ctx = context_lens.cpu().to(torch.int64)
    table = block_table.cpu().to(torch.int64)
    capacity = table.shape[1] * block_size
    for b in range(B):
        n = int(nacc[b])
        if not 0 <= n < P:
            raise ValueError(f"num_accepted[{b}] = {n} is outside [0, {P - 1}] (accepted_nodes has {P} columns)")
        if int(ctx[b]) < 0:
            raise ValueError(f"context_lens[{b}] = {int(ctx[b])} is negative")
        path = nodes[b, : n + 1]
        if int(path[0]) != 0:
            raise ValueError(f"accepted_nodes[{b}, 0] = {int(path[0])}, expected 0 (the root starts every path)")
        if n and bool((path[1:] <= path[:-1]).any()):
            raise ValueError(f"accepted_nodes[{b}, :{n + 1}] = {path.tolist()} must be strictly increasing (a root-to-leaf path in topological order)")
        last_slot = int(ctx[b]) + int(path[-1])
        if last_slot >= capacity:
            raise ValueError(
                f"request {b}: node {int(path[-1])} sits at slot {last_slot} but block_table holds only "
                f"{capacity} slots ({table.shape[1]} blocks x block_size {block_size})"
            )
        slots = torch.cat([int(ctx[b]) + path, int(ctx[b]) + torch.arange(n + 1)])
        pages = table[b, slots // block_size]
        bad = (pages < 0) | (pages >= num_blocks)
        if bad.any():
            s = int(slots[bad.nonzero()[0, 0]])
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
    if validate and not _capturing(dev):
        _validate_values(block_table, context_lens, accepted_nodes, num_accepted, num_blocks, block_size)
    _, fn = _COMPACT.resolve(backend, dev)
    return fn(ks, vs, block_table, context_lens, accepted_nodes, num_accepted)
