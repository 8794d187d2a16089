"""The target distribution of one logits row: temperature, top-k, top-p (pure torch, float64).

This is the contract every sampling backend reproduces. For a row ``l`` (a request's logits after
one node) and the request's parameters:

* greedy when ``temperature`` is 0 (callers map ``None`` to 0): the distribution is one-hot at
  ``argmax(l)`` (the lowest token id among ties);
* otherwise ``z = l / temperature``;
* top-k (disabled when ``k`` is 0 or ``>= V``): keep every token with ``z >= z_(k)``, the k-th
  largest value. Ties at the boundary are all kept (a *threshold*, so a kernel can find it by
  bisection on the value instead of sorting);
* ``p = softmax(z)`` over the kept tokens;
* top-p (disabled when ``top_p == 1``): ``tau* = max{tau : sum(p_i for p_i >= tau) >= top_p}``;
  keep ``{p_i >= tau*}`` and renormalize. This equals the sort-based "smallest set of most likely
  tokens whose mass reaches top_p", except that ties at the boundary are all kept.

``-inf`` logits are legal (probability 0). Rows holding NaN or ``+inf``, or only ``-inf``, have no
distribution: :func:`row_errors` flags them and callers must not use their probabilities.
"""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["greedy_tokens", "row_errors", "target_probs", "sample_inverse_cdf"]


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """``int64 [...]``: argmax over the last dim, the lowest id among ties (``torch.argmax`` rule)."""
    return logits.argmax(dim=-1)


def row_errors(logits: torch.Tensor) -> torch.Tensor:
    """``bool [...]``: rows with a NaN or ``+inf``, or with every entry ``-inf``."""
    bad = torch.isnan(logits).any(-1) | torch.isposinf(logits).any(-1)
    return bad | torch.isneginf(logits).all(-1)


def target_probs(
    logits: torch.Tensor,
    temperature: Optional[torch.Tensor] = None,
    top_k: Optional[torch.Tensor] = None,
    top_p: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Target distribution of each row.

    Args:
        logits: ``[N, V]`` float (any float dtype; computed in float64).
        temperature: ``[N]`` float or None (None = greedy for every row; 0 = greedy for that row).
        top_k: ``[N]`` int or None (0 or ``>= V`` disables).
        top_p: ``[N]`` float in (0, 1] or None (1 disables).

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
    temp = temperature.to(device=dev, dtype=torch.float64)
    greedy = temp <= 0
    z = l / torch.where(greedy, torch.ones_like(temp), temp).unsqueeze(1)

    if top_k is not None:
        k = top_k.to(device=dev, dtype=torch.int64)
        on = (k > 0) & (k < V)
        kth = z.sort(dim=1, descending=True).values.gather(1, (k.clamp(1, V) - 1).unsqueeze(1))
        z = torch.where(on.unsqueeze(1) & (z < kth), torch.full_like(z, float("-inf")), z)

    p = torch.softmax(z, dim=1)

    if top_p is not None:
        tp = top_p.to(device=dev, dtype=torch.float64)
        on = tp < 1
        srt = p.sort(dim=1, descending=True).values
        # First sorted position whose cumulative mass reaches top_p; its probability is tau*.
        reach = srt.cumsum(1) >= tp.unsqueeze(1)
        pos = torch.where(reach.any(1), reach.to(torch.int8).argmax(1), torch.full_like(tp, V - 1, dtype=torch.int64))
        tau = srt.gather(1, pos.unsqueeze(1))
        p = torch.where(on.unsqueeze(1) & (p < tau), torch.zeros_like(p), p)
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
