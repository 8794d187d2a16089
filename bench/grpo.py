"""GRPO's arithmetic, for the RL suite: group-normalized advantages, the clipped policy loss over response tokens,
and a permutation test of two reward samples.

GRPO (Shao et al. 2024, DeepSeekMath) samples ``G`` responses per prompt; a response's advantage is its reward minus
its group's mean reward, over the group's standard deviation; every token of the response gets it. The loss is
PPO's clipped surrogate ``-min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A)`` with ``ratio = exp(logp - logp_old)``,
``logp_old`` the rollout's log-probs (the engine returns them), averaged over the response's tokens, then over
responses. No KL term (as several recent recipes drop it).
"""
from __future__ import annotations

import random
from typing import List, Sequence

import torch


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-4) -> torch.Tensor:
    """``float32 [P * G]``: ``(r - mean_g) / (std_g + eps)`` per group of ``group_size`` consecutive responses."""
    grouped = rewards.float().view(-1, group_size)
    mean, std = grouped.mean(1, keepdim=True), grouped.std(1, unbiased=False, keepdim=True)
    return ((grouped - mean) / (std + eps)).flatten()


def response_logprobs(logits_fn, device, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]):
    """``(logp float32 [N, R], mask bool [N, R])``: log-softmax of the logits ``logits_fn(tokens int64 [N, S])``
    returns (``[N, S, V]``) at each response token, over prompt + response right-padded; ``R`` the longest
    response. Differentiable (the GRPO loss's forward)."""
    longest = max(len(p) + len(r) for p, r in zip(prompts, responses))
    width = max(len(r) for r in responses)
    tokens = torch.zeros(len(prompts), longest, dtype=torch.int64)
    index = torch.zeros(len(prompts), width, dtype=torch.int64)
    mask = torch.zeros(len(prompts), width, dtype=torch.bool)
    for i, (prompt, response) in enumerate(zip(prompts, responses)):
        seq = list(prompt) + list(response)
        tokens[i, : len(seq)] = torch.tensor(seq)
        index[i, : len(response)] = torch.arange(len(prompt) - 1, len(seq) - 1)  # row t predicts token t + 1
        mask[i, : len(response)] = True
    tokens, index, mask = tokens.to(device), index.to(device), mask.to(device)
    logits = logits_fn(tokens)
    picked = logits.gather(1, index.unsqueeze(2).expand(-1, -1, logits.shape[2])).float()  # response rows only
    logp = torch.log_softmax(picked, dim=2)
    targets = tokens.gather(1, (index + 1).clamp(max=longest - 1))
    return logp.gather(2, targets.unsqueeze(2)).squeeze(2) * mask, mask


def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor,
              clip: float = 0.2) -> torch.Tensor:
    """The clipped surrogate over response tokens (``[N, R]`` each, ``advantages [N]``), mean per response then
    over responses."""
    ratio = torch.exp((logp - old_logp).masked_fill(~mask, 0.0))
    adv = advantages.unsqueeze(1)
    per_token = -torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
    per_response = (per_token * mask).sum(1) / mask.sum(1).clamp(min=1)
    return per_response.mean()


def permutation_pvalue(a: Sequence[float], b: Sequence[float], rounds: int = 2000, seed: int = 0) -> float:
    """Two-sided p-value of the difference of means of ``a`` and ``b`` under label permutation (no distributional
    assumption; rewards are 0/1 and bounded)."""
    a, b = list(a), list(b)
    if not a or not b:
        return float("nan")
    observed = abs(sum(a) / len(a) - sum(b) / len(b))
    pooled, rng, extreme = a + b, random.Random(seed), 0
    for _ in range(rounds):
        rng.shuffle(pooled)
        left, right = pooled[: len(a)], pooled[len(a):]
        extreme += abs(sum(left) / len(left) - sum(right) / len(right)) >= observed - 1e-12
    return (extreme + 1) / (rounds + 1)


def common_prefix_diffs(tokens_a: List[List[int]], logp_a: List[List[float]], tokens_b: List[List[int]],
                        logp_b: List[List[float]]) -> List[float]:
    """``|logp_a - logp_b|`` of every token two rollouts of the same requests share (each pair's common prefix): the
    lossless check of two decoders' scores."""
    diffs = []
    for ta, la, tb, lb in zip(tokens_a, logp_a, tokens_b, logp_b):
        for x, y, u, v in zip(ta, tb, la, lb):
            if x != y:
                break
            diffs.append(abs(u - v))
    return diffs

