"""Package-level contracts: import hygiene, backend dispatch, the Philox RNG, the token-tree helpers."""
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import tlt_kernels
from tlt_kernels import _backend
from tlt_kernels._backend import BackendUnavailableError, available_backends, backend_unavailable_reason, register_op
from tlt_kernels.rng import PURPOSE_ACCEPT, PURPOSE_SAMPLE, philox4x32, uniform
from tlt_kernels.tree import (
    chain_parents,
    pack_tree_mask,
    resolve_num_nodes,
    tree_ancestor_mask,
    tree_ancestor_mask_packed,
    tree_depths,
    tree_positions,
    unpack_tree_mask,
    validate_tree,
)

try:
    import pytest_benchmark  # noqa: F401
except ImportError:  # the GPU machine may lack it: skip the timings rather than error out

    @pytest.fixture
    def benchmark():
        pytest.skip("pytest-benchmark is not installed")


# ---------------------------------------------------------------------------------------------
# import hygiene and public names
# ---------------------------------------------------------------------------------------------
def test_import_touches_no_gpu_triton_or_extension():
    # Our kernel modules load on first use, and nothing of ours pulls in torch._dynamo (which imports Triton).
    code = (
        "import sys, torch\n"
        "before = 'triton' in sys.modules or 'torch._dynamo' in sys.modules\n"
        "import tlt_kernels\n"
        "bad = [m for m in sys.modules if m.startswith(('tlt_kernels._triton.', 'tlt_kernels._cuda.', 'tlt_kernels._C'))]\n"
        "assert not bad, f'importing tlt_kernels imported kernel modules {bad}'\n"
        "assert before or not ('triton' in sys.modules or 'torch._dynamo' in sys.modules), 'importing tlt_kernels imported Triton / torch._dynamo'\n"
        "assert not torch.cuda.is_initialized(), 'importing tlt_kernels initialized CUDA'\n"
        "print(tlt_kernels.__version__)\n"
    )
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == tlt_kernels.__version__


def test_public_names_are_defined():
    missing = [name for name in tlt_kernels.__all__ if getattr(tlt_kernels, name, None) is None]
    assert not missing, f"tlt_kernels exports undefined names: {missing}"
    assert tlt_kernels.__version__.count(".") == 2


# ---------------------------------------------------------------------------------------------
# backend dispatch
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def dummy_op():
    table = register_op("test_dummy_op", {"torch": "math:sqrt", "cuda": "math:floor"}, preference=("cuda", "torch"))
    yield table
    _backend._REGISTRY.pop("test_dummy_op", None)


def test_available_backends_reports_reasons(dummy_op):
    report = available_backends("test_dummy_op", device="cpu")
    assert set(report) == {"test_dummy_op"}
    row = report["test_dummy_op"]
    assert row["torch"] is None
    assert row["triton"] == "test_dummy_op has no triton backend"
    assert row["cuda"] == "the cuda backend needs CUDA tensors (got cpu)"
    assert "test_dummy_op" in available_backends(device="cpu")


def test_dispatch_rules(dummy_op):
    cpu = torch.device("cpu")
    assert dummy_op.resolve("auto", cpu) == ("torch", math.sqrt)
    assert dummy_op.resolve("torch", cpu) == ("torch", math.sqrt)
    with pytest.raises(BackendUnavailableError, match=r"test_dummy_op: backend 'cuda' is unavailable: the cuda backend needs CUDA tensors \(got cpu\)"):
        dummy_op.resolve("cuda", cpu)
    with pytest.raises(BackendUnavailableError, match=r"test_dummy_op has no 'triton' backend \(it has \['cuda', 'torch'\]\)"):
        dummy_op.resolve("triton", cpu)
    with pytest.raises(ValueError, match=r"unknown backend 'tpu'; expected 'auto' or one of \('torch', 'triton', 'cuda'\)"):
        dummy_op.resolve("tpu", cpu)
    assert issubclass(BackendUnavailableError, RuntimeError)


def test_triton_reason_names_the_fix(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    reason = backend_unavailable_reason("triton", torch.device("cpu"))
    if _backend._triton_import_error() is None:
        assert reason == "triton needs CUDA tensors (got cpu); set TRITON_INTERPRET=1 to run it on the CPU"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert backend_unavailable_reason("triton", torch.device("cpu")) == _backend._triton_import_error()
    with pytest.raises(ValueError, match="unknown backend 'x'"):
        backend_unavailable_reason("x", torch.device("cpu"))


def test_missing_cuda_extension_message(monkeypatch):
    monkeypatch.setitem(sys.modules, "tlt_kernels._C", None)  # makes the import fail like an unbuilt extension
    msg = _backend._cuda_ext_import_error.__wrapped__()
    assert msg.startswith("the CUDA extension tlt_kernels._C is not built (")
    assert msg.endswith("reinstall with nvcc on PATH or TLT_BUILD_CUDA=1")


def test_process_constants_are_cached_and_compile_without_tracing_the_cache():
    """Import probes and device properties are computed once, and torch.compile takes their value (dynamo would
    otherwise trace through functools.lru_cache with a warning)."""
    import warnings

    calls = []

    @_backend.process_constant
    def probe(x: int) -> int:
        calls.append(x)
        return 10 * x

    assert probe(2) == 20 and probe(2) == 20 and calls == [2] and probe.__wrapped__(2) == 20

    def fn(t):
        return t + (1 if backend_unavailable_reason("triton", t.device) is None else 2) + probe(3)

    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(fn, backend="eager", fullgraph=True)(torch.zeros(2))
    assert torch.equal(out, fn(torch.zeros(2)))
    assert not [w for w in caught if "lru_cache" in str(w.message)], [str(w.message)[:120] for w in caught]


def test_every_registered_op_has_a_torch_backend():
    report = available_backends(device="cpu")
    for op, row in report.items():
        assert row["torch"] is None, f"{op} has no torch reference backend: {row['torch']}"


# ---------------------------------------------------------------------------------------------
# Philox4x32-10
# ---------------------------------------------------------------------------------------------
MASK = 0xFFFFFFFF


def _philox_scalar(ctr, key):
    """Independent pure-Python Philox4x32-10 (all four output words), for cross-checking."""
    c0, c1, c2, c3 = ctr
    k0, k1 = key
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = ((p1 >> 32) ^ c1 ^ k0) & MASK, p1 & MASK, ((p0 >> 32) ^ c3 ^ k1) & MASK, p0 & MASK
        k0, k1 = (k0 + 0x9E3779B9) & MASK, (k1 + 0xBB67AE85) & MASK
    return c0, c1, c2, c3


def _as_int64(u64):
    return u64 - (1 << 64) if u64 >= 1 << 63 else u64


def _rng_args(ctr, key):
    """Map a Random123 (counter, key) to this package's (seed, offset, node, purpose)."""
    seed = _as_int64(key[0] | (key[1] << 32))
    offset = _as_int64(ctr[0] | (ctr[1] << 32))
    return torch.tensor(seed), torch.tensor(offset), ctr[2], ctr[3]


# Random123's published known-answer vectors (kat_vectors, philox4x32 10 rounds): first output word.
KATS = [
    ((0, 0, 0, 0), (0, 0), 0x6627E8D5),
    ((MASK, MASK, MASK, MASK), (MASK, MASK), 0x408F276D),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0), 0xD16CFE09),
]


@pytest.mark.parametrize("ctr,key,first", KATS)
def test_philox_known_answers(ctr, key, first):
    assert int(philox4x32(*_rng_args(ctr, key))) == first
    assert _philox_scalar(ctr, key)[0] == first


def test_philox_matches_scalar_reference_and_broadcasts(gen):
    seeds = torch.randint(-(2**62), 2**62, (7, 1), generator=gen)
    offsets = torch.randint(0, 2**40, (1, 5), generator=gen)
    got = philox4x32(seeds, offsets, 3, PURPOSE_SAMPLE)
    assert got.shape == (7, 5) and got.dtype == torch.int64
    for i in range(7):
        for j in range(5):
            s, o = int(seeds[i, 0]) & (2**64 - 1), int(offsets[0, j])
            want = _philox_scalar((o & MASK, o >> 32, 3, PURPOSE_SAMPLE), (s & MASK, s >> 32))[0]
            assert int(got[i, j]) == want


def test_uniform_mapping_is_exact_and_open():
    seed = torch.arange(-512, 512).view(-1, 1)
    offset = torch.arange(256).view(1, -1)
    u = uniform(seed, offset, 5, PURPOSE_ACCEPT)
    assert u.dtype == torch.float32 and u.shape == (1024, 256)
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0
    bits = philox4x32(seed, offset, 5, PURPOSE_ACCEPT)
    # ((w >> 9) + 0.5) * 2**-23 is exact in float32: u * 2**23 - 0.5 recovers the top 23 bits.
    assert torch.equal((u.double() * 2**23 - 0.5).long(), bits >> 9)
    assert 2.0**-24 == float(torch.tensor(0.5 * 2**-23, dtype=torch.float32))
    assert float(torch.tensor((2**23 - 1 + 0.5) * 2**-23, dtype=torch.float32)) < 1.0


def test_uniform_chi_square():
    scipy_stats = pytest.importorskip("scipy.stats")
    n, bins = 1 << 16, 64
    u = uniform(torch.tensor(20240611), torch.arange(n), 0, PURPOSE_SAMPLE).numpy()
    counts = np.bincount((u * bins).astype(np.int64), minlength=bins)
    assert scipy_stats.chisquare(counts).pvalue > 1e-4
    # every input word matters: neighbouring streams are uncorrelated
    streams = [
        uniform(torch.tensor(7), torch.arange(n), 0, PURPOSE_ACCEPT),
        uniform(torch.tensor(7), torch.arange(n), 0, PURPOSE_SAMPLE),
        uniform(torch.tensor(7), torch.arange(n), 1, PURPOSE_ACCEPT),
        uniform(torch.tensor(7 + 2**32), torch.arange(n), 0, PURPOSE_ACCEPT),
        uniform(torch.tensor(7), torch.arange(n) + 2**32, 0, PURPOSE_ACCEPT),
    ]
    for other in streams[1:]:
        r = np.corrcoef(streams[0].numpy(), other.numpy())[0, 1]
        assert abs(r) < 5 / math.sqrt(n), r


# ---------------------------------------------------------------------------------------------
# token trees
# ---------------------------------------------------------------------------------------------
def random_trees(B, T, gen, pad_value=None):
    """Random valid trees (``num_nodes`` in [1, T]) whose padding holds arbitrary in-range junk."""
    n = torch.randint(1, T + 1, (B,), generator=gen, dtype=torch.int32)
    parents = torch.randint(-1, T, (B, T), generator=gen, dtype=torch.int32)
    for b in range(B):
        parents[b, 0] = -1
        for i in range(1, int(n[b])):
            parents[b, i] = int(torch.randint(0, i, (1,), generator=gen))
        if pad_value is not None:
            parents[b, int(n[b]):] = pad_value
    return parents, n


def brute_force(parents, n):
    B, T = parents.shape
    depth = torch.zeros(B, T, dtype=torch.int32)
    mask = torch.zeros(B, T, T, dtype=torch.bool)
    for b in range(B):
        for i in range(int(n[b])):
            j, d = i, 0
            mask[b, i, i] = True
            while parents[b, j] >= 0:
                j = int(parents[b, j])
                mask[b, i, j] = True
                d += 1
            depth[b, i] = d
    return depth, mask


@pytest.mark.parametrize("B,T", [(1, 1), (3, 2), (5, 7), (4, 31), (3, 32), (2, 33), (2, 70)])
def test_tree_helpers_match_brute_force(B, T, gen):
    parents, n = random_trees(B, T, gen)
    depth, mask = brute_force(parents, n)
    assert torch.equal(validate_tree(parents, n), n)
    got_depth = tree_depths(parents, n)
    assert got_depth.dtype == torch.int32 and torch.equal(got_depth, depth)
    got_mask = tree_ancestor_mask(parents, n)
    assert got_mask.dtype == torch.bool and torch.equal(got_mask, mask)
    ctx = torch.randint(0, 1000, (B,), generator=gen, dtype=torch.int32)
    pos = tree_positions(parents, ctx, n)
    assert pos.dtype == torch.int32 and torch.equal(pos, ctx.unsqueeze(1) + depth)
    packed = tree_ancestor_mask_packed(parents, n)
    assert packed.dtype == torch.int32 and packed.shape == (B, T, (T + 31) // 32)
    assert torch.equal(unpack_tree_mask(packed, T), mask)
    # int64 parents work the same
    assert torch.equal(tree_depths(parents.long(), n), depth)


def test_pack_bit_layout(gen):
    mask = torch.rand(3, 5, 70, generator=gen) < 0.5
    mask[0, 0, 31] = True  # the sign bit of word 0
    mask[0, 0, 63] = True
    packed = pack_tree_mask(mask)
    assert packed.shape == (3, 5, 3) and packed.dtype == torch.int32
    for b, i, j in [(0, 0, 31), (0, 0, 63), (1, 2, 5), (2, 4, 69), (1, 3, 40)]:
        word = int(packed[b, i, j // 32]) & 0xFFFFFFFF
        assert bool((word >> (j % 32)) & 1) == bool(mask[b, i, j])
    assert int(packed[0, 0, 0]) < 0  # bit 31 survives as the int32 sign
    assert torch.equal(unpack_tree_mask(packed, 70), mask)
    assert not unpack_tree_mask(packed, 96)[..., 70:].any()  # padding bits are zero


def test_full_trees_and_chains():
    p = chain_parents(2, 5)
    assert p.dtype == torch.int32 and p.tolist() == [[-1, 0, 1, 2, 3]] * 2
    assert tree_depths(p).tolist() == [[0, 1, 2, 3, 4]] * 2
    assert torch.equal(tree_ancestor_mask(p)[0], torch.ones(5, 5, dtype=torch.bool).tril())
    assert resolve_num_nodes(p, None).tolist() == [5, 5]
    assert torch.equal(validate_tree(p), torch.tensor([5, 5], dtype=torch.int32))


def test_padding_is_ignored(gen):
    parents, n = random_trees(6, 9, gen)
    depth, mask = tree_depths(parents, n), tree_ancestor_mask(parents, n)
    for b in range(6):
        assert not depth[b, int(n[b]):].any()
        assert not mask[b, int(n[b]):].any() and not mask[b, :, int(n[b]):].any()


def test_padding_out_of_range_is_ignored(gen):
    parents, n = random_trees(4, 6, gen, pad_value=99)
    n[0] = 3  # make sure request 0 has padding
    parents[0, 3:] = 99
    depth, mask = brute_force(parents, n)
    validate_tree(parents, n)
    assert torch.equal(tree_depths(parents, n), depth)
    assert torch.equal(tree_ancestor_mask(parents, n), mask)


P = torch.tensor([[-1, 0, 0, 1], [-1, 0, 1, 2]], dtype=torch.int32)


@pytest.mark.parametrize(
    "parents,num_nodes,exc,msg",
    [
        (P.float(), None, TypeError, "parents must have dtype int32, int64, got float32"),
        (P[0], None, ValueError, r"parents must be 2-D, got shape \(4,\)"),
        ([[-1, 0]], None, TypeError, "parents must be a torch.Tensor, got list"),
        (P[:, :0], None, ValueError, r"parents must hold at least one node \(the root\) per request"),
        (P, torch.tensor([4, 0], dtype=torch.int32), ValueError, r"num_nodes\[1\] = 0 is outside \[1, T=4\]"),
        (P, torch.tensor([5, 4], dtype=torch.int32), ValueError, r"num_nodes\[0\] = 5 is outside \[1, T=4\]"),
        (P, torch.tensor([4, 4, 4], dtype=torch.int32), ValueError, r"num_nodes has size 3 on dim 0, expected 2"),
        (P, torch.tensor([4.0, 4.0]), TypeError, "num_nodes must have dtype int32, int64, got float32"),
        (torch.tensor([[-1, 0], [0, 0]], dtype=torch.int32), None, ValueError,
         r"invalid tree: request 1, node 0 \(the root\) must have parent -1, got 0"),
        (torch.tensor([[-1, 0, 2]], dtype=torch.int32), None, ValueError,
         r"invalid tree: request 0, node 2 has parent 2: a parent must precede its child \(topological order; this also rules out cycles\)"),
        (torch.tensor([[-1, 2, 1]], dtype=torch.int32), None, ValueError, r"invalid tree: request 0, node 1 has parent 2: a parent must precede"),
        (torch.tensor([[-1, 0, 1], [-1, 0, -1]], dtype=torch.int32), None, ValueError,
         r"invalid tree: request 1, node 2 has parent -1: only the root may have a negative parent"),
    ],
)
def test_validate_tree_errors(parents, num_nodes, exc, msg):
    with pytest.raises(exc, match=msg):
        validate_tree(parents, num_nodes)


def test_validate_tree_accepts_junk_padding_and_int64():
    parents = torch.tensor([[-1, 0, 5, -3], [-1, 0, 1, 1]], dtype=torch.int64)
    n = validate_tree(parents, torch.tensor([2, 4]))
    assert n.dtype == torch.int32 and n.tolist() == [2, 4]


# ---------------------------------------------------------------------------------------------
# CPU-side costs (pytest-benchmark; few rounds so the suite stays fast)
# ---------------------------------------------------------------------------------------------
def _bench(benchmark, fn, *args):
    return benchmark.pedantic(fn, args=args, rounds=5, iterations=1, warmup_rounds=1)


def test_bench_tree_mask_packed_b64_t16(benchmark, gen):
    parents, n = random_trees(64, 16, gen)
    packed = _bench(benchmark, tree_ancestor_mask_packed, parents, n)
    assert packed.shape == (64, 16, 1)


def test_bench_validate_tree_b64_t16(benchmark, gen):
    parents, n = random_trees(64, 16, gen)
    assert torch.equal(_bench(benchmark, validate_tree, parents, n), n)


def test_bench_tree_positions_b64_t64(benchmark, gen):
    parents, n = random_trees(64, 64, gen)
    ctx = torch.full((64,), 4096, dtype=torch.int32)
    assert _bench(benchmark, tree_positions, parents, ctx, n).shape == (64, 64)


def test_bench_uniform_b64_t16(benchmark):
    seeds = torch.arange(64).view(64, 1)
    u = _bench(benchmark, uniform, seeds, torch.tensor(3), torch.arange(16).view(1, 16), PURPOSE_ACCEPT)
    assert u.shape == (64, 16)


def test_bench_plan_tree_attention_b64_t16(benchmark, gen):
    """Planning cost of one decoding step (built once, reused by every layer): 7B geometry, 4k context."""
    from tlt_kernels.ops.tree_attention import plan_tree_attention

    parents, n = random_trees(64, 16, gen)
    ctx = torch.full((64,), 4096, dtype=torch.int32)
    table = torch.arange(64 * 258, dtype=torch.int32).view(64, 258)
    plan = _bench(
        benchmark, lambda: plan_tree_attention(parents, ctx, table, n, num_q_heads=28, num_kv_heads=4, head_dim=128,
                                               block_size=16, max_context_len=4096)
    )
    assert plan.tree_mask.shape == (64, 16, 1) and plan.num_splits >= 1
    assert torch.equal(plan.tree_mask, tree_ancestor_mask_packed(parents, n))


def test_bench_verify_tree_validation_b64_t16(benchmark, gen):
    """Host cost of verify_tree(validate=True)'s value checks alone (two host copies, whole-batch checks)."""
    from tlt_kernels.ops.verify_tree import _validate

    B, T, V = 64, 16, 4096
    parents, n = random_trees(B, T, gen)
    tokens = torch.randint(0, V, (B, T), generator=gen)
    q = torch.rand(B, T, V, generator=gen)
    temp, top_p = torch.full((B,), 0.7), torch.full((B,), 0.9)
    assert _bench(benchmark, _validate, torch.empty(B, T, V), tokens, parents, n, q, temp, None, top_p, T - 1) is None


def test_bench_compact_kv_validation_b256(benchmark, gen):
    """Host cost of compact_kv(validate=True)'s value checks at B=256 (one host copy, whole-batch checks)."""
    from tlt_kernels.ops.compact_kv import _validate_values

    B, P, W, block_size = 256, 8, 64, 16
    table = torch.randperm(B * W, generator=gen).view(B, W).to(torch.int32)
    ctx = torch.randint(0, (W - 1) * block_size - 16, (B,), generator=gen).to(torch.int32)
    nacc = torch.randint(0, P, (B,), generator=gen).to(torch.int32)
    nodes = torch.full((B, P), -1, dtype=torch.int32)
    for b in range(B):
        k = int(nacc[b])
        nodes[b, : k + 1] = torch.cat([torch.zeros(1), torch.randperm(14, generator=gen)[:k].sort().values + 1]).to(torch.int32)
    assert _bench(benchmark, _validate_values, table, ctx, nodes, nacc, B * W, block_size) is None
