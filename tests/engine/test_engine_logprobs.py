"""``SpeculativeEngine(logprobs=True)``: every emitted token's log-probability, as an RL trainer reads it.

Each token's scores equal ``log_softmax`` of a plain dense forward over the prompt and the tokens before it (raw),
and of those logits over the temperature (sampling); speculative and plain decoding of the same sequence score it
alike; greedy requests score 0 under their point-mass sampling distribution; EOS and budgets cut the scores with the
tokens; graphs (fused and separate, on the CPU stand-in backend) and eager steps agree."""
import pytest
import torch

from conftest import ragged_prompts
from tlt_kernels.engine import SpeculativeEngine
from tlt_kernels.runtime import GraphPool, Strategy, StrategySelector
from tlt_kernels.runtime.graph_pool import FakeGraphBackend

MAX_NEW = [6, 17, 3, 12]
TOL = 1e-4


@pytest.fixture(scope="module")
def prompts():
    return ragged_prompts(len(MAX_NEW), seed=1, first=5, step=3)


def dense_scores(target, prompt, tokens, temperature: float):
    """``(sampling, raw)`` float64 ``[n]`` of ``tokens`` after ``prompt`` from one dense forward (no cache)."""
    seq = torch.tensor([prompt + tokens[:-1]])
    logits = target(seq)[0][0, len(prompt) - 1:].double()
    token = torch.tensor(tokens).unsqueeze(1)
    raw = torch.log_softmax(logits, -1).gather(1, token).squeeze(1)
    if temperature == 0:
        return torch.zeros_like(raw), raw
    return torch.log_softmax(logits / temperature, -1).gather(1, token).squeeze(1), raw


def _check(target, prompts, out, temperature):
    for b, prompt in enumerate(prompts):
        assert len(out.logprobs[b]) == len(out.raw_logprobs[b]) == len(out.tokens[b]) == int(out.lengths[b])
        sampling, raw = dense_scores(target, prompt, out.tokens[b], temperature)
        assert torch.allclose(torch.tensor(out.raw_logprobs[b], dtype=torch.float64), raw, atol=TOL, rtol=0), b
        assert torch.allclose(torch.tensor(out.logprobs[b], dtype=torch.float64), sampling, atol=TOL, rtol=0), b


def _engine(target, kind, strategy, pool=None, fuse=False):
    return SpeculativeEngine(target, None if kind == "none" else kind, strategy, pool, max_batch_size=8,
                             max_seq_len=64, fuse_step=fuse, logprobs=True)


@pytest.mark.parametrize("kind,strategy", [("none", Strategy.off()), ("ngram", Strategy(4, 1, 5)),
                                           ("ngram", Strategy(3, 2, 7)), ("eagle", Strategy(3, 2, 6))], ids=str)
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_scores_equal_a_dense_forward(target, prompts, kind, strategy, temperature):
    drafter = kind
    if kind == "eagle":
        from tlt_kernels.drafter import EagleDrafter
        drafter = EagleDrafter.for_target(target)
    eng = SpeculativeEngine(target, None if kind == "none" else drafter, strategy, max_batch_size=8, max_seq_len=64,
                            logprobs=True)
    out = eng.generate(prompts, MAX_NEW, temperature=temperature, seed=[3, 4, 5, 6])
    _check(target, prompts, out, temperature)


def test_speculative_and_plain_decoding_score_the_same_sequence_alike(target, prompts):
    plain = _engine(target, "none", Strategy.off()).generate(prompts, MAX_NEW)
    spec = _engine(target, "ngram", StrategySelector([Strategy(2, 1, 3), Strategy(3, 2, 7)], seed=0)).generate(
        prompts, MAX_NEW)
    assert spec.tokens == plain.tokens and spec.mean_accepted_length() > 1.0
    for b in range(len(prompts)):
        assert spec.logprobs[b] == plain.logprobs[b] == [0.0] * len(plain.tokens[b])  # greedy: a point mass
        assert torch.allclose(torch.tensor(spec.raw_logprobs[b]), torch.tensor(plain.raw_logprobs[b]), atol=TOL)


@pytest.mark.parametrize("kind,fuse", [("none", False), ("none", True), ("eagle", True), ("eagle", False)], ids=str)
def test_graph_steps_score_like_eager_steps(target, prompts, kind, fuse):
    """Fused step graphs return the scores between accept's outputs and the drafter's state."""
    from tlt_kernels.drafter import EagleDrafter

    strategy = Strategy.off() if kind == "none" else Strategy(2, 2, 4)
    drafter = (lambda: "none") if kind == "none" else (lambda: EagleDrafter.for_target(target, seed=0))
    eager = _engine(target, drafter(), strategy).generate(prompts, MAX_NEW, temperature=0.7, seed=[1, 2, 3, 4])
    pool = GraphPool(backend=FakeGraphBackend(lambda key: 0), warmup_iters=1)
    eng = _engine(target, drafter(), strategy, pool=pool, fuse=fuse)
    eng.capture_graphs([4, 8])
    graphed = eng.generate(prompts, MAX_NEW, temperature=0.7, seed=[1, 2, 3, 4])
    assert all(s.graph for s in graphed.steps)
    assert graphed.tokens == eager.tokens
    for b in range(len(prompts)):  # padded graph batches may round the forward differently: within fp32 noise
        assert torch.allclose(torch.tensor(graphed.logprobs[b]), torch.tensor(eager.logprobs[b]), atol=TOL, rtol=0)
        assert torch.allclose(torch.tensor(graphed.raw_logprobs[b]), torch.tensor(eager.raw_logprobs[b]), atol=TOL,
                              rtol=0)


def test_eos_cuts_scores_with_the_tokens(target, prompts):
    eng = _engine(target, "ngram", Strategy(4, 1, 5))
    full = eng.generate(prompts, MAX_NEW)
    eos = full.tokens[1][4]  # request 1 emits it at its fifth token at the latest
    out = eng.generate(prompts, MAX_NEW, eos_token_id=eos)
    for b in range(len(prompts)):
        n = len(out.tokens[b])
        assert len(out.logprobs[b]) == len(out.raw_logprobs[b]) == n
        assert out.raw_logprobs[b] == full.raw_logprobs[b][:n]
    assert len(out.tokens[1]) <= 5


def test_unscored_engines_return_none(target, prompts):
    out = SpeculativeEngine(target, None, Strategy.off(), max_batch_size=8, max_seq_len=64).generate(prompts, 2)
    assert out.logprobs is None and out.raw_logprobs is None


def test_scoring_adds_no_host_read(target, prompts, monkeypatch):
    """The scores stay on the device until the result is assembled: a step still reads the device at most once."""
    from test_host_syncs import MAX_READS_PER_STEP, count_step_reads

    eng = _engine(target, "ngram", Strategy(3, 2, 7))
    out, per_step = count_step_reads(eng, monkeypatch, temperature=0.9, seed=list(range(7)))  # its 7 prompts
    assert out.logprobs is not None and len(per_step) >= 3
    for i, reads in enumerate(per_step):
        assert sum(reads.values()) <= MAX_READS_PER_STEP, f"step {i}: {dict(reads)}"
