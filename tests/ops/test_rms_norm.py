"""rms_norm: every backend against the torch reference (awkward sizes, strided rows, residual or not), the reference
against transformers' formula and torch's own rms_norm, validation, torch.compile, and a hypothesis property."""
import pytest
import torch
import torch.nn.functional as F
from conftest import agreement_backends, kernel_devices, need_backend
from hypothesis import given, note
from hypothesis import strategies as st
from strategies import FLOAT_DTYPES, assert_rejects, backend_params, budget, gen, relayout, seeds, ulps_apart

import tlt_kernels
from tlt_kernels import rms_norm
from tlt_kernels.ops.rms_norm import _RMS_NORM

EPS = 1e-5


def strided_rows(shape, H, dtype, g):
    """``[*shape, H]`` values as a slice of a wider buffer: every leading stride differs from the contiguous one."""
    buf = torch.randn(*shape, 2, H + 3, generator=g).to(dtype)
    return buf[..., 1, 2: H + 2]


def transformers_rms_norm(x, weight, eps):
    """transformers' LlamaRMSNorm.forward, written out."""
    input_dtype = x.dtype
    hidden_states = x.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + eps)
    return weight * hidden_states.to(input_dtype)


def check_out(got, want, dtype):
    """bf16 / fp16: within one ulp of the dtype (the fp32 mean of squares may be summed in another order, which can
    move a value across a rounding boundary); fp32: a tight relative tolerance."""
    assert got.dtype == want.dtype and got.shape == want.shape
    assert not got.isnan().any()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
    else:
        assert float(ulps_apart(got, want).max()) <= 1.0


@pytest.mark.parametrize("backend", agreement_backends())
@pytest.mark.parametrize("H", [1, 7, 33, 576, 1000])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_matches_reference(backend, H, dtype, with_residual, gen):
    device = kernel_devices()[0]
    need_backend("rms_norm", backend, torch.device(device))
    for shape in [(1,), (3,), (5, 1)]:
        x = strided_rows(shape, H, dtype, gen)
        res = strided_rows(shape, H, dtype, gen) if with_residual else None
        w = torch.randn(H, generator=gen).to(dtype)
        want, want_h = rms_norm(x, w, EPS, res, backend="torch")
        dx, dw = x.to(device), w.to(device)
        dres = res.to(device) if res is not None else None
        out, h = rms_norm(dx, dw, EPS, dres, backend=backend)
        check_out(out.cpu(), want, dtype)
        assert out.is_contiguous()
        if with_residual:
            # The residual add is one rounding of an exact fp32 sum: the same bits as torch's add in the dtype.
            assert torch.equal(h.cpu(), want_h) and torch.equal(want_h, x + res)
        else:
            assert h is dx


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("H", [1, 33, 576])
def test_reference_is_transformers_rms_norm(dtype, H, gen):
    x = strided_rows((3, 2), H, dtype, gen)
    res = strided_rows((3, 2), H, dtype, gen)
    w = torch.randn(H, generator=gen).to(dtype)
    out, h = rms_norm(x, w, EPS)
    assert torch.equal(out, transformers_rms_norm(x, w, EPS)) and h is x
    out, h = rms_norm(x, w, EPS, res)
    assert torch.equal(h, x + res) and torch.equal(out, transformers_rms_norm(x + res, w, EPS))
    if dtype == torch.float32:
        torch.testing.assert_close(out, F.rms_norm(x + res, (H,), w, EPS), rtol=1e-6, atol=1e-6)


def test_auto_is_the_reference_on_cpu():
    assert _RMS_NORM.choose("auto", torch.device("cpu")) == "torch"


@pytest.mark.triton
def test_direct_and_op_paths_agree(monkeypatch, gen):
    """Eager calls launch the kernel directly; with direct dispatch off the custom op runs it: same bits."""
    import tlt_kernels._backend as backend_mod

    device = kernel_devices()[0]
    need_backend("rms_norm", "triton", torch.device(device))
    x, res = (torch.randn(4, 40, generator=gen).to(torch.bfloat16).to(device) for _ in range(2))
    w = torch.randn(40, generator=gen).to(torch.bfloat16).to(device)
    direct = rms_norm(x, w, EPS, res, backend="triton")
    monkeypatch.setattr(backend_mod, "DIRECT_DISPATCH", False)
    calls = []
    real = torch.ops.tlt.add_rms_norm
    monkeypatch.setattr(torch.ops.tlt, "add_rms_norm", lambda *a: calls.append(1) or real(*a))
    through_op = rms_norm(x, w, EPS, res, backend="triton")
    assert calls == [1] and all(torch.equal(a, b) for a, b in zip(direct, through_op))


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("with_residual", [False, True])
def test_torch_compile(backend, with_residual, gen):
    x = strided_rows((2, 3), 40, torch.bfloat16, gen)
    res = strided_rows((2, 3), 40, torch.bfloat16, gen) if with_residual else None
    w = torch.randn(40, generator=gen).to(torch.bfloat16)

    def fn(x, w, res):
        return rms_norm(x * 1.0, w, EPS, res, backend=backend)

    torch._dynamo.reset()
    got = torch.compile(fn, backend="aot_eager", fullgraph=True)(x, w, res)
    want = fn(x, w, res)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_bad_inputs(gen):
    x = torch.randn(3, 8, generator=gen).to(torch.bfloat16)
    w = torch.randn(8, generator=gen).to(torch.bfloat16)
    cases = [
        ("x", dict(x=x.to(torch.int32))),
        ("x", dict(x=x.t().contiguous().t())),  # a transposed [3, 8]: last dim not contiguous
        ("x", dict(x=torch.tensor(1.0, dtype=torch.bfloat16), weight=w[:1])),
        ("x", dict(x=[1.0])),
        ("weight", dict(weight=w.float())),
        ("weight", dict(weight=w[:7])),
        ("weight", dict(weight=w.to("meta"))),
        ("residual", dict(residual=x[:2])),
        ("residual", dict(residual=x.half())),
        ("residual", dict(residual=x.t().contiguous().t())),
        ("residual", dict(residual=x.to("meta"))),
        ("eps", dict(eps=-1.0)),
        ("eps", dict(eps="1e-5")),
        ("backend", dict(backend="tpu")),
    ]
    for name, bad in cases:
        args = dict(x=x, weight=w, eps=EPS, residual=None, backend="torch")
        args.update(bad)
        backend = args.pop("backend")
        assert_rejects(rms_norm, name, args.pop("x"), args.pop("weight"), args.pop("eps"), args.pop("residual"),
                       backend=backend)


def test_exported():
    assert tlt_kernels.rms_norm is rms_norm and "rms_norm" in tlt_kernels.__all__


# ----------------------------------------------------------------------------------------------- property
@budget(10)
@given(st.data())
@pytest.mark.parametrize("backend", backend_params())
def test_property_matches_reference(backend, data):
    """Any rows (0..5, in up to two leading dims), any H (1..70), any float dtype, residual or not, in any row
    layout: the reference's values (ulp-level as above), the exact residual sum, no NaN from finite inputs."""
    dtype = data.draw(st.sampled_from(FLOAT_DTYPES), label="dtype")
    lead = tuple(data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=2), label="leading dims"))
    H = data.draw(st.integers(1, 70), label="H")
    g = gen(data.draw(seeds))
    x = (torch.randn(*lead, H, generator=g) * data.draw(st.sampled_from([1e-3, 1.0, 30.0]))).to(dtype)
    res = torch.randn(*lead, H, generator=g).to(dtype) if data.draw(st.booleans(), label="residual") else None
    w = torch.randn(H, generator=g).to(dtype)
    layout = data.draw(st.sampled_from(["contiguous", "offset", "strided", "wide_rows"]), label="layout")
    note(f"layout {layout}")
    vx = relayout(x, layout) if x.numel() else x
    vres = relayout(res, layout) if res is not None and res.numel() else res
    want, want_h = rms_norm(x, w, EPS, res, backend="torch")
    out, h = rms_norm(vx, w, EPS, vres, backend=backend)
    if want.numel():
        check_out(out, want, dtype)
    assert out.shape == x.shape
    if res is None:
        assert h is vx
    else:
        assert torch.equal(h, want_h)
