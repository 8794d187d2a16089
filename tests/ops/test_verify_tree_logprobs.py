"""``verify_tree(return_logprobs=, return_raw_logprobs=)``: the log-probability of every emitted token.

Checked against an independent computation (``log_softmax`` of the scored row, in float64), on every backend, at
awkward sizes, with greedy and sampled requests mixed, top-k, flagged requests and padding; the chain of a
speculative step scores its tokens as plain decoding of the same sequence does; torch.compile and CUDA graphs."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import agreement_backends, kernel_devices, need_backend
from tlt_kernels import chain_parents, verify_tree

DEV = kernel_devices()[0]
TOL = 1e-4


def _case(B, T, V, seed, dtype=torch.float32):
    """Random logits (scaled so rows are peaked), a random tree, draft tokens half of which are their parent row's
    argmax (so walks go deep), per-request temperatures with greedy rows mixed in."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, T, V, generator=g) * 3).to(dtype)
    parents = torch.full((B, T), -1, dtype=torch.int32)
    for i in range(1, T):
        parents[:, i] = torch.randint(0, i, (B,), generator=g)
    tokens = torch.randint(0, V, (B, T), generator=g)
    argmax_of_parent = logits.float().argmax(-1).gather(1, parents.clamp(min=0).long())
    tokens = torch.where(torch.rand(B, T, generator=g) < 0.5, argmax_of_parent, tokens)
    temperature = torch.where(torch.rand(B, generator=g) < 0.3, torch.zeros(B), 0.5 + torch.rand(B, generator=g))
    return logits, tokens, parents, temperature


def _expected(logits, out, temperature, top_k=None):
    """``(sampled, raw)`` float64 ``[B, max_depth+1]`` from the definition, one emitted token at a time."""
    B, W = out.tokens.shape
    sampled, raw = torch.zeros(B, W, dtype=torch.float64), torch.zeros(B, W, dtype=torch.float64)
    for b in range(B):
        if out.error[b]:
            continue
        for j in range(int(out.num_accepted[b]) + 1):
            row = logits[b, int(out.accepted_nodes[b, j])].double().cpu()
            token = int(out.tokens[b, j])
            raw[b, j] = torch.log_softmax(row, 0)[token]
            t = float(temperature[b])
            if t > 0:
                scaled = row / t
                if top_k is not None and 0 < int(top_k[b]) < row.numel():
                    kth = row.topk(int(top_k[b])).values[-1]
                    scaled = scaled.masked_fill(row < kth, float("-inf"))
                sampled[b, j] = torch.log_softmax(scaled, 0)[token]
    return sampled, raw


def _run(backend, logits, tokens, parents, temperature, **kw):
    dev = torch.device(DEV) if backend != "torch" else torch.device("cpu")
    need_backend("verify_tree", backend, dev)
    move = lambda t: t.to(dev) if isinstance(t, torch.Tensor) else t  # noqa: E731
    out = verify_tree(move(logits), move(tokens), move(parents), temperature=move(temperature),
                      seed=torch.arange(logits.shape[0], device=dev), backend=backend, return_logprobs=True,
                      return_raw_logprobs=True, **{k: move(v) for k, v in kw.items()})
    return type(out)(*(None if t is None else t.cpu() for t in out))


@pytest.mark.parametrize("backend", agreement_backends())
@pytest.mark.parametrize("B,T,V,dtype", [(3, 5, 37, torch.float32), (7, 9, 1000, torch.bfloat16),
                                         (1, 1, 5, torch.float16), (5, 4, 130, torch.float32)])
def test_logprobs_match_log_softmax_of_the_scored_rows(backend, B, T, V, dtype):
    logits, tokens, parents, temperature = _case(B, T, V, seed=B * 100 + T, dtype=dtype)
    out = _run(backend, logits, tokens, parents, temperature)
    assert out.logprobs.dtype == torch.float32 and out.logprobs.shape == out.tokens.shape
    sampled, raw = _expected(logits, out, temperature)
    assert torch.allclose(out.logprobs.double(), sampled, atol=TOL, rtol=0)
    assert torch.allclose(out.raw_logprobs.double(), raw, atol=TOL, rtol=0)
    assert out.num_accepted.sum() > 0 or T == 1  # the case reaches past the root somewhere


@pytest.mark.parametrize("backend", agreement_backends())
def test_top_k_renormalizes_over_the_kept_tokens(backend):
    B, T, V = 6, 4, 50
    logits, tokens, parents, _ = _case(B, T, V, seed=7)
    temperature = torch.full((B,), 0.9)
    top_k = torch.tensor([0, 1, 3, 10, 49, 50], dtype=torch.int32)
    out = _run(backend, logits, tokens, parents, temperature, top_k=top_k)
    sampled, raw = _expected(logits, out, temperature, top_k=top_k)
    assert torch.allclose(out.logprobs.double(), sampled, atol=TOL, rtol=0)
    assert torch.allclose(out.raw_logprobs.double(), raw, atol=TOL, rtol=0)
    assert (out.logprobs[1, : int(out.num_accepted[1]) + 1] == 0).all()  # top-1: a point mass


@pytest.mark.parametrize("backend", agreement_backends())
@pytest.mark.parametrize("V", [50, 333])
def test_top_p_and_top_k_match_the_reference(backend, V):
    """The kernel backends' scoring (bisection thresholds in float32) against the float64 reference's, top-p and
    top-k together, greedy rows mixed in; random logits have no ties at the boundary."""
    B, T = 8, 5
    logits, tokens, parents, _ = _case(B, T, V, seed=V)
    temperature = torch.tensor([0.7, 1.0, 1.3, 0.0, 0.9, 1.0, 2.0, 0.5])
    top_p = torch.tensor([1.0, 0.9, 0.5, 0.8, 0.05, 0.99, 0.3, 0.7])
    top_k = torch.tensor([0, 0, 7, 3, 0, V - 1, 2, 1], dtype=torch.int32)
    got = _run(backend, logits, tokens, parents, temperature, top_p=top_p, top_k=top_k)
    want = verify_tree(logits, tokens, parents, temperature=temperature, top_p=top_p, top_k=top_k,
                       seed=torch.arange(B), backend="torch", return_logprobs=True, return_raw_logprobs=True)
    assert torch.equal(got.tokens, want.tokens)
    assert torch.allclose(got.logprobs, want.logprobs, atol=TOL, rtol=0)
    assert torch.allclose(got.raw_logprobs, want.raw_logprobs, atol=TOL, rtol=0)
    assert (got.logprobs[3] == 0).all()  # greedy


@pytest.mark.parametrize("backend", agreement_backends())
@pytest.mark.parametrize("top_p", [None, 0.9])
def test_rows_of_several_tiles_score_like_the_reference(backend, top_p):
    """V = 4500 spans three of the Triton walk's 2048-wide streaming tiles (the last one ragged): the raw normalizer
    it sums online next to the sampling one is rescaled whenever a later tile holds a larger logit (the rows are
    built so that the max sits in the last tile for some requests), with and without top-p."""
    B, T, V = 4, 5, 4500
    logits, tokens, parents, _ = _case(B, T, V, seed=45)
    logits[::2, :, -300:] += 4.0  # the row max in the last, ragged tile
    temperature = torch.tensor([1.0, 0.6, 0.0, 1.7])
    kw = {} if top_p is None else dict(top_p=torch.full((B,), top_p))
    got = _run(backend, logits, tokens, parents, temperature, **kw)
    want = verify_tree(logits, tokens, parents, temperature=temperature, seed=torch.arange(B), backend="torch",
                       return_logprobs=True, return_raw_logprobs=True, **kw)
    assert torch.equal(got.tokens, want.tokens)
    assert torch.allclose(got.logprobs, want.logprobs, atol=TOL, rtol=0)
    assert torch.allclose(got.raw_logprobs, want.raw_logprobs, atol=TOL, rtol=0)


@pytest.mark.parametrize("backend", agreement_backends())
def test_scoring_changes_no_decision(backend):
    """The scored walk (fused on the Triton backend) emits the same tokens, counts and stats as the unscored one."""
    logits, tokens, parents, temperature = _case(6, 7, 200, seed=11)
    plain = _run(backend, logits, tokens, parents, temperature)
    dev = torch.device(DEV) if backend != "torch" else torch.device("cpu")
    unscored = verify_tree(logits.to(dev), tokens.to(dev), parents.to(dev), temperature=temperature.to(dev),
                           seed=torch.arange(6, device=dev), backend=backend, return_stats=True)
    scored = verify_tree(logits.to(dev), tokens.to(dev), parents.to(dev), temperature=temperature.to(dev),
                         seed=torch.arange(6, device=dev), backend=backend, return_stats=True, return_logprobs=True)
    for name in ("tokens", "num_accepted", "accepted_nodes", "error", "stats"):
        assert torch.equal(getattr(unscored, name), getattr(scored, name)), name
    assert torch.equal(scored.logprobs.cpu(), plain.logprobs) and scored.raw_logprobs is None


@pytest.mark.parametrize("backend", agreement_backends())
def test_padding_and_flagged_requests_are_zero(backend):
    B, T, V = 4, 6, 40
    logits, tokens, parents, temperature = _case(B, T, V, seed=3)
    logits[2, 0, 5] = float("nan")  # request 2's root row: flagged
    out = _run(backend, logits, tokens, parents, temperature)
    assert out.error.tolist() == [0, 0, 1, 0]
    assert (out.logprobs[2] == 0).all() and (out.raw_logprobs[2] == 0).all()
    for b in (0, 1, 3):
        past = int(out.num_accepted[b]) + 1
        assert (out.logprobs[b, past:] == 0).all() and (out.raw_logprobs[b, past:] == 0).all()
        assert (out.raw_logprobs[b, :past] < 0).all()


def test_only_the_requested_outputs_come_back():
    logits, tokens, parents, temperature = _case(2, 3, 11, seed=1)
    plain = verify_tree(logits, tokens, parents, temperature=temperature, seed=torch.arange(2))
    assert plain.logprobs is None and plain.raw_logprobs is None
    raw_only = verify_tree(logits, tokens, parents, temperature=temperature, seed=torch.arange(2),
                           return_raw_logprobs=True)
    assert raw_only.logprobs is None and raw_only.raw_logprobs is not None
    assert torch.equal(raw_only.tokens, plain.tokens)  # scoring changes no decision


def test_a_speculative_chain_scores_like_plain_decoding():
    """Greedy: a chain whose drafts are each row's argmax is accepted whole; each token's log-probs equal those of
    plain decoding (a one-node tree per row) emitting the same token."""
    V, depth = 64, 5
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, depth + 1, V, generator=g) * 2
    drafts = torch.zeros(1, depth + 1, dtype=torch.int64)
    drafts[0, 1:] = logits[0, :depth].argmax(-1)
    spec = verify_tree(logits, drafts, chain_parents(1, depth + 1), return_logprobs=True, return_raw_logprobs=True)
    assert int(spec.num_accepted[0]) == depth
    for j in range(depth + 1):
        plain = verify_tree(logits[:, j:j + 1], drafts[:, :1], chain_parents(1, 1), return_logprobs=True,
                            return_raw_logprobs=True)
        assert int(plain.tokens[0, 0]) == int(spec.tokens[0, j])
        assert float(plain.raw_logprobs[0, 0]) == pytest.approx(float(spec.raw_logprobs[0, j]), abs=1e-6)
        assert float(plain.logprobs[0, 0]) == float(spec.logprobs[0, j]) == 0.0  # greedy: a point mass


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(B=st.integers(1, 6), T=st.integers(1, 7), V=st.integers(2, 80), seed=st.integers(0, 2**16),
       temp=st.floats(0.05, 4.0))
def test_logprob_invariants_property(B, T, V, seed, temp):
    """Any shape and temperature: emitted tokens score finite values <= 0, exp of the raw scores is a probability,
    padding is 0, and the sampled scores are log_softmax(row / T) at the token."""
    logits, tokens, parents, _ = _case(B, T, V, seed)
    temperature = torch.full((B,), temp)
    out = verify_tree(logits, tokens, parents, temperature=temperature, seed=torch.arange(B), return_logprobs=True,
                      return_raw_logprobs=True, backend="torch")
    emitted = torch.arange(T).unsqueeze(0) <= out.num_accepted.unsqueeze(1).long()
    assert torch.isfinite(out.logprobs).all() and (out.logprobs <= 0).all() and (out.raw_logprobs <= 0).all()
    assert (out.logprobs[~emitted] == 0).all() and (out.raw_logprobs[~emitted] == 0).all()
    sampled, raw = _expected(logits, out, temperature)
    assert torch.allclose(out.logprobs.double(), sampled, atol=TOL, rtol=0)
    assert torch.allclose(out.raw_logprobs.double(), raw, atol=TOL, rtol=0)


@pytest.mark.parametrize("backend", [pytest.param("torch", id="torch"),
                                     pytest.param("triton", marks=pytest.mark.triton, id="triton")])
def test_logprobs_under_torch_compile(backend):
    dev = torch.device(DEV) if backend != "torch" else torch.device("cpu")
    need_backend("verify_tree", backend, dev)
    logits, tokens, parents, temperature = (t.to(dev) for t in _case(3, 4, 29, seed=5))
    seeds = torch.arange(3, device=dev)
    kw = dict(temperature=temperature, validate=False, backend=backend, return_logprobs=True,
              return_raw_logprobs=True)
    eager = verify_tree(logits, tokens, parents, seed=seeds, **kw)
    torch._dynamo.reset()
    compiled = torch.compile(lambda l, s: verify_tree(l, tokens, parents, seed=s, **kw), backend="eager")
    got = compiled(logits, seeds)
    assert torch.equal(got.tokens, eager.tokens)
    assert torch.equal(got.logprobs, eager.logprobs) and torch.equal(got.raw_logprobs, eager.raw_logprobs)


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_logprobs_in_a_cuda_graph(backend):
    """No host sync: the scoring is captured with the walk (fused on Triton, after it on CUDA) and replays with new
    logits."""
    need_backend("verify_tree", backend, torch.device("cuda"))
    logits, tokens, parents, temperature = (t.cuda() for t in _case(4, 5, 300, seed=9))
    kw = dict(temperature=temperature, seed=torch.arange(4, device="cuda"), validate=False, backend=backend,
              return_logprobs=True, return_raw_logprobs=True)
    static = logits.clone()
    verify_tree(static, tokens, parents, **kw)  # warm-up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = verify_tree(static, tokens, parents, **kw)
    static.copy_(logits * 0.5)
    graph.replay()
    want = verify_tree(logits * 0.5, tokens, parents, **kw)
    assert torch.equal(out.tokens, want.tokens)
    assert torch.allclose(out.logprobs, want.logprobs) and torch.allclose(out.raw_logprobs, want.raw_logprobs)


_COMPILE_SM90 = r"""
from tlt_kernels._triton import path_logprobs as m

for logits in ("*bf16", "*fp32", "*fp16"):
    for flags in ((True, True, True), (False, False, False), (True, False, True)):
        consts = dict(HAS_TEMP=flags[0], HAS_TOPK=flags[1], HAS_TOPP=flags[2], BLOCK=4096)
        types = [logits, "*i32", "*i32", "*i32", "*i32", "*fp32", "*i32", "*fp32", "*fp32", "*fp32"] + ["i64"] * 5 + ["i32"]
        compile_sm90(m._path_logprobs_kernel, types, consts, 4)
"""


@pytest.mark.slow
def test_scoring_kernel_compiles_for_sm90():
    """The interpreter accepts code the compiler rejects: compile the scoring kernel for sm_90."""
    from conftest import compile_for_sm90

    compile_for_sm90(_COMPILE_SM90)
