"""``plan_masked_attention``: new tokens that see each other through an explicit mask (a forest, a causal chunk)
match a float64 naive attention on every backend, on CPU (the kernels in the interpreter) and on the GPU; a mask
equal to a tree's ancestors gives what ``plan_tree_attention`` gives; bad arguments are named."""
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import tlt_kernels as tlt
from strategies import backend_params, gen, seeds
from tlt_kernels.tree import tree_ancestor_mask

TOL = {torch.float32: 1e-4, torch.bfloat16: 1.6e-2}


@st.composite
def masked_problems(draw, D=64):
    B, T = draw(st.integers(1, 3)), draw(st.integers(1, 8))
    Hkv, G = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    bs = draw(st.sampled_from([1, 4, 16]))
    g = gen(draw(seeds))
    ctx = [draw(st.integers(0, 40)) for _ in range(B)]
    W = max(-(-(c + T) // bs) for c in ctx)
    num_blocks = B * W + 1
    table = torch.randperm(num_blocks, generator=g)[: B * W].reshape(B, W).to(torch.int32)
    mask = (torch.rand(B, T, T, generator=g) < draw(st.sampled_from([0.0, 0.3, 0.7]))) | torch.eye(T, dtype=torch.bool)
    return dict(q=torch.randn(B, T, Hkv * G, D, generator=g), k=torch.randn(num_blocks, bs, Hkv, D, generator=g),
                v=torch.randn(num_blocks, bs, Hkv, D, generator=g), table=table, mask=mask,
                ctx=torch.tensor(ctx, dtype=torch.int32), dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])))


def naive(p):
    """float64: row i of request b sees the context slots and the new tokens its mask row names."""
    q, k, v = (p[x].to(p["dtype"]).to(torch.float64) for x in ("q", "k", "v"))
    B, T, Hq, D = q.shape
    bs, Hkv = k.shape[1], k.shape[2]
    out = torch.zeros(B, T, Hq, D, dtype=torch.float64)
    for b in range(B):
        c = int(p["ctx"][b])
        for i in range(T):
            seen = list(range(c)) + [c + j for j in range(T) if p["mask"][b, i, j]]
            rows = [(int(p["table"][b, s // bs]), s % bs) for s in seen]
            ks, vs = torch.stack([k[r] for r in rows]), torch.stack([v[r] for r in rows])
            for h in range(Hq):
                w = torch.softmax(ks[:, h // (Hq // Hkv)] @ q[b, i, h] / math.sqrt(D), 0)
                out[b, i, h] = w @ vs[:, h // (Hq // Hkv)]
    return out


def run_masked(p, backend, device="cpu"):
    dt = p["dtype"]
    q, k, v = (p[x].to(device, dt) for x in ("q", "k", "v"))
    plan = tlt.plan_masked_attention(p["mask"].to(device), p["ctx"].to(device), p["table"].to(device),
                                     num_q_heads=q.shape[2], num_kv_heads=k.shape[2], head_dim=q.shape[3],
                                     block_size=k.shape[1], max_context_len=p["table"].shape[1] * k.shape[1],
                                     num_blocks=k.shape[0])
    return plan.run(q, k, v, backend=backend)


@given(st.data())
@pytest.mark.parametrize("backend", backend_params())
def test_masked_plan_matches_naive_attention(backend, data):
    p = data.draw(masked_problems(D=64 if backend != "torch" else data.draw(st.sampled_from([8, 64]))))
    got = run_masked(p, backend)
    torch.testing.assert_close(got.to(torch.float64), naive(p), atol=TOL[p["dtype"]], rtol=TOL[p["dtype"]])


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["triton", "cuda", "auto"])
@pytest.mark.parametrize("seed", range(4))
def test_masked_plan_on_the_gpu(backend, seed):
    g = torch.Generator().manual_seed(seed)
    B, T, Hkv, G, bs = 3, 5 + seed, 2, 3, 16
    ctx = torch.tensor([0, 37, 300 + seed][:B], dtype=torch.int32)
    W = -(-(int(ctx.max()) + T) // bs)
    mask = (torch.rand(B, T, T, generator=g) < 0.4) | torch.eye(T, dtype=torch.bool)
    p = dict(q=torch.randn(B, T, Hkv * G, 64, generator=g), k=torch.randn(B * W, bs, Hkv, 64, generator=g),
             v=torch.randn(B * W, bs, Hkv, 64, generator=g), mask=mask, ctx=ctx,
             table=torch.randperm(B * W, generator=g).reshape(B, W).to(torch.int32), dtype=torch.bfloat16)
    got = run_masked(p, backend, "cuda")
    torch.testing.assert_close(got.cpu().to(torch.float64), naive(p), atol=TOL[torch.bfloat16], rtol=TOL[torch.bfloat16])


def _growing_forest_problem(seed, ctx, T=6, Hkv=2, G=3, bs=16, D=64):
    g = torch.Generator().manual_seed(seed)
    B = len(ctx)
    W = -(-(max(ctx) + T) // bs)
    mask = (torch.rand(B, T, T, generator=g) < 0.4).tril() | torch.eye(T, dtype=torch.bool)  # a forest's rows
    return dict(q=torch.randn(B, T, Hkv * G, D, generator=g), k=torch.randn(B * W, bs, Hkv, D, generator=g),
                v=torch.randn(B * W, bs, Hkv, D, generator=g), mask=mask, ctx=torch.tensor(ctx, dtype=torch.int32),
                table=torch.randperm(B * W, generator=g).reshape(B, W).to(torch.int32), dtype=torch.bfloat16)


def _run_growing_plans(p, backend, device):
    """Plans of the first 2, 4, 6 tokens (a draft's forest growing by steps) sharing one zeroing of the arrival
    counters, sized for the widest, and kept ``num_nodes``; returns each run's output and the plans' splits."""
    q, k, v = (p[x].to(device, p["dtype"]) for x in ("q", "k", "v"))
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    counters = torch.zeros(B, Hkv, -(-T * (Hq // Hkv) // tlt.ops.tree_attention.SPLIT_COUNTER_ROWS),
                           dtype=torch.int32, device=device)
    outs, splits = [], []
    for n in (2, 4, 6, 6):  # the widest twice: a second run finds the counters as the first left them
        plan = tlt.plan_masked_attention(
            p["mask"][:, :n, :n].to(device), p["ctx"].to(device), p["table"].to(device), num_q_heads=Hq,
            num_kv_heads=Hkv, head_dim=D, block_size=k.shape[1], max_context_len=p["table"].shape[1] * k.shape[1],
            num_blocks=k.shape[0], num_nodes=torch.full((B,), n, dtype=torch.int32, device=device),
            split_counters=counters)
        outs.append(plan.run(q[:, :n], k, v, backend=backend).cpu().to(torch.float64))
        splits.append(plan.num_splits)
    assert not counters.any()  # every run leaves them zeros
    return outs, splits


def _check_growing_plans(p, outs):
    for out in outs:
        n = out.shape[1]
        sub = dict(p, q=p["q"][:, :n], mask=p["mask"][:, :n, :n])
        torch.testing.assert_close(out, naive(sub), atol=TOL[p["dtype"]], rtol=TOL[p["dtype"]])


@pytest.mark.parametrize("backend", backend_params())
def test_plans_sharing_counters_match_naive_attention(backend):
    p = _growing_forest_problem(seed=3, ctx=[0, 70])
    _check_growing_plans(p, _run_growing_plans(p, backend, "cpu")[0])


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["triton", "cuda", "auto"])
def test_plans_sharing_counters_on_the_gpu(backend):
    p = _growing_forest_problem(seed=4, ctx=[5, 3000, 700])
    outs, splits = _run_growing_plans(p, backend, "cuda")
    assert max(splits) > 1  # the split merge (where the Triton kernel counts arrivals) ran
    _check_growing_plans(p, outs)


def test_a_tree_mask_gives_the_tree_plan():
    g = torch.Generator().manual_seed(1)
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2], [-1, 0, 1, 2, 3, 4]], dtype=torch.int32)
    B, T, Hkv, D, bs = 2, 6, 2, 8, 4
    ctx = torch.tensor([5, 11], dtype=torch.int32)
    table = torch.arange(2 * 5, dtype=torch.int32).reshape(2, 5)
    q = torch.randn(B, T, 4, D, generator=g)
    k, v = torch.randn(10, bs, Hkv, D, generator=g), torch.randn(10, bs, Hkv, D, generator=g)
    geometry = dict(num_q_heads=4, num_kv_heads=Hkv, head_dim=D, block_size=bs)
    tree = tlt.plan_tree_attention(parents, ctx, table, **geometry)
    masked = tlt.plan_masked_attention(tree_ancestor_mask(parents), ctx, table, max_context_len=20, **geometry)
    packed = tlt.plan_masked_attention(tlt.pack_tree_mask(tree_ancestor_mask(parents)), ctx, table,
                                       max_context_len=20, **geometry)
    assert torch.equal(masked.tree_mask, tree.tree_mask) and torch.equal(packed.tree_mask, tree.tree_mask)
    torch.testing.assert_close(masked.run(q, k, v), tree.run(q, k, v))


@pytest.mark.parametrize("bad,why", [
    (dict(mask=torch.ones(1, 3, 2, dtype=torch.bool)), r"mask must be bool \[B, T, T\] or bit-packed"),
    (dict(mask=torch.ones(1, 3, 3, dtype=torch.int32)), r"int32 \[B, T, ceil\(T / 32\)\]"),
    (dict(mask=torch.ones(1, 3, 3)), "mask must have dtype"),
    (dict(context_lens=torch.zeros(2, dtype=torch.int32)), "context_lens"),
    (dict(max_context_len=-1), "max_context_len"),
    (dict(num_nodes=torch.full((1,), 3, dtype=torch.int64)), "num_nodes"),
    (dict(num_nodes=torch.full((2,), 3, dtype=torch.int32)), "num_nodes"),
    (dict(split_counters=torch.zeros(1, 2, 1, dtype=torch.int32)), r"split_counters must be contiguous int32 \[B=1"),
    (dict(split_counters=torch.zeros(1, 1, 0, dtype=torch.int32)), r"split_counters must be .* >= 1"),
    (dict(split_counters=torch.zeros(1, 1, 1)), "split_counters must have dtype"),
])
def test_bad_arguments_are_named(bad, why):
    args = dict(mask=torch.ones(1, 3, 3, dtype=torch.bool), context_lens=torch.zeros(1, dtype=torch.int32),
                block_table=torch.zeros(1, 2, dtype=torch.int32), num_q_heads=2, num_kv_heads=1, head_dim=8,
                block_size=4, max_context_len=4)
    args.update(bad)
    mask, ctx, table = args.pop("mask"), args.pop("context_lens"), args.pop("block_table")
    with pytest.raises((ValueError, TypeError), match=why):
        tlt.plan_masked_attention(mask, ctx, table, **args)
