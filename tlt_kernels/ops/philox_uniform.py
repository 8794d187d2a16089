"""``philox_uniform``: the uniforms of :mod:`tlt_kernels.rng` (the stream every acceptance walk draws its coins from)
as a tensor, for callers that need a walk's coins outside the walk: an adapter's per-draft statistics, a test's
expected values.

Backends: ``torch`` (the reference, :func:`tlt_kernels.rng.uniform`: ten Philox rounds of elementwise ops, about 160
launches) and ``triton`` (:mod:`tlt_kernels._triton.philox`, one launch). Every backend gives the same bits. ``auto``
picks Triton on a GPU and the reference on CPU tensors.
"""
from __future__ import annotations

import numbers
from typing import Union

import torch

from .._backend import register_op
from ..rng import as_words

_PHILOX_UNIFORM = register_op(
    "philox_uniform",
    {"torch": "tlt_kernels.rng:uniform", "triton": "tlt_kernels._triton.philox:philox_uniform"},
    preference=("triton", "torch"),
)

Words = Union[torch.Tensor, int]
_INTEGER_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def _device_of(**words) -> torch.device:
    """The one device of the tensor arguments (CPU when all are ints); a ValueError naming a tensor on another."""
    device = None
    for name, w in words.items():
        if isinstance(w, torch.Tensor):
            if w.dtype not in _INTEGER_DTYPES:
                raise ValueError(f"philox_uniform: {name} must hold integers, got {w.dtype}")
            if device is not None and w.device != device:
                raise ValueError(f"philox_uniform: {name} is on {w.device}, the other tensors on {device}")
            device = w.device
        elif not isinstance(w, numbers.Integral) or isinstance(w, bool):
            raise TypeError(f"philox_uniform: {name} must be an integer tensor or an int, got {type(w).__name__}")
    return device if device is not None else torch.device("cpu")


def philox_uniform(seed: Words, offset: Words, node: Words, purpose: int, *, backend: str = "auto") -> torch.Tensor:
    """Philox4x32-10 uniforms, the definition in :mod:`tlt_kernels.rng`, for every broadcast element.

    Args:
        seed, offset: 64-bit key and counter words: integer tensors (read as their int64 bits) or Python ints (taken
            modulo ``2**64``). A walk's coins use a request's ``seed`` and the step's ``offset``.
        node: integer tensor or int: the counter's third word (its low 32 bits), the draft node a coin belongs to.
        purpose: int in ``[0, 2**31)``: the counter's fourth word (:data:`tlt_kernels.rng.PURPOSE_ACCEPT` for a
            draft's accept coin, :data:`~tlt_kernels.rng.PURPOSE_SAMPLE` for a final token's inverse-CDF draw).
        backend: ``"auto"``, ``"torch"`` or ``"triton"``.

    Returns:
        ``float32`` of the three arguments' broadcast shape, on their device, strictly inside (0, 1); the same bits
        on every backend (graph-capturable on the GPU: no host sync, ints become device fills).
    """
    device = _device_of(seed=seed, offset=offset, node=node)
    if not isinstance(purpose, numbers.Integral) or isinstance(purpose, bool) or not 0 <= purpose < 2**31:
        raise ValueError(f"philox_uniform: purpose must be an int in [0, 2**31), got {purpose!r}")
    seed, offset, node = (as_words(w, device) for w in (seed, offset, node))
    seed, offset, node = torch.broadcast_tensors(seed, offset, node)
    _, fn = _PHILOX_UNIFORM.resolve(backend, device)
    shape = seed.shape
    flat = [w.reshape(-1).contiguous() for w in (seed, offset, node)]
    return fn(*flat, int(purpose)).reshape(shape)
