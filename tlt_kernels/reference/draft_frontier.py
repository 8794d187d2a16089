"""Reference of one expansion step's bookkeeping in an EAGLE-2 draft (pure torch, CPU and GPU).

A draft step expands the ``K`` frontier nodes into ``C`` children each (the top ``C`` tokens of each node's next-token
distribution). Every child becomes a candidate of the draft, scored by its cumulative log-probability (its parent's
score plus its own log-probability); the ``keep`` best children, ranked as :func:`rank_descending` ranks (largest
first, ties by child index ``parent * C + c``, the lower first), form the next frontier, and the next layer's input
of each is its token's embedding beside its parent's predicted feature.
"""
from __future__ import annotations

import torch

from ..tree import bit_values
from .top_logprobs import rank_descending


def draft_frontier(parent_scores, parent_index, child_logprobs, child_tokens, features, embed_weight, keep: int,
                   first_index: int, first_row: int, ancestor_words=None):
    """Shapes and dtypes: :func:`tlt_kernels.ops.draft_frontier.draft_frontier`. Returns the 7-tuple
    ``(cand_parents, cand_scores, scores, tokens, cand_index, parent_rows, inputs)``; writes the kept children's
    ``ancestor_words`` in place when given."""
    B, K, C = child_logprobs.shape
    H = features.shape[-1]
    cand_scores = (parent_scores.unsqueeze(2) + child_logprobs).reshape(B, K * C)
    cand_parents = parent_index.unsqueeze(2).expand(B, K, C).reshape(B, K * C).to(torch.int32)
    best = rank_descending(cand_scores)[:, :keep]  # [B, keep] child indices
    parent = best // C
    tokens = child_tokens.reshape(B, K * C).gather(1, best)
    parent_features = features.gather(1, parent.unsqueeze(2).expand(B, keep, H))
    emb = embed_weight[tokens].to(features.dtype)
    inputs = torch.cat([emb, parent_features], -1)
    if ancestor_words is not None:  # kept child p becomes node first_row + K + p: its parent's word and its own bit
        own = first_row + K + torch.arange(keep, device=best.device)
        bits = bit_values(8 * ancestor_words.element_size(), best.device, ancestor_words.dtype)[own]
        ancestor_words[:, own] = ancestor_words.gather(1, first_row + parent) | bits
    return (cand_parents, cand_scores.contiguous(), cand_scores.gather(1, best), tokens, first_index + best,
            first_row + parent, inputs)
