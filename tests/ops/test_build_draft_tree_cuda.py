"""CUDA backend of build_draft_tree (tlt_kernels._C) against the torch reference and the Triton backend: every
output must match exactly; every failure names the first mismatching request."""
from __future__ import annotations

import pytest
import torch

from conftest import poison_
from cuda_cases import need_gpu_ext
from tlt_kernels import build_draft_tree


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
    need_gpu_ext()
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
    need_gpu_ext()
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
