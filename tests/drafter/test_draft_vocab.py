"""The EAGLE drafter's draft vocabulary (``EagleDrafter.set_draft_vocab``, ``frequent_tokens``): a draft over a subset
of the vocabulary is the whole vocabulary's draft with every other token's logit at -inf, candidates come only from
the subset, the engine's output is unchanged (greedy), and bad input is refused naming the argument."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import ragged_prompts

from tlt_kernels.drafter import DrafterKVCache, EagleDrafter, frequent_tokens
from tlt_kernels.engine import SpeculativeEngine
from tlt_kernels.models import reference_generate
from tlt_kernels.models.config import ModelConfig
from tlt_kernels.models.llama import LlamaForCausalLM
from tlt_kernels.runtime import Strategy

pytestmark = pytest.mark.usefixtures("one_thread")

V = 64


@pytest.fixture(params=["fused", "dense"])
def decode_path(request, monkeypatch):
    """Both decoding paths of a draft (the fused ops and the dense reference)."""
    if request.param == "dense":
        monkeypatch.setattr(EagleDrafter, "_fused", lambda self, cache, width: False)
    return request.param


def _drafter_and_state(B=3, L=9, seed=0):
    """A drafter with large random weights (so its scores spread) over a tiny target, and a state of ``B`` random
    sequences of ``L`` pairs."""
    torch.manual_seed(seed)
    target = LlamaForCausalLM(ModelConfig.tiny(vocab_size=V)).eval()
    d = EagleDrafter.for_target(target, seed=seed).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in d.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[1] ** -0.5)
        toks = torch.randint(0, V, (B, L + 1), generator=g)
        feats = target(toks[:, :L])[1]
    cache = DrafterKVCache(d.config, 1 + B * d.blocks_per_request(L, 4), 4)
    state = d.new_state(cache, B, L)
    d.extend(state, cache, feats, toks[:, 1:], torch.full((B,), L, dtype=torch.int32))
    return d, cache, state


def _masked_head(d, vocab):
    """The LM head with a bias of 0 on ``vocab`` and -1e30 elsewhere: its log-softmax over ``vocab`` is the
    subset's own, and no other token can rank in a top-k."""
    w = d.shared_modules[1].weight.detach()
    bias = torch.full((w.shape[0],), -1e30)
    bias[vocab] = 0.0
    return lambda: (w, bias)


@pytest.mark.parametrize("depth,topk,num_verify", [(1, 3, 4), (3, 2, 6), (4, 4, 16)])
def test_subset_draft_is_the_masked_full_draft(depth, topk, num_verify, decode_path, monkeypatch):
    d, cache, state = _drafter_and_state()
    vocab = torch.tensor([1, 3, 4, 8, 9, 15, 22, 23, 30, 41, 47, 52, 60, 63])
    d.set_draft_vocab(vocab)
    sub = d.draft(state, cache, depth, topk, num_verify)
    assert bool(torch.isin(sub.cand_tokens, vocab).all())
    d.set_draft_vocab(None)
    monkeypatch.setattr(d, "_full_head", _masked_head(d, vocab))
    full = d.draft(state, cache, depth, topk, num_verify)
    assert torch.equal(sub.cand_tokens, full.cand_tokens)
    assert torch.equal(sub.cand_parents, full.cand_parents)
    torch.testing.assert_close(sub.cand_scores, full.cand_scores, atol=1e-5, rtol=1e-5)
    for name in ("draft_tokens", "parents", "num_nodes"):
        assert torch.equal(getattr(sub.tree, name), getattr(full.tree, name)), name


def test_the_whole_vocabulary_as_a_subset_drafts_the_same_tree(decode_path):
    d, cache, state = _drafter_and_state(seed=3)
    full = d.draft(state, cache, 3, 3, 8)
    d.set_draft_vocab(torch.arange(V, dtype=torch.int32))
    assert d.draft_vocab_size == V and d.draft_vocab.dtype == torch.int64
    sub = d.draft(state, cache, 3, 3, 8)
    assert torch.equal(sub.cand_tokens, full.cand_tokens) and torch.equal(sub.cand_parents, full.cand_parents)
    torch.testing.assert_close(sub.cand_scores, full.cand_scores, atol=1e-6, rtol=1e-6)


def test_the_vocabulary_is_not_a_weight_and_follows_replicas():
    d, _, _ = _drafter_and_state()
    d.set_draft_vocab(torch.tensor([5, 2, 7]))
    assert "draft_vocab" not in d.state_dict()  # published weights leave it: an engine's drafter keeps its own
    assert d.draft_vocab.tolist() == [5, 2, 7]  # the order given is kept
    twin = d.replica("cpu")
    assert twin.draft_vocab.tolist() == [5, 2, 7] and twin.draft_vocab.data_ptr() != d.draft_vocab.data_ptr()
    version = d.draft_vocab_version
    d.set_draft_vocab(None)
    assert d.draft_vocab is None and d.draft_vocab_size == V and d.draft_vocab_version == version + 1


@pytest.mark.parametrize("bad,match", [
    (torch.tensor([1.0, 2.0]), "1-D integer"),
    (torch.tensor([[1, 2]]), "1-D integer"),
    (torch.tensor([True, False]), "1-D integer"),
    ([1, 2], "1-D integer"),
    (torch.zeros(0, dtype=torch.int64), "at least one"),
    (torch.tensor([0, V]), r"\[0, vocab_size=64\)"),
    (torch.tensor([-1, 3]), r"\[0, vocab_size=64\)"),
    (torch.tensor([3, 5, 3]), "distinct"),
])
def test_set_draft_vocab_refuses_bad_ids(bad, match):
    d, _, _ = _drafter_and_state()
    with pytest.raises(ValueError, match=match):
        d.set_draft_vocab(bad)
    assert d.draft_vocab is None  # nothing half-set


def test_topk_past_the_draft_vocabulary_is_refused():
    d, cache, state = _drafter_and_state()
    d.set_draft_vocab(torch.tensor([4, 9]))
    with pytest.raises(ValueError, match="draft vocabulary's 2 tokens"):
        d.draft(state, cache, 2, 3, 4)


def test_frequent_tokens_ranks_by_count_then_id():
    sequences = [[5, 5, 7, 2], [7, 5, 9], [2]]  # counts: 5 -> 3, 7 -> 2, 2 -> 2, 9 -> 1
    assert frequent_tokens(sequences, 1, 10).tolist() == [5]
    assert frequent_tokens(sequences, 3, 10).tolist() == [2, 5, 7]  # returned in id order
    assert frequent_tokens(sequences, 2, 10).tolist() == [2, 5]  # 2 and 7 tie on 2: the lower id ranks first
    assert frequent_tokens(sequences, 5, 10).tolist() == [0, 2, 5, 7, 9]  # unseen ids by id after the seen
    assert frequent_tokens([], 3, 10).tolist() == [0, 1, 2]
    assert frequent_tokens(sequences, 3, 10).dtype == torch.int64


@pytest.mark.parametrize("args,error,match", [
    (([[1]], 0, 10), ValueError, "size must be >= 1"),
    (([[1]], 11, 10), ValueError, "size must be <= vocab_size=10"),
    (([[1]], 2.0, 10), TypeError, "size must be a Python int"),
    (([[1, 10]], 2, 10), ValueError, "outside"),
    (([[-1]], 2, 10), ValueError, "outside"),
    (([[1]], 1, 0), ValueError, "vocab_size must be >= 1"),
])
def test_frequent_tokens_refuses_bad_input(args, error, match):
    with pytest.raises(error, match=match):
        frequent_tokens(*args)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 19), max_size=12), max_size=6), st.integers(1, 20))
def test_frequent_tokens_is_the_top_of_a_count_then_id_order(sequences, size):
    counts = [sum(s.count(t) for s in sequences) for t in range(20)]
    want = sorted(sorted(range(20), key=lambda t: (-counts[t], t))[:size])
    assert frequent_tokens(sequences, size, 20).tolist() == want


def test_engine_output_is_unchanged_and_drafts_come_from_the_vocabulary(target):
    """Lossless: greedy rollouts with a draft vocabulary equal plain decoding's; and a vocabulary set after the engine
    was built (its graphs keep the old one) is refused at the next rollout."""
    prompts = ragged_prompts(4, seed=1, first=5, step=3)
    max_new = [12, 7, 16, 9]
    drafter = EagleDrafter.for_target(target)
    vocab = frequent_tokens(prompts, 48, target.config.vocab_size)
    drafter.set_draft_vocab(vocab)
    eng = SpeculativeEngine(target, drafter, Strategy(3, 2, 6), max_batch_size=4, max_seq_len=64)
    proposed = []
    draft = drafter.draft
    drafter.draft = lambda *a, **k: proposed.append(draft(*a, **k)) or proposed[-1]
    out = eng.generate(prompts, max_new)
    ref = reference_generate(target, prompts, max(max_new))
    for b, n in enumerate(max_new):
        assert out.tokens[b] == ref.tokens[b, :n].tolist(), f"request {b}"
    assert proposed and all(bool(torch.isin(p.cand_tokens, vocab).all()) for p in proposed)
    drafter.set_draft_vocab(None)
    with pytest.raises(RuntimeError, match="set_draft_vocab before building the engine"):
        eng.generate(prompts, max_new)


@pytest.mark.cuda
def test_gpu_fused_step_graphs_draft_from_the_vocabulary():
    """On the GPU, inside the fused step's CUDA graphs (the head's rows gathered in the graph): greedy output equals
    plain decoding's, every step replays a graph, and the drafts hold only the vocabulary's tokens."""
    from conftest import tiny_trained_target
    from tlt_kernels.runtime import GraphPool

    gpu = tiny_trained_target().cuda()
    prompts = ragged_prompts(6, seed=2, first=6, step=2)
    max_new = [9, 21, 5, 30, 14, 2]
    drafter = EagleDrafter.for_target(gpu)
    vocab = frequent_tokens(reference_generate(gpu, prompts, 32).tokens.tolist(), 40, gpu.config.vocab_size)
    drafter.set_draft_vocab(vocab)
    eng = SpeculativeEngine(gpu, drafter, Strategy(3, 2, 7), GraphPool(), max_batch_size=8, max_seq_len=80,
                            fuse_step=True)
    eng.capture_graphs([1, 2, 4, 8])
    assert eng.graph_error is None, eng.graph_error
    out = eng.generate(prompts, max_new)
    ref = reference_generate(gpu, prompts, max(max_new))
    for b, n in enumerate(max_new):
        assert out.tokens[b] == ref.tokens[b, :n].tolist(), f"request {b}"
    assert all(s.graph for s in out.steps)
    cache = DrafterKVCache(drafter.config, 1 + drafter.blocks_per_request(16, 4), 4, device="cuda")
    state = drafter.new_state(cache, 1, 16)
    feats = torch.randn(1, 16, drafter.config.hidden_size, device="cuda")
    tokens = torch.randint(0, gpu.config.vocab_size, (1, 16), device="cuda")
    drafter.extend(state, cache, feats, tokens, torch.tensor([16], device="cuda"))
    assert bool(torch.isin(drafter.draft(state, cache, 3, 2, 7).cand_tokens, vocab.cuda()).all())
