"""``ngram_propose(..., siblings=)`` / ``ngram_propose_tree(..., siblings=)``: drafting from a request's group.

Checked against a brute force written from the rule (tlt_kernels.reference.ngram_group): occurrences in the
request's own history and in each sibling's, the longest n over all sources, the own history first, then the
siblings in the order given, most recent first; and against the self-only op when no sibling is usable."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import agreement_backends, kernel_devices, need_backend
from test_ngram import brute_trie, random_histories
from tlt_kernels import ngram_propose, validate_tree
from tlt_kernels.ops.ngram import ngram_propose_tree


def brute_sources(histories, b, sibling_row):
    """The request's sources in rank order: its own row, then each usable sibling slot."""
    return [b] + [r for r in sibling_row if r >= 0 and r != b]


def brute_ranked(histories, b, sibling_row, min_n, max_n):
    """``(n, [(row, end), ...])``: the longest n with an occurrence in any source and its occurrences, ranked."""
    h = histories[b]
    for n in range(max_n, min_n - 1, -1):
        if n > len(h):
            continue
        suffix = h[len(h) - n:]
        found = []
        for r in brute_sources(histories, b, sibling_row):
            src = histories[r]
            # an occurrence ends at e <= len(src) - 2 (a token follows it)
            found += [(r, e) for e in range(len(src) - 2, n - 2, -1) if src[e - n + 1: e + 1] == suffix]
        if found:
            return n, found
    return 0, []


def brute_chain(histories, b, sibling_row, k, min_n, max_n):
    _, found = brute_ranked(histories, b, sibling_row, min_n, max_n)
    if not found:
        return []
    r, e = found[0]
    return histories[r][e + 1: e + 1 + k]


def brute_tree(histories, b, sibling_row, k, R, min_n, max_n):
    _, found = brute_ranked(histories, b, sibling_row, min_n, max_n)
    h = histories[b]
    return brute_trie(h[-1] if h else 0, [histories[r][e + 1: e + 1 + k] for r, e in found[:R]])


def _groups(B, S, gen):
    """Random sibling tables: each row lists up to S other rows (itself and -1 mixed in)."""
    return torch.randint(-1, B, (B, S), generator=gen)


def _check(tokens, lengths, siblings, k, R, min_n, max_n):
    histories = [tokens[b, : int(lengths[b])].tolist() for b in range(tokens.shape[0])]
    chain = ngram_propose(tokens, lengths, k, min_n, max_n, siblings=siblings)
    tree = ngram_propose_tree(tokens, lengths, k, R, min_n, max_n, siblings=siblings)
    validate_tree(tree.parents, tree.num_nodes)
    T = 1 + R * k
    for b, sibling_row in enumerate(siblings.tolist()):
        want = brute_chain(histories, b, sibling_row, k, min_n, max_n)
        assert chain.drafts[b].tolist() == want + [-1] * (k - len(want)), f"request {b}: {histories}, {sibling_row}"
        assert int(chain.num_drafts[b]) == len(want)
        parents, toks = brute_tree(histories, b, sibling_row, k, R, min_n, max_n)
        n = len(parents)
        assert int(tree.num_nodes[b]) == n and tree.parents[b].tolist() == parents + [0] * (T - n), f"request {b}"
        assert tree.draft_tokens[b].tolist() == toks + [0] * (T - n), f"request {b}"


@pytest.mark.parametrize("B,L,vocab,S", [(1, 1, 2, 1), (4, 17, 3, 3), (6, 30, 4, 5), (3, 12, 2, 0)])
@pytest.mark.parametrize("k,R,min_n,max_n", [(1, 1, 1, 2), (3, 4, 1, 3), (4, 2, 2, 4)])
def test_matches_brute_force(B, L, vocab, S, k, R, min_n, max_n, gen):
    tokens, lengths = random_histories(B, L, vocab, gen)
    _check(tokens, lengths, _groups(B, S, gen), k, R, min_n, max_n)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(B=st.integers(1, 6), L=st.integers(1, 24), vocab=st.integers(2, 5), S=st.integers(0, 6), k=st.integers(1, 5),
       R=st.integers(1, 4), min_n=st.integers(1, 3), extra=st.integers(0, 2), seed=st.integers(0, 2**16))
def test_matches_brute_force_property(B, L, vocab, S, k, R, min_n, extra, seed):
    g = torch.Generator().manual_seed(seed)
    tokens, lengths = random_histories(B, L, vocab, g)
    _check(tokens.to(torch.int32), lengths, _groups(B, S, g).to(torch.int32), k, R, min_n, min_n + extra)


def test_without_usable_siblings_it_is_the_self_only_op(gen):
    tokens, lengths = random_histories(5, 40, 3, gen)
    B = tokens.shape[0]
    own = torch.arange(B).unsqueeze(1)
    for siblings in (torch.empty(B, 0, dtype=torch.int64), torch.full((B, 3), -1), torch.cat([own, own], 1)):
        for got, want in ((ngram_propose(tokens, lengths, 4, 1, 3, siblings=siblings), ngram_propose(tokens, lengths, 4, 1, 3)),
                          (ngram_propose_tree(tokens, lengths, 3, 3, 1, 3, siblings=siblings),
                           ngram_propose_tree(tokens, lengths, 3, 3, 1, 3))):
            for x, y in zip(got, want):
                assert torch.equal(x, y)


@pytest.mark.parametrize("backend", agreement_backends())
def test_a_finished_sibling_drafts_for_the_straggler(backend):
    """Row 0 finished ``... 5 6 7 8 9``; row 1 has just written ``5 6``: its own history holds no match, its
    sibling's continues it; the own history wins a tie of the same length; among siblings the first listed wins."""
    dev = torch.device(kernel_devices()[0]) if backend != "torch" else torch.device("cpu")
    need_backend("ngram_propose_group", backend, dev)
    tokens = torch.tensor([[1, 5, 6, 7, 8, 9, 0], [2, 3, 5, 6, 0, 0, 0], [5, 6, 4, 2, 5, 6, 0],
                           [5, 6, 1, 1, 0, 0, 0], [0, 3, 5, 6, 0, 0, 0]])
    lengths = torch.tensor([6, 4, 6, 4, 4])
    siblings = torch.tensor([[1, 2], [0, -1], [0, 1], [-1, -1], [3, 0]])
    out = ngram_propose(tokens.to(dev), lengths.to(dev), 3, 1, 2, siblings=siblings.to(dev), backend=backend)
    out = type(out)(*(t.cpu() for t in out))
    assert out.drafts[4].tolist() == [1, 1, -1]  # sibling 3 is listed before sibling 0
    assert out.drafts[1].tolist() == [7, 8, 9] and int(out.num_drafts[1]) == 3
    assert out.drafts[2].tolist() == [4, 2, 5]  # its own "5 6" (at 0-1) outranks sibling 0's
    alone = ngram_propose(tokens, lengths, 3, 1, 2, backend="torch")
    assert alone.num_drafts[1] == 0  # without the group: nothing


def test_a_longer_match_in_a_sibling_beats_a_shorter_own_one():
    tokens = torch.tensor([[4, 1, 2, 3, 7, 0], [9, 3, 8, 1, 2, 3]])
    lengths = torch.tensor([5, 6])
    out = ngram_propose(tokens, lengths, 2, 1, 3, siblings=torch.tensor([[1], [0]]))
    assert out.drafts[1].tolist() == [7, -1]  # "1 2 3" in row 0 (n = 3) over its own "3" (n = 1) -> 8
    tree = ngram_propose_tree(tokens, lengths, 1, 2, 1, 3, siblings=torch.tensor([[1], [0]]))
    assert tree.num_nodes[1] == 2 and tree.draft_tokens[1, 1] == 7


def test_bad_siblings_are_named():
    tokens, lengths = torch.zeros(3, 5, dtype=torch.int64), torch.full((3,), 5)
    with pytest.raises(ValueError, match=r"siblings\[1, 0\] = 3 is outside \[-1, B=3\)"):
        ngram_propose(tokens, lengths, 2, siblings=torch.tensor([[0], [3], [1]]))
    with pytest.raises(ValueError, match="one row per request"):
        ngram_propose(tokens, lengths, 2, siblings=torch.zeros(2, 1, dtype=torch.int64))
    with pytest.raises(TypeError, match="siblings"):
        ngram_propose(tokens, lengths, 2, siblings=torch.zeros(3, 1))
    with pytest.raises(ValueError, match="siblings= runs on the backends"):
        ngram_propose_tree(tokens, lengths, 2, 2, siblings=torch.zeros(3, 1, dtype=torch.int64), backend="cuda")


@pytest.mark.parametrize("backend", agreement_backends())
@pytest.mark.parametrize("B,L,vocab,S,k,min_n,max_n", [(1, 1, 2, 1, 1, 1, 2), (5, 37, 3, 4, 4, 1, 3),
                                                       (6, 70, 2, 5, 3, 2, 4), (4, 20, 4, 0, 2, 1, 1),
                                                       (3, 300, 3, 2, 6, 1, 4), (8, 24, 8, 7, 3, 1, 3),
                                                       (8, 40, 6, 7, 4, 2, 4), (6, 16, 12, 5, 2, 1, 2)])
def test_chain_backends_match_the_reference(backend, B, L, vocab, S, k, min_n, max_n, gen):
    """Every backend of the chain (Triton: one launch per call) against the torch reference, with poisoned outputs
    checked as fully written, strided histories included."""
    dev = torch.device(kernel_devices()[0]) if backend != "torch" else torch.device("cpu")
    need_backend("ngram_propose_group", backend, dev)
    tokens, lengths = random_histories(B, L, vocab, gen)
    siblings = _groups(B, S, gen)
    want = ngram_propose(tokens, lengths, k, min_n, max_n, siblings=siblings, backend="torch")
    wide = torch.zeros(B, L + 7, dtype=tokens.dtype)
    wide[:, 3:3 + L] = tokens  # a strided view: rows of L + 7
    got = ngram_propose(wide[:, 3:3 + L].to(dev), lengths.to(dev), k, min_n, max_n, siblings=siblings.to(dev),
                        backend=backend)
    assert torch.equal(got.drafts.cpu(), want.drafts) and torch.equal(got.num_drafts.cpu(), want.num_drafts)


@pytest.mark.parametrize("backend", agreement_backends())
@pytest.mark.parametrize("B,L,vocab,S,k,R,min_n,max_n", [(1, 1, 2, 1, 1, 1, 1, 2), (5, 37, 3, 4, 3, 4, 1, 3),
                                                         (8, 24, 8, 7, 3, 3, 1, 3), (8, 40, 6, 7, 4, 2, 2, 4),
                                                         (6, 16, 12, 5, 2, 5, 1, 2), (4, 20, 4, 0, 2, 3, 1, 1),
                                                         (3, 200, 3, 2, 5, 3, 1, 4)])
def test_tree_backends_match_the_reference(backend, B, L, vocab, S, k, R, min_n, max_n, gen):
    """Every backend of the group tree (Triton: one launch per call) against the torch reference, strided
    histories included; the trees are valid."""
    dev = torch.device(kernel_devices()[0]) if backend != "torch" else torch.device("cpu")
    need_backend("ngram_propose_tree_group", backend, dev)
    tokens, lengths = random_histories(B, L, vocab, gen)
    siblings = _groups(B, S, gen)
    want = ngram_propose_tree(tokens, lengths, k, R, min_n, max_n, siblings=siblings, backend="torch")
    wide = torch.zeros(B, L + 5, dtype=tokens.dtype)
    wide[:, 2:2 + L] = tokens
    got = ngram_propose_tree(wide[:, 2:2 + L].to(dev), lengths.to(dev), k, R, min_n, max_n,
                             siblings=siblings.to(dev), backend=backend)
    for name, x, y in zip(("parents", "draft_tokens", "num_nodes"), want, got):
        assert torch.equal(x, y.cpu()), name
    validate_tree(got.parents.cpu(), got.num_nodes.cpu())


def test_group_drafting_compiles_and_has_no_host_sync():
    tokens, lengths = random_histories(4, 20, 3, torch.Generator().manual_seed(2))
    siblings = torch.tensor([[1, 2, 3], [0, 2, 3], [0, 1, 3], [0, 1, 2]])
    eager = ngram_propose(tokens, lengths, 3, 1, 3, siblings=siblings, validate=False)
    torch._dynamo.reset()
    compiled = torch.compile(lambda t, n: ngram_propose(t, n, 3, 1, 3, siblings=siblings, validate=False),
                             backend="eager", fullgraph=True)  # fullgraph: a host read would break the graph
    got = compiled(tokens, lengths)
    assert torch.equal(got.drafts, eager.drafts) and torch.equal(got.num_drafts, eager.num_drafts)


_COMPILE_GROUP_SM90 = r"""
import triton
from tlt_kernels._triton import ngram_group as m

for tok in ("*i64", "*i32"):
    for max_n, block, k in ((4, 2048, 8), (1, 16, 1), (3, 256, 5)):
        consts = dict(MIN_N=1, MAX_N=max_n, BLOCK_SIZE=block, N_POW2=triton.next_power_of_2(max_n + 1),
                      BLOCK_K=triton.next_power_of_2(k))
        compile_sm90(m._ngram_group_kernel, [tok, "*i32", "*i64", "*i64", "*i32", "i64", "i64", "i64", "i32", "i32"],
                     consts, 4)
    for R, k, max_n, block in ((4, 8, 4, 2048), (1, 1, 1, 16), (3, 5, 3, 256)):
        T = 1 + R * k
        consts = dict(R=R, MIN_N=1, MAX_N=max_n, BLOCK_SIZE=block, N_POW2=triton.next_power_of_2(max_n + 1),
                      R_POW2=triton.next_power_of_2(R), K_POW2=triton.next_power_of_2(k),
                      F_POW2=triton.next_power_of_2(R * k), T_POW2=triton.next_power_of_2(T))
        types = [tok, "*i32", "*i64", "*i32", "*i64", "*i32", "i64", "i64", "i64", "i64", "i32", "i32", "i32"]
        compile_sm90(m._ngram_group_tree_kernel, types, consts, 4)
"""


@pytest.mark.slow
def test_group_kernel_compiles_for_sm90():
    """The interpreter accepts code the compiler rejects: compile the group kernels (chain, tree) for sm_90."""
    from conftest import compile_for_sm90

    compile_for_sm90(_COMPILE_GROUP_SM90)
