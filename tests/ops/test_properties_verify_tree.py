"""Property tests (hypothesis) of ``verify_tree``.

Valid problems: B = 0..4, T = 1..8, V = 1..48, fp32/fp16/bf16 logits (Gaussian, or rounded to halves for ties, with
-0.0 next to +0.0, -inf masks, rows of NaN / +inf / all -inf), int32/int64 tokens and parents, ragged trees,
optional draft probabilities, every form of the per-request parameters (None, scalar, list with None, ``[B]``
tensor) over edge values (tiny and huge temperatures, top-k at 1 and past V, top-p down to 1e-6), seeds and
offsets over all of int64, ``max_depth`` at and past the deepest node, stats. Every backend of this machine, on
contiguous inputs and on non-contiguous views of the same values, must return exactly the torch reference's outputs
on the contiguous layout (one Philox stream on every backend). Invariants (on the reference and every backend):
emitted tokens in ``[0, V)`` and in the support of the filtered target row, ``num_accepted <= depth``,
``accepted_nodes`` a root-to-node path whose draft tokens are the emitted ones, the error contract, stats
consistent with the path; greedy requests follow an independent greedy walk.

Invalid problems must raise ValueError/TypeError naming the argument.
Long run: ``TLT_HYPOTHESIS_PROFILE=long python -m pytest -q tests/ops/test_properties_verify_tree.py``.
"""
import math
from typing import NamedTuple

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st

import tlt_kernels as tlt
from strategies import (FLOAT_DTYPES, INT_DTYPES, assert_rejects, backend_params, budget, gen, layouts, naive_depths,
                        relayout, seeds, star_like, trees)

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
TEMPERATURES = [0.0, 1e-45, 1e-30, 1e-8, 1e-3, 0.1, 0.7, 1.0, 1.5, 100.0, 1e30]
TOP_P = [1e-6, 0.05, 0.5, 0.9, 0.999, 1.0]
BIG_INTS = [0, 1, -1, 2**31 - 1, 2**31, 2**32 + 7, -(2**40), INT64_MIN, INT64_MAX]


def _param(draw, B, values, kind, none_ok=True):
    """A per-request parameter in one of its accepted forms: None, a Python scalar, a list (maybe with None), a
    ``[B]`` tensor (int32/int64 or float32/float64/fp16) or a 0-d tensor. Returns (value, host list or None)."""
    forms = ["none", "scalar", "list", "tensor", "tensor0d"] if none_ok else ["scalar", "list", "tensor", "tensor0d"]
    form = draw(st.sampled_from(forms))
    if form == "none":
        return None, None
    if form == "scalar":
        v = draw(values)
        return v, [v] * B
    if form == "tensor0d":
        v = draw(values)
        dt = torch.int64 if kind == "int" else torch.float32
        return torch.tensor(v, dtype=dt), [torch.tensor(v, dtype=dt).item()] * B
    vals = [draw(values) for _ in range(B)]
    if form == "list":
        if none_ok and B and draw(st.booleans()):
            vals[draw(st.integers(0, B - 1))] = None
        return vals, vals
    if kind == "int":
        dt = draw(st.sampled_from(INT_DTYPES)) if all(-(2**31) <= v < 2**31 for v in vals) else torch.int64
    else:
        dt = draw(st.sampled_from([torch.float32, torch.float64]))
    t = torch.tensor(vals, dtype=dt).reshape(B)
    return t, t.tolist()


@st.composite
def verify_problems(draw, max_B=4, max_T=8, max_V=48, min_B=0):
    B = draw(st.integers(min_B, max_B))
    T = draw(st.integers(1, max_T))
    V = draw(st.integers(1, max_V))
    parents, n = draw(trees(B, T))
    g = gen(draw(seeds))
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    scale = draw(st.sampled_from([1.0, 0.0, 3.0, 20.0]))
    logits = torch.randn(B, T, V, generator=g) * scale
    if draw(st.booleans()):  # ties, and -0.0 beside +0.0
        logits = torch.round(logits * 2) / 2
        logits = torch.where((logits == 0) & (torch.rand(B, T, V, generator=g) < 0.5), -0.0, logits)
    mask_frac = draw(st.sampled_from([0.0, 0.0, 0.3, 0.9]))
    logits = torch.where(torch.rand(B, T, V, generator=g) < mask_frac, -math.inf, logits)
    special = draw(st.sampled_from(["none"] * 5 + ["nan", "+inf", "all -inf"]))
    if special != "none" and B:
        b, i, v = draw(st.integers(0, B - 1)), draw(st.integers(0, T - 1)), draw(st.integers(0, V - 1))
        if special == "nan":
            logits[b, i, v] = math.nan
        elif special == "+inf":
            logits[b, i, v] = math.inf
        else:
            logits[b, i] = -math.inf
    logits = logits.to(dtype)

    tok_dtype = draw(st.sampled_from(INT_DTYPES))
    tokens = torch.randint(0, V, (B, T), generator=g)
    # Make acceptances likely: a child often proposes its parent row's argmax.
    agree = torch.rand(B, T, generator=g) < draw(st.sampled_from([0.0, 0.5, 0.9]))
    par_live = parents.to(torch.int64).clamp(0, T - 1)
    argmax = logits.float().nan_to_num(nan=0.0).argmax(-1)  # [B, T]
    tokens = torch.where(agree, argmax.gather(1, par_live), tokens)
    idx = torch.arange(T)
    padding = idx.unsqueeze(0) >= n.unsqueeze(1)
    tokens = torch.where(padding, torch.randint(-3, V + 3, (B, T), generator=g), tokens)  # ignored by contract
    tokens[:, 0] = torch.randint(-5, V + 5, (B,), generator=g)  # the root's token is unused
    tokens = tokens.to(tok_dtype)

    draft_probs = None
    if draw(st.booleans()):
        q = torch.softmax(torch.randn(B, T, V, generator=g) * draw(st.sampled_from([0.5, 2.0, 8.0])), -1)
        if draw(st.booleans()):  # zero entries (a draft that cannot propose some tokens), keep each row's max
            keep = (torch.rand(B, T, V, generator=g) < 0.5) | (q == q.amax(-1, keepdim=True))
            q = q * keep
        if draw(st.booleans()):  # unnormalized rows are normalized internally
            q = q * 3.0
        draft_probs = q.to(draw(st.sampled_from(FLOAT_DTYPES)))

    temperature, temps = _param(draw, B, st.sampled_from(TEMPERATURES), "float")
    top_k, ks = _param(draw, B, st.sampled_from([0, 1, 2, 3, max(V - 1, 0), V, V + 5]), "int")
    top_p, ps = _param(draw, B, st.one_of(st.sampled_from(TOP_P), st.floats(1e-6, 1.0)), "float")
    seed, _ = _param(draw, B, st.sampled_from(BIG_INTS) | st.integers(INT64_MIN, INT64_MAX), "int", none_ok=False)
    offset, _ = _param(draw, B, st.sampled_from(BIG_INTS) | st.integers(0, 2**40), "int")
    depth = naive_depths(parents, n)
    deepest = int(depth.max()) if B else 0
    max_depth = draw(st.one_of(st.none(), st.integers(deepest, deepest + 2)))
    return dict(logits=logits, draft_tokens=tokens, parents=parents, num_nodes=n, draft_probs=draft_probs,
                temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, offset=offset, max_depth=max_depth,
                return_stats=draw(st.booleans())), dict(temps=temps, ks=ks, ps=ps)


TENSOR_ARGS = ("logits", "draft_tokens", "parents", "num_nodes", "draft_probs", "temperature", "top_k", "top_p", "seed",
               "offset")


def _junk(name, t, V):
    if name == "parents":
        return star_like(t)
    if name == "draft_tokens":
        return (t.to(torch.int64) + 1).remainder(max(V, 1)).to(t.dtype)
    if name == "num_nodes":
        return torch.ones_like(t)
    return None


def _relaid(draw, problem, host, V):
    """The problem with every tensor argument in a drawn layout. ``expanded``: every batch tensor is request 0's row
    broadcast with stride 0 (the per-request lists stay as they are), so the expectation is recomputed from it."""
    out = dict(problem)
    B = problem["logits"].shape[0]
    if B > 1 and draw(st.integers(0, 5)) == 0:
        host = dict(host)
        for name in TENSOR_ARGS:
            t = out[name]
            if isinstance(t, torch.Tensor) and t.dim() >= 1:
                out[name] = relayout(t, "expanded")
                hname = {"temperature": "temps", "top_k": "ks", "top_p": "ps"}.get(name)
                if hname:
                    host[hname] = [host[hname][0]] * B
        return out, host, "expanded"
    chosen = {}
    for name in TENSOR_ARGS:
        t = out[name]
        if isinstance(t, torch.Tensor) and t.dim() >= 1:
            chosen[name] = draw(layouts())
            out[name] = relayout(t, chosen[name], _junk(name, t, V))
    return out, host, chosen


def _contiguous(problem):
    return {k: (v.contiguous() if isinstance(v, torch.Tensor) else v) for k, v in problem.items()}


def _outputs(res):
    return {f: getattr(res, f) for f in ("tokens", "num_accepted", "accepted_nodes", "error", "stats")}


def _assert_same(got, want, what):
    for f, w in _outputs(want).items():
        g = _outputs(got)[f]
        if w is None:
            assert g is None, f"{what}: {f} should be None"
            continue
        assert g.dtype == w.dtype and g.shape == w.shape, f"{what}: {f} {g.dtype}{tuple(g.shape)} vs {w.dtype}{tuple(w.shape)}"
        assert torch.equal(g, w), f"{what}: {f} differs\n got {g.tolist()}\nwant {w.tolist()}"


# ----------------------------------------------------------------------------------------------- invariants
def _row_ok(row):
    return not (torch.isnan(row).any() or torch.isposinf(row).any() or torch.isneginf(row).all())


def _argmax(row):
    m = max(row.tolist())
    return next(i for i, x in enumerate(row.tolist()) if x == m)  # lowest id among ties; -0.0 == +0.0


def _support(row, temp, k, p):
    """Tokens of positive probability in the filtered target row, as a superset robust to fp32 rounding."""
    V = row.numel()
    if not temp:
        return {_argmax(row)}
    z = row.to(torch.float64) / temp
    keep = torch.isfinite(z) | (z > 0)
    if k and 0 < k < V:
        kth = z.sort(descending=True).values[k - 1]
        keep &= z >= kth
    if p is not None and p < 1:
        zz = torch.where(keep, z, torch.tensor(-math.inf, dtype=torch.float64))
        prob = torch.softmax(zz, 0)
        srt = prob.sort(descending=True).values
        reach = srt.cumsum(0) >= min(1.0, p * (1 + 1e-3) + 1e-6)
        pos = int(reach.to(torch.int8).argmax()) if reach.any() else V - 1
        keep &= prob >= srt[pos] * (1 - 1e-3)
    return set(keep.nonzero().flatten().tolist())


class _Request(NamedTuple):
    """One request of a checked call: its inputs (float64 logits ``[T, V]``, int64 parents and draft tokens ``[T]``,
    its host sampling parameters) and its outputs as Python values."""

    what: str
    b: int
    logits: torch.Tensor
    parents: torch.Tensor
    draft_tokens: torch.Tensor
    num_nodes: int
    max_depth: int
    temp: object
    k: object
    p: object
    num_accepted: int
    path: list
    out: list
    stats: object

    def children(self, node):
        return [c for c in range(1, self.num_nodes) if self.parents[c] == node]


def check_invariants(problem, host, res, what):
    """Asserts the invariants of a verify_tree result ``res`` on ``problem`` (``what`` names the call in messages)."""
    logits = problem["logits"].contiguous().to(torch.float64)
    B, T, V = logits.shape
    par = problem["parents"].contiguous().to(torch.int64)
    toks = problem["draft_tokens"].contiguous().to(torch.int64)
    n = problem["num_nodes"].contiguous().to(torch.int64)
    max_depth = T - 1 if problem["max_depth"] is None else problem["max_depth"]
    P = max_depth + 1
    assert res.tokens.shape == (B, P) and res.accepted_nodes.shape == (B, P)
    assert res.num_accepted.shape == (B,) and res.error.shape == (B,)
    for t in (res.tokens, res.num_accepted, res.accepted_nodes, res.error):
        assert t.dtype == torch.int32
    depth = naive_depths(par, n)
    temps, ks, ps = host["temps"], host["ks"], host["ps"]
    for b in range(B):
        err = int(res.error[b])
        assert err in (0, 1), f"{what}: error[{b}] = {err}"
        r = _Request(what, b, logits[b], par[b], toks[b], int(n[b]), max_depth,
                     temps[b] if temps is not None else None, ks[b] if ks is not None else None,
                     ps[b] if ps is not None else None, int(res.num_accepted[b]), res.accepted_nodes[b].tolist(),
                     res.tokens[b].tolist(), res.stats[b] if res.stats is not None else None)
        if err:
            _check_flagged(r)
            continue
        deepest = int(depth[b, : r.num_nodes].max())
        _check_path(r, deepest)
        _check_support(r)
        if not r.temp:
            _check_greedy_walk(r)
        if r.stats is not None:
            _check_stats(r)


def _check_flagged(r: _Request):
    """A flagged request has a row without a distribution, and the reset outputs."""
    what, b, P = r.what, r.b, r.max_depth + 1
    assert any(not _row_ok(r.logits[i]) for i in range(r.num_nodes)), f"{what}: request {b} flagged, all rows ok"
    assert r.num_accepted == 0 and r.out == [-1] * P and r.path == [0] + [-1] * (P - 1), f"{what}: request {b} flagged"
    if r.stats is not None:
        assert not r.stats.any()


def _check_path(r: _Request, deepest: int):
    """``accepted_nodes`` is a root-to-node path of at most ``min(max_depth, deepest)`` nodes whose draft tokens are
    the emitted ones; -1 padding after it."""
    what, b, na, path, out, P = r.what, r.b, r.num_accepted, r.path, r.out, r.max_depth + 1
    assert 0 <= na <= min(r.max_depth, deepest), f"{what}: num_accepted[{b}] = {na}"
    assert path[0] == 0 and path[na + 1:] == [-1] * (P - na - 1), f"{what}: accepted_nodes[{b}] = {path}"
    assert out[na + 1:] == [-1] * (P - na - 1), f"{what}: tokens[{b}] = {out}"
    for d in range(1, na + 1):
        node = path[d]
        assert 0 < node < r.num_nodes and r.parents[node] == path[d - 1], f"{what}: request {b} path {path} is no path"
        assert out[d - 1] == r.draft_tokens[node], (
            f"{what}: tokens[{b}, {d - 1}] = {out[d - 1]} is not node {node}'s token")


def _check_support(r: _Request):
    """Every visited row has a distribution, and each emitted token lies in ``[0, V)`` and in its filtered support."""
    what, b, out, V = r.what, r.b, r.out, r.logits.shape[1]
    for d in range(r.num_accepted + 1):
        node = r.path[d]
        row = r.logits[node]
        assert _row_ok(row), f"{what}: request {b} visited row {node} that has no distribution but no error"
        assert 0 <= out[d] < V, f"{what}: tokens[{b}, {d}] = {out[d]} outside [0, V={V})"
        assert out[d] in _support(row, r.temp, r.k, r.p), (
            f"{what}: tokens[{b}, {d}] = {out[d]} has probability 0 under row {node} (temperature {r.temp}, "
            f"top_k {r.k}, top_p {r.p}): row {row.tolist()}")


def _check_greedy_walk(r: _Request):
    """A greedy request follows an independent walk: the first child whose token is the argmax, then the argmax."""
    na = r.num_accepted
    want_path, want_out, cur = [0], [], 0
    while True:
        a = _argmax(r.logits[cur])
        kids = r.children(cur) if len(want_path) - 1 < r.max_depth else []
        hit = next((c for c in kids if r.draft_tokens[c] == a), None)
        if hit is None:
            want_out.append(a)
            break
        want_path.append(hit)
        want_out.append(a)
        cur = hit
    assert r.path[: na + 1] == want_path and r.out[: na + 1] == want_out, (
        f"{r.what}: greedy request {r.b}: path {r.path[: na + 1]} tokens {r.out[: na + 1]}, "
        f"want {want_path} {want_out}")


def _check_stats(r: _Request):
    """Stats consistent with the path: one acceptance per accepted depth, and children tried within each node's."""
    na, st_, max_depth = r.num_accepted, r.stats, r.max_depth
    assert st_.shape == (max_depth, 2)
    assert st_[:, 1].tolist() == [1] * na + [0] * (max_depth - na), f"{r.what}: stats[{r.b}] = {st_.tolist()}"
    for d in range(max_depth):
        kids = len(r.children(r.path[d])) if d <= na else 0
        tried = int(st_[d, 0])
        ok = (1 <= tried <= kids) if d < na else tried == kids  # at depth na + 1 every child was tried
        assert ok, f"{r.what}: stats[{r.b}] = {st_.tolist()} for path {r.path[: na + 1]}"


def _call(problem, backend):
    return tlt.verify_tree(**problem, backend=backend)


# ----------------------------------------------------------------------------------------------- properties
@budget(40)
@given(verify_problems(min_B=1))
def test_reference_invariants(case):
    """The torch reference itself: invariants, and the same result on a second call (pure function of the seed)."""
    problem, host = case
    res = _call(problem, "torch")
    check_invariants(problem, host, res, "torch")
    _assert_same(_call(problem, "torch"), res, "torch, second call")


@budget(12)
@given(st.data())
@pytest.mark.parametrize("backend", backend_params())
def test_backends_match_reference_in_every_layout(backend, data):
    """Each backend, on a drawn layout of every tensor argument, returns exactly the reference's outputs on the
    contiguous inputs (and satisfies the invariants)."""
    _backends_match(backend, data, min_B=1)


@budget(3)
@given(st.data())
@pytest.mark.parametrize("backend", backend_params())
def test_empty_batch(backend, data):
    """B = 0 (its own property: a failure here must not stop the search on non-empty batches)."""
    _backends_match(backend, data, max_B=0)


def _backends_match(backend, data, **sizes):
    problem, host = data.draw(verify_problems(**sizes), label="problem")
    V = problem["logits"].shape[2]
    relaid, host, chosen = _relaid(data.draw, problem, host, V)
    note(f"layouts: {chosen}")
    want = _call(_contiguous(relaid), "torch")
    got = _call(relaid, backend)
    _assert_same(got, want, f"{backend} with layouts {chosen}")
    check_invariants(relaid, host, got, backend)


@budget(10)
@given(verify_problems(max_B=3, max_T=5, max_V=16, min_B=1), st.sampled_from(BIG_INTS))
@pytest.mark.parametrize("backend", backend_params())
def test_offset_changes_only_the_coins(backend, case, offset):
    """A different offset is another valid call: the backends still agree exactly (same Philox stream)."""
    problem, host = case
    problem = dict(problem, offset=offset)
    want = _call(problem, "torch")
    _assert_same(_call(problem, backend), want, f"{backend} offset {offset}")
    check_invariants(problem, host, want, "torch")


@budget(6)
@given(verify_problems(max_B=3, max_T=5, max_V=12, min_B=1), st.sampled_from([2**31 - 1, 2**31, 2**32 + 1, 2**40, 2**63 - 1]))
@pytest.mark.parametrize("backend", backend_params())
def test_top_k_past_int32_means_off(backend, case, k):
    """``top_k >= V`` is documented as off, however large: the result equals ``top_k=None`` (or, if the op chooses to
    bound top_k, a ValueError naming it -- never a silently wrapped top_k)."""
    problem, _ = case
    problem = dict(problem, temperature=1.0, top_p=None)
    want = _call(dict(problem, top_k=None), "torch")
    try:
        got = _call(dict(problem, top_k=k), backend)
    except (ValueError, TypeError) as exc:
        assert "top_k" in str(exc), str(exc)
        return
    _assert_same(got, want, f"{backend} top_k={k}")
    got = _call(dict(problem, top_k=[k] * problem["logits"].shape[0]), backend)
    _assert_same(got, want, f"{backend} top_k=[{k}] * B")


def _wrap64(v):
    return (int(v) + 2**63) % 2**64 - 2**63


@budget(6)
@given(verify_problems(max_B=3, max_T=5, max_V=12, min_B=1), st.integers(-(2**70), 2**70), st.integers(-(2**70), 2**70),
       st.sampled_from(["scalar", "list"]))
@pytest.mark.parametrize("backend", backend_params())
def test_seeds_and_offsets_are_taken_modulo_2_64(backend, case, seed, offset, form):
    """Documented: Python integers of any size are taken modulo 2**64 (as int64 two's complement). A seed/offset
    past int64 gives exactly the result of its wrapped int64 (or a ValueError naming it, never an OverflowError)."""
    problem, _ = case
    B = problem["logits"].shape[0]
    problem = dict(problem, temperature=1.0)
    want = _call(dict(problem, seed=_wrap64(seed), offset=_wrap64(offset)), "torch")
    wrap = (lambda v: v) if form == "scalar" else (lambda v: [v] * B)
    try:
        got = _call(dict(problem, seed=wrap(seed), offset=wrap(offset)), backend)
    except (ValueError, TypeError) as exc:
        assert "seed" in str(exc) or "offset" in str(exc), str(exc)
        return
    _assert_same(got, want, f"{backend} seed {seed} offset {offset}")


# ----------------------------------------------------------------------------------------------- invalid problems
def _first_live(problem):
    """(b, i) of a live non-root node, or None."""
    n = problem["num_nodes"]
    for b in range(n.shape[0]):
        if int(n[b]) > 1:
            return b, int(n[b]) - 1
    return None


def _set(problem, **kw):
    return dict(problem, **kw)


def _tok_out_of_range(p, value):
    loc = _first_live(p)
    if loc is None:
        return None
    t = p["draft_tokens"].clone()
    t[loc] = value
    return _set(p, draft_tokens=t)


def _parents_bad(p):
    loc = _first_live(p)
    if loc is None:
        return None
    par = p["parents"].clone()
    par[loc] = loc[1]  # a node its own parent
    return _set(p, parents=par)


def _probs_bad(p, value):
    loc = _first_live(p)
    if loc is None:
        return None
    q = torch.softmax(p["logits"].float().nan_to_num(0.0, 0.0, 0.0), -1)
    b, i = loc
    q[b, int(p["parents"][b, i])] = value
    return _set(p, draft_probs=q)


B_ = lambda p: p["logits"].shape[0]  # noqa: E731
INVALID = {
    # case: (names the message may use, mutation(problem) -> problem or None to skip)
    "logits int dtype": ("logits", lambda p: _set(p, logits=p["logits"].to(torch.int32))),
    "logits fp64": ("logits", lambda p: _set(p, logits=p["logits"].double())),
    "logits 2-D": ("logits", lambda p: _set(p, logits=p["logits"][:, 0])),
    "logits not a tensor": ("logits", lambda p: _set(p, logits=p["logits"].tolist())),
    "logits V=0": ("logits", lambda p: _set(p, logits=p["logits"][..., :0])),
    "draft_tokens float": ("draft_tokens", lambda p: _set(p, draft_tokens=p["draft_tokens"].float())),
    "draft_tokens shape": ("draft_tokens", lambda p: _set(p, draft_tokens=p["draft_tokens"][:, :-1])),
    "draft_tokens batch": ("draft_tokens", lambda p: _set(p, draft_tokens=torch.cat([p["draft_tokens"]] * 2))),
    "draft_tokens device": ("draft_tokens", lambda p: _set(p, draft_tokens=p["draft_tokens"].to("meta"))),
    "draft_tokens >= V": ("draft_tokens", lambda p: _tok_out_of_range(p, p["logits"].shape[2])),
    "draft_tokens < 0": ("draft_tokens", lambda p: _tok_out_of_range(p, -1)),
    "draft_tokens huge": ("draft_tokens", lambda p: _tok_out_of_range(_set(p, draft_tokens=p["draft_tokens"].long()), 2**40)),
    "parents float": ("parents", lambda p: _set(p, parents=p["parents"].float())),
    "parents batch": ("parents", lambda p: _set(p, parents=torch.cat([p["parents"]] * 2))),
    "parents not topological": ("parents", _parents_bad),
    "parents root": ("parents", lambda p: _set(p, parents=torch.cat([p["parents"][:, :1] * 0, p["parents"][:, 1:]], 1))),
    "num_nodes float": ("num_nodes", lambda p: _set(p, num_nodes=p["num_nodes"].float())),
    "num_nodes shape": ("num_nodes", lambda p: _set(p, num_nodes=torch.cat([p["num_nodes"]] * 2))),
    "num_nodes 0": ("num_nodes", lambda p: _set(p, num_nodes=torch.zeros_like(p["num_nodes"]))),
    "num_nodes > T": ("num_nodes", lambda p: _set(p, num_nodes=p["num_nodes"] + p["parents"].shape[1])),
    "draft_probs shape": ("draft_probs", lambda p: _set(p, draft_probs=torch.ones(B_(p), p["logits"].shape[1],
                                                                                 p["logits"].shape[2] + 1))),
    "draft_probs int": ("draft_probs", lambda p: _set(p, draft_probs=torch.ones_like(p["logits"], dtype=torch.int32))),
    "draft_probs negative": ("draft_probs", lambda p: _probs_bad(p, -0.5)),
    "draft_probs nan": ("draft_probs", lambda p: _probs_bad(p, math.nan)),
    "draft_probs inf": ("draft_probs", lambda p: _probs_bad(p, math.inf)),
    "temperature negative": ("temperature", lambda p: _set(p, temperature=-0.5)),
    "temperature nan": ("temperature", lambda p: _set(p, temperature=math.nan)),
    "temperature inf": ("temperature", lambda p: _set(p, temperature=math.inf)),
    "temperature tensor negative": ("temperature", lambda p: _set(p, temperature=torch.full((B_(p),), -1.0))),
    "temperature tensor nan": ("temperature", lambda p: _set(p, temperature=torch.full((B_(p),), math.nan))),
    "temperature int tensor": ("temperature", lambda p: _set(p, temperature=torch.ones(B_(p), dtype=torch.int64))),
    "temperature list length": ("temperature", lambda p: _set(p, temperature=[1.0] * (B_(p) + 1))),
    "temperature tensor shape": ("temperature", lambda p: _set(p, temperature=torch.ones(B_(p) + 1))),
    "temperature string": ("temperature", lambda p: _set(p, temperature="hot")),
    "top_k negative": ("top_k", lambda p: _set(p, temperature=1.0, top_k=-1)),
    "top_k float": ("top_k", lambda p: _set(p, temperature=1.0, top_k=2.5)),
    "top_k float tensor": ("top_k", lambda p: _set(p, temperature=1.0, top_k=torch.ones(B_(p)))),
    "top_k tensor negative": ("top_k", lambda p: _set(p, temperature=1.0, top_k=torch.full((B_(p),), -3))),
    "top_p zero": ("top_p", lambda p: _set(p, temperature=1.0, top_p=0.0)),
    "top_p > 1": ("top_p", lambda p: _set(p, temperature=1.0, top_p=1.5)),
    "top_p nan": ("top_p", lambda p: _set(p, temperature=1.0, top_p=math.nan)),
    "top_p tensor > 1": ("top_p", lambda p: _set(p, temperature=1.0, top_p=torch.full((B_(p),), 2.0))),
    "top_p list": ("top_p", lambda p: _set(p, temperature=1.0, top_p=[0.5] * B_(p) + [0.5])),
    "seed float": ("seed", lambda p: _set(p, seed=1.5)),
    "seed float tensor": ("seed", lambda p: _set(p, seed=torch.ones(B_(p)))),
    "seed tensor shape": ("seed", lambda p: _set(p, seed=torch.ones(B_(p) + 2, dtype=torch.int64))),
    "seed device": ("seed", lambda p: _set(p, seed=torch.ones(B_(p), dtype=torch.int64, device="meta"))),
    "offset float": ("offset", lambda p: _set(p, offset=0.5)),
    "max_depth negative": ("max_depth", lambda p: _set(p, max_depth=-1)),
    "max_depth float": ("max_depth", lambda p: _set(p, max_depth=2.0)),
    "max_depth below the tree": ("max_depth", lambda p: _set(p, max_depth=0) if _first_live(p) else None),
    "backend unknown": ("backend", lambda p: _set(p, backend="tpu")),
}


@budget(3)
@given(st.data())
@pytest.mark.parametrize("case", list(INVALID))
def test_invalid_arguments_are_named(case, data):
    problem, _ = data.draw(verify_problems(max_B=3, max_T=5, max_V=12, min_B=1))
    names, mutate = INVALID[case]
    # A mutation that needs a live draft node, or a batch, skips problems without one.
    bad = mutate(dict(problem, logits=problem["logits"].nan_to_num(0.0, 0.0, 0.0) if problem["logits"].numel() else
                      problem["logits"]))
    if bad is None:
        return
    kw = dict(bad)
    backend = kw.pop("backend", "torch")
    assert_rejects(tlt.verify_tree, names, backend=backend, **kw)
