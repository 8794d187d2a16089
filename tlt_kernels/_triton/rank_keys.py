"""Rank keys: fp32 values and their indices as unique int64 keys, so "the k largest" is a max over integers.

A key holds the value's fp32 bits mapped to an integer of the same order in its high half (``-0.0`` as ``0.0``, every
NaN above ``+inf``) and ``0xFFFFFFFF - index`` in its low half (equal values: the lower index ranks first). Keys are
unique, so the k largest keys are exactly a stable descending sort's first k (the references spell that order out:
:func:`tlt_kernels.reference.top_logprobs.rank_descending`), and a key decodes back to its value and index.
"""
from __future__ import annotations

import triton
import triton.language as tl

MIN_KEY = tl.constexpr(-(2**63))  # below every value's key: empty slots and masked elements
MAX_KEY = tl.constexpr(2**63 - 1)


@triton.jit
def rank_keys(x, index):
    """int64 keys of fp32 values ``x`` at indices ``index`` (module docstring)."""
    x = tl.where(x == 0.0, 0.0, x)  # -0.0 ranks as +0.0
    bits = x.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # negative floats order backwards as integers
    ordered = tl.where(x != x, 0x7FFFFFFF, ordered)  # every NaN above +inf
    return (ordered.to(tl.int64) << 32) | (0xFFFFFFFF - index.to(tl.int64))


@triton.jit
def key_value(key):
    """The fp32 value of a key (``-0.0`` comes back as ``0.0``, a NaN as the canonical NaN)."""
    ordered = (key >> 32).to(tl.int32)
    return tl.where(ordered < 0, ordered ^ 0x7FFFFFFF, ordered).to(tl.float32, bitcast=True)


@triton.jit
def key_index(key):
    return 0xFFFFFFFF - (key & 0xFFFFFFFF)


@triton.jit
def largest(keys, slots, K: tl.constexpr):
    """The K largest of ``keys`` (any shape, unique but for MIN_KEY) into ``slots``' positions 0..K-1, largest first."""
    out = tl.full(slots.shape, MIN_KEY, tl.int64)
    for j in tl.static_range(K):
        top = tl.max(keys)
        out = tl.where(slots == j, top, out)
        keys = tl.where(keys == top, MIN_KEY, keys)
    return out
