"""CUDA backend of tree attention (tlt_kernels._C) against the torch reference.

Every case prints one diagnostic line (run with ``-s`` or ``-rA`` to see them on success):

    CASE <id> max_abs_err=<e> at (b, t, h, d) ref=<x> got=<y> | partial-split max err: ctx=<e> tree=<e> lse=<e>

The partial check compares the kernel's flash-decoding scratch (``plan.partial_out`` /
``plan.partial_lse``) with a per-split torch computation, so a failure says whether step 1 (the
partial kernel: context-only splits, or the last split with the masked tree folded in) or step 2
(the merge) is wrong. ``tree`` is the error of the last split of each multi-split request.
"""
from __future__ import annotations

import math

import pytest
import torch

from conftest import HAS_CUDA, poison_

pytestmark = pytest.mark.cuda

if HAS_CUDA:
    from tlt_kernels import cuda_extension_available
    from tlt_kernels.ops.tree_attention import plan_tree_attention
    from tlt_kernels.reference.tree_attention import tree_attention_reference

TOL = {torch.bfloat16: (2.5e-2, 2e-2), torch.float16: (4e-3, 4e-3)}  # (atol, rtol) vs the fp32 reference


@pytest.fixture(autouse=True)
def _need_extension():
    if HAS_CUDA and not cuda_extension_available():
        pytest.skip("tlt_kernels._C is not built (pip install -e . with nvcc on PATH)")


def random_parents(B, T, g):
    parents = torch.full((B, T), -1, dtype=torch.int32)
    for i in range(1, T):
        parents[:, i] = torch.randint(0, i, (B,), generator=g, dtype=torch.int32)
    return parents


def make_case(B, T, Hkv, G, D, block_size, ctx_lens, dtype, seed, *, ragged_nodes=True, combined_kv=False):
    """Random paged cache with shuffled pages; unused pages and unused table entries are NaN traps."""
    g = torch.Generator().manual_seed(seed)
    ctx = torch.tensor(ctx_lens, dtype=torch.int32)
    assert ctx.numel() == B
    n = torch.randint(1, T + 1, (B,), generator=g, dtype=torch.int32) if ragged_nodes else torch.full((B,), T, dtype=torch.int32)
    n[0] = T  # at least one full tree
    parents = random_parents(B, T, g)
    pages = [-(-(int(ctx[b]) + T) // block_size) for b in range(B)]
    max_blocks = max(pages) + 1
    num_used = sum(pages)
    num_blocks = num_used + 1  # the last page is the NaN trap
    perm = torch.randperm(num_used, generator=g).to(torch.int32)
    trap = num_blocks - 1
    table = torch.full((B, max_blocks), trap, dtype=torch.int32)
    o = 0
    for b in range(B):
        table[b, : pages[b]] = perm[o : o + pages[b]]
        o += pages[b]
    heads = 2 * Hkv if combined_kv else Hkv
    kv = torch.randn(2, num_blocks, block_size, heads, D, generator=g).to(dtype)
    kv[:, trap] = float("nan")
    # Slots past each request's context + tree in its last page are never read: poison them too.
    for b in range(B):
        last = int(ctx[b]) + T
        if last % block_size:
            kv[:, int(table[b, last // block_size]), last % block_size :] = float("nan")
    dev = torch.device("cuda")
    # Slice on the device: .to() of a strided (non-dense) view would hand back a contiguous copy.
    kv = kv.to(dev)
    if combined_kv:  # vLLM-style [num_blocks, block_size, 2*Hkv, D] storage: strided K and V views
        k_cache, v_cache = kv[0][:, :, :Hkv], kv[1][:, :, Hkv:]
    else:
        k_cache, v_cache = kv[0], kv[1]
    q = torch.randn(B, T, Hkv * G, D, generator=g).to(dtype)
    return dict(
        q=q.to(dev), k_cache=k_cache, v_cache=v_cache, block_table=table.to(dev),
        context_lens=ctx.to(dev), parents=parents.to(dev), num_nodes=n.to(dev),
    )


def reference_partials(c, plan, sm_scale):
    """Per-split (O_s, lse_s) of rows r < num_nodes[b] * G in fp32, as the CUDA backend writes the scratch.

    The tree is folded into the last non-empty context split (split 0 when the context is empty); a
    request with at most one non-empty split writes ``out`` directly and no scratch, so only requests
    with ``used = ceil(C / split_len) >= 2`` are listed, at slots ``s < used``.
    """
    B, T, Hq, D = c["q"].shape
    Hkv, G, L = plan.num_kv_heads, plan.group, plan.split_len
    bs = plan.block_size
    res = []
    ctx_all, n_all = c["context_lens"].tolist(), c["num_nodes"].tolist()
    mask = plan.tree_mask.cpu()
    for b in range(B):
        C, n = ctx_all[b], n_all[b]
        used = -(-C // L)
        if used <= 1:
            continue
        slots = torch.arange(C + n, device="cuda")
        pages = c["block_table"][b].long()[slots // bs]
        k = c["k_cache"][pages, slots % bs].float()  # [C+n, Hkv, D]
        v = c["v_cache"][pages, slots % bs].float()
        q = c["q"][b, :n].float().view(n, Hkv, G, D)
        bits = (mask[b, :n].long() & 0xFFFFFFFF)
        j = torch.arange(n)
        tree_allowed = ((bits[:, j // 32] >> (j % 32)) & 1).bool().cuda()  # [n, n]
        for s in range(used):
            lo, hi = s * L, min((s + 1) * L, C)
            cols = torch.arange(lo, hi, device="cuda")
            allowed = torch.ones(n, hi - lo, dtype=torch.bool, device="cuda")
            if s == used - 1:
                cols = torch.cat([cols, torch.arange(C, C + n, device="cuda")])
                allowed = torch.cat([allowed, tree_allowed], dim=1)
            sc = torch.einsum("tkgd,skd->ktgs", q, k[cols]) * sm_scale  # [Hkv, n, G, len]
            sc = sc.masked_fill(~allowed[None, :, None, :], float("-inf"))
            lse = torch.logsumexp(sc, dim=-1)  # [Hkv, n, G]
            o = torch.einsum("ktgs,skd->ktgd", sc.softmax(-1), v[cols])
            res.append((b, s, s == used - 1, o.reshape(Hkv, n * G, D), lse.reshape(Hkv, n * G)))
    return res


def check_case(case_id, c, dtype, *, split_len=None, out_view=False, check_partials=True):
    B, T, Hq, D = c["q"].shape
    Hkv = c["k_cache"].shape[2]
    bs = c["k_cache"].shape[1]
    plan = plan_tree_attention(
        c["parents"], c["context_lens"], c["block_table"], c["num_nodes"],
        num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D, block_size=bs, split_len=split_len,
    )
    poison_(plan.partial_out)
    poison_(plan.partial_lse)
    if out_view:  # an output with a non-trivial head stride: a slice of a wider buffer
        wide = torch.empty(B, T, Hq + 3, D, dtype=dtype, device="cuda")
        out = wide[:, :, 2 : 2 + Hq]
    else:
        out = torch.empty_like(c["q"])
    poison_(out)
    sm_scale = 1.0 / math.sqrt(D)
    got = plan.run(c["q"], c["k_cache"], c["v_cache"], out=out, backend="cuda")
    torch.cuda.synchronize()
    assert got.data_ptr() == out.data_ptr()
    ref = tree_attention_reference(
        c["q"], c["k_cache"], c["v_cache"], c["block_table"], c["context_lens"], c["parents"], c["num_nodes"],
        sm_scale=sm_scale, out_dtype=torch.float32,
    )
    err = (got.float() - ref).abs()
    err = torch.where(torch.isnan(err), torch.full_like(err, float("inf")), err)
    worst = int(err.argmax())
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), err.shape))
    max_err = float(err.max())

    part_msg = ""
    if check_partials:
        ctx_err = tree_err = lse_err = 0.0
        n_all = c["num_nodes"].tolist()
        for b, s, with_tree, o_ref, lse_ref in reference_partials(c, plan, sm_scale):
            M = n_all[b] * plan.group
            lse = plan.partial_lse[b, :, s, :M]
            e = (plan.partial_out[b, :, s, :M] - o_ref).abs().nan_to_num(nan=float("inf")).max().item()
            le = (lse - lse_ref).abs().nan_to_num(nan=float("inf")).max().item()
            lse_err = max(lse_err, le)
            if with_tree:
                tree_err = max(tree_err, e)
            else:
                ctx_err = max(ctx_err, e)
        part_msg = f" | partial-split max err: ctx={ctx_err:.3g} tree={tree_err:.3g} lse={lse_err:.3g}"

    msg = (f"CASE {case_id} S={plan.num_splits} split_len={plan.split_len} max_abs_err={max_err:.3g} at (b,t,h,d)={idx} "
           f"ref={float(ref[idx]):.4f} got={float(got[idx].float()):.4f}{part_msg}")
    print(msg)
    # Padding rows must be exact zeros (not poison).
    n = c["num_nodes"].cpu()
    pad = torch.arange(T)[None, :] >= n[:, None]
    if pad.any():
        assert bool((got.cpu()[pad] == 0).all()), f"padding rows not zeroed: {msg}"
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.float(), ref, atol=atol, rtol=rtol, msg=lambda m: f"{msg}\n{m}")


# (B, T, Hkv, G, D, block_size, context lengths, dtype, split_len)
CASES = [
    (1, 1, 1, 1, 128, 16, [1], torch.bfloat16, None),
    (2, 7, 2, 4, 128, 16, [0, 300], torch.bfloat16, None),
    (3, 16, 2, 4, 128, 16, [513, 0, 77], torch.float16, 64),
    (2, 64, 1, 4, 128, 16, [1000, 31], torch.bfloat16, None),
    (2, 16, 2, 7, 128, 1, [130, 257], torch.bfloat16, 64),
    (2, 16, 2, 7, 64, 128, [700, 5], torch.float16, 128),
    (3, 7, 3, 1, 64, 16, [64, 65, 63], torch.bfloat16, 64),
    (2, 64, 2, 7, 64, 16, [200, 0], torch.bfloat16, None),
    (2, 16, 2, 4, 256, 16, [333, 1024], torch.bfloat16, 256),
    (2, 64, 1, 1, 256, 128, [90, 2049], torch.float16, None),
    (1, 33, 2, 7, 256, 1, [129], torch.bfloat16, 64),
    (4, 1, 4, 4, 128, 128, [4096, 0, 1, 2500], torch.bfloat16, None),
    (2, 1, 2, 7, 64, 1, [3, 0], torch.float16, 64),
    (2, 7, 8, 1, 128, 16, [2048, 1], torch.float16, 512),
    (5, 64, 2, 7, 128, 16, [0, 0, 0, 0, 0], torch.bfloat16, None),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}-T{c[1]}-Hkv{c[2]}-G{c[3]}-D{c[4]}-bs{c[5]}-{str(c[7])[6:]}-sl{c[8]}")
def test_matches_reference(case):
    B, T, Hkv, G, D, bs, ctx, dtype, split_len = case
    c = make_case(B, T, Hkv, G, D, bs, ctx, dtype, seed=sum(ctx) + 31 * T + 7 * D + bs)
    check_case(f"B{B} T{T} Hkv{Hkv} G{G} D{D} bs{bs} ctx{ctx} {dtype}", c, dtype, split_len=split_len)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [64, 128, 256])
def test_strided_kv_and_out(dtype, D):
    """K and V as head-slices of one [num_blocks, bs, 2*Hkv, D] buffer; out as a head-slice too."""
    c = make_case(3, 9, 2, 4, D, 16, [150, 0, 700], dtype, seed=D, combined_kv=True)
    assert not c["k_cache"].is_contiguous()
    check_case(f"strided D{D} {dtype}", c, dtype, split_len=128, out_view=True)


def test_full_trees_long_context():
    c = make_case(2, 16, 8, 4, 128, 16, [8191, 4000], torch.bfloat16, seed=7, ragged_nodes=False)
    check_case("long-ctx", c, torch.bfloat16, check_partials=False)


def test_cuda_graph_capture_and_replay():
    """Capture plan.run once; replay with new q and new lengths written into the plan's tensors."""
    B, T, Hkv, G, D, bs = 3, 16, 2, 4, 128, 16
    dtype = torch.bfloat16
    # Built for the longest lengths; replays shrink them (pages stay allocated, the plan stays valid).
    c = make_case(B, T, Hkv, G, D, bs, [1000, 1000, 1000], dtype, seed=11)
    plan = plan_tree_attention(
        c["parents"], c["context_lens"], c["block_table"], c["num_nodes"], num_q_heads=Hkv * G, num_kv_heads=Hkv,
        head_dim=D, block_size=bs, max_context_len=1024, split_len=256,
    )
    q_static = c["q"].clone()
    out = torch.empty_like(q_static)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):  # warm-up outside capture (sets the kernels' shared-memory attributes)
            plan.run(q_static, c["k_cache"], c["v_cache"], out=out, backend="cuda")
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.run(q_static, c["k_cache"], c["v_cache"], out=out, backend="cuda")

    for step, ctx in enumerate(([1000, 1000, 1000], [17, 0, 640])):
        g = torch.Generator().manual_seed(100 + step)
        q_static.copy_(torch.randn(q_static.shape, generator=g).to(dtype))
        plan.context_lens.copy_(torch.tensor(ctx, dtype=torch.int32))
        poison_(out)
        graph.replay()
        torch.cuda.synchronize()
        ref = tree_attention_reference(
            q_static, c["k_cache"], c["v_cache"], c["block_table"], plan.context_lens, c["parents"], c["num_nodes"],
            out_dtype=torch.float32,
        )
        err = float((out.float() - ref).abs().nan_to_num(nan=float("inf")).max())
        print(f"CASE graph replay {step} ctx={ctx} max_abs_err={err:.3g}")
        torch.testing.assert_close(out.float(), ref, atol=TOL[dtype][0], rtol=TOL[dtype][1])


def test_run_cuda_rejects_misaligned_cache():
    from tlt_kernels._cuda.tree_attention import run_cuda

    c = make_case(1, 4, 1, 1, 64, 16, [10], torch.bfloat16, seed=3)
    plan = plan_tree_attention(c["parents"], c["context_lens"], c["block_table"], c["num_nodes"],
                               num_q_heads=1, num_kv_heads=1, head_dim=64, block_size=16)
    flat = torch.zeros(c["k_cache"].numel() + 1, dtype=torch.bfloat16, device="cuda")
    k_bad = flat[1:].view(c["k_cache"].shape)  # 2-byte offset: not 16-byte aligned
    with pytest.raises(ValueError, match="k_cache rows must be 16-byte aligned"):
        run_cuda(plan, c["q"], k_bad, c["v_cache"], torch.empty_like(c["q"]), 0.125)
