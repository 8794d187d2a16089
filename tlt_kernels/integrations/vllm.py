"""vLLM v1's rejection-sampler call shape over :func:`tlt_kernels.verify_tree`.

Terms (vLLM's): a batch holds ``B`` requests; request ``b`` proposes ``num_draft_tokens[b]`` drafts (0 allowed), all
requests' drafts flattened into ``draft_token_ids [N]`` in request order, ``cu_num_draft_tokens [B]`` their cumulative
counts (request ``b``'s drafts end there). ``target_logits [N, V]`` holds the target's logits at each draft's position
(row ``i`` scores draft ``i``); the target's token after the last draft, the *bonus token*, was sampled separately
(``bonus_token_ids [B, 1]``). ``draft_probs [N, V]`` is the distribution each draft was drawn from, or None for drafters
that propose without one (n-gram, EAGLE top-1): a draft is then a deterministic candidate.

Rule (lossless): greedy requests (temperature 0) accept drafts while each equals the argmax of its row and end with
that row's argmax at the first mismatch; sampled requests accept draft ``x`` with probability ``min(1, p(x) / q(x))``
(``p(x)`` without draft probabilities) under temperature, top-k and top-p, and at the first rejection draw from
``norm(max(p - q, 0))`` (``p`` without ``x`` when there is no ``q``). A request whose drafts are all accepted ends
with its bonus token. Output: ``int32 [B, max_spec_len + 1]``, the emitted tokens then -1 (vLLM's placeholder).

Randomness is ours: a per-request Philox ``seed`` and ``offset`` replace vLLM's generators, so outputs have vLLM's law,
not its samples.
"""
from __future__ import annotations

from typing import Optional

import torch

from .._validation import capturing
from ..ops.verify_tree import verify_tree
from ..tree import chain_parents

__all__ = ["rejection_sample"]

PLACEHOLDER_TOKEN_ID = -1


def _check(draft_token_ids, cu_num_draft_tokens, max_spec_len, draft_probs, target_logits, bonus_token_ids) -> int:
    """``B``, or a ValueError naming the argument that does not fit."""
    if draft_token_ids.dim() != 1 or draft_token_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"rejection_sample: draft_token_ids must be int32/int64 [num_tokens], got "
                         f"{draft_token_ids.dtype} {tuple(draft_token_ids.shape)}")
    N = draft_token_ids.shape[0]
    if cu_num_draft_tokens.dim() != 1 or cu_num_draft_tokens.dtype not in (torch.int32, torch.int64):
        raise ValueError("rejection_sample: cu_num_draft_tokens must be int32/int64 [batch]")
    B = cu_num_draft_tokens.shape[0]
    if target_logits.dim() != 2 or target_logits.shape[0] != N:
        raise ValueError(f"rejection_sample: target_logits must be [num_tokens={N}, vocab], got "
                         f"{tuple(target_logits.shape)}")
    if draft_probs is not None and tuple(draft_probs.shape) != tuple(target_logits.shape):
        raise ValueError(f"rejection_sample: draft_probs must be None or {tuple(target_logits.shape)} like "
                         f"target_logits, got {tuple(draft_probs.shape)}")
    if tuple(bonus_token_ids.shape) not in ((B, 1), (B,)):
        raise ValueError(f"rejection_sample: bonus_token_ids must be [{B}, 1], got {tuple(bonus_token_ids.shape)}")
    if not isinstance(max_spec_len, int) or max_spec_len < 0:
        raise ValueError(f"rejection_sample: max_spec_len must be an int >= 0 (the most drafts of a request), "
                         f"got {max_spec_len!r}")
    return B


def _check_counts(counts: torch.Tensor, ends: torch.Tensor, max_spec_len: int, num_tokens: int) -> None:
    """The device-side counts against the host sizes (one host read: validation only)."""
    low, high, last = (int(v) for v in torch.stack([counts.min(), counts.max(), ends[-1]]).tolist()) \
        if counts.numel() else (0, 0, 0)
    if low < 0:
        raise ValueError("rejection_sample: cu_num_draft_tokens must be non-decreasing (cumulative counts)")
    if high > max_spec_len:
        raise ValueError(f"rejection_sample: a request has {high} drafts, more than max_spec_len = {max_spec_len}")
    if last != num_tokens:
        raise ValueError(f"rejection_sample: cu_num_draft_tokens ends at {last}, but draft_token_ids holds "
                         f"{num_tokens} drafts")


def _padded(rows: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor, width: int) -> torch.Tensor:
    """``rows [N, ...]`` regrouped as ``[B, width, ...]`` (request ``b``'s rows first, zeros after): one gather."""
    position = torch.arange(width, device=rows.device).unsqueeze(0)
    valid = position < counts.unsqueeze(1)
    index = torch.where(valid, starts.unsqueeze(1) + position, 0).clamp(max=max(rows.shape[0] - 1, 0))
    if rows.shape[0] == 0:
        return rows.new_zeros((counts.shape[0], width, *rows.shape[1:]))
    gathered = rows[index.reshape(-1)].reshape(counts.shape[0], width, *rows.shape[1:])
    mask = valid.reshape(*valid.shape, *([1] * (rows.dim() - 1)))
    return torch.where(mask, gathered, torch.zeros((), dtype=rows.dtype, device=rows.device))


def rejection_sample(
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    max_spec_len: int,
    draft_probs: Optional[torch.Tensor],
    target_logits: torch.Tensor,
    bonus_token_ids: torch.Tensor,
    temperature=None,
    top_k=None,
    top_p=None,
    seed=0,
    offset=0,
    backend: str = "auto",
    validate: bool = True,
) -> torch.Tensor:
    """vLLM's rejection sampling (see the module docstring), lossless, on the device.

    Args:
        draft_token_ids: ``int32/int64 [N]``: every request's drafts, flattened in request order.
        cu_num_draft_tokens: ``int32/int64 [B]``: cumulative draft counts (request ``b``'s drafts end there).
        max_spec_len: host int >= every request's draft count: the output has ``max_spec_len + 1`` columns.
        draft_probs: ``[N, V]`` float or None (drafts without a distribution).
        target_logits: ``[N, V]`` float32/bf16/fp16: the target's logits at each draft's position.
        bonus_token_ids: ``int [B, 1]``: the token after each request's last draft, sampled by the caller.
        temperature, top_k, top_p: per request, as :func:`tlt_kernels.verify_tree` takes them (None or 0
            temperature = greedy; vLLM's ``SamplingMetadata`` values).
        seed, offset: per-request 64-bit Philox key and counter (int or ``int64 [B]``); advance offset every step.
        backend, validate: as :func:`tlt_kernels.verify_tree`.

    Returns:
        ``int32 [B, max_spec_len + 1]``: accepted drafts, then the recovered token at the first rejection or the
        bonus token, then -1. A request whose visited rows hold NaN/+inf emits nothing (all -1).
    """
    B = _check(draft_token_ids, cu_num_draft_tokens, max_spec_len, draft_probs, target_logits, bonus_token_ids)
    device, width = target_logits.device, max_spec_len + 1
    ends = cu_num_draft_tokens.long()
    counts = ends - torch.cat([ends.new_zeros(1), ends[:-1]])
    starts = ends - counts
    # Node 0 is the root; node i + 1 is draft i, scored by row i. Row n_b (after the last draft) is zeros: the walk
    # reaches it only when every draft was accepted, and then the bonus token replaces what it draws there.
    if validate and not capturing(device):
        _check_counts(counts, ends, max_spec_len, draft_token_ids.shape[0])
    logits = _padded(target_logits, starts, counts, width)
    tokens = torch.cat([draft_token_ids.new_zeros(B, 1), _padded(draft_token_ids, starts, counts, max_spec_len)], 1)
    probs = None if draft_probs is None else _padded(draft_probs, starts, counts, width)
    result = verify_tree(logits, tokens, chain_parents(B, width, device), num_nodes=(counts + 1).to(torch.int32),
                         draft_probs=probs, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                         offset=offset, max_depth=max_spec_len, validate=validate, backend=backend)
    out = result.tokens
    all_accepted = (result.num_accepted.long() == counts) & (result.error == 0)
    bonus = bonus_token_ids.reshape(B).to(out.dtype)
    column = torch.arange(width, device=device).unsqueeze(0) == counts.unsqueeze(1)
    return torch.where(column & all_accepted.unsqueeze(1), bonus.unsqueeze(1), out)
