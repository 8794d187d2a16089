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
        logprobs: None, or ``float32 [B, max_depth+1]``: ``logprobs[b, j]`` is the log-probability of
            ``tokens[b, j]`` under the target's sampling distribution (temperature, top-k, top-p) of the row that
            predicted it, row ``accepted_nodes[b, j]``; 0 for a greedy request's tokens (a point mass at the
            argmax), 0 on padding and on flagged requests. (:func:`path_logprobs`.)
        raw_logprobs: None, or ``float32 [B, max_depth+1]``: the same tokens under the raw distribution,
            ``log_softmax`` of the row's logits at temperature 1 with no filter; 0 on padding and flagged requests.
    """

    tokens: torch.Tensor
    num_accepted: torch.Tensor
    accepted_nodes: torch.Tensor
    error: torch.Tensor
    stats: Optional[torch.Tensor] = None
    logprobs: Optional[torch.Tensor] = None
    raw_logprobs: Optional[torch.Tensor] = None


def path_logprobs(logits: torch.Tensor, result: VerifyResult, temperature: Optional[torch.Tensor],
                  top_k: Optional[torch.Tensor], top_p: Optional[torch.Tensor], sampled: bool = True,
                  raw: bool = False):
    """``(logprobs | None, raw_logprobs | None)``, each ``float32 [B, max_depth+1]``, of the tokens a walk emitted
    (see :class:`VerifyResult`). Token ``j`` of a request was predicted by row ``accepted_nodes[j]`` (the accepted
    node it hangs from, or for the final token the last accepted node), so only rows the walk read are read. Its law
    is the row's target distribution whether it was an accepted draft or the final sample (the acceptance rule is
    lossless), so that distribution is the one scored, not the residual the final token was drawn from. float64
    arithmetic, no host sync (capturable); ``sampled`` / ``raw`` pick the outputs."""
    if not (sampled or raw):
        return None, None
    B, W = result.tokens.shape
    V = logits.shape[2]
    emitted = (torch.arange(W, device=logits.device).unsqueeze(0) <= result.num_accepted.unsqueeze(1).long())
    emitted &= ~result.error.bool().unsqueeze(1)
    nodes = torch.where(emitted, result.accepted_nodes.long(), torch.zeros_like(result.accepted_nodes, dtype=torch.long))
    rows = logits.gather(1, nodes.unsqueeze(2).expand(B, W, V)).reshape(B * W, V).to(torch.float64)
    rows = torch.where(emitted.reshape(B * W, 1), rows, torch.zeros_like(rows))  # no NaN from rows never scored
    token = torch.where(emitted, result.tokens.long(), torch.zeros_like(result.tokens, dtype=torch.long))
    token = token.reshape(B * W, 1)

    def scored(values):
        return torch.where(emitted, values.reshape(B, W), torch.zeros_like(values.reshape(B, W))).to(torch.float32)

    per_row = lambda t: None if t is None else t.repeat_interleave(W)  # noqa: E731  ([B] -> one value per row)
    out_sampled = out_raw = None
    if sampled:
        probs = target_probs(rows, per_row(temperature), per_row(top_k), per_row(top_p))
        out_sampled = scored(probs.gather(1, token).squeeze(1).log())
    if raw:
        out_raw = scored(torch.log_softmax(rows, dim=1).gather(1, token).squeeze(1))
    return out_sampled, out_raw


def empty_verify_outputs(logits: torch.Tensor, max_depth: int, return_stats: bool):
    """Uninitialized int32 kernel outputs (also the fake-tensor shapes): ``tokens [B, max_depth+1]``,
    ``num_accepted [B]``, ``accepted_nodes [B, max_depth+1]``, ``error [B]``,
    ``stats [B, max_depth or 0, 2]``."""
    B = logits.shape[0]
    new = lambda *shape: logits.new_empty(shape, dtype=torch.int32)  # noqa: E731
    return new(B, max_depth + 1), new(B), new(B, max_depth + 1), new(B), new(B, max_depth if return_stats else 0, 2)



def empty_verify_scores(logits: torch.Tensor, max_depth: int) -> torch.Tensor:
    """Uninitialized ``float32 [B, max_depth+1, 2]``: a scored walk's (sampled, raw) log-probs (also the fake)."""
    return logits.new_empty((logits.shape[0], max_depth + 1, 2), dtype=torch.float32)


def scored_launch(launch):
    """A backend's scored launch from its plain one, which takes ``scores=`` (a float32 ``[B, max_depth+1, 2]``
    buffer the walk fills with the emitted tokens' log-probs): returns ``(tokens, num, nodes, error, stats,
    scores)``, what :func:`make_verify_tree_op` with ``scored=True`` wraps."""
    def launch_scored(logits, draft_tokens, parents, num_nodes, draft_probs, temperature, top_k, top_p, seed, offset,
                      max_depth, return_stats):
        scores = empty_verify_scores(logits, max_depth)
        out = launch(logits, draft_tokens, parents, num_nodes, draft_probs, temperature, top_k, top_p, seed, offset,
                     max_depth, return_stats, scores=scores)
        return (*out, scores)

    return launch_scored


def make_verify_tree_op(op_name: str, launch, scored: bool = False):
    """A kernel backend's ``verify_tree``: ``launch(logits, draft_tokens, parents, num_nodes, draft_probs,
    temperature, top_k, top_p, seed, offset, max_depth, return_stats)`` returns ``(tokens, num_accepted,
    accepted_nodes, error, stats)``, and with ``scored`` also ``scores float32 [B, max_depth+1, 2]``: the emitted
    tokens' (sampled, raw) log-probs computed in the walk. Returns ``(op, verify)``: the ``torch.library`` custom op
    ``op_name`` (fake implementation from :func:`empty_verify_outputs`, for ``torch.compile``) and the backend entry
    point, which takes already-validated inputs and returns a :class:`VerifyResult` (``logprobs`` and
    ``raw_logprobs`` filled when ``scored``)."""

    def fake(logits, draft_tokens, parents, num_nodes, draft_probs, temperature, top_k, top_p, seed, offset, max_depth,
             return_stats):
        out = empty_verify_outputs(logits, max_depth, return_stats)
        if scored:
            out = (*out, empty_verify_scores(logits, max_depth))
        return out

    def run_launch(
        logits: torch.Tensor, draft_tokens: torch.Tensor, parents: torch.Tensor, num_nodes: torch.Tensor,
        draft_probs: Optional[torch.Tensor], temperature: Optional[torch.Tensor], top_k: Optional[torch.Tensor],
        top_p: Optional[torch.Tensor], seed: torch.Tensor, offset: torch.Tensor, max_depth: int, return_stats: bool,
    ):
        return tuple(launch(logits, draft_tokens, parents, num_nodes, draft_probs, temperature, top_k, top_p, seed,
                            offset, max_depth, return_stats))

    # The schema is read from the annotations: five tensors, six when scored.
    run_launch.__annotations__["return"] = tuple.__class_getitem__((torch.Tensor,) * (6 if scored else 5))
    op = torch.library.custom_op(op_name, run_launch, mutates_args=())
    op.register_fake(fake)

    def verify(logits, draft_tokens, parents, num_nodes, draft_probs, temperature, top_k, top_p, seed, offset,
               max_depth, return_stats=False) -> VerifyResult:
        if num_nodes is None:
            num_nodes = torch.full((logits.shape[0],), logits.shape[1], dtype=torch.int32, device=logits.device)
        i64 = lambda t: t if t.dtype == torch.int64 else t.to(torch.int64)  # noqa: E731
        args = (logits, draft_tokens, parents, num_nodes, draft_probs, temperature, top_k, top_p,
                i64(seed), i64(offset), int(max_depth), bool(return_stats))
        # Plain eager calls launch directly (the op's dispatch is host time the kernel does not need).
        run = launch if direct_dispatch_ok(*args[:10]) else verify.op
        tokens, num, nodes, err, stats, *scores = run(*args)
        logprobs = raw_logprobs = None
        if scored:
            logprobs, raw_logprobs = scores[0][..., 0], scores[0][..., 1]
        return VerifyResult(tokens, num, nodes, err, stats if return_stats else None, logprobs, raw_logprobs)

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
    walk = _Walk(logits, draft_tokens, parents, num_nodes, draft_probs, temperature, top_k, top_p, seed, offset,
                 max_depth)
    for depth in range(max_depth):
        if not walk.step(depth):
            break
    walk.emit_final(walk.active)
    return walk.result(return_stats)


def _accept_rule(p: torch.Tensor, q: Optional[torch.Tensor], x: torch.Tensor, u: torch.Tensor, sampled: torch.Tensor):
    """Whether each request accepts its child token ``x`` with coin ``u`` under its current distribution ``p``, and
    the residual a rejection leaves: ``(accept, residual normalized where it has mass, its mass [B, 1])``.

    With the draft rows ``q``: accept iff ``u * q(x) < p(x)``, residual ``max(p - q, 0)`` (greedy requests accept
    the argmax whatever the draft row holds, as the kernels do). Without: accept iff ``u < p(x)``, residual ``p``
    with ``x`` zeroed."""
    rows = torch.arange(p.shape[0], device=p.device)
    px = p[rows, x]
    if q is not None:
        accept = torch.where(sampled, u * q[rows, x] < px, px > 0)
        residual = (p - q).clamp(min=0)
    else:
        accept = u < px
        residual = p.clone()
        residual[rows, x] = 0.0
    mass = residual.sum(1, keepdim=True)
    return accept, residual / torch.where(mass > 0, mass, torch.ones_like(mass)), mass


class _Walk:
    """The walks of every request of a batch, advanced one depth at a time: the current node ``cur`` and its
    (residual) target distribution ``p``, the requests still walking (``active``) or flagged (``error``), and the
    outputs written so far."""

    def __init__(self, logits, draft_tokens, parents, num_nodes, draft_probs, temperature, top_k, top_p, seed, offset,
                 max_depth):
        B, T, V = logits.shape
        dev = logits.device
        self.logits, self.draft_probs, self.vocab_size = logits, draft_probs, V
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.seed, self.offset = seed.to(torch.int64), offset.to(torch.int64)
        self.rows = torch.arange(B, device=dev)
        self.node_ids = torch.arange(T, device=dev)
        n = resolve_num_nodes(parents, num_nodes).to(torch.int64)
        self.parents = parents.to(torch.int64)
        self.is_node = (self.node_ids.unsqueeze(0) < n.unsqueeze(1)) & (self.node_ids.unsqueeze(0) > 0)
        self.draft_tokens = draft_tokens.to(torch.int64)
        self.error = torch.zeros(B, dtype=torch.bool, device=dev)
        self.sampled = (torch.zeros(B, dtype=torch.bool, device=dev) if temperature is None
                        else temperature.to(dev) > 0)
        self.tokens = torch.full((B, max_depth + 1), -1, dtype=torch.int32, device=dev)
        self.nodes = torch.full((B, max_depth + 1), -1, dtype=torch.int32, device=dev)
        self.nodes[:, 0] = 0
        self.stats = torch.zeros(B, max(max_depth, 0), 2, dtype=torch.int32, device=dev)
        self.num_accepted = torch.zeros(B, dtype=torch.int64, device=dev)
        self.cur = torch.zeros(B, dtype=torch.int64, device=dev)
        self.active = torch.ones(B, dtype=torch.bool, device=dev)
        self.p = self.target_dist(self.cur)
        self.active = self.active & ~self.error

    def target_dist(self, node: torch.Tensor) -> torch.Tensor:
        """The rows' target distributions; a visited row without one flags its (active) request, and is replaced by
        zeros, so that no NaN reaches the other requests' arithmetic."""
        rows = self.logits[self.rows, node]
        bad = row_errors(rows)
        self.error = self.error | (bad & self.active)
        rows = torch.where(bad.unsqueeze(1), torch.zeros_like(rows), rows)
        return target_probs(rows, self.temperature, self.top_k, self.top_p)

    def draft_rows(self, node: torch.Tensor):
        """The normalized draft rows, and whether each is unusable: a float32 sum (the kernels' precision) that is
        not finite and positive flags a sampled request when a child is tested against it, as the kernels do."""
        q = self.draft_probs[self.rows, node]
        s32 = q.sum(1, dtype=torch.float32)
        q = q.to(torch.float64)
        s = q.sum(1, keepdim=True)
        return q / torch.where(s > 0, s, torch.ones_like(s)), ~(torch.isfinite(s32) & (s32 > 0))

    def children_in_order(self):
        """``(order [B, width], num_children [B], width)``: the children of ``cur`` in increasing index order
        (non-children sorted last), ``width`` the most children an active request has."""
        child = self.is_node & (self.parents == self.cur.unsqueeze(1))
        num_children = child.sum(1)
        width = int(num_children[self.active].max()) if self.active.any() else 0
        T = self.node_ids.shape[0]
        order = torch.where(child, self.node_ids, self.node_ids + T).argsort(dim=1)[:, :width]
        return order, num_children, width

    def step(self, depth: int) -> bool:
        """One depth: the active requests try the children of ``cur`` in index order and move to the first accepted
        one; a request that accepts none emits its final token. Returns whether any request walks on."""
        order, num_children, width = self.children_in_order()
        if width == 0:
            return False
        q, q_bad = self.draft_rows(self.cur) if self.draft_probs is not None else (None, None)
        accepted = torch.zeros_like(self.active)
        nxt = self.cur.clone()
        for rank in range(width):
            child = order[:, rank]
            trying = self.active & ~accepted & (rank < num_children)
            won = self.try_child(child, trying, q, q_bad, depth)
            accepted |= won
            nxt = torch.where(won, child, nxt)
        self.stats[:, depth, 1] = accepted.to(torch.int32)
        self.emit_final(self.active & ~accepted)
        self.move_to(accepted, nxt)
        if not self.active.any():
            return False
        self.p = torch.where(self.active.unsqueeze(1), self.target_dist(self.cur), self.p)
        self.active = self.active & ~self.error
        return True

    def try_child(self, child, trying, q, q_bad, depth: int) -> torch.Tensor:
        """The ``trying`` requests test ``child`` with its coin; a rejection leaves ``p`` the residual. A child token
        outside ``[0, V)`` (or an unusable draft row of a sampled request) flags the request instead. Returns the
        requests that accepted ``child``."""
        V = self.vocab_size
        x = self.draft_tokens[self.rows, child]
        invalid = trying & ((x < 0) | (x >= V))
        if q is not None:
            invalid = invalid | (trying & self.sampled & q_bad)
        self.error = self.error | invalid
        trying = trying & ~invalid
        self.active = self.active & ~invalid
        u = uniform(self.seed, self.offset, child, PURPOSE_ACCEPT).to(torch.float64)
        accept, residual, mass = _accept_rule(self.p, q, x.clamp(0, V - 1), u, self.sampled)
        rejected = trying & ~accept
        self.p = torch.where((rejected.unsqueeze(1) & (mass > 0)), residual, self.p)
        self.stats[:, depth, 0] += trying.to(torch.int32)
        return trying & accept

    def emit_final(self, rows: torch.Tensor) -> None:
        """The requests of ``rows`` emit their final token: an inverse-CDF sample of ``p``."""
        # A distribution without positive mass has no token to emit: flagged (it cannot arise from a valid row,
        # whose maximal logits weigh exactly 1).
        self.error = self.error | (rows & ~(self.p.sum(1) > 0))
        u = uniform(self.seed, self.offset, self.cur, PURPOSE_SAMPLE)
        final = sample_inverse_cdf(self.p, u)
        at = (self.rows, self.num_accepted)
        self.tokens[at] = torch.where(rows, final.to(torch.int32), self.tokens[at])

    def move_to(self, accepted: torch.Tensor, nxt: torch.Tensor) -> None:
        """The ``accepted`` requests record child ``nxt`` (token and node) and move to it; the others stop."""
        at = (self.rows, self.num_accepted)
        self.tokens[at] = torch.where(accepted, self.draft_tokens[self.rows, nxt].to(torch.int32), self.tokens[at])
        self.num_accepted = self.num_accepted + accepted.to(torch.int64)
        at = (self.rows, self.num_accepted)
        self.nodes[at] = torch.where(accepted, nxt.to(torch.int32), self.nodes[at])
        self.active = accepted
        self.cur = nxt

    def result(self, return_stats: bool) -> VerifyResult:
        """The outputs, with a flagged request's reset as the kernels leave them."""
        err = self.error.unsqueeze(1)
        tokens = self.tokens.masked_fill(err, -1)
        nodes = self.nodes.masked_fill(err, -1)
        nodes[:, 0] = 0
        num_accepted = self.num_accepted.masked_fill(self.error, 0).to(torch.int32)
        stats = self.stats.masked_fill(err.unsqueeze(2), 0)
        return VerifyResult(tokens, num_accepted, nodes, self.error.to(torch.int32), stats if return_stats else None)
