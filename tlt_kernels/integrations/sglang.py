"""SGLang's EAGLE verification call shapes over :func:`tlt_kernels.verify_tree`, and our draft trees in its layout.

Terms (SGLang's): request ``b`` verifies ``T`` tree nodes; node 0 is the root (the last verified token) and
``candidates[b, i]`` the token of node ``i``. The tree is a linked list per node: ``retrive_next_token[b, i]``
is its first child and ``retrive_next_sibling[b, i]`` its next sibling (-1: none); siblings are tried in that list's
order. ``retrive_index[b, i]`` is node ``i``'s row in the flattened ``[B * T]`` arrays (``predicts``, and the
``target_predict`` / logits rows SGLang's kernels read). Outputs: ``accept_index [B, num_spec_steps]`` the flat
indices of the accepted path (root first, -1 after), ``accept_token_num [B]`` the accepted drafts, and
``predicts [B * T]``, where each path node's entry holds the token that followed it (the next accepted draft, or for
the last node the target's token); other entries are left as they were.

Rules (lossless only): greedy, a child is accepted when its token is its parent row's argmax (lowest id on ties);
sampled ("target only": the drafts come without a distribution), child ``x`` is accepted with probability ``p(x)``
of the current distribution and a rejection removes ``x`` from it (renormalized), the final token drawn from what
remains. SGLang's relaxed acceptance (``threshold_single`` / ``threshold_acc`` below 1) accepts tokens the target
would not emit at that rate, so it changes the output law: it is not offered. Randomness is ours (per-request Philox
``seed`` and ``offset`` instead of its uniform arrays), so sampled outputs have SGLang's law, not its samples.

Conversion: siblings in a linked list may come in any index order, while ``verify_tree`` tries children in
increasing index order with every parent before its children; the tree is renumbered in depth-first preorder
(siblings in list order), the logits rows gathered in that order, and the path mapped back. The renumbering is
``O(log T)`` small device ops by pointer jumping (no host sync; capturable).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..ops.verify_tree import verify_tree
from ..tree import resolve_num_nodes, tree_ancestor_mask, tree_depths

__all__ = ["verify_tree_greedy", "tree_speculative_sampling_target_only", "retrieval_arrays", "build_tree_outputs"]


def _rounds(T: int) -> int:
    """Pointer-jumping rounds for chains of up to ``T`` nodes: ``2 ** rounds >= T`` (``ceil(log2 T)``)."""
    return (T - 1).bit_length()


def _jump(pointer: torch.Tensor, rounds: int) -> torch.Tensor:
    """``pointer`` (``[B, W]``, values in ``[0, W)``) followed ``2 ** rounds`` times, by doubling."""
    for _ in range(rounds):
        pointer = pointer.gather(1, pointer)
    return pointer


def _padded(links: torch.Tensor) -> torch.Tensor:
    """``links [B, T]`` with none (-1) as ``T`` and a column ``T`` mapping none to none: gathers need no masks."""
    B, T = links.shape
    return torch.cat([torch.where(links >= 0, links, T), links.new_full((B, 1), T)], 1)


def _links(next_token: torch.Tensor, next_sibling: torch.Tensor) -> torch.Tensor:
    """``int64 [B, T]`` parent of each node from the first-child / next-sibling links (-1: root or unreachable)."""
    B, T = next_token.shape
    nodes = torch.arange(T, device=next_token.device).expand(B, T)
    unlinked = torch.full((B, T + 1), -1, dtype=torch.int64, device=next_token.device)
    target = lambda links: torch.where(links >= 0, links, T)  # noqa: E731  (-1 links write the dropped column T)
    first_child_of = unlinked.scatter(1, target(next_token), nodes)[:, :T]
    prev_sibling = unlinked.scatter(1, target(next_sibling), nodes)[:, :T]
    # Siblings share a parent: the one whose first child heads their list (the list's node with no predecessor).
    head = _jump(torch.where(prev_sibling >= 0, prev_sibling, nodes), _rounds(T))
    return first_child_of.gather(1, head)


def _preorder(next_token: torch.Tensor, next_sibling: torch.Tensor, parent: torch.Tensor) -> torch.Tensor:
    """``int64 [B, T]``: ``order[b, k]`` the node visited ``k``-th by a depth-first preorder from the root that
    takes children in list order (-1 past the reachable nodes)."""
    B, T = next_token.shape
    rounds = _rounds(T)
    nodes = torch.arange(T, device=next_token.device).expand(B, T)
    # Links below are padded (none: T, a fixed point). A node with a next sibling stops the climb; others go up.
    climb = _padded(torch.where(next_sibling >= 0, nodes, parent))
    has_next = _jump(climb, rounds)[:, :T]  # nearest ancestor-or-self with a next sibling (T: none)
    # succ(v): v's first child, else the next sibling of v or of its nearest ancestor that has one.
    succ = _padded(torch.where(next_token >= 0, next_token, _padded(next_sibling).gather(1, has_next)))
    # order[k] = succ^k(root), in doubling chunks: order[m:2m] = succ^m(order[:m]), then succ^m squared.
    order = torch.zeros(B, T, dtype=torch.int64, device=next_token.device)
    for r in range(rounds):
        m = 1 << r
        order[:, m:2 * m] = succ.gather(1, order[:, :min(m, T - m)])
        if r + 1 < rounds:
            succ = succ.gather(1, succ)
    return torch.where(order < T, order, -1)


def _as_tree(next_token, next_sibling):
    """``(order, parents int32 [B, T], num_nodes int32 [B])`` of the renumbered tree (see the module docstring)."""
    next_token, next_sibling = next_token.long(), next_sibling.long()
    parent = _links(next_token, next_sibling)
    order = _preorder(next_token, next_sibling, parent)
    B, T = order.shape
    new_index = torch.full((B, T + 1), -1, dtype=torch.int64, device=order.device)
    ranks = torch.arange(T, device=order.device).expand(B, T)
    new_index.scatter_(1, torch.where(order >= 0, order, T), ranks)
    old_parent = parent.gather(1, order.clamp(min=0))
    parents = torch.where(old_parent >= 0, new_index.gather(1, old_parent.clamp(min=0)), -1)
    parents = torch.where(order >= 0, parents, 0)  # padding nodes: any earlier node
    parents[:, 0] = -1
    return order, parents.to(torch.int32), (order >= 0).sum(1, dtype=torch.int32)


def _walk(candidates, retrive_index, retrive_next_token, retrive_next_sibling, target_logits, num_spec_steps: int,
          predicts, temperature, top_k, top_p, seed, offset, backend, validate):
    """Renumber, walk, map the path back: ``(predicts, accept_index, accept_token_num)``."""
    B, T = candidates.shape
    order, parents, num_nodes = _as_tree(retrive_next_token, retrive_next_sibling)
    rows = retrive_index.long().reshape(B, T)
    # The logits of node i sit at flat row retrive_index[b, i]; gathered in the new order.
    flat_logits = target_logits.reshape(-1, target_logits.shape[-1])
    node_rows = rows.gather(1, order.clamp(min=0))
    logits = flat_logits[node_rows.reshape(-1)].reshape(B, T, -1)
    tokens = candidates.long().gather(1, order.clamp(min=0))
    result = verify_tree(logits, tokens, parents, num_nodes=num_nodes, temperature=temperature, top_k=top_k,
                         top_p=top_p, seed=seed, offset=offset, validate=validate, backend=backend)
    # SGLang stops after num_spec_steps - 1 drafts. The walk's first tokens have the law (and, greedy, the values)
    # a walk stopped there would emit: its token after the last kept node is the target's draw (or argmax) there.
    num_accepted = result.num_accepted.long().clamp(max=num_spec_steps - 1)
    width = min(num_spec_steps, T)
    depth = torch.arange(width, device=candidates.device).unsqueeze(0)
    on_path = (depth <= num_accepted.unsqueeze(1)) & (result.error == 0).unsqueeze(1)
    path_flat = node_rows.gather(1, result.accepted_nodes[:, :width].long().clamp(min=0))  # new node -> flat row
    accept_index = torch.full((B, num_spec_steps), -1, dtype=torch.int32, device=candidates.device)
    accept_index[:, :width] = torch.where(on_path, path_flat, -1).to(torch.int32)
    if predicts is None:
        predicts = torch.full((B * T,), -1, dtype=torch.int32, device=candidates.device)
    target = torch.where(on_path, path_flat, predicts.numel())  # off-path writes land in a dropped slot
    padded = torch.cat([predicts, predicts.new_zeros(1)])
    padded.scatter_(0, target.reshape(-1), result.tokens[:, :width].reshape(-1).to(predicts.dtype))
    predicts.copy_(padded[:-1])
    accept_token_num = torch.where(result.error == 0, num_accepted, 0).to(torch.int32)
    return predicts, accept_index, accept_token_num


def _check(candidates, retrive_index, retrive_next_token, retrive_next_sibling, target_logits, num_spec_steps):
    if candidates.dim() != 2:
        raise ValueError(f"candidates must be [batch, num_draft_tokens], got {tuple(candidates.shape)}")
    B, T = candidates.shape
    for name, t in (("retrive_index", retrive_index), ("retrive_next_token", retrive_next_token),
                    ("retrive_next_sibling", retrive_next_sibling)):
        if tuple(t.shape) != (B, T) or t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32/int64 [{B}, {T}] like candidates, got {t.dtype} {tuple(t.shape)}")
    if target_logits.shape[:-1].numel() != B * T or target_logits.dim() not in (2, 3):
        raise ValueError(f"target_logits must be [{B * T}, vocab] or [{B}, {T}, vocab] (one row per node), got "
                         f"{tuple(target_logits.shape)}")
    if not isinstance(num_spec_steps, int) or num_spec_steps < 1:
        raise ValueError(f"num_spec_steps must be an int >= 1 (accept_index's width), got {num_spec_steps!r}")


def verify_tree_greedy(candidates: torch.Tensor, retrive_index: torch.Tensor, retrive_next_token: torch.Tensor,
                       retrive_next_sibling: torch.Tensor, target_logits: torch.Tensor, num_spec_steps: int,
                       predicts: Optional[torch.Tensor] = None, backend: str = "auto",
                       validate: bool = True) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SGLang's greedy EAGLE verification, from the target's logits (SGLang passes their argmax).

    Args:
        candidates: ``int [B, T]`` node tokens (node 0 the root). retrive_index, retrive_next_token,
            retrive_next_sibling: ``int [B, T]`` as in the module docstring.
        target_logits: ``[B * T, V]`` or ``[B, T, V]``: row ``retrive_index[b, i]`` scores node ``i``'s children.
        num_spec_steps: ``accept_index``'s width (the path's nodes, root included).
        predicts: optional ``int32 [B * T]`` to write the path's tokens into (others untouched); new (-1) if None.

    Returns:
        ``(predicts int32 [B * T], accept_index int32 [B, num_spec_steps], accept_token_num int32 [B])``.
    """
    _check(candidates, retrive_index, retrive_next_token, retrive_next_sibling, target_logits, num_spec_steps)
    return _walk(candidates, retrive_index, retrive_next_token, retrive_next_sibling, target_logits, num_spec_steps,
                 predicts, None, None, None, 0, 0, backend, validate)


def tree_speculative_sampling_target_only(
    candidates: torch.Tensor, retrive_index: torch.Tensor, retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor, target_logits: torch.Tensor, num_spec_steps: int, temperature=1.0,
    top_k=None, top_p=None, seed=0, offset=0, predicts: Optional[torch.Tensor] = None, backend: str = "auto",
    validate: bool = True,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SGLang's sampled EAGLE verification ("target only": drafts without a distribution), lossless.

    Same tree arguments and outputs as :func:`verify_tree_greedy`. Instead of SGLang's target probabilities and
    uniform arrays: the target's logits with per-request ``temperature`` / ``top_k`` / ``top_p`` (as
    :func:`tlt_kernels.verify_tree` takes them; SGLang renormalizes its probabilities by them first) and a
    per-request Philox ``seed`` / ``offset`` (advance ``offset`` every step). SGLang's ``threshold_single`` /
    ``threshold_acc`` are not offered: below 1 they accept tokens the target would not emit at that rate (lossy).
    """
    _check(candidates, retrive_index, retrive_next_token, retrive_next_sibling, target_logits, num_spec_steps)
    return _walk(candidates, retrive_index, retrive_next_token, retrive_next_sibling, target_logits, num_spec_steps,
                 predicts, temperature, top_k, top_p, seed, offset, backend, validate)


def retrieval_arrays(parents: torch.Tensor, num_nodes: Optional[torch.Tensor] = None):
    """Our tree (``parents int32 [B, T]``, topologically ordered, as :func:`tlt_kernels.build_draft_tree` returns
    it) in SGLang's layout: ``(retrive_index, retrive_next_token, retrive_next_sibling)`` int64 ``[B, T]`` (flat rows
    ``b * T + i``; children listed in increasing index order, the order our walk tries them; padding nodes -1)
    and the depth of every node (``int32 [B, T]``: positions are ``seq_lens[b] + depth``; the attention mask is
    :func:`tlt_kernels.tree_ancestor_mask`)."""
    n = resolve_num_nodes(parents, num_nodes)
    B, T = parents.shape
    dev = parents.device
    index = torch.arange(T, device=dev)
    valid = index.unsqueeze(0) < n.unsqueeze(1)
    parent = torch.where(valid, parents.long(), -2)  # padding: nobody's child
    # child j of p lies after p; its next sibling is the smallest k > j with the same parent.
    same_parent = (parent.unsqueeze(2) == parent.unsqueeze(1)) & (parent.unsqueeze(2) >= 0)
    later = index.view(1, 1, T) > index.view(1, T, 1)
    sibling = torch.where(same_parent & later, index.view(1, 1, T), T).amin(2)
    is_child = parent.unsqueeze(1) == index.view(1, T, 1)  # [b, p, j]: j's parent is p
    first = torch.where(is_child, index.view(1, 1, T), T).amin(2)
    none = lambda t: torch.where((t < T) & valid, t, -1)  # noqa: E731
    retrive_index = torch.where(valid, torch.arange(B, device=dev).unsqueeze(1) * T + index, -1)
    return retrive_index, none(first), none(sibling), tree_depths(parents, n)


def build_tree_outputs(parents: torch.Tensor, num_nodes: Optional[torch.Tensor], seq_lens: torch.Tensor,
                       seq_lens_sum: Optional[int] = None):
    """Our tree (``parents int32 [B, T]``, e.g. :func:`tlt_kernels.build_draft_tree`'s) as SGLang's tree builder
    returns it: ``(tree_mask, positions, retrive_index, retrive_next_token, retrive_next_sibling)``.

    ``positions`` int64 ``[B * T]``: ``seq_lens[b] + depth``. ``tree_mask`` bool, flat: with ``seq_lens_sum`` (the
    host int ``sum(seq_lens)``, as SGLang passes it) its full-mask layout, request after request ``T`` rows of
    ``seq_lens[b] + T`` entries (the whole prefix, then the node's ancestors and itself); without it the
    query-length-only layout ``[B, T, T]``. Padding nodes' rows and columns are False. The retrieval arrays are
    :func:`retrieval_arrays`'. Device ops only (no host sync)."""
    n = resolve_num_nodes(parents, num_nodes)
    B, T = parents.shape
    index, next_token, next_sibling, depths = retrieval_arrays(parents, n)
    positions = (seq_lens.long().unsqueeze(1) + depths.long()).reshape(-1)
    ancestors = tree_ancestor_mask(parents, n)
    if seq_lens_sum is None:
        return ancestors.reshape(-1), positions, index, next_token, next_sibling
    return _full_mask(ancestors, n, seq_lens.long(), int(seq_lens_sum)), positions, index, next_token, next_sibling


def _full_mask(ancestors: torch.Tensor, num_nodes: torch.Tensor, seq_lens: torch.Tensor,
               seq_lens_sum: int) -> torch.Tensor:
    """SGLang's full tree mask from ``ancestors bool [B, T, T]``: each request's ``T`` rows of ``L_b + T``."""
    B, T, _ = ancestors.shape
    dev = ancestors.device
    row_len = seq_lens + T
    block = T * row_len
    starts = torch.cumsum(block, 0) - block
    flat = torch.arange(T * seq_lens_sum + B * T * T, device=dev)
    b = torch.searchsorted(starts, flat, right=True) - 1
    local = flat - starts[b]
    i, col = local // row_len[b], local % row_len[b]
    in_prefix = col < seq_lens[b]
    j = (col - seq_lens[b]).clamp(min=0, max=T - 1)
    return torch.where(in_prefix, i < num_nodes.long()[b], ancestors[b, i.clamp(max=T - 1), j])
