"""Helpers shared by the CUDA acceptance-kernel tests (tests/ops/test_{verify_tree,compact_kv,build_draft_tree}_cuda.py
and test_acceptance_cuda_glue.py): extension lookup, the verify_tree backend routing fixture, random inputs."""
from __future__ import annotations

import pytest
import torch

from conftest import HAS_CUDA
from tlt_kernels import cuda_extension_available


def ext_or_skip():
    if not cuda_extension_available():
        pytest.skip("tlt_kernels._C is not built (pip install -e . with nvcc on PATH)")
    from tlt_kernels._cuda import extension

    return extension()


def need_gpu_ext():
    if not HAS_CUDA:
        pytest.skip("needs a CUDA GPU")
    ext_or_skip()


VERIFY_CUDA_IMPL = "tlt_kernels._cuda.verify_tree:verify_tree_cuda"


@pytest.fixture(autouse=True)
def verify_cuda_backend(monkeypatch):
    """Route verify_tree(backend="cuda") to the CUDA glue even before ops/verify_tree.py lists it."""
    from tlt_kernels.ops import verify_tree as op

    if "cuda" not in op._BACKENDS.impls:
        monkeypatch.setitem(op._BACKENDS.impls, "cuda", VERIFY_CUDA_IMPL)
    yield


def random_parents(B, T, g, chain_frac=0.25):
    par = torch.full((B, T), -1, dtype=torch.int32)
    for i in range(1, T):
        par[:, i] = torch.randint(0, i, (B,), generator=g, dtype=torch.int32)
    chain = torch.rand(B, generator=g) < chain_frac
    par[chain, 1:] = torch.arange(T - 1, dtype=torch.int32)
    return par


def verify_inputs(B, T, V, seed, use_q, dtype=torch.float32, q_dtype=None):
    g = torch.Generator().manual_seed(seed)
    lg = torch.randn(B, T, V, generator=g) * 2.5
    par = random_parents(B, T, g)
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


def compact_case(B, layers, Hkv, D, block_size, P, dtype, seed):
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
