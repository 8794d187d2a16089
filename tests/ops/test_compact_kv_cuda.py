"""CUDA backend of compact_kv (tlt_kernels._C) against the torch reference and the Triton backend: the
compacted caches and context lengths must match exactly; every failure names the first mismatching row."""
from __future__ import annotations

import pytest
import torch

from cuda_cases import compact_case, need_gpu_ext
from tlt_kernels import compact_kv


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
    need_gpu_ext()
    ks, vs, table, ctx, nodes, nacc = compact_case(B, layers, Hkv, D, block_size, P, dtype, seed=B * 13 + P)
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
    need_gpu_ext()
    B, layers, Hkv, D, block_size, P = 6, 3, 2, 64, 16, 7
    ks, vs, table, ctx, nodes, nacc = compact_case(B, layers, Hkv, D, block_size, P, torch.bfloat16, seed=3)
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
