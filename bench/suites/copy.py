"""Suite "copy": device-to-device copy bandwidth, the yardstick of every other suite.

A copy moves each byte twice (read + write), so ``bytes_moved = 2 * size``. On a GPU the
``torch-copy`` row of the largest size reproduces ``ctx.copy_bandwidth`` (the HBM floor's
denominator, ~100% by construction); the smaller sizes show where launch overhead and L2 start to
matter. ``triton-copy`` is a plain Triton kernel: how close a straightforward Triton loop gets to the
copy engine-free ``cudaMemcpy`` path tells what to expect of memory-bound Triton kernels here.
"""
from __future__ import annotations

import torch

SUITE = "copy"

_KERNEL = None


def _triton_copy_kernel():
    # Defined on first use so discovery never imports Triton and TRITON_INTERPRET is honoured.
    global _KERNEL
    if _KERNEL is None:
        import triton
        import triton.language as tl

        @triton.jit
        def _copy_kernel(X_ptr, Y_ptr, n_elements, BLOCK_SIZE: tl.constexpr):
            offs = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
            mask = offs < n_elements
            tl.store(Y_ptr + offs, tl.load(X_ptr + offs, mask=mask), mask=mask)

        _KERNEL = _copy_kernel
    return _KERNEL


def triton_copy(src: torch.Tensor, dst: torch.Tensor, block_size: int = 4096) -> None:
    """``dst.copy_(src)`` for contiguous int32 ``[N]`` tensors, as a Triton kernel."""
    n = src.numel()
    _triton_copy_kernel()[(triton_cdiv(n, block_size),)](src, dst, n, BLOCK_SIZE=block_size)


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def run(ctx) -> None:
    from tlt_kernels._backend import backend_unavailable_reason

    if ctx.device.type != "cuda":
        sizes_mib = [0.0625, 1]
    elif ctx.small:
        sizes_mib = [16, 64]
    else:
        sizes_mib = [16, 256, 1024]
    # The Triton row runs where Triton can: CUDA tensors, or the CPU interpreter (off for a CPU run on a GPU machine).
    have_triton = ctx.try_import("triton") is not None and backend_unavailable_reason("triton", ctx.device) is None
    for mib in sizes_mib:
        nbytes = int(mib * 2**20)
        src = torch.randint(-(2**31), 2**31 - 1, (nbytes // 4,), dtype=torch.int32, device=ctx.device)
        dst = torch.empty_like(src)
        case = {"MiB": mib}
        ctx.add(case, "torch-copy", ctx.time_ms(lambda: dst.copy_(src)), bytes_moved=2 * nbytes)
        if have_triton:
            dst.zero_()
            triton_copy(src, dst)
            if not torch.equal(src, dst):
                raise AssertionError(f"triton-copy produced wrong output for {mib} MiB")
            ctx.add(case, "triton-copy", ctx.time_ms(lambda: triton_copy(src, dst)), bytes_moved=2 * nbytes)
        del src, dst
