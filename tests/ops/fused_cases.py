"""Shared helpers of the fused layer ops' tests (rms_norm, apply_rotary, silu_and_mul)."""
import torch

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# One unit in the last place of each dtype, relative: the kernels may differ from torch by one rounding step (an
# fp32 reduction order, an fp32 exp), never more.
ULP = {torch.float32: 2e-6, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}


def strided(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a non-contiguous view (every other row of a taller buffer)."""
    buf = torch.empty((t.shape[0] * 2,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    view = buf[::2]
    view.copy_(t)
    return view


def assert_within_ulp(got: torch.Tensor, want: torch.Tensor, what: str, scale=None, ulps: int = 1) -> None:
    """Equal shapes and dtypes, finite, and every element within ``ulps`` units in the last place of ``max(|want|,
    scale)``: ``scale`` (a tensor broadcast to ``want``) is the size of the terms a sum cancelled, where a rounding
    step of the terms (an fp32 FMA, one ulp of an intermediate) shows against a small result."""
    assert got.shape == want.shape and got.dtype == want.dtype, what
    assert torch.isfinite(got).all(), f"{what}: non-finite output"
    g, w = got.double(), want.double()
    size = w.abs() if scale is None else torch.maximum(w.abs(), scale.double().expand_as(w))
    tol = ulps * ULP[got.dtype] * size.clamp(min=1e-3) * 1.01
    bad = (g - w).abs() > tol
    assert not bad.any(), f"{what}: {int(bad.sum())} of {bad.numel()} elements off by more than {ulps} ulp, e.g. " \
                          f"{g[bad][:3].tolist()} vs {w[bad][:3].tolist()}"


def skip_interpreted_bf16(backend: str, dtype: torch.dtype, device) -> None:
    """The Triton interpreter rounds to bf16 by truncation (numpy has no bf16), so a kernel that rounds
    intermediate values to bf16 is checked in bf16 on the GPU only; fp16 and fp32 run everywhere."""
    import pytest

    if backend == "triton" and dtype == torch.bfloat16 and str(device) == "cpu":
        pytest.skip("bf16 rounding of intermediates is checked on the GPU (the interpreter truncates)")
