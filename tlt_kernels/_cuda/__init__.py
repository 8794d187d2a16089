"""Python glue of the CUDA extension :mod:`tlt_kernels._C`.

The extension is torch-free: it takes raw device pointers (``tensor.data_ptr()`` as Python ints),
strides in elements and a ``cudaStream_t`` as an int. These helpers turn tensors into those
arguments. Importing this package does not import the extension; :func:`extension` does, with an
actionable error when it was not built.
"""
from __future__ import annotations

import functools
from typing import Tuple

import torch

__all__ = ["extension", "ptr", "stream_handle", "dtype_code", "strides", "build_info"]


@functools.lru_cache(maxsize=None)
def extension():
    """The compiled module ``tlt_kernels._C`` (ImportError with the reason when it is missing)."""
    try:
        from .. import _C
    except ImportError as exc:
        raise ImportError(
            "tlt_kernels._C (the CUDA extension) is not available: reinstall with nvcc on PATH "
            f"(TLT_BUILD_CUDA=1 pip install -e .) or use backend='triton' / 'torch' ({exc})"
        ) from exc
    return _C


def build_info() -> dict:
    """``tlt_kernels._C.build_info()``: archs, nvcc version, CUDA runtime / driver versions."""
    return dict(extension().build_info())


def ptr(t: torch.Tensor | None) -> int:
    """Device address of ``t``'s first element (0 for None)."""
    return 0 if t is None else t.data_ptr()


def stream_handle(device: torch.device) -> int:
    """The ``cudaStream_t`` of the current torch stream of ``device`` (captured graphs included)."""
    return torch.cuda.current_stream(device).cuda_stream


def dtype_code(dtype: torch.dtype) -> int:
    """The extension's dtype code of a half-precision torch dtype."""
    ext = extension()
    if dtype == torch.bfloat16:
        return ext.DTYPE_BFLOAT16
    if dtype == torch.float16:
        return ext.DTYPE_FLOAT16
    raise TypeError(f"the CUDA kernels take bfloat16 or float16 tensors, got {dtype}")


def kv_fp8_code(cache_dtype: torch.dtype) -> int:
    """The extension's code of a cache's storage: ``KV_FP8_E4M3`` / ``KV_FP8_E5M2`` for the fp8 dtypes, else
    ``KV_FP8_NONE`` (a cache of q's dtype)."""
    ext = extension()
    if cache_dtype == torch.float8_e4m3fn:
        return ext.KV_FP8_E4M3
    if cache_dtype == torch.float8_e5m2:
        return ext.KV_FP8_E5M2
    return ext.KV_FP8_NONE


def strides(t: torch.Tensor, dims: Tuple[int, ...]) -> Tuple[int, ...]:
    """Element strides of ``t`` along ``dims``."""
    return tuple(int(t.stride(d)) for d in dims)
