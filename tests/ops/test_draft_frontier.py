"""draft_frontier: every backend against the torch reference (ties, special scores, keep 0 / K / K * C, mixed
embedding and feature dtypes, strided inputs, poisoned outputs), the reference against a loop over its definition,
validation, torch.compile, CUDA graphs, a hypothesis property, and the sm_90 compile."""
import pytest
import torch
from conftest import HAS_CUDA, agreement_backends, compile_for_sm90, kernel_devices, need_backend, poison_
from hypothesis import given, note
from hypothesis import strategies as st
from strategies import FLOAT_DTYPES, assert_rejects, backend_params, budget, gen, relayout, seeds

import tlt_kernels
from tlt_kernels import FrontierStep, draft_frontier
from tlt_kernels.ops.draft_frontier import TRITON_MAX_CHILDREN, TRITON_MAX_KEEP

INF, NAN = float("inf"), float("nan")
VOCAB = 97


def problem(B, K, C, H, g, features_dtype=torch.bfloat16, embed_dtype=torch.bfloat16, special=0.0):
    """Arguments of one draft step: frontier scores and candidate indices, children's log-probabilities (ties
    between parents, and -inf / NaN / -0.0 where ``special`` > 0), tokens, features and an embedding table."""
    parent_scores = -torch.rand(B, K, generator=g) * 4
    child_logprobs = -torch.rand(B, K, C, generator=g) * 4
    if K > 1:  # the same cumulative score under two parents: the lower child index ranks first
        child_logprobs[:, 1, 0] = parent_scores[:, 0] + child_logprobs[:, 0, 0] - parent_scores[:, 1]
    if special:
        values = torch.tensor([-INF, NAN, -0.0, INF])[torch.randint(0, 4, (B, K, C), generator=g)]
        child_logprobs = torch.where(torch.rand(B, K, C, generator=g) < special, values, child_logprobs)
        parent_scores = parent_scores.masked_fill(torch.rand(B, K, generator=g) < special / 2, -0.0)
    return dict(parent_scores=parent_scores, parent_index=torch.randint(0, 50, (B, K), generator=g),
                child_logprobs=child_logprobs, child_tokens=torch.randint(0, VOCAB, (B, K, C), generator=g),
                features=torch.randn(B, K, H, generator=g).to(features_dtype),
                embed_weight=torch.randn(VOCAB, H, generator=g).to(embed_dtype))


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bits (the sign of zero included), NaN where the other is NaN (hardware NaN payloads differ)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.cpu(), b.cpu()
    if not a.dtype.is_floating_point:
        return torch.equal(a, b)
    nan = a.isnan()
    view = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(nan, b.isnan()) and torch.equal(a.masked_fill(nan, 0).view(view), b.masked_fill(nan, 0).view(view))


def check_step(got: FrontierStep, want: FrontierStep, msg=""):
    assert isinstance(got, FrontierStep)
    for name, x, y in zip(FrontierStep._fields, got, want):
        assert x.is_contiguous(), f"{msg}: {name} is not contiguous"
        assert same(x, y), f"{msg}: {name}\n{x}\n!=\n{y}"


def run(args, keep, backend, device="cpu", first_index=5, first_row=3):
    moved = {k: v.to(device) for k, v in args.items()}
    return draft_frontier(**moved, keep=keep, first_index=first_index, first_row=first_row, backend=backend)


@pytest.mark.parametrize("backend", agreement_backends())
@pytest.mark.parametrize("K, C, H", [(1, 1, 8), (4, 4, 64), (3, 5, 100), (8, 8, 576), (2, 30, 1500)])
@pytest.mark.parametrize("dtypes", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
                                    (torch.float16, torch.float32), (torch.float32, torch.float32)])
def test_matches_reference(backend, K, C, H, dtypes, gen):
    device = kernel_devices()[0]
    need_backend("draft_frontier", backend, torch.device(device))
    for B, special in ((1, 0.0), (5, 0.0), (3, 0.3)):
        args = problem(B, K, C, H, gen, *dtypes, special=special)
        for keep in sorted({0, 1, K} | ({K * C} if K * C <= 20 else set())):  # every child kept where that is cheap
            check_step(run(args, keep, backend, device), run(args, keep, "torch"), f"B={B} keep={keep} {special}")


def test_reference_is_its_definition(gen):
    """A loop: every child's cumulative score and parent; the kept ones best first (ties by child index, -0.0 as
    0.0, NaN above +inf); their inputs the token's embedding beside the parent's feature."""
    B, K, C, H = 3, 3, 4, 6
    args = problem(B, K, C, H, gen, torch.float32, torch.float32, special=0.3)
    args["child_logprobs"][0, 2, 3] = -0.0
    args["parent_scores"][0, 2] = 0.0  # -0.0 + 0.0 = 0.0 ties the 0.0 scores below it
    step = run(args, K * C, "torch", first_index=7, first_row=2)
    for b in range(B):
        rank = lambda i: (not step.cand_scores[b, i].isnan(), -float(step.cand_scores[b, i]) + 0.0, i)  # noqa: E731
        order = sorted(range(K * C), key=rank)
        for i in range(K * C):
            p, c = divmod(i, C)
            want = args["parent_scores"][b, p] + args["child_logprobs"][b, p, c]
            assert same(step.cand_scores[b, i], want) and step.cand_parents[b, i] == args["parent_index"][b, p]
        for j, i in enumerate(order):
            p, c = divmod(i, C)
            token = args["child_tokens"][b, p, c]
            assert step.cand_index[b, j] == 7 + i and step.parent_rows[b, j] == 2 + p and step.tokens[b, j] == token
            assert same(step.scores[b, j], step.cand_scores[b, i])
            assert torch.equal(step.inputs[b, j], torch.cat([args["embed_weight"][token], args["features"][b, p]]))


@pytest.mark.triton
@pytest.mark.parametrize("layout", ["offset", "strided", "column"])
def test_strided_inputs(layout, gen):
    """Any strides but a unit last one for the [B, K, C] / [B, K, H] inputs and the embedding; any strides at all for
    the [B, K] ones (the first frontier's indices are ``arange(K).expand(B, K)``)."""
    device = kernel_devices()[0]
    args = problem(4, 3, 5, 40, gen)
    views = {k: relayout(v, layout if k in ("parent_scores", "parent_index") else "offset") for k, v in args.items()}
    views["parent_index"] = torch.arange(3).expand(4, 3)
    want = run({**args, "parent_index": torch.arange(3).expand(4, 3).contiguous()}, 3, "torch")
    check_step(run(views, 3, "triton", device), want, layout)


@pytest.mark.triton
@pytest.mark.parametrize("keep", [0, 2, 12])
def test_every_output_element_is_written(keep, gen):
    from tlt_kernels._triton.draft_frontier import _outputs, draft_frontier_out

    device = kernel_devices()[0]
    args = {k: v.to(device) for k, v in problem(3, 3, 4, 33, gen, special=0.2).items()}
    outputs = tuple(poison_(t) for t in _outputs(args["child_logprobs"], args["features"], keep))
    draft_frontier_out(*args.values(), keep, 4, 1, outputs)
    check_step(FrontierStep(*outputs), run(args, keep, "torch", device, first_index=4, first_row=1))


def test_limits_of_the_triton_backend(gen):
    device = kernel_devices()[0]
    args = problem(1, 33, 32, 4, gen)  # K * C = 1056 children
    check_step(run(args, 2, "auto", device), run(args, 2, "torch"))
    need_backend("draft_frontier", "triton", torch.device(device))
    with pytest.raises(tlt_kernels.BackendUnavailableError, match=f"K \\* C <= {TRITON_MAX_CHILDREN}"):
        run(args, 2, "triton", device)
    args = problem(1, 8, 8, 4, gen)
    check_step(run(args, TRITON_MAX_KEEP + 1, "auto", device), run(args, TRITON_MAX_KEEP + 1, "torch"))


def test_bad_inputs(gen):
    good = problem(2, 3, 4, 8, gen)
    cases = [
        ("child_logprobs", dict(child_logprobs=good["child_logprobs"].double())),
        ("child_logprobs", dict(child_logprobs=good["child_logprobs"][0])),
        ("child_logprobs", dict(child_logprobs=good["child_logprobs"].transpose(1, 2).contiguous().transpose(1, 2))),
        ("child_logprobs", dict(child_logprobs=torch.zeros(2, 3, 0))),
        ("child_tokens", dict(child_tokens=good["child_tokens"].int())),
        ("child_tokens", dict(child_tokens=good["child_tokens"][:, :2])),
        ("child_tokens", dict(child_tokens=good["child_tokens"].index_put((torch.tensor(1), torch.tensor(2), torch.tensor(3)),
                                                                    torch.tensor(VOCAB)))),
        ("child_tokens", dict(child_tokens=torch.full((2, 3, 4), -1))),
        ("parent_scores", dict(parent_scores=good["parent_scores"][:1])),
        ("parent_scores", dict(parent_scores=good["parent_scores"].half())),
        ("parent_index", dict(parent_index=good["parent_index"].int())),
        ("features", dict(features=good["features"][:, :2])),
        ("features", dict(features=good["features"].int())),
        ("features", dict(features=good["features"].transpose(1, 2).contiguous().transpose(1, 2))),
        ("embed_weight", dict(embed_weight=good["embed_weight"][:, :7])),
        ("embed_weight", dict(embed_weight=good["embed_weight"].t().contiguous().t())),
        ("keep", dict(keep=13)),
        ("keep", dict(keep=-1)),
        ("keep", dict(keep=2.0)),
        ("first_index", dict(first_index=-1)),
        ("first_row", dict(first_row=True)),
        ("backend", dict(backend="tpu")),
    ]
    for name, bad in cases:
        args = dict(good, keep=3, first_index=0, first_row=0, backend="torch")
        args.update(bad)
        assert_rejects(draft_frontier, name, **args)
    # validate=False skips the token check (a host sync) and nothing else
    args = dict(good, keep=3, first_index=0, first_row=0, backend="torch", validate=False)
    assert_rejects(draft_frontier, "keep", **dict(args, keep=13))


def ancestor_words_case(B, K, first_row, width, dtype, g):
    """Words of the nodes expanded before the step (columns ``< first_row + K``: random bits), poisoned beyond."""
    bits = 8 * torch.empty(0, dtype=dtype).element_size()
    words = torch.randint(-2**(bits - 1), 2**(bits - 1) - 1, (B, width), generator=g, dtype=torch.int64).to(dtype)
    words[:, first_row + K:] = -1 if dtype == torch.int64 else 0x5A5A5A5A
    return words


@pytest.mark.parametrize("backend", agreement_backends())
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("K, C, keep, first_row", [(1, 1, 1, 0), (4, 4, 4, 8), (3, 5, 15, 0)])
def test_ancestor_words(backend, dtype, K, C, keep, first_row, gen):
    """Kept child p's word (column first_row + K + p): its parent's word (column first_row + parent) with bit
    first_row + K + p set; every other column as it was; the outputs as without words. The widest case sets the
    dtype's last bit (int32's sign bit at 32 columns)."""
    device = kernel_devices()[0]
    need_backend("draft_frontier", backend, torch.device(device))
    bits = 8 * torch.empty(0, dtype=dtype).element_size()
    first_row = max(first_row, bits - K - keep) if (K, C) == (3, 5) else first_row  # up to the dtype's last bit
    args = problem(3, K, C, 16, gen)
    words = ancestor_words_case(3, K, first_row, first_row + K + keep + 2, dtype, gen)
    before = words.clone()
    moved = {k: v.to(device) for k, v in args.items()}
    words_dev = words.to(device)
    got = draft_frontier(**moved, keep=keep, first_index=1, first_row=first_row, ancestor_words=words_dev,
                         backend=backend)
    check_step(got, run(args, keep, "torch", first_index=1, first_row=first_row))
    want = before.clone()
    parents = got.parent_rows.cpu()
    for b in range(3):
        for p in range(keep):
            own = first_row + K + p
            want[b, own] = before[b, parents[b, p]] | torch.tensor(1, dtype=dtype).bitwise_left_shift(own)
    assert torch.equal(words_dev.cpu(), want)


def test_ancestor_words_are_checked(gen):
    args = problem(2, 4, 4, 8, gen)
    ok = torch.zeros(2, 12, dtype=torch.int32)
    cases = [ok.float(), ok[:1], ok[:, :11], ok.t().contiguous().t(), torch.zeros(2, 40, dtype=torch.int64)[:, ::2],
             torch.zeros(2, 40, dtype=torch.int32)]
    for i, words in enumerate(cases):
        first_row = 30 if i == len(cases) - 1 else 4  # the last: 30 + 4 + 4 columns past int32's bits
        assert_rejects(draft_frontier, "ancestor_words", **args, keep=4, first_index=0, first_row=first_row,
                       ancestor_words=words, backend="torch")


@pytest.mark.parametrize("backend", backend_params())
def test_torch_compile(backend, gen):
    """The custom ops' fakes (with and without the mutated ancestor words; the Triton kernels in the interpreter on a
    CPU): a compiled call gives what an eager one gives."""
    args = problem(2, 3, 4, 16, gen)

    def fn(child_logprobs, **rest):
        return draft_frontier(child_logprobs=child_logprobs * 1.0, **rest, keep=3, first_index=3, first_row=0,
                              validate=False, backend=backend)

    moved = {k: v.to(kernel_devices()[0]) for k, v in args.items()}
    fn(**moved)  # the backend's module imported outside the trace
    torch._dynamo.reset()
    got = torch.compile(fn, backend="aot_eager", fullgraph=True)(**moved)
    check_step(FrontierStep(*got), fn(**moved))

    def with_words(words, child_logprobs, **rest):  # the mutated words, as eager writes them
        draft_frontier(child_logprobs=child_logprobs * 1.0, **rest, keep=3, first_index=3, first_row=0,
                       ancestor_words=words, validate=False, backend=backend)
        return words + 0

    torch._dynamo.reset()
    words = ancestor_words_case(2, 3, 0, 8, torch.int64, gen).to(kernel_devices()[0])
    got = torch.compile(with_words, backend="aot_eager", fullgraph=True)(words.clone(), **moved)
    assert torch.equal(got, with_words(words.clone(), **moved))


@pytest.mark.cuda
def test_cuda_graph(gen):
    """Captured once, replayed on new scores: the graph's outputs are the new step's (no host sync inside)."""
    args = {k: v.cuda() for k, v in problem(16, 4, 4, 576, gen).items()}
    run(args, 4, "auto", "cuda")  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step = draft_frontier(**args, keep=4, first_index=4, first_row=0, validate=False)
    for _ in range(2):
        fresh = problem(16, 4, 4, 576, gen)
        for k in ("parent_scores", "child_logprobs", "child_tokens", "features"):
            args[k].copy_(fresh[k])
        graph.replay()
        check_step(step, run({**fresh, "embed_weight": args["embed_weight"].cpu(),
                              "parent_index": args["parent_index"].cpu()}, 4, "torch", first_index=4, first_row=0))


def test_exported():
    assert tlt_kernels.draft_frontier is draft_frontier and "draft_frontier" in tlt_kernels.__all__
    assert "FrontierStep" in tlt_kernels.__all__


@pytest.mark.skipif(HAS_CUDA, reason="a GPU compiles the kernel in its own tests")
def test_kernel_compiles_for_sm90():
    """The interpreter accepts code the compiler rejects: compile the kernel for sm_90, each feature dtype."""
    compile_for_sm90(r"""
from tlt_kernels._triton import draft_frontier as m

for features, embed in (("*bf16", "*bf16"), ("*fp32", "*bf16"), ("*fp16", "*fp32")):
    for words in ("*i64", "*i32"):  # the draft's ancestor words, each width (none: an unread int64 pointer)
        types = ["*fp32", "*i64", "*fp32", "*i64", features, embed, "*i32", "*fp32", "*fp32", "*i64", "*i64", "*i64",
                 features, words] + ["i64"] * 12 + ["i32", "i32", "i32"]
        for keep, has_words in ((0, False), (4, False), (4, True)):
            compile_sm90(m._draft_frontier_kernel, types, dict(K=4, C=4, C_P=4, KC_P=16, KEEP=keep, KEEP_P=4,
                         BLOCK_H=1024, H_TILES=1, HAND_ROUND=False, HAS_WORDS=has_words), 4)
compile_sm90(m._draft_frontier_kernel, ["*fp32", "*i64", "*fp32", "*i64", "*bf16", "*bf16", "*i32", "*fp32",
                                         "*fp32", "*i64", "*i64", "*i64", "*bf16", "*i64"] + ["i64"] * 12 + ["i32"] * 3,
             dict(K=3, C=5, C_P=8, KC_P=16, KEEP=15, KEEP_P=16, BLOCK_H=64, H_TILES=3, HAND_ROUND=False,
                  HAS_WORDS=True), 4)
""")


# ----------------------------------------------------------------------------------------------- property
@budget(10)
@given(st.data())
@pytest.mark.parametrize("backend", backend_params())
def test_property_matches_reference(backend, data):
    """Any batch (0..4), frontier width, children per node, kept count and feature width, any float dtypes, scores
    with ties everywhere or spread, -inf / +inf / NaN / -0.0 sprinkled: the reference's outputs, bit for bit."""
    B = data.draw(st.integers(0, 4), label="B")
    K, C = data.draw(st.integers(1, 6), label="K"), data.draw(st.integers(1, 6), label="C")
    H = data.draw(st.integers(1, 70), label="H")
    keep = data.draw(st.integers(0, min(K * C, TRITON_MAX_KEEP)), label="keep")
    dtypes = data.draw(st.tuples(st.sampled_from(FLOAT_DTYPES), st.sampled_from(FLOAT_DTYPES)), label="dtypes")
    g = gen(data.draw(seeds))
    args = problem(B, K, C, H, g, *dtypes, special=data.draw(st.sampled_from([0.0, 0.1, 0.5]), label="special"))
    if data.draw(st.booleans(), label="few distinct scores"):
        args["child_logprobs"] = -torch.randint(0, 3, (B, K, C), generator=g).float()
        args["parent_scores"] = -torch.randint(0, 2, (B, K), generator=g).float()
    first_index, first_row = data.draw(st.integers(0, 10**6)), data.draw(st.integers(0, 10**6))
    note(f"first_index {first_index}, first_row {first_row}")
    check_step(run(args, keep, backend, first_index=first_index, first_row=first_row),
               run(args, keep, "torch", first_index=first_index, first_row=first_row))
