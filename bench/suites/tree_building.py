"""Suite "tree-building": EAGLE-2 tree selection (``build_draft_tree``) and KV compaction (``compact_kv``).

build_draft_tree: ``bytes_moved`` = candidates read (parent int32, token int64, score fp32) plus the
tree written (parents, tokens, cand_index, packed mask); the kernel is latency-bound (V-1 dependent
argmax rounds per request), so the HBM percentage is informative only at large B.

compact_kv: a 64-node tree per request, accepted paths of random depth in [0, 8], ``layers`` layers
of bf16 ``[num_blocks, 16, Hkv, D]`` K and V; ``bytes_moved`` = the moved rows read and written in
every cache. Calls repeat in place (the same rows move each time, so the work per call is constant).
"""
from __future__ import annotations

import torch

from tlt_kernels import BackendUnavailableError, build_draft_tree, compact_kv

SUITE = "tree-building"


def _candidates(B, N, device):
    g = torch.Generator().manual_seed(0)
    # A beam-like candidate list: each candidate's parent is an earlier candidate or the root.
    parents = (torch.rand(B, N, generator=g) * torch.arange(N)).long() - 1
    parents[:, : min(N, 8)] = -1
    step = -torch.rand(B, N, generator=g) * 3
    scores = step.clone()
    for c in range(N):  # cumulative log-probs: parent's score + the step
        p = parents[:, c]
        scores[:, c] += torch.where(p >= 0, scores.gather(1, p.clamp(min=0).unsqueeze(1)).squeeze(1), torch.zeros(B))
    tokens = torch.randint(0, 32000, (B, N), generator=g)
    root = torch.randint(0, 32000, (B,), generator=g)
    return parents.to(torch.int32).to(device), tokens.to(device), scores.to(device), root.to(device)


def _bench_build(ctx):
    cases = [(4, 32, 8)] if ctx.small else [(64, 256, 64), (256, 512, 64), (512, 1024, 128)]
    for B, N, V in cases:
        p, t, s, r = _candidates(B, N, ctx.device)
        words = (V + 31) // 32
        nbytes = B * N * (4 + 8 + 4) + B * V * (4 + 8 + 4 + 4 * words) + B * 4
        case = {"op": "build_draft_tree", "B": B, "N": N, "V": V}
        ref = build_draft_tree(p, t, s, V, r, return_mask=True, validate=False, backend="torch")
        ctx.add(case, "torch-ref", ctx.time_ms(lambda: build_draft_tree(p, t, s, V, r, return_mask=True, validate=False, backend="torch")), bytes_moved=nbytes)
        for impl in ("triton", "cuda"):
            try:
                out = build_draft_tree(p, t, s, V, r, return_mask=True, validate=False, backend=impl)
            except BackendUnavailableError as exc:
                ctx.note(f"build_draft_tree tlt-{impl} skipped: {exc}")
                continue
            if not all(torch.equal(a, b) for a, b in zip(out, ref)):
                raise AssertionError(f"build_draft_tree {impl} != torch for {case}")
            ms = ctx.time_ms(lambda: build_draft_tree(p, t, s, V, r, return_mask=True, validate=False, backend=impl))
            ctx.add(case, f"tlt-{impl}", ms, bytes_moved=nbytes)

def _kv_case(B, layers, hkv, dim, dtype, device):
    g = torch.Generator().manual_seed(1)
    block_size, tree = 16, 64
    ctx_lens = torch.randint(100, 2000, (B,), generator=g)
    max_blocks = (int(ctx_lens.max()) + tree) // block_size + 1
    table = torch.randperm(B * max_blocks, generator=g).view(B, max_blocks).to(torch.int32)
    shape = (B * max_blocks, block_size, hkv, dim)
    ks = [torch.randn(shape, generator=g).to(dtype).to(device) for _ in range(layers)]
    vs = [torch.randn(shape, generator=g).to(dtype).to(device) for _ in range(layers)]
    nacc = torch.randint(0, 9, (B,), generator=g).to(torch.int32)
    nodes = torch.full((B, 9), -1, dtype=torch.int32)
    moved = 0
    for b in range(B):
        n = int(nacc[b])
        path = [0] + sorted((torch.randperm(tree - 1, generator=g)[:n] + 1).tolist())
        nodes[b, : n + 1] = torch.tensor(path, dtype=torch.int32)
        moved += sum(1 for d, node in enumerate(path) if node != d)
    args = (table.to(device), ctx_lens.to(torch.int32).to(device), nodes.to(device), nacc.to(device))
    return ks, vs, args, moved


def _bench_compact(ctx):
    cases = [(4, 2, 2, 16)] if ctx.small else [(64, 32, 8, 128), (256, 32, 8, 128)]
    for B, layers, hkv, dim in cases:
        ks, vs, args, moved = _kv_case(B, layers, hkv, dim, ctx.dtype, ctx.device)
        row_bytes = hkv * dim * ks[0].element_size()
        nbytes = 2 * moved * row_bytes * 2 * layers  # read + write, K and V, every layer
        case = {"op": "compact_kv", "B": B, "layers": layers, "Hkv": hkv, "D": dim}
        ctx.add(case, "torch-ref", ctx.time_ms(lambda: compact_kv(ks, vs, *args, validate=False, backend="torch")), bytes_moved=nbytes)
        for impl in ("triton", "cuda"):
            try:
                compact_kv(ks, vs, *args, validate=False, backend=impl)
            except BackendUnavailableError as exc:
                ctx.note(f"compact_kv tlt-{impl} skipped: {exc}")
                continue
            ms = ctx.time_ms(lambda: compact_kv(ks, vs, *args, validate=False, backend=impl))
            ctx.add(case, f"tlt-{impl}", ms, bytes_moved=nbytes, rows_moved_per_cache=moved)

def run(ctx) -> None:
    _bench_build(ctx)
    _bench_compact(ctx)
