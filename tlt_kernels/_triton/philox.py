"""Triton Philox4x32-10 uniforms: the stream of :mod:`tlt_kernels.rng`, bit for bit.

``_philox_uniform`` is the device function every Triton acceptance walk draws its coins from; ``philox_uniform`` is
the backend of :func:`tlt_kernels.ops.philox_uniform.philox_uniform`: one launch over flat ``[N]`` words (the torch
reference takes ten rounds of elementwise ops, about 160 launches). Eager calls launch directly; otherwise the launch
runs inside the custom op ``tlt::philox_uniform`` (fake implementation for ``torch.compile``; no host sync).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._backend import direct_dispatch_ok

BLOCK = 128  # words per program: ten rounds of 32-bit integer ops each, no memory reuse to tile for


@triton.jit
def _philox_uniform(seed, offset, node, purpose: tl.constexpr):
    """Philox4x32-10 word 0 of counter (offset lo, offset hi, node, purpose), key = seed; see rng.py."""
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    c0 = (offset & 0xFFFFFFFF).to(tl.uint32)
    c1 = ((offset >> 32) & 0xFFFFFFFF).to(tl.uint32)
    c2 = node.to(tl.uint32)
    c3 = c2 * 0 + purpose
    k0 = c2 * 0 + k0
    k1 = c2 * 0 + k1
    c0 = c2 * 0 + c0
    c1 = c2 * 0 + c1
    for _ in tl.static_range(10):
        hi0 = tl.umulhi(c0, 0xD2511F53)
        lo0 = c0 * 0xD2511F53
        hi1 = tl.umulhi(c2, 0xCD9E8D57)
        lo1 = c2 * 0xCD9E8D57
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    return ((c0 >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07


@triton.jit
def _philox_uniform_kernel(seed_ptr, offset_ptr, node_ptr, out_ptr, N, PURPOSE: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offs < N
    seed = tl.load(seed_ptr + offs, mask=mask, other=0)
    offset = tl.load(offset_ptr + offs, mask=mask, other=0)
    node = tl.load(node_ptr + offs, mask=mask, other=0)  # int64: its low 32 bits are the counter word
    tl.store(out_ptr + offs, _philox_uniform(seed, offset, node, PURPOSE), mask=mask)


def philox_uniform_out(seed: torch.Tensor, offset: torch.Tensor, node: torch.Tensor, purpose: int,
                       out: torch.Tensor) -> None:
    """Launch into ``out`` (float32 ``[N]``); ``seed``, ``offset``, ``node``: contiguous int64 ``[N]``."""
    N = out.numel()
    if N == 0:
        return
    _philox_uniform_kernel[(triton.cdiv(N, BLOCK),)](seed, offset, node, out, N, PURPOSE=purpose, BLOCK_SIZE=BLOCK,
                                                     num_warps=4)


@torch.library.custom_op("tlt::philox_uniform", mutates_args=())
def _philox_uniform_op(seed: torch.Tensor, offset: torch.Tensor, node: torch.Tensor, purpose: int) -> torch.Tensor:
    out = torch.empty(seed.shape, dtype=torch.float32, device=seed.device)
    philox_uniform_out(seed, offset, node, purpose, out)
    return out


@_philox_uniform_op.register_fake
def _(seed, offset, node, purpose):
    return torch.empty(seed.shape, dtype=torch.float32, device=seed.device)


def philox_uniform(seed: torch.Tensor, offset: torch.Tensor, node: torch.Tensor, purpose: int) -> torch.Tensor:
    """Backend of :func:`tlt_kernels.ops.philox_uniform.philox_uniform`: ``float32 [N]`` from contiguous int64
    ``[N]`` words (``node``'s low 32 bits are used)."""
    if direct_dispatch_ok(seed, offset, node):  # plain eager: launch without the op's dispatch
        out = torch.empty(seed.shape, dtype=torch.float32, device=seed.device)
        philox_uniform_out(seed, offset, node, purpose, out)
        return out
    return torch.ops.tlt.philox_uniform(seed, offset, node, purpose)
