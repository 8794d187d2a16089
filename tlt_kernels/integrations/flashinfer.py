"""FlashInfer's ``chain_speculative_sampling`` call shape over :func:`tlt_kernels.verify_tree`.

Terms (FlashInfer's): a request proposes a chain of ``n`` draft tokens ``draft_token_ids[b, i]``, draft ``i`` drawn
from ``draft_probs[b, i]``; ``target_probs[b, i]`` is the target's distribution at the position of draft ``i``, and
row ``n`` the one after the last draft (the bonus token's). Draft ``i`` is accepted with probability
``min(1, p(x) / q(x))``; the first rejection draws the final token from ``norm(max(p - q, 0))``; with every draft
accepted the bonus token is drawn from row ``n``. The emitted tokens then have exactly the target's law.

The chain becomes a tree of ``n + 1`` nodes (node 0 the root, node ``i + 1`` draft ``i``), the target probabilities
become logits (``log p``: ``softmax(log p)`` is ``p``, zero-probability tokens are masked), and the walk runs at
temperature 1 with the draft rows. The random stream is ours (one Philox stream per request, explicit ``seed`` and
``offset``), so outputs have FlashInfer's law, not its samples.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..ops.philox_uniform import philox_uniform
from ..ops.verify_tree import verify_tree
from ..rng import PURPOSE_ACCEPT, as_words
from ..tree import chain_parents

__all__ = ["chain_speculative_sampling"]


def _check_shapes(draft_probs, draft_token_ids, target_probs) -> Tuple[int, int, int]:
    """``(B, n, V)``, or a ValueError naming the argument whose shape or dtype does not fit."""
    for name, t in (("draft_probs", draft_probs), ("draft_token_ids", draft_token_ids), ("target_probs", target_probs)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"chain_speculative_sampling: {name} must be a tensor, got {type(t).__name__}")
    if draft_probs.dim() != 3:
        raise ValueError(f"chain_speculative_sampling: draft_probs must be [batch, num_speculate_tokens, vocab], "
                         f"got shape {tuple(draft_probs.shape)}")
    B, n, V = draft_probs.shape
    if tuple(draft_token_ids.shape) != (B, n) or draft_token_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"chain_speculative_sampling: draft_token_ids must be int32/int64 [{B}, {n}] (draft_probs' "
                         f"first two dims), got {draft_token_ids.dtype} {tuple(draft_token_ids.shape)}")
    if tuple(target_probs.shape) != (B, n + 1, V):
        raise ValueError(f"chain_speculative_sampling: target_probs must be [{B}, {n + 1}, {V}] (one row more than "
                         f"draft_probs: the bonus token's), got {tuple(target_probs.shape)}")
    if not (draft_probs.is_floating_point() and target_probs.is_floating_point()):
        raise ValueError("chain_speculative_sampling: draft_probs and target_probs must be floating point")
    return B, n, V


def _per_request(name: str, value, B: int, device) -> torch.Tensor:
    """A seed or offset (int, or an int64 tensor of length 1 or B, FlashInfer's forms) as ``int64 [B]``."""
    words = as_words(value, device)
    if words.dim() == 0:
        return words.expand(B)
    if words.dim() != 1 or words.shape[0] not in (1, B):
        raise ValueError(f"chain_speculative_sampling: {name} must be an int or a 1-D tensor of length 1 or {B}, "
                         f"got shape {tuple(words.shape)}")
    return words.expand(B)


def _independent_accepts(draft_probs, draft_token_ids, target_probs, seed, offset, num_accepted,
                         backend) -> torch.Tensor:
    """FlashInfer's ``accepted_token_num``: drafts that pass their own test ``u q(x) < p(x)`` (rows normalized),
    each with the coin the walk gives it, whether or not an earlier draft was rejected. The walk's own decisions
    stand where it made them (its first ``num_accepted`` drafts passed, the next one failed), so a float rounding
    at the boundary never contradicts the emitted tokens. ``int32 [B]``."""
    B, n, _ = draft_probs.shape
    ids = draft_token_ids.long().unsqueeze(2)
    q = draft_probs.float().gather(2, ids).squeeze(2) / draft_probs.float().sum(2)
    p = target_probs[:, :n].float().gather(2, ids).squeeze(2) / target_probs[:, :n].float().sum(2)
    position = torch.arange(n, device=draft_probs.device).unsqueeze(0)
    # One launch on the GPU (the torch reference's ten Philox rounds are ~160 launches, most of a small call's time).
    coins = philox_uniform(seed.unsqueeze(1), offset.unsqueeze(1), position + 1, PURPOSE_ACCEPT, backend=backend)
    walked = num_accepted.long().unsqueeze(1)
    passed = torch.where(position < walked, True, torch.where(position == walked, False, coins * q < p))
    return passed.sum(1, dtype=torch.int32)


def _coin_backend(backend: str) -> str:
    """The coins' backend for the walk's ``backend``: philox_uniform has no CUDA C++ build (Triton's gives the same
    bits)."""
    return "triton" if backend == "cuda" else backend


def chain_speculative_sampling(
    draft_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    target_probs: torch.Tensor,
    maybe_output_accepted_token_num: Optional[torch.Tensor] = None,
    maybe_output_emitted_draft_token_num: Optional[torch.Tensor] = None,
    seed=0,
    offset=0,
    backend: str = "auto",
    validate: bool = True,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Speculative sampling of a chain of drafts, in FlashInfer's call shape (lossless).

    Args:
        draft_probs: ``[B, n, V]`` float: the draft distribution each draft was drawn from (rows normalized here).
        draft_token_ids: ``int32/int64 [B, n]``: the drafts.
        target_probs: ``[B, n+1, V]`` float: the target's distribution at each draft's position, then the bonus
            token's row (rows normalized here; a zero entry is a token the target never emits).
        maybe_output_accepted_token_num, maybe_output_emitted_draft_token_num: optional ``int32 [B]`` counters that
            the two counts are added to in place (FlashInfer's semantics); fresh zeros when None.
        seed, offset: per-request 64-bit Philox key and counter: an int or an int64 tensor of length 1 or ``B``
            (FlashInfer's forms; tensors keep a captured graph replayable with new values). Advance ``offset`` every
            step.
        backend, validate: as :func:`tlt_kernels.verify_tree` (validation is skipped while a graph is captured).

    Returns:
        ``(output_token_ids int32 [B, n+1], accepted_token_num int32 [B], emitted_draft_token_num int32 [B])``:
        the emitted tokens (accepted drafts, then the final token; -1 after it), the drafts that pass their own
        acceptance test independently of earlier rejections (an alignment metric), and the drafts emitted (the
        bonus token not counted). A request whose target row holds NaN/inf or no positive entry emits nothing
        (-1 everywhere, counts unchanged): verify_tree flags it.
    """
    B, n, V = _check_shapes(draft_probs, draft_token_ids, target_probs)
    device = target_probs.device
    seed, offset = _per_request("seed", seed, B, device), _per_request("offset", offset, B, device)
    tokens = torch.cat([torch.zeros_like(draft_token_ids[:, :1]), draft_token_ids], dim=1)
    # Row n has no children: its draft row is never read, zeros only fill the [B, n+1, V] shape verify_tree takes.
    rows = torch.cat([draft_probs, draft_probs.new_zeros(B, 1, V)], dim=1)
    result = verify_tree(target_probs.float().log(), tokens, chain_parents(B, n + 1, device), draft_probs=rows,
                         temperature=1.0, seed=seed, offset=offset, validate=validate, backend=backend)
    flagged = result.error.bool()
    independent = _independent_accepts(draft_probs, draft_token_ids, target_probs, seed, offset, result.num_accepted,
                                       _coin_backend(backend))
    accepted = maybe_output_accepted_token_num
    emitted = maybe_output_emitted_draft_token_num
    accepted = torch.zeros(B, dtype=torch.int32, device=device) if accepted is None else accepted
    emitted = torch.zeros(B, dtype=torch.int32, device=device) if emitted is None else emitted
    accepted.add_(torch.where(flagged, 0, independent).to(accepted.dtype))
    emitted.add_(result.num_accepted.to(emitted.dtype))
    return result.tokens, accepted, emitted
