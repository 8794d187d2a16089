"""``tlt_kernels.integrations.vllm.rejection_sample``: vLLM v1's rejection-sampler call shape, our lossless walk.

Written from vLLM's documented semantics and the cases its public tests exercise (re-expressed, not copied): a
perfect match ends with the bonus token, a mismatch ends with the target's token and placeholders after it, batches
of different draft counts (zero included), greedy and sampled requests mixed, the output law of sampled requests,
argument errors and capture in a CUDA graph."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import agreement_backends, kernel_devices, need_backend
from tlt_kernels.integrations.vllm import rejection_sample

DEV = kernel_devices()[0]
V = 12


def _device(backend):
    dev = torch.device(DEV) if backend != "torch" else torch.device("cpu")
    need_backend("verify_tree", backend, dev)
    return dev


def _peaked(argmaxes):
    """Logits ``[len, V]`` whose row ``i`` has its maximum at ``argmaxes[i]``."""
    logits = torch.full((len(argmaxes), V), -4.0)
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes, dtype=torch.long)] = 4.0
    return logits


def _greedy(drafts_per_request, argmaxes_per_request, bonus, max_spec_len, backend):
    dev = _device(backend)
    drafts = torch.tensor([t for req in drafts_per_request for t in req], dtype=torch.int64)
    counts = torch.tensor([len(req) for req in drafts_per_request])
    logits = _peaked([t for req in argmaxes_per_request for t in req])
    out = rejection_sample(drafts.to(dev), counts.cumsum(0).to(dev), max_spec_len, None, logits.to(dev),
                           torch.tensor(bonus).unsqueeze(1).to(dev), backend=backend)
    assert out.dtype == torch.int32 and out.shape == (len(counts), max_spec_len + 1)
    return out.cpu().tolist()


@pytest.mark.parametrize("backend", agreement_backends())
def test_greedy_perfect_match_ends_with_the_bonus_token(backend):
    assert _greedy([[1, 2, 3]], [[1, 2, 3]], [4], 3, backend) == [[1, 2, 3, 4]]


@pytest.mark.parametrize("backend", agreement_backends())
def test_greedy_mismatch_ends_with_the_targets_token(backend):
    assert _greedy([[1, 2, 3]], [[1, 5, 3]], [4], 3, backend) == [[1, 5, -1, -1]]
    assert _greedy([[1, 2, 3]], [[7, 2, 3]], [4], 3, backend) == [[7, -1, -1, -1]]  # at the first draft


@pytest.mark.parametrize("backend", agreement_backends())
def test_batches_of_different_draft_counts(backend):
    """Counts 2, 0, 3 and 1 in one batch, max_spec_len above all of them: each row's layout is its own."""
    got = _greedy([[1, 2], [], [3, 4, 5], [6]], [[1, 2], [], [3, 9, 5], [0]], [7, 8, 10, 11], 4, backend)
    assert got == [[1, 2, 7, -1, -1], [8, -1, -1, -1, -1], [3, 9, -1, -1, -1], [0, -1, -1, -1, -1]]


@pytest.mark.parametrize("backend", agreement_backends())
def test_greedy_and_sampled_requests_mix(backend):
    """Request 0 greedy; request 1 sampled with a one-hot target (temperature 1 over logits of -inf but one):
    both outcomes are forced."""
    dev = _device(backend)
    logits = torch.cat([_peaked([1, 2]), torch.full((2, V), float("-inf"))])
    logits[2, 3], logits[3, 9] = 0.0, 0.0
    out = rejection_sample(torch.tensor([1, 2, 3, 4]).to(dev), torch.tensor([2, 4]).to(dev), 2, None, logits.to(dev),
                           torch.tensor([[5], [6]]).to(dev), temperature=torch.tensor([0.0, 1.0]).to(dev),
                           seed=torch.tensor([3, 4]).to(dev), backend=backend)
    assert out.cpu().tolist() == [[1, 2, 5], [3, 9, -1]]  # draft 4 has probability 0: the residual is token 9


@pytest.mark.parametrize("backend", [pytest.param("torch", id="torch"),
                                     pytest.param("cuda", marks=pytest.mark.cuda, id="cuda")])
@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_sampled_requests_emit_the_targets_law(backend, with_draft_probs):
    """Lossless: over 200,000 one-draft requests at temperature 0.8 and top-p 0.9, the first emitted token is
    distributed as the target's filtered softmax, whether drafts come with their distribution or without one."""
    dev = _device(backend)
    B = 200_000
    g = torch.Generator().manual_seed(2)
    row = 2 * torch.randn(V, generator=g)
    draft_row = torch.softmax(torch.randn(V, generator=g), -1)
    drafts = torch.multinomial(draft_row, B, replacement=True, generator=g)
    probs = draft_row.expand(B, V).to(dev) if with_draft_probs else None
    out = rejection_sample(drafts.to(dev), torch.arange(1, B + 1).to(dev), 1, probs, row.expand(B, V).to(dev),
                           torch.full((B, 1), -7).to(dev), temperature=0.8, top_p=0.9,
                           seed=torch.arange(B).to(dev), backend=backend)
    want = torch.softmax(row.double() / 0.8, -1)
    order = want.argsort(descending=True)
    kept = torch.zeros(V, dtype=torch.bool)
    kept[order[: int((want[order].cumsum(0) < 0.9).sum()) + 1]] = True
    want = torch.where(kept, want, 0) / want[kept].sum()
    first = torch.bincount(out[:, 0].cpu().long(), minlength=V).double() / B
    assert (first - want).abs().max() < 5e-3
    accepted = out[:, 0].cpu() == drafts
    assert torch.equal(out[:, 1].cpu() == -7, accepted)  # the bonus (-7) comes iff the draft was accepted


@settings(max_examples=25, deadline=None)
@given(counts=st.lists(st.integers(0, 4), min_size=1, max_size=5), extra=st.integers(0, 2), seed=st.integers(0, 999))
def test_greedy_rule_on_random_batches(counts, extra, seed):
    """Greedy: each row is the longest prefix of drafts equal to their rows' argmax, then the argmax at the first
    mismatch or the bonus token, then -1; for random counts, drafts and logits."""
    g = torch.Generator().manual_seed(seed)
    N = sum(counts)
    logits = torch.randn(N, V, generator=g)
    argmax = logits.argmax(-1)
    drafts = torch.where(torch.rand(N, generator=g) < 0.6, argmax, torch.randint(0, V, (N,), generator=g))
    bonus = torch.randint(0, V, (len(counts), 1), generator=g)
    max_spec_len = max(counts) + extra
    out = rejection_sample(drafts, torch.tensor(counts).cumsum(0), max_spec_len, None, logits, bonus,
                           backend="torch").tolist()
    start = 0
    for b, n in enumerate(counts):
        want = []
        for i in range(n):
            want.append(int(argmax[start + i]))
            if drafts[start + i] != argmax[start + i]:
                break
        else:
            want.append(int(bonus[b, 0]))
        assert out[b] == want + [-1] * (max_spec_len + 1 - len(want))
        start += n


def test_bad_arguments_are_named():
    drafts, cu, logits, bonus = torch.tensor([1, 2]), torch.tensor([2]), torch.randn(2, V), torch.tensor([[3]])
    with pytest.raises(ValueError, match="target_logits"):
        rejection_sample(drafts, cu, 2, None, logits[:1], bonus)
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample(drafts, cu, 2, torch.rand(2, V + 1), logits, bonus)
    with pytest.raises(ValueError, match="bonus_token_ids"):
        rejection_sample(drafts, cu, 2, None, logits, torch.tensor([[3, 4]]))
    with pytest.raises(ValueError, match="draft_token_ids"):
        rejection_sample(drafts.float(), cu, 2, None, logits, bonus)
    with pytest.raises(ValueError, match="max_spec_len"):
        rejection_sample(drafts, cu, -1, None, logits, bonus)
    with pytest.raises(ValueError, match="more than max_spec_len"):
        rejection_sample(drafts, cu, 1, None, logits, bonus)
    with pytest.raises(ValueError, match="ends at 1"):
        rejection_sample(drafts, torch.tensor([1]), 2, None, logits, bonus)
    with pytest.raises(ValueError, match="non-decreasing"):
        rejection_sample(drafts, torch.tensor([2, 1]), 2, None, logits, torch.tensor([[3], [4]]))


@pytest.mark.cuda
def test_captured_in_a_cuda_graph():
    """No host sync: captured once, replayed with new logits and seeds written in place."""
    B, n = 8, 3
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(B * n, 500, device="cuda", generator=g)
    drafts = torch.randint(0, 500, (B * n,), device="cuda", generator=g)
    cu = torch.arange(1, B + 1, device="cuda") * n
    bonus = torch.randint(0, 500, (B, 1), device="cuda", generator=g)
    temp = torch.full((B,), 0.7, device="cuda")
    seed = torch.arange(B, device="cuda")
    kw = dict(temperature=temp, seed=seed, validate=False)
    rejection_sample(drafts, cu, n, None, logits, bonus, **kw)  # warm-up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = rejection_sample(drafts, cu, n, None, logits, bonus, **kw)
    logits.copy_(torch.randn(B * n, 500, device="cuda", generator=g))
    seed.add_(100)
    graph.replay()
    assert torch.equal(out, rejection_sample(drafts, cu, n, None, logits, bonus, **kw))
