"""Reference KV compaction after verification (pure torch, CPU and GPU).

During verification node ``i`` of request ``b``'s tree was written to cache slot
``context_lens[b] + i``. After acceptance only the path ``accepted_nodes[b, 0..num_accepted[b]]``
survives; its K/V moves to the contiguous slots ``context_lens[b] + 0 .. + num_accepted[b]`` so the
next step sees an ordinary prefix. Slot ``s`` of request ``b`` is
``cache[block_table[b, s // block_size], s % block_size]``.
"""
from __future__ import annotations

from typing import Callable, List, Sequence, Tuple

import torch

from .._backend import direct_dispatch_ok


def path_slots(
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    accepted_nodes: torch.Tensor,
    num_accepted: torch.Tensor,
    block_size: int,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Flat cache rows (``block * block_size + offset``) to move: ``(src, dst)``, both ``int64 [M]``.

    Only depths ``d <= num_accepted[b]`` whose node is not already at slot ``context_lens[b] + d``
    are listed (a chain's path needs no move at all).
    """
    B, P = accepted_nodes.shape
    dev = accepted_nodes.device
    depth = torch.arange(P, device=dev).unsqueeze(0)
    nodes = accepted_nodes.to(torch.int64)
    live = (depth <= num_accepted.to(torch.int64).unsqueeze(1)) & (nodes != depth)
    ctx = context_lens.to(torch.int64).unsqueeze(1)
    src_slot = torch.where(live, ctx + nodes, torch.zeros_like(nodes))
    dst_slot = torch.where(live, ctx + depth, torch.zeros_like(nodes))
    table = block_table.to(torch.int64)

    def flat(slot):
        page = table.gather(1, slot // block_size)
        return (page * block_size + slot % block_size)[live]

    return flat(src_slot), flat(dst_slot)


def new_context_lens(context_lens: torch.Tensor, num_accepted: torch.Tensor) -> torch.Tensor:
    """``int32 [B]``: each request's context after its accepted path and bonus token, ``context_lens + num_accepted + 1``."""
    return (context_lens.to(torch.int32) + num_accepted.to(torch.int32) + 1).to(torch.int32)


def compact_kv(
    k_caches: Sequence[torch.Tensor],
    v_caches: Sequence[torch.Tensor],
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    accepted_nodes: torch.Tensor,
    num_accepted: torch.Tensor,
) -> torch.Tensor:
    """In-place move for every layer; returns ``new_context_lens int32 [B]``.

    Gather every source row first, then scatter: a destination slot may be another depth's source
    (slot ``ctx + d`` can hold accepted node ``d`` of a deeper position), so moving row by row in an
    arbitrary order could read an already-overwritten slot.
    """
    num_blocks, block_size = k_caches[0].shape[:2]
    src, dst = path_slots(block_table, context_lens, accepted_nodes, num_accepted, block_size)
    if src.numel():
        for cache in list(k_caches) + list(v_caches):
            rows = cache.view(num_blocks * block_size, *cache.shape[2:])
            rows[dst] = rows[src]  # advanced indexing copies: a gather, then the scatter
    return new_context_lens(context_lens, num_accepted)


def make_compact_kv_op(op_name: str, move_: Callable[..., None]) -> Callable[..., torch.Tensor]:
    """A kernel backend's ``compact_kv``: ``move_(k_caches, v_caches, block_table, context_lens, accepted_nodes,
    num_accepted)`` moves the paths in place; the returned function runs it as the ``torch.library`` custom op
    ``op_name`` (mutating the caches, fake implementation for ``torch.compile``) and returns the new context
    lengths ``int32 [B] = context_lens + num_accepted + 1``."""

    @torch.library.custom_op(op_name, mutates_args=("k_caches", "v_caches"))
    def op(k_caches: List[torch.Tensor], v_caches: List[torch.Tensor], block_table: torch.Tensor,
           context_lens: torch.Tensor, accepted_nodes: torch.Tensor, num_accepted: torch.Tensor) -> torch.Tensor:
        move_(k_caches, v_caches, block_table, context_lens, accepted_nodes, num_accepted)
        return new_context_lens(context_lens, num_accepted)

    @op.register_fake
    def _(k_caches, v_caches, block_table, context_lens, accepted_nodes, num_accepted):
        return context_lens.new_empty(context_lens.shape, dtype=torch.int32)

    def compact_kv(k_caches, v_caches, block_table, context_lens, accepted_nodes, num_accepted) -> torch.Tensor:
        args = (list(k_caches), list(v_caches), block_table, context_lens, accepted_nodes, num_accepted)
        if direct_dispatch_ok(*args):  # plain eager: launch without the op's dispatch
            move_(*args)
            return new_context_lens(context_lens, num_accepted)
        return compact_kv.op(*args)

    compact_kv.op = op  # looked up per call, so tests can wrap it
    compact_kv.__doc__ = f"Backend of :func:`tlt_kernels.compact_kv` (custom op ``{op_name}``): moves in place, returns " \
                         "``int32 [B]`` new context lengths."
    return compact_kv
