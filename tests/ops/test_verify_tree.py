"""verify_tree: every backend against the reference, hand-worked rules, exact losslessness (analytic brute force),
Monte Carlo of the reference.

The exact tests use a tiny Markov "target": the logits after a node depend only on that node's
token, ``logits = L[token]``. A brute force enumerates the walk analytically (acceptance
probabilities instead of coins, and every draft assignment weighted by its draft probability) and
must reproduce the target's own sampling distribution. The Monte Carlo tests then run the
implementation itself on >= 100k requests and chi-square the first two emitted tokens against the
brute force. Helpers here are reused by ``test_verify_tree_triton.py``.
"""
import itertools
from collections import defaultdict
from typing import NamedTuple

import numpy as np
import pytest
import torch
from conftest import agreement_backends, kernel_devices, need_backend
from scipy import stats as sstats

import tlt_kernels
from tlt_kernels import VerifyResult, chain_parents, verify_tree

NEG = float("-inf")
DEV = kernel_devices()[0]

# ----------------------------------------------------------------------------------------------
# Every backend against the torch reference (the helpers are shared with test_verify_tree_triton.py)


def verify_inputs(B, T, V, parents, seed, use_q, dtype=torch.float32):
    """Random ``[B, T, V]`` logits (``dtype``), tokens, ``parents`` for every request, draft probabilities if
    ``use_q``; the root's first child usually proposes the argmax, so acceptances are likely."""
    g = torch.Generator().manual_seed(seed)
    lg = torch.randn(B, T, V, generator=g) * 2
    toks = torch.randint(0, V, (B, T), generator=g)
    # Make acceptances likely: the first child of the root usually proposes the argmax.
    if T > 1:
        toks[:, 1] = torch.where(torch.rand(B, generator=g) < 0.7, lg[:, 0].argmax(-1), toks[:, 1])
    par = torch.tensor(parents, dtype=torch.int32).expand(B, T).contiguous()
    q = torch.softmax(lg + 0.7 * torch.randn(B, T, V, generator=g), -1) if use_q else None
    return lg.to(dtype), toks, par, q


TREE = [-1, 0, 0, 1, 1, 2, 3]
CHAIN = [-1, 0, 1, 2, 3]
CONFIGS = {
    "greedy-tree": (TREE, False, dict()),
    "temp-tree": (TREE, False, dict(temperature=0.9)),
    "topk-tree": (TREE, False, dict(temperature=0.7, top_k=3)),
    "topp-chain": (CHAIN, False, dict(temperature=1.1, top_p=0.8)),
    "topk-topp-q-tree": (TREE, True, dict(temperature=0.8, top_k=6, top_p=0.9)),
    "q-chain": (CHAIN, True, dict(temperature=1.0)),
    "mixed-q-tree": (TREE, True, dict(temperature=[0.0, 0.7, None, 1.3], top_k=[0, 2, 5, None], top_p=[1.0, 0.95, 0.5, 0.7])),
}


def compare_outputs(a, b):
    """Asserts two verify_tree results (the reference's first) are equal, output by output."""
    for name, x, y in zip(("tokens", "num_accepted", "accepted_nodes", "error", "stats"), a, b):
        if x is None:
            assert y is None
            continue
        assert torch.equal(x.cpu(), y.cpu()), f"{name} differs:\nreference {x}\nbackend   {y}"


@pytest.mark.parametrize("backend", agreement_backends())
@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("V", [37, 5])
def test_same_tokens_as_reference(backend, name, V):
    """Every backend emits the torch reference's outputs (tokens, paths, error flags, stats) for the same seeds and
    offset, on the kernel device (the GPU, or the CPU under the interpreter)."""
    need_backend("verify_tree", backend, torch.device(DEV))
    parents, use_q, kw = CONFIGS[name]
    B, T = 4, len(parents)
    lg, toks, par, q = verify_inputs(B, T, V, parents, seed=V, use_q=use_q)
    args = dict(draft_probs=q, seed=torch.arange(B) * 31 + 7, offset=11, return_stats=True, **kw)
    ref = verify_tree(lg, toks, par, backend="torch", **args)
    dev = lambda t: None if t is None else t.to(DEV)  # noqa: E731
    got = verify_tree(dev(lg), dev(toks), dev(par), backend=backend, **{**args, "draft_probs": dev(q), "seed": dev(args["seed"])})
    compare_outputs(ref, got)


# ----------------------------------------------------------------------------------------------
# Markov target / draft models and the analytic brute force


def f32(x):
    """The float32 value the op sees for a Python float parameter."""
    return float(torch.tensor(x, dtype=torch.float32))


def brute_target_row(logits, temperature, top_k, top_p):
    """Sort-based target distribution of one row (independent of tlt_kernels.reference.sampling)."""
    V = len(logits)
    if not temperature:
        best = max(range(V), key=lambda t: (logits[t], -t))
        return np.array([1.0 if t == best else 0.0 for t in range(V)])
    z = np.array(logits, dtype=np.float64) / temperature
    if top_k and top_k < V:
        kth = np.sort(z)[::-1][top_k - 1]
        z = np.where(z >= kth, z, -np.inf)
    e = np.exp(z - z.max())
    p = e / e.sum()
    if top_p is not None and top_p < 1:
        order = np.argsort(-p, kind="stable")
        cum = np.cumsum(p[order])
        last = p[order[int(np.searchsorted(cum, top_p))]] if cum[-1] >= top_p else 0.0
        p = np.where(p >= last, p, 0.0)
        p = p / p.sum()
    return p


class Markov:
    """Target ``L [V, V]`` (raw logits after each token), draft ``Q [V, V]``, sampling params."""

    def __init__(self, V, seed, temperature=1.0, top_k=None, top_p=None):
        rng = np.random.default_rng(seed)
        self.V = V
        L = rng.normal(size=(V, V)) * 1.3
        L[0, V - 1] = -np.inf  # masked token
        L[1, 2] = L[1, 0]  # tie (exercises threshold top-k)
        self.L = L
        Q = np.exp(0.6 * L + 0.5 * rng.normal(size=(V, V)))
        Q[np.isinf(L)] = 0.0
        Q[2, 1] = 0.0  # a token the draft never proposes but the target may emit
        self.Q = Q / Q.sum(1, keepdims=True)
        self.temperature = temperature
        self.top_k = top_k
        self.top_p = top_p
        tp = None if top_p is None else f32(top_p)
        temp = None if temperature is None else f32(temperature)
        self.P = np.stack([brute_target_row(L[t], temp, top_k, tp) for t in range(V)])

    def params(self):
        return dict(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)


def children_of(parents, node):
    return [c for c in range(1, len(parents)) if parents[c] == node]


def walk_distribution(M, parents, tokens, use_q):
    """Exact law of the emitted sequence for one fixed tree of draft tokens: {tuple: prob}."""
    out = defaultdict(float)

    def rec(node, prefix, prob):
        p = M.P[tokens[node]].copy()
        q = M.Q[tokens[node]] if use_q else None
        for c in children_of(parents, node):
            x = tokens[c]
            if use_q:
                a = min(1.0, p[x] / q[x]) if q[x] > 0 else float(p[x] > 0)
            else:
                a = p[x]
            if a > 0:
                rec(c, prefix + (x,), prob * a)
            prob *= 1 - a
            if prob <= 0:
                return
            r = np.maximum(p - q, 0) if use_q else np.where(np.arange(M.V) == x, 0.0, p)
            if r.sum() > 0:
                p = r / r.sum()
        for t in np.nonzero(p)[0]:
            out[prefix + (int(t),)] += prob * p[t]

    rec(0, (), 1.0)
    return out


def candidate_tokens(M, parents, root):
    """Deterministic drafts: the r-th child of a node proposes the r-th most likely token under Q."""
    toks = [root] + [0] * (len(parents) - 1)
    for node in range(len(parents)):
        order = np.argsort(-M.Q[toks[node]], kind="stable")
        for r, c in enumerate(children_of(parents, node)):
            toks[c] = int(order[r])
    return toks


def emitted_distribution(M, parents, root, use_q):
    """Exact law of the emitted sequence, averaged over the draft sampling when ``use_q``."""
    if not use_q:
        return dict(walk_distribution(M, parents, candidate_tokens(M, parents, root), False))
    T = len(parents)
    total = defaultdict(float)
    for assign in itertools.product(range(M.V), repeat=T - 1):
        toks = (root,) + assign
        w = 1.0
        for c in range(1, T):
            w *= M.Q[toks[parents[c]], toks[c]]
            if w == 0:
                break
        if w == 0:
            continue
        for seq, pr in walk_distribution(M, parents, toks, True).items():
            total[seq] += w * pr
    return dict(total)


def extend_to(M, dist, root, N):
    """Law of the first N tokens when the emitted sequence is continued by sampling the target."""
    out = np.zeros((M.V,) * N)
    for seq, pr in dist.items():
        rest = N - len(seq)
        out[seq] += pr * (chain_distribution(M, seq[-1], rest) if rest else 1.0)
    return out


def chain_distribution(M, root, N):
    """Law of N tokens sampled one at a time from the target after ``root``: ``[V] * N`` array."""
    out = M.P[root].copy()
    for _ in range(N - 1):
        out = np.einsum("...i,ij->...ij", out, M.P)
    return out


def first_two(dist, V):
    """Exact law of (first token, second token or STOP=V) from {sequence: prob}."""
    out = np.zeros((V, V + 1))
    for seq, pr in dist.items():
        out[seq[0], seq[1] if len(seq) > 1 else V] += pr
    return out


TREE7 = [-1, 0, 0, 1, 1, 2, 3]  # root->{1,2}, 1->{3,4}, 2->{5}, 3->{6}
CHAIN4 = [-1, 0, 1, 2]
CASES = {
    "chain-q-t1": (CHAIN4, True, dict(V=5, seed=1, temperature=1.0)),
    "chain-q-topk-topp": (CHAIN4, True, dict(V=5, seed=2, temperature=0.8, top_k=3, top_p=0.9)),
    "tree-q-topk": (TREE7, True, dict(V=4, seed=3, temperature=0.7, top_k=3)),
    "tree-q-topp": (TREE7, True, dict(V=4, seed=4, temperature=1.3, top_p=0.8)),
    "tree-cand-t1": (TREE7, False, dict(V=5, seed=5, temperature=1.0)),
    "tree-cand-topk-topp": (TREE7, False, dict(V=6, seed=6, temperature=0.9, top_k=4, top_p=0.85)),
    "chain-cand-greedy": (CHAIN4, False, dict(V=5, seed=7, temperature=None)),
    "tree-q-greedy": (TREE7, True, dict(V=4, seed=8, temperature=0.0)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_walk_rules_are_lossless(case):
    """The analytic walk (rules of the contract) reproduces the target's own sampling law."""
    parents, use_q, kw = CASES[case]
    M = Markov(**kw)
    root = 1
    dist = emitted_distribution(M, parents, root, use_q)
    assert abs(sum(dist.values()) - 1) < 1e-12
    N = len(parents)  # max_depth + 1 for these trees would be smaller; N >= every emitted length.
    got = extend_to(M, dist, root, N)
    want = chain_distribution(M, root, N)
    np.testing.assert_allclose(got, want, atol=1e-9, rtol=0)


def build_batch(M, parents, root, use_q, B, gen, dtype=torch.float32):
    """Batched inputs: drafts sampled from Q along the tree (or the deterministic candidates)."""
    T = len(parents)
    Q = torch.tensor(M.Q)
    toks = torch.empty(B, T, dtype=torch.int64)
    toks[:, 0] = root
    if use_q:
        for c in range(1, T):
            toks[:, c] = torch.multinomial(Q[toks[:, parents[c]]], 1, generator=gen).squeeze(1)
    else:
        toks[:] = torch.tensor(candidate_tokens(M, parents, root))
    L = torch.tensor(M.L, dtype=torch.float32)
    logits = L[toks].to(dtype)
    par = torch.tensor(parents, dtype=torch.int32).expand(B, T).contiguous()
    dprobs = Q[toks].to(torch.float32) if use_q else None
    return logits, toks, par, dprobs


def chi2_pvalue(counts, probs, min_expected=5.0):
    """Chi-square p-value of counts against exact probabilities.

    Zero-probability cells must be empty; cells expecting fewer than ``min_expected`` samples are
    pooled into one (the chi-square approximation needs a handful of expected counts per cell).
    """
    counts = np.asarray(counts, dtype=np.float64).ravel()
    probs = np.asarray(probs, dtype=np.float64).ravel()
    assert counts[probs < 1e-15].sum() == 0, "emitted an outcome of probability 0"
    keep = probs >= 1e-15
    counts, probs = counts[keep], probs[keep] / probs[keep].sum()
    expected = probs * counts.sum()
    small = expected < min_expected
    if small.any():
        counts = np.append(counts[~small], counts[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    return sstats.chisquare(counts, expected).pvalue


def biased(probs, tv=0.01):
    """Move ``tv`` of probability mass from the most likely cell to the second: a 1% bias."""
    flat = probs.ravel().copy()
    order = np.argsort(-flat)
    flat[order[0]] -= tv
    flat[order[1]] += tv
    return flat.reshape(probs.shape)


def monte_carlo_first_two(verify, case, B, seed=0, dtype=torch.float32, **kw):
    parents, use_q, mk = CASES[case]
    M = Markov(**mk)
    root = 1
    gen = torch.Generator().manual_seed(seed)
    logits, toks, par, dprobs = build_batch(M, parents, root, use_q, B, gen, dtype)
    seeds = torch.arange(B, dtype=torch.int64) * 7919 + 17 + seed
    res = verify(logits, toks, par, draft_probs=dprobs, seed=seeds, offset=3, **M.params(), **kw)
    first = res.tokens[:, 0].long()
    second = torch.where(res.num_accepted >= 1, res.tokens[:, 1].long(), torch.full_like(first, M.V))
    counts = torch.bincount(first * (M.V + 1) + second, minlength=M.V * (M.V + 1)).numpy()
    exact = first_two(emitted_distribution(M, parents, root, use_q), M.V)
    return counts, exact, res


MC_B = 200_000
ALPHA = 1e-3


@pytest.fixture
def one_thread():
    """Big elementwise CPU work runs faster on one thread when the few cores are shared."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("case", ["chain-q-topk-topp", "tree-q-topk", "tree-cand-topk-topp"])
def test_reference_monte_carlo_matches_exact(case, one_thread):
    counts, exact, _ = monte_carlo_first_two(verify_tree, case, MC_B)
    assert chi2_pvalue(counts, exact) > ALPHA
    # The same test at the same sample size rejects a distribution with 1% of its mass moved.
    rng = np.random.default_rng(0)
    bad_counts = rng.multinomial(MC_B, biased(exact).ravel())
    assert chi2_pvalue(bad_counts, exact) < ALPHA


# ----------------------------------------------------------------------------------------------
# Hand-worked rules


def onehot_logits(B, T, V, best, low=0.0, high=5.0):
    """logits [B, T, V] whose row i has its maximum at best[i]."""
    lg = torch.full((B, T, V), low)
    for i, t in enumerate(best):
        lg[:, i, t] = high
    return lg


def test_greedy_chain_full_acceptance():
    V, T = 8, 4
    best = [3, 1, 4, 6]
    lg = onehot_logits(1, T, V, best)
    toks = torch.tensor([[7, 3, 1, 4]])
    r = verify_tree(lg, toks, chain_parents(1, T))
    assert r.tokens.tolist() == [[3, 1, 4, 6]]
    assert r.num_accepted.tolist() == [3]
    assert r.accepted_nodes.tolist() == [[0, 1, 2, 3]]
    assert r.error.tolist() == [0]
    assert r.tokens.dtype == r.num_accepted.dtype == r.accepted_nodes.dtype == torch.int32


def test_greedy_chain_partial_and_ties_lowest_id():
    V, T = 6, 4
    lg = onehot_logits(1, T, V, [2, 5, 0, 0])
    lg[0, 1, 1] = 5.0  # row 1 ties tokens 1 and 5: the argmax is 1
    r = verify_tree(lg, torch.tensor([[0, 2, 5, 0]]), chain_parents(1, T))
    assert r.tokens.tolist() == [[2, 1, -1, -1]]
    assert r.num_accepted.tolist() == [1]
    assert r.accepted_nodes.tolist() == [[0, 1, -1, -1]]


def test_greedy_tree_second_child_accepted():
    V = 5
    parents = torch.tensor([[-1, 0, 0, 1, 2]], dtype=torch.int32)
    lg = onehot_logits(1, 5, V, [4, 0, 3, 0, 2])
    toks = torch.tensor([[0, 1, 4, 0, 3]])  # node 1 proposes 1 (wrong), node 2 proposes 4 (right)
    r = verify_tree(lg, toks, parents, return_stats=True)
    assert r.accepted_nodes.tolist() == [[0, 2, 4, -1, -1]]
    assert r.tokens.tolist() == [[4, 3, 2, -1, -1]]
    assert r.stats.tolist() == [[[2, 1], [1, 1], [0, 0], [0, 0]]]


@pytest.mark.parametrize("use_q", [False, True])
def test_certain_accept_and_certain_reject(use_q):
    # Row 0 puts all mass on token 2 (others -inf): a child proposing 2 is always accepted, others never.
    B, V = 64, 4
    lg = torch.zeros(B, 3, V)
    lg[:, 0] = torch.tensor([NEG, NEG, 0.0, NEG])
    parents = torch.tensor([[-1, 0, 0]] * B, dtype=torch.int32)
    toks = torch.tensor([[0, 1, 2]] * B)
    q = torch.full((B, 3, V), 0.25) if use_q else None
    r = verify_tree(lg, toks, parents, draft_probs=q, temperature=1.0, seed=torch.arange(B), return_stats=True)
    assert (r.accepted_nodes[:, 1] == 2).all() and (r.tokens[:, 0] == 2).all()
    assert (r.stats[:, 0] == torch.tensor([2, 1], dtype=torch.int32)).all()


def test_draft_rule_zero_draft_prob_accepts():
    # q(x) = 0 with p(x) > 0: u * 0 < p(x) always accepts.
    B, V = 32, 3
    lg = torch.zeros(B, 2, V)
    q = torch.tensor([0.5, 0.5, 0.0]).expand(B, 2, V).contiguous()
    r = verify_tree(lg, torch.tensor([[0, 2]] * B), chain_parents(B, 2), draft_probs=q, temperature=1.0, seed=torch.arange(B))
    assert (r.num_accepted == 1).all()


def test_masked_tokens_never_emitted():
    B, V = 4096, 6
    lg = torch.randn(B, 2, V, generator=torch.Generator().manual_seed(0)) * 3
    lg[:, :, 1] = NEG
    lg[:, :, 4] = NEG
    toks = torch.tensor([[0, 1]] * B)  # the only draft proposes a masked token: never accepted
    r = verify_tree(lg, toks, chain_parents(B, 2), temperature=2.0, seed=torch.arange(B))
    assert (r.num_accepted == 0).all()
    assert not torch.isin(r.tokens[:, 0], torch.tensor([1, 4])).any()
    assert set(r.tokens[:, 0].tolist()) == {0, 2, 3, 5}


def test_top_k_one_is_greedy_and_top_p_tiny_is_greedy():
    g = torch.Generator().manual_seed(1)
    B, T, V = 16, 5, 9
    lg = torch.randn(B, T, V, generator=g)
    toks = torch.randint(0, V, (B, T), generator=g)
    toks[:, 1] = lg[:, 0].argmax(-1)
    par = chain_parents(B, T)
    greedy = verify_tree(lg, toks, par)
    for kw in (dict(top_k=1), dict(top_p=1e-6)):
        r = verify_tree(lg, toks, par, temperature=0.9, seed=torch.arange(B), **kw)
        assert torch.equal(r.tokens, greedy.tokens) and torch.equal(r.num_accepted, greedy.num_accepted)


def greedy_decode(step_logits, root_path, n):
    """Plain greedy decoding with a deterministic next-token function of the path."""
    out, path = [], list(root_path)
    for _ in range(n):
        t = int(step_logits(path).argmax())
        out.append(t)
        path.append(t)
    return out


def test_greedy_equals_plain_greedy_decoding():
    V, T, B = 7, 6, 40
    g = torch.Generator().manual_seed(5)
    W = torch.randn(V, V, generator=g)

    def step_logits(path):
        return W[path[-1]] + 0.3 * W[path[-2]] if len(path) > 1 else W[path[-1]]

    parents = torch.tensor([[-1, 0, 0, 1, 2, 3]] * B, dtype=torch.int32)
    toks = torch.randint(0, V, (B, T), generator=g)
    toks[:, 0] = 2
    for b in range(B):  # half the requests draft the greedy continuation on one branch
        if b % 2 == 0:
            ref = greedy_decode(step_logits, [0, 2], 3)
            branch = [1, 3, 5] if b % 4 == 0 else [2, 4]
            for node, t in zip(branch, ref):
                toks[b, node] = t
    lg = torch.empty(B, T, V)
    for b in range(B):
        for i in range(T):
            path, j = [], i
            while j >= 0:
                path.append(int(toks[b, j]))
                j = int(parents[b, j])
            lg[b, i] = step_logits([0] + path[::-1])
    r = verify_tree(lg, toks, parents)
    for b in range(B):
        k = int(r.num_accepted[b])
        assert r.tokens[b, : k + 1].tolist() == greedy_decode(step_logits, [0, 2], k + 1)
        assert (r.tokens[b, k + 1 :] == -1).all()
        if b % 4 == 0:
            assert k == 3


def _random_inputs(B=32, T=6, V=10, seed=0, use_q=True):
    g = torch.Generator().manual_seed(seed)
    lg = torch.randn(B, T, V, generator=g)
    toks = torch.randint(0, V, (B, T), generator=g)
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2]] * B, dtype=torch.int32)[:, :T]
    q = torch.softmax(lg + 0.5 * torch.randn(B, T, V, generator=g), -1) if use_q else None
    return lg, toks, parents, q


def test_same_seed_same_tokens_different_seeds_differ():
    lg, toks, parents, q = _random_inputs()
    kw = dict(draft_probs=q, temperature=1.0)
    a = verify_tree(lg, toks, parents, seed=torch.arange(32), **kw)
    b = verify_tree(lg, toks, parents, seed=torch.arange(32), **kw)
    c = verify_tree(lg, toks, parents, seed=torch.arange(32) + 1000, **kw)
    d = verify_tree(lg, toks, parents, seed=torch.arange(32), offset=1, **kw)
    assert all(torch.equal(x, y) for x, y in zip(a[:4], b[:4]))
    assert not torch.equal(a.tokens, c.tokens)
    assert not torch.equal(a.tokens, d.tokens)
    # Default seeds come from torch's generator: reproducible under torch.manual_seed.
    torch.manual_seed(3)
    e = verify_tree(lg, toks, parents, **kw)
    torch.manual_seed(3)
    f = verify_tree(lg, toks, parents, **kw)
    assert torch.equal(e.tokens, f.tokens)


def test_mixed_greedy_and_sampled_batch():
    lg, toks, parents, q = _random_inputs(B=8)
    seeds = torch.arange(8) * 11
    temps = [None, 0.8, 0.0, 1.2, None, 0.5, 0.0, 1.0]
    topk = [0, 3, None, 0, 5, 0, 2, 4]
    mixed = verify_tree(lg, toks, parents, draft_probs=q, temperature=temps, top_k=topk, seed=seeds)
    greedy = verify_tree(lg, toks, parents, draft_probs=q, seed=seeds)
    for b, t in enumerate(temps):
        if not t:
            assert torch.equal(mixed.tokens[b], greedy.tokens[b])
        else:
            one = verify_tree(lg[b : b + 1], toks[b : b + 1], parents[b : b + 1], draft_probs=q[b : b + 1], temperature=t, top_k=topk[b], seed=seeds[b : b + 1])
            assert torch.equal(mixed.tokens[b], one.tokens[0])
    # tensors work the same as lists
    again = verify_tree(lg, toks, parents, draft_probs=q, temperature=torch.tensor([t or 0.0 for t in temps]), top_k=torch.tensor([k or 0 for k in topk]), seed=seeds)
    assert torch.equal(mixed.tokens, again.tokens)


def test_padding_nodes_are_ignored():
    lg, toks, parents, q = _random_inputs(B=6, T=6)
    n = torch.tensor([1, 2, 3, 4, 5, 6], dtype=torch.int32)
    kw = dict(temperature=0.9, seed=torch.arange(6))
    full = verify_tree(lg, toks, parents, num_nodes=n, draft_probs=q, **kw)
    lg2, toks2, q2 = lg.clone(), toks.clone(), q.clone()
    for b in range(6):  # garbage past num_nodes: out-of-range tokens, NaN logits, negative draft probs
        lg2[b, n[b] :] = float("nan")
        toks2[b, n[b] :] = 10**6
        q2[b, n[b] :] = -1.0
    pad = verify_tree(lg2, toks2, parents, num_nodes=n, draft_probs=q2, **kw)
    assert all(torch.equal(x, y) for x, y in zip(full[:4], pad[:4]))
    for b in range(6):
        k = int(n[b])
        one = verify_tree(lg[b : b + 1, :k], toks[b : b + 1, :k], parents[b : b + 1, :k], draft_probs=q[b : b + 1, :k], temperature=0.9, seed=torch.tensor([b]))
        m = int(one.num_accepted[0])
        assert full.tokens[b, : m + 1].tolist() == one.tokens[0, : m + 1].tolist()
        assert int(full.num_accepted[b]) == m
    assert (pad.accepted_nodes[0] == torch.tensor([0, -1, -1, -1, -1, -1], dtype=torch.int32)).all()


def test_stats_counters_and_max_depth():
    lg, toks, parents, q = _random_inputs(B=64, T=6)
    r = verify_tree(lg, toks, parents, draft_probs=q, temperature=1.0, seed=torch.arange(64), return_stats=True)
    assert r.stats.shape == (64, 5, 2) and r.stats.dtype == torch.int32
    acc = r.stats[:, :, 1]
    assert torch.equal(acc.sum(1), r.num_accepted)
    # Accepting at depth d+1 requires having accepted at every shallower depth.
    assert (acc[:, 1:] <= acc[:, :-1]).all()
    # The root has 2 children, so depth 1 tries 1 or 2; a deeper level is tried only after an accept.
    assert ((r.stats[:, 0, 0] >= 1) & (r.stats[:, 0, 0] <= 2)).all()
    assert ((r.stats[:, 1:, 0] > 0) <= (acc[:, :-1] > 0)).all()
    assert (acc <= (r.stats[:, :, 0] > 0).int()).all()
    # max_depth: the tree above is 2 deep (nodes 3, 4, 5); a wider output pads with -1.
    wide = verify_tree(lg, toks, parents, draft_probs=q, temperature=1.0, seed=torch.arange(64), max_depth=8)
    assert wide.tokens.shape == (64, 9)
    assert torch.equal(wide.tokens[:, :6], r.tokens) and (wide.tokens[:, 6:] == -1).all()
    with pytest.raises(ValueError, match="max_depth=1"):
        verify_tree(lg, toks, parents, max_depth=1)
    shallow = verify_tree(lg, toks, parents, draft_probs=q, temperature=1.0, seed=torch.arange(64), max_depth=2)
    assert torch.equal(shallow.tokens, r.tokens[:, :3])


def test_low_precision_logits_and_int32_tokens():
    lg, toks, parents, q = _random_inputs()
    kw = dict(temperature=0.7, top_p=0.9, seed=torch.arange(32))
    for dt in (torch.bfloat16, torch.float16):
        a = verify_tree(lg.to(dt), toks.int(), parents, draft_probs=q.to(dt), **kw)
        b = verify_tree(lg.to(dt).float(), toks, parents, draft_probs=q.to(dt).float(), **kw)
        assert torch.equal(a.tokens, b.tokens)


def _assert_flagged_only(got, clean, flagged):
    """``flagged`` requests carry the error flag with reset outputs; every other request equals ``clean``."""
    T1 = got.tokens.shape[1]
    assert got.error.tolist() == [int(b in flagged) for b in range(got.error.shape[0])]
    for b in range(got.error.shape[0]):
        if b in flagged:
            assert got.num_accepted[b] == 0 and (got.tokens[b] == -1).all()
            assert got.accepted_nodes[b].tolist() == [0] + [-1] * (T1 - 1)
            assert got.stats is None or (got.stats[b] == 0).all()
        else:
            for x, y in zip(got, clean):
                assert y is None or torch.equal(x[b], y[b])


def test_nan_and_inf_rows_flag_only_their_request():
    """The issue's contract on every backend, the reference included: a visited row with NaN/+inf (or only -inf)
    sets its request's error flag, resets its outputs and never touches another request's; unvisited rows do not
    matter."""
    lg, toks, parents, _ = _random_inputs(B=4, T=6)
    greedy = verify_tree(lg, toks, parents, return_stats=True)
    assert (greedy.error == 0).all()
    bad = lg.clone()
    bad[2, 0, 3] = float("nan")  # the root's row
    _assert_flagged_only(verify_tree(bad, toks, parents, return_stats=True), greedy, {2})
    sampled = dict(temperature=1.0, seed=torch.arange(4), return_stats=True)
    clean = verify_tree(lg, toks, parents, **sampled)
    bad = lg.clone()
    bad[1, 0] = NEG  # all -inf: no distribution
    _assert_flagged_only(verify_tree(bad, toks, parents, **sampled), clean, {1})
    # An accepted node's row with +inf is an error for its request alone.
    toks2 = toks.clone()
    toks2[:, 1] = greedy.tokens[:, 0]
    clean2 = verify_tree(lg, toks2, parents, return_stats=True)
    assert (clean2.num_accepted >= 1).all()
    bad = lg.clone()
    bad[3, 1, 0] = float("inf")
    bad[0, 1, 2] = float("nan")
    _assert_flagged_only(verify_tree(bad, toks2, parents, return_stats=True), clean2, {0, 3})
    # A row the walk never visits is not an error.
    bad = lg.clone()
    bad[:, 5] = float("nan")
    toks3 = toks.clone()
    toks3[:, 1] = (greedy.tokens[:, 0] + 1) % 10  # nodes 1 and 2 both rejected -> node 5 unvisited
    toks3[:, 2] = (greedy.tokens[:, 0] + 2) % 10
    r = verify_tree(bad, toks3, parents)
    assert (r.num_accepted == 0).all() and (r.error == 0).all()


def test_out_of_range_tried_token_flags_its_request_without_validation():
    """validate=False: a tried child's token outside [0, V) flags its request (as the kernels do) instead of being
    clamped into the vocabulary; untried children's tokens are not read."""
    B, T, V = 3, 4, 7
    g = torch.Generator().manual_seed(5)
    lg = torch.randn(B, T, V, generator=g)
    par = chain_parents(B, T)
    toks = torch.randint(0, V, (B, T), generator=g)
    toks[:, 1] = lg[:, 0].argmax(-1)  # greedy accepts node 1 everywhere, then tries node 2
    clean = verify_tree(lg, toks, par, return_stats=True)
    bad = toks.clone()
    bad[0, 2] = V + 3
    bad[1, 2] = -2
    _assert_flagged_only(verify_tree(lg, bad, par, return_stats=True, validate=False), clean, {0, 1})
    toks_rej = toks.clone()
    toks_rej[2, 1] = (toks[2, 1] + 1) % V  # request 2 rejects node 1, so node 2's token is never tried
    clean = verify_tree(lg, toks_rej, par, return_stats=True)
    bad = toks_rej.clone()
    bad[2, 2] = V + 3
    _assert_flagged_only(verify_tree(lg, bad, par, return_stats=True, validate=False), clean, set())
    with pytest.raises(ValueError, match=r"draft_tokens\[2, 2\] = 10 is outside the vocabulary"):
        verify_tree(lg, bad, par)  # validate=True rejects it up front


def empty_batch_call(backend, device="cpu"):
    """verify_tree on B = 0 with validation on (shared with the kernel backends' tests)."""
    lg = torch.randn(0, 4, 9, device=device)
    toks = torch.zeros(0, 4, dtype=torch.int64, device=device)
    par = torch.zeros(0, 4, dtype=torch.int32, device=device)
    res = verify_tree(lg, toks, par, draft_probs=torch.rand(0, 4, 9, device=device), temperature=0.7, top_p=0.9,
                      seed=torch.zeros(0, dtype=torch.int64, device=device), return_stats=True, backend=backend)
    assert res.tokens.shape == (0, 4) and res.num_accepted.shape == (0,) and res.stats.shape == (0, 3, 2)


def test_empty_batch_validates_and_returns_empty_outputs():
    empty_batch_call("torch")


class _BadInputs(NamedTuple):
    """The valid call that ``test_bad_inputs`` changes one argument of."""

    logits: torch.Tensor
    draft_tokens: torch.Tensor
    parents: torch.Tensor
    draft_probs: torch.Tensor


def _edited(t: torch.Tensor, edits) -> torch.Tensor:
    """A copy of ``t`` with ``t[where] = value`` for each ``(where, value)`` of ``edits``."""
    t = t.clone()
    for where, value in edits:
        t[where] = value
    return t


_NAN, _INF = float("nan"), float("inf")
# (id, the changed arguments of the call as a function of its inputs, the error raised, what its message matches).
BAD_INPUTS = [
    ("logits-numpy", lambda i: dict(logits=i.logits.numpy()), TypeError, "logits must be a torch.Tensor"),
    ("logits-float64", lambda i: dict(logits=i.logits.double()), TypeError, "logits must have dtype"),
    ("logits-2d", lambda i: dict(logits=i.logits[0]), ValueError, "logits must be 3-D"),
    ("tokens-float", lambda i: dict(draft_tokens=i.draft_tokens.float()), TypeError, "draft_tokens must have dtype"),
    ("tokens-short", lambda i: dict(draft_tokens=i.draft_tokens[:, :5]), ValueError,
     "draft_tokens has size 5 on dim 1"),
    ("parents-rows", lambda i: dict(parents=torch.cat([i.parents, i.parents[:1]])), ValueError,
     "parents has size 3 on dim 0"),
    ("num-nodes-size", lambda i: dict(num_nodes=torch.tensor([1, 2, 3], dtype=torch.int32)), ValueError,
     "num_nodes has size 3 on dim 0"),
    ("num-nodes-range", lambda i: dict(num_nodes=torch.tensor([2, 7], dtype=torch.int32)), ValueError,
     r"num_nodes\[1\] = 7 is outside"),
    ("root-parent", lambda i: dict(parents=_edited(i.parents, [((0, 0), 0)])), ValueError, "request 0, node 0"),
    ("self-parent", lambda i: dict(parents=_edited(i.parents, [((1, 4), 4)])), ValueError,
     "request 1, node 4 has parent 4"),
    ("token-past-vocab", lambda i: dict(draft_tokens=_edited(i.draft_tokens, [((1, 3), 10)])), ValueError,
     r"draft_tokens\[1, 3\] = 10 is outside the vocabulary"),
    ("token-negative", lambda i: dict(draft_tokens=_edited(i.draft_tokens, [((0, 2), -1)])), ValueError,
     r"draft_tokens\[0, 2\] = -1"),
    ("probs-vocab", lambda i: dict(draft_probs=i.draft_probs[..., :9]), ValueError, "draft_probs has size 9 on dim 2"),
    ("probs-float64", lambda i: dict(draft_probs=i.draft_probs.double()), TypeError, "draft_probs must have dtype"),
    # One corrupted draft row at a time (elements or whole rows set), then two bad rows (the first row's first bad
    # element wins).
    ("probs-negative", lambda i: dict(draft_probs=_edited(i.draft_probs, [((1, 2, 3), -0.5)])), ValueError,
     r"draft_probs\[1, 2, 3\] = -0.5"),
    ("probs-nan", lambda i: dict(draft_probs=_edited(i.draft_probs, [((0, 1, 0), _NAN)])), ValueError,
     r"draft_probs\[0, 1, 0\] = nan"),
    ("probs-minus-inf", lambda i: dict(draft_probs=_edited(i.draft_probs, [((1, 4, 2), -_INF)])), ValueError,
     r"draft_probs\[1, 4, 2\] = -inf"),
    ("probs-inf", lambda i: dict(draft_probs=_edited(i.draft_probs, [((0, 3, 7), _INF)])), ValueError,
     r"draft_probs\[0, 3, 7\] = inf"),
    ("probs-sum-overflows", lambda i: dict(draft_probs=_edited(i.draft_probs, [((1, 0), 3e38)])), ValueError,
     r"draft_probs\[1, 0\] sums to inf in float32: rows must have a finite sum"),
    ("probs-zero-row", lambda i: dict(draft_probs=_edited(i.draft_probs, [((0, 1), 0.0)])), ValueError,
     r"draft_probs\[0, 1\] sums to 0"),
    ("probs-two-bad-rows", lambda i: dict(draft_probs=_edited(i.draft_probs, [((1, 2, 3), -0.5), ((1, 3, 0), _NAN)])),
     ValueError, r"draft_probs\[1, 2, 3\] = -0.5"),
    ("temperature-negative", lambda i: dict(temperature=-1.0), ValueError, "temperature = -1"),
    ("temperature-list-nan", lambda i: dict(temperature=[1.0, _NAN]), ValueError, r"temperature\[1\] = nan"),
    ("temperature-tensor-negative", lambda i: dict(temperature=torch.tensor([-0.5, 1.0])), ValueError,
     r"temperature\[0\] = -0.5"),
    ("temperature-list-long", lambda i: dict(temperature=[1.0, 1.0, 1.0]), ValueError, "temperature has 3 entries"),
    ("temperature-tensor-long", lambda i: dict(temperature=torch.ones(3)), ValueError,
     r"temperature must be a scalar or a \[B\]=2 tensor"),
    ("top-k-float", lambda i: dict(top_k=torch.tensor([1.5, 2.0])), TypeError, "top_k must be an integer"),
    ("top-k-negative", lambda i: dict(top_k=-1), ValueError, "top_k = -1"),
    ("top-k-tensor-negative", lambda i: dict(top_k=torch.tensor([2, -3])), ValueError, r"top_k\[1\] = -3"),
    *[(f"top-p-{bad_p}", lambda i, bad_p=bad_p: dict(top_p=bad_p), ValueError, f"top_p = {bad_p}")
      for bad_p in (0.0, 1.5, -0.1)],
    ("top-p-tensor-zero", lambda i: dict(top_p=torch.tensor([0.5, 0.0])), ValueError, r"top_p\[1\]"),
    ("seed-float", lambda i: dict(seed=torch.tensor([0.5, 1.0])), TypeError, "seed must be an integer"),
    ("seed-list-long", lambda i: dict(seed=[1, 2, 3]), ValueError, "seed has 3 entries"),
    ("offset-2d", lambda i: dict(offset=torch.zeros(2, 2, dtype=torch.int64)), ValueError,
     "offset must be a scalar or a"),
    *[(f"max-depth-{bad_d}", lambda i, bad_d=bad_d: dict(max_depth=bad_d), ValueError,
       "max_depth must be a non-negative int") for bad_d in (-1, 1.5, True)],
    ("backend-unknown", lambda i: dict(backend="nope"), ValueError, "unknown backend"),
    ("backend-cuda", lambda i: dict(backend="cuda"), tlt_kernels.BackendUnavailableError, None),
]

# (id, the changed arguments): inputs that look wrong but are never read, or not checked; the call succeeds.
ACCEPTED_INPUTS = [
    # The root's token is never read.
    ("root-token-negative", lambda i: dict(draft_tokens=_edited(i.draft_tokens, [((slice(None), 0), -5)]))),
    # Node 5 is a leaf: its draft row is never used.
    ("leaf-probs-zero", lambda i: dict(draft_probs=_edited(i.draft_probs, [((slice(None), 5), 0)]))),
    # Rows past num_nodes[0] are padding: never checked.
    ("padding-probs-nan", lambda i: dict(draft_probs=_edited(i.draft_probs, [((0, slice(4, None)), _NAN)]),
                                         num_nodes=torch.tensor([4, 6], dtype=torch.int32))),
    # validate=False skips the value checks (the caller vouches for the inputs).
    ("unvalidated-root-token", lambda i: dict(draft_tokens=_edited(i.draft_tokens, [((0, 0), 99)]), validate=False)),
]


def _call_changed(change) -> VerifyResult:
    """``verify_tree`` on the small valid call of :class:`_BadInputs`, with ``change(inputs)``'s arguments instead."""
    inputs = _BadInputs(*_random_inputs(B=2, T=6, V=10))
    kw = dict(logits=inputs.logits, draft_tokens=inputs.draft_tokens, parents=inputs.parents)
    kw.update(change(inputs))
    return verify_tree(**kw)


@pytest.mark.parametrize("change, error, match", [pytest.param(*case[1:], id=case[0]) for case in BAD_INPUTS])
def test_bad_inputs(change, error, match):
    with pytest.raises(error, match=match):
        _call_changed(change)


@pytest.mark.parametrize("change", [pytest.param(case[1], id=case[0]) for case in ACCEPTED_INPUTS])
def test_inputs_never_read_or_unchecked_pass(change):
    _call_changed(change)


@pytest.mark.cuda
def test_reference_on_gpu_matches_cpu():
    lg, toks, parents, q = _random_inputs(B=64)
    kw = dict(temperature=0.8, top_k=6, top_p=0.9, seed=torch.arange(64), return_stats=True)
    cpu = verify_tree(lg, toks, parents, draft_probs=q, backend="torch", **kw)
    gpu = verify_tree(lg.cuda(), toks.cuda(), parents.cuda(), draft_probs=q.cuda(), backend="torch", **{**kw, "seed": kw["seed"].cuda()})
    for a, b in zip(cpu, gpu):  # the log-prob fields are None on both (not asked for)
        assert (a is None and b is None) or torch.equal(a, b.cpu())
