"""The counter-based random number generator every backend reproduces.

A uniform is a pure function of four integers, so the same ``(seed, offset)`` gives the same
tokens on every backend and device, and a CUDA graph can replay with new seeds/offsets read from
device tensors (no generator state, no host synchronization).

Definition (Philox4x32-10, Salmon et al., SC'11):

* key ``(k0, k1) = (seed & 0xffffffff, (seed >> 32) & 0xffffffff)`` for the request's 64-bit seed;
* counter ``(c0, c1, c2, c3) = (offset & 0xffffffff, (offset >> 32) & 0xffffffff, node, purpose)``;
* ten rounds of ``(c0, c1, c2, c3) <- (hi(M1*c2) ^ c1 ^ k0, lo(M1*c2), hi(M0*c0) ^ c3 ^ k1, lo(M0*c0))``
  with ``M0 = 0xD2511F53``, ``M1 = 0xCD9E8D57``, the key bumped by ``(0x9E3779B9, 0xBB67AE85)``
  after each round;
* the uniform is ``((c0 >> 9) + 0.5) * 2**-23``: a float32 strictly inside (0, 1), exact in float32
  (smallest ``2**-24``, largest ``1 - 2**-24``), so every backend computes the same bits.

Seeds and offsets are 64-bit words: a Python integer of any size is taken modulo ``2**64`` (held as the int64
with the same low 64 bits, so ``-1`` and ``2**64 - 1`` are one seed); integer tensors are read as their int64 bits.

Purposes: :data:`PURPOSE_ACCEPT` (the coin that accepts or rejects draft node ``node``) and
:data:`PURPOSE_SAMPLE` (the uniform that draws the final token from node ``node``'s row by inverse
CDF). Callers advance ``offset`` once per decoding step.
"""
from __future__ import annotations

import numbers

import torch

PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9
PHILOX_W1 = 0xBB67AE85
PHILOX_ROUNDS = 10
MASK32 = 0xFFFFFFFF

PURPOSE_ACCEPT = 0
PURPOSE_SAMPLE = 1


def _wrap64(v):
    """A Python integer (or nested list of them) modulo 2**64, as the int64 with the same low 64 bits."""
    if isinstance(v, (list, tuple)):
        return [_wrap64(x) for x in v]
    if isinstance(v, numbers.Integral) and not isinstance(v, bool):
        return (int(v) + 2**63) % 2**64 - 2**63
    return v


def as_words(x, device=None) -> torch.Tensor:
    """``int64`` tensor of 64-bit words (seeds, offsets): tensors as their int64 bits, Python integers modulo 2**64."""
    if isinstance(x, torch.Tensor):
        return x.to(device=device if device is not None else x.device, dtype=torch.int64)
    if isinstance(x, numbers.Integral) and not isinstance(x, bool):  # a fill, not a host copy: capturable
        return torch.full((), _wrap64(x), dtype=torch.int64, device=device)
    return torch.as_tensor(_wrap64(x), dtype=torch.int64, device=device)


def _mulhilo(a: int, b: torch.Tensor):
    # b < 2**32 and a < 2**32: the product's 64 bits wrap in int64 but the bit pattern is exact.
    prod = b * a
    return (prod >> 32) & MASK32, prod & MASK32


def philox4x32(seed: torch.Tensor, offset: torch.Tensor, node: torch.Tensor, purpose) -> torch.Tensor:
    """First 32-bit output word of Philox4x32-10, as int64 in ``[0, 2**32)``; inputs broadcast."""
    seed = as_words(seed)
    offset, node, purpose = (as_words(x, seed.device) for x in (offset, node, purpose))
    seed, offset, node, purpose = torch.broadcast_tensors(seed, offset, node, purpose)
    k0, k1 = seed & MASK32, (seed >> 32) & MASK32
    c0, c1, c2, c3 = offset & MASK32, (offset >> 32) & MASK32, node & MASK32, purpose & MASK32
    for _ in range(PHILOX_ROUNDS):
        hi0, lo0 = _mulhilo(PHILOX_M0, c0)
        hi1, lo1 = _mulhilo(PHILOX_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = (k0 + PHILOX_W0) & MASK32
        k1 = (k1 + PHILOX_W1) & MASK32
    return c0


def uniform(seed: torch.Tensor, offset: torch.Tensor, node, purpose) -> torch.Tensor:
    """float32 uniforms strictly inside (0, 1); see the module docstring for the exact definition."""
    bits = philox4x32(seed, offset, node, purpose)
    return ((bits >> 9).to(torch.float32) + 0.5) * (2.0**-23)
