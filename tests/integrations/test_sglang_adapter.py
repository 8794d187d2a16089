"""``tlt_kernels.integrations.sglang``: SGLang's EAGLE verification call shapes and its retrieval layout.

Written from SGLang's documented semantics and the case its public kernel test checks (re-expressed, not copied):
the greedy walk over first-child / next-sibling links with its outputs (predicts, accept_index, accept_token_num),
random trees with their siblings linked in every order checked against a direct implementation of that rule, the
sampled rule's output law, our trees converted to its layout and back, argument errors and graph capture."""
import itertools
import random

import pytest
import torch

from conftest import agreement_backends, kernel_devices, need_backend
from tlt_kernels import verify_tree
from tlt_kernels.integrations.sglang import (retrieval_arrays, tree_speculative_sampling_target_only,
                                             verify_tree_greedy)

DEV = kernel_devices()[0]


def _device(backend):
    dev = torch.device(DEV) if backend != "torch" else torch.device("cpu")
    need_backend("verify_tree", backend, dev)
    return dev


def _two_requests():
    """Two 6-node trees; in request 1 the root's children are linked 4 then 1 (not index order)."""
    candidates = torch.tensor([[0, 1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12]])
    retrive_index = torch.tensor([[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]])
    next_token = torch.tensor([[1, 2, -1, 4, 5, -1], [4, 2, 3, -1, 5, -1]])
    next_sibling = torch.tensor([[-1, 3, -1, -1, -1, -1], [-1, -1, -1, -1, 1, -1]])
    logits = torch.zeros(2, 6, 20)
    argmax = {(0, 0): 3, (0, 3): 4, (0, 4): 5, (1, 0): 11, (1, 4): 12}
    for b in range(2):
        for i in range(6):
            logits[b, i, argmax.get((b, i), 18)] = 9.0
    return candidates, retrive_index, next_token, next_sibling, logits


@pytest.mark.parametrize("backend", agreement_backends())
def test_greedy_walks_the_linked_siblings(backend):
    """Request 0 accepts nodes 3, 4, 5 (node 1's token is not the root's argmax, its sibling 3's is) and ends with
    node 5's argmax; request 1 accepts 4 then 5, tried before node 1 because the list says so."""
    dev = _device(backend)
    args = [t.to(dev) for t in _two_requests()]
    predicts, accept_index, accept_num = verify_tree_greedy(*args, num_spec_steps=4, backend=backend)
    assert predicts.cpu().tolist() == [3, -1, -1, 4, 5, 18, 11, -1, -1, -1, 12, 18]
    assert accept_index.cpu().tolist() == [[0, 3, 4, 5], [6, 10, 11, -1]]
    assert accept_num.cpu().tolist() == [3, 2]


def test_given_predicts_keep_their_other_entries():
    args = _two_requests()
    predicts = torch.full((12,), 77, dtype=torch.int32)
    out, _, _ = verify_tree_greedy(*args, num_spec_steps=4, predicts=predicts, backend="torch")
    assert out is predicts and predicts.tolist() == [3, 77, 77, 4, 5, 18, 11, 77, 77, 77, 12, 18]


def _random_linked_tree(rng: random.Random, T: int):
    """A random tree of T nodes, node 0 the root and the others labelled in random order, every node's children
    linked in a random order: (parent, next_token, next_sibling) lists."""
    labels = [0] + rng.sample(range(1, T), T - 1)  # labels[k]: the label of the k-th created node
    parent = [-1] * T
    for k in range(1, T):
        parent[labels[k]] = labels[rng.randrange(k)]
    next_token, next_sibling = [-1] * T, [-1] * T
    for p in range(T):
        children = [c for c in range(T) if parent[c] == p]
        rng.shuffle(children)
        if children:
            next_token[p] = children[0]
        for a, b in zip(children, children[1:]):
            next_sibling[a] = b
    return parent, next_token, next_sibling


def _greedy_rule(candidates, next_token, next_sibling, argmax, num_spec_steps):
    """SGLang's greedy rule on one request, directly: (path nodes, tokens following them)."""
    path, follow, cur = [0], [], 0
    while len(path) < num_spec_steps:
        child = next_token[cur]
        while child != -1 and candidates[child] != argmax[cur]:
            child = next_sibling[child]
        if child == -1:
            break
        follow.append(candidates[child])
        path.append(child)
        cur = child
    return path, follow + [argmax[cur]]


@pytest.mark.parametrize("B", [1, 3])  # one request: its [1, T] link tables are dense views (aliasing checks)
@pytest.mark.parametrize("seed", range(40))
def test_random_trees_in_any_sibling_order_follow_the_rule(seed, B):
    """Random trees (up to 9 nodes, random labels and sibling orders, drafts often equal to their parent row's
    argmax so walks go deep, flat rows permuted) against the rule implemented directly."""
    rng = random.Random(seed)
    T, V = rng.randint(1, 9), 7
    cands, nts, nss, argmaxes = [], [], [], []
    logits = torch.randn(B, T, V, generator=torch.Generator().manual_seed(seed))
    for b in range(B):
        parent, nt, ns = _random_linked_tree(rng, T)
        argmax = logits[b].argmax(-1).tolist()
        cand = [0] + [argmax[parent[i]] if rng.random() < 0.7 else rng.randrange(V) for i in range(1, T)]
        cands.append(cand), nts.append(nt), nss.append(ns), argmaxes.append(argmax)
    flat_rows = torch.randperm(B * T, generator=torch.Generator().manual_seed(seed)).reshape(B, T)
    flat_logits = torch.empty(B * T, V)
    flat_logits[flat_rows.reshape(-1)] = logits.reshape(B * T, V)
    steps = rng.randint(1, T + 1)
    predicts, accept_index, accept_num = verify_tree_greedy(
        torch.tensor(cands), flat_rows, torch.tensor(nts), torch.tensor(nss), flat_logits, steps, backend="torch")
    for b in range(B):
        path, follow = _greedy_rule(cands[b], nts[b], nss[b], argmaxes[b], steps)
        assert accept_num[b] == len(path) - 1
        assert accept_index[b].tolist() == [int(flat_rows[b, n]) for n in path] + [-1] * (steps - len(path))
        assert [int(predicts[flat_rows[b, n]]) for n in path] == follow


@pytest.mark.parametrize("backend", [pytest.param("torch", id="torch"),
                                     pytest.param("cuda", marks=pytest.mark.cuda, id="cuda")])
def test_sampled_walk_emits_the_targets_law_in_any_sibling_order(backend):
    """Root with three candidate children linked 3, 1, 2: over 200,000 requests at temperature 0.7 the first emitted
    token (the accepted child's, or the final draw) is distributed as the root row's softmax."""
    dev = _device(backend)
    B, V = 200_000, 6
    row = torch.randn(V, generator=torch.Generator().manual_seed(3))
    logits = torch.zeros(B, 4, V)
    logits[:, 0] = row
    candidates = torch.tensor([[0, 1, 4, 2]]).expand(B, 4)
    next_token = torch.tensor([[3, -1, -1, -1]]).expand(B, 4)
    next_sibling = torch.tensor([[-1, 2, -1, 1]]).expand(B, 4)
    index = torch.arange(B * 4).reshape(B, 4)
    predicts, _, _ = tree_speculative_sampling_target_only(
        candidates.to(dev), index.to(dev), next_token.to(dev), next_sibling.to(dev), logits.to(dev), 2,
        temperature=0.7, seed=torch.arange(B, device=dev), backend=backend)
    first = torch.bincount(predicts.reshape(B, 4)[:, 0].cpu().long(), minlength=V).double() / B
    assert (first - torch.softmax(row.double() / 0.7, -1)).abs().max() < 5e-3


@pytest.mark.parametrize("seed", range(10))
def test_our_trees_in_sglangs_layout_walk_as_ours_do(seed):
    """retrieval_arrays of random topologically ordered trees: the links list children in index order, node depths
    are tree_depths, and SGLang's greedy walk over them equals verify_tree over the tree itself."""
    g = torch.Generator().manual_seed(seed)
    B, T, V = 4, 7, 9
    parents = torch.full((B, T), -1, dtype=torch.int32)
    for i in range(1, T):
        parents[:, i] = torch.randint(0, i, (B,), generator=g)
    num_nodes = torch.randint(1, T + 1, (B,), generator=g).to(torch.int32)
    logits = torch.randn(B, T, V, generator=g)
    tokens = torch.where(torch.rand(B, T, generator=g) < 0.7,
                         logits.argmax(-1).gather(1, parents.clamp(min=0).long()), torch.randint(0, V, (B, T), generator=g))
    index, next_token, next_sibling, depths = retrieval_arrays(parents, num_nodes)
    for b, i in itertools.product(range(B), range(T)):
        if i >= num_nodes[b]:
            assert index[b, i] == next_token[b, i] == next_sibling[b, i] == -1
            continue
        children = [j for j in range(int(num_nodes[b])) if parents[b, j] == i]
        assert int(next_token[b, i]) == (children[0] if children else -1)
        if i > 0:
            siblings = [j for j in range(int(num_nodes[b])) if parents[b, j] == parents[b, i] and j > i]
            assert int(next_sibling[b, i]) == (siblings[0] if siblings else -1)
    want = verify_tree(logits, tokens, parents, num_nodes=num_nodes, backend="torch")
    _, accept_index, accept_num = verify_tree_greedy(tokens, index.clamp(min=0), next_token, next_sibling, logits, T,
                                                     backend="torch")
    assert torch.equal(accept_num, want.num_accepted)
    for b in range(B):
        n = int(want.num_accepted[b]) + 1
        assert accept_index[b, :n].tolist() == [b * T + int(x) for x in want.accepted_nodes[b, :n]]


def test_bad_arguments_are_named():
    candidates, index, next_token, next_sibling, logits = _two_requests()
    with pytest.raises(ValueError, match="retrive_next_sibling"):
        verify_tree_greedy(candidates, index, next_token, next_sibling[:, :5], logits, 4)
    with pytest.raises(ValueError, match="target_logits"):
        verify_tree_greedy(candidates, index, next_token, next_sibling, logits[:1], 4)
    with pytest.raises(ValueError, match="num_spec_steps"):
        verify_tree_greedy(candidates, index, next_token, next_sibling, logits, 0)
    with pytest.raises(ValueError, match="candidates"):
        verify_tree_greedy(candidates[0], index, next_token, next_sibling, logits, 4)


@pytest.mark.cuda
def test_captured_in_a_cuda_graph():
    candidates, index, next_token, next_sibling, logits = (t.cuda() for t in _two_requests())
    kw = dict(num_spec_steps=4, temperature=0.8, seed=torch.arange(2, device="cuda"), validate=False)
    tree_speculative_sampling_target_only(candidates, index, next_token, next_sibling, logits, **kw)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tree_speculative_sampling_target_only(candidates, index, next_token, next_sibling, logits, **kw)
    logits.mul_(0.5)
    kw["seed"].add_(9)
    graph.replay()
    want = tree_speculative_sampling_target_only(candidates, index, next_token, next_sibling, logits, **kw)
    for got, expected in zip(out, want):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("seed", range(8))
def test_build_tree_outputs_in_sglangs_layouts(seed):
    """Positions are seq_lens + depth; the full mask holds, request after request, T rows of seq_len + T entries
    (the prefix, then ancestors and self; padding rows all False); the query-length mask is the ancestor mask."""
    from tlt_kernels import tree_ancestor_mask, tree_depths
    from tlt_kernels.integrations.sglang import build_tree_outputs

    g = torch.Generator().manual_seed(seed)
    B, T = 3, 5
    parents = torch.full((B, T), -1, dtype=torch.int32)
    for i in range(1, T):
        parents[:, i] = torch.randint(0, i, (B,), generator=g)
    num_nodes = torch.randint(1, T + 1, (B,), generator=g).to(torch.int32)
    seq_lens = torch.randint(0, 6, (B,), generator=g)
    mask, positions, index, next_token, next_sibling = build_tree_outputs(parents, num_nodes, seq_lens,
                                                                          int(seq_lens.sum()))
    depths = tree_depths(parents, num_nodes)
    assert positions.tolist() == (seq_lens.unsqueeze(1) + depths).reshape(-1).tolist()
    ancestors = tree_ancestor_mask(parents, num_nodes)
    want = []
    for b in range(B):
        for i in range(T):
            valid = i < int(num_nodes[b])
            want += [valid] * int(seq_lens[b]) + ancestors[b, i].tolist()
    assert mask.dtype == torch.bool and mask.tolist() == want
    qlen_mask, *rest = build_tree_outputs(parents, num_nodes, seq_lens)
    assert torch.equal(qlen_mask, ancestors.reshape(-1))
    assert all(torch.equal(a, b) for a, b in zip(rest, (positions, index, next_token, next_sibling)))
