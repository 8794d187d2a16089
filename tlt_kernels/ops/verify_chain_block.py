"""``verify_chain_block``: block verification of draft chains, an alternative to token-by-token acceptance.

For a chain of drafts, :func:`tlt_kernels.verify_tree` accepts draft ``i`` with probability ``min(1, p_i/q_i)`` and
stops at the first rejection. Block verification (Sun et al., ICLR 2025, arXiv 2403.10444) decides the accepted
length from the whole block: it is just as lossless and accepts at least as many drafts in expectation (more when
the drafter over- and under-shoots the target on consecutive tokens, since a later token's surplus can pay for an
earlier token's deficit). The rule and its proof are in :mod:`tlt_kernels.reference.verify_chain_block`;
docs/ACCEPTANCE.md says when it helps.

Backends: ``torch`` (the float64 reference) and ``triton`` (:mod:`tlt_kernels._triton.verify_chain_block`, a
``torch.library`` custom op). ``auto`` picks Triton on a GPU and the reference on CPU tensors.
"""
from __future__ import annotations

import numbers
from typing import Optional

import torch

from .._backend import register_op
from .._validation import capturing, check_tensor, dense, per_request, saturate_to
from ..reference.verify_chain_block import BlockVerifyResult
from ..rng import as_words

__all__ = ["BlockVerifyResult", "verify_chain_block"]

_BACKENDS = register_op(
    "verify_chain_block",
    {
        "torch": "tlt_kernels.reference.verify_chain_block:verify_chain_block_reference",
        "triton": "tlt_kernels._triton.verify_chain_block:verify_chain_block_triton",
    },
    preference=("triton", "torch"),
)

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_INTS = (torch.int32, torch.int64)
_F32_MAX = float(torch.finfo(torch.float32).max)
_MIN_NORMAL = 2.0**-126  # positive temperatures below it act as it (the sampling contract's clamp)


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


def _temperature(value, B: int, device) -> torch.Tensor:
    """``float32 [B]`` (None, and None entries of a list = 0 = greedy); host values are range-checked here."""
    if value is None:
        return torch.zeros(B, dtype=torch.float32, device=device)
    if isinstance(value, torch.Tensor):
        if not value.is_floating_point():
            raise TypeError("temperature must be a floating-point scalar/list/[B] tensor, "
                            f"got dtype {_dtype_name(value)}")
        if value.dtype == torch.float64:  # keep a tiny positive value positive through the float32 conversion
            value = torch.where(value > 0, value.clamp(min=_MIN_NORMAL), value)
        return per_request("temperature", value, B, device, torch.float32)
    is_list = isinstance(value, (list, tuple))
    values = [0.0 if v is None else v for v in (value if is_list else [value])]
    for b, v in enumerate(values):
        where = f"temperature[{b}]" if is_list else "temperature"
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not (0 <= v <= _F32_MAX):
            raise ValueError(f"{where} = {v!r} is invalid: expected a value in [0, {_F32_MAX}] (0 = greedy)")
    values = [_MIN_NORMAL if 0 < v < _MIN_NORMAL else float(v) for v in values]
    return per_request("temperature", values if is_list else values[0], B, device, torch.float32)


def _word(name: str, value, B: int, device) -> torch.Tensor:
    """``int64 [B]`` seed / offset: 64-bit words (Python integers modulo 2**64, integer tensors as their bits)."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer scalar/list/[B] tensor, got dtype {_dtype_name(value)}")
        return per_request(name, value.to(torch.int64), B, device, torch.int64)
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    for b, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            where = f"{name}[{b}]" if isinstance(value, (list, tuple)) else name
            raise ValueError(f"{where} = {v!r} is invalid: expected an integer (any size: taken modulo 2**64)")
    words = as_words(value, device)
    return per_request(name, words if words.dim() else words.expand(B), B, device, torch.int64)


def _check_shapes(logits, draft_tokens, draft_probs, num_drafts) -> torch.Tensor:
    """Dtype, shape and device checks (metadata only, no sync); returns ``num_drafts int32 [B]`` (default gamma)."""
    check_tensor("logits", logits, dtype=_FLOATS, ndim=3)
    B, width, V = logits.shape
    dev = logits.device
    if width < 1 or V < 1:
        raise ValueError(f"logits must be [B, gamma+1, V] with gamma >= 0 and V >= 1, got shape {tuple(logits.shape)}")
    check_tensor("draft_tokens", draft_tokens, dtype=_INTS, shape=(B, width - 1), device=dev)
    check_tensor("draft_probs", draft_probs, dtype=_FLOATS, shape=(B, width - 1, V), device=dev)
    if num_drafts is None:
        return torch.full((B,), width - 1, dtype=torch.int32, device=dev)
    check_tensor("num_drafts", num_drafts, dtype=_INTS, shape=(B,), device=dev)
    return num_drafts


def _first_bad(mask: torch.Tensor):
    return tuple(int(v) for v in mask.nonzero()[0])


def _validate(logits, draft_tokens, draft_probs, num_drafts, temperature) -> None:
    """The value checks of ``validate=True``: one device-to-host copy of per-row summaries, checked on the host."""
    B, width, V = logits.shape
    if B == 0:
        return
    gamma = width - 1
    f64 = lambda t: t.to(torch.float64).reshape(B, -1)  # noqa: E731
    parts = [f64(logits.amax(-1)), f64(torch.isnan(logits).any(-1)), f64(num_drafts), f64(temperature),
             f64(draft_tokens), f64(draft_probs.sum(-1, dtype=torch.float32)), f64(draft_probs.amin(-1))]
    host = torch.cat(parts, 1).cpu()  # the only sync
    row_max, has_nan, n, temp = host[:, :width], host[:, width:2 * width], host[:, 2 * width], host[:, 2 * width + 1]
    tokens, q_sum, q_min = (host[:, 2 * width + 2 + k * gamma:2 * width + 2 + (k + 1) * gamma] for k in range(3))
    bad = (n < 0) | (n > gamma)
    if bad.any():
        b = _first_bad(bad)[0]
        raise ValueError(f"num_drafts[{b}] = {int(n[b])} is outside [0, gamma={gamma}]")
    bad = ~((temp >= 0) & (temp <= _F32_MAX))
    if bad.any():
        b = _first_bad(bad)[0]
        raise ValueError(f"temperature[{b}] = {temp[b].item()} is invalid: expected a value in [0, {_F32_MAX}]")
    read = torch.arange(width).unsqueeze(0) <= n.unsqueeze(1)  # rows 0..n are read
    bad = read & ((has_nan > 0) | ~torch.isfinite(row_max))
    if bad.any():
        b, i = _first_bad(bad)
        raise ValueError(f"logits[{b}, {i}] holds NaN or +inf, or only -inf: the target row has no distribution")
    drafted = read[:, 1:] & (torch.arange(gamma).unsqueeze(0) < n.unsqueeze(1))
    bad = drafted & ((tokens < 0) | (tokens >= V))
    if bad.any():
        b, i = _first_bad(bad)
        raise ValueError(f"draft_tokens[{b}, {i}] = {int(tokens[b, i])} is outside the vocabulary [0, V={V})")
    bad = drafted & (temp > 0).unsqueeze(1) & ~(torch.isfinite(q_sum) & (q_sum > 0) & (q_min >= 0))
    if bad.any():
        b, i = _first_bad(bad)
        raise ValueError(f"draft_probs[{b}, {i}] is not a distribution (sum {q_sum[b, i].item()}, min "
                         f"{q_min[b, i].item()}): entries must be finite and >= 0 with a positive sum")


def verify_chain_block(
    logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    num_drafts: Optional[torch.Tensor] = None,
    temperature=None,
    seed=None,
    offset=None,
    validate: bool = True,
    backend: str = "auto",
) -> BlockVerifyResult:
    """Accept a prefix of each request's draft chain by block verification, losslessly.

    Args:
        logits: ``[B, gamma+1, V]`` float32/bfloat16/float16, any strides. Row ``i`` is the target's next-token
            logits after the last accepted token and drafts ``1 .. i``; row ``num_drafts[b]`` is the bonus row.
            ``-inf`` entries are masked tokens. Top-k / top-p are not applied here: to verify against a filtered
            target, pass logits already filtered (``-inf`` outside the kept set); the rule is exact for any target
            distribution, so the guarantee then holds for the filtered one.
        draft_tokens: ``int64 [B, gamma]`` (int32 accepted): draft ``i + 1`` in column ``i``.
        draft_probs: ``[B, gamma, V]`` float32/bfloat16/float16: row ``i`` is the distribution the drafter sampled
            column ``i``'s token from (normalized here). Greedy requests ignore it.
        num_drafts: ``int32 [B]`` (int64 accepted) drafts per request in ``[0, gamma]`` (ragged chains; 0 = just
            sample the bonus row), or None (= gamma). Later columns are padding.
        temperature: per request (scalar, list, ``[B]`` tensor) in ``[0, float32 max]``; None or 0 = greedy, where
            the rule is exact-match prefix acceptance plus the argmax. A positive ``T`` samples from
            ``softmax((l - max l) / T')``, ``T' = clamp(T, 2**-126, 2**126)`` (:mod:`tlt_kernels.reference.sampling`).
        seed: ``int64 [B]`` / int / list, a 64-bit Philox key (Python integers modulo 2**64); None draws seeds
            from torch's default CPU generator. Pass seeds for reproducibility and for CUDA-graph capture.
        offset: ``int64 [B]`` / int / list or None (= 0): a 64-bit counter; advance it once per decoding step.
        validate: check value ranges (one host sync): num_drafts in ``[0, gamma]``, the logits rows read (0 ..
            num_drafts) hold a distribution, draft tokens in ``[0, V)``, draft rows of sampled requests finite,
            non-negative, of positive sum, temperatures in range. Skipped while a CUDA graph is captured. With
            ``validate=False`` nothing is read on the host: num_drafts is clamped to ``[0, gamma]``, an
            out-of-vocabulary draft is never accepted, a temperature not > 0 (NaN included) is greedy.
        backend: ``"auto"``, ``"torch"`` or ``"triton"``.

    Returns:
        :class:`BlockVerifyResult` ``(tokens int64 [B, gamma+1], num_accepted int32 [B])``: ``tokens[b, :tau]`` are
        the accepted drafts, ``tokens[b, tau]`` the token drawn from the residual (or the bonus row when
        ``tau = num_drafts[b]``), -1 after; ``num_accepted[b] = tau``. Both backends draw the same uniforms
        (:mod:`tlt_kernels.rng`: node ``i``'s accept coin decides prefix ``i``, node ``tau``'s sample coin the final
        token), so equal seeds give equal outputs; the reference computes in float64, the kernel in float32, which
        can differ only where a coin or a sample falls on a float tie at a decision boundary. Greedy outputs equal
        :func:`tlt_kernels.verify_tree`'s on the same chain.
    """
    n = _check_shapes(logits, draft_tokens, draft_probs, num_drafts)
    B, dev = logits.shape[0], logits.device
    temp = _temperature(temperature, B, dev)
    if seed is None:
        seed = torch.randint(-(2**63), 2**63 - 1, (B,), dtype=torch.int64).to(dev)
    seed = _word("seed", seed, B, dev)
    offset = _word("offset", 0 if offset is None else offset, B, dev)
    if validate and not capturing(dev):
        _validate(logits, draft_tokens, draft_probs, n, temp)
    unit = lambda t: t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()  # noqa: E731
    _, fn = _BACKENDS.resolve(backend, dev)
    return fn(unit(logits), dense(draft_tokens.to(torch.int64)), unit(draft_probs),
              dense(saturate_to(n, torch.int32)), dense(temp), dense(seed), dense(offset))
