"""Property tests (hypothesis) of ``ngram_propose`` and ``ngram_propose_tree``.

Valid problems: B = 0..4, L = 1..48, int32/int64 histories over small alphabets (so n-grams repeat; some with
negative or > int32 token ids), lengths 0..L with junk past each length, k 1..6, 1 <= min_n <= max_n <= 5,
1..3 branches, in every layout of :mod:`strategies`. Every backend must return exactly independent naive
prompt-lookup oracles (and the torch reference on contiguous inputs): the drafts are the continuation of the most
recent occurrence of the longest matching suffix n-gram, i.e. a continuation present in the history; the tree is a
valid trie of such continuations, padded as documented.

Invalid problems must raise ValueError/TypeError naming the argument.
Long run: ``TLT_HYPOTHESIS_PROFILE=long python -m pytest -q tests/ops/test_properties_ngram.py``.
"""
import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st

import tlt_kernels as tlt
from strategies import INT_DTYPES, assert_rejects, backend_params, budget, layouts, relayout


@st.composite
def ngram_problems(draw, max_B=4, max_L=48, min_B=0):
    B = draw(st.integers(min_B, max_B))
    L = draw(st.integers(1, max_L))
    dtype = draw(st.sampled_from(INT_DTYPES))
    alphabet = draw(st.sampled_from([[0], [0, 1], [1, 2, 3], [0, 1, 2, 3], [-1, 0, 1], [7, 2**31 - 1]] +
                                    ([[2**40, 3, 2**62]] if dtype == torch.int64 else [])))
    rows = [[draw(st.sampled_from(alphabet)) for _ in range(L)] for _ in range(B)]
    lengths = [draw(st.integers(0, L)) for _ in range(B)]
    min_n = draw(st.integers(1, 3))
    max_n = draw(st.integers(min_n, 5))
    return dict(tokens=torch.tensor(rows, dtype=dtype).reshape(B, L),
                lengths=torch.tensor(lengths, dtype=draw(st.sampled_from(INT_DTYPES))).reshape(B),
                k=draw(st.integers(1, 6)), min_n=min_n, max_n=max_n)


def _occurrences(h, min_n, max_n):
    """(n, starts most recent first) of the longest n in [min_n, max_n] whose suffix occurs earlier, or (0, [])."""
    ln = len(h)
    for n in range(max_n, min_n - 1, -1):
        if n > ln:
            continue
        suffix = h[ln - n:]
        starts = [s for s in range(ln - n - 1, -1, -1) if h[s:s + n] == suffix]  # s + n <= ln - 1
        if starts:
            return n, starts
    return 0, []


def naive_propose(p):
    B, k = p["tokens"].shape[0], p["k"]
    drafts = torch.full((B, k), -1, dtype=torch.int64)
    num = torch.zeros(B, dtype=torch.int32)
    for b in range(B):
        h = p["tokens"][b, : int(p["lengths"][b])].tolist()
        n, starts = _occurrences(h, p["min_n"], p["max_n"])
        if starts:
            cont = h[starts[0] + n: starts[0] + n + k]
            drafts[b, : len(cont)] = torch.tensor(cont, dtype=torch.int64)
            num[b] = len(cont)
    return drafts, num


def naive_tree(p, R):
    B, k = p["tokens"].shape[0], p["k"]
    T = 1 + R * k
    parents = torch.zeros(B, T, dtype=torch.int32)
    toks = torch.zeros(B, T, dtype=torch.int64)
    nn = torch.ones(B, dtype=torch.int32)
    for b in range(B):
        ln = int(p["lengths"][b])
        h = p["tokens"][b, :ln].tolist()
        parents[b, 0] = -1
        toks[b, 0] = h[-1] if ln else 0
        n, starts = _occurrences(h, p["min_n"], p["max_n"])
        child = {}
        for s in starts[:R]:
            cur = 0
            for t in h[s + n: s + n + k]:
                if (cur, t) not in child:
                    i = int(nn[b])
                    child[(cur, t)] = i
                    parents[b, i], toks[b, i] = cur, t
                    nn[b] += 1
                cur = child[(cur, t)]
    return parents, toks, nn


def _relaid(draw, p):
    out, chosen = dict(p), {}
    B, L = p["tokens"].shape
    chosen["tokens"] = draw(layouts())
    out["tokens"] = relayout(p["tokens"], chosen["tokens"], p["tokens"] + 1)
    if B > 1 and draw(st.integers(0, 4)) == 0:
        chosen["lengths"] = "expanded"  # every request at request 0's length
        out["lengths"] = relayout(p["lengths"], "expanded")
    else:
        chosen["lengths"] = draw(layouts())
        out["lengths"] = relayout(p["lengths"], chosen["lengths"], L - p["lengths"])
    return out, chosen


def _contiguous(p):
    return {k: (v.contiguous() if isinstance(v, torch.Tensor) else v) for k, v in p.items()}


@budget(30)
@given(st.data())
@pytest.mark.parametrize("backend", backend_params())
def test_ngram_propose_matches_prompt_lookup_in_every_layout(backend, data):
    _propose_matches(backend, data, min_B=1)


@budget(3)
@given(st.data())
@pytest.mark.parametrize("backend", backend_params())
def test_ngram_propose_empty_batch(backend, data):
    """B = 0 (its own property: a failure here must not stop the search on non-empty batches)."""
    _propose_matches(backend, data, max_B=0)


def _propose_matches(backend, data, **sizes):
    problem = data.draw(ngram_problems(**sizes), label="problem")
    relaid, chosen = _relaid(data.draw, problem)
    note(f"layouts: {chosen}")
    contiguous = _contiguous(relaid)
    want_d, want_n = naive_propose(contiguous)
    B, k = contiguous["tokens"].shape[0], contiguous["k"]
    # The naive oracle is the expectation; the torch backend is also run on the contiguous inputs (the reference).
    runs = [("torch reference", lambda: tlt.ngram_propose(**contiguous, backend="torch"))] if backend == "torch" else []
    runs.append((f"{backend} with layouts {chosen}", lambda: tlt.ngram_propose(**relaid, backend=backend)))
    for name, run in runs:
        res = run()
        assert res.drafts.dtype == torch.int64 and res.drafts.shape == (B, k), name
        assert res.num_drafts.dtype == torch.int32 and res.num_drafts.shape == (B,), name
        assert torch.equal(res.num_drafts, want_n), f"{name}: num_drafts {res.num_drafts.tolist()}, want {want_n.tolist()}"
        assert torch.equal(res.drafts, want_d), f"{name}: drafts {res.drafts.tolist()}, want {want_d.tolist()}"
        for b in range(B):  # a continuation present in the history, right after an occurrence of its suffix
            h = contiguous["tokens"][b, : int(contiguous["lengths"][b])].tolist()
            m = int(res.num_drafts[b])
            d = res.drafts[b, :m].tolist()
            assert m == 0 or any(h[s:s + m] == d and h[s - n:s] == h[len(h) - n:]
                                 for n in range(contiguous["min_n"], contiguous["max_n"] + 1)
                                 for s in range(n, len(h)))


@budget(25)
@given(st.data(), st.integers(1, 3))
@pytest.mark.parametrize("backend", backend_params())
def test_ngram_propose_tree_is_the_trie_of_recent_continuations(backend, data, R):
    _tree_matches(backend, data, R, min_B=1)


@budget(3)
@given(st.data(), st.integers(1, 3))
@pytest.mark.parametrize("backend", backend_params())
def test_ngram_propose_tree_empty_batch(backend, data, R):
    """B = 0 (its own property: a failure here must not stop the search on non-empty batches)."""
    _tree_matches(backend, data, R, max_B=0)


def _tree_matches(backend, data, R, **sizes):
    problem = data.draw(ngram_problems(**sizes), label="problem")
    relaid, chosen = _relaid(data.draw, problem)
    note(f"layouts: {chosen}")
    contiguous = _contiguous(relaid)
    e_par, e_tok, e_n = naive_tree(contiguous, R)
    B, T = contiguous["tokens"].shape[0], 1 + R * contiguous["k"]
    runs = [("torch reference", lambda: tlt.ngram_propose_tree(**contiguous, num_branches=R, backend="torch"))] \
        if backend == "torch" else []
    runs.append((f"{backend} with layouts {chosen}",
                 lambda: tlt.ngram_propose_tree(**relaid, num_branches=R, backend=backend)))
    for name, run in runs:
        res = run()
        assert res.parents.dtype == torch.int32 and res.parents.shape == (B, T), name
        assert res.draft_tokens.dtype == torch.int64 and res.num_nodes.dtype == torch.int32, name
        assert torch.equal(res.num_nodes, e_n), f"{name}: num_nodes {res.num_nodes.tolist()}, want {e_n.tolist()}"
        assert torch.equal(res.parents, e_par), f"{name}: parents {res.parents.tolist()}, want {e_par.tolist()}"
        assert torch.equal(res.draft_tokens, e_tok), f"{name}: draft_tokens {res.draft_tokens.tolist()}, want {e_tok.tolist()}"
        if B:
            tlt.validate_tree(res.parents, res.num_nodes)
    # With one branch the tree is ngram_propose's chain.
    if R == 1:
        d, n = naive_propose(contiguous)
        for b in range(B):
            assert e_tok[b, 1: 1 + int(n[b])].tolist() == d[b, : int(n[b])].tolist()


# ----------------------------------------------------------------------------------------------- invalid problems
def _set(p, **kw):
    return dict(p, **kw)


def _length(p, value):
    n = p["lengths"].clone()
    n[0] = value
    return _set(p, lengths=n)


INVALID = {
    "tokens float": ("tokens", lambda p: _set(p, tokens=p["tokens"].float())),
    "tokens int16": ("tokens", lambda p: _set(p, tokens=p["tokens"].to(torch.int16))),
    "tokens 1-D": ("tokens", lambda p: _set(p, tokens=p["tokens"][0])),
    "tokens 3-D": ("tokens", lambda p: _set(p, tokens=p["tokens"].unsqueeze(0))),
    "tokens L=0": ("tokens", lambda p: _set(p, tokens=p["tokens"][:, :0], lengths=p["lengths"] * 0)),
    "tokens list": ("tokens", lambda p: _set(p, tokens=p["tokens"].tolist())),
    "lengths float": ("lengths", lambda p: _set(p, lengths=p["lengths"].float())),
    "lengths shape": ("lengths", lambda p: _set(p, lengths=torch.cat([p["lengths"]] * 2))),
    "lengths 2-D": ("lengths", lambda p: _set(p, lengths=p["lengths"].unsqueeze(1))),
    "lengths negative": ("lengths", lambda p: _length(p, -1)),
    "lengths past L": ("lengths", lambda p: _length(p, p["tokens"].shape[1] + 1)),
    "lengths past int32": ("lengths", lambda p: _length(_set(p, lengths=p["lengths"].long()), 2**32)),
    "lengths device": ("lengths", lambda p: _set(p, lengths=p["lengths"].to("meta"))),
    "lengths list": ("lengths", lambda p: _set(p, lengths=p["lengths"].tolist())),
    "k 0": ("k", lambda p: _set(p, k=0)),
    "k negative": ("k", lambda p: _set(p, k=-2)),
    "k float": ("k", lambda p: _set(p, k=2.0)),
    "k bool": ("k", lambda p: _set(p, k=True)),
    "min_n 0": ("min_n", lambda p: _set(p, min_n=0)),
    "max_n 0": (("max_n", "min_n"), lambda p: _set(p, max_n=0)),
    "min_n > max_n": ("min_n", lambda p: _set(p, min_n=p["max_n"] + 1)),
    "min_n float": ("min_n", lambda p: _set(p, min_n=1.0)),
    "backend unknown": ("backend", lambda p: _set(p, backend="tpu")),
}
TREE_ONLY = {
    "num_branches 0": ("num_branches", lambda p: _set(p, num_branches=0)),
    "num_branches float": ("num_branches", lambda p: _set(p, num_branches=1.5)),
    "num_branches negative": ("num_branches", lambda p: _set(p, num_branches=-1)),
}


@budget(3)
@given(st.data())
@pytest.mark.parametrize("op", ["ngram_propose", "ngram_propose_tree"])
@pytest.mark.parametrize("case", list(INVALID) + list(TREE_ONLY))
def test_invalid_arguments_are_named(case, op, data):
    if case in TREE_ONLY and op != "ngram_propose_tree":
        pytest.skip("ngram_propose_tree only")
    problem = data.draw(ngram_problems(max_B=3, max_L=12, min_B=1))
    if op == "ngram_propose_tree":
        problem["num_branches"] = 2
    names, mutate = {**INVALID, **TREE_ONLY}[case]
    bad = dict(mutate(problem))
    backend = bad.pop("backend", "torch")
    assert_rejects(getattr(tlt, op), names, backend=backend, **bad)
