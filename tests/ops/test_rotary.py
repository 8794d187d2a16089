"""apply_rotary: every backend against the reference (odd head counts, GQA, head dims 2..96, strided q/k views of
one packed projection); the reference against transformers' rotate-half formula; validation; a property test."""
import pytest
import torch
from conftest import agreement_backends, kernel_devices, need_backend
from fused_cases import DTYPES, assert_within_ulp, skip_interpreted_bf16
from hypothesis import given, settings
from hypothesis import strategies as st

from tlt_kernels import apply_rotary
from tlt_kernels.reference.rotary import apply_rotary as reference


def _inputs(B, T, HQ, HK, D, dtype, device, seed=0):
    """q and k as views of one packed [B, T, (HQ + 2 HK) * D] projection (strided like a fused qkv would be)."""
    g = torch.Generator().manual_seed(seed)
    packed = torch.randn(B, T, (HQ + 2 * HK) * D, generator=g).to(dtype).to(device)
    q = packed[..., :HQ * D].view(B, T, HQ, D)
    k = packed[..., HQ * D:(HQ + HK) * D].view(B, T, HK, D)
    angles = torch.rand(B, T, D // 2, generator=g) * 50
    emb = torch.cat((angles, angles), -1)
    return q, k, emb.cos().to(dtype).to(device), emb.sin().to(dtype).to(device)


def _terms(x):
    """The size of the two terms each output sums (|cos|, |sin| <= 1): the row's largest |x|."""
    return x.abs().amax(-1, keepdim=True)


@pytest.mark.parametrize("backend", agreement_backends())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,T,HQ,HK,D", [(1, 1, 1, 1, 2), (3, 1, 9, 3, 64), (1, 5, 3, 1, 96), (2, 3, 4, 4, 16)])
def test_agrees_with_reference(backend, dtype, B, T, HQ, HK, D):
    device = kernel_devices()[0] if backend != "torch" else "cpu"
    need_backend("apply_rotary", backend, device)
    skip_interpreted_bf16(backend, dtype, device)
    q, k, cos, sin = _inputs(B, T, HQ, HK, D, dtype, device)
    assert B * T == 1 or not q.is_contiguous()  # a view of the packed projection
    got_q, got_k = apply_rotary(q, k, cos, sin, backend=backend)
    want_q, want_k = reference(q, k, cos, sin)
    assert_within_ulp(got_q, want_q, f"q {backend} {dtype}", scale=_terms(q))
    assert_within_ulp(got_k, want_k, f"k {backend} {dtype}", scale=_terms(k))
    assert got_q.is_contiguous() and got_k.is_contiguous()


def test_reference_is_rotate_half():
    q, k, cos, sin = _inputs(2, 3, 2, 1, 8, torch.float32, "cpu")
    got_q, _ = reference(q, k, cos, sin)
    x1, x2 = q[..., :4], q[..., 4:]
    c, s = cos[:, :, None, :4], sin[:, :, None, :4]  # both halves share the angle
    torch.testing.assert_close(got_q, torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1))
    same = reference(q, k, torch.ones_like(cos), torch.zeros_like(sin))  # angle 0: no rotation
    assert torch.equal(same[0], q) and torch.equal(same[1], k)


def test_validation_names_the_argument():
    q, k, cos, sin = _inputs(1, 2, 2, 1, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match="q must be 4-D"):
        apply_rotary(q[0], k, cos, sin)
    with pytest.raises(ValueError, match="even"):
        apply_rotary(q[..., :7], k[..., :7], cos[..., :7], sin[..., :7])
    with pytest.raises(TypeError, match="k must have dtype"):
        apply_rotary(q, k.half(), cos, sin)
    with pytest.raises(ValueError, match="cos"):
        apply_rotary(q, k, cos[:, :1], sin)
    with pytest.raises(ValueError, match="sin"):
        apply_rotary(q, k, cos, sin[..., :4])


@pytest.mark.triton
@settings(max_examples=10, deadline=None)
@given(B=st.integers(1, 3), T=st.integers(1, 3), HQ=st.integers(1, 5), HK=st.integers(1, 3),
       half=st.integers(1, 20), seed=st.integers(0, 2**16), dtype=st.sampled_from([torch.float32, torch.float16]))
def test_property_triton_matches_reference(B, T, HQ, HK, half, seed, dtype):
    q, k, cos, sin = _inputs(B, T, HQ, HK, 2 * half, dtype, kernel_devices()[0], seed=seed)
    got_q, got_k = apply_rotary(q, k, cos, sin, backend="triton")
    want_q, want_k = reference(q, k, cos, sin)
    assert_within_ulp(got_q, want_q, "q", scale=_terms(q))
    assert_within_ulp(got_k, want_k, "k", scale=_terms(k))
