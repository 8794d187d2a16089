"""``verify_tree(return_logprobs=, return_raw_logprobs=)``: the log-probability of every emitted token.

Checked against an independent computation (``log_softmax`` of the scored row, in float64), on every backend, at
awkward sizes, with greedy and sampled requests mixed, top-k, flagged requests and padding; the chain of a
speculative step scores its tokens as plain decoding of the same sequence does; torch.compile and CUDA graphs. The
CUDA backend's fused scoring (``verify_tree_cuda.scored``) also at every cluster size, on flagged requests, at any
output width and on poisoned buffers."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import agreement_backends, kernel_devices, need_backend, poison_
from tlt_kernels import chain_parents, verify_tree
from tlt_kernels.reference.verify_tree import path_logprobs

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
@pytest.mark.parametrize("V", [37, 5000])
def test_temperature_one_scores_raw_and_sampled_alike(backend, V):
    """At temperature exactly 1 with no filter the sampling law is the raw one, so both log-probs agree: the same bits
    on the reference and Triton (which takes the raw normalizer from the sampling sum there), within float32 rounding
    on CUDA (the same normalizer, but its two score expressions compile to different instruction sequences: 1-ulp
    differences seen on an H200); with top-p the raw one stays unfiltered."""
    B, T = 6, 5
    logits, tokens, parents, _ = _case(B, T, V, seed=V)
    ones = torch.ones(B)
    out = _run(backend, logits, tokens, parents, ones)
    sampled, raw = _expected(logits, out, ones)
    if backend == "cuda":
        torch.testing.assert_close(out.logprobs, out.raw_logprobs, rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(out.logprobs, out.raw_logprobs)
    assert torch.allclose(out.raw_logprobs.double(), raw, atol=TOL, rtol=0) and torch.equal(sampled, raw)
    cut = _run(backend, logits, tokens, parents, ones, top_p=torch.full((B,), 0.5))
    _, raw_cut = _expected(logits, cut, ones)
    assert torch.allclose(cut.raw_logprobs.double(), raw_cut, atol=TOL, rtol=0)
    assert (cut.logprobs > cut.raw_logprobs + 1e-3).any()  # renormalized over the kept half: a higher log-prob


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
    """The scored walk (fused on the Triton and CUDA backends) emits the same tokens, counts and stats as the unscored
    one."""
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


@pytest.mark.parametrize("backend", agreement_backends())
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
    """No host sync: the scoring is captured with the walk (fused into it on both kernel backends) and replays with
    new logits."""
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


# ---------------------------------------------------------------------------------------------
# CUDA backend: the walk scores its own tokens (tlt_kernels._cuda.verify_tree: verify_tree_cuda.scored)
# ---------------------------------------------------------------------------------------------

def test_cuda_scored_op_registers_with_its_fake():
    """CPU: the CUDA backend has a scored entry point, a torch.library op of its own whose fake gives six outputs, the
    scores ``float32 [B, max_depth+1, 2]``, on fake tensors and on meta tensors; it is the op's log-prob path."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tlt_kernels._cuda.verify_tree import verify_tree_cuda, verify_tree_cuda_scored

    assert verify_tree_cuda.scored is verify_tree_cuda_scored and verify_tree_cuda_scored.op is not verify_tree_cuda.op
    B, T, V, D = 3, 6, 11, 4

    def call(dev, stats):
        i32 = lambda *s: torch.empty(s, dtype=torch.int32, device=dev)  # noqa: E731
        i64 = lambda *s: torch.empty(s, dtype=torch.int64, device=dev)  # noqa: E731
        return torch.ops.tlt.verify_tree_cuda_scored(torch.empty(B, T, V, device=dev, dtype=torch.bfloat16), i64(B, T),
                                                     i32(B, T), i32(B), None, torch.empty(B, device=dev), None, None,
                                                     i64(B), i64(B), D, stats)

    with FakeTensorMode():
        fake = call("cpu", True)
    for out, stats_rows in ((fake, D), (call("meta", False), 0)):
        assert [tuple(t.shape) for t in out] == [(B, D + 1), (B,), (B, D + 1), (B,), (B, stats_rows, 2), (B, D + 1, 2)]
        assert [t.dtype for t in out] == [torch.int32] * 5 + [torch.float32]


def _cuda_kw(rule, B, g):
    """Per-request sampling tensors of a rule (``None`` where off), in the op's dtypes."""
    temp = torch.rand(B, generator=g) * 1.5 + 0.1
    if rule == "greedy":
        return dict(temperature=None, top_k=None, top_p=None)
    if rule == "temp1":  # temperature exactly 1 (the raw normalizer is the sampling one), greedy rows mixed in
        return dict(temperature=torch.where(torch.arange(B) % 3 == 0, torch.zeros(B), torch.ones(B)), top_k=None,
                    top_p=None)
    if rule == "topp":
        return dict(temperature=temp, top_k=None, top_p=torch.rand(B, generator=g) * 0.9 + 0.05)
    if rule == "mixed":  # greedy rows, top-k, top-p, both, neither
        temp[::3] = 0.0
        return dict(temperature=temp, top_k=torch.randint(0, 8, (B,), generator=g, dtype=torch.int32),
                    top_p=torch.where(torch.rand(B, generator=g) < 0.5, torch.ones(B), torch.rand(B, generator=g) * 0.8 + 0.2))
    if rule == "topk-topp":
        return dict(temperature=temp, top_k=torch.randint(0, 40, (B,), generator=g, dtype=torch.int32),
                    top_p=torch.rand(B, generator=g) * 0.9 + 0.1)
    raise KeyError(rule)


def _poisoned_scores(monkeypatch):
    """Makes the scored launch allocate NaN-filled score buffers, so an element the kernel leaves unwritten shows up."""
    from tlt_kernels.reference import verify_tree as ref

    real = ref.empty_verify_scores
    monkeypatch.setattr(ref, "empty_verify_scores", lambda *a: poison_(real(*a)))


def _no_scoring_pass(monkeypatch):
    """Fails a test if the op scores after the walk instead of taking the CUDA walk's fused scores."""
    from tlt_kernels.ops import verify_tree as op

    def fail(*a, **k):
        raise AssertionError("the CUDA backend must score in the walk (verify_tree_cuda.scored)")

    monkeypatch.setattr(op, "path_logprobs", fail)  # the pass after the walk, for a walk that does not score


def _check_cuda_scores(logits, out, kw, label, tol=TOL):
    """``out`` (CUDA, scored) against the float64 reference's scores of the same tokens (:func:`path_logprobs`);
    exactly 0 past each request's final token and on flagged requests."""
    out = type(out)(*(None if t is None else t.cpu() for t in out))
    temp, k, tp = (None if kw.get(n) is None else kw[n].cpu() for n in ("temperature", "top_k", "top_p"))
    want_s, want_r = path_logprobs(logits.cpu(), out, temp, k, tp, sampled=True, raw=True)
    for name, got, want in (("logprobs", out.logprobs, want_s), ("raw_logprobs", out.raw_logprobs, want_r)):
        assert got.dtype == torch.float32 and got.shape == out.tokens.shape, name
        assert torch.isfinite(got).all(), f"{label}: {name} not finite (unwritten?): {got}"
        err = (got.double() - want.double()).abs()
        assert err.max() <= tol, f"{label}: {name} off by {err.max().item():.3g} at {divmod(int(err.argmax()), got.shape[1])}"
        past = torch.arange(got.shape[1]).unsqueeze(0) > out.num_accepted.unsqueeze(1).long()
        assert (got[past | out.error.bool().unsqueeze(1)] == 0).all(), f"{label}: {name} not 0 past the path"


CUDA_SCORED_CASES = [
    # (rule, draft-probability dtype or None, V, T, B, logits dtype): odd V (unaligned rows), slices of several
    # 2048-token chunks; fp32 or no draft rows with top-p run the candidate-top-p instantiations too
    ("mixed", torch.float32, 4099, 13, 9, torch.bfloat16),
    ("temp1", None, 20011, 9, 5, torch.float32),
    ("topk-topp", torch.float16, 32003, 9, 7, torch.float16),
    ("greedy", None, 5, 6, 11, torch.float32),  # most slices of a cluster empty
    ("topp", torch.bfloat16, 8191, 7, 3, torch.bfloat16),
    ("topp", None, 30011, 5, 4, torch.float32),
]


@pytest.mark.cuda
@pytest.mark.parametrize("rule,q_dtype,V,T,B,dtype", CUDA_SCORED_CASES)
@pytest.mark.parametrize("cluster", [0, 1, 2, 4, 8, 16])
@pytest.mark.parametrize("parallel", [False, True], ids=["visited-rows", "parallel-rows"])
def test_cuda_scored_walk_matches_the_reference(monkeypatch, rule, q_dtype, V, T, B, dtype, cluster, parallel):
    """The CUDA walk's fused scores against the float64 reference's of the same tokens, at every cluster size (the
    raw normalizer folded over 1 to 16 CTAs; 0 = the launcher's choice), greedy / temperature-1 / top-k / top-p rows,
    fp32 / fp16 / bf16 logits and draft rows (rejections, then later children accepted), the top-p threshold over
    the full row and over compacted candidates; every element written (poisoned buffers); the plain outputs are the
    same bits with scoring on and off; reruns are identical."""
    need_backend("verify_tree", "cuda", torch.device("cuda"))
    from cuda_cases import verify_inputs
    from tlt_kernels._cuda import verify_tree as cv

    lg, toks, par, n, q = verify_inputs(B, T, V, seed=V + T, use_q=q_dtype is not None, dtype=dtype, q_dtype=q_dtype)
    sampling = _cuda_kw(rule, B, torch.Generator().manual_seed(V))
    kw = {k: v.cuda() for k, v in dict(num_nodes=n, draft_probs=q, seed=torch.arange(B) * 7 + 1,
                                       offset=torch.arange(B) + 2**33, **sampling).items() if v is not None}
    args = (lg.cuda(), toks.cuda(), par.cuda())
    monkeypatch.setattr(cv, "CLUSTER_SIZE", cluster)
    monkeypatch.setattr(cv, "PARALLEL_ROWS", parallel)  # the scores from the rows kernel's statistics too
    _poisoned_scores(monkeypatch)
    _no_scoring_pass(monkeypatch)
    for compact in ((False, True) if "top_p" in kw else (True,)):
        monkeypatch.setattr(cv, "TOPP_COMPACT", compact)
        label = f"scored[{rule} q={q_dtype} V={V} {dtype} C={cluster} compact={compact}]"
        plain = verify_tree(*args, backend="cuda", return_stats=True, **kw)
        got = verify_tree(*args, backend="cuda", return_stats=True, return_logprobs=True, return_raw_logprobs=True, **kw)
        for name in ("tokens", "num_accepted", "accepted_nodes", "error", "stats"):
            assert torch.equal(getattr(plain, name), getattr(got, name)), f"{label}: {name} changed by scoring"
        _check_cuda_scores(lg, got, kw, label)
        again = verify_tree(*args, backend="cuda", return_logprobs=True, return_raw_logprobs=True, **kw)
        assert torch.equal(again.logprobs, got.logprobs) and torch.equal(again.raw_logprobs, got.raw_logprobs), label
        assert (got.num_accepted > 0).any() or T == 1, label


@pytest.mark.cuda
@pytest.mark.parametrize("cluster", [1, 4])
@pytest.mark.parametrize("parallel", [False, True], ids=["visited-rows", "parallel-rows"])
def test_cuda_scores_of_flagged_requests_are_zero(monkeypatch, cluster, parallel):
    """Requests flagged after accepting drafts (a NaN in a row deeper on the path; a draft token outside the
    vocabulary tried after an accept, validate=False): the pairs written at their accepts are reset to 0 with the
    rest of their outputs; the other requests keep reference scores."""
    need_backend("verify_tree", "cuda", torch.device("cuda"))
    from tlt_kernels._cuda import verify_tree as cv

    monkeypatch.setattr(cv, "CLUSTER_SIZE", cluster)
    monkeypatch.setattr(cv, "PARALLEL_ROWS", parallel)
    _poisoned_scores(monkeypatch)
    B, T, V = 4, 5, 9001
    g = torch.Generator().manual_seed(4)
    lg = torch.randn(B, T, V, generator=g)
    peak = torch.randint(0, V, (B, T), generator=g)
    lg.scatter_(2, peak.unsqueeze(2), 30.0)  # peaked rows: each chain draft below is accepted (p ~ 1)
    toks = torch.zeros(B, T, dtype=torch.int64)
    toks[:, 1:] = peak[:, :-1]
    lg[1, 2, 7] = float("nan")  # request 1: visited after two accepts
    toks[2, 3] = V + 5  # request 2: tried after two accepts
    kw = dict(temperature=torch.tensor([0.0, 0.7, 0.0, 1.3]).cuda(), seed=torch.arange(B).cuda())
    out = verify_tree(lg.cuda(), toks.cuda(), chain_parents(B, T).cuda(), backend="cuda", validate=False,
                      return_logprobs=True, return_raw_logprobs=True, **kw)
    assert out.error.tolist() == [0, 1, 1, 0]
    assert (out.logprobs[1:3] == 0).all() and (out.raw_logprobs[1:3] == 0).all()
    assert out.num_accepted[[0, 3]].tolist() == [T - 1, T - 1]
    _check_cuda_scores(lg, out, kw, f"flagged C={cluster}")


@pytest.mark.cuda
@pytest.mark.parametrize("max_depth", [0, 2, 6, 11])
def test_cuda_scores_fill_any_width(monkeypatch, max_depth):
    """Output widths below, at and past the tree's depth (max_depth + 1 columns; beyond T - 1 the kernel's staged
    path stops at T - 1): every column written, 0 past the final token."""
    need_backend("verify_tree", "cuda", torch.device("cuda"))
    from cuda_cases import verify_inputs

    _poisoned_scores(monkeypatch)
    B, T, V = 6, 7, 999
    lg, toks, par, n, q = verify_inputs(B, T, V, seed=max_depth, use_q=True)
    par[0, 1:] = torch.arange(T - 1, dtype=torch.int32)  # a chain: deep walks
    kw = dict(num_nodes=n.cuda(), draft_probs=q.cuda(), temperature=torch.full((B,), 0.8).cuda(),
              seed=torch.arange(B).cuda())
    # validate=False: trees deeper than max_depth are legal to the kernel (the walk stops there).
    out = verify_tree(lg.cuda(), toks.cuda(), par.cuda(), backend="cuda", max_depth=max_depth, validate=False,
                      return_logprobs=True, return_raw_logprobs=True, **kw)
    assert out.logprobs.shape == (B, max_depth + 1)
    _check_cuda_scores(lg, out, kw, f"max_depth={max_depth}")


@pytest.mark.cuda
@pytest.mark.parametrize("cluster", [1, 4])
def test_cuda_scores_of_deep_unstaged_trees(monkeypatch, cluster):
    """T = 2100 (past the kernel's shared-memory staging of the tree) with a 2099-draft chain accepted whole: a pair
    per depth, written at each accept."""
    need_backend("verify_tree", "cuda", torch.device("cuda"))
    from tlt_kernels._cuda import verify_tree as cv

    monkeypatch.setattr(cv, "CLUSTER_SIZE", cluster)
    B, T, V = 2, 2100, 23
    g = torch.Generator().manual_seed(8)
    lg = torch.randn(B, T, V, generator=g) * 3
    toks = torch.zeros(B, T, dtype=torch.int64)
    toks[:, 1:] = lg[:, :-1].argmax(-1)
    kw = dict(temperature=torch.tensor([0.0, 1.0]).cuda(), top_k=torch.tensor([0, 1], dtype=torch.int32).cuda(),
              seed=torch.arange(B).cuda())
    out = verify_tree(lg.cuda(), toks.cuda(), chain_parents(B, T).cuda(), backend="cuda", return_logprobs=True,
                      return_raw_logprobs=True, **kw)
    assert out.num_accepted.tolist() == [T - 1, T - 1]  # greedy, and top-1 (a point mass at the argmax)
    _check_cuda_scores(lg, out, kw, f"T={T} C={cluster}")


@pytest.mark.cuda
def test_cuda_scores_of_huge_logits():
    """Rows whose maximum is at least 2**102 (the weights' halved exponent, so that x - max stays finite): equal
    logits of 2**110 score -ln V under both laws (0 sampled for greedy requests); one row also holds -2**110."""
    need_backend("verify_tree", "cuda", torch.device("cuda"))
    B, T, V = 3, 2, 4099
    lg = torch.full((B, T, V), 2.0**110)
    lg[2, :, :1000] = -(2.0**110)  # their weights underflow: uniform over the other V - 1000
    toks = torch.zeros(B, T, dtype=torch.int64)
    toks[2, 1] = 2000
    kw = dict(temperature=torch.tensor([0.0, 0.9, 2.0]).cuda(), seed=torch.arange(B).cuda())
    out = verify_tree(lg.cuda(), toks.cuda(), chain_parents(B, T).cuda(), backend="cuda", return_logprobs=True,
                      return_raw_logprobs=True, **kw)
    _check_cuda_scores(lg, out, kw, "huge logits")
    live = torch.tensor([V, V, V - 1000], dtype=torch.float64).log().neg()
    assert torch.allclose(out.raw_logprobs[:, 0].cpu().double(), live, atol=TOL, rtol=0)


@pytest.mark.cuda
@pytest.mark.parametrize("cluster", [2, 16])
@pytest.mark.parametrize("parallel", [False, True], ids=["visited-rows", "parallel-rows"])
def test_cuda_scored_walk_in_a_cuda_graph(monkeypatch, cluster, parallel):
    """The scored cluster kernel captured in a CUDA graph: replays with new logits give the eager call's bits."""
    need_backend("verify_tree", "cuda", torch.device("cuda"))
    from cuda_cases import verify_inputs
    from tlt_kernels._cuda import verify_tree as cv

    monkeypatch.setattr(cv, "CLUSTER_SIZE", cluster)
    monkeypatch.setattr(cv, "PARALLEL_ROWS", parallel)
    B, T, V = 5, 9, 12347
    lg, toks, par, n, q = (t.cuda() for t in verify_inputs(B, T, V, seed=21, use_q=True, dtype=torch.bfloat16,
                                                            q_dtype=torch.bfloat16))
    kw = dict(num_nodes=n, draft_probs=q, temperature=torch.tensor([0.8, 0.0, 1.0, 1.2, 0.5]).cuda(), top_k=40,
              top_p=0.9, seed=torch.arange(B).cuda(), validate=False, backend="cuda", return_logprobs=True,
              return_raw_logprobs=True)
    static = lg.clone()
    verify_tree(static, toks, par, **kw)  # warm-up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = verify_tree(static, toks, par, **kw)
    for scale in (0.5, 1.5):
        static.copy_(lg * scale)
        graph.replay()
        want = verify_tree(lg * scale, toks, par, **kw)
        for name in ("tokens", "num_accepted", "logprobs", "raw_logprobs"):
            assert torch.equal(getattr(out, name), getattr(want, name)), f"C={cluster} x{scale}: {name}"


def test_cuda_launcher_takes_a_scores_pointer():
    """CPU, with the extension built: ``_C.verify_tree`` takes ``scores`` (0 = the plain kernel) and checks the
    other pointers before any CUDA call either way."""
    from cuda_cases import ext_or_skip

    ext = ext_or_skip()
    args = dict(logits=0, draft_probs=0, draft_tokens=0, parents=0, num_nodes=0, temperature=0, top_k=0, top_p=0,
                seed=0, offset=0, scratch=0, out_tokens=0, out_num=0, out_nodes=0, out_error=0, out_stats=0,
                logits_stride_b=0, logits_stride_t=0, q_stride_b=0, q_stride_t=0, tokens_stride_b=0,
                parents_stride_b=0, batch=1, num_tree=3, vocab=5, max_depth=2, tokens_int64=True, logits_dtype=0,
                q_dtype=0, stream=0)
    for scores in (0, 4096):
        with pytest.raises(ValueError, match="device pointers"):
            ext.verify_tree(**args, scores=scores)
        ext.verify_tree(**{**args, "batch": 0}, scores=scores)  # nothing to do: no launch
