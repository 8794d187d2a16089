"""Paged KV cache: per-layer ``[num_blocks, block_size, Hkv, D]`` pools and a simple block allocator.

Slot ``s`` of request ``b`` lives at ``cache[block_table[b, s // block_size], s % block_size]``, the
layout :func:`tlt_kernels.tree_attention` and :func:`tlt_kernels.compact_kv` read.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from .._validation import check_positive_ints, check_tensor
from .config import ModelConfig



def paged_rows(block_table: torch.Tensor, slots: torch.Tensor, block_size: int) -> torch.Tensor:
    """``int64 [B, T]`` row of each slot (``int [B, T]``) in a ``[num_blocks * block_size, Hkv, D]`` view of a paged
    cache whose requests' pages are ``block_table`` (``int32 [B, max_blocks]``). Leading dims alike on both (``[..., B,
    T]`` slots, a ``[..., B, max_blocks]`` table, which may be expanded) give ``[..., B, T]`` rows: slots laid out
    step-major, ``[S, B, T]``, give each step's rows contiguous.

    Slots past the table's width are clamped to its last block; callers make sure such slots are never written
    (they are masked or guaranteed in range).
    """
    slots = slots.to(torch.int64)
    col = (slots // block_size).clamp(max=block_table.shape[-1] - 1)
    # The int32 pages gathered as they are and widened inside the add (int64 arithmetic, the page times block_size
    # as its alpha): five launches, where widening the whole table and a separate product took seven.
    return torch.add(slots % block_size, block_table.gather(-1, col), alpha=block_size)


class PagedKVCache:
    """K/V pools of every layer plus a free list of blocks.

    Attributes:
        k, v: lists of ``num_layers`` tensors ``[num_blocks, block_size, num_kv_heads, head_dim]``
            (``dtype``), views into one allocation each so a list can be handed to ``compact_kv``.
        block_size, num_blocks, num_layers.
    """

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int = 16, device="cpu", dtype: torch.dtype = torch.float32):
        check_positive_ints("PagedKVCache", num_blocks=num_blocks, block_size=block_size)
        self.config = config
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_layers = config.num_layers
        self.dtype = dtype
        shape = (config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.k_pool = torch.zeros(shape, device=device, dtype=dtype)
        self.v_pool = torch.zeros(shape, device=device, dtype=dtype)
        # The pool's own device: "cuda" is stored as "cuda:<current>", so comparisons with a model's device hold.
        self.device = self.k_pool.device
        self.k: List[torch.Tensor] = list(self.k_pool.unbind(0))
        self.v: List[torch.Tensor] = list(self.v_pool.unbind(0))
        self._free: List[int] = list(range(num_blocks))

    # -- allocation -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, batch_size: int, max_tokens: int, generator: Optional[torch.Generator] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """Reserve ``ceil(max_tokens / block_size)`` blocks for each of ``batch_size`` requests.

        Returns ``block_table: int32 [batch_size, max_blocks]`` and ``context_lens: int32 [batch_size]``
        (zeros), both on the cache's device. ``max_tokens`` must cover the prompt, the generated tokens
        and the widest draft tree (tree nodes are written at ``context_lens + i`` before acceptance).
        ``generator`` shuffles which free blocks each request gets (tests use it to get
        non-contiguous tables); without it blocks are handed out in free-list order.
        """
        check_positive_ints("PagedKVCache.allocate", batch_size=batch_size, max_tokens=max_tokens)
        per = self.blocks_for(max_tokens)
        need = batch_size * per
        if need > len(self._free):
            raise RuntimeError(
                f"PagedKVCache out of blocks: need {need} ({batch_size} requests x {per} blocks of {self.block_size}), "
                f"{len(self._free)} free of {self.num_blocks}"
            )
        if generator is not None:
            order = torch.randperm(len(self._free), generator=generator).tolist()
            self._free = [self._free[i] for i in order]
        taken, self._free = self._free[:need], self._free[need:]
        table = torch.tensor(taken, dtype=torch.int32).view(batch_size, per).to(self.device)
        return table, torch.zeros(batch_size, dtype=torch.int32, device=self.device)

    def free(self, block_table: torch.Tensor) -> None:
        """Return the (non-negative) blocks of ``block_table`` to the free list."""
        blocks = [b for b in block_table.flatten().tolist() if b >= 0]
        if len(set(blocks)) != len(blocks) or any(b >= self.num_blocks for b in blocks):
            raise ValueError("block_table holds duplicate or out-of-range block ids; it was not allocated by this cache")
        in_free = set(self._free).intersection(blocks)
        if in_free:
            raise ValueError(f"blocks {sorted(in_free)[:8]} are already free (double free)")
        self._free.extend(blocks)

    # -- access -----------------------------------------------------------------------------------
    def check_block_table(self, block_table: torch.Tensor, context_lens: torch.Tensor, batch: int) -> None:
        check_tensor("block_table", block_table, dtype=torch.int32, ndim=2, device=self.device)
        if block_table.shape[0] != batch:
            raise ValueError(f"block_table has {block_table.shape[0]} rows, expected one per request (B={batch})")
        check_tensor("context_lens", context_lens, dtype=torch.int32, shape=(batch,), device=self.device)

    def flat_index(self, block_table: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """``int64 [B, T]`` row of each slot in the ``[num_blocks * block_size, Hkv, D]`` view (:func:`paged_rows`)."""
        return paged_rows(block_table, slots, self.block_size)

    def write(self, layer: int, block_table: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              mask: Optional[torch.Tensor] = None) -> None:
        """Store ``k, v: [B, T, Hkv, D]`` at ``slots: [B, T]`` of layer ``layer``.

        With ``mask: bool [B, T]`` only the selected tokens are written (this synchronizes with the
        device); without it every token is written, with no host synchronization (CUDA-graph safe).
        """
        idx = self.flat_index(block_table, slots)
        if mask is not None:
            idx, k, v = idx[mask], k[mask], v[mask]
        self.write_at(layer, idx.flatten(), k, v)

    def layer_rows(self, layer: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s K and V caches as ``[num_blocks * block_size, Hkv, D]`` views (row = :meth:`flat_index`)."""
        k, v = self.k[layer], self.v[layer]
        return k.view(-1, *k.shape[2:]), v.view(-1, *v.shape[2:])

    def write_at(self, layer: int, flat_index: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k, v`` (``[..., Hkv, D]``, ``N`` tokens) at rows ``flat_index`` (int64 ``[N]``, from
        :meth:`flat_index`) of layer ``layer``: a step computes the index once for all its layers."""
        kf, vf = self.layer_rows(layer)
        kf.index_copy_(0, flat_index, k.reshape(-1, *kf.shape[1:]).to(self.dtype))
        vf.index_copy_(0, flat_index, v.reshape(-1, *vf.shape[1:]).to(self.dtype))

    def read_at(self, layer: int, flat_index: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """K/V of layer ``layer`` at rows ``flat_index`` (int64 ``[...]``, from :meth:`flat_index`) as new
        ``[..., Hkv, D]`` tensors: a prefill computes the index once for all its layers."""
        kf, vf = self.layer_rows(layer)
        return kf[flat_index], vf[flat_index]

    def gather(self, layer: int, block_table: torch.Tensor, num_slots: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """K/V of slots ``0 .. num_slots-1`` of every request as contiguous ``[B, num_slots, Hkv, D]``."""
        B = block_table.shape[0]
        slots = torch.arange(num_slots, device=block_table.device).unsqueeze(0).expand(B, num_slots)
        return self.read_at(layer, self.flat_index(block_table, slots))
