"""Property tests (hypothesis) of ``compact_kv`` (in place: the whole cache is compared after the call).

Valid problems: B = 0..4, tree sizes 1..8, block sizes 1..8, odd head sizes, 1..3 layers (a tensor, a list or a
tuple; layers that are slices of one buffer), fp32/fp16/bf16 caches holding NaN/inf (moved bit for bit), random
strictly increasing paths, distinct pages per request in random order with junk (-1 / past the cache) in the table
entries no slot touches, int32/int64 tables, in every layout of :mod:`strategies`. Every backend must leave exactly
the caches of a naive per-slot move (and of the torch reference on contiguous inputs), every other slot untouched,
and return ``context_lens + num_accepted + 1``.

Invalid problems must raise ValueError/TypeError naming the argument.
Long run: ``TLT_HYPOTHESIS_PROFILE=long python -m pytest -q tests/ops/test_properties_compact_kv.py``.
"""
import math

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st

import tlt_kernels as tlt
from strategies import (FLOAT_DTYPES, INT_DTYPES, assert_rejects, backend_params, bits_equal, budget, gen, layouts,
                        relayout, seeds)


@st.composite
def compact_problems(draw, max_B=4, max_T=8, min_B=0):
    B = draw(st.integers(min_B, max_B))
    T = draw(st.integers(1, max_T))
    bs = draw(st.integers(1, 8))
    H = draw(st.integers(1, 2))
    D = draw(st.sampled_from([1, 3, 8]))
    layers = draw(st.integers(1, 3))
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    g = gen(draw(seeds))
    ctx = [draw(st.integers(0, 20)) for _ in range(B)]
    P = draw(st.integers(1, T + 1))
    paths, nacc = [], []
    for _ in range(B):
        na = draw(st.integers(0, min(T - 1, P - 1)))
        nodes = sorted(draw(st.sets(st.integers(1, T - 1), min_size=na, max_size=na))) if na else []
        pad = draw(st.sampled_from([-1, "junk"]))
        tail = [-1 if pad == -1 else draw(st.integers(-1, T + 3)) for _ in range(P - 1 - na)]
        paths.append([0] + nodes + tail)
        nacc.append(na)
    W = max([-(-(c + T) // bs) for c in ctx] + [1]) + draw(st.integers(0, 1))
    num_blocks = B * W + draw(st.integers(0, 3))
    perm = torch.randperm(num_blocks, generator=g)[: B * W].reshape(B, W)
    table = perm.clone()
    for b in range(B):  # entries past the slots this request touches are junk
        used = -(-(ctx[b] + T) // bs)
        junk = draw(st.sampled_from(["keep", "-1", "past"]))
        if junk != "keep":
            table[b, used:] = -1 if junk == "-1" else num_blocks + 5
    idx_dtype = draw(st.sampled_from(INT_DTYPES))
    shared = draw(st.booleans())  # layers as slices of one buffer
    def cache():
        buf = torch.randn(2 * layers, num_blocks, bs, H, D, generator=g)
        special = torch.rand(buf.shape, generator=g)
        buf = torch.where(special < 0.05, math.nan, torch.where(special > 0.97, -math.inf, buf)).to(dtype)
        return buf
    buf = cache()
    ks = [buf[i] for i in range(layers)] if shared else [buf[i].clone() for i in range(layers)]
    vs = [buf[layers + i] for i in range(layers)] if shared else [buf[layers + i].clone() for i in range(layers)]
    form = draw(st.sampled_from(["tensor", "list", "tuple"])) if layers == 1 else draw(st.sampled_from(["list", "tuple"]))
    return dict(
        k_cache=ks, v_cache=vs, form=form,
        block_table=table.to(idx_dtype).reshape(B, W),
        context_lens=torch.tensor(ctx, dtype=draw(st.sampled_from(INT_DTYPES))).reshape(B),
        accepted_nodes=torch.tensor(paths, dtype=draw(st.sampled_from(INT_DTYPES))).reshape(B, P),
        num_accepted=torch.tensor(nacc, dtype=draw(st.sampled_from(INT_DTYPES))).reshape(B),
    )


def _caches(p, ks, vs):
    if p["form"] == "tensor":
        return ks[0], vs[0]
    if p["form"] == "tuple":
        return tuple(ks), tuple(vs)
    return list(ks), list(vs)


def naive_compact(p):
    """The expected caches: for each request, read every path slot first, then write them to ``ctx + d``."""
    ks = [k.clone() for k in p["k_cache"]]
    vs = [v.clone() for v in p["v_cache"]]
    bs = ks[0].shape[1]
    table = p["block_table"].contiguous()
    for b in range(table.shape[0]):
        c = int(p["context_lens"][b])
        na = int(p["num_accepted"][b])
        nodes = [int(x) for x in p["accepted_nodes"][b, : na + 1]]
        slot = lambda s: (int(table[b, s // bs]), s % bs)  # noqa: E731
        for layer in ks + vs:
            rows = [layer[slot(c + n)].clone() for n in nodes]
            for d, row in enumerate(rows):
                layer[slot(c + d)] = row
    return ks, vs


def _fresh(p):
    """A deep copy of the caches (the op runs in place), keeping the shared-buffer structure."""
    q = dict(p)
    ks, vs = p["k_cache"], p["v_cache"]
    if ks[0]._base is not None and all(t._base is ks[0]._base for t in ks + vs):
        base = ks[0]._base.clone()
        L = len(ks)
        q["k_cache"], q["v_cache"] = [base[i] for i in range(L)], [base[L + i] for i in range(L)]
    else:
        q["k_cache"], q["v_cache"] = [k.clone() for k in ks], [v.clone() for v in vs]
    return q


INDEX_ARGS = ("block_table", "context_lens", "accepted_nodes", "num_accepted")


def _relaid(draw, p):
    out, chosen = dict(p), {}
    for name in INDEX_ARGS:
        opts = ("contiguous", "offset", "strided", "column", "wide_rows", "colmajor")
        chosen[name] = draw(layouts(opts))
        t = p[name]
        junk = t.flip(0) if t.shape[0] > 1 else None
        if name == "num_accepted":
            junk = torch.zeros_like(t)
        if name == "context_lens":
            junk = (t + 1) if t.numel() else t
        out[name] = relayout(t, chosen[name], junk)
    if p["context_lens"].shape[0] > 1 and draw(st.booleans()) and _ctx_uniform_ok(p):
        out["context_lens"] = relayout(p["context_lens"], "expanded")  # every request at request 0's length
        chosen["context_lens"] = "expanded"
    return out, chosen


def _ctx_uniform_ok(p):
    """Whether request 0's context length fits every request's table (all tables are equally long; the junk
    entries start where a request's own slots end, so only requests without junk qualify)."""
    c0 = int(p["context_lens"][0])
    bs = p["k_cache"][0].shape[1]
    T = int(p["accepted_nodes"].max()) + 1
    for b in range(p["block_table"].shape[0]):
        need = -(-(c0 + T) // bs)
        if need > p["block_table"].shape[1] or (p["block_table"][b, :need] < 0).any() or \
                (p["block_table"][b, :need] >= p["k_cache"][0].shape[0]).any():
            return False
    return True


def _run(p, backend):
    k, v = _caches(p, p["k_cache"], p["v_cache"])
    return tlt.compact_kv(k, v, p["block_table"], p["context_lens"], p["accepted_nodes"], p["num_accepted"],
                          backend=backend)


@budget(25)
@given(st.data())
@pytest.mark.parametrize("backend", backend_params())
def test_compact_kv_moves_exactly_the_path(backend, data):
    _moves_exactly_the_path(backend, data, min_B=1)


@budget(3)
@given(st.data())
@pytest.mark.parametrize("backend", backend_params())
def test_empty_batch(backend, data):
    """B = 0 (its own property: a failure here must not stop the search on non-empty batches)."""
    _moves_exactly_the_path(backend, data, max_B=0)


def _moves_exactly_the_path(backend, data, **sizes):
    problem = data.draw(compact_problems(**sizes), label="problem")
    relaid, chosen = _relaid(data.draw, problem)
    note(f"layouts: {chosen}")
    relaid = _fresh(relaid)
    contiguous = _fresh({**relaid, **{n: relaid[n].contiguous() for n in INDEX_ARGS}})
    want_k, want_v = naive_compact(contiguous)
    want_len = (contiguous["context_lens"].to(torch.int64) + contiguous["num_accepted"] + 1).to(torch.int32)
    if backend == "torch":  # the reference on the contiguous inputs
        ref = _run(contiguous, "torch")
        for i, (a, b) in enumerate(zip(contiguous["k_cache"] + contiguous["v_cache"], want_k + want_v)):
            assert bits_equal(a, b), f"torch reference: layer tensor {i} differs from the naive move"
        assert torch.equal(ref, want_len)
    got = _run(relaid, backend)
    assert got.dtype == torch.int32 and torch.equal(got, want_len), f"{backend}: new lengths {got.tolist()}"
    for i, (a, b) in enumerate(zip(relaid["k_cache"] + relaid["v_cache"], want_k + want_v)):
        diff = (a.float() != b.float()) & ~(a.float().isnan() & b.float().isnan())
        assert bits_equal(a, b), f"{backend} with layouts {chosen}: cache tensor {i} wrong at {diff.nonzero().tolist()[:8]}"


# ----------------------------------------------------------------------------------------------- invalid problems
def _set(p, **kw):
    return dict(p, **kw)


def _nodes(p, fn):
    a = p["accepted_nodes"].clone()
    fn(a, p)
    return _set(p, accepted_nodes=a)


def _with_path(p):
    """Request 0 given a path of two nodes [0, 1] when the tree allows it (num_accepted 1)."""
    a = p["accepted_nodes"].clone()
    n = p["num_accepted"].clone()
    if a.shape[1] < 2:
        return None
    a[0, :2] = torch.tensor([0, 1])
    n[0] = 1
    return _set(p, accepted_nodes=a, num_accepted=n)


def _first_page(p, value):
    t = p["block_table"].clone()
    t[0, int(p["context_lens"][0]) // p["k_cache"][0].shape[1]] = value
    return _set(p, block_table=t)


def _fused(p):
    """K and V as the two halves of one ``[num_blocks, block_size, 2, H, D]`` buffer: non-contiguous caches."""
    k = p["k_cache"][0]
    kv = torch.stack([k, p["v_cache"][0]], 2)
    return _set(p, k_cache=[kv[:, :, 0]], v_cache=[kv[:, :, 1]], form="tensor") if not kv[:, :, 0].is_contiguous() else None


def _transposed(p):
    ks, vs = [k.transpose(2, 3) for k in p["k_cache"]], [v.transpose(2, 3) for v in p["v_cache"]]
    return None if ks[0].is_contiguous() else _set(p, k_cache=ks, v_cache=vs)


INVALID = {
    "k_cache 3-D": ("k_cache", lambda p: _set(p, k_cache=[k[0] for k in p["k_cache"]])),
    "k_cache not contiguous": ("k_cache", _fused),
    "k_cache transposed": ("k_cache", _transposed),
    "k_cache empty list": ("k_cache", lambda p: _set(p, k_cache=[], form="list")),
    "k_cache not a tensor": ("k_cache", lambda p: _set(p, k_cache=[k.tolist() for k in p["k_cache"]])),
    "k_cache layer dtype": ("k_cache", lambda p: _set(p, k_cache=p["k_cache"] + [p["k_cache"][0].double()],
                                                       v_cache=p["v_cache"] + [p["v_cache"][0]], form="list")),
    "v_cache shape": ("v_cache", lambda p: _set(p, v_cache=[v[:, :, :, :0] for v in p["v_cache"]])),
    "v_cache dtype": ("v_cache", lambda p: _set(p, v_cache=[v.double() for v in p["v_cache"]])),
    "v_cache layers": ("v_cache", lambda p: _set(p, v_cache=p["v_cache"] + p["v_cache"], form="list")),
    "v_cache device": ("v_cache", lambda p: _set(p, v_cache=[v.to("meta") for v in p["v_cache"]])),
    "accepted_nodes float": ("accepted_nodes", lambda p: _set(p, accepted_nodes=p["accepted_nodes"].float())),
    "accepted_nodes 1-D": ("accepted_nodes", lambda p: _set(p, accepted_nodes=p["accepted_nodes"][:, 0])),
    "accepted_nodes no column": ("accepted_nodes", lambda p: _set(p, accepted_nodes=p["accepted_nodes"][:, :0])),
    "accepted_nodes root": ("accepted_nodes", lambda p: _nodes(p, lambda a, p: a[0].__setitem__(0, 1))),
    "accepted_nodes not increasing": ("accepted_nodes", lambda p: (lambda q: q and _nodes(
        q, lambda a, p: a[0].__setitem__(1, 0)))(_with_path(p))),
    "accepted_nodes negative": ("accepted_nodes", lambda p: (lambda q: q and _nodes(
        q, lambda a, p: a[0].__setitem__(1, -1)))(_with_path(p))),
    "accepted_nodes past the table": ("block_table", lambda p: (lambda q: q and _nodes(
        q, lambda a, p: a[0].__setitem__(1, p["block_table"].shape[1] * p["k_cache"][0].shape[1] + 1)))(_with_path(p))),
    "accepted_nodes device": ("accepted_nodes", lambda p: _set(p, accepted_nodes=p["accepted_nodes"].to("meta"))),
    "block_table float": ("block_table", lambda p: _set(p, block_table=p["block_table"].float())),
    "block_table batch": ("block_table", lambda p: _set(p, block_table=torch.cat([p["block_table"]] * 2))),
    "block_table 1-D": ("block_table", lambda p: _set(p, block_table=p["block_table"][:, 0])),
    "block_table page negative": ("block_table", lambda p: _first_page(p, -1)),
    "block_table page past the cache": ("block_table", lambda p: _first_page(p, p["k_cache"][0].shape[0])),
    "block_table page past int32": ("block_table", lambda p: _first_page(_set(p, block_table=p["block_table"].long()),
                                                                         2**32)),
    "context_lens negative": ("context_lens", lambda p: _set(p, context_lens=p["context_lens"] - 1000)),
    "context_lens shape": ("context_lens", lambda p: _set(p, context_lens=p["context_lens"][:-1])),
    "context_lens float": ("context_lens", lambda p: _set(p, context_lens=p["context_lens"].float())),
    "context_lens past the table": (("block_table", "context_lens"), lambda p: _set(
        p, context_lens=p["context_lens"] + p["block_table"].shape[1] * p["k_cache"][0].shape[1])),
    "num_accepted negative": ("num_accepted", lambda p: _set(p, num_accepted=torch.cat([p["num_accepted"][:1] * 0 - 1,
                                                                                      p["num_accepted"][1:]]))),
    "num_accepted past the path": ("num_accepted", lambda p: _set(
        p, num_accepted=torch.full_like(p["num_accepted"], p["accepted_nodes"].shape[1]))),
    "num_accepted shape": ("num_accepted", lambda p: _set(p, num_accepted=p["num_accepted"].unsqueeze(0))),
    "num_accepted float": ("num_accepted", lambda p: _set(p, num_accepted=p["num_accepted"].float())),
    "backend unknown": ("backend", lambda p: _set(p, backend="tpu")),
}


@budget(3)
@given(st.data())
@pytest.mark.parametrize("case", list(INVALID))
def test_invalid_arguments_are_named(case, data):
    problem = data.draw(compact_problems(max_B=3, max_T=5, min_B=1))
    names, mutate = INVALID[case]
    bad = mutate(problem)
    if not bad:
        return
    bad = dict(bad)
    backend = bad.pop("backend", "torch")
    k, v = _caches(bad, bad["k_cache"], bad["v_cache"]) if bad["k_cache"] else ([], bad["v_cache"])
    before = [t.clone() for t in bad["k_cache"] + bad["v_cache"] if isinstance(t, torch.Tensor) and t.device.type == "cpu"]
    assert_rejects(tlt.compact_kv, names, k, v, bad["block_table"], bad["context_lens"], bad["accepted_nodes"],
                   bad["num_accepted"], backend=backend)
    after = [t for t in bad["k_cache"] + bad["v_cache"] if isinstance(t, torch.Tensor) and t.device.type == "cpu"]
    assert all(bits_equal(a, b) for a, b in zip(before, after)), "a rejected call modified the cache"
