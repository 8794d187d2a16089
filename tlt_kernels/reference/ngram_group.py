"""Reference n-gram drafting across a request's group (pure torch).

GRPO samples ``G`` responses per prompt; in the tail a straggler's siblings have finished, and their text is a draft
source its own history cannot match. ``siblings int [B, S]`` lists, per request, the rows whose histories it may
draw from besides its own (-1 = empty slot; its own row there is ignored). Sources are ranked: the request's own
history first, then its siblings in the order given. The rule extends :mod:`tlt_kernels.reference.ngram`:

* an occurrence in source row ``r`` ends at ``e <= len_r - 2`` (a token follows it) and has length ``m_r(e)``, the
  common suffix of ``tokens[r, :e+1]`` and the request's history, capped at ``max_n``;
* the n-gram size is the longest ``n`` in ``[min_n, max_n]`` with an occurrence in any source;
* the chain takes the first-ranked source holding an occurrence of that ``n``, its most recent one, and proposes
  the up-to-``k`` tokens after it; the tree takes the first ``num_branches`` occurrences in (source rank, most
  recent first) order and merges their continuations into a trie.

Without siblings (``S = 0``, or only empty slots) this is :func:`~tlt_kernels.reference.ngram.ngram_propose`.
Memory: ``O(B * (1 + S) * L * max_n)``; no host sync.
"""
from __future__ import annotations

import torch

from .ngram import _best_n, merge_trie


def source_match_lengths(tokens: torch.Tensor, lengths: torch.Tensor, siblings: torch.Tensor, max_n: int):
    """``(m int64 [B, 1+S, L], sources int64 [B, 1+S])``: ``m[b, s, e]`` is the match length of the occurrence
    ending at ``e`` in source ``s`` of request ``b`` (source 0: its own row), 0 where none or the slot is empty."""
    B, L = tokens.shape
    dev = tokens.device
    own = torch.arange(B, device=dev).unsqueeze(1)
    sources = torch.cat([own, siblings.to(torch.int64)], 1)
    usable = (sources >= 0) & ((sources != own) | (torch.arange(sources.shape[1], device=dev) == 0))
    sources = sources.clamp(min=0)
    candidates, source_lens = tokens[sources], lengths.to(torch.int64)[sources]  # [B, 1+S, L], [B, 1+S]
    i = torch.arange(max_n, device=dev)
    suf_pos = lengths.to(torch.int64).unsqueeze(1) - 1 - i  # the request's history read backwards
    suffix = tokens.gather(1, suf_pos.clamp(min=0))  # [B, max_n]
    e = torch.arange(L, device=dev)
    pos = e.view(L, 1) - i.view(1, max_n)
    index = pos.clamp(min=0).reshape(1, 1, L * max_n).expand(B, sources.shape[1], L * max_n)
    back = candidates.gather(2, index).view(B, sources.shape[1], L, max_n)
    eq = (back == suffix.view(B, 1, 1, max_n)) & (pos >= 0) & (suf_pos >= 0).view(B, 1, 1, max_n)
    m = torch.cumprod(eq.to(torch.int64), dim=3).sum(dim=3)  # the leading run of equal tokens
    followed = e.view(1, 1, L) <= source_lens.unsqueeze(2) - 2
    return torch.where(followed & usable.unsqueeze(2), m, torch.zeros_like(m)), sources


def _ranked_occurrences(tokens, lengths, siblings, num_branches: int, min_n: int, max_n: int):
    """The first ``num_branches`` occurrences of the longest n in (source, most recent) order: ``(rows int64
    [B, R], ends int64 [B, R])``, end -1 where there are fewer."""
    B, L = tokens.shape
    m, sources = source_match_lengths(tokens, lengths, siblings, max_n)
    num_sources = sources.shape[1]
    _, hits = _best_n(m.reshape(B, num_sources * L), min_n, max_n)
    # Rank: source first, then the latest end; a larger score is earlier.
    e = torch.arange(L, device=tokens.device)
    rank = (num_sources - 1 - torch.arange(num_sources, device=tokens.device)).view(1, -1, 1) * L + e
    score = torch.where(hits, rank.reshape(1, -1).expand(B, -1), torch.full_like(hits, -1, dtype=torch.int64))
    if score.shape[1] < num_branches:
        pad = torch.full((B, num_branches - score.shape[1]), -1, dtype=torch.int64, device=tokens.device)
        score = torch.cat([score, pad], 1)
    best, where = score.topk(num_branches, dim=1)
    slot, ends = (where // L).clamp(max=num_sources - 1), where % L
    return sources.gather(1, slot), torch.where(best >= 0, ends, torch.full_like(ends, -1))


def _continuations(tokens, lengths, rows, ends, k: int):
    """Up to ``k`` tokens after each ``(row, end)``: ``(int64 [B, R, k], counts int64 [B, R])``; end -1 = none."""
    start = ends + 1
    count = torch.where(ends >= 0, (lengths.to(torch.int64)[rows] - start).clamp(min=0, max=k), torch.zeros_like(ends))
    pos = (start.unsqueeze(2) + torch.arange(k, device=tokens.device)).clamp(max=tokens.shape[1] - 1)
    return tokens[rows.unsqueeze(2), pos], count


def ngram_propose_group(tokens, lengths, siblings, k: int, min_n: int, max_n: int):
    """See :func:`tlt_kernels.ngram_propose` (``siblings=``): ``(drafts int64 [B, k], num_drafts int32 [B])``."""
    tokens = tokens.to(torch.int64)
    rows, ends = _ranked_occurrences(tokens, lengths, siblings, 1, min_n, max_n)
    cont, count = _continuations(tokens, lengths, rows, ends, k)
    j = torch.arange(k, device=tokens.device)
    drafts = torch.where(j < count, cont[:, 0], torch.full_like(cont[:, 0], -1))
    return drafts, count[:, 0].to(torch.int32)


def ngram_propose_tree_group(tokens, lengths, siblings, k: int, num_branches: int, min_n: int, max_n: int):
    """See :func:`tlt_kernels.ngram_propose_tree` (``siblings=``): ``(parents, draft_tokens, num_nodes)``."""
    tokens = tokens.to(torch.int64)
    rows, ends = _ranked_occurrences(tokens, lengths, siblings, num_branches, min_n, max_n)
    cont, count = _continuations(tokens, lengths, rows, ends, k)
    lens = lengths.to(torch.int64)
    last = tokens.gather(1, (lens - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    return merge_trie(cont, count, torch.where(lens > 0, last, torch.zeros_like(last)))
