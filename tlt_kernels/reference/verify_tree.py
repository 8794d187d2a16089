"""Reference tree verification: lossless acceptance of a draft tree (pure torch, float64).

Vectorized over the batch: the loops run over depth and over child *rank* (first child of the
current node, second child, ...), never over requests, so a Monte Carlo test with hundreds of
thousands of requests is a few batched calls. It synchronizes with the device (loop bounds, error
checks), so it is a contract and a baseline, not a CUDA-graph path.

The walk of one request (see :func:`tlt_kernels.verify_tree` for the full contract):
``cur = 0``; ``p`` = target distribution of row ``cur``. The children ``c`` of ``cur`` are tried
in increasing index order with the coin ``u = uniform(seed, offset, c, PURPOSE_ACCEPT)``:

* with draft probabilities ``q`` (row ``cur`` of ``draft_probs``, the distribution the children were
  drawn from i.i.d.): accept iff ``u * q(x) < p(x)``, i.e. with probability ``min(1, p(x)/q(x))``;
  on reject ``p <- norm(max(p - q, 0))`` (kept as is if that has no mass). This is speculative
  sampling (Leviathan et al. 2023, Chen et al. 2023) applied recursively over siblings (SpecInfer,
  Miao et al. 2024): each stage is an exact speculative sample of the residual, so the emitted token
  has law ``p``.
* without ``q`` (deterministic candidates): accept iff ``u < p(x)``; on reject ``p <- norm(p with x
  zeroed)``. Accepting x w.p. p(x) and otherwise sampling from p conditioned on "not x" is again
  exactly ``p``.

Greedy requests use the one-hot ``p`` at the argmax, for which both rules reduce to "accept the
first child whose token is the argmax" and the final token is the argmax. After an accept the walk
moves to the child; when no child is accepted (or at a leaf) it emits the final token by inverse CDF
with ``u' = uniform(seed, offset, cur, PURPOSE_SAMPLE)``.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .._backend import direct_dispatch_ok
from ..rng import PURPOSE_ACCEPT, PURPOSE_SAMPLE, uniform
from ..tree import resolve_num_nodes
from .sampling import row_errors, sample_inverse_cdf, target_probs


class VerifyResult(NamedTuple):
    """Output of :func:`tlt_kernels.verify_tree`.

    Attributes:
        tokens: ``int32 [B, max_depth+1]``: the accepted draft tokens, then the final token; -1 pad.
        num_accepted: ``int32 [B]``: number of accepted draft tokens (``tokens`` holds one more).
        accepted_nodes: ``int32 [B, max_depth+1]``: the path's node indices starting with 0; -1 pad.
        error: ``int32 [B]``: 1 where a row the request's walk visited held NaN/+inf or only -inf, or a child it
            tried had a token outside ``[0, V)``, else 0. Such a request's other outputs are reset (tokens -1,
            num_accepted 0, accepted_nodes ``[0, -1, ...]``, stats 0); other requests are unaffected.
        stats: None, or ``int32 [B, max_depth, 2]``: ``[:, d, 0]`` children tried at depth ``d+1``,
            ``[:, d, 1]`` whether one was accepted there (0/1).
    """

    tokens: torch.Tensor
    num_accepted: torch.Tensor
    accepted_nodes: torch.Tensor
    error: torch.Tensor
    stats: Optional[torch.Tensor] = None


def empty_verify_outputs(logits: torch.Tensor, max_depth: int, return_stats: bool):
    """Uninitialized int32 kernel outputs (also the fake-tensor shapes): ``tokens [B, max_depth+1]``,
    ``num_accepted [B]``, ``accepted_nodes [B, max_depth+1]``, ``error [B]``,
    ``stats [B, max_depth or 0, 2]``."""
    B = logits.shape[0]
    new = lambda *shape: logits.new_empty(shape, dtype=torch.int32)  # noqa: E731
    return new(B, max_depth + 1), new(B), new(B, max_depth + 1), new(B), new(B, max_depth if return_stats else 0, 2)



def make_verify_tree_op(op_name: str, launch):
    """A kernel backend's ``verify_tree``: ``launch(logits, draft_tokens, parents, num_nodes, draft_probs,
    temperature, top_k, top_p, seed, offset, max_depth, return_stats)`` returns ``(tokens, num_accepted,
    accepted_nodes, error, stats)``. Returns ``(op, verify)``: the ``torch.library`` custom op ``op_name`` (fake
    implementation from :func:`empty_verify_outputs`, for ``torch.compile``) and the backend entry point, which
    takes already-validated inputs and returns a :class:`VerifyResult`."""

    @torch.library.custom_op(op_name, mutates_args=())
    def op(
        logits: torch.Tensor, draft_tokens: torch.Tensor, parents: torch.Tensor, num_nodes: torch.Tensor,
        draft_probs: Optional[torch.Tensor], temperature: Optional[torch.Tensor], top_k: Optional[torch.Tensor],
        top_p: Optional[torch.Tensor], seed: torch.Tensor, offset: torch.Tensor, max_depth: int, return_stats: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return tuple(launch(logits, draft_tokens, parents, num_nodes, draft_probs, temperature, top_k, top_p, seed,
                            offset, max_depth, return_stats))

    @op.register_fake
    def _(logits, draft_tokens, parents, num_nodes, draft_probs, temperature, top_k, top_p, seed, offset, max_depth,
          return_stats):
        return empty_verify_outputs(logits, max_depth, return_stats)

    def verify(logits, draft_tokens, parents, num_nodes, draft_probs, temperature, top_k, top_p, seed, offset,
               max_depth, return_stats=False) -> VerifyResult:
        if num_nodes is None:
            num_nodes = torch.full((logits.shape[0],), logits.shape[1], dtype=torch.int32, device=logits.device)
        i64 = lambda t: t if t.dtype == torch.int64 else t.to(torch.int64)  # noqa: E731
        args = (logits, draft_tokens, parents, num_nodes, draft_probs, temperature, top_k, top_p,
                i64(seed), i64(offset), int(max_depth), bool(return_stats))
        # Plain eager calls launch directly (the op's dispatch is host time the kernel does not need).
        run = launch if direct_dispatch_ok(*args[:10]) else verify.op
        tokens, num, nodes, err, stats = run(*args)
        return VerifyResult(tokens, num, nodes, err, stats if return_stats else None)

    verify.op = op  # looked up per call, so tests can wrap it
    return op, verify

def verify_tree_reference(
    logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    parents: torch.Tensor,
    num_nodes: Optional[torch.Tensor],
    draft_probs: Optional[torch.Tensor],
    temperature: Optional[torch.Tensor],
    top_k: Optional[torch.Tensor],
    top_p: Optional[torch.Tensor],
    seed: torch.Tensor,
    offset: torch.Tensor,
    max_depth: int,
    return_stats: bool = False,
) -> VerifyResult:
    """Reference walk over already-validated inputs.

    Args:
        logits: ``[B, T, V]`` fp32/bf16/fp16. draft_tokens: ``int32/int64 [B, T]``.
        parents: ``int32 [B, T]``. num_nodes: ``int32 [B]`` or None (= T).
        draft_probs: ``[B, T, V]`` float or None. temperature: ``float32 [B]`` (0 = greedy) or None
            (all greedy). top_k: ``int32 [B]`` (0 = off) or None. top_p: ``float32 [B]`` (1 = off)
            or None. seed, offset: ``int64 [B]``. max_depth: deepest node the walk may accept.
    """
    B, T, V = logits.shape
    dev = logits.device
    ar = torch.arange(B, device=dev)
    n = resolve_num_nodes(parents, num_nodes).to(torch.int64)
    idx = torch.arange(T, device=dev)
    par = parents.to(torch.int64)
    is_node = (idx.unsqueeze(0) < n.unsqueeze(1)) & (idx.unsqueeze(0) > 0)
    toks = draft_tokens.to(torch.int64)
    seed = seed.to(torch.int64)
    offset = offset.to(torch.int64)

    error = torch.zeros(B, dtype=torch.bool, device=dev)
    sampled = torch.zeros(B, dtype=torch.bool, device=dev) if temperature is None else temperature.to(dev) > 0

    def probs_at(node: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        """The rows' target distributions; a visited row without one flags its request (and is replaced by zeros,
        so that no NaN reaches the other requests' arithmetic)."""
        nonlocal error
        rows = logits[ar, node]
        bad = row_errors(rows)
        error = error | (bad & active)
        return target_probs(torch.where(bad.unsqueeze(1), torch.zeros_like(rows), rows), temperature, top_k, top_p)

    def draft_row(node: torch.Tensor):
        """The normalized draft rows, and whether each is unusable: a float32 sum (the kernels' precision) that is
        not finite and positive flags a sampled request when a child is tested against it, as the kernels do."""
        q = draft_probs[ar, node]
        s32 = q.sum(1, dtype=torch.float32)
        q = q.to(torch.float64)
        s = q.sum(1, keepdim=True)
        return q / torch.where(s > 0, s, torch.ones_like(s)), ~(torch.isfinite(s32) & (s32 > 0))

    tokens = torch.full((B, max_depth + 1), -1, dtype=torch.int32, device=dev)
    nodes = torch.full((B, max_depth + 1), -1, dtype=torch.int32, device=dev)
    nodes[:, 0] = 0
    stats = torch.zeros(B, max(max_depth, 0), 2, dtype=torch.int32, device=dev)
    num_acc = torch.zeros(B, dtype=torch.int64, device=dev)

    cur = torch.zeros(B, dtype=torch.int64, device=dev)
    active = torch.ones(B, dtype=torch.bool, device=dev)
    p = probs_at(cur, active)
    active = active & ~error

    def finish(rows: torch.Tensor) -> None:
        nonlocal error
        # A distribution without positive mass has no token to emit: flagged (it cannot arise from a valid row,
        # whose maximal logits weigh exactly 1).
        error = error | (rows & ~(p.sum(1) > 0))
        u = uniform(seed, offset, cur, PURPOSE_SAMPLE)
        final = sample_inverse_cdf(p, u)
        tokens[ar, num_acc] = torch.where(rows, final.to(torch.int32), tokens[ar, num_acc])

    for d in range(max_depth):
        # Children of cur in increasing index order: sort child indices first, non-children last.
        child = is_node & (par == cur.unsqueeze(1))
        nchild = child.sum(1)
        width = int(nchild[active].max()) if active.any() else 0
        if width == 0:
            break
        order = torch.where(child, idx, idx + T).argsort(dim=1)[:, :width]
        q, q_bad = draft_row(cur) if draft_probs is not None else (None, None)
        accepted = torch.zeros(B, dtype=torch.bool, device=dev)
        nxt = cur.clone()
        for r in range(width):
            c = order[:, r]
            trying = active & ~accepted & (r < nchild)
            x = toks[ar, c]
            out_of_range = trying & ((x < 0) | (x >= V))
            if q is not None:
                out_of_range = out_of_range | (trying & sampled & q_bad)
            error = error | out_of_range
            trying = trying & ~out_of_range
            active = active & ~out_of_range
            x = x.clamp(0, V - 1)
            u = uniform(seed, offset, c, PURPOSE_ACCEPT).to(torch.float64)
            px = p[ar, x]
            if q is not None:
                # Greedy requests accept the argmax whatever the draft row holds (as the kernels do).
                acc = torch.where(sampled, u * q[ar, x] < px, px > 0)
                resid = (p - q).clamp(min=0)
            else:
                acc = u < px
                resid = p.clone()
                resid[ar, x] = 0.0
            mass = resid.sum(1, keepdim=True)
            resid = resid / torch.where(mass > 0, mass, torch.ones_like(mass))
            rejected = trying & ~acc
            p = torch.where((rejected.unsqueeze(1) & (mass > 0)), resid, p)
            stats[:, d, 0] += trying.to(torch.int32)
            won = trying & acc
            accepted |= won
            nxt = torch.where(won, c, nxt)
        stats[:, d, 1] = accepted.to(torch.int32)
        finish(active & ~accepted)
        tokens[ar, num_acc] = torch.where(accepted, toks[ar, nxt].to(torch.int32), tokens[ar, num_acc])
        num_acc = num_acc + accepted.to(torch.int64)
        nodes[ar, num_acc] = torch.where(accepted, nxt.to(torch.int32), nodes[ar, num_acc])
        active = accepted
        cur = nxt
        if not active.any():
            break
        p = torch.where(active.unsqueeze(1), probs_at(cur, active), p)
        active = active & ~error
    finish(active)

    # A flagged request's outputs are reset, as the kernels leave them.
    err = error.unsqueeze(1)
    tokens = tokens.masked_fill(err, -1)
    nodes = nodes.masked_fill(err, -1)
    nodes[:, 0] = 0
    num_acc = num_acc.masked_fill(error, 0)
    stats = stats.masked_fill(err.unsqueeze(2), 0)
    return VerifyResult(tokens, num_acc.to(torch.int32), nodes, error.to(torch.int32), stats if return_stats else None)
