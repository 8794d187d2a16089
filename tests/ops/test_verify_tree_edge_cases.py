"""verify_tree at the edges of its input domain, on every backend (issue 26, "no silent wrong answers").

Each test runs one batch of edge cases through the torch reference and through a kernel backend (Triton: on the GPU,
or the CPU interpreter; CUDA: GPU only) and requires the same outputs for the same seeds, and every emitted token
in ``[0, V)`` (or the request flagged). Cases: non-contiguous views of every input; temperatures down to the
smallest positive float and up to the float32 max; logits at their dtype's limits mixed with -inf; signed zeros
under greedy / top-k / top-p; tiny top_p, top_k = 1 with ties, all-equal rows, one finite entry, denormals; draft
rows with denormal or huge values; seeds and offsets past 64 bits; parameters unchecked under validate=False.
"""
import pytest
import torch

from conftest import kernel_devices
from tlt_kernels import rng, verify_tree
from tlt_kernels._backend import cuda_extension_available

DEV = kernel_devices()[0]
F32_MAX = torch.finfo(torch.float32).max
NEG = float("-inf")
KERNELS = [pytest.param("triton", marks=pytest.mark.triton), pytest.param("cuda", marks=pytest.mark.cuda)]
FIELDS = ("tokens", "num_accepted", "accepted_nodes", "error", "stats")


def _device(backend):
    if backend == "cuda" and not cuda_extension_available():
        pytest.skip("tlt_kernels._C is not built")
    return "cpu" if backend == "torch" else ("cuda" if backend == "cuda" else DEV)


def _run(backend, logits, draft_tokens, parents, **kw):
    """verify_tree on the backend's device (tensors moved there): its five walk outputs (tokens, num_accepted,
    accepted_nodes, error, stats), back on the CPU."""
    dev = _device(backend)
    move = lambda v: v.to(dev) if isinstance(v, torch.Tensor) else v  # noqa: E731
    res = verify_tree(move(logits), move(draft_tokens), move(parents), backend=backend, return_stats=True,
                      **{k: move(v) for k, v in kw.items()})
    return tuple(t.cpu() for t in res[:5])


def _assert_valid(res, V):
    """Every unflagged request emits num_accepted + 1 tokens in [0, V) then -1 padding; flagged ones emit none."""
    tokens, num, _, err, _ = res
    for b in range(tokens.shape[0]):
        row = tokens[b].tolist()
        if err[b]:
            assert all(t == -1 for t in row), f"flagged request {b} emitted {row}"
            continue
        n = int(num[b]) + 1
        assert all(0 <= t < V for t in row[:n]) and all(t == -1 for t in row[n:]), f"request {b}: tokens {row}, V={V}"


def _assert_same(ref, got, what=""):
    for name, x, y in zip(FIELDS, ref, got):
        assert torch.equal(x, y), f"{what} {name} differs:\nreference {x.tolist()}\nkernel    {y.tolist()}"


def _agree(backend, logits, draft_tokens, parents, **kw):
    """The backend's outputs equal the reference's, and both emit only valid tokens."""
    ref = _run("torch", logits, draft_tokens, parents, **kw)
    got = _run(backend, logits, draft_tokens, parents, **kw)
    _assert_valid(ref, logits.shape[-1])
    _assert_valid(got, logits.shape[-1])
    _assert_same(ref, got, backend)
    return ref


def _tree(B, T, V, gen, logits):
    """Random tree per request (parents < child), drafts that are often the parent row's argmax."""
    par = torch.full((B, T), -1, dtype=torch.int32)
    for t in range(1, T):
        par[:, t] = (torch.rand(B, generator=gen) * t).to(torch.int32)
    toks = torch.randint(0, V, (B, T), generator=gen)
    best = logits.float().argmax(-1).gather(1, par.clamp(min=0).to(torch.int64))
    return torch.where(torch.rand(B, T, generator=gen) < 0.6, best, toks), par


# ---------------------------------------------------------------------------------------------------------------
# 1. Layout: views read as the values they hold


def _problem(B=6, T=5, V=17):
    g = torch.Generator().manual_seed(5)
    lg = torch.randn(B, T, V, generator=g) * 2
    toks, par = _tree(B, T, V, g, lg)
    return dict(
        logits=lg, draft_tokens=toks, parents=par, num_nodes=torch.tensor([5, 3, 4, 5, 2, 5], dtype=torch.int32),
        draft_probs=torch.softmax(lg + torch.randn(B, T, V, generator=g), -1),
        temperature=torch.tensor([0.7, 0.0, 1.3, 2.0, 0.5, 1e-30]), top_k=torch.tensor([0, 3, 0, 5, 1, 2], dtype=torch.int32),
        top_p=torch.tensor([1.0, 0.9, 0.5, 1.0, 0.8, 0.3]), seed=torch.tensor([3, 1, 4, 1, 5, 9]) * 1000 + 7,
        offset=torch.tensor([0, 2, 7, 1, 8, 2]))


def _column(t):
    """``t`` as every other row of a wider tensor; the other rows hold another request's values."""
    return torch.stack([t, t.flip(0)], dim=1)[:, 0]


def _stride2(t):
    return torch.stack([t, t.flip(0)], dim=-1)[..., 0]


def _expanded(t):
    """A stride-0 view of t[0] over storage whose other entries are other (valid) values."""
    return torch.cat([t[:1], t.flip(0)[1:]])[:1].expand(t.shape[0])


def _views_a(kw):
    out = {k: _column(v) for k, v in kw.items()}
    out["logits"] = _stride2(kw["logits"])
    out["draft_probs"] = torch.stack([kw["draft_probs"], kw["draft_probs"].flip(0)], dim=1)[:, 0]
    return out


def _views_b(kw):
    out = dict(kw)
    out["parents"] = kw["parents"].t().contiguous().t()
    out["draft_tokens"] = kw["draft_tokens"].t().contiguous().t()
    V = kw["logits"].shape[-1]
    out["logits"] = torch.cat([kw["logits"], kw["logits"][..., :3]], -1)[..., :V]  # padded vocabulary rows
    out["draft_probs"] = kw["draft_probs"].transpose(0, 1).contiguous().transpose(0, 1)
    return out


@pytest.mark.parametrize("backend", ["torch"] + KERNELS)
def test_views_give_the_contiguous_result(backend):
    kw = _problem()
    want = _agree(backend, **kw)
    dev = _device(backend)
    on_dev = {k: v.to(dev) for k, v in kw.items()}  # views are made on the device: .to() would densify them
    for name, views in (("columns / stride-2 vocabulary", _views_a), ("column-major / padded rows", _views_b)):
        got = _run(backend, **views(on_dev))
        _assert_same(want, got, f"{backend} with {name}:")
    # Expanded (stride-0) per-request parameters hold one value for every request.
    uniform = dict(kw, temperature=torch.full((6,), 0.7), top_k=torch.full((6,), 3, dtype=torch.int32),
                   top_p=torch.full((6,), 0.8), seed=torch.full((6,), 77), offset=torch.full((6,), 2))
    want = _run(backend, **uniform)
    got = _run(backend, **{k: _expanded(v.to(dev)) if k in ("temperature", "top_k", "top_p", "seed", "offset")
                            else v.to(dev) for k, v in uniform.items()})
    _assert_same(want, got, f"{backend} with expanded parameters:")


# ---------------------------------------------------------------------------------------------------------------
# 2a. Temperatures: tiny to huge, on logits at every dtype's limits


TINY_TEMPS = [1e-37, 1.401298464324817e-45, 2.0**-126, 1e-30, 1e-7, 1e-3]
HUGE_TEMPS = [1.0, 1e30, 1e37, F32_MAX]


@pytest.mark.parametrize("backend", ["torch"] + KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_tiny_temperatures_sample_uniformly_among_the_maximal_logits(backend, dtype):
    """softmax((l - max) / T) with T -> 0 is uniform over the maximal logits (greedy would take the lowest id)."""
    big = torch.finfo(dtype).max
    row = torch.tensor([big / 2, big, -big, big, NEG, 0.0, big, 1.0], dtype=dtype)  # maxima at 1, 3, 6
    B = 4 * len(TINY_TEMPS)
    lg = row.expand(B, 1, 8).contiguous()
    par = torch.full((B, 1), -1, dtype=torch.int32)
    res = _agree(backend, lg, torch.zeros(B, 1, dtype=torch.int64), par, temperature=TINY_TEMPS * 4,
                 seed=list(range(B)))
    assert set(res[0][:, 0].tolist()) == {1, 3, 6}


@pytest.mark.parametrize("backend", ["torch"] + KERNELS)
def test_small_temperatures_on_ordinary_logits(backend):
    """Logits of tens with temperatures of 1e-4 .. 1e-9: l / T is large but finite, and a kernel that scales before
    subtracting the max (2^(l ks - M ks)) loses the max's weight to the rounding of M ks."""
    row = torch.tensor([40.0, 39.5, 40.0, 12.0, NEG, -30.0])
    temps = [1e-4, 1e-6, 1e-8, 1e-9] * 4
    B = len(temps)
    res = _agree(backend, row.expand(B, 1, 6).contiguous(), torch.zeros(B, 1, dtype=torch.int64),
                 torch.full((B, 1), -1, dtype=torch.int32), temperature=temps, seed=list(range(B)))
    assert set(res[0][:, 0].tolist()) == {0, 2}


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_logits_at_dtype_limits_any_temperature(backend, dtype):
    """Rows mixing +-max, -inf, 0 and small values; temperatures from the smallest positive float to the float32 max,
    with and without top-k / top-p / draft probabilities, trees and V = 1."""
    big = torch.finfo(dtype).max
    g = torch.Generator().manual_seed(7)
    temps = TINY_TEMPS + HUGE_TEMPS
    B, T, V = len(temps) * 2, 4, 6
    choices = torch.tensor([big, -big, big / 3, 0.0, -1.0, 2.0, NEG], dtype=torch.float32)
    lg = choices[torch.randint(0, len(choices), (B, T, V), generator=g)]
    lg[..., 0] = torch.where(torch.rand(B, T, generator=g) < 0.5, big, -big)  # a finite entry in every row
    lg = lg.to(dtype)
    toks, par = _tree(B, T, V, g, lg)
    q = torch.rand(B, T, V, generator=g) * (torch.rand(B, T, 1, generator=g) < 0.5)
    q[..., 0] += 0.1
    kw = dict(temperature=temps * 2, top_k=[0, 1, 2, 0] * (B // 4), top_p=[1.0, 1e-45, 0.5, 0.999] * (B // 4),
              seed=list(range(B)), offset=3)
    _agree(backend, lg, toks, par, **kw)
    _agree(backend, lg, toks, par, draft_probs=q.to(dtype), **kw)
    # V = 1: the only token, whatever the parameters.
    one = lg[..., :1].contiguous()
    res = _agree(backend, one, torch.zeros(B, T, dtype=torch.int64), par, **kw)
    assert (res[3] == 0).all() and ((res[0] == 0) | (res[0] == -1)).all()


# ---------------------------------------------------------------------------------------------------------------
# 2b. Signed zeros and other ties


@pytest.mark.parametrize("backend", ["torch"] + KERNELS)
def test_signed_zeros_tie_under_top_k_and_top_p(backend):
    """-0.0 == +0.0: top-k = 2 over [-0, +0, -0, +0, -1] keeps all four zeros (ties kept), as does top-p; a kernel
    keying floats by their bits would keep only the +0.0 ones and draw other tokens for the same seeds."""
    row = torch.tensor([-0.0, 0.0, -0.0, 0.0, -1.0])
    B = 16
    lg = row.expand(B, 1, 5).contiguous()
    toks, par = torch.zeros(B, 1, dtype=torch.int64), torch.full((B, 1), -1, dtype=torch.int32)
    res = _agree(backend, lg, toks, par, temperature=1.0, top_k=[2, 1, 3, 4] * 4, top_p=[1.0, 1.0, 0.3, 0.5] * 4,
                 seed=list(range(B)))
    assert {0, 2} & set(res[0][:, 0].tolist()), "no -0.0 token drawn: signed zeros are not ties"
    # Greedy ties with signed zeros: the lowest id, whichever sign it has.
    lg = torch.tensor([[[-0.0, 0.0, -1.0]], [[0.0, -0.0, -1.0]], [[-1.0, -0.0, 0.0]]])
    res = _agree(backend, lg, torch.zeros(3, 1, dtype=torch.int64), torch.full((3, 1), -1, dtype=torch.int32))
    assert res[0][:, 0].tolist() == [0, 0, 1]


@pytest.mark.parametrize("backend", ["torch"] + KERNELS)
def test_degenerate_rows(backend):
    """All-equal rows, one finite entry, denormal logits, top_k = 1 with ties, top_p at the smallest positive float,
    under greedy, tiny and ordinary temperatures, with a chain of drafts that are sometimes accepted."""
    tiny = 1.401298464324817e-45
    rows = [
        [0.5] * 6,
        [NEG, NEG, 3.0, NEG, NEG, NEG],
        [tiny, 0.0, -tiny, 2 * tiny, -0.0, 2 * tiny],
        [1.0, 2.0, 2.0, 0.0, 2.0, NEG],
        [F32_MAX, F32_MAX, -F32_MAX, NEG, 0.0, F32_MAX],
        [-3.0, -3.0, NEG, -3.0, -5.0, -3.0],
    ]
    lg = torch.tensor(rows).unsqueeze(1).expand(6, 3, 6)  # every node of a request shows its row
    params = [(0.0, 0, 1.0), (1.0, 1, 1.0), (1.0, 0, tiny), (1e-38, 0, 1.0), (tiny, 2, 0.5), (0.7, 1, 1e-30)]
    B = len(rows) * len(params)
    lg = lg.repeat(len(params), 1, 1).contiguous()
    temp, top_k, top_p = ([p[i] for p in params for _ in rows] for i in range(3))
    par = torch.tensor([[-1, 0, 1]] * B, dtype=torch.int32)
    toks = lg.argmax(-1)  # each draft is its parent row's lowest maximal token
    _agree(backend, lg, toks, par, temperature=temp, top_k=top_k, top_p=top_p, seed=list(range(B)))
    toks = torch.roll(toks, 1, dims=0)  # drafts of another request: some rejected
    _agree(backend, lg, toks, par, temperature=temp, top_k=top_k, top_p=top_p, seed=list(range(B)), offset=5)


@pytest.mark.parametrize("backend", ["torch"] + KERNELS)
def test_draft_rows_with_denormal_or_huge_values(backend):
    """Draft rows are normalized by their float32 sum: denormal and huge (finite-sum) rows are used; a row whose
    float32 sum overflows is refused by validation and flags its request with validate=False, on every backend."""
    tiny = 1.401298464324817e-45
    V, B = 5, 6
    g = torch.Generator().manual_seed(3)
    lg = torch.randn(B, 3, V, generator=g)
    par = torch.tensor([[-1, 0, 0]] * B, dtype=torch.int32)
    toks = torch.tensor([[0, 1, 2], [0, 3, 1], [0, 0, 4]] * 2)
    q = torch.full((B, 3, V), 0.2)
    q[0, 0] = torch.tensor([tiny, 0.0, 2 * tiny, tiny, 0.0])
    q[1, 0] = torch.tensor([tiny, tiny, tiny, tiny, tiny])
    q[2, 0] = torch.tensor([1e38, 5e37, 0.0, 1e38, 1e37])
    q[3, 0] = torch.tensor([F32_MAX, 0.0, 0.0, 0.0, 0.0])
    q[4, 0] = torch.tensor([F32_MAX, F32_MAX, 0.0, 0.0, 0.0])  # the float32 sum overflows
    with pytest.raises(ValueError, match=r"draft_probs\[4, 0\] sums to inf in float32"):
        verify_tree(lg, toks, par, draft_probs=q, temperature=1.0)
    kw = dict(draft_probs=q, temperature=[1.0, 0.5, 2.0, 1.0, 1.0, 0.0], seed=list(range(B)), validate=False)
    res = _agree(backend, lg, toks, par, **kw)
    assert res[3].tolist() == [0, 0, 0, 0, 1, 0]


# ---------------------------------------------------------------------------------------------------------------
# 3. Seeds, offsets and the other integer parameters


@pytest.mark.parametrize("backend", ["torch"] + KERNELS)
def test_seeds_and_offsets_are_taken_modulo_2_64(backend):
    g = torch.Generator().manual_seed(2)
    B, T, V = 4, 4, 9
    lg = torch.randn(B, T, V, generator=g)
    toks, par = _tree(B, T, V, g, lg)
    base = _run(backend, lg, toks, par, temperature=1.0, seed=[5, 2**64 - 1, 7, 2**63], offset=[3, 2**64 - 1, 0, 9])
    same = [
        dict(seed=[2**64 + 5, -1, 7 - 2**64, -(2**63)], offset=[3 + 2**64, -1, 2**65, 9]),
        dict(seed=torch.tensor([5, -1, 7, -(2**63)]), offset=torch.tensor([3, -1, 0, 9])),
    ]
    for kw in same:
        _assert_same(base, _run(backend, lg, toks, par, temperature=1.0, **kw), f"{backend} {kw}")
    assert torch.equal(rng.uniform(2**64 + 5, 2**64 + 3, 1, 0), rng.uniform(5, 3, 1, 0))
    assert torch.equal(rng.uniform(-1, 0, 2, 1), rng.uniform(2**64 - 1, 0, 2, 1))


def test_non_integer_seeds_and_top_k_are_refused():
    lg = torch.randn(2, 1, 4)
    args = (lg, torch.zeros(2, 1, dtype=torch.int64), torch.full((2, 1), -1, dtype=torch.int32))
    with pytest.raises(TypeError, match=r"seed = 1.5 is invalid: expected an integer"):
        verify_tree(*args, seed=1.5)
    with pytest.raises(TypeError, match=r"offset\[1\] = 2.0 is invalid: expected an integer"):
        verify_tree(*args, seed=1, offset=[0, 2.0])
    with pytest.raises(TypeError, match=r"top_k\[0\] = 2.5 is invalid: expected an integer"):
        verify_tree(*args, temperature=1.0, top_k=[2.5, 1])
    with pytest.raises(ValueError, match=r"temperature = 1e\+39 is invalid: expected a value in \[0, 3.40282"):
        verify_tree(*args, temperature=1e39)


@pytest.mark.parametrize("backend", ["torch"] + KERNELS)
def test_top_k_past_int32_is_off(backend):
    """top_k >= V is off; values past int32 too (an int64 tensor used to wrap: 2**32 + 1 became top-1)."""
    g = torch.Generator().manual_seed(4)
    B, T, V = 6, 3, 11
    lg = torch.randn(B, T, V, generator=g)
    toks, par = _tree(B, T, V, g, lg)
    kw = dict(temperature=1.5, seed=list(range(B)))
    off = _run(backend, lg, toks, par, **kw)
    for k in (2**40, [2**31, 2**63, 2**31 - 1, V, V + 1, 10**30], torch.full((B,), 2**32 + 1)):
        _assert_same(off, _run(backend, lg, toks, par, top_k=k, **kw), f"{backend} top_k={k}")


@pytest.mark.parametrize("backend", ["torch"] + KERNELS)
def test_float64_parameters_below_float32_range_stay_positive(backend):
    """A positive float64 temperature / top_p that rounds to 0 in float32 acts as 2**-126 (the contract's clamp):
    not greedy, not refused."""
    lg = torch.tensor([[[0.0, 3.0, 3.0, 1.0]]]).expand(8, 1, 4).contiguous()
    args = (lg, torch.zeros(8, 1, dtype=torch.int64), torch.full((8, 1), -1, dtype=torch.int32))
    kw = dict(seed=list(range(8)))
    want = _run(backend, *args, temperature=2.0**-126, top_p=2.0**-126, **kw)
    got = _run(backend, *args, temperature=torch.full((8,), 1e-300, dtype=torch.float64),
               top_p=torch.full((8,), 1e-300, dtype=torch.float64), **kw)
    _assert_same(want, got, backend)
    assert set(got[0][:, 0].tolist()) == {1, 2}
    _assert_same(want, _run(backend, *args, temperature=1e-300, top_p=1e-300, **kw), backend)


@pytest.mark.parametrize("backend", KERNELS)
def test_unvalidated_parameters_behave_alike(backend):
    """validate=False: NaN / negative temperature = greedy; top_p NaN or > 1 = off, <= 0 = the smallest top_p;
    top_k < 0 = off; +inf temperature acts as 2**126. The same on every backend."""
    g = torch.Generator().manual_seed(9)
    B, T, V = 8, 4, 7
    lg = torch.randn(B, T, V, generator=g) * 3
    toks, par = _tree(B, T, V, g, lg)
    nan, inf = float("nan"), float("inf")
    kw = dict(temperature=torch.tensor([nan, -1.0, inf, 1.0, 1.0, 1.0, 0.8, 2.0]),
              top_k=torch.tensor([0, 0, 0, -3, 0, 0, 2, 0], dtype=torch.int32),
              top_p=torch.tensor([1.0, 1.0, 1.0, 1.0, nan, 1.5, 0.0, -2.0]), seed=list(range(B)), validate=False)
    _agree(backend, lg, toks, par, **kw)


def test_unvalidated_parameters_reference_semantics():
    g = torch.Generator().manual_seed(9)
    B, T, V = 4, 4, 7
    lg = torch.randn(B, T, V, generator=g) * 3
    toks, par = _tree(B, T, V, g, lg)
    run = lambda **kw: _run("torch", lg, toks, par, seed=list(range(B)), validate=False, **kw)  # noqa: E731
    t = torch.tensor
    _assert_same(run(), run(temperature=t([float("nan"), -1.0, 0.0, -0.0])))
    _assert_same(run(temperature=1.0), run(temperature=1.0, top_p=t([float("nan"), 1.5, 1.0, 2.0]),
                                           top_k=t([-1, -5, 0, V], dtype=torch.int32)))
    _assert_same(run(temperature=2.0**126), run(temperature=t([float("inf")] * B)))
    _assert_same(run(temperature=1.0, top_p=2.0**-126), run(temperature=1.0, top_p=t([0.0, -1.0, 1e-45, 1e-40])))


def test_old_overflow_errors_are_gone():
    """seed=2**64 used to raise 'int too big to convert'; it is the seed 0 now."""
    lg = torch.randn(1, 1, 3)
    args = (lg, torch.zeros(1, 1, dtype=torch.int64), torch.full((1, 1), -1, dtype=torch.int32))
    _assert_same(_run("torch", *args, temperature=1.0, seed=2**64), _run("torch", *args, temperature=1.0, seed=0))
