"""Suite "block-verify": accepted drafts per step, block verification vs token-by-token verification.

Synthetic chains at a realistic per-token acceptance ``beta = E[sum_x min(p(x), q(x))]`` of 0.6, 0.75 and 0.9,
gamma 3 and 7, temperature 1: every position's target row is random logits (std 2) and the draft row is
``softmax(logits + sigma * noise)``, with ``sigma`` found by bisection so that the mean per-token acceptance is
``beta`` (reported as ``accept_rate``, measured on the rows used). The drafts are sampled from the draft rows, and
the same inputs go through ``verify_tree`` on the chain (token by token: ``impl = token``) and
``verify_chain_block`` (``impl = block``), each with its own seeded coins, for ``draws`` chains.

Columns: ``mean_accepted`` (drafts kept per chain, over the draws; the bonus/residual token not counted),
``exact`` on the token rows (``sum_k prod_{j<=k} beta_j`` per chain, averaged: the exact token-by-token
expectation for these rows, which do not depend on the drafted tokens), ``gain`` on the block rows (block mean /
token mean) and ``ms``, one call of each op at the suite's batch (``backend="auto"``: the torch references on a
CPU, the kernels on a GPU). Sizes: V = 512, 8 x 256 chains on a CPU; V = 32000, 16 x 2048 on a GPU.
"""
from __future__ import annotations

import torch

from tlt_kernels import chain_parents, verify_chain_block, verify_tree

SUITE = "block-verify"

LEVELS = (0.6, 0.75, 0.9)
GAMMAS = (3, 7)


def _rows(B, gamma, V, sigma, g, device):
    """``(logits float32 [B, gamma+1, V], q float32 [B, gamma, V])``."""
    logits = torch.randn(B, gamma + 1, V, generator=g, device=device) * 2
    noise = torch.randn(B, gamma, V, generator=g, device=device)
    return logits, torch.softmax(logits[:, :gamma] + sigma * noise, -1)


def _overlap(logits, q):
    """``float32 [B, gamma]``: per-token acceptance ``sum_x min(p, q)`` of each draft row."""
    return torch.minimum(torch.softmax(logits[:, :q.shape[1]], -1), q).sum(-1)


def _sigma_for(beta, V, device, g):
    """The noise scale whose mean per-token acceptance is ``beta`` (bisection; acceptance falls with sigma)."""
    lo, hi = 0.0, 16.0
    for _ in range(30):
        mid = (lo + hi) / 2
        if _overlap(*_rows(64, 1, V, mid, g, device)).mean().item() > beta:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _draw(logits, q, g):
    """Draft tokens ``int64 [B, gamma]`` sampled from the draft rows."""
    B, gamma, V = q.shape
    return torch.multinomial(q.reshape(B * gamma, V), 1, generator=g).reshape(B, gamma)


def _token_exact(logits, q):
    """Exact token-by-token expectation per chain, averaged: ``mean_b sum_k prod_{j<=k} beta_bj``."""
    return _overlap(logits, q).double().cumprod(1).sum(1).mean().item()


def _both(logits, q, drafts, seed):
    """``(token num_accepted, block num_accepted)`` of one batch (seeded coins, no host checks)."""
    B, gamma, V = q.shape
    dev = logits.device
    root = torch.zeros(B, 1, dtype=torch.int64, device=dev)
    tree_probs = torch.cat([q, torch.zeros(B, 1, V, device=dev)], 1)
    parents = chain_parents(B, gamma + 1, device=dev)
    seeds = torch.arange(B, device=dev) + seed * B
    token = verify_tree(logits, torch.cat([root, drafts], 1), parents, draft_probs=tree_probs, temperature=1.0,
                        seed=seeds, validate=False)
    block = verify_chain_block(logits, drafts, q, temperature=1.0, seed=seeds, validate=False)
    return (token.num_accepted, block.num_accepted), (
        lambda: verify_tree(logits, torch.cat([root, drafts], 1), parents, draft_probs=tree_probs, temperature=1.0,
                            seed=seeds, validate=False),
        lambda: verify_chain_block(logits, drafts, q, temperature=1.0, seed=seeds, validate=False))


def _case(ctx, gamma, beta, V, B, rounds):
    g = torch.Generator(device=ctx.device).manual_seed(1000 * gamma + int(100 * beta))
    sigma = _sigma_for(beta, V, ctx.device, g)
    sums, exact, rate = [0.0, 0.0], 0.0, 0.0
    for r in range(rounds):
        logits, q = _rows(B, gamma, V, sigma, g, ctx.device)
        drafts = _draw(logits, q, g)
        accepted, calls = _both(logits, q, drafts, r)
        for k in range(2):
            sums[k] += accepted[k].double().mean().item() / rounds
        exact += _token_exact(logits, q) / rounds
        rate += _overlap(logits, q).mean().item() / rounds
    case = {"gamma": gamma, "accept": beta, "V": V, "draws": B * rounds}
    ctx.add(case, "token", ctx.time_ms(calls[0]), mean_accepted=round(sums[0], 4), exact=round(exact, 4),
            accept_rate=round(rate, 4))
    ctx.add(case, "block", ctx.time_ms(calls[1]), mean_accepted=round(sums[1], 4),
            gain=round(sums[1] / sums[0], 4), accept_rate=round(rate, 4))


def run(ctx) -> None:
    on_gpu = ctx.device.type == "cuda"
    V, B, rounds = (32000, 2048, 16) if on_gpu else (512, 256, 8)
    ctx.note("mean_accepted: drafts kept per chain; exact (token rows): sum_k prod_j beta_j, the token-by-token "
             "expectation on these rows; gain (block rows): block / token mean accepted")
    for gamma in GAMMAS:
        for beta in LEVELS:
            _case(ctx, gamma, beta, V, B, rounds)
