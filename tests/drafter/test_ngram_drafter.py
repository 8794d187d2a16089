"""NGramDrafter: device-resident histories, ragged appends without host copies, proposals equal
``ngram_propose`` on the same histories."""
import pytest
import torch

from conftest import kernel_devices
from tlt_kernels.drafter import NGramDrafter, drafts_to_tree
from tlt_kernels.ops.ngram import ngram_propose, ngram_propose_tree
from tlt_kernels.tree import validate_tree




@pytest.mark.parametrize("B,max_len", [(1, 7), (5, 33)])
def test_ragged_appends_match_python_lists(B, max_len, gen):
    dr = NGramDrafter(B, max_len)
    ref = [[] for _ in range(B)]
    for _ in range(6):
        n = int(torch.randint(1, 6, (1,), generator=gen))
        toks = torch.randint(0, 9, (B, n), generator=gen)
        num = torch.randint(0, n + 1, (B,), generator=gen).to(torch.int32)
        dr.append(toks, num)
        for b in range(B):
            ref[b] = (ref[b] + toks[b, : int(num[b])].tolist())[:max_len]
        for b in range(B):
            assert dr.lengths[b] == len(ref[b])
            assert dr.histories[b, : len(ref[b])].tolist() == ref[b]


@pytest.mark.parametrize("B,max_len", [(3, 7), (6, 33)])
def test_append_rows_matches_append_and_touches_only_its_rows(B, max_len, gen):
    """append_rows (the fused step's in-place commit) gives the chosen rows what append gives them; the other rows
    keep their histories; repeated sink rows (padding) write only the sink."""
    full, part = NGramDrafter(B + 1, max_len), NGramDrafter(B + 1, max_len)
    sink = B
    for _ in range(6):
        n = int(torch.randint(1, 6, (1,), generator=gen))
        toks = torch.randint(0, 9, (B + 1, n), generator=gen)
        num = torch.randint(0, n + 1, (B + 1,), generator=gen).to(torch.int32)
        rows = torch.randperm(B, generator=gen)[: max(1, B // 2)]
        masked = torch.zeros_like(num)
        masked[rows] = num[rows]
        full.append(toks, masked)
        padded = torch.cat([rows, torch.full((3,), sink)])  # three padding rows, all at the sink
        part.append_rows(padded, toks[padded], num[padded])
        for b in range(B):
            assert int(part.lengths[b]) == int(full.lengths[b])
            assert torch.equal(part.histories[b, : int(full.lengths[b])], full.histories[b, : int(full.lengths[b])])


def test_reset_slots_and_root_tokens():
    dr = NGramDrafter(3, 16)
    dr.append(torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]]), torch.tensor([3, 2, 1], dtype=torch.int32))
    dr.reset([1], torch.tensor([[11, 12, 13, 14]]), torch.tensor([3]))
    assert dr.lengths.tolist() == [3, 3, 1]
    assert dr.histories[1, :3].tolist() == [11, 12, 13]
    assert dr.root_tokens().tolist() == [3, 13, 7]
    dr.reset([0, 2], torch.zeros(2, 1, dtype=torch.long), torch.tensor([0, 0]))
    assert dr.lengths.tolist() == [0, 3, 0] and dr.root_tokens().tolist() == [0, 13, 0]


@pytest.mark.parametrize("device", kernel_devices())
def test_proposals_equal_op(device, gen):
    B, L = 4, 40
    base = torch.randint(0, 5, (B, L), generator=gen)  # small alphabet: many repeats
    dr = NGramDrafter(B, 64, device=device, min_n=1, max_n=3)
    lens = torch.tensor([40, 17, 1, 0], dtype=torch.int32)
    dr.append(base.to(device), lens.to(device))
    got = dr.propose(5)
    want = ngram_propose(base, lens, 5, 1, 3, backend="torch")
    assert torch.equal(got.drafts.cpu(), want.drafts) and torch.equal(got.num_drafts.cpu(), want.num_drafts)
    chain = dr.propose_chain_tree(5)
    validate_tree(chain.parents, chain.num_nodes)
    assert torch.equal(chain.num_nodes.cpu(), want.num_drafts + 1)
    assert torch.equal(chain.draft_tokens[:, 0].cpu(), torch.tensor([base[0, 39], base[1, 16], base[2, 0], 0]))
    tree = dr.propose_tree(3, 2)
    want_t = ngram_propose_tree(base, lens, 3, 2, 1, 3, backend="torch")
    assert all(torch.equal(a.cpu(), b) for a, b in zip(tree, want_t))


def test_drafts_to_tree_padding():
    drafts = torch.tensor([[4, 5, -1], [-1, -1, -1]])
    t = drafts_to_tree(drafts, torch.tensor([2, 0], dtype=torch.int32), torch.tensor([9, 8]))
    assert t.draft_tokens.tolist() == [[9, 4, 5, 0], [8, 0, 0, 0]]
    assert t.num_nodes.tolist() == [3, 1]
    validate_tree(t.parents, t.num_nodes)


def test_validation_errors():
    with pytest.raises(ValueError, match="min_n"):
        NGramDrafter(2, 8, min_n=3, max_n=2)
    dr = NGramDrafter(2, 8)
    with pytest.raises(ValueError, match="rows"):
        dr.append(torch.zeros(3, 2, dtype=torch.long), torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="num_new"):
        dr.append(torch.zeros(2, 2, dtype=torch.long), torch.zeros(3, dtype=torch.int32))


@pytest.mark.cuda
def test_append_and_propose_in_cuda_graph():
    B = 8
    dr = NGramDrafter(B, 256, device="cuda", backend="auto")
    dr.append(torch.randint(0, 4, (B, 32), device="cuda"), torch.full((B,), 32, dtype=torch.int32, device="cuda"))
    new = torch.randint(0, 4, (B, 3), device="cuda")
    num = torch.full((B,), 2, dtype=torch.int32, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        dr.append(new, num)  # warm-up (compiles the kernels)
        dr.propose(8)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        dr.append(new, num)
        out = dr.propose(8)
    g.replay()
    torch.cuda.synchronize()
    want = ngram_propose(dr.buffer, dr.lengths, 8, 1, 4, backend="torch")
    assert torch.equal(out.drafts, want.drafts)
