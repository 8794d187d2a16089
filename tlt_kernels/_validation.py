"""Input checks shared by every op. Messages name the argument, what was expected and what came."""
from __future__ import annotations

import math
import numbers
from typing import Iterable, Optional, Sequence, Union

import torch

DTypes = Union[torch.dtype, Sequence[torch.dtype]]
# 8-bit float KV caches, read by the kernels as value * scale (with bf16/fp16 queries).
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _dtype_names(dtypes: Iterable[torch.dtype]) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def _normalize(device) -> torch.device:
    """``cuda`` and ``cuda:<current>`` are the same device; compare them as such."""
    device = torch.device(device)
    # Asking for the current device initializes CUDA: only where a GPU exists (never at import: this runs per call).
    if device.type == "cuda" and device.index is None and (torch.cuda.is_initialized() or torch.cuda.is_available()):
        return torch.device("cuda", torch.cuda.current_device())
    return device


def devices_equal(a, b) -> bool:
    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    if a.index is None or b.index is None:
        return _normalize(a) == _normalize(b)
    return a.index == b.index


def check_tensor(
    name: str,
    t,
    *,
    dtype: Optional[DTypes] = None,
    ndim: Optional[int] = None,
    shape: Optional[Sequence[Optional[int]]] = None,
    device: Optional[torch.device] = None,
) -> torch.Tensor:
    """Validate one tensor argument; ``None`` entries of ``shape`` match any size."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtype is not None:
        allowed = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
        if t.dtype not in allowed:
            raise TypeError(f"{name} must have dtype {_dtype_names(allowed)}, got {str(t.dtype).replace('torch.', '')}")
    if shape is not None and ndim is None:
        ndim = len(shape)
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if shape is not None:
        for axis, (want, got) in enumerate(zip(shape, t.shape)):
            if want is not None and want != got:
                raise ValueError(f"{name} has size {got} on dim {axis}, expected {want} (shape {tuple(t.shape)})")
    if device is not None and t.device != device and not devices_equal(t.device, device):  # equal: the common case
        raise ValueError(f"{name} is on {t.device}, expected {device} (all inputs must share one device)")
    return t


def capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on ``device``'s current stream: validation that reads device values on
    the host is skipped then (a host read is not allowed during capture)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def dense(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``t`` itself when it is contiguous, else a contiguous copy (None stays None).

    Every public op passes the tensors its kernels read through this at its boundary: the kernels index them with
    row-major strides, so a view (``x[:, 0]``, a transposed table, an expanded scalar) would otherwise be read as if it
    were contiguous and yield another request's values. The copy is a device op: no host sync, capturable."""
    if t is None or t.is_contiguous():
        return t
    return t.contiguous()


def check_positive_ints(where: str, **values) -> None:
    """Each of ``values`` must be an int (not a bool) >= 1: ValueError naming ``where``, the parameter and its value,
    in the order given."""
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
            raise ValueError(f"{where}: {name} must be an int >= 1, got {v!r}")


def check_int(name: str, value, low: int) -> int:
    """``value`` must be a Python int (not a bool; TypeError) >= ``low`` (ValueError), both naming it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a Python int, got {type(value).__name__} {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return value


def same_device(device: torch.device, **tensors) -> None:
    for name, t in tensors.items():
        if t is not None and not devices_equal(t.device, device):
            raise ValueError(f"{name} is on {t.device} but the other inputs are on {device}")


def saturate_to(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)``, but a narrowing integer cast saturates instead of wrapping: ``2**32 + 3`` as int32 would be
    3, a plausible and wrong value; saturated it stays out of range, where validation (or a kernel's guard) sees
    it. A device op: no host sync, capturable."""
    if t.dtype == dtype:
        return t
    integer = lambda d: not d.is_floating_point and not d.is_complex and d != torch.bool  # noqa: E731
    if integer(t.dtype) and integer(dtype):
        src, dst = torch.iinfo(t.dtype), torch.iinfo(dtype)
        if src.min < dst.min or src.max > dst.max:
            t = t.clamp(max(src.min, dst.min), min(src.max, dst.max))
    return t.to(dtype)


def per_request(name: str, value, batch: int, device: torch.device, dtype: torch.dtype) -> Optional[torch.Tensor]:
    """Turn a scalar / sequence / ``[B]`` tensor per-request parameter into a ``[B]`` tensor (None stays None)."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            value = value.reshape(1).expand(batch)
        if value.dim() != 1 or value.shape[0] != batch:
            raise ValueError(f"{name} must be a scalar or a [B]={batch} tensor, got shape {tuple(value.shape)}")
        if not devices_equal(value.device, device):
            raise ValueError(f"{name} is on {value.device} but the other inputs are on {device}")
        return saturate_to(value, dtype)
    if isinstance(value, (int, float)):
        return torch.full((batch,), value, dtype=dtype, device=device)
    seq = list(value)
    if len(seq) != batch:
        raise ValueError(f"{name} has {len(seq)} entries, expected one per request (B={batch})")
    return torch.tensor(seq, dtype=dtype, device=device)


FLOAT_ACTIVATIONS = (torch.float32, torch.bfloat16, torch.float16)


def check_unit_last_stride(name: str, t: torch.Tensor) -> torch.Tensor:
    """``t``'s last dim must be contiguous (stride 1; any stride when it has one element): kernels read rows as
    unit-stride vectors and take the leading dims' strides as they come."""
    if t.dim() == 0:
        raise ValueError(f"{name} must have at least one dim, got a 0-D tensor")
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dim (stride 1), got strides {t.stride()}")
    return t


def check_real(where: str, name: str, value, low: float, high: float = math.inf, strict: bool = False) -> float:
    """``value`` as a finite float in ``[low, high]`` (``low`` itself refused if ``strict``), or a ValueError naming
    ``where`` and ``name`` (a bool is not a number)."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if not ok or value < low or (strict and value == low) or value > high:
        upper = f" and <= {high}" if high < math.inf else ""
        raise ValueError(f"{where}: {name} must be a finite number {'>' if strict else '>='} {low}{upper}, "
                         f"got {value!r}")
    return float(value)


def check_float(name: str, value) -> float:
    """``value`` must be a real Python number (not a bool), finite and >= 0 (TypeError / ValueError naming it)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a float, got {type(value).__name__} {value!r}")
    value = float(value)
    if not (value >= 0.0 and value < float("inf")):
        raise ValueError(f"{name} must be a finite number >= 0, got {value}")
    return value
