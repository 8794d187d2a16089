"""Token trees: validation and the derived tensors every kernel uses.

A batch of draft trees is ``parents: int32 [B, T]``. For request ``b`` the valid nodes are
``0 .. num_nodes[b]-1`` in topological order: ``parents[b, 0] == -1`` (node 0, the root, is the
last accepted token) and ``0 <= parents[b, i] < i`` for ``1 <= i < num_nodes[b]``. Entries at or
past ``num_nodes[b]`` are padding and are ignored. A chain is ``parents[b, i] = i - 1``.

Because every parent index is smaller than its child's, a valid tree can hold no cycle; an entry
that breaks the rule (a parent >= its own index, a negative parent below node 1, a non-root node 0)
is reported as a ``ValueError`` naming the request and the node.
"""
from __future__ import annotations

from typing import Optional

import torch

from ._validation import check_int, check_tensor, saturate_to

_INT_DTYPES = (torch.int32, torch.int64)


def _check_parents(parents) -> None:
    """Metadata checks of a ``parents`` tensor (no host sync): what every tree utility needs."""
    check_tensor("parents", parents, dtype=_INT_DTYPES, ndim=2)
    if parents.shape[1] < 1:
        raise ValueError(f"parents must hold at least one node (the root) per request, got shape {tuple(parents.shape)}")


def chain_parents(batch: int, num_nodes: int, device="cpu") -> torch.Tensor:
    """``int32 [batch, num_nodes]`` parents of a chain: ``[-1, 0, 1, ..., num_nodes-2]``."""
    check_int("batch", batch, 0)
    check_int("num_nodes", num_nodes, 1)
    row = torch.arange(-1, num_nodes - 1, dtype=torch.int32, device=device)
    return row.unsqueeze(0).expand(batch, num_nodes).contiguous()


def resolve_num_nodes(parents: torch.Tensor, num_nodes: Optional[torch.Tensor]) -> torch.Tensor:
    """``num_nodes`` as ``int32 [B]`` (all ``T`` when None)."""
    _check_parents(parents)
    B, T = parents.shape
    if num_nodes is None:
        return torch.full((B,), T, dtype=torch.int32, device=parents.device)
    check_tensor("num_nodes", num_nodes, dtype=_INT_DTYPES, shape=(B,), device=parents.device)
    return saturate_to(num_nodes, torch.int32)  # 2**32 + 3 stays out of range instead of wrapping to 3


def validate_tree(parents: torch.Tensor, num_nodes: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Check ``parents`` (and ``num_nodes``); return ``num_nodes`` as ``int32 [B]``.

    Synchronizes with the device (it reads the values): use it outside CUDA-graph capture.
    """
    n = resolve_num_nodes(parents, num_nodes)  # checks parents first
    B, T = parents.shape
    n_cpu = n.cpu()
    bad_n = ((n_cpu < 1) | (n_cpu > T)).nonzero()
    if bad_n.numel():
        b = int(bad_n[0, 0])
        raise ValueError(f"num_nodes[{b}] = {int(n_cpu[b])} is outside [1, T={T}]")
    p = parents.cpu().to(torch.int64)
    idx = torch.arange(T)
    valid = idx.unsqueeze(0) < n_cpu.unsqueeze(1)
    root_bad = p[:, 0] != -1
    if root_bad.any():
        b = int(root_bad.nonzero()[0, 0])
        raise ValueError(f"invalid tree: request {b}, node 0 (the root) must have parent -1, got {int(p[b, 0])} "
                         f"(parents[{b}, 0])")
    nonroot = valid & (idx.unsqueeze(0) > 0)
    bad = nonroot & ((p < 0) | (p >= idx.unsqueeze(0)))
    if bad.any():
        b, i = (int(v) for v in bad.nonzero()[0])
        par = int(p[b, i])
        why = "a parent must precede its child (topological order; this also rules out cycles)" if par >= 0 else "only the root may have a negative parent"
        raise ValueError(f"invalid tree: request {b}, node {i} has parent {par}: {why} (parents[{b}, {i}])")
    return n


def tree_depths(parents: torch.Tensor, num_nodes: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``int32 [B, T]`` depth of each node (root 0). Padding nodes get depth 0.

    Pointer jumping: after ``ceil(log2 T)`` rounds every node has counted its ancestors, so this
    runs as a handful of gathers with no host synchronization.
    """
    n = resolve_num_nodes(parents, num_nodes)  # checks parents first
    B, T = parents.shape
    if T == 1:  # a plain decoding step: the root alone (one launch, not a round of jumps)
        return torch.zeros(B, 1, dtype=torch.int32, device=parents.device)
    idx = torch.arange(T, device=parents.device)
    valid = idx.unsqueeze(0) < n.unsqueeze(1).to(idx.dtype)
    anc = torch.where(valid & (idx > 0), parents.to(torch.int64), torch.full_like(idx, -1).expand(B, T))
    depth = (anc >= 0).to(torch.int64)
    # Invariant: depth[i] = hops from i to anc[i] (or to the root once anc[i] == -1).
    for _ in range(max(1, (T - 1).bit_length())):
        has = anc >= 0
        safe = anc.clamp(0, T - 1)
        depth = depth + torch.where(has, depth.gather(1, safe), torch.zeros_like(depth))
        anc = torch.where(has, anc.gather(1, safe), anc)
    return depth.to(torch.int32)


def depths_from_ancestor_mask(packed: torch.Tensor) -> torch.Tensor:
    """``int32 [B, T]`` node depths read off a bit-packed ancestor mask ``int32 [B, T, W]`` (:func:`tree_ancestor_mask_packed`):
    a node's row holds itself and its ancestors, so its depth is the row's bit count minus one (padding rows, all
    zero, get 0, as :func:`tree_depths` gives them). A verify step's plan has the mask already: a handful of launches
    where the pointer jumping takes about ten per round."""
    if packed.shape[1] == 1:  # a plain decoding step: the root alone, depth 0 (one launch)
        return torch.zeros(packed.shape[0], 1, dtype=torch.int32, device=packed.device)
    bits = torch.arange(32, dtype=torch.int32, device=packed.device)
    count = ((packed.unsqueeze(-1) >> bits) & 1).sum((-1, -2))  # an arithmetic shift keeps bit 31 readable
    return (count - 1).clamp(min=0).to(torch.int32)


def tree_positions(parents: torch.Tensor, context_lens: torch.Tensor, num_nodes: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``int32 [B, T]`` position ids of the nodes (for RoPE): ``context_lens[b] + depth``."""
    depths = tree_depths(parents, num_nodes)  # checks parents first
    check_tensor("context_lens", context_lens, dtype=_INT_DTYPES, shape=(parents.shape[0],), device=parents.device)
    return (context_lens.to(torch.int32).unsqueeze(1) + depths).to(torch.int32)


def tree_ancestor_mask(parents: torch.Tensor, num_nodes: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``bool [B, T, T]``: ``mask[b, i, j]`` is True iff node j is node i or one of its ancestors.

    Rows and columns of padding nodes are all False.
    """
    n = resolve_num_nodes(parents, num_nodes)  # checks parents first
    B, T = parents.shape
    idx = torch.arange(T, device=parents.device)
    valid = idx.unsqueeze(0) < n.unsqueeze(1).to(idx.dtype)
    mask = torch.zeros(B, T, T, dtype=torch.bool, device=parents.device)
    mask[:, idx, idx] = valid
    par = parents.to(torch.int64).clamp(0, T - 1)
    # Topological order: node i's row is its parent's row plus itself, filled in increasing i.
    for i in range(1, T):
        inherit = mask[torch.arange(B, device=parents.device), par[:, i]] & valid[:, i : i + 1]
        mask[:, i] |= inherit
    return mask


def pack_tree_mask(mask: torch.Tensor) -> torch.Tensor:
    """Bit-pack a ``bool [B, T, T]`` mask into ``int32 [B, T, ceil(T/32)]``.

    Bit ``j % 32`` of word ``j // 32`` of row ``i`` holds ``mask[b, i, j]``.
    """
    check_tensor("mask", mask, dtype=torch.bool, ndim=3)
    B, T, T2 = mask.shape
    words = (T2 + 31) // 32
    if T2 <= 64:  # one int64 word per row, read as its two int32 halves: 5 launches, not 11 (a step's plan makes one)
        return pack_bit_words(torch.where(mask, bit_values(T2, mask.device), 0).sum(-1), T2)
    padded = torch.zeros(B, T, words * 32, dtype=torch.int64, device=mask.device)
    padded[..., :T2] = mask.to(torch.int64)
    packed = (padded.view(B, T, words, 32) * bit_values(32, mask.device)).sum(-1)
    # Fold into the int32 range (two's complement) so bit 31 survives.
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)
    return packed.to(torch.int32)


def bit_values(n: int, device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """``[n]`` of ``dtype`` (int64, or int32 for ``n <= 32``): ``1 << j``; the last bit is the sign bit (two's
    complement), so a sum of distinct bits never overflows."""
    ones = torch.ones(n, dtype=dtype, device=device)
    return torch.bitwise_left_shift(ones, torch.arange(n, dtype=dtype, device=device))


def pack_bit_words(words: torch.Tensor, num_cols: int) -> torch.Tensor:
    """``int64 [B, T]`` rows of bits (bit j: column j, ``num_cols <= 64``) -> :func:`pack_tree_mask`'s ``int32 [B, T,
    ceil(num_cols / 32)]``: the words' int32 halves (little-endian: the low half is word 0), no arithmetic."""
    halves = words.contiguous().view(torch.int32).view(*words.shape, 2)
    return halves[..., : (num_cols + 31) // 32].contiguous()


def unpack_tree_mask(packed: torch.Tensor, num_cols: int) -> torch.Tensor:
    """Inverse of :func:`pack_tree_mask`: ``int32 [B, T, W]`` -> ``bool [B, T, num_cols]``."""
    check_tensor("packed", packed, dtype=torch.int32, ndim=3)
    check_int("num_cols", num_cols, 0)
    if num_cols > 32 * packed.shape[2]:
        raise ValueError(f"num_cols = {num_cols} exceeds the {32 * packed.shape[2]} bits of {packed.shape[2]} words per row")
    bits = torch.arange(32, device=packed.device, dtype=torch.int64)
    words = packed.to(torch.int64) & 0xFFFFFFFF
    unpacked = (words.unsqueeze(-1) >> bits) & 1
    return unpacked.flatten(-2)[..., :num_cols].bool()


def tree_ancestor_mask_packed(parents: torch.Tensor, num_nodes: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Bit-packed ancestor mask, ``int32 [B, T, ceil(T/32)]`` (a verify step's plan makes one)."""
    n = resolve_num_nodes(parents, num_nodes)  # checks parents first
    T = parents.shape[1]
    if T == 1:  # a plain decoding step: the root sees itself (a padding root, num_nodes = 0, nothing)
        return (n > 0).to(torch.int32).view(-1, 1, 1)
    if _WORDS_MIN_NODES <= T <= 64:
        return pack_bit_words(_ancestor_words(parents, n), T)
    return pack_tree_mask(tree_ancestor_mask(parents, n))


# From this many nodes the pointer-jumping words (about 13 + 3 * log2(T) launches) beat the row-by-row mask (4 per
# node) plus its packing (6).
_WORDS_MIN_NODES = 6


def _ancestor_words(parents: torch.Tensor, num_nodes: torch.Tensor) -> torch.Tensor:
    """``int64 [B, T]`` (``T <= 64``): bit j of row i is set iff node j is node i or one of its ancestors; padding rows
    are 0. Pointer jumping: after round k a row holds its ancestors up to 2^k levels up, so ceil(log2 T) rounds of
    two gathers cover any depth, where the row-by-row mask takes T - 1 dependent steps."""
    B, T = parents.shape
    idx = torch.arange(T, device=parents.device)
    valid = idx.unsqueeze(0) < num_nodes.to(torch.int64).unsqueeze(1)
    par = parents.to(torch.int64)
    # Roots, padding nodes and out-of-range entries point at themselves, so a jump from them goes nowhere.
    jump = torch.where(valid & (par >= 0) & (par < T), par, idx)
    words = bit_values(T, parents.device).expand(B, T)
    for _ in range((T - 1).bit_length()):
        words = words | words.gather(1, jump)
        jump = jump.gather(1, jump)
    return torch.where(valid, words, 0)
