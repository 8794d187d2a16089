"""Triton draft-frontier step: an EAGLE-2 expansion step's candidates, next frontier and next inputs in one launch.

Grid ``(B, max(K, keep))``. Program ``(b, p)`` writes parent ``p``'s ``C`` candidates (cumulative scores and parent
index) when ``p < K``, and slot ``p`` of the next frontier when ``p < keep``: it ranks all ``K * C`` children by rank
key (:mod:`.rank_keys`; each program ranks them again, a few hundred values at most, rather than wait on another
program), takes the ``p``-th, and copies its token's embedding row and its parent's feature row into the next input;
given the draft's ancestor words, it also writes its kept child's (the parent's word with the child's own bit). The
kept score is recomputed from its two terms (the same fp32 add as the candidate's: the same bits, ``-0.0`` and NaN
payloads included). Values are upcast to fp32 as loaded (the interpreter computes bf16 arithmetic as zeros); an
embedding row of another dtype rounds to the features' dtype to nearest even, as torch casts (:mod:`.rounding`).

Eager calls launch directly; otherwise the launch runs inside the custom op ``tlt::draft_frontier`` (or
``tlt::draft_frontier_words``, which also writes the ancestor words; fake implementations for ``torch.compile``; no
host sync).
"""
from __future__ import annotations

from typing import Tuple

import torch
import triton
import triton.language as tl

from .._backend import direct_dispatch_ok
from .rank_keys import MIN_KEY, key_index, largest, rank_keys
from .rounding import hand_round, round_to

MAX_BLOCK_H = 1024  # feature columns copied per loop trip


@triton.jit
def _store_candidates(ParentScores, ParentIndex, ChildLogp, CandParents, CandScores, b, p, s_ps0, s_ps1, s_pi0,
                      s_pi1, s_cl0, s_cl1, K: tl.constexpr, C: tl.constexpr, C_P: tl.constexpr):
    """Parent ``p``'s C children as candidates: cumulative score and the parent's candidate index."""
    c = tl.arange(0, C_P)
    mask = c < C
    score = (tl.load(ParentScores + b * s_ps0 + p * s_ps1)
             + tl.load(ChildLogp + b * s_cl0 + p * s_cl1 + c, mask=mask, other=0.0))
    out = b * (K * C) + p * C + c
    tl.store(CandScores + out, score, mask=mask)
    parent = tl.load(ParentIndex + b * s_pi0 + p * s_pi1).to(tl.int32)
    tl.store(CandParents + out, tl.zeros([C_P], tl.int32) + parent, mask=mask)


@triton.jit
def _kept_child(ParentScores, ChildLogp, b, p, s_ps0, s_ps1, s_cl0, s_cl1, K: tl.constexpr, C: tl.constexpr,
                KC_P: tl.constexpr, KEEP: tl.constexpr, KEEP_P: tl.constexpr):
    """The child index ``parent * C + c`` of rank ``p`` among the K * C children."""
    i = tl.arange(0, KC_P)
    valid = i < K * C
    parent, child = i // C, i % C
    cum = (tl.load(ParentScores + b * s_ps0 + parent * s_ps1, mask=valid, other=0.0)
           + tl.load(ChildLogp + b * s_cl0 + parent * s_cl1 + child, mask=valid, other=0.0))
    keys = tl.where(valid, rank_keys(cum, i), MIN_KEY)
    slots = tl.arange(0, KEEP_P)
    best = largest(keys, slots, KEEP)
    return key_index(tl.max(tl.where(slots == p, best, MIN_KEY), 0))


@triton.jit
def _draft_frontier_kernel(ParentScores, ParentIndex, ChildLogp, ChildTok, Features, Embed,
                           CandParents, CandScores, Scores, Tokens, CandIndex, ParentRows, Inputs, Words,
                           s_ps0, s_ps1, s_pi0, s_pi1, s_cl0, s_cl1, s_ct0, s_ct1, s_f0, s_f1, s_e0, s_w0,
                           first_index, first_row, H,
                           K: tl.constexpr, C: tl.constexpr, C_P: tl.constexpr, KC_P: tl.constexpr,
                           KEEP: tl.constexpr, KEEP_P: tl.constexpr, BLOCK_H: tl.constexpr, H_TILES: tl.constexpr,
                           HAND_ROUND: tl.constexpr, HAS_WORDS: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    if p < K:
        _store_candidates(ParentScores, ParentIndex, ChildLogp, CandParents, CandScores, b, p, s_ps0, s_ps1, s_pi0,
                          s_pi1, s_cl0, s_cl1, K, C, C_P)
    if p < KEEP:
        idx = _kept_child(ParentScores, ChildLogp, b, p, s_ps0, s_ps1, s_cl0, s_cl1, K, C, KC_P, KEEP, KEEP_P)
        parent = idx // C
        score = (tl.load(ParentScores + b * s_ps0 + parent * s_ps1)
                 + tl.load(ChildLogp + b * s_cl0 + parent * s_cl1 + idx % C))
        token = tl.load(ChildTok + b * s_ct0 + parent * s_ct1 + idx % C)
        slot = b * KEEP + p
        tl.store(Scores + slot, score)
        tl.store(Tokens + slot, token)
        tl.store(CandIndex + slot, first_index + idx)
        tl.store(ParentRows + slot, first_row + parent)
        if HAS_WORDS:  # the kept child becomes node first_row + K + p: its parent's ancestor word and its own bit
            own = first_row + K + p
            word = tl.load(Words + b * s_w0 + first_row + parent)
            tl.store(Words + b * s_w0 + own, word | (tl.full([], 1, Words.dtype.element_ty) << own))
        for tile in range(H_TILES):  # a constexpr trip count: the interpreter takes no tensor bounds in range()
            cols = tile * BLOCK_H + tl.arange(0, BLOCK_H)
            mask = cols < H
            emb = tl.load(Embed + token * s_e0 + cols, mask=mask).to(tl.float32)
            feature = tl.load(Features + b * s_f0 + parent * s_f1 + cols, mask=mask).to(tl.float32)
            tl.store(Inputs + slot * (2 * H) + cols, round_to(emb, Inputs.dtype.element_ty, HAND_ROUND), mask=mask)
            tl.store(Inputs + slot * (2 * H) + H + cols, feature.to(Inputs.dtype.element_ty), mask=mask)  # exact


def _outputs(child_logprobs: torch.Tensor, features: torch.Tensor, keep: int) -> Tuple[torch.Tensor, ...]:
    B, K, C = child_logprobs.shape
    dev = child_logprobs.device
    return (torch.empty(B, K * C, dtype=torch.int32, device=dev), torch.empty(B, K * C, dtype=torch.float32, device=dev),
            torch.empty(B, keep, dtype=torch.float32, device=dev), torch.empty(B, keep, dtype=torch.int64, device=dev),
            torch.empty(B, keep, dtype=torch.int64, device=dev), torch.empty(B, keep, dtype=torch.int64, device=dev),
            torch.empty(B, keep, 2 * features.shape[-1], dtype=features.dtype, device=dev))


def draft_frontier_out(parent_scores, parent_index, child_logprobs, child_tokens, features, embed_weight, keep: int,
                       first_index: int, first_row: int, outputs, ancestor_words=None) -> None:
    """Launch into ``outputs`` (:func:`_outputs`' shapes, contiguous) and the kept children's columns of
    ``ancestor_words`` (contiguous int32 / int64 ``[B, W]``, or None); inputs with a unit last stride."""
    B, K, C = child_logprobs.shape
    if B == 0:
        return
    H = features.shape[-1]
    block_h = min(triton.next_power_of_2(H), MAX_BLOCK_H)
    has_words = ancestor_words is not None
    words = ancestor_words if has_words else outputs[4]  # an unread int64 pointer without words
    strides = (*parent_scores.stride(), *parent_index.stride(), *child_logprobs.stride()[:2],
               *child_tokens.stride()[:2], *features.stride()[:2], embed_weight.stride(0), words.stride(0))
    _draft_frontier_kernel[(B, max(K, keep))](
        parent_scores, parent_index, child_logprobs, child_tokens, features, embed_weight, *outputs, words, *strides,
        first_index, first_row, H, K=K, C=C, C_P=triton.next_power_of_2(C), KC_P=triton.next_power_of_2(K * C),
        KEEP=keep, KEEP_P=triton.next_power_of_2(max(keep, 1)), BLOCK_H=block_h, H_TILES=triton.cdiv(H, block_h),
        HAND_ROUND=hand_round(features.dtype), HAS_WORDS=has_words, num_warps=4)


@torch.library.custom_op("tlt::draft_frontier", mutates_args=())
def _draft_frontier_op(parent_scores: torch.Tensor, parent_index: torch.Tensor, child_logprobs: torch.Tensor,
                       child_tokens: torch.Tensor, features: torch.Tensor, embed_weight: torch.Tensor, keep: int,
                       first_index: int, first_row: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                  torch.Tensor, torch.Tensor, torch.Tensor,
                                                                  torch.Tensor]:
    outputs = _outputs(child_logprobs, features, keep)
    draft_frontier_out(parent_scores, parent_index, child_logprobs, child_tokens, features, embed_weight, keep,
                       first_index, first_row, outputs)
    return outputs


@_draft_frontier_op.register_fake
def _(parent_scores, parent_index, child_logprobs, child_tokens, features, embed_weight, keep, first_index, first_row):
    return _outputs(child_logprobs, features, keep)


# The same step writing the kept children's ancestor words: an op of its own, whose mutated words are a required
# tensor (torch 2.11's fake tensors fail on an optional mutated argument given None).
@torch.library.custom_op("tlt::draft_frontier_words", mutates_args=("ancestor_words",))
def _draft_frontier_words_op(parent_scores: torch.Tensor, parent_index: torch.Tensor, child_logprobs: torch.Tensor,
                             child_tokens: torch.Tensor, features: torch.Tensor, embed_weight: torch.Tensor, keep: int,
                             first_index: int, first_row: int, ancestor_words: torch.Tensor
                             ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                        torch.Tensor, torch.Tensor]:
    outputs = _outputs(child_logprobs, features, keep)
    draft_frontier_out(parent_scores, parent_index, child_logprobs, child_tokens, features, embed_weight, keep,
                       first_index, first_row, outputs, ancestor_words)
    return outputs


@_draft_frontier_words_op.register_fake
def _(parent_scores, parent_index, child_logprobs, child_tokens, features, embed_weight, keep, first_index, first_row,
      ancestor_words):
    return _outputs(child_logprobs, features, keep)


def draft_frontier(parent_scores, parent_index, child_logprobs, child_tokens, features, embed_weight, keep: int,
                   first_index: int, first_row: int, ancestor_words=None) -> Tuple[torch.Tensor, ...]:
    """Backend of :func:`tlt_kernels.ops.draft_frontier.draft_frontier`: new contiguous outputs (and the kept
    children's ``ancestor_words``, in place)."""
    args = (parent_scores, parent_index, child_logprobs, child_tokens, features, embed_weight)
    if direct_dispatch_ok(*args, ancestor_words):  # plain eager: launch without the op's dispatch
        outputs = _outputs(child_logprobs, features, keep)
        draft_frontier_out(*args, keep, first_index, first_row, outputs, ancestor_words)
        return outputs
    if ancestor_words is None:
        return torch.ops.tlt.draft_frontier(*args, keep, first_index, first_row)
    return torch.ops.tlt.draft_frontier_words(*args, keep, first_index, first_row, ancestor_words)
