"""Property tests (hypothesis) of ``build_draft_tree``.

Valid problems: B = 0..4, N = 0..12 candidates in random topological order, scores either cumulative log-probs
(never increasing along a path) or arbitrary, with ties, -0.0 beside +0.0 and -inf (unusable, with its subtree),
``num_verify`` 1..N+3, with and without the mask, in every layout of :mod:`strategies`. Every backend must return
exactly an independent greedy-frontier selection (and the torch reference on contiguous inputs); the output is a
valid, ancestor-closed tree whose tokens are the candidates' tokens, padded as documented, whose mask is the
ancestor mask, and with cumulative scores it is plain top-(num_verify - 1).

Invalid problems must raise ValueError/TypeError naming the argument.
Long run: ``TLT_HYPOTHESIS_PROFILE=long python -m pytest -q tests/ops/test_properties_build_draft_tree.py``.
"""
import math

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st

import tlt_kernels as tlt
from strategies import assert_rejects, backend_params, budget, layouts, relayout

SCORES = [0.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.25, -7.0, -math.inf, 1.0, 2.5, -1e-30, -1e30]


@st.composite
def build_problems(draw, max_B=4, max_N=12, min_B=0):
    B = draw(st.integers(min_B, max_B))
    N = draw(st.integers(0, max_N))
    cumulative = draw(st.booleans())
    parents, tokens, scores = [], [], []
    for _ in range(B):
        par, sc = [], []
        for c in range(N):
            p = draw(st.integers(-1, c - 1))
            par.append(p)
            if cumulative:  # a child's score never exceeds its parent's
                step = draw(st.sampled_from([0.0, -0.0, -0.25, -0.5, -1.0, -3.0, -math.inf]))
                base = sc[p] if p >= 0 else draw(st.sampled_from([0.0, -0.0, -0.5, -1.0, -2.0]))
                sc.append(base + step)
            else:
                sc.append(draw(st.sampled_from(SCORES) | st.floats(-10, 10, width=32)))
        parents.append(par)
        scores.append(sc)
        tokens.append([draw(st.integers(-(2**40), 2**40)) if draw(st.booleans()) else draw(st.integers(0, 50))
                       for _ in range(N)])
    num_verify = draw(st.integers(1, N + 3))
    roots = [draw(st.integers(0, 2**40)) for _ in range(B)]
    return dict(cand_parents=torch.tensor(parents, dtype=torch.int32).reshape(B, N),
                cand_tokens=torch.tensor(tokens, dtype=torch.int64).reshape(B, N),
                cand_scores=torch.tensor(scores, dtype=torch.float32).reshape(B, N),
                num_verify=num_verify, root_tokens=torch.tensor(roots, dtype=torch.int64).reshape(B),
                return_mask=draw(st.booleans())), cumulative


def naive_select(par, scores, num_select):
    """Greedy frontier selection: repeatedly the best usable candidate whose parent is the root or taken (ties ->
    lower index; -0.0 == +0.0)."""
    N = len(par)
    taken = [False] * N
    for _ in range(num_select):
        best = None
        for c in range(N):
            if taken[c] or scores[c] == -math.inf or (par[c] >= 0 and not taken[par[c]]):
                continue
            if best is None or scores[c] > scores[best]:
                best = c
        if best is None:
            break
        taken[best] = True
    return [c for c in range(N) if taken[c]]


def expected_tree(p):
    B, N = p["cand_scores"].shape
    V = p["num_verify"]
    par_out = torch.zeros(B, V, dtype=torch.int32)
    tok_out = torch.zeros(B, V, dtype=torch.int64)
    idx_out = torch.full((B, V), -1, dtype=torch.int32)
    nn = torch.zeros(B, dtype=torch.int32)
    for b in range(B):
        par = p["cand_parents"][b].tolist()
        kept = naive_select(par, p["cand_scores"][b].tolist(), V - 1)
        node_of = {c: i + 1 for i, c in enumerate(kept)}
        par_out[b, 0] = -1
        tok_out[b, 0] = int(p["root_tokens"][b])
        for c, i in node_of.items():
            par_out[b, i] = 0 if par[c] < 0 else node_of[par[c]]
            tok_out[b, i] = int(p["cand_tokens"][b, c])
            idx_out[b, i] = c
        nn[b] = 1 + len(kept)
    return par_out, tok_out, idx_out, nn


def _call(p, backend):
    return tlt.build_draft_tree(p["cand_parents"], p["cand_tokens"], p["cand_scores"], p["num_verify"], p["root_tokens"],
                                return_mask=p["return_mask"], backend=backend)


ARGS = ("cand_parents", "cand_tokens", "cand_scores", "root_tokens")


def _relaid(draw, p):
    out, chosen = dict(p), {}
    B = p["cand_scores"].shape[0]
    if B > 1 and draw(st.integers(0, 5)) == 0:
        for name in ARGS:
            out[name] = relayout(p[name], "expanded")
        return out, "expanded"
    for name in ARGS:
        chosen[name] = draw(layouts())
        t = p[name]
        junk = None
        if name == "cand_parents":
            junk = torch.full_like(t, -1)  # every candidate a child of the root: valid, usually different
        elif name == "cand_scores":
            junk = torch.zeros_like(t)
        out[name] = relayout(t, chosen[name], junk)
    return out, chosen


@budget(30)
@given(st.data())
@pytest.mark.parametrize("backend", backend_params())
def test_build_draft_tree_matches_greedy_frontier_in_every_layout(backend, data):
    _matches_greedy_frontier(backend, data, min_B=1)


@budget(3)
@given(st.data())
@pytest.mark.parametrize("backend", backend_params())
def test_empty_batch(backend, data):
    """B = 0 (its own property: a failure here must not stop the search on non-empty batches)."""
    _matches_greedy_frontier(backend, data, max_B=0)


def _matches_greedy_frontier(backend, data, **sizes):
    problem, cumulative = data.draw(build_problems(**sizes), label="problem")
    relaid, chosen = _relaid(data.draw, problem)
    note(f"layouts: {chosen}")
    contiguous = {k: (v.contiguous() if isinstance(v, torch.Tensor) else v) for k, v in relaid.items()}
    B, N = contiguous["cand_scores"].shape
    V = contiguous["num_verify"]
    e_par, e_tok, e_idx, e_n = expected_tree(contiguous)
    # The naive oracle is the expectation; the torch backend is also run on the contiguous inputs (the reference).
    runs = [("torch reference", lambda: _call(contiguous, "torch"))] if backend == "torch" else []
    runs.append((f"{backend} with layouts {chosen}", lambda: _call(relaid, backend)))
    for name, run in runs:
        res = run()
        assert res.parents.dtype == torch.int32 and res.parents.shape == (B, V), name
        assert res.draft_tokens.dtype == torch.int64 and res.cand_index.dtype == torch.int32, name
        assert res.num_nodes.dtype == torch.int32 and res.num_nodes.shape == (B,), name
        assert torch.equal(res.cand_index, e_idx), f"{name}: cand_index {res.cand_index.tolist()}, want {e_idx.tolist()}"
        assert torch.equal(res.num_nodes, e_n), f"{name}: num_nodes {res.num_nodes.tolist()}, want {e_n.tolist()}"
        assert torch.equal(res.parents, e_par), f"{name}: parents {res.parents.tolist()}, want {e_par.tolist()}"
        assert torch.equal(res.draft_tokens, e_tok), f"{name}: draft_tokens {res.draft_tokens.tolist()}"
        if B:
            tlt.validate_tree(res.parents, res.num_nodes)
        if contiguous["return_mask"]:
            assert res.tree_mask is not None and res.tree_mask.shape == (B, V, (V + 31) // 32), name
            assert torch.equal(res.tree_mask, tlt.tree_ancestor_mask_packed(e_par, e_n)), f"{name}: tree_mask"
        else:
            assert res.tree_mask is None, name
    # Ancestor-closed, and with cumulative scores plain top-(V-1) of the usable scores.
    for b in range(B):
        kept = set(e_idx[b, 1: int(e_n[b])].tolist())
        par = contiguous["cand_parents"][b].tolist()
        sc = contiguous["cand_scores"][b].tolist()
        assert all(par[c] < 0 or par[c] in kept for c in kept)
        if cumulative:
            reachable = [c for c in range(N) if _usable_path(c, par, sc)]
            assert len(kept) == min(V - 1, len(reachable))
            if kept and len(kept) < len(reachable):
                assert min(sc[c] for c in kept) >= max(sc[c] for c in reachable if c not in kept)


def _usable_path(c, par, sc):
    while c >= 0:
        if sc[c] == -math.inf:
            return False
        c = par[c]
    return True


# ----------------------------------------------------------------------------------------------- invalid problems
def _set(p, **kw):
    return dict(p, **kw)


def _entry(p, name, value, col=None):
    t = p[name].clone()
    N = t.shape[1]
    if N == 0:
        return None
    t[0, N - 1 if col is None else min(col, N - 1)] = value
    return _set(p, **{name: t})


B_ = lambda p: p["cand_scores"].shape[0]  # noqa: E731
INVALID = {
    "cand_scores fp16": ("cand_scores", lambda p: _set(p, cand_scores=p["cand_scores"].half())),
    "cand_scores int": ("cand_scores", lambda p: _set(p, cand_scores=p["cand_scores"].to(torch.int32))),
    "cand_scores 1-D": ("cand_scores", lambda p: _set(p, cand_scores=p["cand_scores"][0])),
    "cand_scores nan": ("cand_scores", lambda p: _entry(p, "cand_scores", math.nan)),
    "cand_scores list": ("cand_scores", lambda p: _set(p, cand_scores=p["cand_scores"].tolist())),
    "cand_parents float": ("cand_parents", lambda p: _set(p, cand_parents=p["cand_parents"].float())),
    "cand_parents shape": ("cand_parents", lambda p: _set(p, cand_parents=torch.cat([p["cand_parents"]] * 2, 1))
                           if p["cand_parents"].shape[1] else None),
    "cand_parents batch": ("cand_parents", lambda p: _set(p, cand_parents=torch.cat([p["cand_parents"]] * 2))),
    "cand_parents self": ("cand_parents", lambda p: _entry(p, "cand_parents", p["cand_parents"].shape[1] - 1)),
    "cand_parents later": ("cand_parents", lambda p: _entry(p, "cand_parents", p["cand_parents"].shape[1])),
    "cand_parents below -1": ("cand_parents", lambda p: _entry(p, "cand_parents", -2)),
    "cand_parents device": ("cand_parents", lambda p: _set(p, cand_parents=p["cand_parents"].to("meta"))),
    "cand_tokens float": ("cand_tokens", lambda p: _set(p, cand_tokens=p["cand_tokens"].float())),
    "cand_tokens int32": ("cand_tokens", lambda p: _set(p, cand_tokens=p["cand_tokens"].int())),
    "cand_tokens batch": ("cand_tokens", lambda p: _set(p, cand_tokens=torch.cat([p["cand_tokens"]] * 2))),
    "root_tokens shape": ("root_tokens", lambda p: _set(p, root_tokens=p["root_tokens"].reshape(B_(p), 1))),
    "root_tokens dtype": ("root_tokens", lambda p: _set(p, root_tokens=p["root_tokens"].float())),
    "root_tokens scalar": ("root_tokens", lambda p: _set(p, root_tokens=5)),
    "num_verify 0": ("num_verify", lambda p: _set(p, num_verify=0)),
    "num_verify negative": ("num_verify", lambda p: _set(p, num_verify=-3)),
    "num_verify float": ("num_verify", lambda p: _set(p, num_verify=2.0)),
    "num_verify bool": ("num_verify", lambda p: _set(p, num_verify=True)),
    "num_verify tensor": ("num_verify", lambda p: _set(p, num_verify=torch.tensor(2))),
    "backend unknown": ("backend", lambda p: _set(p, backend="tpu")),
}


@budget(3)
@given(st.data())
@pytest.mark.parametrize("case", list(INVALID))
def test_invalid_arguments_are_named(case, data):
    problem, _ = data.draw(build_problems(max_B=3, max_N=6, min_B=1))
    names, mutate = INVALID[case]
    bad = mutate(problem)
    if bad is None:
        return
    bad = dict(bad)
    backend = bad.pop("backend", "torch")
    assert_rejects(tlt.build_draft_tree, names, bad["cand_parents"], bad["cand_tokens"], bad["cand_scores"],
                   bad["num_verify"], bad["root_tokens"], return_mask=bad["return_mask"], backend=backend)
