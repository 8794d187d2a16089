"""top_logprobs: every backend against the torch reference (awkward widths, masked and tied logits, NaN and infinities,
strided rows, every split of a row), the reference against its definition, the split rule, validation,
torch.compile, CUDA graphs, and a hypothesis property."""
import pytest
import torch
from conftest import HAS_CUDA, agreement_backends, compile_for_sm90, kernel_devices, need_backend, poison_
from hypothesis import given, note
from hypothesis import strategies as st
from strategies import FLOAT_DTYPES, assert_rejects, backend_params, budget, gen, relayout, seeds

import tlt_kernels
from tlt_kernels import top_logprobs
from tlt_kernels.ops.top_logprobs import TRITON_MAX_K, _TOP_LOGPROBS

# The interpreter's numpy arithmetic on infinities (inf - inf, log(0)) warns where the kernel means it.
pytestmark = [pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning")]

INF, NAN = float("inf"), float("nan")


def logits_with_ties(lead, V, dtype, g, masked: float = 0.25):
    """``[*lead, V]`` logits of spread ~3, a quarter of them -inf (a masked vocabulary), and the row's largest value
    repeated at a few columns (ties the order must break by column)."""
    x = torch.randn(*lead, V, generator=g) * 3
    x = x.masked_fill(torch.rand(*lead, V, generator=g) < masked, -INF).to(dtype)
    if V >= 8:
        top = x.float().amax(-1, keepdim=True).to(dtype)
        cols = torch.randperm(V, generator=g)[:3]
        x[..., cols] = top.expand(*lead, 3)
    return x


def check_top(got, want, msg=""):
    """Tokens exactly the reference's (the order is defined on the logits, which every backend reads alike);
    log-probabilities within 1e-5 (the normaliser's sum runs in another order), NaN where the reference's are."""
    logp, tokens = got
    want_logp, want_tokens = want
    assert logp.dtype == torch.float32 and tokens.dtype == torch.int64 and logp.is_contiguous() and tokens.is_contiguous()
    assert tokens.shape == want_tokens.shape and logp.shape == want_logp.shape
    assert torch.equal(tokens.cpu(), want_tokens), f"{msg}: tokens {tokens.cpu()} != {want_tokens}"
    torch.testing.assert_close(logp.cpu(), want_logp, atol=1e-5, rtol=1e-5, equal_nan=True, msg=lambda m: f"{msg}\n{m}")


@pytest.mark.parametrize("backend", agreement_backends())
@pytest.mark.parametrize("V", [1, 7, 100, 4097, 49152])
@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_matches_reference(backend, V, k, dtype, gen):
    device = kernel_devices()[0]
    need_backend("top_logprobs", backend, torch.device(device))
    k = min(k, V)
    for lead in [(1,), (3,), (2, 5)]:
        x = logits_with_ties(lead, V, dtype, gen, masked=0.0 if V == 1 else 0.25)
        check_top(top_logprobs(x.to(device), k, backend=backend), top_logprobs(x, k, backend="torch"), f"{lead}")


@pytest.mark.triton
@pytest.mark.parametrize("splits", [1, 2, 3, 5, 100])
def test_every_split_of_a_row(splits, gen):
    """The merge of a row's partial results equals one program's pass over it, whatever the split (more splits than
    tiles: one per tile); the outputs are poisoned first, so an unwritten element fails."""
    from tlt_kernels._triton.top_logprobs import _outputs, top_logprobs_out

    device = kernel_devices()[0]
    x = logits_with_ties((3,), 4 * 4096 + 17, torch.bfloat16, gen).to(device)
    logp, tokens = _outputs(x, 5)
    poison_(logp), poison_(tokens)
    top_logprobs_out(x, 5, logp, tokens, num_splits=splits)
    check_top((logp, tokens), top_logprobs(x.cpu(), 5, backend="torch"), f"{splits} splits")


@pytest.mark.parametrize("backend", agreement_backends())
@pytest.mark.parametrize("V", [7, 4097])
def test_token_ids_map_the_columns(backend, V, gen):
    """With ``token_ids`` (a drafter's head over a subset of the vocabulary): the columns the op ranks without it,
    each reported as its token id, the log-probabilities unchanged, on one program and on a merge of splits."""
    device = kernel_devices()[0]
    need_backend("top_logprobs", backend, torch.device(device))
    ids = torch.randperm(5 * V, generator=gen)[:V]
    x = logits_with_ties((2, 3), V, torch.bfloat16, gen)
    want_logp, columns = top_logprobs(x, 4, backend="torch")
    check_top(top_logprobs(x.to(device), 4, token_ids=ids.to(device), backend=backend), (want_logp, ids[columns]))


@pytest.mark.triton
def test_token_ids_on_every_split(gen):
    from tlt_kernels._triton.top_logprobs import _outputs, top_logprobs_out

    device = kernel_devices()[0]
    x = logits_with_ties((3,), 2 * 4096 + 5, torch.float32, gen).to(device)
    ids = torch.randperm(3 * x.shape[-1], generator=gen)[: x.shape[-1]]
    want_logp, columns = top_logprobs(x.cpu(), 3, backend="torch")
    for splits in (1, 3):
        logp, tokens = _outputs(x, 3)
        poison_(logp), poison_(tokens)
        top_logprobs_out(x, 3, logp, tokens, num_splits=splits, token_ids=ids.to(device))
        check_top((logp, tokens), (want_logp, ids[columns]), f"{splits} splits")


def test_token_ids_are_checked(gen):
    x = torch.randn(2, 10, generator=gen)
    for bad in (torch.arange(10, dtype=torch.int32), torch.arange(9), torch.arange(20)[::2].reshape(1, 10)):
        assert_rejects(top_logprobs, "token_ids", x, 3, token_ids=bad)


@pytest.mark.parametrize("backend", agreement_backends())
def test_special_values(backend):
    """NaN ranks above +inf, -0.0 ties with 0.0 (by column), and the log-probabilities are NaN wherever
    ``torch.log_softmax``'s are: a row holding NaN or +inf, and a row of -inf only."""
    device = kernel_devices()[0]
    need_backend("top_logprobs", backend, torch.device(device))
    x = torch.tensor(SPECIAL_ROWS)
    for dtype in FLOAT_DTYPES:
        for k in (1, 4, 8):
            check_top(top_logprobs(x.to(dtype).to(device), k, backend=backend),
                      top_logprobs(x.to(dtype), k, backend="torch"), f"{dtype} k={k}")


SPECIAL_ROWS = [[1.0, NAN, -0.0, 0.0, INF, 3.0, 3.0, -INF],
                [-0.0, 0.0, -0.0, 0.0, -1.0, -INF, -2.0, -0.0],
                [-INF] * 8,
                [5.0, -INF, INF, INF, -INF, 2.0, 1.0, 0.5],
                [2.0, -1.0, NAN, -0.0, 7.5, 7.5, NAN, 1e-30]]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_reference_is_the_definition(dtype, gen):
    """The reference: the k largest logits (NaN first, -0.0 as 0.0), equal ones by column, with
    ``torch.log_softmax``'s values."""
    x = torch.cat([logits_with_ties((4,), 8, dtype, gen), torch.tensor(SPECIAL_ROWS).to(dtype)])
    logp, tokens = top_logprobs(x, 6, backend="torch")
    full = torch.log_softmax(x.float(), -1)
    for row in range(x.shape[0]):
        values = [float(v) for v in x[row]]
        ranked = sorted(range(8), key=lambda c: (values[c] == values[c], -values[c] if values[c] == values[c] else 0, c))
        assert tokens[row].tolist() == ranked[:6], row
        torch.testing.assert_close(logp[row], full[row, ranked[:6]], rtol=0, atol=0, equal_nan=True)


def test_default_splits():
    from tlt_kernels._triton.top_logprobs import SPLIT_PROGRAMS_PER_SM, default_splits

    assert default_splits(rows=1024, tiles=12, sm_count=132) == 1  # the rows fill the GPU
    assert default_splits(rows=4, tiles=12, sm_count=132) == 12  # a few rows: one program per tile
    assert default_splits(rows=16, tiles=38, sm_count=132) == -(-SPLIT_PROGRAMS_PER_SM * 132 // 16)
    assert default_splits(rows=1, tiles=1, sm_count=132) == 1
    assert default_splits(rows=0, tiles=5, sm_count=132) == 5


def test_auto_backend():
    """``auto``: the reference on CPU tensors, and past ``TRITON_MAX_K`` on any device, where asking for Triton
    raises."""
    assert _TOP_LOGPROBS.choose("auto", torch.device("cpu")) == "torch"
    device = kernel_devices()[0]
    x = torch.randn(2, 40)
    check_top(top_logprobs(x.to(device), TRITON_MAX_K + 1), top_logprobs(x, TRITON_MAX_K + 1, backend="torch"))
    need_backend("top_logprobs", "triton", torch.device(device))
    with pytest.raises(tlt_kernels.BackendUnavailableError, match=f"k <= {TRITON_MAX_K}, got k = {TRITON_MAX_K + 1}"):
        top_logprobs(x.to(device), TRITON_MAX_K + 1, backend="triton")


@pytest.mark.parametrize("backend", backend_params())
def test_torch_compile(backend, gen):
    x = logits_with_ties((2, 3), 300, torch.bfloat16, gen)

    def fn(x):
        return top_logprobs(x * 1.0, 4, backend=backend)

    torch._dynamo.reset()
    got = torch.compile(fn, backend="aot_eager", fullgraph=True)(x)
    check_top(got, fn(x))

    ids = torch.randperm(1000, generator=gen)[:300]

    def with_ids(x, ids):
        return top_logprobs(x * 1.0, 4, token_ids=ids, backend=backend)

    torch._dynamo.reset()
    check_top(torch.compile(with_ids, backend="aot_eager", fullgraph=True)(x, ids), with_ids(x, ids))


@pytest.mark.cuda
@pytest.mark.parametrize("rows", [1, 4, 600])
def test_cuda_graph(rows, gen):
    """Captured once, replayed on new logits: the graph's outputs are the new rows' top k (no host sync inside)."""
    x = logits_with_ties((rows,), 49152, torch.bfloat16, gen).cuda()
    top_logprobs(x, 4)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logp, tokens = top_logprobs(x, 4)
    for _ in range(2):
        x.copy_(logits_with_ties((rows,), 49152, torch.bfloat16, gen).cuda())
        graph.replay()
        check_top((logp, tokens), top_logprobs(x.cpu(), 4, backend="torch"))


def test_bad_inputs(gen):
    x = torch.randn(3, 10, generator=gen)
    cases = [
        ("logits", dict(logits=x.to(torch.int64))),
        ("logits", dict(logits=x.t())),
        ("logits", dict(logits=torch.tensor(1.0))),
        ("logits", dict(logits=x.tolist())),
        ("k", dict(k=0)),
        ("k", dict(k=11)),
        ("k", dict(k=2.0)),
        ("k", dict(k=True)),
        ("backend", dict(backend="tpu")),
    ]
    for name, bad in cases:
        args = dict(logits=x, k=2, backend="torch")
        args.update(bad)
        assert_rejects(top_logprobs, name, args["logits"], args["k"], backend=args["backend"])
    with pytest.raises(tlt_kernels.BackendUnavailableError, match="top_logprobs has no 'cuda' backend"):
        top_logprobs(x, 2, backend="cuda")


def test_numpy_integer_k(gen):
    import numpy as np

    x = logits_with_ties((2,), 50, torch.float32, gen)
    check_top(top_logprobs(x, np.int64(3)), top_logprobs(x, 3))


def test_exported():
    assert tlt_kernels.top_logprobs is top_logprobs and "top_logprobs" in tlt_kernels.__all__


@pytest.mark.skipif(HAS_CUDA, reason="a GPU compiles the kernels in its own tests")
def test_kernels_compile_for_sm90():
    """The interpreter accepts code the compiler rejects: compile both kernels for sm_90, every variant."""
    compile_for_sm90(r"""
from tlt_kernels._triton import top_logprobs as m

for logits in ("*fp32", "*bf16", "*fp16"):
    for final, tiles in ((True, 12), (False, 1)):
        for ids in (False, True):
            compile_sm90(m._top_logprobs_kernel,
                         [logits, "i64", "i32", "*fp32", "*i64", "*i64", "*fp32", "*fp32", "*i64"],
                         dict(K=4, KP=4, BLOCK=m.MAX_BLOCK, SPLIT_TILES=tiles, FINAL=final, HAS_IDS=ids), 8)
compile_sm90(m._top_logprobs_kernel, ["*bf16", "i64", "i32", "*fp32", "*i64", "*i64", "*fp32", "*fp32", "*i64"],
             dict(K=1, KP=1, BLOCK=64, SPLIT_TILES=1, FINAL=True, HAS_IDS=False), 4)
for ids in (False, True):
    compile_sm90(m._top_logprobs_merge_kernel, ["*fp32", "*fp32", "*i64", "*fp32", "*i64", "*i64", "i32"],
                 dict(K=3, KP=4, SP=16, HAS_IDS=ids), 1)
""")


# ----------------------------------------------------------------------------------------------- property
@budget(10)
@given(st.data())
@pytest.mark.parametrize("backend", backend_params())
def test_property_matches_reference(backend, data):
    """Any rows (0..4 in up to two leading dims), any width (1..300), any k, any float dtype, logits drawn from a few
    values (ties everywhere) or spread, with -inf / +inf / NaN sprinkled, in any row layout: the reference's tokens
    and log-probabilities."""
    dtype = data.draw(st.sampled_from(FLOAT_DTYPES), label="dtype")
    lead = tuple(data.draw(st.lists(st.integers(0, 4), min_size=1, max_size=2), label="leading dims"))
    V = data.draw(st.integers(1, 300), label="V")
    k = data.draw(st.integers(1, min(V, TRITON_MAX_K)), label="k")
    g = gen(data.draw(seeds))
    if data.draw(st.booleans(), label="few distinct values"):
        x = torch.randint(-3, 3, (*lead, V), generator=g).float()
    else:
        x = torch.randn(*lead, V, generator=g) * data.draw(st.sampled_from([1e-3, 1.0, 50.0]), label="scale")
    special = torch.tensor([-INF, INF, NAN, -0.0])[torch.randint(0, 4, x.shape, generator=g)]
    x = torch.where(torch.rand(x.shape, generator=g) < data.draw(st.sampled_from([0.0, 0.05, 0.5])), special, x)
    x = x.to(dtype)
    layout = data.draw(st.sampled_from(["contiguous", "offset", "strided", "wide_rows"]), label="layout")
    note(f"layout {layout}")
    view = relayout(x, layout) if x.numel() else x
    check_top(top_logprobs(view, k, backend=backend), top_logprobs(x, k, backend="torch"))
