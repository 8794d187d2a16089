"""ngram_propose / ngram_propose_tree: hand-worked histories, brute-force oracles, bad inputs, Triton parity."""
import pytest
import torch
from conftest import agreement_backends, compile_for_sm90, kernel_devices, need_backend, poison_

from tlt_kernels import ngram_propose, validate_tree
from tlt_kernels.ops.ngram import ngram_propose_tree


def brute_occurrences(h, n):
    """Starts s (largest first) of earlier occurrences of h's n-suffix with s + n <= len - 1."""
    L = len(h)
    if n > L:
        return []
    suffix = h[L - n :]
    return [s for s in range(L - n - 1, -1, -1) if h[s : s + n] == suffix]


def brute_best(h, min_n, max_n):
    for n in range(max_n, min_n - 1, -1):
        occ = brute_occurrences(h, n)
        if occ:
            return n, occ
    return 0, []


def brute_propose(h, k, min_n, max_n):
    n, occ = brute_best(h, min_n, max_n)
    return h[occ[0] + n : occ[0] + n + k] if occ else []


def brute_trie(root_token, continuations):
    """The trie of token lists under a root, nodes numbered in insertion order: (parents, tokens)."""
    parents, toks, children = [-1], [root_token], {}
    for continuation in continuations:
        cur = 0
        for t in continuation:
            if (cur, t) not in children:
                children[(cur, t)] = len(parents)
                parents.append(cur)
                toks.append(t)
            cur = children[(cur, t)]
    return parents, toks


def brute_tree(h, k, R, min_n, max_n):
    """Trie of the continuations of the R most recent occurrences: (parents, tokens)."""
    n, occ = brute_best(h, min_n, max_n)
    return brute_trie(h[-1] if h else 0, [h[s + n : s + n + k] for s in occ[:R]])


def random_histories(B, L, vocab, gen, min_len=0):
    tokens = torch.randint(0, vocab, (B, L), generator=gen)
    lengths = torch.randint(min_len, L + 1, (B,), generator=gen).to(torch.int32)
    # Garbage past lengths must not matter.
    pos = torch.arange(L)
    tokens = torch.where(pos < lengths.unsqueeze(1).long(), tokens, torch.randint(0, vocab, (B, L), generator=gen))
    return tokens, lengths


def check_propose(out, tokens, lengths, k, min_n, max_n):
    for b in range(tokens.shape[0]):
        h = tokens[b, : int(lengths[b])].tolist()
        want = brute_propose(h, k, min_n, max_n)
        assert int(out.num_drafts[b]) == len(want), f"request {b}: history {h}"
        assert out.drafts[b].tolist() == want + [-1] * (k - len(want)), f"request {b}: history {h}"


# Agreement cases, ((B, L, vocab), (k, R, min_n, max_n)): R None is ngram_propose (one chain), else
# ngram_propose_tree over the R most recent occurrences.
PROPOSE_CASES = [(shape, (k, None, lo, hi)) for shape in [(1, 1, 2), (3, 37, 3), (7, 130, 4), (2, 300, 2)]
                 for k, lo, hi in [(1, 1, 1), (8, 1, 4), (5, 2, 5)]]
TREE_CASES = [(shape, config) for shape in [(1, 1, 2), (3, 45, 3), (4, 140, 2)]
              for config in [(1, 1, 1, 2), (3, 4, 1, 3), (4, 3, 2, 4)]]
AGREEMENT_CASES = [pytest.param(*case, id=f"{op}-{'-'.join(map(str, case[0] + case[1]))}")
                   for op, cases in (("propose", PROPOSE_CASES), ("tree", TREE_CASES)) for case in cases]


def propose(tokens, lengths, k, R, min_n, max_n, backend):
    """ngram_propose (``R`` None) or ngram_propose_tree of one agreement case."""
    if R is None:
        return ngram_propose(tokens, lengths, k, min_n, max_n, backend=backend)
    return ngram_propose_tree(tokens, lengths, k, R, min_n, max_n, backend=backend)


@pytest.mark.parametrize("backend", agreement_backends())
@pytest.mark.parametrize("shape,config", AGREEMENT_CASES)
def test_matches_reference(backend, shape, config, gen):
    """Every backend gives the torch reference's outputs: ngram_propose's drafts for int64 and int32 histories,
    ngram_propose_tree's trie (parents, tokens, sizes) for int64 ones."""
    device = kernel_devices()[0]
    R = config[1]
    need_backend("ngram_propose" if R is None else "ngram_propose_tree", backend, torch.device(device))
    tokens, lengths = random_histories(*shape, gen)
    ref = propose(tokens, lengths, *config, backend="torch")
    for dtype in (torch.int64, torch.int32) if R is None else (torch.int64,):
        out = propose(tokens.to(device, dtype), lengths.to(device), *config, backend=backend)
        for name in ref._fields:
            assert torch.equal(getattr(out, name).cpu(), getattr(ref, name)), name


def test_hand_worked():
    #            0  1  2  3  4  5  6  7  8
    h = torch.tensor([[5, 6, 7, 8, 5, 6, 9, 5, 6]])
    out = ngram_propose(h, torch.tensor([9], dtype=torch.int32), k=3, min_n=1, max_n=3)
    # Suffix "5 6": occurrences at s=4 (-> 9 5 6) and s=0; the most recent wins. "9 5 6" never recurs.
    assert out.drafts.tolist() == [[9, 5, 6]] and out.num_drafts.tolist() == [3]
    out = ngram_propose(h, torch.tensor([9], dtype=torch.int32), k=8, min_n=1, max_n=3)
    assert out.drafts.tolist() == [[9, 5, 6] + [-1] * 5] and out.num_drafts.tolist() == [3]


def test_overlapping_occurrence_and_no_match():
    # "1 1 1 1": suffix "1 1 1" occurs at s=0 (s + n = 3 <= len - 1) and overlaps the suffix itself.
    out = ngram_propose(torch.tensor([[1, 1, 1, 1], [1, 2, 3, 4]]), torch.tensor([4, 4], dtype=torch.int32), k=2, max_n=3)
    assert out.drafts.tolist() == [[1, -1], [-1, -1]]
    assert out.num_drafts.tolist() == [1, 0]


def test_short_histories_and_min_n():
    tokens = torch.tensor([[3, 3, 0, 0], [3, 0, 0, 0], [4, 9, 4, 9]])
    out = ngram_propose(tokens, torch.tensor([2, 1, 0], dtype=torch.int32), k=2)
    assert out.num_drafts.tolist() == [1, 0, 0] and out.drafts[0].tolist() == [3, -1]
    # min_n=2 rules out the unigram match "9" but "4 9" does not recur before the end either.
    out = ngram_propose(torch.tensor([[4, 9, 1, 9]]), torch.tensor([4], dtype=torch.int32), k=2, min_n=2)
    assert out.num_drafts.tolist() == [0]


@pytest.mark.parametrize("B,L,vocab", [(1, 1, 2), (3, 17, 3), (7, 40, 5), (3, 65, 2), (2, 33, 50)])
@pytest.mark.parametrize("k,min_n,max_n", [(1, 1, 1), (3, 1, 4), (8, 2, 5), (5, 3, 3)])
def test_matches_brute_force(B, L, vocab, k, min_n, max_n, gen):
    tokens, lengths = random_histories(B, L, vocab, gen)
    for dtype in (torch.int64, torch.int32):
        out = ngram_propose(tokens.to(dtype), lengths, k, min_n, max_n)
        assert out.drafts.dtype == torch.int64 and out.num_drafts.dtype == torch.int32
        check_propose(out, tokens, lengths, k, min_n, max_n)


def check_tree(out, tokens, lengths, k, R, min_n, max_n):
    T = 1 + R * k
    assert out.parents.shape == (tokens.shape[0], T)
    for b in range(tokens.shape[0]):
        h = tokens[b, : int(lengths[b])].tolist()
        par, tok = brute_tree(h, k, R, min_n, max_n)
        n = len(par)
        assert int(out.num_nodes[b]) == n, f"request {b}: history {h}"
        assert out.parents[b].tolist() == par + [0] * (T - n), f"request {b}: history {h}"
        assert out.draft_tokens[b].tolist() == tok + [0] * (T - n), f"request {b}: history {h}"


def test_tree_hand_worked():
    #                  0  1  2  3  4  5  6  7  8  9
    h = torch.tensor([[1, 2, 3, 1, 2, 4, 1, 2, 3, 1]])
    out = ngram_propose_tree(h, torch.tensor([10], dtype=torch.int32), k=2, num_branches=3, max_n=1)
    # Suffix "1" occurs at 6 (-> 2 3), 3 (-> 2 4), 0 (-> 2 3): trie 1 -> 2 -> {3, 4}.
    assert out.num_nodes.tolist() == [4]
    assert out.parents.tolist() == [[-1, 0, 1, 1, 0, 0, 0]]
    assert out.draft_tokens.tolist() == [[1, 2, 3, 4, 0, 0, 0]]


@pytest.mark.parametrize("B,L,vocab", [(1, 1, 2), (3, 23, 3), (7, 40, 4), (2, 50, 2)])
@pytest.mark.parametrize("k,R,min_n,max_n", [(1, 1, 1, 2), (3, 4, 1, 3), (4, 3, 2, 4)])
def test_tree_matches_brute_force(B, L, vocab, k, R, min_n, max_n, gen):
    tokens, lengths = random_histories(B, L, vocab, gen)
    out = ngram_propose_tree(tokens, lengths, k, R, min_n, max_n)
    check_tree(out, tokens, lengths, k, R, min_n, max_n)
    validate_tree(out.parents, out.num_nodes)


def test_bad_inputs():
    t = torch.tensor([[1, 2, 3]])
    n = torch.tensor([3], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"lengths\[0\] = 4 is outside \[0, L=3\]"):
        ngram_propose(t, torch.tensor([4], dtype=torch.int32), 2)
    with pytest.raises(ValueError, match="min_n must be <= max_n"):
        ngram_propose(t, n, 2, min_n=3, max_n=2)
    with pytest.raises(ValueError, match="k must be >= 1"):
        ngram_propose(t, n, 0)
    with pytest.raises(TypeError, match="tokens must have dtype"):
        ngram_propose(t.float(), n, 2)
    with pytest.raises(ValueError, match="lengths has size 2"):
        ngram_propose(t, torch.tensor([3, 3], dtype=torch.int32), 2)
    with pytest.raises(ValueError, match="num_branches must be >= 1"):
        ngram_propose_tree(t, n, 2, 0)


# ----------------------------------------------------------------------------- Triton kernels


@pytest.mark.triton
@pytest.mark.parametrize("device", kernel_devices())
def test_triton_writes_every_output(device, gen):
    from tlt_kernels._triton.ngram import ngram_propose_out

    tokens, lengths = random_histories(5, 50, 3, gen)
    drafts = poison_(torch.empty(5, 4, dtype=torch.int64, device=device))
    num = poison_(torch.empty(5, dtype=torch.int32, device=device))
    ngram_propose_out(tokens.to(device), lengths.to(device), 1, 3, drafts, num)
    ref = ngram_propose(tokens, lengths, 4, 1, 3, backend="torch")
    assert torch.equal(drafts.cpu(), ref.drafts) and torch.equal(num.cpu(), ref.num_drafts)


@pytest.mark.cuda
@pytest.mark.parametrize("B,L,vocab", [(256, 8192, 50), (17, 3000, 3)])
def test_triton_large_gpu(B, L, vocab, gen):
    tokens, lengths = random_histories(B, L, vocab, gen, min_len=L // 2)
    tokens, lengths = tokens.cuda(), lengths.cuda()
    ref = ngram_propose(tokens, lengths, 8, 1, 4, backend="torch")
    out = ngram_propose(tokens, lengths, 8, 1, 4, backend="triton")
    assert torch.equal(out.drafts, ref.drafts) and torch.equal(out.num_drafts, ref.num_drafts)
    ref_t = ngram_propose_tree(tokens, lengths, 4, 4, 1, 4, backend="torch")
    out_t = ngram_propose_tree(tokens, lengths, 4, 4, 1, 4, backend="triton")
    for name in ref_t._fields:
        assert torch.equal(getattr(out_t, name), getattr(ref_t, name)), name


@pytest.mark.triton
def test_triton_custom_ops_opcheck(gen):
    import tlt_kernels._triton.ngram  # noqa: F401  (registers tlt::ngram_propose*)

    dev = kernel_devices()[0]  # the GPU, or the CPU under the interpreter
    tokens, lengths = (x.to(dev) for x in random_histories(2, 20, 3, gen, min_len=5))
    torch.library.opcheck(torch.ops.tlt.ngram_propose.default, (tokens, lengths, 3, 1, 3))
    torch.library.opcheck(torch.ops.tlt.ngram_propose_tree.default, (tokens, lengths, 2, 2, 1, 3))


@pytest.mark.cuda
def test_triton_cuda_graph(gen):
    tokens, lengths = random_histories(8, 500, 4, gen)
    tokens, lengths = tokens.cuda(), lengths.cuda()
    ref = ngram_propose(tokens, lengths, 6, 1, 4, backend="torch")
    ngram_propose(tokens, lengths, 6, 1, 4, backend="triton")  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ngram_propose(tokens, lengths, 6, 1, 4, backend="triton")
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.drafts, ref.drafts) and torch.equal(out.num_drafts, ref.num_drafts)


# ----------------------------------------------------------------------------- chunked Triton kernel
# ngram_propose splits every history into chunks of `chunk` ends (one program each) and combines the
# per-chunk (m, e) maxima; small chunks put many chunk boundaries into CPU-sized histories.


def history_kinds(B, L, gen):
    """(name, tokens int64 [B, L], lengths int32 [B]) covering the cases the chunk split can get wrong."""
    rand, rand_len = random_histories(B, L, 50, gen)
    rep, rep_len = random_histories(B, L, 2, gen, min_len=L // 2)
    period = torch.arange(L).remainder(3).expand(B, L).clone()  # "0 1 2 0 1 2": overlapping occurrences
    period_len = torch.randint(L // 2, L + 1, (B,), generator=gen).to(torch.int32)
    short_len = torch.tensor([0, 1, 2, 3, 4, 5][:B] + [2] * max(0, B - 6), dtype=torch.int32)  # < min_n + 1 and just above
    short = torch.randint(0, 2, (B, L), generator=gen)
    return [("random", rand, rand_len), ("repetitive", rep, rep_len), ("periodic", period, period_len), ("short", short, short_len)]


@pytest.mark.triton
@pytest.mark.parametrize("device", kernel_devices())
@pytest.mark.parametrize("chunk,num_warps", [(16, 1), (32, 2), (64, 1)])
@pytest.mark.parametrize("k,min_n,max_n", [(1, 1, 1), (8, 1, 4), (3, 2, 5), (4, 3, 3)])
def test_triton_chunked_matches_reference(device, chunk, num_warps, k, min_n, max_n, gen):
    from tlt_kernels._triton.ngram import ngram_propose_out

    for name, tokens, lengths in history_kinds(6, 99, gen):
        ref = ngram_propose(tokens, lengths, k, min_n, max_n, backend="torch")
        for dtype in (torch.int64, torch.int32):
            drafts = poison_(torch.empty(6, k, dtype=torch.int64, device=device))
            num = poison_(torch.empty(6, dtype=torch.int32, device=device))
            ngram_propose_out(tokens.to(device, dtype), lengths.to(device), min_n, max_n, drafts, num, chunk=chunk, num_warps=num_warps)
            assert torch.equal(drafts.cpu(), ref.drafts), (name, dtype)
            assert torch.equal(num.cpu(), ref.num_drafts), (name, dtype)


@pytest.mark.triton
@pytest.mark.parametrize("device", kernel_devices())
def test_triton_chunk_boundaries(device):
    """Longest n beats a more recent shorter n across chunks; an occurrence straddling a boundary is found."""
    from tlt_kernels._triton.ngram import ngram_propose_out

    L = 64
    # Row 0: "7 8 9" ends at 10 (chunk 0), "8 9" recurs at 40-41 (chunk 2); suffix "7 8 9" -> ends at 10 win.
    # Row 1: the only earlier "5 6 7" occupies 15-17, across the chunk 0 / chunk 1 boundary.
    # Row 2: the suffix "4 4" occurs (overlapping) at 61-62 inside the suffix's own chunk, and at 20-21.
    tokens = torch.zeros(3, L, dtype=torch.int64)
    tokens[0, 8:11] = torch.tensor([7, 8, 9])
    tokens[0, 11] = 3
    tokens[0, 40:42] = torch.tensor([8, 9])
    tokens[0, 42] = 2
    tokens[0, 61:64] = torch.tensor([7, 8, 9])
    tokens[1, 15:19] = torch.tensor([5, 6, 7, 1])
    tokens[1, 61:64] = torch.tensor([5, 6, 7])
    tokens[2] = torch.arange(L) + 10
    tokens[2, 20:23] = torch.tensor([4, 4, 6])
    tokens[2, 61:64] = 4
    lengths = torch.full((3,), L, dtype=torch.int32)
    ref = ngram_propose(tokens, lengths, 2, 1, 3, backend="torch")
    assert ref.drafts.tolist() == [[3, 0], [1, 0], [4, -1]] and ref.num_drafts.tolist() == [2, 2, 1]
    for chunk in (16, 32, 64):
        drafts = poison_(torch.empty(3, 2, dtype=torch.int64, device=device))
        num = poison_(torch.empty(3, dtype=torch.int32, device=device))
        ngram_propose_out(tokens.to(device), lengths.to(device), 1, 3, drafts, num, chunk=chunk)
        assert torch.equal(drafts.cpu(), ref.drafts) and torch.equal(num.cpu(), ref.num_drafts), chunk


@pytest.mark.triton
@pytest.mark.parametrize("device", kernel_devices())
def test_triton_strided_rows_and_baseline(device, gen):
    """Row views of a wider buffer (the drafter's [B, max_len + 1] layout), and the rowscan baseline."""
    from tlt_kernels._triton.ngram import ngram_propose_out, ngram_propose_rowscan_out

    buf, lengths = random_histories(5, 77, 3, gen)
    tokens = buf.to(device)[:, :70]
    lengths = lengths.clamp(max=70)
    assert tokens.stride(0) == 77
    ref = ngram_propose(tokens.cpu().contiguous(), lengths, 4, 1, 4, backend="torch")
    for run in (lambda d, n: ngram_propose_out(tokens, lengths.to(device), 1, 4, d, n, chunk=16),
                lambda d, n: ngram_propose_rowscan_out(tokens, lengths.to(device), 1, 4, d, n)):
        drafts = poison_(torch.empty(5, 4, dtype=torch.int64, device=device))
        num = poison_(torch.empty(5, dtype=torch.int32, device=device))
        run(drafts, num)
        assert torch.equal(drafts.cpu(), ref.drafts) and torch.equal(num.cpu(), ref.num_drafts)


def test_chunk_config():
    from tlt_kernels._triton import ngram as m

    assert m.chunk_config(256, 8192) == (m.CHUNK, m.NUM_WARPS)
    chunk, warps = m.chunk_config(1, 8192)  # a lone request is split finer to reach more SMs
    assert chunk == m.MIN_CHUNK and warps >= 1
    assert m.chunk_config(4, 20)[0] == 32  # never wider than the history (rounded up to a power of two)
    assert m.chunk_config(256, 8192, chunk=2048, num_warps=8) == (2048, 8)
    with pytest.raises(ValueError, match="chunk must be a power of two >= 16, got 100"):
        m.chunk_config(2, 100, chunk=100)
    with pytest.raises(ValueError, match="num_warps must be a power of two >= 1, got 3"):
        m.chunk_config(2, 100, num_warps=3)


_COMPILE_NGRAM_SM90 = r"""
from tlt_kernels._triton import ngram as m

for tok in ("*i64", "*i32"):
    for chunk, warps, max_n in ((m.CHUNK, m.NUM_WARPS, 4), (2048, 8, 5), (128, 1, 1)):
        compile_sm90(m._ngram_chunk_kernel, [tok, "*i32", "*i64", "i64", "i32"],
                     dict(MIN_N=1, MAX_N=max_n, N_POW2=triton.next_power_of_2(max_n), CHUNK=chunk, KEY_SHIFT=m.KEY_SHIFT), warps)
    compile_sm90(m._ngram_combine_kernel, [tok, "*i64", "*i64", "*i64", "*i32", "i64", "i64", "i32", "i32"],
                 dict(KEY_SHIFT=m.KEY_SHIFT, BLOCK_C=8, BLOCK_K=8), m.FINAL_WARPS)
"""


@pytest.mark.slow
def test_chunked_kernels_compile_for_sm90():
    """The interpreter accepts code the compiler rejects: compile the chunk and combine kernels for sm_90."""
    compile_for_sm90(_COMPILE_NGRAM_SM90)


@pytest.mark.cuda
@pytest.mark.parametrize("B,L", [(256, 8192), (1, 32768), (3, 5000), (64, 2048)])
@pytest.mark.parametrize("chunk,num_warps", [(None, None), (512, 4), (2048, 8)])
def test_triton_chunked_large_gpu(B, L, chunk, num_warps, gen):
    from tlt_kernels._triton.ngram import ngram_propose_out

    for vocab in (32000, 50, 2):
        tokens, lengths = random_histories(B, L, vocab, gen, min_len=L // 2)
        tokens, lengths = tokens.cuda(), lengths.cuda()
        ref = ngram_propose(tokens, lengths, 8, 1, 4, backend="torch")
        drafts = poison_(torch.empty(B, 8, dtype=torch.int64, device="cuda"))
        num = poison_(torch.empty(B, dtype=torch.int32, device="cuda"))
        ngram_propose_out(tokens, lengths, 1, 4, drafts, num, chunk=chunk, num_warps=num_warps)
        assert torch.equal(drafts, ref.drafts) and torch.equal(num, ref.num_drafts), vocab
