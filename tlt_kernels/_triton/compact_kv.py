"""Triton KV compaction: the accepted path of every request, K and V of every layer, one launch.

Layers as separate tensors: the kernel takes the first K cache as its base pointer and an ``int64``
device tensor of per-layer offsets *in elements* from that base (``(data_ptr - base) / itemsize``)
for the 2L caches (K of every layer, then V). The offsets tensor is cached by the tuple of data
pointers, so steady-state calls (and CUDA-graph replays) launch exactly one kernel; a cache miss
during graph capture builds it with capturable fills instead of a host-to-device copy.

Grid ``(B, 2L, cdiv(Hkv*D, BLOCK_F))``; a program moves one column tile of every path depth of one
request in one cache. Race freedom: destination slots ``ctx + d`` can be another depth's source
(``ctx + node[d']`` with ``node[d'] = d``), so the program loads the whole ``[depths, BLOCK_F]`` tile
of sources, synchronizes its threads, then stores. Programs never overlap: different requests own
different tail slots, different caches are different tensors, different tiles are different columns.
Depths already in place (``node[d] == d``, e.g. all of a chain) are masked out: no traffic.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import List

import torch
import triton
import triton.language as tl

from .._validation import capturing
from ..reference.compact_kv import make_compact_kv_op


@triton.jit
def _compact_kv_kernel(
    Base_ptr, LayerOffsets_ptr, BlockTable_ptr, ContextLens_ptr, Nodes_ptr, NumAccepted_ptr,
    stride_bt, stride_nodes, P, ROW,
    BLOCK_SIZE_KV: tl.constexpr, P_POW2: tl.constexpr, BLOCK_F: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    layer = tl.program_id(1)
    f = tl.program_id(2).to(tl.int64) * BLOCK_F + tl.arange(0, BLOCK_F).to(tl.int64)
    cache_ptr = Base_ptr + tl.load(LayerOffsets_ptr + layer)

    d = tl.arange(0, P_POW2).to(tl.int64)
    n_acc = tl.load(NumAccepted_ptr + b).to(tl.int64)
    ctx = tl.load(ContextLens_ptr + b).to(tl.int64)
    node = tl.load(Nodes_ptr + b * stride_nodes + d, mask=(d < P) & (d <= n_acc), other=0).to(tl.int64)
    live = (d < P) & (d <= n_acc) & (node != d)
    src_slot = ctx + node
    dst_slot = ctx + d
    table = BlockTable_ptr + b * stride_bt
    src_page = tl.load(table + src_slot // BLOCK_SIZE_KV, mask=live, other=0).to(tl.int64)
    dst_page = tl.load(table + dst_slot // BLOCK_SIZE_KV, mask=live, other=0).to(tl.int64)
    src_row = src_page * BLOCK_SIZE_KV + src_slot % BLOCK_SIZE_KV
    dst_row = dst_page * BLOCK_SIZE_KV + dst_slot % BLOCK_SIZE_KV

    m = live[:, None] & (f[None, :] < ROW)
    vals = tl.load(cache_ptr + src_row[:, None] * ROW + f[None, :], mask=m)
    # Every source is read before any destination is written (see the module docstring).
    tl.debug_barrier()
    tl.store(cache_ptr + dst_row[:, None] * ROW + f[None, :], vals, mask=m)


_OFFSETS: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()
_OFFSETS_MAX = 64


def _layer_offsets(caches: List[torch.Tensor]) -> torch.Tensor:
    """``int64 [len(caches)]`` element offsets of each cache from ``caches[0]``, on the caches' device."""
    base = caches[0]
    key = (base.device, base.dtype, tuple(t.data_ptr() for t in caches))
    hit = _OFFSETS.get(key)
    if hit is not None:
        _OFFSETS.move_to_end(key)
        return hit
    itemsize = base.element_size()
    deltas = [t.data_ptr() - base.data_ptr() for t in caches]
    if any(delta % itemsize for delta in deltas):
        raise ValueError(f"compact_kv (triton): every cache must be aligned to its dtype size ({itemsize} bytes)")
    offsets = [delta // itemsize for delta in deltas]
    if capturing(base.device):
        # A host-to-device copy cannot be captured; scalar fills can (the value is a kernel argument).
        table = torch.empty(len(offsets), dtype=torch.int64, device=base.device)
        for i, off in enumerate(offsets):
            table[i].fill_(off)
    else:
        table = torch.tensor(offsets, dtype=torch.int64, device=base.device)
    _OFFSETS[key] = table
    if len(_OFFSETS) > _OFFSETS_MAX:
        _OFFSETS.popitem(last=False)
    return table


def compact_kv_(k_caches: List[torch.Tensor], v_caches: List[torch.Tensor], block_table, context_lens, accepted_nodes, num_accepted) -> None:
    """Launch the in-place move (inputs validated by :func:`tlt_kernels.compact_kv`)."""
    caches = list(k_caches) + list(v_caches)
    num_blocks, block_size, hkv, dim = caches[0].shape
    row = hkv * dim
    B, P = accepted_nodes.shape
    p_pow2 = triton.next_power_of_2(P)
    block_f = min(triton.next_power_of_2(row), max(16, 8192 // p_pow2))
    grid = (B, len(caches), triton.cdiv(row, block_f))
    _compact_kv_kernel[grid](
        caches[0], _layer_offsets(caches), block_table, context_lens, accepted_nodes, num_accepted,
        block_table.stride(0), accepted_nodes.stride(0), P, row,
        BLOCK_SIZE_KV=block_size, P_POW2=p_pow2, BLOCK_F=block_f,
    )


compact_kv = make_compact_kv_op("tlt::compact_kv", compact_kv_)
