"""The target distribution of one logits row: temperature, top-k, top-p (pure torch, float64).

This is the contract every sampling backend reproduces. For a row ``l`` (a request's logits after
one node) and the request's parameters:

* greedy when ``temperature`` is not > 0 (0, or NaN/negative when validation is skipped; callers map
  ``None`` to 0): the distribution is one-hot at ``argmax(l)`` (the lowest token id among ties);
* otherwise, with ``M = max(l)`` and ``T' = clamp(temperature, 2**-126, 2**126)`` (the normal float32
  range: kernels scale by ``1 / T'`` in float32, which must stay finite and normal), the weights are
  ``w = exp((l - M) / T')``: the max is subtracted *before* dividing, so nothing overflows for any
  temperature or logit magnitude; ``w`` is exactly 1 at the maximal logits and ``-inf`` logits get 0.
  As ``T -> 0`` this is uniform over the maximal logits (greedy with ties drawn at random);
* top-k (disabled when ``k`` is not in ``[1, V)``): keep every token with ``l >= l_(k)``, the k-th
  largest logit. Ties at the boundary are all kept (a *threshold*, so a kernel can find it by
  bisection on the value instead of sorting);
* ``p = w / sum(w)`` over the kept tokens;
* top-p (disabled when ``top_p`` is not < 1; values below ``2**-126`` act as ``2**-126``, which keeps only
  the maximal logits as any ``top_p <= 1/V`` does): the kept set is ``{l_i >= l*}`` where ``l*`` is the
  largest logit such that the tokens with ``l >= l*`` reach mass ``top_p``; renormalize. This equals the
  sort-based "smallest set of most likely tokens whose mass reaches top_p", except that ties at the
  boundary are all kept.

Ties are equal logits, and ``-0.0 == +0.0`` (kernels canonicalize the sign of zero before keying floats).
``-inf`` logits are legal (probability 0). Rows holding NaN or ``+inf``, or only ``-inf``, have no
distribution: :func:`row_errors` flags them and callers must not use their probabilities.
"""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["greedy_tokens", "row_errors", "sampling_params", "target_probs", "sample_inverse_cdf"]

# The clamps of the contract: the normal float32 range, where a kernel's 1 / T' (scaled by log2(e)) and its
# products stay finite and normal on every GPU arithmetic mode.
TEMP_MIN = 2.0**-126
TEMP_MAX = 2.0**126
TOP_P_MIN = 2.0**-126


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """``int64 [...]``: argmax over the last dim, the lowest id among ties (``torch.argmax`` rule)."""
    return logits.argmax(dim=-1)


def row_errors(logits: torch.Tensor) -> torch.Tensor:
    """``bool [...]``: rows with a NaN or ``+inf``, or with every entry ``-inf``."""
    bad = torch.isnan(logits).any(-1) | torch.isposinf(logits).any(-1)
    return bad | torch.isneginf(logits).all(-1)


def sampling_params(temperature: torch.Tensor, top_p: Optional[torch.Tensor] = None):
    """``(greedy, T', top_p')`` of the contract: ``greedy`` where the temperature is not > 0, ``T'`` the
    temperature clamped to ``[2**-126, 2**126]`` (1 for greedy rows), ``top_p'`` 1 (off) where top_p is not < 1,
    else top_p raised to at least ``2**-126`` (None stays None). float64."""
    temp = temperature.to(torch.float64)
    greedy = ~(temp > 0)
    t_eff = torch.where(greedy, torch.ones_like(temp), temp.clamp(TEMP_MIN, TEMP_MAX))
    if top_p is None:
        return greedy, t_eff, None
    tp = top_p.to(device=temp.device, dtype=torch.float64)
    return greedy, t_eff, torch.where(tp < 1, tp.clamp(min=TOP_P_MIN), torch.ones_like(tp))


def target_probs(
    logits: torch.Tensor,
    temperature: Optional[torch.Tensor] = None,
    top_k: Optional[torch.Tensor] = None,
    top_p: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Target distribution of each row.

    Args:
        logits: ``[N, V]`` float (any float dtype; computed in float64).
        temperature: ``[N]`` float or None (None = greedy for every row; not > 0 = greedy for that row).
        top_k: ``[N]`` int or None (values outside ``[1, V)`` disable).
        top_p: ``[N]`` float or None (values not < 1 disable).

    Returns:
        ``float64 [N, V]`` probabilities summing to 1 per row (garbage for rows flagged by
        :func:`row_errors`).
    """
    N, V = logits.shape
    dev = logits.device
    l = logits.to(torch.float64)
    onehot = torch.zeros(N, V, dtype=torch.float64, device=dev)
    onehot.scatter_(1, greedy_tokens(l).unsqueeze(1), 1.0)
    if temperature is None:
        return onehot
    greedy, t_eff, tp = sampling_params(temperature.to(dev), top_p)

    keep = torch.ones(N, V, dtype=torch.bool, device=dev)
    if top_k is not None:
        k = top_k.to(device=dev, dtype=torch.int64)
        on = (k > 0) & (k < V)
        kth = l.sort(dim=1, descending=True).values.gather(1, (k.clamp(1, V) - 1).unsqueeze(1))
        keep = ~on.unsqueeze(1) | (l >= kth)

    # The max is subtracted before dividing by the temperature: no overflow for any T' or logit magnitude.
    w = torch.exp((l - l.amax(1, keepdim=True)) / t_eff.unsqueeze(1))
    w = torch.where(keep, w, torch.zeros_like(w))
    p = w / w.sum(1, keepdim=True)

    if tp is not None:
        on = tp < 1
        srt_l, order = l.sort(dim=1, descending=True)
        # First position, in decreasing logit order, whose cumulative mass reaches top_p; its logit is l*.
        reach = p.gather(1, order).cumsum(1) >= tp.unsqueeze(1)
        pos = torch.where(reach.any(1), reach.to(torch.int8).argmax(1), torch.full_like(tp, V - 1, dtype=torch.int64))
        l_star = srt_l.gather(1, pos.unsqueeze(1))
        p = torch.where(on.unsqueeze(1) & (l < l_star), torch.zeros_like(p), p)
        p = p / p.sum(1, keepdim=True)

    return torch.where(greedy.unsqueeze(1), onehot, p)


def sample_inverse_cdf(p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``int64 [N]``: the smallest token ``t`` with ``cumsum(p)[t] > u * sum(p)`` (token-id order).

    ``p`` is ``[N, V]`` non-negative (unnormalized is fine), ``u`` is ``[N]`` in (0, 1). If rounding
    puts ``u * sum`` at or past the total, the last token with ``p > 0`` is taken, so a
    zero-probability token is never returned.
    """
    p = p.to(torch.float64)
    cdf = p.cumsum(1)
    target = u.to(torch.float64) * cdf[:, -1]
    over = cdf > target.unsqueeze(1)
    first = over.to(torch.int8).argmax(1)
    V = p.shape[1]
    last_pos = V - 1 - (p > 0).flip(1).to(torch.int8).argmax(1)
    return torch.where(over.any(1), first, last_pos)
