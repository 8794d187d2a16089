"""compact_kv: exact slot-level checks on paged caches, multi-layer, bad inputs, Triton parity."""
import pytest
import torch
from conftest import agreement_backends, kernel_devices, need_backend

from tlt_kernels import compact_kv


def make_case(B, block_size, layers, gen, Hkv=2, D=8, max_path=5, tree_nodes=9, dtype=torch.float32, chain=False):
    """Random paged caches with non-contiguous, shuffled block tables and random accepted paths."""
    ctx = torch.randint(0, 3 * block_size + 2, (B,), generator=gen)
    need = int((ctx + tree_nodes).max())
    max_blocks = (need + block_size - 1) // block_size + 1
    num_blocks = B * max_blocks + 3
    perm = torch.randperm(num_blocks, generator=gen)[: B * max_blocks]
    table = perm.view(B, max_blocks).to(torch.int32)
    ks = [torch.randn(num_blocks, block_size, Hkv, D, generator=gen).to(dtype) for _ in range(layers)]
    vs = [torch.randn(num_blocks, block_size, Hkv, D, generator=gen).to(dtype) for _ in range(layers)]
    nodes = torch.full((B, max_path + 1), -1, dtype=torch.int32)
    nacc = torch.randint(0, max_path + 1, (B,), generator=gen).to(torch.int32)
    for b in range(B):
        n = int(nacc[b])
        if chain:
            path = list(range(n + 1))
        else:
            path = [0] + sorted(torch.randperm(tree_nodes - 1, generator=gen)[:n].add(1).tolist())
        nodes[b, : n + 1] = torch.tensor(path, dtype=torch.int32)
    return ks, vs, table, ctx.to(torch.int32), nodes, nacc


def expected(ks, vs, table, ctx, nodes, nacc):
    """Per-slot Python oracle: a dict {(layer, kind, block, offset): row} of what must change."""
    block_size = ks[0].shape[1]
    want = {}
    for b in range(table.shape[0]):
        for d in range(int(nacc[b]) + 1):
            src = int(ctx[b]) + int(nodes[b, d])
            dst = int(ctx[b]) + d
            sb, so = int(table[b, src // block_size]), src % block_size
            db, do = int(table[b, dst // block_size]), dst % block_size
            for l in range(len(ks)):
                want[(l, 0, db, do)] = ks[l][sb, so].clone()
                want[(l, 1, db, do)] = vs[l][sb, so].clone()
    return want


def check(ks, vs, before_k, before_v, want):
    for l in range(len(ks)):
        for kind, (now, before) in enumerate(((ks[l], before_k[l]), (vs[l], before_v[l]))):
            exp = before.clone()
            for (ll, kk, blk, off), row in want.items():
                if ll == l and kk == kind:
                    exp[blk, off] = row
            assert torch.equal(now, exp), f"layer {l} {'kv'[kind]}"


@pytest.mark.parametrize("backend", agreement_backends())
@pytest.mark.parametrize("block_size,B,layers", [(1, 3, 2), (3, 7, 3), (16, 2, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chain", [False, True])
def test_matches_reference(backend, block_size, B, layers, dtype, chain, gen):
    """Every backend moves the same bits as the torch reference on CPU tensors (kernels on the GPU, or the CPU
    under the interpreter)."""
    device = kernel_devices()[0]
    need_backend("compact_kv", backend, torch.device(device))
    ks, vs, table, ctx, nodes, nacc = make_case(B, block_size, layers, gen, Hkv=3, D=5, dtype=dtype, chain=chain)
    ref_k, ref_v = [k.clone() for k in ks], [v.clone() for v in vs]
    ref_new = compact_kv(ref_k, ref_v, table, ctx, nodes, nacc, backend="torch")
    dk, dv = [k.to(device) for k in ks], [v.to(device) for v in vs]
    new = compact_kv(dk, dv, table.to(device), ctx.to(device), nodes.to(device), nacc.to(device), backend=backend)
    assert torch.equal(new.cpu(), ref_new)
    for l in range(layers):
        assert torch.equal(dk[l].cpu(), ref_k[l]) and torch.equal(dv[l].cpu(), ref_v[l]), f"layer {l}"


@pytest.mark.parametrize("block_size", [1, 3, 16])
@pytest.mark.parametrize("B,layers", [(1, 1), (3, 2), (7, 3)])
@pytest.mark.parametrize("chain", [False, True])
def test_reference_moves_exactly_the_path(block_size, B, layers, chain, gen):
    ks, vs, table, ctx, nodes, nacc = make_case(B, block_size, layers, gen, chain=chain)
    before_k, before_v = [k.clone() for k in ks], [v.clone() for v in vs]
    want = expected(ks, vs, table, ctx, nodes, nacc)
    new = compact_kv(ks, vs, table, ctx, nodes, nacc)
    assert new.dtype == torch.int32 and new.tolist() == (ctx + nacc + 1).tolist()
    check(ks, vs, before_k, before_v, want)


def test_hand_worked_overlapping_move():
    # block_size 2, ctx 1: path 0 -> 2 -> 3 moves slot 3 -> 2 and 4 -> 3 (slot 3 is read and written).
    k = torch.arange(8.0).view(4, 2, 1, 1)
    v = -k.clone()
    table = torch.tensor([[2, 0, 3]], dtype=torch.int32)  # slots: 0,1 -> blk 2; 2,3 -> blk 0; 4,5 -> blk 3
    new = compact_kv(k, v, table, torch.tensor([1], dtype=torch.int32), torch.tensor([[0, 2, 3, -1]], dtype=torch.int32), torch.tensor([2], dtype=torch.int32))
    assert new.tolist() == [4]
    # Before: slot2=blk0[0]=0, slot3=blk0[1]=1, slot4=blk3[0]=6. After: slot2 <- 1, slot3 <- 6.
    assert k.flatten().tolist() == [1.0, 6.0, 2, 3, 4, 5, 6, 7]
    assert v.flatten().tolist() == [-1.0, -6.0, -2, -3, -4, -5, -6, -7]


def test_single_tensor_and_bf16(gen):
    ks, vs, table, ctx, nodes, nacc = make_case(3, 4, 1, gen, dtype=torch.bfloat16)
    before_k, before_v = [k.clone() for k in ks], [v.clone() for v in vs]
    want = expected(ks, vs, table, ctx, nodes, nacc)
    compact_kv(ks[0], vs[0], table, ctx, nodes, nacc)
    check(ks, vs, before_k, before_v, want)


def test_bad_inputs(gen):
    ks, vs, table, ctx, nodes, nacc = make_case(2, 4, 2, gen, max_path=3)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    with pytest.raises(ValueError, match="strictly increasing"):
        compact_kv(ks, vs, table, ctx, i32([[0, 3, 2, -1], [0, -1, -1, -1]]), i32([2, 0]))
    with pytest.raises(ValueError, match=r"accepted_nodes\[1, 0\] = 1"):
        compact_kv(ks, vs, table, ctx, i32([[0, -1, -1, -1], [1, -1, -1, -1]]), i32([0, 0]))
    with pytest.raises(ValueError, match=r"num_accepted\[0\] = 4"):
        compact_kv(ks, vs, table, ctx, nodes, i32([4, 0]))
    with pytest.raises(ValueError, match="block_table holds only"):
        compact_kv(ks, vs, table, i32([table.shape[1] * 4 - 1, 0]), i32([[0, 2, -1, -1], [0, -1, -1, -1]]), i32([1, 0]))
    bad_table = table.clone()
    bad_table[0, :] = 10_000
    with pytest.raises(ValueError, match=r"block_table\[0, \d+\] = 10000"):
        compact_kv(ks, vs, bad_table, ctx, nodes, nacc)
    with pytest.raises(ValueError, match="k_cache has 2 layers but v_cache has 1"):
        compact_kv(ks, vs[:1], table, ctx, nodes, nacc)
    with pytest.raises(ValueError, match=r"k_cache\[1\] has size"):
        compact_kv([ks[0], ks[1][:, :2]], vs, table, ctx, nodes, nacc)
    with pytest.raises(TypeError, match=r"k_cache\[1\] has dtype"):
        compact_kv([ks[0], ks[1].double()], vs, table, ctx, nodes, nacc)
    with pytest.raises(ValueError, match="must be contiguous"):
        compact_kv([k.transpose(2, 3) for k in ks], [v.transpose(2, 3) for v in vs], table, ctx, nodes, nacc)
    with pytest.raises(TypeError, match="context_lens must have dtype"):
        compact_kv(ks, vs, table, ctx.float(), nodes, nacc)
    with pytest.raises(ValueError, match="num_accepted has size 3"):
        compact_kv(ks, vs, table, ctx, nodes, i32([0, 0, 0]))


# ----------------------------------------------------------------------------- Triton kernel


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_large_gpu(dtype, gen):
    ks, vs, table, ctx, nodes, nacc = make_case(64, 16, 8, gen, Hkv=8, D=128, max_path=16, tree_nodes=64, dtype=dtype)
    ref_k, ref_v = [k.clone() for k in ks], [v.clone() for v in vs]
    ref_new = compact_kv(ref_k, ref_v, table, ctx, nodes, nacc, backend="torch")
    dk, dv = [k.cuda() for k in ks], [v.cuda() for v in vs]
    new = compact_kv(dk, dv, table.cuda(), ctx.cuda(), nodes.cuda(), nacc.cuda(), backend="triton")
    assert torch.equal(new.cpu(), ref_new)
    for l in range(8):
        assert torch.equal(dk[l].cpu(), ref_k[l]) and torch.equal(dv[l].cpu(), ref_v[l])


@pytest.mark.cuda
def test_triton_cuda_graph(gen):
    ks, vs, table, ctx, nodes, nacc = make_case(4, 16, 2, gen, Hkv=2, D=64, dtype=torch.bfloat16)
    ref_k, ref_v = [k.clone() for k in ks], [v.clone() for v in vs]
    compact_kv(ref_k, ref_v, table, ctx, nodes, nacc, backend="torch")
    dk, dv = [k.cuda() for k in ks], [v.cuda() for v in vs]
    args = (table.cuda(), ctx.cuda(), nodes.cuda(), nacc.cuda())
    scratch_k, scratch_v = [k.clone() for k in dk], [v.clone() for v in dv]
    compact_kv(scratch_k, scratch_v, *args, backend="triton")  # warm-up: compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        compact_kv(dk, dv, *args, backend="triton")
    graph.replay()
    torch.cuda.synchronize()
    for l in range(2):
        assert torch.equal(dk[l].cpu(), ref_k[l]) and torch.equal(dv[l].cpu(), ref_v[l])


@pytest.mark.triton
def test_triton_custom_op_opcheck(gen):
    import tlt_kernels._triton.compact_kv  # noqa: F401  (registers tlt::compact_kv)

    dev = kernel_devices()[0]  # the GPU, or the CPU under the interpreter
    ks, vs, table, ctx, nodes, nacc = make_case(2, 4, 2, gen)
    ks, vs = [k.to(dev) for k in ks], [v.to(dev) for v in vs]
    table, ctx, nodes, nacc = (x.to(dev) for x in (table, ctx, nodes, nacc))
    torch.library.opcheck(torch.ops.tlt.compact_kv.default, (ks, vs, table, ctx, nodes, nacc))


@pytest.mark.triton
def test_triton_eager_call_launches_directly_and_matches_the_custom_op(monkeypatch, gen):
    import tlt_kernels._backend as backend
    from tlt_kernels._triton import compact_kv as tck

    device = kernel_devices()[0]
    ks, vs, table, ctx, nodes, nacc = make_case(3, 4, 2, gen)
    args = (table.to(device), ctx.to(device), nodes.to(device), nacc.to(device))
    results = []
    calls = []
    real = tck.compact_kv.op
    monkeypatch.setattr(tck.compact_kv, "op", lambda *a: calls.append(1) or real(*a))
    for direct in (True, False):
        monkeypatch.setattr(backend, "DIRECT_DISPATCH", direct)
        dk, dv = [k.clone().to(device) for k in ks], [v.clone().to(device) for v in vs]
        new = compact_kv(dk, dv, *args, backend="triton")
        results.append((new.cpu(), [k.cpu() for k in dk + dv]))
        assert calls == ([] if direct else [1])
    (new_a, caches_a), (new_b, caches_b) = results
    assert torch.equal(new_a, new_b) and all(torch.equal(a, b) for a, b in zip(caches_a, caches_b))
    ref_k, ref_v = [k.clone() for k in ks], [v.clone() for v in vs]
    assert torch.equal(compact_kv(ref_k, ref_v, table, ctx, nodes, nacc, backend="torch"), new_a)
    assert all(torch.equal(a, b) for a, b in zip(caches_a, ref_k + ref_v)), "both paths move exactly the reference path"


def _loop_oracle(block_table, context_lens, accepted_nodes, num_accepted, num_blocks, block_size):
    """The former per-request validation loop: the vectorized checks must raise exactly what it raised."""
    B, P = accepted_nodes.shape
    nodes, nacc, ctx, table = (t.to(torch.int64) for t in (accepted_nodes, num_accepted, context_lens, block_table))
    capacity = table.shape[1] * block_size
    for b in range(B):
        n = int(nacc[b])
        if not 0 <= n < P:
            raise ValueError(f"num_accepted[{b}] = {n} is outside [0, {P - 1}] (accepted_nodes has {P} columns)")
        if int(ctx[b]) < 0:
            raise ValueError(f"context_lens[{b}] = {int(ctx[b])} is negative")
        path = nodes[b, : n + 1]
        if int(path[0]) != 0:
            raise ValueError(f"accepted_nodes[{b}, 0] = {int(path[0])}, expected 0 (the root starts every path)")
        if n and bool((path[1:] <= path[:-1]).any()):
            raise ValueError(f"accepted_nodes[{b}, :{n + 1}] = {path.tolist()} must be strictly increasing (a root-to-leaf path in topological order)")
        last_slot = int(ctx[b]) + int(path[-1])
        if last_slot >= capacity:
            raise ValueError(f"request {b}: node {int(path[-1])} sits at slot {last_slot} but block_table holds only "
                             f"{capacity} slots ({table.shape[1]} blocks x block_size {block_size})")
        slots = torch.cat([int(ctx[b]) + path, int(ctx[b]) + torch.arange(n + 1)])
        pages = table[b, slots // block_size]
        bad = (pages < 0) | (pages >= num_blocks)
        if bad.any():
            s = int(slots[bad.nonzero()[0, 0]])
            raise ValueError(f"block_table[{b}, {s // block_size}] = {int(table[b, s // block_size])} is outside [0, {num_blocks}) (needed for slot {s})")


def test_vectorized_validation_raises_what_the_loop_raised(gen):
    """Random valid and corrupted batches: the whole-batch checks report the same first error as a per-request loop."""
    from tlt_kernels.ops.compact_kv import _validate_values

    outcomes = set()
    for trial in range(400):
        B = int(torch.randint(1, 6, (1,), generator=gen))
        block_size = [1, 3, 4, 16][trial % 4]
        ks, vs, table, ctx, nodes, nacc = make_case(B, block_size, 1, gen, max_path=4)
        num_blocks = ks[0].shape[0]
        for _ in range(int(torch.randint(0, 3, (1,), generator=gen))):  # up to two corruptions
            b = int(torch.randint(0, B, (1,), generator=gen))
            kind = int(torch.randint(0, 7, (1,), generator=gen))
            if kind == 0:
                nacc[b] = int(torch.randint(-2, 8, (1,), generator=gen))
            elif kind == 1:
                ctx[b] = -int(torch.randint(1, 4, (1,), generator=gen))
            elif kind == 2:
                nodes[b, 0] = int(torch.randint(1, 4, (1,), generator=gen))
            elif kind == 3 and nodes.shape[1] > 2:
                nodes[b, 2] = nodes[b, 1]
            elif kind == 4:
                ctx[b] = table.shape[1] * block_size - int(torch.randint(0, 3, (1,), generator=gen))
            elif kind == 5:
                table[b, int(torch.randint(0, table.shape[1], (1,), generator=gen))] = num_blocks + 7
            else:
                table[b, int(torch.randint(0, table.shape[1], (1,), generator=gen))] = -1
        errors = []
        for check in (_loop_oracle, _validate_values):
            try:
                check(table, ctx, nodes, nacc, num_blocks, block_size)
                errors.append(None)
            except ValueError as exc:
                errors.append(str(exc))
        assert errors[0] == errors[1], f"trial {trial}"
        outcomes.add(None if errors[0] is None else errors[0].split("[")[0].split(":")[0][:20])
    assert len(outcomes) >= 6, f"the corruptions must reach most checks: {outcomes}"
