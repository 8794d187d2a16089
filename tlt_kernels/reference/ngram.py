"""Reference n-gram (prompt-lookup) drafting from each request's own history (pure torch).

For request ``b`` with history ``h = tokens[b, :len]``: an n-gram *occurrence* of the suffix
``h[len-n:]`` is a start ``s`` with ``h[s:s+n] == h[len-n:]`` and ``s + n <= len - 1`` (strictly
before the suffix itself, overlaps allowed, at least one token follows it). It is convenient to
index occurrences by their last position ``e = s + n - 1 <= len - 2``: ``e`` ends an occurrence of
every ``n <= m(e)``, where ``m(e)`` is the length of the common suffix of ``h[:e+1]`` and ``h``.
The continuation of an occurrence is ``h[e+1 : min(e+1+k, len)]``.
"""
from __future__ import annotations

import torch


def match_lengths(tokens: torch.Tensor, lengths: torch.Tensor, max_n: int) -> torch.Tensor:
    """``int64 [B, L]``: ``m(e)`` capped at ``max_n`` for ``e <= len - 2``, else 0."""
    B, L = tokens.shape
    dev = tokens.device
    lens = lengths.to(torch.int64).unsqueeze(1)
    i = torch.arange(max_n, device=dev)
    # suffix[b, i] = h[len-1-i]: the history read backwards from its last token.
    suf_pos = lens - 1 - i
    suffix = tokens.gather(1, suf_pos.clamp(min=0))
    e = torch.arange(L, device=dev)
    pos = e.view(1, L, 1) - i.view(1, 1, max_n)  # [1, L, max_n]: h[e-i]
    back = tokens.gather(1, pos.clamp(min=0).expand(B, L, max_n).reshape(B, L * max_n)).view(B, L, max_n)
    eq = (back == suffix.unsqueeze(1)) & (pos >= 0) & (suf_pos >= 0).unsqueeze(1)
    m = torch.cumprod(eq.to(torch.int64), dim=2).sum(dim=2)  # leading run of equalities
    return torch.where(e.unsqueeze(0) <= lens - 2, m, torch.zeros_like(m))


def _best_n(m: torch.Tensor, min_n: int, max_n: int):
    """Longest ``n`` in ``[min_n, max_n]`` with an occurrence (0 if none), and ``m >= n`` for it."""
    best_n = torch.zeros(m.shape[0], dtype=torch.int64, device=m.device)
    for n in range(min_n, max_n + 1):
        best_n = torch.where((m >= n).any(dim=1), torch.full_like(best_n, n), best_n)
    hits = (m >= best_n.unsqueeze(1)) & (best_n > 0).unsqueeze(1)
    return best_n, hits


def _continuations(tokens, lens, ends, k):
    """Tokens following each end position: ``(int64 [B, R, k], counts int64 [B, R])``; ``ends`` -1 = none."""
    start = ends + 1
    count = torch.where(ends >= 0, (lens.unsqueeze(1) - start).clamp(min=0, max=k), torch.zeros_like(ends))
    j = torch.arange(k, device=tokens.device)
    pos = (start.unsqueeze(2) + j).clamp(max=tokens.shape[1] - 1)
    B, R = ends.shape
    cont = tokens.gather(1, pos.reshape(B, R * k)).view(B, R, k)
    return cont, count


def ngram_propose(tokens: torch.Tensor, lengths: torch.Tensor, k: int, min_n: int, max_n: int):
    """See :func:`tlt_kernels.ngram_propose`; returns ``(drafts int64 [B, k], num_drafts int32 [B])``."""
    B, L = tokens.shape
    tokens = tokens.to(torch.int64)
    lens = lengths.to(torch.int64)
    m = match_lengths(tokens, lengths, max_n)
    _, hits = _best_n(m, min_n, max_n)
    e = torch.arange(L, device=tokens.device)
    last = torch.where(hits, e, torch.full_like(e, -1).expand(B, L)).max(dim=1).values
    cont, count = _continuations(tokens, lens, last.unsqueeze(1), k)
    j = torch.arange(k, device=tokens.device)
    drafts = torch.where(j < count, cont[:, 0], torch.full_like(cont[:, 0], -1))
    return drafts, count[:, 0].to(torch.int32)


def ngram_propose_tree(tokens: torch.Tensor, lengths: torch.Tensor, k: int, num_branches: int, min_n: int, max_n: int):
    """See :func:`tlt_kernels.ops.ngram.ngram_propose_tree`; returns ``(parents, draft_tokens, num_nodes)``.

    Continuations of the ``num_branches`` most recent occurrences of the longest matching n-gram are
    merged into a trie under the root (the last token). A node ``(r, j)`` (branch r, depth j) is a
    duplicate when an earlier branch ``r' < r`` has the same ``j + 1`` first tokens; new nodes are
    numbered branch-major, which is topological because a node's parent is either the same branch one
    step up or a node of an earlier branch.
    """
    B, L = tokens.shape
    R = num_branches
    dev = tokens.device
    tokens = tokens.to(torch.int64)
    lens = lengths.to(torch.int64)
    m = match_lengths(tokens, lengths, max_n)
    _, hits = _best_n(m, min_n, max_n)
    e = torch.arange(L, device=dev)
    ends_all = torch.where(hits, e, torch.full_like(e, -1).expand(B, L))
    if L < R:
        ends_all = torch.cat([ends_all, torch.full((B, R - L), -1, device=dev, dtype=torch.int64)], dim=1)
    ends = ends_all.topk(R, dim=1).values  # most recent first; -1 = no branch
    cont, count = _continuations(tokens, lens, ends, k)  # [B, R, k]
    last_token = tokens.gather(1, (lens - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    return merge_trie(cont, count, torch.where(lens > 0, last_token, torch.zeros_like(last_token)))


def merge_trie(cont: torch.Tensor, count: torch.Tensor, roots: torch.Tensor):
    """The trie of ``R`` continuations (``cont`` int64 ``[B, R, k]``, the first ``count[b, r]`` valid) under
    ``roots`` int64 ``[B]``: ``(parents int32 [B, 1 + R*k], draft_tokens int64, num_nodes int32 [B])`` (see
    :func:`ngram_propose_tree`)."""
    B, R, k = cont.shape
    dev = cont.device
    T = 1 + R * k
    j = torch.arange(k, device=dev)
    valid = j.view(1, 1, k) < count.unsqueeze(2)  # [B, R, k]
    # same[b, r, r2, j]: branches r and r2 share their first j+1 tokens (both long enough).
    eq = (cont.unsqueeze(2) == cont.unsqueeze(1)) & valid.unsqueeze(2) & valid.unsqueeze(1)
    same = torch.cumprod(eq.to(torch.int64), dim=3).bool()
    canon = same.to(torch.int64).argmax(dim=2)  # first r2 sharing the prefix; r itself when new
    is_new = valid & (canon == torch.arange(R, device=dev).view(1, R, 1))
    node = torch.cumsum(is_new.reshape(B, R * k).to(torch.int64), dim=1).view(B, R, k)  # 1-based ids
    node = node * is_new
    # Parent of new node (r, j): root for j = 0, else the node that represents (r, j-1).
    canon_up = canon[:, :, :-1]
    up = node[:, :, :-1].reshape(B, R * (k - 1))
    # reshape(B, -1) cannot infer a size from an empty batch: name it.
    parent_prev = up.gather(1, (canon_up * (k - 1) + j[:-1].view(1, 1, -1)).reshape(B, R * (k - 1))).view(B, R, k - 1)
    par = torch.cat([torch.zeros(B, R, 1, dtype=torch.int64, device=dev), parent_prev], dim=2)
    dst = torch.where(is_new, node, torch.full_like(node, T)).reshape(B, R * k)
    parents = torch.zeros(B, T + 1, dtype=torch.int64, device=dev).scatter_(1, dst, par.reshape(B, R * k))[:, :T]
    draft = torch.zeros(B, T + 1, dtype=torch.int64, device=dev).scatter_(1, dst, cont.reshape(B, R * k))[:, :T]
    parents[:, 0] = -1
    draft[:, 0] = roots
    num_nodes = (1 + is_new.sum(dim=(1, 2))).to(torch.int32)
    return parents.to(torch.int32), draft, num_nodes
