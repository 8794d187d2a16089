"""Small constant tensors of a draft or a commit, made once per shape outside CUDA-graph capture.

A step graph replays every launch it captured, the ones that only make constants (an ``arange``, the bits of a
draft's nodes, a commit's causal mask) included: a constant made before the capture and kept is read by the graph
instead, with no launch. One made *during* a capture holds its values only once its graph has replayed, so it is
never kept: inside a capture, and under ``torch.compile`` (whose fake tensors must not outlive the trace), the maker
runs as it would uncached. Callers only read the tensors (they are shared).
"""
from __future__ import annotations

import functools

import torch

from .._validation import capturing
from ..tree import bit_values, pack_bit_words


def cached_constant(make):
    """``make(*args, device)`` (hashable arguments, the ``torch.device`` last) cached per arguments outside capture
    and compilation; ``cache_clear`` and ``cache_info`` as ``functools.lru_cache``'s."""
    cached = functools.lru_cache(maxsize=128)(make)

    @functools.wraps(make)
    def get(*args):
        if capturing(args[-1]) or torch.compiler.is_compiling():
            return make(*args)
        return cached(*args)

    get.cache_clear, get.cache_info = cached.cache_clear, cached.cache_info
    return get


@cached_constant
def arange(n: int, device: torch.device) -> torch.Tensor:
    """``int64 [n]``: ``0 .. n - 1``."""
    return torch.arange(n, device=device)


@cached_constant
def node_bits(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[n]`` of ``dtype``: ``1 << j`` (:func:`tlt_kernels.tree.bit_values`)."""
    return bit_values(n, device, dtype)


@cached_constant
def causal_mask(batch_size: int, n: int, device: torch.device) -> torch.Tensor:
    """``int32 [batch_size, n, ceil(n / 32)]``, the packed mask of n pairs causal among themselves: row i sees pairs
    0..i, the bits below and at i, ``(1 << i) * 2 - 1``, as the sum of the bits 0..i."""
    return pack_bit_words(bit_values(n, device).cumsum(0).expand(batch_size, n), n)


@cached_constant
def full(shape: tuple, value: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.full(shape, value)`` of ``dtype``."""
    return torch.full(shape, value, dtype=dtype, device=device)
