"""Reference block verification of a draft chain (pure torch, float64).

Block verification (Sun, Mendlovic, Leviathan, Aharoni, Beirami, Ro, Suresh, "Block Verification Accelerates
Speculative Decoding", ICLR 2025, arXiv 2403.10444, Algorithm 2) decides how many drafts of a chain to keep from the
whole block at once instead of token by token. It is lossless and keeps, in expectation, at least as many drafts as
token-by-token verification (the paper shows it is optimal among valid verifiers of a chain).

Terms, for one request with ``n`` drafts (``n = num_drafts[b] <= gamma``):

* ``X_1 .. X_n``: the draft tokens (``draft_tokens[b, :n]``); ``X^i`` is the prefix ``X_1 .. X_i`` (``X^0`` empty);
* ``q_i``: the distribution ``X_i`` was drawn from, given ``X^{i-1}`` (``draft_probs[b, i-1]``, normalized);
* ``p_i``: the target's sampling distribution of token ``i`` given ``X^{i-1}`` (``logits[b, i-1]`` after
  temperature), for ``i = 1 .. n+1``; ``p_{n+1}`` is the bonus row;
* the *weight* ``w_i`` of prefix ``X^i``: ``w_0 = 1``, ``w_i = min(1, w_{i-1} p_i(X_i) / q_i(X_i))`` (0 when
  ``p_i(X_i) = 0``; 1 when ``q_i(X_i) = 0 < p_i(X_i)`` and ``w_{i-1} > 0``);
* the *residual* after ``X^i`` (``i < n``): ``r_i(x) = max(w_i p_{i+1}(x) - q_{i+1}(x), 0)``, of mass
  ``R_i = sum_x r_i(x)``;
* the *stopping probability* of prefix ``X^i``: ``h_i = R_i / (R_i + 1 - w_i)`` for ``1 <= i < n`` (1 when
  ``R_i = 0`` and ``w_i = 1``: then any value is exact, see below) and ``h_n = w_n``.

The rule: with independent uniforms ``eta_1 .. eta_n``, the number of accepted drafts is
``tau = max({i in 1..n : eta_i < h_i} | {0})``; the request emits ``X_1 .. X_tau`` and one more token ``Y``: drawn
from ``p_{n+1}`` when ``tau = n`` (every draft kept: the bonus token), else from ``r_tau / R_tau`` (for ``tau = 0``
that is ``max(p_1 - q_1, 0)``, the usual first-rejection residual). A residual without mass (it can only be reached
where ``w_tau = 1`` and ``p_{tau+1} = q_{tau+1}``, or through float rounding) is replaced by ``p_{tau+1}``, as
:func:`tlt_kernels.verify_tree` keeps ``p`` when its residual is empty.

Why it is lossless. (a) ``P(tau >= i | X^i) = w_i`` once the later drafts and uniforms are averaged out: true for
``i = n`` (``h_n = w_n``), and if true for ``i + 1`` then, since ``E_{X_{i+1} ~ q_{i+1}}[w_{i+1}] = sum_x
min(q_{i+1}(x), w_i p_{i+1}(x)) = w_i - R_i``, ``P(tau >= i | X^i) = h_i + (1 - h_i)(w_i - R_i)``, which equals
``w_i`` exactly for the ``h_i`` above. Hence ``P(tau = i | X^i) = w_i - (w_i - R_i) = R_i``. (b) The probability
that the output holds at least ``i`` tokens and that they are ``z^{i}`` is then ``q(z^{i-1}) [min(q_i(z_i),
w_{i-1} p_i(z_i)) + max(w_{i-1} p_i(z_i) - q_i(z_i), 0)] = q(z^{i-1}) w_{i-1}(z^{i-1}) p_i(z_i)``: the first term
keeps draft ``z_i`` (``tau >= i``), the second stops at ``i - 1`` and draws ``z_i`` from ``r_{i-1}``. Given the
prefix and that the output reaches position ``i``, token ``i`` therefore has law ``p_i``, whatever the drafts
were; the bonus position is ``p_{n+1}`` by construction. Continuing with the target after the output gives exactly
the target's joint law (tests/ops/test_verify_chain_block.py checks this by enumeration). Expected length: the
token-by-token rule keeps ``X^i`` with probability ``prod_j min(1, p_j/q_j)``, never more than ``w_i``.

Greedy requests (temperature not > 0) use ``q_i := p_i`` (one-hot at the argmax): ``w_i`` is 1 while the drafts
equal the argmax and 0 after the first mismatch, every ``R_i`` is 0, so ``tau`` is the exact-match prefix length
and ``Y`` the argmax at ``tau``, whatever the draft rows hold (the exact-match rule, bit for bit).

Randomness: ``eta_i = uniform(seed, offset, i, PURPOSE_ACCEPT)`` and the final token is an inverse-CDF sample with
``uniform(seed, offset, tau, PURPOSE_SAMPLE)`` (:mod:`tlt_kernels.rng`): the streams :func:`tlt_kernels.verify_tree`
uses on the same chain (node ``i`` = draft ``i``), so greedy outputs equal verify_tree's.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..rng import PURPOSE_ACCEPT, PURPOSE_SAMPLE, uniform
from .sampling import sample_inverse_cdf, target_probs

__all__ = ["BlockVerifyResult", "empty_block_outputs", "next_weight", "stop_probability",
           "verify_chain_block_reference"]


class BlockVerifyResult(NamedTuple):
    """Output of :func:`tlt_kernels.verify_chain_block`.

    Attributes:
        tokens: ``int64 [B, gamma+1]``: the accepted drafts, then the final (residual or bonus) token; -1 pad.
        num_accepted: ``int32 [B]``: accepted drafts ``tau`` (``tokens`` holds ``tau + 1`` tokens).
    """

    tokens: torch.Tensor
    num_accepted: torch.Tensor


def empty_block_outputs(logits: torch.Tensor):
    """Uninitialized ``(tokens int64 [B, gamma+1], num_accepted int32 [B])`` (also the fake-tensor shapes)."""
    B, width = logits.shape[0], logits.shape[1]
    return (logits.new_empty((B, width), dtype=torch.int64), logits.new_empty((B,), dtype=torch.int32))


def next_weight(w: torch.Tensor, px: torch.Tensor, qx: torch.Tensor) -> torch.Tensor:
    """``w_i = min(1, w_{i-1} p(x) / q(x))`` with the edge cases of the rule: 0 when ``w_{i-1} p(x) = 0``, 1 when
    ``w_{i-1} p(x) >= q(x)`` (including ``q(x) = 0``)."""
    num = w * px
    ratio = num / torch.where(qx > 0, qx, torch.ones_like(qx))
    return torch.where(num <= 0, torch.zeros_like(w), torch.where(num >= qx, torch.ones_like(w), ratio))


def stop_probability(w: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """``h = R / (R + 1 - w)``; 1 where ``R + 1 - w = 0`` (``w = 1``, ``R = 0``: every ``h`` keeps the law exact,
    and 1 keeps the longest prefix)."""
    den = mass + (1.0 - w)
    return torch.where(den > 0, mass / torch.where(den > 0, den, torch.ones_like(den)), torch.ones_like(w))


def _distributions(logits, draft_probs, temperature):
    """``(p float64 [B, gamma+1, V], q float64 [B, gamma, V])``: the target rows after temperature and the
    normalized draft rows, with ``q := p`` for greedy requests (see the module docstring)."""
    B, width, V = logits.shape
    temp = temperature.to(logits.device).repeat_interleave(width)
    p = target_probs(logits.reshape(B * width, V), temp).reshape(B, width, V)
    q = draft_probs.to(torch.float64)
    total = q.sum(-1, keepdim=True)
    q = q / torch.where(total > 0, total, torch.ones_like(total))
    greedy = ~(temperature.to(logits.device) > 0)
    return p, torch.where(greedy.view(B, 1, 1), p[:, :-1], q)


def _stopping_point(p, q, draft_tokens, n, seed, offset):
    """``(tau int64 [B], w_tau float64 [B])``: the accepted length and the weight of the accepted prefix."""
    B, width, V = p.shape
    rows = torch.arange(B, device=p.device)
    x = draft_tokens.to(torch.int64)
    in_vocab = (x >= 0) & (x < V)
    x = x.clamp(0, V - 1)
    w = torch.ones(B, dtype=torch.float64, device=p.device)
    tau = torch.zeros(B, dtype=torch.int64, device=p.device)
    w_tau = w.clone()
    for i in range(1, width):  # prefix X^i, i = 1 .. gamma
        px = torch.where(in_vocab[:, i - 1], p[rows, i - 1, x[:, i - 1]], torch.zeros_like(w))
        w = next_weight(w, px, q[rows, i - 1, x[:, i - 1]])
        if i < width - 1:  # R_i from row i (absent for i = gamma, where h = w)
            mass = (w.unsqueeze(1) * p[:, i] - q[:, i]).clamp(min=0).sum(1)
        else:
            mass = torch.zeros_like(w)
        h = torch.where(n == i, w, stop_probability(w, mass))
        eta = uniform(seed, offset, i, PURPOSE_ACCEPT).to(torch.float64)
        stop = (i <= n) & (eta < h)
        tau = torch.where(stop, i, tau)
        w_tau = torch.where(stop, w, w_tau)
    return tau, w_tau


def verify_chain_block_reference(
    logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    num_drafts: torch.Tensor,
    temperature: torch.Tensor,
    seed: torch.Tensor,
    offset: torch.Tensor,
) -> BlockVerifyResult:
    """Block verification over already-validated inputs (float64; synchronizes nowhere, but is not a fast path).

    Args:
        logits: ``[B, gamma+1, V]`` fp32/bf16/fp16. draft_tokens: ``int64 [B, gamma]``.
        draft_probs: ``[B, gamma, V]`` float (rows normalized here). num_drafts: ``int32 [B]`` (clamped to
            ``[0, gamma]``). temperature: ``float32 [B]`` (not > 0 = greedy). seed, offset: ``int64 [B]``.

    Returns:
        :class:`BlockVerifyResult`.
    """
    B, width, V = logits.shape
    rows = torch.arange(B, device=logits.device)
    n = num_drafts.to(torch.int64).clamp(0, width - 1)
    seed, offset = seed.to(torch.int64), offset.to(torch.int64)
    p, q = _distributions(logits, draft_probs, temperature)
    tau, w_tau = _stopping_point(p, q, draft_tokens, n, seed, offset)
    # The final token: the bonus row when every draft was kept, else the residual r_tau (p where it has no mass).
    p_row = p[rows, tau]
    q_row = q[rows, tau.clamp(max=width - 2)] if width > 1 else torch.zeros_like(p_row)
    residual = (w_tau.unsqueeze(1) * p_row - q_row).clamp(min=0)
    use_residual = (tau < n) & (residual.sum(1) > 0)
    final = torch.where(use_residual.unsqueeze(1), residual, p_row)
    y = sample_inverse_cdf(final, uniform(seed, offset, tau, PURPOSE_SAMPLE))
    cols = torch.arange(width, device=logits.device).unsqueeze(0)
    drafts = torch.nn.functional.pad(draft_tokens.to(torch.int64), (0, 1), value=-1)
    tokens = torch.where(cols < tau.unsqueeze(1), drafts, torch.full_like(drafts, -1))
    tokens[rows, tau] = y
    return BlockVerifyResult(tokens, tau.to(torch.int32))
