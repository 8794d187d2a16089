"""CUDA backends of verify_tree, compact_kv and build_draft_tree (tlt_kernels._C) against the references.

GPU tests compare with the torch reference (float64) and with the Triton backend on random inputs
of awkward sizes. verify_tree must give the same tokens for the same seeds; a request may differ
only through a float tie at a decision boundary (fp32 kernel vs float64 reference), so up to
``ALLOW_TIES`` requests per comparison may differ and every difference is printed. compact_kv and
build_draft_tree must match exactly. Every failure names the first mismatching request.

The CPU tests check what needs no GPU: the kernels' Philox (the same __host__ __device__ code,
evaluated on the host) against tlt_kernels.rng, the launchers' argument checks, and the glue's checks.
"""
from __future__ import annotations

import pytest
import torch

from conftest import HAS_CUDA, poison_
from tlt_kernels import build_draft_tree, compact_kv, cuda_extension_available, rng, verify_tree

ALLOW_TIES = 1


def _ext_or_skip():
    if not cuda_extension_available():
        pytest.skip("tlt_kernels._C is not built (pip install -e . with nvcc on PATH)")
    from tlt_kernels._cuda import extension

    return extension()


def _need_gpu_ext():
    if not HAS_CUDA:
        pytest.skip("needs a CUDA GPU")
    _ext_or_skip()


VERIFY_CUDA_IMPL = "tlt_kernels._cuda.verify_tree:verify_tree_cuda"


@pytest.fixture(autouse=True)
def _verify_cuda_backend(monkeypatch):
    """Route verify_tree(backend="cuda") to the CUDA glue even before ops/verify_tree.py lists it."""
    from tlt_kernels.ops import verify_tree as op

    if "cuda" not in op._BACKENDS.impls:
        monkeypatch.setitem(op._BACKENDS.impls, "cuda", VERIFY_CUDA_IMPL)
    yield


# ---------------------------------------------------------------------------------------------
# CPU: Philox bit-exactness, launcher argument checks, glue checks
# ---------------------------------------------------------------------------------------------

def test_philox_host_bit_exact():
    ext = _ext_or_skip()
    seeds = [0, 1, -1, 2**32 + 7, 2**40 + 3, -(2**63), 2**63 - 1, 12345678901, -987654321]
    offsets = [0, 5, 2**32, 2**33 + 1, -1, 7, 2**62, 3, 1]
    nodes = [0, 1, 2, 63, 64, 1000, 2**20, 5, 2**31 - 1]
    for purpose in (rng.PURPOSE_ACCEPT, rng.PURPOSE_SAMPLE):
        want = rng.uniform(torch.tensor(seeds), torch.tensor(offsets), torch.tensor(nodes), purpose)
        got = torch.tensor([ext.philox_uniform_host(s, o, n, purpose) for s, o, n in zip(seeds, offsets, nodes)],
                           dtype=torch.float32)
        assert torch.equal(got, want), f"purpose {purpose}: host {got.tolist()} vs rng {want.tolist()}"


def _verify_args(**kw):
    args = dict(logits=0, draft_probs=0, draft_tokens=0, parents=0, num_nodes=0, temperature=0, top_k=0, top_p=0,
                seed=0, offset=0, scratch=0, out_tokens=0, out_num=0, out_nodes=0, out_error=0, out_stats=0,
                logits_stride_b=0, logits_stride_t=0, q_stride_b=0, q_stride_t=0, tokens_stride_b=0,
                parents_stride_b=0, batch=1, num_tree=3, vocab=5, max_depth=2, tokens_int64=True, logits_dtype=0,
                q_dtype=0, stream=0)
    args.update(kw)
    return args


def test_launcher_argument_checks_need_no_gpu():
    ext = _ext_or_skip()
    # Every check below fails before any CUDA call, so these run on a machine without a GPU.
    with pytest.raises(ValueError, match="device pointers"):
        ext.verify_tree(**_verify_args())
    with pytest.raises(ValueError, match="max_depth"):
        ext.verify_tree(**_verify_args(max_depth=-1))
    with pytest.raises(ValueError, match="logits dtype"):
        ext.verify_tree(**_verify_args(logits_dtype=7))
    with pytest.raises(ValueError, match="need T >= 1"):
        ext.verify_tree(**_verify_args(num_tree=0))
    with pytest.raises(ValueError, match="cluster must be 0 .auto., 1, 2, 4, 8 or 16, got 3"):
        ext.verify_tree(**_verify_args(cluster_size=3))
    with pytest.raises(ValueError, match="exceeds the CUDA kernel's limit"):
        ext.verify_tree(**_verify_args(vocab=2**31 - 2))
    ext.verify_tree(**_verify_args(batch=0))  # nothing to do: no launch, no error
    ext.verify_tree(**_verify_args(batch=0, cluster_size=8))
    ext.verify_tree(**_verify_args(batch=0, cluster_size=16))
    with pytest.raises(ValueError, match="got 32"):
        ext.verify_tree(**_verify_args(cluster_size=32))
    cargs = dict(cache_ptrs=0, block_table=0, context_lens=0, accepted_nodes=0, num_accepted=0, bt_stride_b=4,
                 nodes_stride_b=3, row_bytes=64, num_caches=2, batch=1, path_len=3, block_size=16, unit=16, stream=0)
    with pytest.raises(ValueError, match="unit must be"):
        ext.compact_kv(**{**cargs, "unit": 3})
    with pytest.raises(ValueError, match="multiple of unit"):
        ext.compact_kv(**{**cargs, "row_bytes": 24})
    with pytest.raises(ValueError, match="device pointers"):
        ext.compact_kv(**cargs)
    bargs = dict(cand_parents=0, cand_tokens=0, cand_scores=0, root_tokens=0, parents=0, draft_tokens=0, cand_index=0,
                 num_nodes=0, tree_mask=0, cp_stride_b=5, ct_stride_b=5, cs_stride_b=5, batch=1, num_cand=5,
                 num_verify=4, stream=0)
    with pytest.raises(ValueError, match="up to 2048 candidates"):
        ext.build_draft_tree(**{**bargs, "num_cand": 4096})
    with pytest.raises(ValueError, match="num_verify"):
        ext.build_draft_tree(**{**bargs, "num_verify": 0})
    assert ext.BUILD_TREE_MAX_CANDIDATES == 2048 and ext.VERIFY_MAX_DEPTH == 4096


def test_glue_checks_on_cpu_tensors():
    from tlt_kernels._cuda import build_draft_tree as cb
    from tlt_kernels._cuda import compact_kv as cc
    from tlt_kernels._cuda import verify_tree as cv

    assert cb.MAX_CANDIDATES == 2048 and cv.MAX_DEPTH == 4096
    with pytest.raises(ValueError, match="N=3000"):
        cb.check_inputs(torch.zeros(2, 3000), 8)
    cb.check_inputs(torch.zeros(2, 2048), 8)
    with pytest.raises(TypeError, match="float64"):
        cv.check_inputs(torch.zeros(1, 2, 3, dtype=torch.float64), None, 1)
    with pytest.raises(ValueError, match="limit 4096"):
        cv.check_inputs(torch.zeros(1, 5000, 1), None, 4999)
    cv.check_inputs(torch.zeros(1, 5, 3, dtype=torch.bfloat16), torch.zeros(1, 5, 3, dtype=torch.float16), 4)
    caches = [torch.zeros(4, 2, 3, 8, dtype=torch.bfloat16)]  # 48-byte slots
    assert cc.access_unit(caches) == 16
    assert cc.access_unit([torch.zeros(4, 2, 1, 7, dtype=torch.float16)]) == 2  # 14-byte slots
    assert cc.access_unit([torch.zeros(64, dtype=torch.bfloat16)[1:].view(7, 1, 1, 9)]) == 2  # odd address
    with pytest.raises(ValueError, match="CUDA tensors"):
        cc.compact_kv_(caches, caches, torch.zeros(1, 2, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                       torch.zeros(1, 2, dtype=torch.int32), torch.zeros(1, dtype=torch.int32))


def test_fake_implementations_for_torch_compile():
    from torch._subclasses.fake_tensor import FakeTensorMode

    import tlt_kernels._cuda.build_draft_tree  # noqa: F401  (registers the custom ops)
    import tlt_kernels._cuda.compact_kv  # noqa: F401
    import tlt_kernels._cuda.verify_tree  # noqa: F401

    with FakeTensorMode():
        B, T, V, D = 3, 6, 11, 4
        i32 = lambda *s: torch.empty(s, dtype=torch.int32)  # noqa: E731
        i64 = lambda *s: torch.empty(s, dtype=torch.int64)  # noqa: E731
        out = torch.ops.tlt.verify_tree_cuda(torch.empty(B, T, V), i64(B, T), i32(B, T), i32(B), None, torch.empty(B),
                                             None, None, i64(B), i64(B), D, True)
        assert [tuple(t.shape) for t in out] == [(B, D + 1), (B,), (B, D + 1), (B,), (B, D, 2)]
        assert all(t.dtype == torch.int32 for t in out)
        tree = torch.ops.tlt.build_draft_tree_cuda(i32(B, 9), i64(B, 9), torch.empty(B, 9), 40, i64(B), True)
        assert [tuple(t.shape) for t in tree] == [(B, 40), (B, 40), (B, 40), (B,), (B, 40, 2)]
        assert tree[1].dtype == torch.int64
        k = torch.empty(5, 4, 2, 8, dtype=torch.bfloat16)
        new_ctx = torch.ops.tlt.compact_kv_cuda([k], [k.clone()], i32(B, 2), i32(B), i32(B, 3), i32(B))
        assert tuple(new_ctx.shape) == (B,) and new_ctx.dtype == torch.int32


# ---------------------------------------------------------------------------------------------
# GPU: verify_tree
# ---------------------------------------------------------------------------------------------

def _random_parents(B, T, g, chain_frac=0.25):
    par = torch.full((B, T), -1, dtype=torch.int32)
    for i in range(1, T):
        par[:, i] = torch.randint(0, i, (B,), generator=g, dtype=torch.int32)
    chain = torch.rand(B, generator=g) < chain_frac
    par[chain, 1:] = torch.arange(T - 1, dtype=torch.int32)
    return par


def _verify_inputs(B, T, V, seed, use_q, dtype=torch.float32, q_dtype=None):
    g = torch.Generator().manual_seed(seed)
    lg = torch.randn(B, T, V, generator=g) * 2.5
    par = _random_parents(B, T, g)
    toks = torch.randint(0, V, (B, T), generator=g)
    # Make acceptances likely: many nodes propose their parent's argmax.
    prop = lg.argmax(-1).gather(1, par.clamp(min=0).long())
    toks = torch.where(torch.rand(B, T, generator=g) < 0.6, prop, toks)
    n = torch.randint(1, T + 1, (B,), generator=g, dtype=torch.int32)
    n[0] = T
    q = None
    if use_q:
        q = torch.softmax(lg + 0.8 * torch.randn(B, T, V, generator=g), -1).to(q_dtype or torch.float32)
    return lg.to(dtype), toks, par, n, q


def _sampling_kw(name, B, g):
    if name == "greedy":
        return {}
    if name == "temp":
        return dict(temperature=0.9)
    if name == "topk":
        return dict(temperature=0.7, top_k=torch.randint(1, 12, (B,), generator=g, dtype=torch.int32))
    if name == "topp":
        return dict(temperature=1.1, top_p=torch.rand(B, generator=g) * 0.9 + 0.05)
    if name == "topk-topp":
        return dict(temperature=0.8, top_k=torch.randint(0, 40, (B,), generator=g, dtype=torch.int32),
                    top_p=torch.rand(B, generator=g) * 0.9 + 0.1)
    if name == "mixed":  # greedy and sampled requests in one batch
        temp = torch.rand(B, generator=g) * 1.5
        temp[::3] = 0.0
        return dict(temperature=temp, top_k=torch.randint(0, 8, (B,), generator=g, dtype=torch.int32),
                    top_p=torch.where(torch.rand(B, generator=g) < 0.5, torch.ones(B), torch.rand(B, generator=g) * 0.8 + 0.2))
    raise KeyError(name)


def _to(dev, kw):
    return {k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}


def _diff_requests(ref, got, label):
    """Indices of requests whose outputs differ; prints each difference."""
    bad = set()
    fields = ("tokens", "num_accepted", "accepted_nodes", "error", "stats")
    for name, x, y in zip(fields, ref, got):
        if x is None:
            assert y is None, f"{label}: {name} should be None"
            continue
        x, y = x.cpu(), y.cpu()
        assert x.shape == y.shape, f"{label}: {name} shape {tuple(y.shape)} != {tuple(x.shape)}"
        rows = (x != y).reshape(x.shape[0], -1).any(1).nonzero().flatten().tolist()
        for b in rows:
            if b not in bad:
                print(f"{label}: request {b} differs in {name}: expected {x[b].tolist()} got {y[b].tolist()}")
            bad.add(b)
    return sorted(bad)


def _check_close(ref, got, label, allow=ALLOW_TIES):
    bad = _diff_requests(ref, got, label)
    assert len(bad) <= allow, f"{label}: {len(bad)} requests differ (first: {bad[:5]}); at most {allow} float ties allowed"


VERIFY_CASES = [
    # (rule, use_q, V, T, B)
    ("greedy", False, 37, 7, 19),
    ("temp", False, 37, 13, 19),
    ("topk", False, 101, 9, 17),
    ("topp", False, 37, 11, 23),
    ("topk-topp", True, 517, 9, 13),
    ("mixed", True, 4099, 13, 9),  # > one 4096-element chunk, odd V: unaligned rows
    ("mixed", False, 5, 6, 33),
    ("topp", True, 32000, 5, 6),
    ("greedy", True, 1, 3, 4),
]


@pytest.mark.cuda
@pytest.mark.parametrize("rule,use_q,V,T,B", VERIFY_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_verify_same_tokens_as_reference_and_triton(rule, use_q, V, T, B, dtype):
    _need_gpu_ext()
    g = torch.Generator().manual_seed(V * 7 + T)
    lg, toks, par, n, q = _verify_inputs(B, T, V, seed=V + T, use_q=use_q, dtype=dtype,
                                         q_dtype=torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)
    kw = dict(num_nodes=n, draft_probs=q, seed=torch.arange(B) * 977 - 5, offset=torch.arange(B) + 2**33,
              return_stats=True, **_sampling_kw(rule, B, g))
    ref = verify_tree(lg, toks, par, backend="torch", **kw)
    got = verify_tree(lg.cuda(), toks.cuda(), par.cuda(), backend="cuda", **_to("cuda", kw))
    label = f"verify[{rule} q={use_q} V={V} T={T} B={B} {dtype}]"
    _check_close(ref, got, label + " cuda vs reference")
    tri = verify_tree(lg.cuda(), toks.cuda(), par.cuda(), backend="triton", **_to("cuda", kw))
    _check_close(tri, got, label + " cuda vs triton")
    again = verify_tree(lg.cuda(), toks.cuda(), par.cuda(), backend="cuda", **_to("cuda", kw))
    assert not _diff_requests(got, again, label + " rerun"), "the CUDA kernel must be deterministic"


# The cluster path: each request's vocabulary split over C CTAs (slices of ceil(V / C) rounded up to 8).
# V = 5 with C = 8 or 16 leaves most slices empty; 4099 and 32003 are not multiples of any slice; B is odd.
# C = 16 is the non-portable cluster size (Hopper).
CLUSTER_CASES = [
    # (rule, use_q, V, T, B)
    ("topk-topp", True, 32003, 9, 7),
    ("mixed", True, 4099, 13, 9),
    ("temp", True, 20011, 11, 5),
    ("topp", False, 8191, 7, 3),
    ("greedy", False, 20011, 9, 5),
    ("mixed", False, 5, 6, 11),
]


@pytest.mark.cuda
@pytest.mark.parametrize("rule,use_q,V,T,B", CLUSTER_CASES)
@pytest.mark.parametrize("cluster", [1, 2, 4, 8, 16])
def test_verify_cluster_sizes_same_tokens(monkeypatch, rule, use_q, V, T, B, cluster):
    _need_gpu_ext()
    from tlt_kernels._cuda import verify_tree as cv

    g = torch.Generator().manual_seed(V + T + 1)
    lg, toks, par, n, q = _verify_inputs(B, T, V, seed=V * 3 + T, use_q=use_q)
    kw = dict(num_nodes=n, draft_probs=q, seed=torch.arange(B) * 31 + 7, offset=torch.arange(B) * 5,
              return_stats=True, **_sampling_kw(rule, B, g))
    ref = verify_tree(lg, toks, par, backend="torch", **kw)
    dkw = _to("cuda", kw)
    monkeypatch.setattr(cv, "CLUSTER_SIZE", cluster)
    got = verify_tree(lg.cuda(), toks.cuda(), par.cuda(), backend="cuda", **dkw)
    label = f"verify[C={cluster} {rule} q={use_q} V={V} T={T} B={B}]"
    _check_close(ref, got, label + " cuda vs reference")
    for _ in range(2):
        again = verify_tree(lg.cuda(), toks.cuda(), par.cuda(), backend="cuda", **dkw)
        assert not _diff_requests(got, again, label + " rerun"), "the cluster kernel must be deterministic"
    monkeypatch.setattr(cv, "CLUSTER_SIZE", 1)
    single = verify_tree(lg.cuda(), toks.cuda(), par.cuda(), backend="cuda", **dkw)
    _check_close(single, got, label + " vs C=1")


@pytest.mark.cuda
@pytest.mark.parametrize("cluster", [2, 8, 16])
def test_verify_cluster_graph_capture_and_bf16(monkeypatch, cluster):
    _need_gpu_ext()
    from tlt_kernels._cuda import verify_tree as cv

    monkeypatch.setattr(cv, "CLUSTER_SIZE", cluster)
    B, T, V = 5, 9, 12347
    lg, toks, par, n, q = _verify_inputs(B, T, V, seed=21, use_q=True, dtype=torch.bfloat16, q_dtype=torch.bfloat16)
    kw = dict(num_nodes=n, draft_probs=q, temperature=0.8, top_k=40, top_p=0.9, seed=torch.arange(B), return_stats=True)
    ref = verify_tree(lg, toks, par, backend="torch", **kw)
    dev = [t.cuda() for t in (lg, toks, par)]
    dkw = _to("cuda", kw)
    got = verify_tree(*dev, backend="cuda", **dkw)
    _check_close(ref, got, f"verify[C={cluster} bf16]")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = verify_tree(*dev, backend="cuda", validate=False, **dkw)
    graph.replay()
    torch.cuda.synchronize()
    assert not _diff_requests(got, out, f"C={cluster} graph replay"), "replayed graph differs from eager"


def _full_row_and_candidates(monkeypatch, cluster, lg, toks, par, kw):
    """CUDA verify_tree with cluster size `cluster`, the top-p threshold selected over the full row, then over the
    compacted candidates (kw: CUDA tensors)."""
    from tlt_kernels._cuda import verify_tree as cv

    monkeypatch.setattr(cv, "CLUSTER_SIZE", cluster)
    out = []
    for compact in (False, True):
        monkeypatch.setattr(cv, "TOPP_COMPACT", compact)
        out.append(verify_tree(lg.cuda(), toks.cuda(), par.cuda(), backend="cuda", **kw))
    return out


TOPP_COMPACT_CASES = [
    # (rule, use_q, V, T, B, dtype, temperature scale)
    ("topp", True, 152064, 7, 5, torch.bfloat16, 1.0),  # the benchmark's shape: peaked, few candidates
    ("topp", False, 152064, 5, 3, torch.bfloat16, 3.0),  # flat: most of the row is a candidate
    ("topk-topp", True, 32003, 9, 7, torch.float32, 1.0),  # the top-k floor under the candidates' bound
    ("mixed", True, 4099, 13, 9, torch.float32, 1.0),
    ("topp", False, 5, 6, 11, torch.float32, 1.0),
]


@pytest.mark.cuda
@pytest.mark.parametrize("rule,use_q,V,T,B,dtype,scale", TOPP_COMPACT_CASES)
@pytest.mark.parametrize("cluster", [0, 1, 4, 16])
def test_verify_topp_candidates_same_bits(monkeypatch, rule, use_q, V, T, B, dtype, scale, cluster):
    """The top-p threshold selected among compacted candidates (TOPP_COMPACT) is the full row's: every token at
    or above it is a candidate. After top-k the need is the same integer, so outputs are identical; for top-p alone
    the need comes from the statistics' float Z and the normalizer from the kept candidates' 32.32 sum, so outputs
    may differ only at a float tie (at most ALLOW_TIES requests). Reruns are identical either way."""
    _need_gpu_ext()
    g = torch.Generator().manual_seed(V + T + 3)
    lg, toks, par, n, q = _verify_inputs(B, T, V, seed=V * 5 + T, use_q=use_q, dtype=dtype)
    kw = _sampling_kw(rule, B, g)
    if "temperature" in kw:
        kw["temperature"] = kw["temperature"] * scale
    kw = _to("cuda", dict(num_nodes=n, draft_probs=q, seed=torch.arange(B) * 17 + 3, return_stats=True, **kw))
    full, got = _full_row_and_candidates(monkeypatch, cluster, lg, toks, par, kw)
    label = f"verify[topp candidates C={cluster} {rule} q={use_q} V={V} T={T} B={B} {dtype} x{scale}]"
    _check_close(full, got, label + " candidates vs full row")
    again = verify_tree(lg.cuda(), toks.cuda(), par.cuda(), backend="cuda", **kw)
    assert not _diff_requests(got, again, label + " rerun")


@pytest.mark.cuda
@pytest.mark.parametrize("cluster", [1, 8])
def test_verify_topp_candidates_extremes(monkeypatch, cluster):
    """The candidate path's boundaries against the full-row select and the reference: top-p alone just below and
    above 0.999 (above it the full-row select runs), top-k then top-p up to 0.99999 (candidates = every token top-k
    keeps, at any top_p), peaked rows (Z ~ 1: the floor far below the max, one candidate kept) and near-flat rows
    (most of the row a candidate)."""
    _need_gpu_ext()
    B, T, V = 12, 4, 30011
    g = torch.Generator().manual_seed(5)
    lg = torch.randn(B, T, V, generator=g) * 2
    lg[0:4, :, 7] += 40.0  # peaked: token 7 holds all but ~1e-11 of the mass
    lg[4:6] = 0.05 * torch.randn(2, T, V, generator=g)  # near-flat
    par = torch.tensor([-1, 0, 1, 2]).repeat(B, 1).to(torch.int32)
    toks = torch.randint(0, V, (B, T), generator=g)
    toks[0:4, 1:] = 7  # the peaked rows' drafts are accepted, so the walk visits every row
    kw = dict(temperature=0.9, top_p=torch.tensor([0.05, 0.999, 0.9991, 0.9999, 0.5, 0.99, 0.999, 0.9991, 0.9, 0.95, 0.999,
                                                   0.99999]),
              top_k=torch.tensor([0, 0, 0, 0, 0, 0, 0, 0, 50, 1000, 7, 100], dtype=torch.int32),
              seed=torch.arange(B) * 3 + 1, return_stats=True)
    ref = verify_tree(lg, toks, par, backend="torch", **kw)
    full, got = _full_row_and_candidates(monkeypatch, cluster, lg, toks, par, _to("cuda", kw))
    label = f"verify[topp extremes C={cluster}]"
    _check_close(full, got, label + " candidates vs full row")
    _check_close(ref, got, label + " cuda vs reference")
    assert (got.num_accepted.cpu()[0:4] == T - 1).all(), "the peaked rows accept every draft"


@pytest.mark.cuda
@pytest.mark.parametrize("cluster", [1, 4])
def test_verify_topp_equal_keys(monkeypatch, cluster):
    """Rows whose logits are all equal: every top-p candidate has the same key, so the radix select has no bit
    left to resolve and returns that key (keep every token). Compared with the reference and between the full-row
    and candidate paths."""
    _need_gpu_ext()
    B, T, V = 6, 3, 4099
    g = torch.Generator().manual_seed(17)
    lg = torch.full((B, T, V), 0.25).add_(torch.arange(B, dtype=torch.float32).view(B, 1, 1))
    lg[1::2, :, : V // 2] = -float("inf")  # half the vocabulary masked: equal keys among the live tokens only
    par = torch.tensor([-1, 0, 1]).repeat(B, 1).to(torch.int32)
    toks = torch.randint(V // 2, V, (B, T), generator=g)
    kw = dict(temperature=0.8, top_p=torch.full((B,), 0.5), seed=torch.arange(B) * 13 + 1, offset=torch.zeros(B, dtype=torch.int64),
              return_stats=True)
    ref = verify_tree(lg, toks, par, backend="torch", **kw)
    full, got = _full_row_and_candidates(monkeypatch, cluster, lg, toks, par, _to("cuda", kw))
    label = f"verify[equal keys C={cluster}]"
    assert not _diff_requests(full, got, label), "the candidates' select must give the full row's threshold"
    _check_close(ref, got, label + " cuda vs reference")
    out = got.tokens.cpu()
    emitted = out >= 0
    assert emitted[:, 0].all(), "every request emits at least one token"
    assert (out[1::2][emitted[1::2]] >= V // 2).all(), "a masked (-inf) token was emitted"


@pytest.mark.cuda
@pytest.mark.parametrize("use_q", [False, True])
def test_verify_auto_cluster_large_vocab(monkeypatch, use_q):
    """The launcher's own C (16 at B = 1 on an H100/H200, slices of 9504 tokens) against C = 1 and the reference,
    bf16 logits with fp32 draft probabilities as in the benchmark, odd strides of the kernel's loads."""
    _need_gpu_ext()
    from tlt_kernels._cuda import verify_tree as cv

    B, T, V = 3, 7, 152064
    lg, toks, par, n, q = _verify_inputs(B, T, V, seed=99, use_q=use_q, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(5)
    for rule in ("temp", "topp", "greedy"):
        kw = dict(num_nodes=n, draft_probs=q, seed=torch.arange(B) + 11, return_stats=True, **_sampling_kw(rule, B, g))
        ref = verify_tree(lg, toks, par, backend="torch", **kw)
        dkw = _to("cuda", kw)
        monkeypatch.setattr(cv, "CLUSTER_SIZE", 0)
        got = verify_tree(lg.cuda(), toks.cuda(), par.cuda(), backend="cuda", **dkw)
        label = f"verify[auto C {rule} q={use_q} V={V}]"
        _check_close(ref, got, label + " vs reference")
        monkeypatch.setattr(cv, "CLUSTER_SIZE", 1)
        single = verify_tree(lg.cuda(), toks.cuda(), par.cuda(), backend="cuda", **dkw)
        _check_close(single, got, label + " vs C=1")


@pytest.mark.cuda
@pytest.mark.parametrize("cluster", [1, 4])
def test_verify_large_tree_not_staged(monkeypatch, cluster):
    """T above the kernel's shared-memory staging limit (2048 nodes): parents and tokens are read from global
    memory during the walk. Some requests are chains of 2099 drafts (deep walks), others random trees."""
    _need_gpu_ext()
    from tlt_kernels._cuda import verify_tree as cv

    monkeypatch.setattr(cv, "CLUSTER_SIZE", cluster)
    B, T, V = 4, 2100, 23
    lg, toks, par, n, q = _verify_inputs(B, T, V, seed=7, use_q=True)
    par[1, 1:] = torch.arange(T - 1, dtype=torch.int32)  # at least one chain
    n[1] = T
    for rule in ("greedy", "temp"):
        kw = dict(num_nodes=n, draft_probs=q, seed=torch.arange(B) * 3, return_stats=True,
                  **_sampling_kw(rule, B, torch.Generator().manual_seed(1)))
        ref = verify_tree(lg, toks, par, backend="torch", **kw)
        got = verify_tree(lg.cuda(), toks.cuda(), par.cuda(), backend="cuda", **_to("cuda", kw))
        _check_close(ref, got, f"verify[T={T} C={cluster} {rule}]")


@pytest.mark.cuda
@pytest.mark.parametrize("q_dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_verify_half_logits_strided_rows(q_dtype):
    _need_gpu_ext()
    B, T, V = 7, 9, 1000
    lg, toks, par, n, q = _verify_inputs(B, T, V, seed=5, use_q=True, dtype=torch.float16, q_dtype=q_dtype)
    # Rows with a padded stride (vocabulary padded to 1003): unaligned row starts take the scalar path.
    big = torch.full((B, T, V + 3), float("nan"), dtype=lg.dtype)
    big[..., :V] = lg
    kw = dict(num_nodes=n, draft_probs=q, temperature=0.9, top_k=50, top_p=0.9, seed=torch.arange(B), return_stats=True)
    ref = verify_tree(lg, toks, par, backend="torch", **kw)
    got = verify_tree(big.cuda()[..., :V], toks.cuda().to(torch.int32), par.cuda(), backend="cuda", **_to("cuda", kw))
    _check_close(ref, got, f"verify[fp16 logits, {q_dtype} q, strided]")


@pytest.mark.cuda
def test_verify_poisoned_outputs_and_padding():
    _need_gpu_ext()
    from tlt_kernels._cuda import verify_tree as cv

    B, T, V = 6, 8, 29
    lg, toks, par, _, q = _verify_inputs(B, T, V, seed=9, use_q=True)
    n = torch.tensor([1, 2, 3, 5, 8, 8], dtype=torch.int32)
    for b in range(B):
        lg[b, n[b]:] = float("nan")  # padding is never read
        toks[b, n[b]:] = -7
    max_depth = 5  # < T - 1: deeper nodes are never accepted
    for b in range(B):  # keep the tree within max_depth for the reference's validation
        par[b] = torch.tensor([-1, 0, 0, 1, 1, 2, 3, 4], dtype=torch.int32)
    out = tuple(poison_(torch.empty(s, dtype=torch.int32, device="cuda"))
                for s in ((B, max_depth + 1), (B,), (B, max_depth + 1), (B,), (B, max_depth, 2)))
    temp = torch.full((B,), 1.0)
    cv._launch(*(t.cuda() for t in (lg, toks, par, n, q, temp)), None, None, torch.arange(B).cuda(),
               torch.zeros(B, dtype=torch.int64).cuda(), max_depth=max_depth, return_stats=True, out=out)
    for name, t in zip(("tokens", "num", "nodes", "error", "stats"), out):
        assert not (t == -12345).any(), f"{name} has unwritten entries: {t.cpu().tolist()}"
    ref = verify_tree(lg, toks, par, num_nodes=n, draft_probs=q, temperature=1.0, seed=torch.arange(B),
                      max_depth=max_depth, return_stats=True)
    _check_close(ref, out, "verify[poisoned]", allow=0)


@pytest.mark.cuda
def test_verify_error_flags_are_per_request():
    _need_gpu_ext()
    B, T, V = 6, 5, 9
    lg, toks, _, _, _ = _verify_inputs(B, T, V, seed=4, use_q=False)
    par = torch.tensor([[-1, 0, 1, 2, 3]] * B, dtype=torch.int32)
    toks[:, 1] = lg[:, 0].argmax(-1)  # node 1 always accepted (greedy)
    bad = lg.clone()
    bad[0, 0, 3] = float("nan")  # root row NaN
    bad[1, 1, 0] = float("inf")  # accepted row +inf
    bad[2, 0] = float("-inf")  # root row all -inf
    bad[3, 4] = float("nan")  # node 4: read only if the walk gets there
    toks_bad = toks.clone()
    toks_bad[4, 2] = V + 3  # out-of-range token, tried after node 1 is accepted
    kw = dict(seed=torch.arange(B).cuda(), return_stats=True, validate=False)
    # Greedy: node 1 is surely accepted, so rows/tokens behind it are surely visited; sampled: only
    # the root rows are.
    for temperature, must in ((None, (0, 1, 2, 4)), (0.8, (0, 2))):
        got = verify_tree(bad.cuda(), toks_bad.cuda(), par.cuda(), backend="cuda", temperature=temperature, **kw)
        err = got.error.cpu().tolist()
        assert all(err[b] == 1 for b in must), f"temperature={temperature}: error flags {err}"
        for b in [b for b in range(B) if err[b]]:
            assert got.tokens[b].eq(-1).all() and int(got.num_accepted[b]) == 0, f"request {b}: {got.tokens[b].tolist()}"
            assert got.accepted_nodes[b].tolist() == [0] + [-1] * (T - 1)
            assert got.stats[b].eq(0).all()
        clean = verify_tree(lg.cuda(), toks.cuda(), par.cuda(), backend="cuda", temperature=temperature, **kw)
        assert err[5] == 0 and torch.equal(got.tokens[5], clean.tokens[5]), "request 5 changed by other requests' errors"
        # Request 3 is flagged exactly when its walk accepts node 4 (whose row is NaN).
        assert err[3] == int(int(clean.num_accepted[3]) == 4), f"request 3: error {err[3]}, clean walk {clean.accepted_nodes[3].tolist()}"
        if not err[3]:
            assert torch.equal(got.tokens[3], clean.tokens[3])
        if temperature is not None:
            for b in (1, 4):  # flagged exactly when the walk got past node 1
                assert err[b] == int(int(clean.num_accepted[b]) >= 1), f"request {b}: error {err[b]}, clean {clean.accepted_nodes[b].tolist()}"
        # The torch reference flags the same requests (one contract on every backend); greedy walks have no float ties.
        ref = verify_tree(bad, toks_bad, par, backend="torch", temperature=temperature,
                          **{**kw, "seed": torch.arange(B)})
        assert ref.error.tolist() == err
        if temperature is None:
            for x, y in zip(ref, got):
                assert torch.equal(x, y.cpu())


@pytest.mark.cuda
def test_verify_cuda_graph_capture_and_replay():
    _need_gpu_ext()
    B, T, V = 9, 7, 300
    lg, toks, par, n, q = _verify_inputs(B, T, V, seed=12, use_q=True)
    dev = lambda t: t.cuda()  # noqa: E731
    lg, toks, par, n, q = map(dev, (lg, toks, par, n, q))
    temp = torch.full((B,), 0.9, device="cuda")
    topk = torch.full((B,), 20, dtype=torch.int32, device="cuda")
    topp = torch.full((B,), 0.85, device="cuda")
    seed = torch.arange(B, device="cuda", dtype=torch.int64)
    offset = torch.zeros(B, device="cuda", dtype=torch.int64)
    call = lambda: verify_tree(lg, toks, par, num_nodes=n, draft_probs=q, temperature=temp, top_k=topk, top_p=topp,  # noqa: E731
                               seed=seed, offset=offset, return_stats=True, backend="cuda")
    call()  # warm up (lazy imports, op registration)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for step in range(3):
        offset.fill_(step * 5 + 1)
        seed.add_(1000)
        graph.replay()
        torch.cuda.synchronize()
        eager = call()
        assert not _diff_requests(eager, out, f"graph replay {step}"), "replayed graph differs from eager"


# ---------------------------------------------------------------------------------------------
# GPU: compact_kv
# ---------------------------------------------------------------------------------------------

def _compact_case(B, layers, Hkv, D, block_size, P, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randint(0, 3 * block_size, (B,), generator=g, dtype=torch.int32)
    T = P + 3  # tree nodes per request (paths use nodes < T)
    pages = [-(-(int(ctx[b]) + T) // block_size) for b in range(B)]
    max_blocks = max(pages) + 2
    num_blocks = sum(pages) + 1
    perm = torch.randperm(num_blocks - 1, generator=g).to(torch.int32)
    table = torch.full((B, max_blocks), num_blocks - 1, dtype=torch.int32)
    o = 0
    for b in range(B):
        table[b, : pages[b]] = perm[o : o + pages[b]]
        o += pages[b]
    nacc = torch.randint(0, P, (B,), generator=g, dtype=torch.int32)
    nacc[0] = P - 1
    nodes = torch.full((B, P), -1, dtype=torch.int32)
    for b in range(B):
        k = int(nacc[b])
        chain = torch.rand(1, generator=g).item() < 0.2
        path = torch.arange(k + 1) if chain else torch.cat([torch.zeros(1, dtype=torch.long), torch.randperm(T - 1, generator=g)[:k].sort().values + 1])
        nodes[b, : k + 1] = path.to(torch.int32)
    mk = lambda: [torch.randn(num_blocks, block_size, Hkv, D, generator=g).to(dtype) for _ in range(layers)]  # noqa: E731
    return mk(), mk(), table, ctx, nodes, nacc


COMPACT_CASES = [
    # (B, layers, Hkv, D, block_size, P, dtype)
    (5, 3, 2, 64, 16, 6, torch.bfloat16),
    (7, 2, 3, 24, 5, 9, torch.float16),      # awkward block size, 144-byte slots
    (3, 1, 1, 7, 4, 5, torch.float16),       # 14-byte slots: 2-byte accesses
    (4, 2, 8, 128, 16, 40, torch.bfloat16),  # long paths: narrow slabs
    (6, 2, 2, 32, 8, 4, torch.float32),
]


@pytest.mark.cuda
@pytest.mark.parametrize("B,layers,Hkv,D,block_size,P,dtype", COMPACT_CASES)
def test_compact_kv_exact(B, layers, Hkv, D, block_size, P, dtype):
    _need_gpu_ext()
    ks, vs, table, ctx, nodes, nacc = _compact_case(B, layers, Hkv, D, block_size, P, dtype, seed=B * 13 + P)
    ref_k, ref_v = [t.clone() for t in ks], [t.clone() for t in vs]
    want = compact_kv(ref_k, ref_v, table, ctx, nodes, nacc, backend="torch")
    gk, gv = [t.cuda() for t in ks], [t.cuda() for t in vs]
    got = compact_kv(gk, gv, table.cuda(), ctx.cuda(), nodes.cuda(), nacc.cuda(), backend="cuda")
    assert torch.equal(got.cpu(), want)
    for name, a, b in [("k", ref_k, gk), ("v", ref_v, gv)]:
        for layer, (x, y) in enumerate(zip(a, b)):
            diff = (x.view(-1, Hkv * D) != y.cpu().view(-1, Hkv * D)).any(1).nonzero().flatten()
            assert diff.numel() == 0, f"{name}_cache[{layer}]: flat rows {diff[:8].tolist()} differ from the reference"


@pytest.mark.cuda
def test_compact_kv_matches_triton_and_graph_replay():
    _need_gpu_ext()
    B, layers, Hkv, D, block_size, P = 6, 3, 2, 64, 16, 7
    ks, vs, table, ctx, nodes, nacc = _compact_case(B, layers, Hkv, D, block_size, P, torch.bfloat16, seed=3)
    tk, tv = [t.cuda() for t in ks], [t.cuda() for t in vs]
    compact_kv(tk, tv, table.cuda(), ctx.cuda(), nodes.cuda(), nacc.cuda(), backend="triton")
    gk, gv = [t.cuda() for t in ks], [t.cuda() for t in vs]
    args = [table.cuda(), ctx.cuda(), nodes.cuda(), nacc.cuda()]
    compact_kv(gk, gv, *args, backend="cuda", validate=False)  # warm-up also builds the pointer table
    for x, y in zip(tk + tv, gk + gv):
        assert torch.equal(x, y), "cuda and triton compaction differ"
    # Capture on fresh copies, replay, compare with the eager result.
    ck, cv = [t.cuda() for t in ks], [t.cuda() for t in vs]
    compact_kv(ck, cv, *args, backend="cuda", validate=False)
    for t, src in zip(ck + cv, ks + vs):
        t.copy_(src)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        new_ctx = compact_kv(ck, cv, *args, backend="cuda", validate=False)
    for t, src in zip(ck + cv, ks + vs):
        t.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(new_ctx.cpu(), (ctx + nacc + 1).to(torch.int32))
    for x, y in zip(gk + gv, ck + cv):
        assert torch.equal(x, y), "graph replay differs from the eager compaction"


# ---------------------------------------------------------------------------------------------
# GPU: build_draft_tree
# ---------------------------------------------------------------------------------------------

def _candidates(B, N, g, ties=False):
    par = torch.full((B, N), -1, dtype=torch.int32)
    for c in range(1, N):
        par[:, c] = torch.where(torch.rand(B, generator=g) < 0.2, torch.full((B,), -1, dtype=torch.int32),
                                torch.randint(0, c, (B,), generator=g, dtype=torch.int32))
    scores = -torch.rand(B, N, generator=g) * 8
    if ties:
        scores = (scores * 2).round() / 2  # many equal scores: tie-breaking by index matters
        scores[:, ::7] = -0.0
        scores[:, 3::7] = 0.0
    scores = torch.where(torch.rand(B, N, generator=g) < 0.1, torch.full_like(scores, float("-inf")), scores)
    tokens = torch.randint(0, 50000, (B, N), generator=g)
    roots = torch.randint(0, 50000, (B,), generator=g)
    return par, tokens, scores, roots


BUILD_CASES = [(3, 1, 1), (5, 5, 3), (7, 37, 17), (4, 37, 64), (9, 300, 64), (3, 1000, 128), (2, 2048, 128), (4, 20, 40)]


@pytest.mark.cuda
@pytest.mark.parametrize("B,N,num_verify", BUILD_CASES)
@pytest.mark.parametrize("ties", [False, True])
def test_build_draft_tree_exact(B, N, num_verify, ties):
    _need_gpu_ext()
    g = torch.Generator().manual_seed(N * 31 + num_verify + ties)
    par, tokens, scores, roots = _candidates(B, N, g, ties)
    ref = build_draft_tree(par, tokens, scores, num_verify, roots, return_mask=True, backend="torch")
    dev = [t.cuda() for t in (par, tokens, scores)]
    got = build_draft_tree(*dev, num_verify, roots.cuda(), return_mask=True, backend="cuda")
    tri = build_draft_tree(*dev, num_verify, roots.cuda(), return_mask=True, backend="triton")
    for name, x, y, z in zip(("parents", "draft_tokens", "cand_index", "num_nodes", "tree_mask"), ref, got, tri):
        x, y, z = x.cpu(), y.cpu(), z.cpu()
        rows = (x != y).reshape(B, -1).any(1).nonzero().flatten().tolist()
        assert not rows, f"{name} differs from the reference at request {rows[0]}: expected {x[rows[0]].tolist()} got {y[rows[0]].tolist()}"
        assert torch.equal(y, z), f"{name} differs from the triton backend"
    no_mask = build_draft_tree(*dev, num_verify, roots.cuda(), backend="cuda")
    assert no_mask.tree_mask is None and torch.equal(no_mask.parents, got.parents)


@pytest.mark.cuda
def test_build_draft_tree_poisoned_outputs_and_graph():
    _need_gpu_ext()
    from tlt_kernels._cuda import build_draft_tree as cb

    B, N, V = 5, 77, 40
    g = torch.Generator().manual_seed(0)
    par, tokens, scores, roots = (t.cuda() for t in _candidates(B, N, g))
    outs = [poison_(torch.empty(B, V, dtype=torch.int32, device="cuda")), poison_(torch.empty(B, V, dtype=torch.int64, device="cuda")),
            poison_(torch.empty(B, V, dtype=torch.int32, device="cuda")), poison_(torch.empty(B, dtype=torch.int32, device="cuda")),
            poison_(torch.empty(B, V, 2, dtype=torch.int32, device="cuda"))]
    cb.build_draft_tree_out(par, tokens, scores, roots, *outs)
    for name, t in zip(("parents", "draft_tokens", "cand_index", "num_nodes", "tree_mask"), outs):
        assert not (t == -12345).any(), f"{name} has unwritten entries"
    ref = build_draft_tree(par.cpu(), tokens.cpu(), scores.cpu(), V, roots.cpu(), return_mask=True, backend="torch")
    for x, y in zip(ref, outs):
        assert torch.equal(x, y.cpu())
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tree = build_draft_tree(par, tokens, scores, V, roots, return_mask=True, validate=False, backend="cuda")
    scores.copy_(scores.flip(1))  # new inputs, same buffers
    graph.replay()
    torch.cuda.synchronize()
    ref = build_draft_tree(par.cpu(), tokens.cpu(), scores.cpu(), V, roots.cpu(), return_mask=True, validate=False, backend="torch")
    for x, y in zip(ref, tree):
        assert torch.equal(x, y.cpu()), "graph replay differs from the reference"


@pytest.mark.cuda
def test_eager_direct_dispatch_matches_the_custom_op_on_the_gpu(monkeypatch):
    """Plain eager calls launch _C without the torch.library op (tlt_kernels._backend.direct_dispatch_ok); the
    op path (TLT_DIRECT_DISPATCH=0, torch.compile) must give the same bits for verify_tree and compact_kv."""
    _need_gpu_ext()
    import tlt_kernels._backend as backend
    from tlt_kernels._cuda import compact_kv as ccv
    from tlt_kernels._cuda import verify_tree as cvt

    B, T, V = 5, 9, 4099
    lg, toks, par, n, q = (t.cuda() if t is not None else None
                           for t in _verify_inputs(B, T, V, seed=17, use_q=True, dtype=torch.bfloat16))
    kw = dict(num_nodes=n, draft_probs=q, temperature=0.8, top_p=0.9, seed=torch.arange(B, device="cuda"),
              return_stats=True, validate=False, backend="cuda")
    ks, vs, table, ctx, nodes, nacc = _compact_case(4, 2, 2, 64, 16, 5, torch.bfloat16, seed=9)
    counts = {"verify": [], "compact": []}
    for name, entry in (("verify", cvt.verify_tree_cuda), ("compact", ccv.compact_kv)):
        real = entry.op
        monkeypatch.setattr(entry, "op", lambda *a, real=real, name=name: counts[name].append(1) or real(*a))
    results = []
    for direct in (True, False):
        monkeypatch.setattr(backend, "DIRECT_DISPATCH", direct)
        res = verify_tree(lg, toks, par, **kw)
        gk, gv = [t.cuda() for t in ks], [t.cuda() for t in vs]
        new_ctx = compact_kv(gk, gv, table.cuda(), ctx.cuda(), nodes.cuda(), nacc.cuda(), backend="cuda", validate=False)
        torch.cuda.synchronize()
        results.append((res, new_ctx.cpu(), [t.cpu() for t in gk + gv]))
        assert counts == ({"verify": [], "compact": []} if direct else {"verify": [1], "compact": [1]})
    (a, ctx_a, caches_a), (b, ctx_b, caches_b) = results
    for field in ("tokens", "num_accepted", "accepted_nodes", "error", "stats"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field
    assert torch.equal(ctx_a, ctx_b) and all(torch.equal(x, y) for x, y in zip(caches_a, caches_b))


@pytest.mark.cuda
def test_verify_empty_batch_with_validation():
    _need_gpu_ext()
    from test_verify_tree import empty_batch_call

    empty_batch_call("cuda", "cuda")

