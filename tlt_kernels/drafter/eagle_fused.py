"""The EAGLE drafter's decoding on the fused ops: the math of :class:`~tlt_kernels.drafter.EagleDrafter`'s dense path
(``eagle.py``) in a launch count fit for a small model's step.

A small model's step is bound by its kernel launches, not by bytes (docs/MODELS.md). The dense path spends about 150
launches per draft depth: RoPE and the RMSNorms as elementwise torch ops, and an attention that gathers every
request's whole padded context and masks it densely. Here the drafter's layer runs the target's fused kernels: one
RMSNorm kernel (the residual add inside), one packed q/k/v GEMM, RoPE and the K/V store in one launch, the paged
tree-attention kernels over the cached context plus the new tokens, SiLU * up in one.

Where the new tokens live. A commit (:func:`extend_fused`) writes its ``n`` pairs at slots ``context_lens + i``, the
padding ones too (past the committed pairs: later commits overwrite them). A draft (:class:`FusedExpansion`) writes
the ``r``-th node it expands at slot ``context_lens + r``, again past the committed pairs. Both stay within
:data:`SCRATCH_SLOTS` slots past the context, which :meth:`EagleDrafter.new_state` reserves in every block table.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..models.kv_cache import paged_rows
from ..models.llama import rope_cos_sin
from ..ops.rms_norm import rms_norm
from ..ops.rotary import rotary_to_cache
from ..ops.silu_and_mul import silu_and_mul
from ..ops.tree_attention import KERNEL_MAX_NODES, SPLIT_COUNTER_ROWS, plan_masked_attention
from ..tree import pack_bit_words
from . import constants

# Slots a block table keeps past its committed pairs for the fused path's new tokens: the widest forest or commit
# the attention kernels take (a wider one runs the dense path).
SCRATCH_SLOTS = KERNEL_MAX_NODES


def fused_layer(drafter, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rows: torch.Tensor, plan, cache,
                queries: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The drafter's layer over ``x [B, T, H]`` (``g`` of the module docstring of ``eagle.py``).

    The T tokens' K/V go to cache rows ``rows int64 [B * T]``; attention runs ``plan`` (a
    :func:`~tlt_kernels.plan_masked_attention` plan) over the P tokens' rotated queries ``queries [B, P, Hq, D]``
    (any strides with a contiguous head dim), whose first ``P - T`` rows hold the plan's earlier tokens' and whose
    last T this layer writes; None when ``P = T``. Returns ``g [B, T, H]``.
    """
    c = drafter.config
    B, T, _ = x.shape
    h, residual = rms_norm(x, drafter.input_norm.weight, c.rms_norm_eps)
    q, k, v = drafter.qkv_projections(h)
    q = q.view(B, T, c.num_q_heads, c.head_dim)
    k = k.view(B, T, c.num_kv_heads, c.head_dim)
    v = v.view(B, T, c.num_kv_heads, c.head_dim)
    k_rows, v_rows = (t.view(-1, c.num_kv_heads, c.head_dim) for t in (cache.k, cache.v))
    if queries is None:  # P = T
        queries = rotary_to_cache(q, k, v, cos, sin, k_rows, v_rows, rows, validate=False)
    else:  # the new rows' rotated queries land after the earlier ones, in place: no concatenation per step
        rotary_to_cache(q, k, v, cos, sin, k_rows, v_rows, rows, q_out=queries[:, -T:], validate=False)
    attn = plan.run(queries, cache.k, cache.v, sm_scale=c.head_dim**-0.5)[:, -T:]
    h, residual = rms_norm(drafter.o_proj(attn.flatten(-2)), drafter.post_norm.weight, c.rms_norm_eps,
                           residual=residual)
    gate, up = drafter.gate_up_projections(h)
    # The residual add rides in the down projection's GEMM (beta = 1 on the residual, a new tensor this layer owns):
    # one launch fewer than a GEMM then an add.
    act = silu_and_mul(gate, up).flatten(0, -2)
    return residual.view(-1, residual.shape[-1]).addmm_(act, drafter.down_proj.weight.t()).view(residual.shape)


def _plan(drafter, mask: torch.Tensor, context_lens: torch.Tensor, block_table: torch.Tensor, cache,
          split_counters: Optional[torch.Tensor] = None):
    """The masked plan of ``mask [B, T, *]``, its ``num_nodes`` (T each) a kept constant."""
    c = drafter.config
    B, T = mask.shape[:2]
    num_nodes = constants.full(B, T, torch.int32, mask.device)
    return plan_masked_attention(mask, context_lens.to(torch.int32), block_table, num_q_heads=c.num_q_heads,
                                 num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, block_size=cache.block_size,
                                 max_context_len=block_table.shape[1] * cache.block_size, num_blocks=cache.num_blocks,
                                 kv_dtype=cache.k.dtype, num_nodes=num_nodes, split_counters=split_counters)


def extend_fused(drafter, state, cache, x: torch.Tensor) -> torch.Tensor:
    """The layer over a commit's pairs ``x [B, n, H]`` (``n <= SCRATCH_SLOTS``) at slots and positions
    ``context_lens + i``, causal among themselves; every one of the n slots is written. Returns ``g [B, n, H]``."""
    B, n, _ = x.shape
    positions = state.context_lens.unsqueeze(1) + constants.arange(n, x.device)  # int64 [B, n]: the add widens
    cos, sin = rope_cos_sin(drafter.rope_freqs(x.device), positions, x.dtype)
    causal = constants.causal_mask(n, x.device).expand(B, -1, -1)  # the plan copies it at B > 1
    plan = _plan(drafter, causal, state.context_lens, state.block_table, cache)
    rows = paged_rows(state.block_table, positions, cache.block_size).flatten()
    return fused_layer(drafter, x, cos, sin, rows, plan, cache)


class FusedExpansion:
    """The expansion steps of one draft (``EagleDrafter.draft``) on the fused layer.

    Step ``s`` (1-based) runs K frontier pairs at RoPE position ``context_lens + s - 1``; they see the context, their
    expanded ancestors and themselves. The nodes expanded so far form a forest (the depth-1 candidates are its roots),
    hence a masked plan over all of them; their rotated queries stay in a per-draft buffer, each step's written after
    the earlier ones', and all are rerun (a few rows more, no launch more). The mask is one word of bits per node
    (``P <= 64``) in a buffer of the draft's nodes, :attr:`ancestor_words`: a node's word is its parent's plus its own
    bit. The first step writes its roots' words; the draft's frontier step writes the others as it keeps each child
    (``draft_frontier(ancestor_words=)``), no launch of their own. The words are int32 while the nodes fit 32 bits,
    so the first ``P`` of them are the plan's packed mask as they stand (a view at one request), else int64, halved
    per step. The plans share one zeroing of their arrival counters, sized for the widest step.
    """

    def __init__(self, drafter, state, cache, depth: int, topk: int):
        self.drafter, self.state, self.cache = drafter, state, cache
        self.ancestor_words: Optional[torch.Tensor] = None
        dev = state.context_lens.device
        context_lens = state.context_lens.unsqueeze(1)  # int32: the adds below widen to int64
        num_nodes = (depth - 1) * topk  # the nodes the draft expands (none at depth 1)
        if num_nodes:  # made once: each step slices them
            positions = context_lens + constants.arange(depth - 1, dev)
            self.cos, self.sin = rope_cos_sin(drafter.rope_freqs(dev), positions, drafter.fc.weight.dtype)
            # Node (s - 1) * K + k of request b at slot context_lens[b] + (s - 1) * K + k, laid out [depth - 1, B, K]:
            # step s's rows contiguous, so a step takes a view, not a copy.
            node_slots = context_lens.unsqueeze(0) + constants.arange(num_nodes, dev).view(depth - 1, 1, topk)
            table = state.block_table.expand(depth - 1, -1, -1)
            self.rows = paged_rows(table, node_slots, cache.block_size).view(depth - 1, -1)  # [depth - 1, B * K]
            word = torch.int32 if num_nodes <= 32 else torch.int64
            self.bits = constants.node_bits(topk, word, dev)  # the roots' own bits
            # [B, num_nodes]: bit j of word i: node j is node i or its ancestor (the first K written by step 1, the
            # next K by each frontier step)
            self.ancestor_words = torch.empty(context_lens.shape[0], num_nodes, dtype=word, device=dev)
            # One zeroing for every step's plan: the widest step's row chunks (each run leaves them zeros).
            c = drafter.config
            query_rows = num_nodes * (c.num_q_heads // c.num_kv_heads)  # per KV head
            self.split_counters = torch.zeros(context_lens.shape[0], c.num_kv_heads,
                                              -(-query_rows // SPLIT_COUNTER_ROWS), dtype=torch.int32, device=dev)
            # [B, num_nodes, Hq, D]: node r's rotated query, written by its step
            self.queries = torch.empty(context_lens.shape[0], num_nodes, c.num_q_heads, c.head_dim,
                                       dtype=drafter.fc.weight.dtype, device=dev)

    def __call__(self, x: torch.Tensor, parent_rows: torch.Tensor, step: int) -> torch.Tensor:
        """``g [B, K, H]`` of the step's pairs ``x [B, K, H]``, whose parents are the expanded nodes ``parent_rows int64
        [B, K]``: the roots (-1) at step 1, expanded nodes (>= 0) after it, as ``EagleDrafter.draft`` makes them (the
        dense path's call; here the frontier step has already written their words)."""
        B, K, _ = x.shape
        P = step * K  # nodes expanded so far, this step's K last
        if step == 1:  # the roots see the context and themselves; later steps' words came with their frontier
            self.ancestor_words[:, :K].copy_(self.bits[:K].expand(B, K))
        words = self.ancestor_words[:, :P]
        mask = words.unsqueeze(2) if words.dtype == torch.int32 else pack_bit_words(words, P)
        plan = _plan(self.drafter, mask, self.state.context_lens, self.state.block_table, self.cache,
                     self.split_counters)
        rows = self.rows[step - 1]
        cos = self.cos[:, step - 1 : step].expand(B, K, -1)
        sin = self.sin[:, step - 1 : step].expand(B, K, -1)
        return fused_layer(self.drafter, x, cos, sin, rows, plan, self.cache, self.queries[:, :P])
