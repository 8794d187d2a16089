"""verify_chain_block: block verification of draft chains (Sun et al., ICLR 2025).

The law tests enumerate every draft chain of a tiny vocabulary with its draft probability and the rule's stopping
law, so the output distribution is exact; the Monte Carlo tests then check that the op (not the formulas) draws
from it. Token-by-token verification's expected length comes from the same enumeration (and is checked against
verify_tree's chain rule by sampling).
"""
import itertools
import math
from collections import Counter

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from scipy import stats as sstats

from conftest import agreement_backends
from strategies import backend_params, budget, relayout
from tlt_kernels import chain_parents, verify_chain_block, verify_tree
from tlt_kernels.reference.sampling import target_probs

BACKENDS = [p for p in agreement_backends() if p.id != "cuda"]


def _run(backend, *args, **kw):
    """The op on ``backend``: kernel backends get every tensor on the GPU where there is one (CPU tensors run in the
    interpreter); the outputs come back on the CPU."""
    dev = "cuda" if backend != "torch" and torch.cuda.is_available() else "cpu"
    move = lambda v: v.to(dev) if isinstance(v, torch.Tensor) else v  # noqa: E731
    out = verify_chain_block(*map(move, args), backend=backend, **{k: move(v) for k, v in kw.items()})
    return type(out)(*(t.cpu() for t in out))
TEMP = 0.8  # the law tests' temperature (any positive value works; 1 would hide a missing division)


# ----------------------------------------------------------------------------------------------- problems
def _chain_tables(V, gamma, seed, closeness=1.0):
    """Context-dependent target logits and draft rows for every prefix: ``(logits[j] [V**j, V], q[j] [V**j, V])``
    for ``j = 0 .. gamma`` (``q[gamma]`` unused); prefix ``x_1 .. x_j`` has code ``sum x_i V**(j-i)``. The draft
    is the target blurred by noise (``closeness`` scales the agreement)."""
    g = torch.Generator().manual_seed(seed)
    logits, q = [], []
    for j in range(gamma + 1):
        lg = torch.randn(V**j, V, generator=g, dtype=torch.float64) * 1.5
        noise = torch.randn(V**j, V, generator=g, dtype=torch.float64)
        logits.append(lg)
        q.append(torch.softmax(closeness * lg / TEMP + 1.2 * noise, -1))
    return logits, q


def _target(logits_row):
    return target_probs(logits_row.unsqueeze(0), torch.tensor([TEMP]))[0].tolist()


def _weight(w, px, qx):
    num = w * px
    return 0.0 if num <= 0 else (1.0 if num >= qx else num / qx)


def _exact_law(logits, q, V, gamma, stop_at_weight=False):
    """``({emitted tuple: probability}, {tau: probability})`` of the draft process + block verification, by
    enumeration of every draft chain (its probability under q) and the rule's stopping law on it.
    ``stop_at_weight``: a wrong rule (``h_i = w_i`` everywhere), the negative control."""
    law, taus = Counter(), Counter()
    P = {}
    for j in range(gamma + 1):
        for code in range(V**j):
            P[j, code] = _target(logits[j][code])
    for xs in itertools.product(range(V), repeat=gamma):
        codes = [sum(x * V ** (k - 1 - i) for i, x in enumerate(xs[:k])) for k in range(gamma + 1)]
        qs = [q[k][codes[k]].tolist() for k in range(gamma)]
        prob = math.prod(qs[k][xs[k]] for k in range(gamma))
        w = [1.0]
        for k in range(gamma):
            w.append(_weight(w[-1], P[k, codes[k]][xs[k]], qs[k][xs[k]]))
        residual = [[max(w[k] * P[k, codes[k]][y] - qs[k][y], 0.0) for y in range(V)] for k in range(gamma)]
        h = [1.0] + [sum(residual[k]) / (sum(residual[k]) + 1 - w[k]) if sum(residual[k]) + 1 - w[k] > 0 else 1.0
                     for k in range(1, gamma)] + [w[gamma]]
        if stop_at_weight:
            h = [1.0] + w[1:]
        for tau in range(gamma + 1):
            p_tau = h[tau] * math.prod(1 - h[j] for j in range(tau + 1, gamma + 1))
            final = P[gamma, codes[gamma]] if tau == gamma else residual[tau]
            if tau < gamma and sum(final) <= 0:
                final = P[tau, codes[tau]]
            total = sum(final)
            taus[tau] += prob * p_tau
            for y in range(V):
                law[xs[:tau] + (y,)] += prob * p_tau * final[y] / total
    return law, taus


def _completed_law(law, logits, V, gamma):
    """The law of the emitted tokens continued by the target to gamma + 1 tokens."""
    out = Counter()
    frontier = Counter(law)
    while frontier:
        seq, prob = frontier.popitem()
        if len(seq) == gamma + 1:
            out[seq] += prob
            continue
        code = sum(x * V ** (len(seq) - 1 - i) for i, x in enumerate(seq))
        for y, py in enumerate(_target(logits[len(seq)][code])):
            frontier[seq + (y,)] += prob * py
    return out


def _target_joint(logits, V, gamma):
    out = {}
    for seq in itertools.product(range(V), repeat=gamma + 1):
        prob = 1.0
        for k in range(gamma + 1):
            code = sum(x * V ** (k - 1 - i) for i, x in enumerate(seq[:k]))
            prob *= _target(logits[k][code])[seq[k]]
        out[seq] = prob
    return out


def _token_by_token_mean(logits, q, V, gamma):
    """Exact expected accepted length of token-by-token verification: sum_k P(drafts 1..k accepted)."""
    total = 0.0
    for k in range(1, gamma + 1):
        for xs in itertools.product(range(V), repeat=k):
            prob = 1.0
            for j in range(k):
                code = sum(x * V ** (j - 1 - i) for i, x in enumerate(xs[:j]))
                prob *= min(q[j][code][xs[j]].item(), _target(logits[j][code])[xs[j]])
            total += prob
    return total


def _draw_chains(logits, q, V, gamma, N, seed):
    """N draft chains sampled from q: ``(logits [N, gamma+1, V], drafts [N, gamma], draft_probs [N, gamma, V])``."""
    g = torch.Generator().manual_seed(seed)
    code = torch.zeros(N, dtype=torch.int64)
    rows_l, rows_q, drafts = [], [], []
    for j in range(gamma + 1):
        rows_l.append(logits[j][code])
        if j == gamma:
            break
        rows_q.append(q[j][code])
        x = torch.multinomial(rows_q[-1], 1, generator=g).squeeze(1)
        drafts.append(x)
        code = code * V + x
    return (torch.stack(rows_l, 1).float(), torch.stack(drafts, 1), torch.stack(rows_q, 1).float())


def _random_problem(B, gamma, V, seed, dtype=torch.float32, greedy_every=3):
    """A batch with realistic acceptance: drafts sampled from a blurred target; ragged num_drafts (0 included)."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, gamma + 1, V, generator=g) * 2).to(dtype)
    q = torch.softmax(logits[:, :gamma].float() + 0.7 * torch.randn(B, gamma, V, generator=g), -1)
    drafts = torch.multinomial(q.reshape(-1, V), 1, generator=g).reshape(B, gamma) if gamma else \
        torch.zeros(B, 0, dtype=torch.int64)
    n = torch.randint(0, gamma + 1, (B,), generator=g, dtype=torch.int32)
    temp = torch.rand(B, generator=g) * 1.5 + 0.1
    temp[::greedy_every] = 0.0
    return logits, drafts, q.to(dtype), n, temp


def _check_invariants(out, drafts, n):
    B, width = out.tokens.shape
    tau = out.num_accepted.long()
    assert out.tokens.dtype == torch.int64 and out.num_accepted.dtype == torch.int32
    assert ((tau >= 0) & (tau <= n.long())).all()
    cols = torch.arange(width).unsqueeze(0)
    kept = cols < tau.unsqueeze(1)
    padded = torch.nn.functional.pad(drafts, (0, 1), value=-1)
    assert torch.equal(out.tokens[kept], padded[kept])
    assert (out.tokens[cols > tau.unsqueeze(1)] == -1).all()
    assert (out.tokens.gather(1, tau.unsqueeze(1)) >= 0).all()


# ----------------------------------------------------------------------------------------------- (1) exact law
@pytest.mark.parametrize("V,gamma,seed", [(3, 2, 0), (4, 3, 1), (5, 2, 2), (3, 3, 3)])
def test_enumerated_law_is_the_target_law(V, gamma, seed):
    """Summed over every draft chain, the emitted tokens continued by the target have the target's joint law."""
    logits, q = _chain_tables(V, gamma, seed)
    law, _ = _exact_law(logits, q, V, gamma)
    assert abs(sum(law.values()) - 1) < 1e-12
    completed, target = _completed_law(law, logits, V, gamma), _target_joint(logits, V, gamma)
    assert max(abs(completed[s] - target[s]) for s in target) < 1e-12
    # The check has teeth: stopping with probability w_i instead of h_i is not lossless.
    wrong = _completed_law(_exact_law(logits, q, V, gamma, stop_at_weight=True)[0], logits, V, gamma)
    assert max(abs(wrong[s] - target[s]) for s in target) > 1e-3


def _chi_square(counts, law, N):
    """``(p-value, max |frequency - probability|)`` over the outcomes (expected counts below 5 pooled)."""
    keys = sorted(set(law) | set(counts))
    big = [k for k in keys if law.get(k, 0) * N >= 5]
    obs = [counts.get(k, 0) for k in big] + [sum(counts.get(k, 0) for k in keys if k not in big)]
    exp = [law[k] * N for k in big] + [sum(law.get(k, 0) for k in keys if k not in big) * N]
    if exp[-1] == 0:
        assert obs[-1] == 0, "an outcome of probability 0 was emitted"
        obs, exp = obs[:-1], exp[:-1]
    dev = max(abs(counts.get(k, 0) / N - law.get(k, 0)) for k in keys)
    return sstats.chisquare(obs, [e * sum(obs) / sum(exp) for e in exp]).pvalue, dev


@pytest.mark.parametrize("V,gamma,seed", [(3, 3, 10), (5, 2, 11)])
def test_sampled_law_matches_enumeration(V, gamma, seed):
    """200k seeded draws through the torch op: each emitted sequence's frequency matches the enumerated law
    (standard error <= 1.2e-3 per outcome, so a 1% absolute bias is >= 8 sigma), and so does the accepted length."""
    N = 200_000
    logits, q = _chain_tables(V, gamma, seed)
    law, taus = _exact_law(logits, q, V, gamma)
    lg, drafts, probs = _draw_chains(logits, q, V, gamma, N, seed)
    out = verify_chain_block(lg, drafts, probs, temperature=TEMP, seed=torch.arange(N) * 7919 + seed, offset=3,
                             backend="torch")
    tau = out.num_accepted.tolist()
    rows = out.tokens.tolist()
    counts = Counter(tuple(r[:t + 1]) for r, t in zip(rows, tau))
    pvalue, dev = _chi_square(counts, law, N)
    print(f"V={V} gamma={gamma}: {len(law)} outcomes, chi-square p={pvalue:.3g}, max |freq - P| = {dev:.2e}")
    assert pvalue > 1e-4, (pvalue, dev)
    assert dev < 0.004, dev
    tau_p, tau_dev = _chi_square(Counter(tau), taus, N)
    assert tau_p > 1e-4, (tau_p, tau_dev)


@pytest.mark.parametrize("backend", BACKENDS)
def test_law_inputs_agree_across_backends(backend):
    """The Monte Carlo law test's inputs through each backend: identical outputs for identical seeds (so the
    Triton kernel draws from the law the torch op was shown to draw from)."""
    V, gamma, N = 4, 3, 600
    logits, q = _chain_tables(V, gamma, 5)
    lg, drafts, probs = _draw_chains(logits, q, V, gamma, N, 5)
    kw = dict(temperature=TEMP, seed=torch.arange(N) + 11, offset=2)
    ref = verify_chain_block(lg, drafts, probs, backend="torch", **kw)
    out = _run(backend, lg, drafts, probs, **kw)
    assert torch.equal(out.tokens, ref.tokens) and torch.equal(out.num_accepted, ref.num_accepted)


# ----------------------------------------------------------------------------------------------- (2) accepted length
def test_paper_example_expected_lengths():
    """Sun et al.'s motivating example: target (1/3, 2/3), draft (2/3, 1/3), context-free, gamma = 2: token
    verification keeps 10/9 drafts in expectation, block verification 11/9."""
    V, gamma = 2, 2
    p_logits = torch.tensor([1.0, 2.0], dtype=torch.float64).log() * TEMP  # softmax(l / TEMP) = (1/3, 2/3)
    logits = [p_logits.expand(V**j, V) for j in range(gamma + 1)]
    q = [torch.tensor([2 / 3, 1 / 3], dtype=torch.float64).expand(V**j, V) for j in range(gamma + 1)]
    _, taus = _exact_law(logits, q, V, gamma)
    # (1e-7: the temperature is a float32 0.8, so p is (1/3, 2/3) to float32 precision)
    assert abs(sum(t * p for t, p in taus.items()) - 11 / 9) < 1e-7
    assert abs(_token_by_token_mean(logits, q, V, gamma) - 10 / 9) < 1e-7


@pytest.mark.parametrize("V,gamma", [(2, 4), (3, 3), (4, 2), (5, 1)])
def test_block_accepts_at_least_token_by_token(V, gamma):
    """Exact expectations by enumeration, on random context-dependent (p, q) pairs of varied agreement."""
    gains = []
    for seed in range(6):
        logits, q = _chain_tables(V, gamma, 100 + seed, closeness=0.5 + 0.25 * seed)
        _, taus = _exact_law(logits, q, V, gamma)
        block, token = sum(t * p for t, p in taus.items()), _token_by_token_mean(logits, q, V, gamma)
        assert block >= token - 1e-12, (seed, block, token)
        gains.append(block - token)
    if gamma > 1:
        assert max(gains) > 1e-3  # strictly better somewhere (gamma = 1: the two rules coincide)
    else:
        assert max(gains) < 1e-12


def test_token_by_token_mean_is_verify_trees_chain_rule():
    """The token-by-token expectation used above is what verify_tree's chain walk achieves (sampled)."""
    V, gamma, N = 3, 3, 40_000
    logits, q = _chain_tables(V, gamma, 21)
    lg, drafts, probs = _draw_chains(logits, q, V, gamma, N, 21)
    tree_tokens = torch.cat([torch.zeros(N, 1, dtype=torch.int64), drafts], 1)
    tree_probs = torch.cat([probs, torch.zeros(N, 1, V)], 1)
    res = verify_tree(lg, tree_tokens, chain_parents(N, gamma + 1), draft_probs=tree_probs, temperature=TEMP,
                      seed=torch.arange(N), backend="torch")
    mean, exact = res.num_accepted.double().mean().item(), _token_by_token_mean(logits, q, V, gamma)
    assert abs(mean - exact) < 4 * res.num_accepted.double().std().item() / math.sqrt(N)


# ----------------------------------------------------------------------------------------------- (3) greedy
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("V", [5, 37])
def test_greedy_is_exact_match_prefix(backend, V):
    B, gamma = 24, 4
    g = torch.Generator().manual_seed(V)
    logits = torch.randn(B, gamma + 1, V, generator=g)
    best = logits.argmax(-1)
    drafts = torch.where(torch.rand(B, gamma, generator=g) < 0.75, best[:, :gamma],
                         torch.randint(0, V, (B, gamma), generator=g))
    n = torch.randint(0, gamma + 1, (B,), generator=g, dtype=torch.int32)
    junk = torch.softmax(torch.randn(B, gamma, V, generator=g), -1)  # greedy ignores the draft rows
    out = _run(backend, logits, drafts, junk, n, temperature=0.0, seed=torch.arange(B))
    match = (drafts == best[:, :gamma]).long().cumprod(1).sum(1)
    tau = torch.minimum(match, n.long())
    assert torch.equal(out.num_accepted.long(), tau)
    assert torch.equal(out.tokens.gather(1, tau.unsqueeze(1)).squeeze(1), best.gather(1, tau.unsqueeze(1)).squeeze(1))
    _check_invariants(out, drafts, n)
    tree = verify_tree(logits, torch.cat([torch.zeros(B, 1, dtype=torch.int64), drafts], 1),
                       chain_parents(B, gamma + 1), n + 1, backend="torch")
    assert torch.equal(tree.num_accepted, out.num_accepted)
    assert torch.equal(tree.tokens.long(), out.tokens)


# ----------------------------------------------------------------------------------------------- (4) seeds, backends
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("B,gamma,V,dtype,layout", [
    (9, 1, 7, torch.float32, "contiguous"),
    (12, 2, 33, torch.bfloat16, "wide_rows"),
    (10, 3, 1, torch.float32, "strided"),
    (8, 4, 1030, torch.float16, "colmajor"),
    (11, 5, 100, torch.float32, "column"),
    (6, 0, 13, torch.float32, "offset"),
])
def test_seeded_outputs_agree_with_the_reference(backend, B, gamma, V, dtype, layout):
    logits, drafts, q, n, temp = _random_problem(B, gamma, V, seed=B * 100 + V, dtype=dtype)
    kw = dict(temperature=temp, seed=torch.arange(B) * 3 + 1, offset=[5] * B)
    ref = verify_chain_block(logits, drafts, q, n, backend="torch", **kw)
    out = _run(backend, relayout(logits, layout), drafts, relayout(q, layout) if gamma else q, n, **kw)
    again = _run(backend, logits, drafts, q, n, **kw)
    _check_invariants(out, drafts, n)
    assert torch.equal(out.tokens, ref.tokens) and torch.equal(out.num_accepted, ref.num_accepted)
    assert torch.equal(again.tokens, out.tokens)
    other = _run(backend, logits, drafts, q, n, **{**kw, "offset": 6})
    if B * V > 100:
        assert not torch.equal(other.tokens, out.tokens)  # the offset moves the stream


def test_acceptance_is_realistic_in_the_problems():
    """The agreement tests exercise acceptances and rejections alike (not all-reject)."""
    logits, drafts, q, n, temp = _random_problem(400, 4, 50, seed=0)
    out = verify_chain_block(logits, drafts, q, n, temperature=temp, seed=torch.arange(400), backend="torch")
    frac = (out.num_accepted.sum() / n.sum()).item()
    assert 0.3 < frac < 0.95, frac


@pytest.mark.triton
def test_torch_compile_keeps_the_custom_op():
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    logits, drafts, q, n, temp = (t.to(dev) for t in _random_problem(5, 3, 20, seed=4))
    seed = torch.arange(5, device=dev)
    eager = verify_chain_block(logits, drafts, q, n, temp, seed, backend="triton", validate=False)
    fn = torch.compile(lambda l, s: verify_chain_block(l, drafts, q, n, temp, s, backend="triton", validate=False),
                       backend="eager", fullgraph=True)
    out = fn(logits, seed)
    assert torch.equal(out.tokens, eager.tokens) and torch.equal(out.num_accepted, eager.num_accepted)


@pytest.mark.cuda
def test_cuda_graph_capture_replays_new_seeds():
    logits, drafts, q, n, temp = (t.cuda() for t in _random_problem(16, 4, 1000, seed=6))
    seed = torch.zeros(16, dtype=torch.int64, device="cuda")
    call = lambda: verify_chain_block(logits, drafts, q, n, temp, seed, backend="triton", validate=False)  # noqa: E731
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for s in (3, 4):
        seed.fill_(s)
        graph.replay()
        eager = call()
        assert torch.equal(out.tokens, eager.tokens) and torch.equal(out.num_accepted, eager.num_accepted)


def test_fake_implementation_shapes():
    pytest.importorskip("triton")
    import tlt_kernels._triton.verify_chain_block  # noqa: F401  (registers the op)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        lg, tok, q = torch.empty(3, 5, 11), torch.empty(3, 4, dtype=torch.int64), torch.empty(3, 4, 11)
        words = torch.empty(3, dtype=torch.int64)
        tokens, num = torch.ops.tlt.verify_chain_block(lg, tok, q, torch.empty(3, dtype=torch.int32),
                                                       torch.empty(3), words, words)
    assert tokens.shape == (3, 5) and tokens.dtype == torch.int64
    assert num.shape == (3,) and num.dtype == torch.int32


# ----------------------------------------------------------------------------------------------- (5) properties
@pytest.mark.parametrize("backend", backend_params())
@budget(8)
@given(B=st.integers(1, 6), gamma=st.integers(0, 5), V=st.integers(1, 40), seed=st.integers(0, 2**31),
       greedy_every=st.integers(1, 4))
def test_properties(backend, B, gamma, V, seed, greedy_every):
    logits, drafts, q, n, temp = _random_problem(B, gamma, V, seed, greedy_every=greedy_every)
    out = verify_chain_block(logits, drafts, q, n, temperature=temp, seed=seed, offset=seed // 3, backend=backend)
    _check_invariants(out, drafts, n)
    assert (out.tokens < V).all()
    if backend != "torch":
        ref = verify_chain_block(logits, drafts, q, n, temperature=temp, seed=seed, offset=seed // 3, backend="torch")
        assert torch.equal(out.tokens, ref.tokens)


# ----------------------------------------------------------------------------------------------- (6) validation
def _valid():
    logits, drafts, q, n, temp = _random_problem(3, 2, 6, seed=1, greedy_every=10)
    return dict(logits=logits, draft_tokens=drafts, draft_probs=q, num_drafts=n, temperature=temp, seed=0)


@pytest.mark.parametrize("change,error,words", [
    (lambda a: a.update(logits=a["logits"].long()), TypeError, "logits"),
    (lambda a: a.update(logits=a["logits"][0]), ValueError, "logits"),
    (lambda a: a.update(draft_tokens=a["draft_tokens"][:, :1]), ValueError, "draft_tokens"),
    (lambda a: a.update(draft_tokens=a["draft_tokens"].float()), TypeError, "draft_tokens"),
    (lambda a: a.update(draft_probs=a["draft_probs"][:, :, :5]), ValueError, "draft_probs"),
    (lambda a: a.update(num_drafts=torch.tensor([0, 3, 1], dtype=torch.int32)), ValueError, "num_drafts[1]"),
    (lambda a: a.update(num_drafts=torch.tensor([0, -1, 1], dtype=torch.int32)), ValueError, "num_drafts[1]"),
    (lambda a: a.update(num_drafts=torch.ones(2, dtype=torch.int32)), ValueError, "num_drafts"),
    (lambda a: a["draft_tokens"].__setitem__((2, 0), 6), ValueError, "draft_tokens[2, 0]"),
    (lambda a: a["draft_probs"].__setitem__((1, 0, 2), -0.5), ValueError, "draft_probs[1, 0]"),
    (lambda a: a["draft_probs"].__setitem__((1, 1), 0.0), ValueError, "draft_probs[1, 1]"),
    (lambda a: a["logits"].__setitem__((0, 1, 3), float("nan")), ValueError, "logits[0, 1]"),
    (lambda a: a["logits"].__setitem__((2, 0), float("-inf")), ValueError, "logits[2, 0]"),
    (lambda a: a.update(temperature=[0.5, -1.0, 1.0]), ValueError, "temperature[1]"),
    (lambda a: a.update(temperature=torch.tensor([0.5, 1.0, float("nan")])), ValueError, "temperature[2]"),
    (lambda a: a.update(temperature=torch.ones(3, dtype=torch.int32)), TypeError, "temperature"),
    (lambda a: a.update(seed=torch.zeros(3)), TypeError, "seed"),
    (lambda a: a.update(seed=[1, 2]), ValueError, "seed"),
    (lambda a: a.update(seed=1.5), ValueError, "seed"),
])
def test_validation_names_the_argument(change, error, words):
    args = _valid()
    args["num_drafts"] = torch.full((3,), 2, dtype=torch.int32)
    change(args)
    with pytest.raises(error, match=words.replace("[", r"\[").replace("]", r"\]")):
        verify_chain_block(**args, backend="torch")


def test_padding_and_greedy_rows_are_not_validated():
    """Rows past num_drafts (and draft rows of greedy requests) may hold anything."""
    args = _valid()
    args["num_drafts"] = torch.tensor([0, 1, 2], dtype=torch.int32)
    args["logits"][0, 1:] = float("nan")  # request 0 reads row 0 only
    args["draft_tokens"][1, 1] = -7  # request 1 has one draft
    args["draft_probs"][0] = -1.0
    out = verify_chain_block(**args, backend="torch")
    _check_invariants(out, args["draft_tokens"], args["num_drafts"])
    args["temperature"] = torch.tensor([1.0, 1.0, 0.0])
    args["draft_probs"][2] = 0.0  # greedy request 2: its draft rows are not read
    verify_chain_block(**args, backend="torch")


def test_unknown_backend():
    with pytest.raises(ValueError, match="backend"):
        verify_chain_block(**_valid(), backend="nope")
