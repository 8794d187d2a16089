"""``verify_tree``: lossless acceptance of a draft token tree from the target's logits."""
from __future__ import annotations

import numbers
from typing import Optional

import torch

from .._backend import register_op
from .._validation import check_tensor, dense, per_request
from ..reference.verify_tree import VerifyResult, path_logprobs
from ..tree import resolve_num_nodes, tree_depths, validate_tree

__all__ = ["VerifyResult", "verify_tree"]

_BACKENDS = register_op(
    "verify_tree",
    {
        "torch": "tlt_kernels.reference.verify_tree:verify_tree_reference",
        "triton": "tlt_kernels._triton.verify_tree:verify_tree_triton",
        "cuda": "tlt_kernels._cuda.verify_tree:verify_tree_cuda",
    },
    # CUDA first: several times faster than the Triton kernel from CUDA graphs on every acceptance case
    # (docs/CUDA_NOTES.md, "Backend order"). Triton stays the fallback where tlt_kernels._C is not built.
    preference=("cuda", "triton", "torch"),
)

# The valid values of the per-request sampling parameters, with the words of the error. Each predicate takes a Python
# number (host values, checked as the parameter is read) or a tensor (device values, checked by ``_validate``).
_F32_MAX = float(torch.finfo(torch.float32).max)
_RANGES = {
    "temperature": (lambda v: (v >= 0) & (v <= _F32_MAX),
                    f"a value in [0, {_F32_MAX}] (finite in float32; None or 0 = greedy)"),
    "top_k": (lambda v: v >= 0, "an integer >= 0 (None or 0 = off)"),
    "top_p": (lambda v: (v > 0) & (v <= 1), "a value in (0, 1] (None or 1 = off)"),
}
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_INTS = (torch.int32, torch.int64)
_U64 = 2**64
_I32_MAX = 2**31 - 1
# Positive temperatures and top_p below the normal float32 range act as this value in every backend (the contract's
# clamp); applying it before the float32 conversion keeps a positive value from rounding to 0 (greedy / invalid).
_MIN_NORMAL = 2.0**-126


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _none_to(value, fill):
    # Lists may mix None (= off / greedy) with numbers; tensors and scalars pass through.
    if isinstance(value, (list, tuple)):
        return [fill if v is None else v for v in value]
    return value


def _host_values(name, value, fill, integer, ok=None, expected=""):
    """The host values of a per-request parameter (a number or a list; None entries = ``fill``), each checked:
    a non-number (or a non-integer where ``integer``) raises TypeError, a value outside ``ok`` ValueError."""
    is_list = isinstance(value, (list, tuple))
    values = _none_to(list(value) if is_list else [value], fill)
    for b, v in enumerate(values):
        where = f"{name}[{b}]" if is_list else name
        if isinstance(v, bool) or not isinstance(v, numbers.Integral if integer else numbers.Real):
            raise TypeError(f"{where} = {v!r} is invalid: expected {expected}")
        if ok is not None and not ok(v):
            raise ValueError(f"{where} = {v!r} is invalid: expected {expected}")
    return values if is_list else values[0]


def _map(value, fn):
    return [fn(v) for v in value] if isinstance(value, list) else fn(value)


def _float_param(name, value, B, device, fill):
    """``float32 [B]`` temperature / top_p (None stays None): host values range-checked here; positive values below
    2**-126 become 2**-126 before the float32 conversion (float64 tensors too: a device op, no sync)."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if not value.is_floating_point():
            raise TypeError(f"{name} must be a floating-point scalar/list/[B] tensor, got dtype {str(value.dtype).replace('torch.', '')}")
        if value.dtype == torch.float64:
            value = torch.where(value > 0, value.clamp(min=_MIN_NORMAL), value)
        return per_request(name, value, B, device, torch.float32)
    value = _host_values(name, value, fill, False, *_RANGES[name])
    return per_request(name, _map(value, lambda v: _MIN_NORMAL if 0 < v < _MIN_NORMAL else float(v)), B, device,
                       torch.float32)


def _top_k_param(value, B, device):
    """``int32 [B]`` top_k (None stays None). Values past int32 are off like any k >= V: clamped, not wrapped
    (``per_request`` saturates an int64 tensor on the device)."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() or value.dtype == torch.bool:
            raise TypeError(f"top_k must be an integer scalar/list/[B] tensor, got dtype {str(value.dtype).replace('torch.', '')}")
        return per_request("top_k", value, B, device, torch.int32)
    value = _host_values("top_k", value, 0, True, *_RANGES["top_k"])
    return per_request("top_k", _map(value, lambda v: min(int(v), _I32_MAX)), B, device, torch.int32)


def _u64_param(name, value, B, device):
    """``int64 [B]`` seed / offset: a 64-bit word. Python integers of any size are taken modulo 2**64 (stored as
    int64 two's complement, so -1 and 2**64 - 1 are the same key); integer tensors are read as their int64 bits."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer scalar/list/[B] tensor, got dtype {str(value.dtype).replace('torch.', '')}")
        return per_request(name, value, B, device, torch.int64)
    value = _host_values(name, value, 0, True, expected="an integer (any size: taken modulo 2**64)")
    wrap = lambda v: (int(v) + 2**63) % _U64 - 2**63  # noqa: E731  (the int64 with the same low 64 bits)
    return per_request(name, _map(value, wrap), B, device, torch.int64)


def _unit_last_stride(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``t`` when its last dim is dense (a row slice of padded logits stays a view), else a contiguous copy."""
    return t if t is None or t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def _validate(logits, draft_tokens, parents, n, draft_probs, temp, k, tp, max_depth: int) -> None:
    """The value checks of ``validate=True`` with two small device-to-host copies (the tree metadata; one sum and
    one minimum per draft row with the per-request parameters), checked on the host; an error's exact
    draft-probability element is looked up afterwards, on the failing row only: a few host round trips instead of
    one synchronizing device op per check (docs/INTEGRATION.md, "Calling the ops from your engine", has the cost)."""
    B, T, V = logits.shape
    if B == 0:
        return
    i64 = lambda t: t.to(torch.int64).reshape(B, -1)  # noqa: E731
    parts = [i64(parents), i64(draft_tokens), i64(n)]
    params = [(name, t) for name, t in (("temperature", temp), ("top_k", k), ("top_p", tp)) if t is not None]
    floats = [t.to(torch.float64).reshape(B, 1) for _, t in params]
    if draft_probs is not None:
        # Per row: the sum (NaN/+inf propagate; zero mass) and the minimum (negative, -inf, NaN).
        floats += [draft_probs.sum(-1, dtype=torch.float32).to(torch.float64), draft_probs.amin(-1).to(torch.float64)]
    ints = torch.cat(parts, 1).cpu()  # the only syncs: these two copies, queued back to back
    flt = torch.cat(floats, 1).cpu() if floats else None
    par_cpu, tok_cpu, n_cpu = ints[:, :T], ints[:, T:2 * T], ints[:, 2 * T]
    validate_tree(par_cpu, n_cpu)
    depth = tree_depths(par_cpu, n_cpu)
    deepest = int(depth.max())
    if deepest > max_depth:
        b, i = (int(v) for v in (depth == deepest).nonzero()[0])
        raise ValueError(f"request {b}, node {i} has depth {deepest} > max_depth={max_depth}; raise max_depth or prune the tree")
    idx = torch.arange(T)
    in_tree = idx.unsqueeze(0) < n_cpu.unsqueeze(1)
    live = in_tree & (idx.unsqueeze(0) > 0)
    bad = live & ((tok_cpu < 0) | (tok_cpu >= V))
    if bad.any():
        b, i = (int(v) for v in bad.nonzero()[0])
        raise ValueError(f"draft_tokens[{b}, {i}] = {int(tok_cpu[b, i])} is outside the vocabulary [0, V={V})")
    if draft_probs is not None:
        row_sum, row_min = flt[:, len(params):len(params) + T], flt[:, len(params) + T:]
        bad = in_tree & ~(torch.isfinite(row_sum) & (row_min >= 0))
        if bad.any():
            b, i = (int(v) for v in bad.nonzero()[0])
            row = draft_probs[b, i]
            elems = (~torch.isfinite(row) | (row < 0)).nonzero()
            if elems.numel():
                t = int(elems[0, 0])
                raise ValueError(f"draft_probs[{b}, {i}, {t}] = {row[t].item()}: draft probabilities must be finite and >= 0")
            raise ValueError(f"draft_probs[{b}, {i}] sums to {row_sum[b, i].item()} in float32: rows must have a finite sum")
        has_child = torch.zeros(B, T, dtype=torch.bool)
        has_child.scatter_(1, torch.where(live, par_cpu.clamp(min=0), torch.zeros_like(par_cpu)), live)
        empty = has_child & (row_sum <= 0)
        if empty.any():
            b, i = (int(v) for v in empty.nonzero()[0])
            raise ValueError(f"draft_probs[{b}, {i}] sums to 0 but node {i} has children drawn from it")
    for col, (name, t) in enumerate(params):
        ok, expected = _RANGES[name]
        values = flt[:, col]
        bad = ~ok(values)
        if bad.any():
            b = int(bad.nonzero()[0, 0])
            value = t[b].item()  # the caller's dtype: an int stays an int in the message
            raise ValueError(f"{name}[{b}] = {value} is invalid: expected {expected}")


def _check_inputs(logits, draft_tokens, parents, num_nodes, draft_probs, max_depth):
    """Dtype, shape and device checks (metadata only: no sync); returns ``(num_nodes int32 [B], max_depth)`` with
    their defaults (T nodes, depth ``T - 1``) filled in."""
    check_tensor("logits", logits, dtype=_FLOATS, ndim=3)
    B, T, V = logits.shape
    dev = logits.device
    if T < 1 or V < 1:
        raise ValueError(f"logits must have T >= 1 nodes and V >= 1 tokens, got shape {tuple(logits.shape)}")
    check_tensor("draft_tokens", draft_tokens, dtype=_INTS, shape=(B, T), device=dev)
    check_tensor("parents", parents, dtype=_INTS, shape=(B, T), device=dev)
    num_nodes = resolve_num_nodes(parents, num_nodes)
    if draft_probs is not None:
        check_tensor("draft_probs", draft_probs, dtype=_FLOATS, shape=(B, T, V), device=dev)
    if max_depth is None:
        max_depth = T - 1
    if not isinstance(max_depth, int) or isinstance(max_depth, bool) or max_depth < 0:
        raise ValueError(f"max_depth must be a non-negative int, got {max_depth!r}")
    return num_nodes, max_depth


def _sampling_params(temperature, top_k, top_p, seed, offset, B, device):
    """The per-request parameters as ``[B]`` device tensors: ``(temperature float32 | None, top_k int32 | None,
    top_p float32 | None, seed int64, offset int64)``. Without seeds, they are drawn from torch's default CPU
    generator."""
    temperature = _float_param("temperature", temperature, B, device, 0.0)
    top_k = _top_k_param(top_k, B, device)
    top_p = _float_param("top_p", top_p, B, device, 1.0)
    if seed is None:
        seed = torch.randint(-(2**63), 2**63 - 1, (B,), dtype=torch.int64).to(device)
    seed = _u64_param("seed", seed, B, device)
    offset = _u64_param("offset", 0 if offset is None else offset, B, device)
    return temperature, top_k, top_p, seed, offset


def _kernel_layout(logits, draft_tokens, parents, num_nodes, draft_probs, temperature, top_k, top_p, seed, offset):
    """The backends' inputs in the layout the kernels index: row-major strides (logits / draft_probs: any batch and
    node strides, a unit vocabulary stride). Views are made dense here, once (device copies, no sync, capturable)."""
    logits, draft_probs = _unit_last_stride(logits), _unit_last_stride(draft_probs)
    return (logits, dense(draft_tokens), dense(parents), dense(num_nodes), draft_probs, dense(temperature),
            dense(top_k), dense(top_p), dense(seed), dense(offset))


def verify_tree(
    logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    parents: torch.Tensor,
    num_nodes: Optional[torch.Tensor] = None,
    draft_probs: Optional[torch.Tensor] = None,
    temperature=None,
    top_k=None,
    top_p=None,
    seed=None,
    offset=None,
    max_depth: Optional[int] = None,
    return_stats: bool = False,
    validate: bool = True,
    backend: str = "auto",
    return_logprobs: bool = False,
    return_raw_logprobs: bool = False,
) -> VerifyResult:
    """Accept the longest path of a draft tree that the target agrees with, losslessly.

    For each request the walk starts at the root (node 0, the last accepted token), tries the
    children of the current node in increasing index order, moves to the first accepted child, and
    ends by sampling one token from the target (or the residual left by rejected siblings). The
    emitted tokens have exactly the law of sampling from the target one token at a time.

    Args:
        logits: ``[B, T, V]`` float32/bfloat16/float16. Row ``i`` is the target's next-token logits
            after node ``i``. ``-inf`` entries are masked tokens; any finite value of the dtype is legal (up to
            its +-max, denormals included).
        draft_tokens: ``int64 [B, T]`` (int32 accepted). Node 0 holds the root's token (unused).
        parents: ``int32 [B, T]`` tree per :mod:`tlt_kernels.tree` (``parents[b, 0] == -1``).
        num_nodes: ``int32 [B]`` valid nodes per request, or None (= T); later nodes are padding.
        draft_probs: ``[B, T, V]`` float32/bfloat16/float16 or None. Row ``i`` is the draft
            distribution the children of node ``i`` were sampled from (i.i.d.); rows are normalized
            internally. With it, child ``x`` is accepted with probability ``min(1, p(x)/q(x))``
            (speculative sampling, recursive over siblings); without it the children are treated as
            deterministic candidates and ``x`` is accepted with probability ``p(x)``.
        temperature: per request (scalar, list, or ``[B]`` tensor) in ``[0, float32 max]``. None or 0 =
            greedy: accept the first child equal to the argmax (lowest id on ties) and emit the argmax. A
            positive ``T`` samples from ``softmax((l - max l) / T')`` with ``T' = clamp(T, 2**-126, 2**126)``
            (the max is subtracted before dividing, so nothing overflows; as ``T -> 0`` this tends to the
            uniform law over the maximal logits, not to greedy).
        top_k: per request; None/0/``>= V`` = off (values past int32 too). Threshold semantics: every token
            whose logit equals the k-th largest is kept.
        top_p: per request in (0, 1]; None/1 = off. Keeps the tokens with ``l >= l*``, ``l*`` the largest
            logit such that those tokens' mass reaches ``top_p`` (ties kept); ``top_p < 2**-126`` acts as
            ``2**-126``, which keeps only the maximal logits.
        seed: ``int64 [B]`` / int / list: a 64-bit Philox key. Python integers of any size are taken modulo
            ``2**64`` (``-1`` and ``2**64 - 1`` are the same key); integer tensors are read as their int64 bits.
            None draws seeds from torch's default CPU generator; pass seeds for reproducibility and for
            CUDA-graph capture.
        offset: ``int64 [B]`` / int / list, or None (= 0): a 64-bit counter, taken modulo ``2**64`` like
            ``seed``. Advance it once per decoding step.
        max_depth: static bound on accepted drafts (default ``T - 1``); sets the output width.
        return_stats: also return the per-depth tried/accepted counters.
        validate: check tree validity, token ids and value ranges (needs a host sync). Skipped
            automatically while a CUDA graph is being captured.
        backend: "auto", "torch", "triton" or "cuda".
        return_logprobs: also return ``logprobs float32 [B, max_depth+1]``: each emitted token's log-probability
            under its row's sampling distribution (after temperature, top-k and top-p; 0 for greedy requests, whose
            distribution is a point mass), what an RL trainer's importance ratio needs from the rollout.
        return_raw_logprobs: also return ``raw_logprobs float32 [B, max_depth+1]``: the same tokens under
            ``log_softmax`` of the logits (temperature 1, no filter).

    Returns:
        :class:`VerifyResult` ``(tokens int32 [B, max_depth+1], num_accepted int32 [B],
        accepted_nodes int32 [B, max_depth+1], error int32 [B], stats int32 [B, max_depth, 2] | None,
        logprobs float32 [B, max_depth+1] | None, raw_logprobs float32 [B, max_depth+1] | None)``. Log-probs are
        0 past ``num_accepted`` and on flagged requests; they read only the rows the walk read (the accepted path's).
        Triton backend: fused into the walk, float32 (each visited row's statistics pass also sums the raw,
        temperature-1 normalizer; a token's scores come from its row's normalizers and one element of the row). CUDA
        backend: fused the same way (``verify_tree_cuda_scored``, kernel instantiations of their own), float32.
        ``backend="torch"``: float64 torch ops. No host sync (capturable).
        On every backend, a request whose walk visits a row holding NaN/+inf or only -inf (or tries a child
        whose token lies outside ``[0, V)``, which ``validate=True`` rejects up front) gets ``error[b] = 1``, tokens
        -1, num_accepted 0, accepted_nodes ``[0, -1, ...]`` and zero stats; the other requests are unaffected. No
        exception: check ``error`` (a diverged policy shows up here).

    Contract on every backend (the seeded outputs are the same: the reference in float64, the kernels in float32,
    differ only through a float tie at a decision boundary):

    * Layout: any strides (column views, expanded per-request tensors, transposed tables); views are made dense once
      here (device copies, no host sync), logits / draft_probs only when their vocabulary dim is strided.
    * Ties: equal logits, with ``-0.0 == +0.0``, for the argmax, top-k and top-p alike.
    * Every emitted token is in ``[0, V)``; a request that would have none is flagged (``error = 1``).
    * With ``validate=False`` nothing is range-checked: a temperature that is not > 0 (NaN included) is greedy, a
      top_k outside ``[1, V)`` and a top_p that is not < 1 are off, and a sampled request whose tested draft row
      has no finite positive float32 sum is flagged.
    """
    num_nodes_resolved, max_depth = _check_inputs(logits, draft_tokens, parents, num_nodes, draft_probs, max_depth)
    dev = logits.device
    temp, k, tp, seed, offset = _sampling_params(temperature, top_k, top_p, seed, offset, logits.shape[0], dev)
    if validate and not _capturing():
        # The tree checks read the caller's num_nodes (int64 values past int32 are reported, not wrapped).
        _validate(logits, draft_tokens, parents, num_nodes_resolved if num_nodes is None else num_nodes, draft_probs,
                  temp, k, tp, max_depth)
    inputs = _kernel_layout(logits, draft_tokens, parents, num_nodes_resolved, draft_probs, temp, k, tp, seed, offset)
    _, fn = _BACKENDS.resolve(backend, dev)
    scoring = bool(return_logprobs or return_raw_logprobs)
    if scoring and getattr(fn, "scored", None) is not None:  # the walk scores its own tokens (Triton, CUDA)
        result = fn.scored(*inputs, max_depth, return_stats)
        return VerifyResult(*result[:5], result.logprobs if return_logprobs else None,
                            result.raw_logprobs if return_raw_logprobs else None)
    result = fn(*inputs, max_depth, return_stats)
    if not scoring:
        return result
    # A backend whose walk does not score its own tokens (the torch reference): the float64 pass over the path's rows.
    logprobs, raw_logprobs = path_logprobs(inputs[0], result, temp, k, tp, sampled=bool(return_logprobs),
                                           raw=bool(return_raw_logprobs))
    # A new VerifyResult rather than _replace: TorchDynamo (torch 2.11) mistraces NamedTuple._replace.
    return VerifyResult(*result[:5], logprobs, raw_logprobs)
