"""linear: every backend against the exact product (awkward sizes, every float dtype, bias or none), strided rows and
packed weight blocks, every output element written, the auto rule, validation, torch.compile, CUDA graphs, and a
hypothesis property."""
import pytest
import torch
from conftest import agreement_backends, compile_for_sm90, kernel_devices, need_backend, poison_
from hypothesis import given, note
from hypothesis import strategies as st
from strategies import FLOAT_DTYPES, assert_rejects, backend_params, budget, gen, relayout, seeds

import tlt_kernels
from tlt_kernels import linear
from tlt_kernels.ops.linear import FEW_ROWS_MAX_ROWS, FEW_ROWS_MAX_WEIGHTS, _LINEAR, few_rows_kernel_applies

SHAPES = [(1, 1, 1), (1, 576, 960), (3, 17, 5), (16, 64, 130), (17, 300, 96), (40, 33, 20), (2, 1536, 24)]


def problem(M, K, N, dtype, g, bias=True, lead=None):
    x = torch.randn(*(lead or (M,)), K, generator=g).to(dtype)
    w = (torch.randn(N, K, generator=g) * K**-0.5).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    return x, w, b


def check_product(got, x, w, b, backend="triton"):
    """``got`` is the exact ``x @ w^T + b`` rounded once to x's dtype, up to the fp32 sum's own error: within one
    ulp of the dtype at the exact value plus ``2 K 2^-24 sum |x| |w|`` (fp16 also its smallest subnormal). torch's
    own linear is held to the dtype's precision instead of fp32's: on the CPU, strided bf16 rows take a path that
    rounds its partial sums (errors of ~0.2% of ``sum |x| |w|`` seen)."""
    assert got.dtype == x.dtype and got.shape == (*x.shape[:-1], w.shape[0]) and got.is_contiguous()
    exact = x.double() @ w.double().T + (b.double() if b is not None else 0.0)
    magnitude = x.double().abs() @ w.double().abs().T
    info = torch.finfo(x.dtype)
    ulp = info.eps * torch.exp2(torch.floor(torch.log2(exact.abs().clamp(min=info.tiny))))
    sum_eps = info.eps if backend == "torch" else 2.0**-24
    bound = ulp + 2 * x.shape[-1] * sum_eps * magnitude + (2.0**-24 if x.dtype == torch.float16 else 0.0)
    err = (got.double() - exact).abs()
    assert bool((err <= bound).all()), f"worst excess {float((err - bound).max())}"


@pytest.mark.parametrize("backend", agreement_backends())
@pytest.mark.parametrize("M,K,N", SHAPES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_matches_the_exact_product(backend, M, K, N, dtype, bias, gen):
    device = kernel_devices()[0]
    need_backend("linear", backend, torch.device(device))
    x, w, b = problem(M, K, N, dtype, gen, bias)
    got = linear(x.to(device), w.to(device), b.to(device) if b is not None else None, backend=backend)
    check_product(got.cpu(), x, w, b, backend)


@pytest.mark.parametrize("backend", agreement_backends())
def test_strided_rows_and_a_packed_weight_block(backend, gen):
    """x from a sliced batch with padded rows and two leading dims, weight a row block of a packed projection (a
    view with a storage offset): the exact product; on the kernel, the same bits as the contiguous inputs (the vendor
    BLAS may sum a strided layout in another order)."""
    device = kernel_devices()[0]
    need_backend("linear", backend, torch.device(device))
    x, w, b = problem(0, 48, 40, torch.bfloat16, gen, lead=(2, 3))
    packed = torch.cat([torch.randn(7, 48, generator=gen).to(torch.bfloat16), w]).to(device)
    block = packed[7:]
    view = relayout(relayout(x, "wide_rows"), "strided").to(device)
    want = linear(x.to(device), w.to(device), b.to(device), backend=backend)
    got = linear(view, block, b.to(device), backend=backend)
    check_product(want.cpu(), x, w, b, backend)
    check_product(got.cpu(), x, w, b, backend)
    assert backend == "torch" or torch.equal(got, want)


@pytest.mark.triton
def test_every_output_element_is_written(gen):
    """The kernel into a poisoned buffer, at sizes that leave partial row and column tiles: nothing left unwritten."""
    from tlt_kernels._triton.linear import linear_out

    device = kernel_devices()[0]
    need_backend("linear", "triton", torch.device(device))
    for M, K, N in [(1, 40, 17), (19, 33, 50), (16, 16, 16)]:
        x, w, b = (t.to(device) for t in problem(M, K, N, torch.float16, gen))
        out = poison_(torch.empty(M, N, dtype=torch.float16, device=device))
        linear_out(x, w, b, out)
        check_product(out.cpu(), x.cpu(), w.cpu(), b.cpu())


_COMPILE_LINEAR_SM90 = r"""
from tlt_kernels._triton import linear as m

for dtype, exact in (("bf16", False), ("fp16", False), ("fp32", True)):
    for (M, K, N) in ((1, 576, 960), (1, 576, 3072), (16, 1536, 576), (40, 33, 20)):
        bm, bn, bk, warps, stages = m.launch_config(M, K, N)
        bk = min(bk, max(16, triton.next_power_of_2(K)))
        for has_bias in (False, True):
            compile_sm90(m._linear_kernel, ["*" + dtype] * 4 + ["i32", "i32", "i64", "i64"],
                         dict(K=K, HAS_BIAS=has_bias, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, EXACT=exact, HAND_ROUND=False),
                         warps)
"""


@pytest.mark.slow
def test_kernel_compiles_for_sm90():
    """The interpreter upcasts every tile to fp32: compile the bf16 / fp16 tensor-core form (and fp32's exact one)
    for sm_90 at the configs the launcher picks."""
    compile_for_sm90(_COMPILE_LINEAR_SM90)


def test_auto_rule():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert few_rows_kernel_applies(cuda, torch.bfloat16, 1, 576, 960)
    assert few_rows_kernel_applies(cuda, torch.float16, FEW_ROWS_MAX_ROWS, 1536, 576)
    assert not few_rows_kernel_applies(cuda, torch.bfloat16, FEW_ROWS_MAX_ROWS + 1, 576, 960)
    assert not few_rows_kernel_applies(cuda, torch.bfloat16, 1, 4864, 896)  # past the weight bound
    assert few_rows_kernel_applies(cuda, torch.bfloat16, 1, 1024, FEW_ROWS_MAX_WEIGHTS // 1024)
    assert not few_rows_kernel_applies(cuda, torch.float32, 1, 576, 960)  # fp32 stays on the vendor BLAS
    assert not few_rows_kernel_applies(cpu, torch.bfloat16, 1, 576, 960)
    assert _LINEAR.choose("auto", cpu) == "torch"


def test_auto_on_the_cpu_is_f_linear(gen):
    x, w, b = problem(3, 40, 9, torch.bfloat16, gen)
    assert torch.equal(linear(x, w, b), torch.nn.functional.linear(x, w, b))


@pytest.mark.parametrize("backend", backend_params())
def test_torch_compile(backend, gen):
    x, w, b = problem(4, 32, 24, torch.bfloat16, gen)

    def fn(x, w, b):
        return linear(x * 1.0, w, b, backend=backend)

    torch._dynamo.reset()
    got = torch.compile(fn, backend="aot_eager", fullgraph=True)(x, w, b)
    assert torch.equal(got, fn(x, w, b))


@pytest.mark.cuda
def test_cuda_graph_replay_matches_eager(gen):
    x, w, b = (t.cuda() for t in problem(4, 576, 960, torch.bfloat16, gen))
    want = linear(x, w, b)
    static_x = x.clone()
    graph = torch.cuda.CUDAGraph()
    linear(static_x, w, b)  # compile before capture
    with torch.cuda.graph(graph):
        out = linear(static_x, w, b)
    static_x.copy_(x * 2)
    graph.replay()
    assert torch.equal(out, linear(x * 2, w, b)) and not torch.equal(out, want)


def test_bad_inputs(gen):
    x, w, b = problem(3, 8, 5, torch.bfloat16, gen)
    cases = [
        ("x", dict(x=x.to(torch.int64))),
        ("x", dict(x=x.t().contiguous().t())),
        ("x", dict(x=torch.tensor(1.0, dtype=torch.bfloat16))),
        ("x", dict(x=x.tolist())),
        ("weight", dict(weight=w.float())),
        ("weight", dict(weight=w[0])),
        ("weight", dict(weight=w[:, :4])),
        ("weight", dict(weight=w.t().contiguous().t())),
        ("weight", dict(weight=w.to("meta"))),
        ("bias", dict(bias=b[:4])),
        ("bias", dict(bias=b.float())),
        ("backend", dict(backend="tpu")),
    ]
    for name, bad in cases:
        args = dict(x=x, weight=w, bias=b, backend="torch")
        args.update(bad)
        assert_rejects(linear, name, args["x"], args["weight"], args["bias"], backend=args["backend"])
    with pytest.raises(tlt_kernels.BackendUnavailableError, match="linear has no 'cuda' backend"):
        linear(x, w, b, backend="cuda")


def test_exported():
    assert tlt_kernels.linear is linear and "linear" in tlt_kernels.__all__


# ----------------------------------------------------------------------------------------------- property
@budget(10)
@given(st.data())
@pytest.mark.parametrize("backend", backend_params())
def test_property_matches_the_exact_product(backend, data):
    """Any rows (0..20 in one or two leading dims), any depth (1..80) and width (1..40), any float dtype, bias or
    none, in any row layout: the exact product within its rounding and the fp32 sum's error."""
    dtype = data.draw(st.sampled_from(FLOAT_DTYPES), label="dtype")
    lead = tuple(data.draw(st.lists(st.integers(0, 5), min_size=1, max_size=2), label="leading dims"))
    K, N = data.draw(st.integers(1, 80), label="K"), data.draw(st.integers(1, 40), label="N")
    x, w, b = problem(0, K, N, dtype, gen(data.draw(seeds)), data.draw(st.booleans(), label="bias"), lead=lead)
    layout = data.draw(st.sampled_from(["contiguous", "offset", "strided", "wide_rows"]), label="layout")
    note(f"layout {layout}")
    got = linear(relayout(x, layout) if x.numel() else x, w, b, backend=backend)
    check_product(got, x, w, b, backend)
