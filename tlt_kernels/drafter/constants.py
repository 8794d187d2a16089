"""Small constant tensors of a draft or a commit, made once outside CUDA-graph capture and kept.

A step graph replays every launch it captured, the ones that only make constants (an ``arange``, the bits of a
draft's nodes, a commit's causal mask) included: a constant made before the capture and kept is read by the graph
instead, with no launch. One made *during* a capture holds its values only once its graph has replayed, so it is
never kept: inside a capture, and under ``torch.compile`` (whose fake tensors must not outlive the trace), the maker
runs as it would uncached.

A graph reads a kept tensor by its address, so nothing kept is ever freed (a freed one would be read after its memory
was reused): the cache has no bound, and its arguments take few values (sizes up to 64, or powers of two, and views
of them for the sizes between; a plan's node counts per batch size, at most the engine's batch sizes times its
draft and commit widths, a few bytes each). Callers only read the tensors (they are shared).
"""
from __future__ import annotations

import functools

import torch

from .._validation import capturing
from ..tree import bit_values, pack_bit_words


def cached_constant(make):
    """``make(*args, device)`` (hashable arguments, the ``torch.device`` last) kept per arguments outside capture and
    compilation, for the process's life; ``cache_info`` as ``functools.lru_cache``'s (and no ``cache_clear``: a
    graph captured before it could still read what it dropped)."""
    cached = functools.lru_cache(maxsize=None)(make)

    @functools.wraps(make)
    def get(*args):
        if capturing(args[-1]) or torch.compiler.is_compiling():
            return make(*args)
        return cached(*args)

    get.cache_info = cached.cache_info
    return get


@cached_constant
def _arange_pow2(n: int, device: torch.device) -> torch.Tensor:
    return torch.arange(n, device=device)


def arange(n: int, device: torch.device) -> torch.Tensor:
    """``int64 [n]``: ``0 .. n - 1``, a view of the kept ``arange`` of the next power of two."""
    return _arange_pow2(1 << max(n - 1, 0).bit_length(), device)[:n]


@cached_constant
def node_bits(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[n]`` of ``dtype`` (``n <= 64``): ``1 << j`` (:func:`tlt_kernels.tree.bit_values`)."""
    return bit_values(n, device, dtype)


@cached_constant
def causal_mask(n: int, device: torch.device) -> torch.Tensor:
    """``int32 [1, n, ceil(n / 32)]`` (``n <= 64``; expand it over a batch), the packed mask of n pairs causal among
    themselves: row i sees pairs 0..i, the bits below and at i, ``(1 << i) * 2 - 1``, as the sum of the bits 0..i."""
    return pack_bit_words(bit_values(n, device).cumsum(0).unsqueeze(0), n)


@cached_constant
def full(n: int, value: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[n]`` of ``dtype``, every entry ``value`` (``n`` a node count up to 64 or a batch size, ``value`` a node
    count or -1: few pairs in a process)."""
    return torch.full((n,), value, dtype=dtype, device=device)
