"""CUDA backend of verify_tree (tlt_kernels._C) against the references.

GPU tests compare with the torch reference (float64) and with the Triton backend on random inputs
of awkward sizes. verify_tree must give the same tokens for the same seeds; a request may differ
only through a float tie at a decision boundary (fp32 kernel vs float64 reference), so up to
``ALLOW_TIES`` requests per comparison may differ and every difference is printed. Every failure names
the first mismatching request.

The CPU test checks the kernels' Philox (the same __host__ __device__ code, evaluated on the host)
against tlt_kernels.rng.
"""
from __future__ import annotations

import pytest
import torch

from conftest import poison_
from cuda_cases import ext_or_skip, need_gpu_ext, verify_cuda_backend, verify_inputs  # noqa: F401 (autouse fixture)
from tlt_kernels import rng, verify_tree

ALLOW_TIES = 1


# ---------------------------------------------------------------------------------------------
# CPU: Philox bit-exactness
# ---------------------------------------------------------------------------------------------

def test_philox_host_bit_exact():
    ext = ext_or_skip()
    seeds = [0, 1, -1, 2**32 + 7, 2**40 + 3, -(2**63), 2**63 - 1, 12345678901, -987654321]
    offsets = [0, 5, 2**32, 2**33 + 1, -1, 7, 2**62, 3, 1]
    nodes = [0, 1, 2, 63, 64, 1000, 2**20, 5, 2**31 - 1]
    for purpose in (rng.PURPOSE_ACCEPT, rng.PURPOSE_SAMPLE):
        want = rng.uniform(torch.tensor(seeds), torch.tensor(offsets), torch.tensor(nodes), purpose)
        got = torch.tensor([ext.philox_uniform_host(s, o, n, purpose) for s, o, n in zip(seeds, offsets, nodes)],
                           dtype=torch.float32)
        assert torch.equal(got, want), f"purpose {purpose}: host {got.tolist()} vs rng {want.tolist()}"


def test_parallel_rows_rule(monkeypatch):
    """The measured rule: parallel rows with a top-p filter and at most PARALLEL_MAX_ROWS rows of B x T; never
    without top-p; PARALLEL_ROWS forces either mode (CPU: no kernel runs)."""
    from tlt_kernels._cuda import verify_tree as cv

    monkeypatch.setattr(cv, "PARALLEL_ROWS", None)
    assert cv.parallel_rows(1, 5, True) and cv.parallel_rows(64, 9, True)  # 576 rows
    assert not cv.parallel_rows(256, 5, True), "1280 rows: the visited-rows walk is faster"
    assert not cv.parallel_rows(1, 5, False), "without top-p a visited row is one pass"
    monkeypatch.setattr(cv, "PARALLEL_ROWS", True)
    assert cv.parallel_rows(256, 9, False)
    monkeypatch.setattr(cv, "PARALLEL_ROWS", False)
    assert not cv.parallel_rows(1, 5, True)


# ---------------------------------------------------------------------------------------------
# GPU: verify_tree
# ---------------------------------------------------------------------------------------------

def _rows(monkeypatch, parallel):
    """Forces the CUDA walk's row mode: every node's row statistics from the rows kernel first (parallel), or each
    visited row streamed by the walk itself."""
    from tlt_kernels._cuda import verify_tree as cv

    monkeypatch.setattr(cv, "PARALLEL_ROWS", parallel)


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
@pytest.mark.parametrize("parallel", [False, True], ids=["visited-rows", "parallel-rows"])
def test_verify_same_tokens_as_reference_and_triton(monkeypatch, rule, use_q, V, T, B, dtype, parallel):
    need_gpu_ext()
    _rows(monkeypatch, parallel)
    g = torch.Generator().manual_seed(V * 7 + T)
    lg, toks, par, n, q = verify_inputs(B, T, V, seed=V + T, use_q=use_q, dtype=dtype,
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
@pytest.mark.parametrize("parallel", [False, True], ids=["visited-rows", "parallel-rows"])
def test_verify_cluster_sizes_same_tokens(monkeypatch, rule, use_q, V, T, B, cluster, parallel):
    need_gpu_ext()
    _rows(monkeypatch, parallel)
    from tlt_kernels._cuda import verify_tree as cv

    g = torch.Generator().manual_seed(V + T + 1)
    lg, toks, par, n, q = verify_inputs(B, T, V, seed=V * 3 + T, use_q=use_q)
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
    need_gpu_ext()
    from tlt_kernels._cuda import verify_tree as cv

    monkeypatch.setattr(cv, "CLUSTER_SIZE", cluster)
    B, T, V = 5, 9, 12347
    lg, toks, par, n, q = verify_inputs(B, T, V, seed=21, use_q=True, dtype=torch.bfloat16, q_dtype=torch.bfloat16)
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
@pytest.mark.parametrize("parallel", [False, True], ids=["visited-rows", "parallel-rows"])
def test_verify_topp_candidates_same_bits(monkeypatch, rule, use_q, V, T, B, dtype, scale, cluster, parallel):
    """The top-p threshold selected among compacted candidates (TOPP_COMPACT) is the full row's: every token at
    or above it is a candidate. After top-k the need is the same integer, so outputs are identical; for top-p alone
    the need comes from the statistics' float Z and the normalizer from the kept candidates' 32.32 sum, so outputs
    may differ only at a float tie (at most ALLOW_TIES requests). Reruns are identical either way; with parallel
    rows the candidates of every node go to their own scratch row."""
    need_gpu_ext()
    _rows(monkeypatch, parallel)
    g = torch.Generator().manual_seed(V + T + 3)
    lg, toks, par, n, q = verify_inputs(B, T, V, seed=V * 5 + T, use_q=use_q, dtype=dtype)
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
    need_gpu_ext()
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
    need_gpu_ext()
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
    need_gpu_ext()
    from tlt_kernels._cuda import verify_tree as cv

    B, T, V = 3, 7, 152064
    lg, toks, par, n, q = verify_inputs(B, T, V, seed=99, use_q=use_q, dtype=torch.bfloat16)
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
@pytest.mark.parametrize("parallel", [False, True], ids=["visited-rows", "parallel-rows"])
def test_verify_large_tree_not_staged(monkeypatch, cluster, parallel):
    """T above the kernel's shared-memory staging limit (2048 nodes): parents and tokens are read from global
    memory during the walk. Some requests are chains of 2099 drafts (deep walks), others random trees."""
    need_gpu_ext()
    from tlt_kernels._cuda import verify_tree as cv

    monkeypatch.setattr(cv, "CLUSTER_SIZE", cluster)
    _rows(monkeypatch, parallel)
    B, T, V = 4, 2100, 23
    lg, toks, par, n, q = verify_inputs(B, T, V, seed=7, use_q=True)
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
@pytest.mark.parametrize("parallel", [False, True], ids=["visited-rows", "parallel-rows"])
def test_verify_half_logits_strided_rows(monkeypatch, q_dtype, parallel):
    need_gpu_ext()
    _rows(monkeypatch, parallel)
    B, T, V = 7, 9, 1000
    lg, toks, par, n, q = verify_inputs(B, T, V, seed=5, use_q=True, dtype=torch.float16, q_dtype=q_dtype)
    # Rows with a padded stride (vocabulary padded to 1003): unaligned row starts take the scalar path.
    big = torch.full((B, T, V + 3), float("nan"), dtype=lg.dtype)
    big[..., :V] = lg
    kw = dict(num_nodes=n, draft_probs=q, temperature=0.9, top_k=50, top_p=0.9, seed=torch.arange(B), return_stats=True)
    ref = verify_tree(lg, toks, par, backend="torch", **kw)
    got = verify_tree(big.cuda()[..., :V], toks.cuda().to(torch.int32), par.cuda(), backend="cuda", **_to("cuda", kw))
    _check_close(ref, got, f"verify[fp16 logits, {q_dtype} q, strided]")


@pytest.mark.cuda
@pytest.mark.parametrize("parallel", [False, True], ids=["visited-rows", "parallel-rows"])
def test_verify_poisoned_outputs_and_padding(monkeypatch, parallel):
    need_gpu_ext()
    from tlt_kernels._cuda import verify_tree as cv

    _rows(monkeypatch, parallel)

    B, T, V = 6, 8, 29
    lg, toks, par, _, q = verify_inputs(B, T, V, seed=9, use_q=True)
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
@pytest.mark.parametrize("parallel", [False, True], ids=["visited-rows", "parallel-rows"])
def test_verify_error_flags_are_per_request(monkeypatch, parallel):
    """A flag comes from a row or token the walk visits, never from another request's, and (parallel rows: every
    node's row is read) never from a row the walk does not reach."""
    need_gpu_ext()
    _rows(monkeypatch, parallel)
    B, T, V = 6, 5, 9
    lg, toks, _, _, _ = verify_inputs(B, T, V, seed=4, use_q=False)
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
                assert (x is None and y is None) or torch.equal(x, y.cpu())


@pytest.mark.cuda
@pytest.mark.parametrize("parallel", [False, True], ids=["visited-rows", "parallel-rows"])
def test_verify_cuda_graph_capture_and_replay(monkeypatch, parallel):
    need_gpu_ext()
    _rows(monkeypatch, parallel)
    B, T, V = 9, 7, 300
    lg, toks, par, n, q = verify_inputs(B, T, V, seed=12, use_q=True)
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


@pytest.mark.cuda
def test_verify_empty_batch_with_validation():
    need_gpu_ext()
    from test_verify_tree import empty_batch_call

    empty_batch_call("cuda", "cuda")
