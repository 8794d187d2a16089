"""Plain autoregressive decoding with a contiguous KV cache: the ground truth for speculative decoding.

No paging, no trees, no custom ops: one token per step, SDPA over ``[B, S, Hkv, D]`` caches. Greedy
speculative decoding must reproduce :func:`reference_generate`'s greedy tokens exactly (up to
floating-point ties), and sampled speculative decoding must match its distribution.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import List, Optional, Sequence, Union

import torch

from ..rng import PURPOSE_SAMPLE, uniform
from .llama import LlamaForCausalLM, _sdpa, check_token_ids

Prompts = Union[torch.Tensor, Sequence[Union[Sequence[int], torch.Tensor]]]


@dataclass
class Generation:
    """``tokens: int64 [B, N]`` generated tokens, ``-1`` after a request stopped; ``lengths: int64 [B]``;
    ``logits: [B, N, V]`` (model dtype) of every step when requested, else None."""

    tokens: torch.Tensor
    lengths: torch.Tensor
    logits: Optional[torch.Tensor] = None

    def as_lists(self) -> List[List[int]]:
        return [row[:n].tolist() for row, n in zip(self.tokens, self.lengths.tolist())]


def sample_from_logits(logits: torch.Tensor, temperature: float, seed: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """Draw one token per row of ``logits: [B, V]``: argmax when ``temperature == 0``, else inverse CDF of
    ``softmax(logits / temperature)`` (fp32) with the Philox uniform ``uniform(seed, offset, node=0, PURPOSE_SAMPLE)``.

    ``seed, offset``: int64 ``[B]``. Returns int64 ``[B]``.
    """
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
        # A negative temperature would sample the least likely tokens first.
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    cdf = probs.cumsum(-1)
    u = uniform(seed, offset, 0, PURPOSE_SAMPLE).to(logits.device)
    tok = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
    return tok.clamp(max=logits.shape[-1] - 1)


def _as_padded(prompts: Prompts, device) -> tuple:
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() != 2:
            raise ValueError(f"prompts must be a [B, L] tensor or a list of 1-D token sequences, got shape {tuple(prompts.shape)}")
        return prompts.to(device=device, dtype=torch.int64), torch.full((prompts.shape[0],), prompts.shape[1], device=device)
    rows = [torch.as_tensor(p, dtype=torch.int64).flatten() for p in prompts]
    if not rows or any(r.numel() == 0 for r in rows):
        raise ValueError("prompts must hold at least one request, each with at least one token")
    lens = torch.tensor([r.numel() for r in rows], device=device)
    out = torch.zeros(len(rows), int(lens.max()), dtype=torch.int64)
    for b, r in enumerate(rows):
        out[b, : r.numel()] = r
    return out.to(device), lens


def _check_args(model: LlamaForCausalLM, tokens: torch.Tensor, lens: torch.Tensor, max_new_tokens) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    check_token_ids("prompts", tokens, model.config.vocab_size, lens)  # the embedding would raise a bare IndexError


@torch.no_grad()
def reference_generate(
    model: LlamaForCausalLM,
    prompts: Prompts,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    seed: Union[int, torch.Tensor] = 0,
    offset: int = 0,
    eos_token_id: Optional[int] = None,
    return_logits: bool = False,
) -> Generation:
    """Generate ``max_new_tokens`` tokens per request, one at a time.

    Args:
        model: the target model (its dense trunk is reused with a contiguous cache).
        prompts: int64 ``[B, L]`` or a list of ``B`` 1-D token sequences (any lengths >= 1).
        temperature: 0 for greedy; else sampling by :func:`sample_from_logits`, step ``t`` using
            Philox offset ``offset + t``.
        seed: int or int64 ``[B]`` per-request Philox seeds.
        eos_token_id: a request stops after emitting it.
    """
    device = model.device
    tokens, lens = _as_padded(prompts, device)
    B, L = tokens.shape
    _check_args(model, tokens, lens, max_new_tokens)
    N = max_new_tokens
    k_cache, v_cache = _contiguous_caches(model, B, L + N)
    seeds = seed.to(device=device, dtype=torch.int64) if isinstance(seed, torch.Tensor) else torch.full((B,), seed, dtype=torch.int64, device=device)
    step_logits = _prefill(model, tokens, lens, k_cache, v_cache)

    out = torch.full((B, N), -1, dtype=torch.int64, device=device)
    all_logits = [] if return_logits else None
    done = torch.zeros(B, dtype=torch.bool, device=device)
    pos = lens.clone()
    for t in range(N):
        if return_logits:
            all_logits.append(step_logits)
        nxt = sample_from_logits(step_logits, temperature, seeds, torch.full((B,), offset + t, dtype=torch.int64, device=device))
        out[:, t] = torch.where(done, torch.full_like(nxt, -1), nxt)
        if eos_token_id is not None:
            done = done | (nxt == eos_token_id)
        if t == N - 1 or bool(done.all()):
            break
        step_logits = _decode_step(model, nxt, pos, k_cache, v_cache)
        pos = pos + 1
    lengths = (out >= 0).sum(1)
    logits = torch.stack(all_logits, 1) if return_logits else None
    return Generation(out, lengths, logits)


def _contiguous_caches(model: LlamaForCausalLM, batch_size: int, num_slots: int):
    """Zeroed per-layer K and V caches, ``[B, S, Hkv, D]`` each in the model's dtype."""
    cfg = model.config
    shape = (batch_size, num_slots, cfg.num_kv_heads, cfg.head_dim)
    k_cache = [torch.zeros(shape, device=model.device, dtype=model.dtype) for _ in range(cfg.num_layers)]
    return k_cache, [torch.zeros_like(k) for k in k_cache]


def _prefill(model: LlamaForCausalLM, tokens: torch.Tensor, lens: torch.Tensor, k_cache, v_cache) -> torch.Tensor:
    """Runs the right-padded prompts ``[B, L]`` into cache slots ``0..L-1``; returns the logits after each prompt's
    last token. Causal; padding rows are clamped to their request's last token."""
    B, L = tokens.shape
    S = k_cache[0].shape[1]
    device = tokens.device
    j = torch.arange(L, device=device).unsqueeze(0)
    last = j.minimum(lens.unsqueeze(1) - 1)
    s = torch.arange(S, device=device).view(1, 1, S)
    mask = (s <= last.unsqueeze(2)).unsqueeze(1)

    def attend_prompt(i, q, k, v):
        k_cache[i][:, :L], v_cache[i][:, :L] = k, v
        return _sdpa(q, k_cache[i], v_cache[i], mask, False, model.sm_scale)

    hidden = model._trunk(tokens, j.expand(B, L), attend_prompt)
    return model.logits(hidden[torch.arange(B, device=device), lens - 1])


def _decode_step(model: LlamaForCausalLM, tokens: torch.Tensor, pos: torch.Tensor, k_cache, v_cache) -> torch.Tensor:
    """Runs one token per request (``tokens [B]``) at position and cache slot ``pos [B]``, attending to slots
    ``0..pos``; returns the next logits ``[B, V]``."""
    B = tokens.shape[0]
    S = k_cache[0].shape[1]
    rows = torch.arange(B, device=tokens.device)
    step_mask = (torch.arange(S, device=tokens.device).view(1, S) <= pos.unsqueeze(1)).view(B, 1, 1, S)

    def attend_step(i, q, k, v):
        k_cache[i][rows, pos], v_cache[i][rows, pos] = k[:, 0], v[:, 0]
        return _sdpa(q, k_cache[i], v_cache[i], step_mask, False, model.sm_scale)

    hidden = model._trunk(tokens.unsqueeze(1), pos.unsqueeze(1), attend_step)
    return model.logits(hidden[:, 0])
