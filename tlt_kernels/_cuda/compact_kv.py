"""CUDA backend of :func:`tlt_kernels.compact_kv`: every layer's K and V in one ``_C.compact_kv`` launch.

The kernel takes a small ``uint64`` device array with the address of each cache (K of every layer,
then V). It is cached by the tuple of data pointers, so steady-state calls and CUDA-graph replays
launch exactly one kernel; a cache miss during capture builds it with capturable scalar fills
instead of a host-to-device copy. Grid ``(B, 2L, slabs)``: a CTA gathers one column slab of every
depth of a request's path into shared memory, synchronizes, then scatters (race-free, see
``csrc/compact_kv/compact_kv.cuh``). Accesses are 16 bytes wide when the slot size and every cache address allow.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import List, Sequence

import torch

from ..reference.compact_kv import make_compact_kv_op
from . import extension, ptr, stream_handle

__all__ = ["compact_kv", "access_unit"]

_PTRS: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()
_PTRS_MAX = 64


def access_unit(caches: Sequence[torch.Tensor]) -> int:
    """Widest access (16, 8, 4, 2 or 1 bytes) dividing a slot's bytes and every cache's address."""
    first = caches[0]
    row_bytes = first[0, 0].numel() * first.element_size()
    unit = 16
    while unit > 1 and (row_bytes % unit or any(t.data_ptr() % unit for t in caches)):
        unit //= 2
    return unit


def _cache_ptrs(caches: List[torch.Tensor]) -> torch.Tensor:
    """``int64 [len(caches)]`` device addresses (read as uint64 by the kernel), on the caches' device."""
    addrs = tuple(t.data_ptr() for t in caches)
    key = (caches[0].device, addrs)
    hit = _PTRS.get(key)
    if hit is not None:
        _PTRS.move_to_end(key)
        return hit
    dev = caches[0].device
    if torch.cuda.is_current_stream_capturing():
        # A host-to-device copy cannot be captured; scalar fills can (the value is a kernel argument).
        table = torch.empty(len(addrs), dtype=torch.int64, device=dev)
        for i, a in enumerate(addrs):
            table[i].fill_(a)
    else:
        table = torch.tensor(addrs, dtype=torch.int64, device=dev)
    _PTRS[key] = table
    if len(_PTRS) > _PTRS_MAX:
        _PTRS.popitem(last=False)
    return table


def compact_kv_(k_caches: List[torch.Tensor], v_caches: List[torch.Tensor], block_table, context_lens, accepted_nodes,
                num_accepted) -> None:
    """Launch the in-place move (inputs validated by :func:`tlt_kernels.compact_kv`)."""
    caches = list(k_caches) + list(v_caches)
    first = caches[0]
    if first.device.type != "cuda":
        raise ValueError(f"compact_kv (cuda backend) needs CUDA tensors, got {first.device}")
    num_blocks, block_size = first.shape[:2]
    B, P = accepted_nodes.shape
    if B == 0 or first.numel() == 0:
        return
    as32 = lambda t: t.to(torch.int32).contiguous()  # noqa: E731  (no-op for int32 contiguous inputs)
    table = block_table.to(torch.int32)
    table = table if table.stride(-1) == 1 else table.contiguous()
    nodes = accepted_nodes.to(torch.int32)
    nodes = nodes if nodes.stride(-1) == 1 else nodes.contiguous()
    ctx, nacc = as32(context_lens), as32(num_accepted)
    ptrs = _cache_ptrs(caches)
    with torch.cuda.device(first.device):
        extension().compact_kv(
            cache_ptrs=ptr(ptrs), block_table=ptr(table), context_lens=ptr(ctx), accepted_nodes=ptr(nodes),
            num_accepted=ptr(nacc), bt_stride_b=int(table.stride(0)), nodes_stride_b=int(nodes.stride(0)),
            row_bytes=int(first[0, 0].numel() * first.element_size()), num_caches=len(caches), batch=B, path_len=P,
            block_size=int(block_size), unit=access_unit(caches), stream=stream_handle(first.device),
        )


compact_kv = make_compact_kv_op("tlt::compact_kv_cuda", compact_kv_)
