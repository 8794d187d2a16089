"""rms_norm: every backend against the reference at awkward sizes, dtypes and strides; the reference against
transformers' formula and torch's own RMSNorm; the residual add; validation; a property test."""
import pytest
import torch
import torch.nn.functional as F
from conftest import agreement_backends, kernel_devices, need_backend
from fused_cases import DTYPES, assert_within_ulp, skip_interpreted_bf16, strided
from hypothesis import given, settings
from hypothesis import strategies as st

from tlt_kernels import rms_norm
from tlt_kernels.reference.rms_norm import rms_norm as reference


def _inputs(rows, H, dtype, device, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, H, generator=g) * scale).to(dtype).to(device)
    res = torch.randn(rows, H, generator=g).to(dtype).to(device)
    w = (1 + 0.5 * torch.randn(H, generator=g)).to(dtype).to(device)
    return x, res, w


@pytest.mark.parametrize("backend", agreement_backends())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,H", [(1, 1), (3, 7), (5, 33), (2, 576), (1, 1000)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_agrees_with_reference(backend, dtype, rows, H, with_residual):
    device = kernel_devices()[0] if backend != "torch" else "cpu"
    need_backend("rms_norm", backend, device)
    skip_interpreted_bf16(backend, dtype, device)
    x, res, w = _inputs(rows, H, dtype, device)
    res = res if with_residual else None
    out, h = rms_norm(strided(x), w, 1e-5, strided(res) if with_residual else None, backend=backend)
    want_out, want_h = reference(x, w, 1e-5, res)
    assert torch.equal(h, want_h)  # the add rounds once, exactly as torch's
    assert_within_ulp(out, want_out, f"{backend} {dtype} rows={rows} H={H}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reference_is_transformers_rmsnorm(dtype):
    x, res, w = _inputs(4, 96, dtype, "cpu", seed=1)
    out, h = reference(x, w, 1e-6, res)
    hidden = x + res  # transformers' LlamaRMSNorm after the residual add
    variance = hidden.to(torch.float32).pow(2).mean(-1, keepdim=True)
    assert torch.equal(out, w * (hidden.to(torch.float32) * torch.rsqrt(variance + 1e-6)).to(dtype))
    assert torch.equal(h, hidden)
    if dtype == torch.float32:
        torch.testing.assert_close(out, F.rms_norm(hidden, (96,), w, 1e-6), atol=1e-6, rtol=1e-6)


def test_without_residual_returns_x_itself():
    x, _, w = _inputs(2, 8, torch.float32, "cpu")
    _, h = rms_norm(x, w, 1e-5)
    assert h is x


def test_validation_names_the_argument():
    x, res, w = _inputs(2, 8, torch.float32, "cpu")
    with pytest.raises(TypeError, match="x must have dtype"):
        rms_norm(x.long(), w, 1e-5)
    with pytest.raises(TypeError, match="weight"):
        rms_norm(x, w.half(), 1e-5)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, w[:4], 1e-5)
    with pytest.raises(ValueError, match="residual"):
        rms_norm(x, w, 1e-5, res[:1])
    with pytest.raises(ValueError, match="eps"):
        rms_norm(x, w, -1.0)
    with pytest.raises(ValueError, match="backend"):
        rms_norm(x, w, 1e-5, backend="nope")


@pytest.mark.triton
@settings(max_examples=12, deadline=None)
@given(rows=st.integers(1, 4), H=st.integers(1, 70), residual=st.booleans(), seed=st.integers(0, 2**16),
       dtype=st.sampled_from([torch.float32, torch.float16]))
def test_property_triton_matches_reference(rows, H, residual, seed, dtype):
    device = kernel_devices()[0]
    x, res, w = _inputs(rows, H, dtype, device, seed=seed)
    res = res if residual else None
    out, h = rms_norm(x, w, 1e-5, res, backend="triton")
    want_out, want_h = reference(x, w, 1e-5, res)
    assert torch.equal(h, want_h)
    assert_within_ulp(out, want_out, "property")
