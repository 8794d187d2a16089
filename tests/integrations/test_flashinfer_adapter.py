"""``tlt_kernels.integrations.flashinfer.chain_speculative_sampling``: FlashInfer's call shape, our lossless walk.

Written from FlashInfer's documented semantics (its docstring's example, the meaning of its outputs and counters):
exact outputs where the inputs force them, the output law where they do not, the counters' in-place accumulation,
argument errors, and capture in a CUDA graph."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import agreement_backends, kernel_devices, need_backend
from tlt_kernels.integrations.flashinfer import chain_speculative_sampling
from tlt_kernels.rng import PURPOSE_ACCEPT, uniform

DEV = kernel_devices()[0]


def _device(backend):
    dev = torch.device(DEV) if backend != "torch" else torch.device("cpu")
    need_backend("verify_tree", backend, dev)
    return dev


@pytest.mark.parametrize("backend", agreement_backends())
def test_the_documented_example_is_forced(backend):
    """Draft 2 has p/q = 0.6/0.3 (always accepted); draft 1 has target probability 0 (always rejected), and the
    residual max(p - q, 0) of row 1 is all on token 0: every seed emits [2, 0, -1], one draft emitted, one draft
    passing its own test."""
    dev = _device(backend)
    draft = torch.tensor([[[0.1, 0.2, 0.3, 0.4], [0.2, 0.3, 0.4, 0.1]]], device=dev).expand(8, 2, 4)
    ids = torch.tensor([[2, 1]], dtype=torch.int32, device=dev).expand(8, 2)
    target = torch.tensor([[[0.0, 0.1, 0.6, 0.3], [1.0, 0.0, 0.0, 0.0], [0.7, 0.1, 0.1, 0.1]]],
                          device=dev).expand(8, 3, 4)
    tokens, accepted, emitted = chain_speculative_sampling(draft, ids, target, seed=torch.arange(8, device=dev),
                                                           backend=backend)
    assert tokens.dtype == torch.int32 and tokens.shape == (8, 3)
    assert tokens.tolist() == [[2, 0, -1]] * 8
    assert accepted.tolist() == [1] * 8 and emitted.tolist() == [1] * 8


@pytest.mark.parametrize("backend", agreement_backends())
def test_all_accepted_samples_the_bonus_row(backend):
    """Drafts equal to a one-hot target are always accepted; the bonus token comes from the last row."""
    dev = _device(backend)
    V = 5
    target = torch.zeros(3, 3, V, device=dev)
    target[:, 0, 4], target[:, 1, 1], target[:, 2, 3] = 1.0, 1.0, 1.0
    draft = torch.full((3, 2, V), 1.0 / V, device=dev)
    ids = torch.tensor([[4, 1]] * 3, device=dev)
    tokens, accepted, emitted = chain_speculative_sampling(draft, ids, target, seed=7, offset=3, backend=backend)
    assert tokens.tolist() == [[4, 1, 3]] * 3
    assert accepted.tolist() == [2] * 3 and emitted.tolist() == [2] * 3


@pytest.mark.parametrize("backend", [pytest.param("torch", id="torch"),
                                     pytest.param("cuda", marks=pytest.mark.cuda, id="cuda")])
def test_emitted_tokens_have_the_targets_law(backend):
    """Lossless: over 200,000 requests with drafts drawn from their draft rows, the first emitted token is
    distributed as target row 0, and the second, where the first draft was accepted, as target row 1 (a bias of
    1% of the mass is 5 standard errors and more)."""
    dev = _device(backend)
    B, n, V = 200_000, 2, 6
    g = torch.Generator().manual_seed(1)
    draft_rows = torch.softmax(torch.randn(n, V, generator=g), -1)
    target_rows = torch.softmax(torch.randn(n + 1, V, generator=g), -1)
    ids = torch.multinomial(draft_rows, B, replacement=True, generator=g).T.contiguous()
    tokens, _, emitted = chain_speculative_sampling(draft_rows.expand(B, n, V).to(dev), ids.to(dev),
                                                    target_rows.expand(B, n + 1, V).to(dev),
                                                    seed=torch.arange(B, device=dev), backend=backend)
    tokens, emitted = tokens.cpu().long(), emitted.cpu()
    first = torch.bincount(tokens[:, 0], minlength=V).double() / B
    assert (first - target_rows[0].double()).abs().max() < 5e-3
    took_first = emitted >= 1
    second = torch.bincount(tokens[took_first, 1], minlength=V).double() / int(took_first.sum())
    assert int(took_first.sum()) > 50_000 and (second - target_rows[1].double()).abs().max() < 8e-3


def test_counters_accumulate_in_place_and_flagged_requests_emit_nothing():
    V = 4
    draft = torch.full((3, 2, V), 0.25)
    ids = torch.tensor([[0, 1], [2, 3], [1, 1]])
    target = torch.softmax(torch.randn(3, 3, V, generator=torch.Generator().manual_seed(0)), -1)
    target[1, 0] = 0.0  # no positive entry: request 1 is flagged
    accepted = torch.tensor([10, 20, 30], dtype=torch.int32)
    emitted = torch.tensor([1, 2, 3], dtype=torch.int32)
    tokens, acc_out, emit_out = chain_speculative_sampling(draft, ids, target, accepted, emitted, seed=5,
                                                           backend="torch", validate=False)
    assert acc_out is accepted and emit_out is emitted  # the given counters, added to
    assert tokens[1].tolist() == [-1, -1, -1] and accepted[1] == 20 and emitted[1] == 2
    for b in (0, 2):
        assert 10 * (b + 1) <= int(accepted[b]) <= 10 * (b + 1) + 2
        assert int(emitted[b]) - (b + 1) == int((tokens[b] >= 0).sum()) - 1


@settings(max_examples=25, deadline=None)
@given(B=st.integers(1, 6), n=st.integers(1, 5), V=st.integers(2, 40), seed=st.integers(0, 2**40))
def test_outputs_are_consistent_with_the_coins(B, n, V, seed):
    """Invariants on random inputs: tokens in [0, V) then -1; emitted = the tokens before the final one; a draft
    counts as passing its own test exactly when its coin says so past the walk's decisions, so passing >= emitted."""
    g = torch.Generator().manual_seed(seed % 2**31)
    draft = torch.softmax(2 * torch.randn(B, n, V, generator=g), -1)
    target = torch.softmax(2 * torch.randn(B, n + 1, V, generator=g), -1)
    ids = torch.randint(0, V, (B, n), generator=g)
    tokens, accepted, emitted = chain_speculative_sampling(draft, ids, target, seed=seed, backend="torch")
    for b in range(B):
        k = int(emitted[b])
        row = tokens[b].tolist()
        assert all(0 <= t < V for t in row[: k + 1]) and all(t == -1 for t in row[k + 1:])
        assert row[:k] == ids[b, :k].tolist()
        coins = uniform(torch.tensor(seed), torch.tensor(0), torch.arange(1, n + 1), PURPOSE_ACCEPT)
        p = target[b, torch.arange(n), ids[b]] / target[b, :n].sum(1)
        q = draft[b, torch.arange(n), ids[b]] / draft[b].sum(1)
        later = int((coins[k + 1:] * q[k + 1:] < p[k + 1:]).sum())
        assert int(accepted[b]) == k + later >= k


def test_bad_arguments_are_named():
    draft, ids, target = torch.rand(2, 3, 5), torch.zeros(2, 3, dtype=torch.int64), torch.rand(2, 4, 5)
    with pytest.raises(ValueError, match="target_probs"):
        chain_speculative_sampling(draft, ids, target[:, :3])
    with pytest.raises(ValueError, match="draft_token_ids"):
        chain_speculative_sampling(draft, ids[:, :2], target)
    with pytest.raises(ValueError, match="draft_token_ids"):
        chain_speculative_sampling(draft, ids.float(), target)
    with pytest.raises(ValueError, match="draft_probs"):
        chain_speculative_sampling(draft[0], ids, target)
    with pytest.raises(ValueError, match="seed"):
        chain_speculative_sampling(draft, ids, target, seed=torch.zeros(3, dtype=torch.int64))
    with pytest.raises(TypeError, match="target_probs"):
        chain_speculative_sampling(draft, ids, target.tolist())


@pytest.mark.cuda
def test_captured_in_a_cuda_graph_and_replayed_with_new_seeds():
    """No host sync: the call is captured once and replays with seeds and probabilities written in place."""
    B, n, V = 16, 3, 300
    g = torch.Generator(device="cuda").manual_seed(0)
    draft = torch.softmax(torch.randn(B, n, V, device="cuda", generator=g), -1)
    target = torch.softmax(torch.randn(B, n + 1, V, device="cuda", generator=g), -1)
    ids = torch.multinomial(draft.view(-1, V), 1, generator=g).view(B, n)
    seed, offset = torch.arange(B, device="cuda"), torch.zeros(B, dtype=torch.int64, device="cuda")
    chain_speculative_sampling(draft, ids, target, seed=seed, offset=offset)  # warm-up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain_speculative_sampling(draft, ids, target, seed=seed, offset=offset)
    seed.add_(1000)
    offset.add_(1)
    target.copy_(torch.softmax(torch.randn(B, n + 1, V, device="cuda", generator=g), -1))
    graph.replay()
    want = chain_speculative_sampling(draft, ids, target, seed=seed, offset=offset)
    for got, expected in zip(out, want):
        assert torch.equal(got, expected)
