"""``apply_rotary``: rotate-half rotary position embedding of q and k (transformers' Llama), one launch for both.

Backends: ``torch`` (the reference, :mod:`tlt_kernels.reference.rotary`) and ``triton``
(:mod:`tlt_kernels._triton.rotary`, one launch instead of the reference's dozen elementwise kernels). There is no
CUDA C++ backend: PyTorch's fused kernels (``torch.compile``) or a later CUDA backend are the alternatives.
``auto`` picks Triton on a GPU and the torch reference on CPU tensors.

``rotary_to_cache``: the same rotation, with the rotated k and v stored straight into a layer's KV cache rows (a
decoding step's K/V write rides in the rotation's launch instead of two copies per layer).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .._backend import register_op
from .._validation import FLOAT_ACTIVATIONS, capturing, check_tensor, check_unit_last_stride

_ROTARY = register_op(
    "apply_rotary",
    {
        "torch": "tlt_kernels.reference.rotary:apply_rotary",
        "triton": "tlt_kernels._triton.rotary:apply_rotary",
    },
    preference=("triton", "torch"),
)
_ROTARY_TO_CACHE = register_op(
    "rotary_to_cache",
    {
        "torch": "tlt_kernels.reference.rotary:rotary_to_cache",
        "triton": "tlt_kernels._triton.rotary:rotary_to_cache",
    },
    preference=("triton", "torch"),
)


def apply_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    backend: str = "auto",
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``x * cos + rotate_half(x) * sin`` for ``x`` in ``(q, k)``; ``rotate_half(x) = cat(-x[..., D/2:],
    x[..., :D/2])``.

    Rounding as torch in the activation dtype: each product rounded to it, then the sum.

    Args:
        q: ``[B, T, Hq, D]`` bf16 / fp16 / fp32, ``D`` even, last dim contiguous (other dims may be strided, e.g.
            a view of a packed qkv projection).
        k: ``[B, T, Hkv, D]`` of q's dtype (``Hkv`` may differ from ``Hq``), last dim contiguous.
        cos, sin: ``[B, T, D]`` of q's dtype, last dim contiguous (other dims may be strided or expanded).
        backend: ``"auto"``, ``"torch"`` or ``"triton"``.

    Returns:
        ``(q_out, k_out)``: new contiguous tensors of q's and k's shapes.
    """
    _check_rotary_inputs(q, k, cos, sin)
    _, fn = _ROTARY.resolve(backend, q.device)
    return fn(q, k, cos, sin)


def _check_rotary_inputs(q, k, cos, sin) -> None:
    check_tensor("q", q, dtype=FLOAT_ACTIVATIONS, ndim=4)
    B, T, _, D = q.shape
    if D % 2:
        raise ValueError(f"q has an odd head dim D={D} (shape {tuple(q.shape)}); rotate-half needs D even")
    check_unit_last_stride("q", q)
    check_tensor("k", k, dtype=q.dtype, shape=(B, T, None, D), device=q.device)
    check_unit_last_stride("k", k)
    for name, t in (("cos", cos), ("sin", sin)):
        check_tensor(name, t, dtype=q.dtype, shape=(B, T, D), device=q.device)
        check_unit_last_stride(name, t)


def rotary_to_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    *,
    q_out: Optional[torch.Tensor] = None,
    backend: str = "auto",
    validate: bool = True,
) -> torch.Tensor:
    """:func:`apply_rotary` of ``q`` and ``k``, with the rotated ``k`` and ``v`` stored at their cache rows.

    Token ``(b, t)``'s rotated k and its v go to row ``slots[b * T + t]`` of ``k_cache`` / ``v_cache`` (written in
    place); rows not named keep their values. Two tokens naming one row leave either token's values there.

    Args:
        q: ``[B, T, Hq, D]`` bf16 / fp16 / fp32, ``D`` even, last dim contiguous (a view of a packed qkv projection
            is fine).
        k, v: ``[B, T, Hkv, D]`` of q's dtype, last dim contiguous.
        cos, sin: ``[B, T, D]`` of q's dtype, last dim contiguous.
        k_cache, v_cache: contiguous ``[N, Hkv, D]`` of q's dtype (a layer's paged cache viewed as rows:
            ``cache.view(-1, Hkv, D)``).
        slots: int64 ``[B * T]`` rows, each in ``[0, N)``.
        q_out: where the rotated q goes: ``[B, T, Hq, D]`` of q's dtype, last dim contiguous, other dims any strides
            (a slice of a larger buffer, such as the rows a drafter appends to its earlier queries), sharing no
            memory with the other arguments. None: a new tensor.
        backend: ``"auto"``, ``"torch"`` or ``"triton"``.
        validate: check the slots' values (a host sync; skipped during CUDA-graph capture).

    Returns:
        the rotated q: ``q_out``, or a new contiguous ``[B, T, Hq, D]``.
    """
    _check_rotary_inputs(q, k, cos, sin)
    B, T, _, D = q.shape
    Hkv = k.shape[2]
    check_tensor("v", v, dtype=q.dtype, shape=(B, T, Hkv, D), device=q.device)
    check_unit_last_stride("v", v)
    check_tensor("k_cache", k_cache, dtype=q.dtype, shape=(None, Hkv, D), device=q.device)
    check_tensor("v_cache", v_cache, dtype=q.dtype, shape=tuple(k_cache.shape), device=q.device)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (rows of Hkv * D values), got strides {t.stride()}")
    check_tensor("slots", slots, dtype=torch.int64, shape=(B * T,), device=q.device)
    if q_out is not None:
        check_tensor("q_out", q_out, dtype=q.dtype, shape=tuple(q.shape), device=q.device)
        check_unit_last_stride("q_out", q_out)
    if validate and slots.numel() and not capturing(q.device):
        bad = (slots < 0) | (slots >= k_cache.shape[0])
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise ValueError(f"slots[{i}] = {int(slots[i])} is outside the cache's rows [0, {k_cache.shape[0]})")
    _, fn = _ROTARY_TO_CACHE.resolve(backend, q.device)
    return fn(q, k, v, cos, sin, k_cache, v_cache, slots, q_out)
