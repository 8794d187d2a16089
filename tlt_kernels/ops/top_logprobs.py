"""``top_logprobs``: the ``k`` most likely tokens of each row of logits, with their log-probabilities.

What a drafter runs at every depth of a draft (EAGLE's top-k expansion): ``torch.log_softmax`` followed by
``torch.topk`` over a vocabulary row is one pass for the softmax and a radix select of several launches per call; the
Triton kernel finds the normaliser and the k largest logits in one read of the row (two launches when a few rows are
spread over the GPU's SMs).

Backends: ``torch`` (the reference, :mod:`tlt_kernels.reference.top_logprobs`) and ``triton``
(:mod:`tlt_kernels._triton.top_logprobs`, ``k <= TRITON_MAX_K``: its cost grows with ``k``, and a radix select is the
better tool for a large one). ``auto`` picks Triton on a GPU for ``k <= TRITON_MAX_K`` and the torch reference
otherwise.
"""
from __future__ import annotations

import numbers
from typing import Optional, Tuple

import torch

from .._backend import BackendUnavailableError, register_op
from .._validation import FLOAT_ACTIVATIONS, check_int, check_tensor, check_unit_last_stride, dense

TRITON_MAX_K = 32  # the kernel keeps k keys per program and selects them one by one

_TOP_LOGPROBS = register_op(
    "top_logprobs",
    {
        "torch": "tlt_kernels.reference.top_logprobs:top_logprobs",
        "triton": "tlt_kernels._triton.top_logprobs:top_logprobs",
    },
    preference=("triton", "torch"),
)


def top_logprobs(logits: torch.Tensor, k: int, *, token_ids: Optional[torch.Tensor] = None,
                 backend: str = "auto") -> Tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest logits of each row and their log-probabilities under the row's softmax (temperature 1).

    Order: largest logit first; equal logits by column, the lower first (a stable sort's order: the result is
    deterministic and the same on every backend and device); ``-0.0`` equals ``0.0`` and every NaN ranks above
    ``+inf``. A log-probability is ``(logit - max) - log(sum(exp(logits - max)))`` in fp32, as
    ``torch.log_softmax`` computes it (the backends' sums differ in order: within 1e-5 of each other).

    Args:
        logits: ``[..., V]`` fp32 / bf16 / fp16, last dim contiguous (leading dims may be strided).
        k: ``1 <= k <= V``, an integer (a numpy integer is taken as its value; a bool or a float is refused).
        token_ids: int64 ``[V]``, the token each column stands for (a drafter's head over a subset of the
            vocabulary): the tokens returned are ``token_ids[column]``, read in the same launch (no gather after
            it). The ranking is by column as without it. Its values are not checked. None: the column itself.
        backend: ``"auto"``, ``"torch"`` or ``"triton"`` (``k <= TRITON_MAX_K``).

    Returns:
        ``(logprobs, tokens)``: new contiguous float32 and int64 ``[..., k]``.
    """
    check_tensor("logits", logits, dtype=FLOAT_ACTIVATIONS)
    check_unit_last_stride("logits", logits)
    if isinstance(k, numbers.Integral) and not isinstance(k, bool):
        k = int(k)  # the custom op's schema takes a Python int
    check_int("k", k, 1)
    if k > logits.shape[-1]:
        raise ValueError(f"k must be <= the number of logits per row (logits.shape[-1] = {logits.shape[-1]}), got {k}")
    if token_ids is not None:
        check_tensor("token_ids", token_ids, dtype=torch.int64, shape=(logits.shape[-1],), device=logits.device)
        token_ids = dense(token_ids)
    if backend == "auto" and k > TRITON_MAX_K:
        backend = "torch"
    name, fn = _TOP_LOGPROBS.resolve(backend, logits.device)
    if name == "triton" and k > TRITON_MAX_K:
        raise BackendUnavailableError(f"top_logprobs: the triton backend takes k <= {TRITON_MAX_K}, got k = {k}")
    return fn(logits, k, token_ids)
