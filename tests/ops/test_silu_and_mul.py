"""silu_and_mul: every backend against the reference at awkward sizes, dtypes and strides; the reference is
``F.silu(gate) * up``; validation; a property test."""
import pytest
import torch
import torch.nn.functional as F
from conftest import agreement_backends, kernel_devices, need_backend
from fused_cases import DTYPES, assert_within_ulp, skip_interpreted_bf16, strided
from hypothesis import given, settings
from hypothesis import strategies as st

from tlt_kernels import silu_and_mul
from tlt_kernels.reference.silu_and_mul import silu_and_mul as reference


def _inputs(rows, width, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    gate = (torch.randn(rows, width, generator=g) * 4).to(dtype).to(device)
    return gate, torch.randn(rows, width, generator=g).to(dtype).to(device)


@pytest.mark.parametrize("backend", agreement_backends())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,width", [(1, 1), (3, 7), (5, 1536), (2, 1025)])
def test_agrees_with_reference(backend, dtype, rows, width):
    device = kernel_devices()[0] if backend != "torch" else "cpu"
    need_backend("silu_and_mul", backend, device)
    skip_interpreted_bf16(backend, dtype, device)
    gate, up = _inputs(rows, width, dtype, device)
    got = silu_and_mul(strided(gate), strided(up), backend=backend)
    # silu's fp32 exp may differ by an ulp, rounded to the dtype before the product: two ulps of the product.
    assert_within_ulp(got, reference(gate, up), f"{backend} {dtype} {rows}x{width}", ulps=2)


def test_reference_is_silu_times_up():
    gate, up = _inputs(3, 11, torch.bfloat16, "cpu")
    assert torch.equal(reference(gate, up), F.silu(gate) * up)
    g, u = gate.float(), up.float()
    torch.testing.assert_close(reference(g, u), g * torch.sigmoid(g) * u, rtol=1e-6, atol=1e-6)


def test_validation_names_the_argument():
    gate, up = _inputs(2, 4, torch.float32, "cpu")
    with pytest.raises(TypeError, match="gate must have dtype"):
        silu_and_mul(gate.long(), up)
    with pytest.raises(TypeError, match="up must have dtype"):
        silu_and_mul(gate, up.half())
    with pytest.raises(ValueError, match="up"):
        silu_and_mul(gate, up[:, :2])


@pytest.mark.triton
@settings(max_examples=12, deadline=None)
@given(rows=st.integers(1, 4), width=st.integers(1, 300), seed=st.integers(0, 2**16),
       dtype=st.sampled_from([torch.float32, torch.float16]))
def test_property_triton_matches_reference(rows, width, seed, dtype):
    gate, up = _inputs(rows, width, dtype, kernel_devices()[0], seed=seed)
    assert_within_ulp(silu_and_mul(gate, up, backend="triton"), reference(gate, up), "property", ulps=2)
