"""``ngram_propose`` / ``ngram_propose_tree``: model-free drafts from each request's own history, or from its
group's (``siblings=``)."""
from __future__ import annotations

from typing import NamedTuple

import torch

from .._backend import register_op
from .._validation import capturing, check_int, check_tensor, dense


class NGramDrafts(NamedTuple):
    drafts: torch.Tensor  # int64 [B, k], -1 past num_drafts[b]
    num_drafts: torch.Tensor  # int32 [B]


class NGramTree(NamedTuple):
    parents: torch.Tensor  # int32 [B, 1 + num_branches * k], tlt_kernels.tree format
    draft_tokens: torch.Tensor  # int64 [B, 1 + num_branches * k]; node 0 = last history token
    num_nodes: torch.Tensor  # int32 [B]


_NGRAM = register_op(
    "ngram_propose",
    {"torch": "tlt_kernels.reference.ngram:ngram_propose", "triton": "tlt_kernels._triton.ngram:ngram_propose"},
    preference=("triton", "torch"),
)
_NGRAM_GROUP = register_op(
    "ngram_propose_group",
    {"torch": "tlt_kernels.reference.ngram_group:ngram_propose_group",
     "triton": "tlt_kernels._triton.ngram_group:ngram_propose_group"},
    preference=("triton", "torch"),
)
_NGRAM_TREE_GROUP = register_op(
    "ngram_propose_tree_group",
    {"torch": "tlt_kernels.reference.ngram_group:ngram_propose_tree_group",
     "triton": "tlt_kernels._triton.ngram_group:ngram_propose_tree_group"},
    preference=("triton", "torch"),
)
_NGRAM_TREE = register_op(
    "ngram_propose_tree",
    {"torch": "tlt_kernels.reference.ngram:ngram_propose_tree", "triton": "tlt_kernels._triton.ngram:ngram_propose_tree"},
    preference=("triton", "torch"),
)


def _check_inputs(tokens, lengths, k, min_n, max_n, validate):
    check_tensor("tokens", tokens, dtype=(torch.int32, torch.int64), ndim=2)
    B, L = tokens.shape
    if L < 1:
        raise ValueError(f"tokens must hold at least one position per request, got shape {tuple(tokens.shape)}")
    check_tensor("lengths", lengths, dtype=(torch.int32, torch.int64), shape=(B,), device=tokens.device)
    check_int("k", k, 1)
    check_int("min_n", min_n, 1)
    check_int("max_n", max_n, 1)
    if min_n > max_n:
        raise ValueError(f"min_n must be <= max_n, got min_n={min_n} > max_n={max_n}")
    if validate and not capturing(tokens.device):
        lens = lengths.cpu()
        bad = ((lens < 0) | (lens > L)).nonzero()
        if bad.numel():
            b = int(bad[0, 0])
            raise ValueError(f"lengths[{b}] = {int(lens[b])} is outside [0, L={L}] (L = tokens.shape[1])")


def _check_siblings(siblings, tokens, validate: bool, backend: str):
    """``siblings`` int ``[B, S]`` on ``tokens``' device, each in ``[-1, B)`` (values read only when ``validate``);
    ``backend`` one the group paths have."""
    backends = ("auto", "torch", "triton")
    B = tokens.shape[0]
    check_tensor("siblings", siblings, dtype=(torch.int32, torch.int64), ndim=2, device=tokens.device)
    if siblings.shape[0] != B:
        raise ValueError(f"siblings must have one row per request ({B}), got shape {tuple(siblings.shape)}")
    if backend not in backends:
        raise ValueError(f"siblings= runs on the backends {backends} here, got backend={backend!r}")
    if validate and not capturing(tokens.device) and siblings.numel():
        values = siblings.cpu()
        bad = ((values < -1) | (values >= B)).nonzero()
        if bad.numel():
            b, s = (int(v) for v in bad[0])
            raise ValueError(f"siblings[{b}, {s}] = {int(values[b, s])} is outside [-1, B={B}) (-1 = empty slot)")


def ngram_propose(tokens, lengths, k: int, min_n: int = 1, max_n: int = 4, validate: bool = True, backend: str = "auto",
                  siblings=None) -> NGramDrafts:
    """Propose up to ``k`` draft tokens per request by prompt lookup in its own history.

    For request ``b`` (history ``h = tokens[b, :lengths[b]]``), find the longest ``n`` in
    ``[min_n, max_n]`` whose suffix ``h[len-n:]`` occurred earlier -- at a start ``s`` with
    ``s + n <= len - 1`` (before the suffix's own position; overlaps allowed) -- take the most recent
    such occurrence (largest ``s``) and propose ``h[s+n : min(s+n+k, len)]``. No match: 0 drafts.

    Args:
        tokens: ``int64`` or ``int32 [B, L]`` histories, the first ``lengths[b]`` entries valid.
        lengths: ``int32`` or ``int64 [B]``, each in ``[0, L]``.
        k: maximum number of drafts per request.
        min_n, max_n: n-gram sizes tried, ``1 <= min_n <= max_n``.
        validate: check ``lengths``' values (reads them on the host; skipped under CUDA-graph capture).
        backend: ``"auto"``, ``"torch"`` or ``"triton"``.
        siblings: ``int32``/``int64 [B, S]`` or None: the rows whose histories request ``b`` may also draw from
            (its group's other responses, finished ones included; -1 = empty slot). The longest ``n`` is then
            searched in every source; its occurrence comes from the request's own history when it has one, else
            from the first sibling (in the order given) that has one, most recent first
            (:mod:`tlt_kernels.reference.ngram_group`); one Triton launch (``tlt_kernels._triton.ngram_group``),
            or the torch reference (chain and tree alike).

    Returns:
        :class:`NGramDrafts` ``(drafts int64 [B, k], -1 padded; num_drafts int32 [B])``.
    """
    _check_inputs(tokens, lengths, k, min_n, max_n, validate)
    if siblings is not None:
        _check_siblings(siblings, tokens, validate, backend)
        _, fn = _NGRAM_GROUP.resolve(backend, tokens.device)
        return NGramDrafts(*fn(dense(tokens), dense(lengths), dense(siblings), k, min_n, max_n))
    _, fn = _NGRAM.resolve(backend, tokens.device)
    drafts, num = fn(dense(tokens), dense(lengths), k, min_n, max_n)
    return NGramDrafts(drafts, num)


def ngram_propose_tree(
    tokens, lengths, k: int, num_branches: int, min_n: int = 1, max_n: int = 4, validate: bool = True, backend: str = "auto",
    siblings=None,
) -> NGramTree:
    """Propose a token tree from several earlier occurrences of the longest matching n-gram.

    The longest ``n`` is chosen as in :func:`ngram_propose`; the continuations (up to ``k`` tokens)
    of its ``num_branches`` most recent occurrences (distinct starts, most recent first) are merged
    into a trie rooted at the last history token: continuations sharing a prefix share nodes. Nodes
    are numbered in insertion order (branch by branch, then by depth), which is topological.

    Args:
        tokens, lengths, k, min_n, max_n, validate, backend, siblings: as in :func:`ngram_propose` (with
            siblings, the branches are the first ``num_branches`` occurrences in (own history, then siblings in
            order; most recent first) order).
        num_branches: number of occurrences used, ``>= 1``.

    Returns:
        :class:`NGramTree` ``(parents int32 [B, T], draft_tokens int64 [B, T], num_nodes int32 [B])``
        with ``T = 1 + num_branches * k`` in the format of :mod:`tlt_kernels.tree`: node 0 is the
        root (``draft_tokens[b, 0]`` = the last history token, 0 for an empty history); padding
        nodes (index >= ``num_nodes[b]``) hold parent 0 and token 0. No match: ``num_nodes = 1``.
    """
    _check_inputs(tokens, lengths, k, min_n, max_n, validate)
    check_int("num_branches", num_branches, 1)
    if siblings is not None:
        _check_siblings(siblings, tokens, validate, backend)
        _, fn = _NGRAM_TREE_GROUP.resolve(backend, tokens.device)
        return NGramTree(*fn(dense(tokens), dense(lengths), dense(siblings), k, num_branches, min_n, max_n))
    _, fn = _NGRAM_TREE.resolve(backend, tokens.device)
    return NGramTree(*fn(dense(tokens), dense(lengths), k, num_branches, min_n, max_n))
