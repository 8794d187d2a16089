"""silu_and_mul: every backend against the torch reference (awkward widths, the halves of a packed gate/up
projection), the reference against the formula, validation, torch.compile, and a hypothesis property."""
import pytest
import torch
from conftest import agreement_backends, kernel_devices, need_backend
from hypothesis import given, note
from hypothesis import strategies as st
from strategies import FLOAT_DTYPES, assert_rejects, backend_params, budget, gen, relayout, seeds, ulps_apart

import tlt_kernels
from tlt_kernels import silu_and_mul
from tlt_kernels.ops.silu_and_mul import _SILU_AND_MUL


def packed_gate_up(shape, I, dtype, g, scale=4.0):
    """``gate, up [*shape, I]`` as the two halves of one ``[*shape, 2I]`` projection (strided rows)."""
    gu = (torch.randn(*shape, 2 * I, generator=g) * scale).to(dtype)
    return gu[..., :I], gu[..., I:]


def check_out(got, want, gate, up):
    """bf16 / fp16: ``got`` is ``act * up`` (torch's product in the dtype) for ``act`` the reference's rounded SiLU or
    one of its two neighbours (the SiLU's fp32 exp may differ in its last bits between implementations, which can
    move the rounded SiLU by an ulp); fp32: within 32 fp32 ulps of the reference (that exp difference carried
    through the division and the product)."""
    assert got.dtype == want.dtype and got.shape == want.shape and got.is_contiguous()
    assert not got.isnan().any()
    if want.dtype == torch.float32:
        # On the GPU tl.exp is an approximate exp2 of x * log2(e): its relative error grows with |x| (up to 10 ulps
        # at |x| ~ 12 in the first GPU run), carried through the division and the product.
        assert float(ulps_apart(got, want).max()) <= 32.0
        return
    act = torch.nn.functional.silu(gate)
    bits = act.contiguous().view(torch.int16)
    ok = got == want
    for step in (1, -1):  # the next representable magnitude up / down (NaN bit patterns never match)
        ok |= got == (bits + step).view(act.dtype) * up
    assert bool(ok.all()), f"{int((~ok).sum())} values off by more than one ulp of the rounded SiLU"


@pytest.mark.parametrize("backend", agreement_backends())
@pytest.mark.parametrize("I", [1, 7, 33, 576, 1000, 4100])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_matches_reference(backend, I, dtype, gen):
    device = kernel_devices()[0]
    need_backend("silu_and_mul", backend, torch.device(device))
    for shape in [(1,), (3,), (5, 1)]:
        gate, up = packed_gate_up(shape, I, dtype, gen)
        want = silu_and_mul(gate, up, backend="torch")
        got = silu_and_mul(gate.to(device), up.to(device), backend=backend)
        check_out(got.cpu(), want, gate, up)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_reference_is_the_formula(dtype, gen):
    gate, up = packed_gate_up((3, 2), 33, dtype, gen)
    want = (gate.float() / (1.0 + torch.exp(-gate.float()))).to(dtype) * up  # silu in fp32, rounded, product in dtype
    check_out(want, silu_and_mul(gate, up), gate, up)
    assert torch.equal(silu_and_mul(gate, up), torch.nn.functional.silu(gate) * up)


def test_auto_is_the_reference_on_cpu():
    assert _SILU_AND_MUL.choose("auto", torch.device("cpu")) == "torch"


@pytest.mark.parametrize("backend", backend_params())
def test_torch_compile(backend, gen):
    gate, up = packed_gate_up((2, 3), 40, torch.bfloat16, gen)

    def fn(gate, up):
        return silu_and_mul(gate, up * 1.0, backend=backend)

    torch._dynamo.reset()
    got = torch.compile(fn, backend="aot_eager", fullgraph=True)(gate, up)
    assert torch.equal(got, fn(gate, up))


def test_bad_inputs(gen):
    gate, up = packed_gate_up((3,), 8, torch.bfloat16, gen)
    cases = [
        ("gate", dict(gate=gate.to(torch.int64))),
        ("gate", dict(gate=gate.t().contiguous().t(), up=up.t().contiguous().t())),
        ("gate", dict(gate=torch.tensor(1.0, dtype=torch.bfloat16), up=torch.tensor(1.0, dtype=torch.bfloat16))),
        ("gate", dict(gate=gate.tolist())),
        ("up", dict(up=up.float())),
        ("up", dict(up=up[:2])),
        ("up", dict(up=up.t().contiguous().t())),
        ("up", dict(up=up.to("meta"))),
        ("backend", dict(backend="tpu")),
    ]
    for name, bad in cases:
        args = dict(gate=gate, up=up, backend="torch")
        args.update(bad)
        assert_rejects(silu_and_mul, name, args["gate"], args["up"], backend=args["backend"])
    with pytest.raises(tlt_kernels.BackendUnavailableError, match="silu_and_mul has no 'cuda' backend"):
        silu_and_mul(gate, up, backend="cuda")


def test_exported():
    assert tlt_kernels.silu_and_mul is silu_and_mul and "silu_and_mul" in tlt_kernels.__all__


# ----------------------------------------------------------------------------------------------- property
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # the interpreter's numpy exp
@budget(10)
@given(st.data())
@pytest.mark.parametrize("backend", backend_params())
def test_property_matches_reference(backend, data):
    """Any rows (0..5 in up to two leading dims), any width (1..70), any float dtype and magnitude (including
    values where exp overflows), in any row layout: the reference's values within an ulp, no NaN from finite
    inputs."""
    dtype = data.draw(st.sampled_from(FLOAT_DTYPES), label="dtype")
    lead = tuple(data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=2), label="leading dims"))
    I = data.draw(st.integers(1, 70), label="I")
    g = gen(data.draw(seeds))
    scale = data.draw(st.sampled_from([1e-3, 1.0, 200.0]), label="scale")
    gate = (torch.randn(*lead, I, generator=g) * scale).to(dtype)
    up = torch.randn(*lead, I, generator=g).to(dtype)
    layouts = [data.draw(st.sampled_from(["contiguous", "offset", "strided", "wide_rows"])) for _ in range(2)]
    note(f"layouts {layouts}")
    vg = relayout(gate, layouts[0]) if gate.numel() else gate
    vu = relayout(up, layouts[1]) if up.numel() else up
    got = silu_and_mul(vg, vu, backend=backend)
    check_out(got, silu_and_mul(gate, up, backend="torch"), gate, up)
