"""build_draft_tree: hand-worked cases, a brute-force oracle, invariants, bad inputs, Triton parity."""
import math

import pytest
import torch
from conftest import agreement_backends, kernel_devices, need_backend, poison_

from tlt_kernels import build_draft_tree, tree_ancestor_mask_packed, validate_tree

NEG = float("-inf")


def brute_force(parents, tokens, scores, num_verify, root):
    """Pure-Python greedy frontier selection for one request."""
    N = len(parents)
    taken = []
    while len(taken) < num_verify - 1:
        best = None
        for c in range(N):
            if c in taken or scores[c] == NEG:
                continue
            if parents[c] != -1 and parents[c] not in taken:
                continue
            if best is None or scores[c] > scores[best]:
                best = c
        if best is None:
            break
        taken.append(best)
    kept = sorted(taken)
    node_of = {c: i + 1 for i, c in enumerate(kept)}
    out_par = [-1] + [0 if parents[c] == -1 else node_of[parents[c]] for c in kept]
    out_tok = [root] + [tokens[c] for c in kept]
    out_idx = [-1] + kept
    pad = num_verify - len(out_par)
    return out_par + [0] * pad, out_tok + [0] * pad, out_idx + [-1] * pad, len(kept) + 1


def random_candidates(B, N, gen, cumulative=True, neg_inf_frac=0.1, ties=False):
    parents = torch.empty(B, N, dtype=torch.int32)
    for c in range(N):
        parents[:, c] = torch.randint(-1, c, (B,), generator=gen) if c else -1
    if ties:
        step = -torch.randint(0, 3, (B, N), generator=gen).float()  # many exact ties
    else:
        step = -torch.rand(B, N, generator=gen) * 2
    scores = torch.zeros(B, N)
    for c in range(N):
        base = torch.where(parents[:, c] >= 0, scores.gather(1, parents[:, c].clamp(min=0).long().unsqueeze(1)).squeeze(1), torch.zeros(B))
        scores[:, c] = base + step[:, c] if cumulative else step[:, c]
    scores[torch.rand(B, N, generator=gen) < neg_inf_frac] = NEG
    tokens = torch.randint(0, 32000, (B, N), generator=gen, dtype=torch.int64)
    root = torch.randint(0, 32000, (B,), generator=gen, dtype=torch.int64)
    return parents, tokens, scores, root


def check_against_brute_force(out, parents, tokens, scores, V, root):
    for b in range(parents.shape[0]):
        p, t, i, n = brute_force(parents[b].tolist(), tokens[b].tolist(), scores[b].tolist(), V, int(root[b]))
        assert out.parents[b].tolist() == p, f"request {b}"
        assert out.draft_tokens[b].tolist() == t, f"request {b}"
        assert out.cand_index[b].tolist() == i, f"request {b}"
        assert int(out.num_nodes[b]) == n, f"request {b}"


@pytest.mark.parametrize("backend", agreement_backends())
@pytest.mark.parametrize("B,N,V", [(1, 1, 2), (3, 17, 8), (7, 50, 16), (2, 40, 37), (3, 5, 40)])
@pytest.mark.parametrize("cumulative", [True, False])
def test_matches_reference(backend, B, N, V, cumulative, gen):
    """Every backend builds the torch reference's tree (all outputs, the packed mask included) on the same device."""
    device = kernel_devices()[0]
    need_backend("build_draft_tree", backend, torch.device(device))
    parents, tokens, scores, root = random_candidates(B, N, gen, cumulative=cumulative, ties=not cumulative)
    args = [x.to(device) for x in (parents, tokens, scores)]
    ref = build_draft_tree(*args, V, root.to(device), return_mask=True, backend="torch")
    out = build_draft_tree(*args, V, root.to(device), return_mask=True, backend=backend)
    for name in ref._fields:
        assert torch.equal(getattr(out, name), getattr(ref, name)), name


def test_hand_worked():
    # Candidates: 0(-1, -0.1) 1(-1, -0.5) 2(0, -0.3) 3(0, -2.0) 4(2, -0.4) 5(1, -inf)
    parents = torch.tensor([[-1, -1, 0, 0, 2, 1]], dtype=torch.int32)
    tokens = torch.tensor([[10, 11, 12, 13, 14, 15]])
    scores = torch.tensor([[-0.1, -0.5, -0.3, -2.0, -0.4, NEG]])
    out = build_draft_tree(parents, tokens, scores, 5, torch.tensor([7]), return_mask=True)
    # Best 4: 0 (-0.1), 2 (-0.3), 4 (-0.4), 1 (-0.5) -> nodes in candidate order 0, 1, 2, 4.
    assert out.cand_index.tolist() == [[-1, 0, 1, 2, 4]]
    assert out.parents.tolist() == [[-1, 0, 0, 1, 3]]
    assert out.draft_tokens.tolist() == [[7, 10, 11, 12, 14]]
    assert out.num_nodes.tolist() == [5]
    assert torch.equal(out.tree_mask, tree_ancestor_mask_packed(out.parents, out.num_nodes))


def test_frontier_keeps_ancestor_closure_for_non_monotone_scores():
    # Child 1 scores higher than its parent 0, and 2 (root child) sits in between.
    parents = torch.tensor([[-1, 0, -1]], dtype=torch.int32)
    scores = torch.tensor([[-3.0, -0.1, -1.0]])
    out = build_draft_tree(parents, torch.tensor([[1, 2, 3]]), scores, 2, torch.tensor([0]))
    assert out.cand_index.tolist() == [[-1, 2]]  # plain top-1 would pick 1 without its parent
    out = build_draft_tree(parents, torch.tensor([[1, 2, 3]]), scores, 3, torch.tensor([0]))
    assert out.cand_index.tolist() == [[-1, 0, 2]]  # 2 first, then 0 (1 only becomes eligible after 0)


def test_ties_go_to_lower_index():
    parents = torch.full((1, 5), -1, dtype=torch.int32)
    scores = torch.tensor([[-1.0, -0.5, -0.5, -1.0, -0.5]])
    out = build_draft_tree(parents, torch.arange(5).unsqueeze(0), scores, 3, torch.tensor([9]))
    assert out.cand_index.tolist() == [[-1, 1, 2]]


def test_padding_when_few_usable():
    parents = torch.tensor([[-1, 0, 1, -1]], dtype=torch.int32)
    scores = torch.tensor([[-0.1, NEG, -0.2, NEG]])  # 2 hangs below the unusable 1
    out = build_draft_tree(parents, torch.tensor([[5, 6, 7, 8]]), scores, 4, torch.tensor([3]), return_mask=True)
    assert out.num_nodes.tolist() == [2]
    assert out.parents.tolist() == [[-1, 0, 0, 0]]
    assert out.draft_tokens.tolist() == [[3, 5, 0, 0]]
    assert out.cand_index.tolist() == [[-1, 0, -1, -1]]
    assert out.tree_mask[0, 2:].eq(0).all()


def test_num_verify_one_is_root_only():
    parents, tokens, scores, root = random_candidates(2, 6, torch.Generator().manual_seed(0))
    out = build_draft_tree(parents, tokens, scores, 1, root, return_mask=True)
    assert out.parents.tolist() == [[-1], [-1]]
    assert out.draft_tokens[:, 0].tolist() == root.tolist()
    assert out.tree_mask.tolist() == [[[1]], [[1]]]


@pytest.mark.parametrize("B,N,V", [(1, 1, 4), (3, 17, 8), (7, 50, 16), (3, 50, 64), (2, 33, 33)])
@pytest.mark.parametrize("ties", [False, True])
def test_matches_brute_force(B, N, V, ties, gen):
    parents, tokens, scores, root = random_candidates(B, N, gen, ties=ties)
    out = build_draft_tree(parents, tokens, scores, V, root, return_mask=True)
    check_against_brute_force(out, parents, tokens, scores, V, root)
    validate_tree(out.parents, out.num_nodes)
    assert torch.equal(out.tree_mask, tree_ancestor_mask_packed(out.parents, out.num_nodes))


@pytest.mark.parametrize("B,N,V", [(3, 40, 10), (5, 25, 12)])
def test_equals_plain_top_k_for_cumulative_scores(B, N, V, gen):
    parents, tokens, scores, root = random_candidates(B, N, gen, neg_inf_frac=0.0)
    out = build_draft_tree(parents, tokens, scores, V, root)
    for b in range(B):
        # Stable sort: ties -> lower index, as in the frontier rule (a parent never scores below its child).
        order = sorted(range(N), key=lambda c: (-scores[b, c].item(), c))[: V - 1]
        assert out.cand_index[b, 1:].tolist() == sorted(order)


def test_invariants(gen):
    parents, tokens, scores, root = random_candidates(7, 45, gen, cumulative=False)
    out = build_draft_tree(parents, tokens, scores, 20, root)
    for b in range(7):
        n = int(out.num_nodes[b])
        kept = set(out.cand_index[b, 1:n].tolist())
        for c in kept:
            p = int(parents[b, c])
            assert p == -1 or p in kept, "ancestor closure"
        idx = out.cand_index[b, 1:n].tolist()
        assert idx == sorted(idx), "nodes in candidate-index order"
        for i in range(1, n):
            assert 0 <= out.parents[b, i] < i
            c = int(out.cand_index[b, i])
            pc = int(parents[b, c])
            want = 0 if pc == -1 else 1 + idx.index(pc)
            assert int(out.parents[b, i]) == want


def test_bad_inputs():
    p = torch.tensor([[-1, 0]], dtype=torch.int32)
    t = torch.tensor([[1, 2]])
    s = torch.tensor([[-0.1, -0.2]])
    r = torch.tensor([0])
    with pytest.raises(ValueError, match=r"cand_parents\[0, 1\] = 1"):
        build_draft_tree(torch.tensor([[-1, 1]], dtype=torch.int32), t, s, 3, r)
    with pytest.raises(ValueError, match=r"cand_parents\[0, 0\] = -2"):
        build_draft_tree(torch.tensor([[-2, 0]], dtype=torch.int32), t, s, 3, r)
    with pytest.raises(ValueError, match="NaN"):
        build_draft_tree(p, t, torch.tensor([[-0.1, math.nan]]), 3, r)
    with pytest.raises(TypeError, match="cand_parents must have dtype int32"):
        build_draft_tree(p.long(), t, s, 3, r)
    with pytest.raises(TypeError, match="cand_scores must have dtype float32"):
        build_draft_tree(p, t, s.double(), 3, r)
    with pytest.raises(ValueError, match="cand_tokens has size 3"):
        build_draft_tree(p, torch.tensor([[1, 2, 3]]), s, 3, r)
    with pytest.raises(ValueError, match="root_tokens"):
        build_draft_tree(p, t, s, 3, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="num_verify must be >= 1"):
        build_draft_tree(p, t, s, 0, r)


# ----------------------------------------------------------------------------- Triton kernel


@pytest.mark.triton
@pytest.mark.parametrize("device", kernel_devices())
def test_triton_signed_zero_and_infinite_ties(device):
    parents = torch.full((1, 6), -1, dtype=torch.int32, device=device)
    scores = torch.tensor([[-1.0, -0.0, 0.0, float("inf"), -0.0, float("inf")]], device=device)
    tokens = torch.arange(6, device=device).unsqueeze(0)
    root = torch.zeros(1, dtype=torch.int64, device=device)
    for V in (2, 3, 4, 6):
        ref = build_draft_tree(parents, tokens, scores, V, root, backend="torch")
        out = build_draft_tree(parents, tokens, scores, V, root, backend="triton")
        assert torch.equal(out.cand_index, ref.cand_index), V
    assert ref.cand_index.tolist() == [[-1, 1, 2, 3, 4, 5]]


@pytest.mark.triton
@pytest.mark.parametrize("device", kernel_devices())
def test_triton_writes_every_output(device, gen):
    from tlt_kernels._triton.build_draft_tree import build_draft_tree_out

    parents, tokens, scores, root = random_candidates(3, 20, gen)
    V = 9
    outs = [poison_(torch.empty(3, V, dtype=torch.int32, device=device)), poison_(torch.empty(3, V, dtype=torch.int64, device=device)),
            poison_(torch.empty(3, V, dtype=torch.int32, device=device)), poison_(torch.empty(3, dtype=torch.int32, device=device)),
            poison_(torch.empty(3, V, 1, dtype=torch.int32, device=device))]
    build_draft_tree_out(parents.to(device), tokens.to(device), scores.to(device), root.to(device), *outs)
    ref = build_draft_tree(parents, tokens, scores, V, root, return_mask=True, backend="torch")
    for got, want in zip(outs, ref):
        assert torch.equal(got.cpu(), want)


@pytest.mark.cuda
@pytest.mark.parametrize("B,N,V", [(512, 1024, 128), (64, 256, 64), (5, 1000, 97)])
def test_triton_large_gpu(B, N, V, gen):
    parents, tokens, scores, root = random_candidates(B, N, gen, ties=True)
    args = [x.cuda() for x in (parents, tokens, scores)]
    ref = build_draft_tree(*args, V, root.cuda(), return_mask=True, backend="torch")
    out = build_draft_tree(*args, V, root.cuda(), return_mask=True, backend="triton")
    for name in ref._fields:
        assert torch.equal(getattr(out, name), getattr(ref, name)), name


@pytest.mark.triton
def test_triton_custom_op_opcheck(gen):
    import tlt_kernels._triton.build_draft_tree  # noqa: F401  (registers tlt::build_draft_tree)

    # Kernel tensors live where Triton can run them: the GPU, or the CPU under the interpreter.
    dev = kernel_devices()[0]
    parents, tokens, scores, root = (x.to(dev) for x in random_candidates(2, 10, gen))
    torch.library.opcheck(torch.ops.tlt.build_draft_tree.default, (parents, tokens, scores, 5, root, True))


@pytest.mark.cuda
def test_triton_cuda_graph(gen):
    parents, tokens, scores, root = (x.cuda() for x in random_candidates(16, 200, gen))
    ref = build_draft_tree(parents, tokens, scores, 32, root, return_mask=True, backend="torch")
    build_draft_tree(parents, tokens, scores, 32, root, return_mask=True, backend="triton")  # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = build_draft_tree(parents, tokens, scores, 32, root, return_mask=True, backend="triton")
    graph.replay()
    torch.cuda.synchronize()
    for name in ref._fields:
        assert torch.equal(getattr(out, name), getattr(ref, name)), name
