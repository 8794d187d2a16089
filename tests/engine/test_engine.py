"""SpeculativeEngine: greedy identity with plain decoding, sampling in distribution, reproducibility.

CPU tests run a tiny fp32 target (hidden 64, 2 layers, vocab 256) trained for a few steps on the
stdlib corpus so its logits are not near-uniform (greedy near-ties would make exact comparisons
meaningless). GPU tests capture the verify forward through a GraphPool.
"""
import sys

import pytest
import torch

from conftest import ragged_prompts, tiny_trained_target, two_sample_chi2

from tlt_kernels.drafter import EagleDrafter, RolloutBuffer, SpotTrainer
from tlt_kernels.drafter.base import Drafter, DrafterBase, ProposedTree
from tlt_kernels.engine import SpeculativeEngine, tree_width
from tlt_kernels.models import ModelConfig, load_corpus, reference_generate, train_tiny_target
from tlt_kernels.models.train_tiny import sample_windows
from tlt_kernels.runtime import Strategy, StrategySelector
from tlt_kernels.tree import chain_parents

MAX_NEW = [5, 23, 9, 30, 3, 17, 1]


@pytest.fixture(scope="module")
def prompts():
    return ragged_prompts(len(MAX_NEW), seed=0, first=6, step=2)


def _drafter(kind, target):
    if kind == "eagle":
        return EagleDrafter.for_target(target)
    if kind == "union":  # EAGLE's tree with the n-gram branch beside it
        return [EagleDrafter.for_target(target), "ngram"]
    return None if kind == "none" else kind


CONFIGS = [
    ("none", Strategy.off()),
    ("ngram", Strategy(4, 1, 5)),
    ("ngram", Strategy(3, 2, 7)),
    ("eagle", Strategy(3, 2, 6)),
    ("eagle", Strategy(1, 3, 4)),
    ("ngram", "selector"),
    ("eagle", "selector"),
]


def _selector(kind):
    arms = [Strategy(2, 1, 3), Strategy(4, 1, 5), Strategy(3, 2, 7)]
    return StrategySelector(arms, seed=0)


def test_each_generate_tells_the_selector_a_new_rollout_starts(target, prompts, monkeypatch):
    """Once per rollout, before its first step, with the most tokens a request may take (the loss budget's horizon):
    the cost policy forgets part of the last batch's counts there."""
    sel = _selector("ngram")
    eng = SpeculativeEngine(target, "ngram", sel, max_batch_size=8, max_seq_len=64)
    events = []
    monkeypatch.setattr(sel, "new_rollout", lambda max_tokens=None: events.append(("new_rollout", max_tokens)))
    select = sel.select
    monkeypatch.setattr(sel, "select", lambda b: events.append("select") or select(b))
    for _ in range(2):
        eng.generate(prompts[:2], [4, 3])
    starts = [i for i, e in enumerate(events) if e == ("new_rollout", 4)]  # told the longest request's budget
    assert len(starts) == 2 and starts[0] == 0 and events[starts[1] - 1] == "select" and events[1] == "select"


@pytest.mark.parametrize("kind,strategy", CONFIGS, ids=lambda v: str(v))
def test_greedy_matches_plain_decoding(target, prompts, kind, strategy):
    sel = _selector(kind) if strategy == "selector" else strategy
    eng = SpeculativeEngine(target, _drafter(kind, target), sel, max_batch_size=8, max_seq_len=64)
    out = eng.generate(prompts, MAX_NEW)
    ref = reference_generate(target, prompts, max(MAX_NEW))
    for b, n in enumerate(MAX_NEW):
        assert out.tokens[b] == ref.tokens[b, :n].tolist(), f"request {b} ({kind}, {strategy})"
    assert out.lengths.tolist() == MAX_NEW
    # The batch shrinks as requests finish (the long tail) and the log accounts for every token.
    sizes = [s.batch_size for s in out.steps]
    assert sizes == sorted(sizes, reverse=True) and sizes[-1] == 1
    assert sum(s.emitted for s in out.steps) == sum(MAX_NEW) - len(MAX_NEW)  # first tokens come from prefill
    assert out.finish_s[3] == max(out.finish_s)  # the longest request finishes last
    if kind != "none":
        assert out.mean_accepted_length() > 1.0  # drafts do get accepted on real text
    assert sum(sum(d.values()) for d in out.strategies_by_batch().values()) == len(out.steps)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_the_progress_bar_ends_at_every_token(target, prompts, capsys, overlap):
    """``progress=True`` draws on stderr; its last line counts every token of the rollout (the host's count of the
    last step read, no device read at the end)."""
    eng = SpeculativeEngine(target, "ngram", Strategy(4, 1, 5), max_batch_size=8, max_seq_len=64, progress=True,
                            overlap_steps=overlap)
    out = eng.generate(prompts, MAX_NEW)
    last = capsys.readouterr().err.rstrip("\n").split("\r")[-1]
    assert last.split("] ")[1].startswith(f"{sum(MAX_NEW)}/{sum(MAX_NEW)} tok") and out.lengths.tolist() == MAX_NEW


def test_plain_sampling_reproduces_reference_stream(target, prompts):
    """Offset = decoding step, node 0: plain decoding is reference_generate's sampler token for token."""
    seeds = [11, 22, 33, 44, 55, 66, 77]
    eng = SpeculativeEngine(target, None, None, max_batch_size=8, max_seq_len=64)
    out = eng.generate(prompts, 12, temperature=0.9, seed=seeds)
    ref = reference_generate(target, prompts, 12, temperature=0.9, seed=torch.tensor(seeds))
    assert out.tokens == ref.as_lists()


def test_per_request_seed_is_reproducible_and_batch_independent(target, prompts):
    eng = SpeculativeEngine(target, "ngram", Strategy(3, 2, 7), max_batch_size=8, max_seq_len=64)
    seeds = [5, 6, 7, 8, 9, 10, 11]
    a = eng.generate(prompts, MAX_NEW, temperature=1.0, top_p=0.95, seed=seeds)
    b = eng.generate(prompts, MAX_NEW, temperature=1.0, top_p=0.95, seed=seeds)
    assert a.tokens == b.tokens
    alone = eng.generate([prompts[3]], MAX_NEW[3], temperature=1.0, top_p=0.95, seed=seeds[3])
    assert alone.tokens[0] == a.tokens[3]
    other = eng.generate(prompts, MAX_NEW, temperature=1.0, top_p=0.95, seed=[s + 100 for s in seeds])
    assert other.tokens != a.tokens


@pytest.mark.parametrize("kind,strategy", [("eagle", Strategy(2, 2, 5))], ids=str)
def test_sampling_matches_plain_sampling_in_distribution(target, kind, strategy):
    """Joint law of the first 3 tokens under speculative sampling = plain sampling (chi-square).

    EAGLE top-k candidates are verified with the deterministic-candidate rule (the n-gram drafter
    uses the same rule, so this covers it; the tiny model rarely repeats under sampling, which
    would leave n-gram drafts almost never accepted here)."""
    N, n_tok = 1500, 3
    # One prompt, many seeds: samples of one distribution. Repetitive, so n-grams find matches.
    prompt = list(b"        self.x = x\n        self.")
    eng = SpeculativeEngine(target, _drafter(kind, target), strategy, max_batch_size=N, max_seq_len=48)
    spec = eng.generate([prompt] * N, n_tok, temperature=0.8, seed=list(range(N)))
    assert spec.mean_accepted_length() > 1.02  # the speculative path really accepted drafts
    plain = reference_generate(target, [prompt] * N, n_tok, temperature=0.8, seed=torch.arange(N) + 10**6)
    xs = [tuple(t) for t in spec.tokens]
    ys = [tuple(t) for t in plain.as_lists()]
    stat, dof, p = two_sample_chi2(xs, ys)
    assert dof >= 5, "too few populated bins for a meaningful test"
    assert p > 1e-3, f"chi2={stat:.1f} dof={dof} p={p:.2e}"
    # Power check: a 20% hotter sampler is rejected by the same test.
    hot = reference_generate(target, [prompt] * N, n_tok, temperature=0.96, seed=torch.arange(N) + 2 * 10**6)
    _, _, p_hot = two_sample_chi2(xs, [tuple(t) for t in hot.as_lists()])
    assert p_hot < p


def test_eos_stops_requests(target, prompts):
    ref = reference_generate(target, prompts, 30)
    eos = int(ref.tokens[3, 4])  # some token request 3 emits early
    eng = SpeculativeEngine(target, "ngram", Strategy(4, 1, 5), max_batch_size=8, max_seq_len=64)
    out = eng.generate(prompts, 30, eos_token_id=eos)
    expect = reference_generate(target, prompts, 30, eos_token_id=eos).as_lists()
    assert out.tokens == expect
    assert len(out.tokens[3]) <= 5 and out.tokens[3][-1] == eos


@pytest.mark.parametrize("kind,strategy,fuse", [("none", Strategy.off(), False), ("ngram", Strategy(4, 1, 5), False),
                                                ("eagle", Strategy(3, 2, 6), False), ("eagle", Strategy(3, 2, 6), True),
                                                ("ngram", Strategy(4, 1, 5), True)], ids=str)
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_requests_done_at_their_first_token_leave_at_the_prefill(target, prompts, kind, strategy, fuse, overlap):
    """The start reads nothing, so requests whose first token is EOS ride along in the first step (or two,
    overlapped) as finished rows: they emit nothing more, count in no step's batch, finish at the prefill's end and
    never enter the rollout buffer; every other request's tokens are its tokens without EOS, cut at its first EOS
    (sampled: the tiny target's greedy tokens are all one token; per-request seeds make each request's stream
    independent of the others')."""
    from tlt_kernels.runtime import GraphPool
    from tlt_kernels.runtime.graph_pool import FakeGraphBackend

    pool = GraphPool(backend=FakeGraphBackend(lambda key: 0), warmup_iters=1) if fuse else None
    buffer = RolloutBuffer(capacity_tokens=1 << 14, storage_dtype=torch.float32)
    eng = SpeculativeEngine(target, _drafter(kind, target), strategy, pool, max_batch_size=8, max_seq_len=64,
                            fuse_step=fuse, overlap_steps=overlap, rollout_buffer=buffer)
    if fuse:
        eng.capture_graphs([2, 8])
    sampling = dict(temperature=1.0, seed=list(range(len(MAX_NEW))))
    free = eng.generate(prompts, MAX_NEW, **sampling)
    eos = free.tokens[1][0]
    at_first = [b for b, tokens in enumerate(free.tokens) if tokens[0] == eos]
    stepping = [b for b, tokens in enumerate(free.tokens) if b not in at_first and MAX_NEW[b] > 1]
    assert at_first and stepping
    buffered, real_add = [], eng._add_to_buffer
    eng._add_to_buffer = lambda rollout, requests: (buffered.extend(requests), real_add(rollout, requests))
    out = eng.generate(prompts, MAX_NEW, eos_token_id=eos, **sampling)
    assert out.tokens == [t[: t.index(eos) + 1] if eos in t else t for t in free.tokens] and out.errors == []
    for b in at_first:
        assert out.tokens[b] == [eos] and out.finish_s[b] == out.prefill_s
    assert all(out.finish_s[b] > out.prefill_s for b in stepping)
    assert out.steps[0].batch_size == len(stepping) and sorted(buffered) == stepping
    # Greedy, with EOS the first token of every request kept (the tiny target's greedy first tokens depend on how its
    # training ran on this machine's threads): no step counts, each finished at the prefill's end.
    greedy = reference_generate(target, prompts, 1).tokens[:, 0].tolist()
    kept = [b for b, token in enumerate(greedy) if token == greedy[0]]
    out = eng.generate([prompts[b] for b in kept], [MAX_NEW[b] for b in kept], eos_token_id=greedy[0])
    assert out.tokens == [greedy[:1]] * len(kept) and out.steps == [] and out.finish_s == [out.prefill_s] * len(kept)


@pytest.mark.parametrize("kind,strategy,fuse", [("none", Strategy.off(), False), ("ngram", Strategy(4, 1, 5), False),
                                                ("eagle", Strategy(3, 2, 6), False), ("none", Strategy.off(), True),
                                                ("eagle", Strategy(3, 2, 6), True), ("ngram", Strategy(4, 1, 5), True)],
                         ids=str)
@pytest.mark.parametrize("where", ["prefill", "step"])
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_nan_logits_stop_only_their_request(target, prompts, monkeypatch, kind, strategy, fuse, where, overlap):
    """A request whose logits turn NaN (verify_tree's error flag) stops there, is reported in ``errors`` with a
    warning and never enters the rollout buffer; no -1 token is emitted and every other request is unaffected.
    ``fuse``: the whole step replayed from a (fake, CPU) step graph, whose outputs carry the flags. ``overlap``: the
    failed request rides along in one more step, which must change nothing of it."""
    from tlt_kernels.runtime import GraphPool
    from tlt_kernels.runtime.graph_pool import FakeGraphBackend

    pool = GraphPool(backend=FakeGraphBackend(lambda key: 0), warmup_iters=1) if fuse else None
    eng = SpeculativeEngine(target, _drafter(kind, target), strategy, pool, max_batch_size=8, max_seq_len=64,
                            fuse_step=fuse, overlap_steps=overlap,
                            rollout_buffer=RolloutBuffer(capacity_tokens=1 << 14, storage_dtype=torch.float32))
    if fuse:
        eng.capture_graphs([2, 8])
        assert eng.graph_error is None, eng.graph_error
    clean = eng.generate(prompts, MAX_NEW)
    assert not fuse or all(s.graph for s in clean.steps)
    assert clean.errors == []
    calls, buffered = [], []
    real_prefill, real_tree = target.prefill_fresh, target.forward_tree

    def prefill(*args, **kwargs):  # the engine's eager prefill (its prompts checked by generate)
        logits, hidden = real_prefill(*args, **kwargs)
        if where == "prefill":
            logits = logits.clone()
            logits[2] = float("nan")
        return logits, hidden

    def forward_tree(tokens, *args, **kwargs):
        logits, hidden = real_tree(tokens, *args, **kwargs)
        calls.append(tokens.shape[0])
        if where == "step" and len(calls) == 2:  # the second step: its first row (synchronous), or request 3
            logits = logits.clone()  # (overlapped: the second step runs the first step's rows, and 3 is running)
            logits[3 if overlap else 0] = float("nan")
        return logits, hidden

    monkeypatch.setattr(target, "prefill_fresh", prefill)
    monkeypatch.setattr(target, "forward_tree", forward_tree)
    real_add = eng._add_to_buffer
    monkeypatch.setattr(eng, "_add_to_buffer", lambda rollout, reqs: (buffered.extend(reqs), real_add(rollout, reqs)))
    with pytest.warns(RuntimeWarning, match="NaN"):
        out = eng.generate(prompts, MAX_NEW)
    assert len(out.errors) == 1
    bad = out.errors[0]
    if where == "prefill":
        assert bad == 2 and out.tokens[2] == []
    else:
        assert out.tokens[bad] == clean.tokens[bad][: len(out.tokens[bad])] and len(out.tokens[bad]) < MAX_NEW[bad]
    assert -1 not in sum(out.tokens, [])
    assert all(out.tokens[b] == clean.tokens[b] for b in range(len(MAX_NEW)) if b != bad)
    assert bad not in buffered and sorted(buffered) == [b for b in range(len(MAX_NEW)) if b not in (bad, 6)]


@pytest.mark.parametrize("spot_overlap", [False, True])
def test_spot_trainer_runs_in_the_tail(target, prompts, monkeypatch, spot_overlap):
    """The trainer starts in the tail and trains; steps overlap until it starts and, unless ``spot_overlap_steps``,
    not after (it works between steps); greedy output is plain decoding's either way."""
    overlapped = []  # (steps overlap, trainer running) at each step
    real_step = SpeculativeEngine._step
    monkeypatch.setattr(SpeculativeEngine, "_step", lambda self, rollout: (
        overlapped.append((rollout.overlap, rollout.spot.running)), real_step(self, rollout)))
    interval_before = sys.getswitchinterval()
    rollout = EagleDrafter.for_target(target)
    train = EagleDrafter.for_target(target)
    buf = RolloutBuffer(capacity_tokens=1 << 16, storage_dtype=torch.float32)
    trainer = SpotTrainer(train, buf, batch_size=4, seq_len=8, warmup_steps=1, autocast_dtype=None)
    sel = StrategySelector([Strategy(2, 2, 4)], seed=0)
    eng = SpeculativeEngine(target, rollout, sel, max_batch_size=8, max_seq_len=128, spot_trainer=trainer,
                            rollout_buffer=buf, spot_overlap_steps=spot_overlap)
    lens = [4, 4, 4, 4, 4, 4, 90]
    out = eng.generate(prompts, lens)
    assert out.lengths.tolist() == lens
    assert buf.num_tokens > 0
    assert out.spot is not None and "error" not in out.spot, out.spot
    assert out.spot["micro_steps"] >= 1
    assert overlapped[0] == (True, False) and (spot_overlap, True) in overlapped
    assert sys.getswitchinterval() == interval_before  # lowered while the trainer ran, restored at the end
    assert all(overlap == spot_overlap for overlap, running in overlapped if running)
    # Greedy output is unaffected by drafter weight swaps mid-rollout.
    ref = reference_generate(target, prompts, max(lens))
    assert out.tokens[6] == ref.tokens[6, :90].tolist()


def _process_trainer_rollout(target, prompts, lens, device):
    """A rollout whose spot trainer is a SpotTrainerProcess on ``device``, then a short one that loads the weights:
    (the first's output, (switch interval, steps overlap, trainer running) at each step, the serving drafter, the
    trainer's last stats)."""
    from tlt_kernels.drafter import SpotTrainerProcess

    seen, real_step = [], SpeculativeEngine._step
    serving = EagleDrafter.for_target(target)
    buf = RolloutBuffer(capacity_tokens=1 << 16, storage_dtype=torch.float32)
    with SpotTrainerProcess(serving, buf, device=device, batch_size=4, seq_len=8, warmup_steps=1) as trainer:
        eng = SpeculativeEngine(target, serving, StrategySelector([Strategy(2, 2, 4)], seed=0), max_batch_size=8,
                                max_seq_len=128, spot_trainer=trainer, rollout_buffer=buf, spot_switch_interval_s=1e-4)
        eng._step = lambda rollout: (seen.append((sys.getswitchinterval(), rollout.overlap, rollout.spot.running)),
                                     real_step(eng, rollout))
        out = eng.generate(prompts, lens)
        steps = list(seen)
        trainer.collect()  # the stopped run's weights follow its stop
        eng.generate(prompts, [2] * len(prompts))  # loads them at its first step
    return out, steps, serving, trainer.last_stats


def test_spot_trainer_process_trains_in_the_tail_and_the_rollout_loads_its_weights(target, prompts):
    """A trainer in a worker process trains from the rollout's finished requests in the tail (stopped at the
    rollout's end, its weights follow the stop); the serving drafter loads what it publishes; the interpreter's
    switch interval is left alone and the steps keep overlapping (no thread of the trainer's runs here); greedy
    output is plain decoding's."""
    lens = [4, 4, 4, 4, 4, 4, 90]
    before = sys.getswitchinterval()
    out, steps, serving, exact = _process_trainer_rollout(target, prompts, lens, "cpu")
    assert out.spot is not None and "error" not in out.spot and out.spot["version"] is None, out.spot
    assert exact.stopped_by == "stop" and exact.micro_steps >= out.spot["micro_steps"]
    assert exact.micro_steps >= 1 and serving.weights_version == exact.published_version >= 1
    assert {interval for interval, _, _ in steps} == {before}
    assert any(running for _, _, running in steps) and all(overlap for _, overlap, _ in steps)
    ref = reference_generate(target, prompts, max(lens))
    assert all(out.tokens[b] == ref.tokens[b, :n].tolist() for b, n in enumerate(lens))


@pytest.mark.cuda
def test_gpu_rollout_with_a_spot_trainer_outranks_the_trainer_stream(prompts, monkeypatch):
    """With a spot trainer on CUDA every step runs on a stream of higher priority than the trainer's (lower number:
    higher priority), the caller's stream is current again afterwards, and greedy output is plain decoding's;
    prioritize_rollout=False keeps the caller's stream."""
    gpu = tiny_trained_target().cuda()
    step_priorities, trainer_priorities = [], []
    real_step, real_run = SpeculativeEngine._step, SpotTrainer.run
    monkeypatch.setattr(SpeculativeEngine, "_step", lambda self, rollout: (
        step_priorities.append(torch.cuda.current_stream().priority), real_step(self, rollout)))
    monkeypatch.setattr(SpotTrainer, "run", lambda self, *a, **kw: (
        trainer_priorities.append(torch.cuda.current_stream().priority), real_run(self, *a, **kw))[1])
    lens = [4, 4, 4, 4, 4, 4, 40]
    ref = reference_generate(gpu, prompts, max(lens))
    caller = torch.cuda.current_stream()
    for prioritize in (True, False):
        step_priorities.clear()
        buf = RolloutBuffer(capacity_tokens=1 << 16, storage_dtype=torch.float32)
        trainer = SpotTrainer(EagleDrafter.for_target(gpu), buf, batch_size=4, seq_len=8, warmup_steps=1)
        eng = SpeculativeEngine(gpu, EagleDrafter.for_target(gpu), Strategy(2, 2, 4), max_batch_size=8,
                                max_seq_len=64, spot_trainer=trainer, rollout_buffer=buf, backend="torch",
                                prioritize_rollout=prioritize)
        out = eng.generate(prompts, lens)
        assert torch.cuda.current_stream() == caller
        assert out.spot is not None and "error" not in out.spot, out.spot
        assert all(out.tokens[b] == ref.tokens[b, :n].tolist() for b, n in enumerate(lens))
        assert len(set(step_priorities)) == 1
        if prioritize:
            assert step_priorities[0] < trainer_priorities[-1] == 0
        else:
            assert step_priorities[0] == caller.priority


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second CUDA GPU for the trainer")
def test_gpu_spot_trainer_on_a_second_gpu_trains_a_replica_and_publishes_to_the_rollout(prompts):
    """The trainer on cuda:1 trains a replica of the serving drafter (cuda:0), publishing into a holder on cuda:0
    that the rollout loads between steps; greedy output stays plain decoding's."""
    from tlt_kernels.drafter import WeightsHolder

    gpu = tiny_trained_target().cuda()
    lens = [4, 4, 4, 4, 4, 4, 40]
    ref = reference_generate(gpu, prompts, max(lens))
    serving = EagleDrafter.for_target(gpu)
    buf = RolloutBuffer(capacity_tokens=1 << 16, storage_dtype=torch.float32)
    trainer = SpotTrainer(serving.replica("cuda:1"), buf, WeightsHolder(device=gpu.device), batch_size=4, seq_len=8,
                          warmup_steps=1)
    eng = SpeculativeEngine(gpu, serving, Strategy(2, 2, 4), max_batch_size=8, max_seq_len=64, spot_trainer=trainer,
                            rollout_buffer=buf, backend="torch")
    for _ in range(2):  # the second rollout's buffer holds the first's tokens: the trainer runs
        out = eng.generate(prompts, lens)
        assert out.spot is not None and "error" not in out.spot, out.spot
        assert all(out.tokens[b] == ref.tokens[b, :n].tolist() for b, n in enumerate(lens))
    assert trainer.micro_steps > 0 and trainer.holder.version > 0
    assert all(p.device == torch.device("cuda:1") for p in trainer.drafter.parameters())
    assert all(w.device == gpu.device for w in trainer.holder.latest().state_dict.values())


@pytest.mark.cuda
def test_gpu_spot_trainer_process_on_the_last_gpu(prompts):
    """The worker trains on the last CUDA device (the rollout's own on one GPU) and the rollout on cuda:0 loads its
    weights; greedy output stays plain decoding's."""
    gpu = tiny_trained_target().cuda()
    lens = [4, 4, 4, 4, 4, 4, 40]
    out, _, serving, exact = _process_trainer_rollout(gpu, prompts, lens, f"cuda:{torch.cuda.device_count() - 1}")
    assert out.spot is not None and "error" not in out.spot, out.spot
    assert exact.micro_steps >= 1 and serving.weights_version == exact.published_version >= 1
    assert all(p.device == gpu.device for p in serving.parameters())
    ref = reference_generate(gpu, prompts, max(lens))
    assert all(out.tokens[b] == ref.tokens[b, :n].tolist() for b, n in enumerate(lens))


def test_validation_errors(target, prompts):
    with pytest.raises(ValueError, match="need a drafter"):
        SpeculativeEngine(target, None, Strategy(2, 1, 3))
    with pytest.raises(ValueError, match="drafter must be"):
        SpeculativeEngine(target, "medusa")
    eng = SpeculativeEngine(target, "ngram", Strategy(2, 1, 3), max_batch_size=2, max_seq_len=40)
    with pytest.raises(ValueError, match="max_batch_size=2"):
        eng.generate(prompts, 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        eng.generate(prompts[:2], [4, 5, 6])
    with pytest.raises(ValueError, match="max_seq_len=40"):
        eng.generate(prompts[:2], 39)
    # The prefill runs unchecked, so generate rejects what it would have: no request, or requests of no token.
    for empty in (torch.zeros(0, 4, dtype=torch.int64), torch.zeros(2, 0, dtype=torch.int64)):
        with pytest.raises(ValueError, match=r"at least one request, each with at least one token, got a \["):
            eng.generate(empty, 3)
    with pytest.raises(ValueError, match=r"prompts\[1, 2\] = 999999"):
        eng.generate(torch.tensor([[1, 2, 3], [4, 5, 999999]]), 3)
    # A failed call leaves the cache usable.
    assert eng.generate(prompts[:2], 3).lengths.tolist() == [3, 3]


class OracleDrafter(DrafterBase):
    """A user's drafter (docs/DRAFTERS.md, "Writing your own drafter"): it proposes the next ``num_steps`` tokens
    of a known continuation (here plain greedy decoding's), so every draft it makes is right."""

    def __init__(self, continuation):
        self.continuation = continuation  # int64 [B, N]
        self.proposals = 0

    def tree_width(self, strategy):
        return 1 if strategy.is_off else 1 + strategy.num_steps

    def start(self, prompts, prompt_lens, first_tokens, prefill_hidden):
        self.generated = torch.ones(prompts.shape[0], dtype=torch.int64, device=prompts.device)

    def propose(self, strategy, rows, state_rows, graphs):
        self.proposals += 1
        k, N = strategy.num_steps, self.continuation.shape[1]
        done = self.generated[rows]
        positions = (done.unsqueeze(1) + torch.arange(k, device=rows.device)).clamp(max=N - 1)
        drafts = self.continuation[rows].gather(1, positions)
        tokens = torch.cat([torch.zeros_like(drafts[:, :1]), drafts], 1)  # node 0: the engine writes the root
        num_nodes = 1 + (N - done).clamp(min=0, max=k)
        return ProposedTree(tokens, chain_parents(rows.shape[0], k + 1, rows.device), num_nodes.to(torch.int32))

    def commit(self, rows, state_rows, path, graphs, new_state=None):
        self.generated[rows] += path.num_new.to(torch.int64)


def test_a_custom_drafter_plugs_into_the_engine(target, prompts):
    ref = reference_generate(target, prompts, max(MAX_NEW))
    oracle = OracleDrafter(ref.tokens)
    assert isinstance(oracle, Drafter)
    eng = SpeculativeEngine(target, oracle, Strategy(3, 1, 4), max_batch_size=8, max_seq_len=64)
    out = eng.generate(prompts, MAX_NEW)
    for b, n in enumerate(MAX_NEW):
        assert out.tokens[b] == ref.tokens[b, :n].tolist(), f"request {b}"
    # One proposal per step; the last launched step may run after every request finished (overlapped steps: it is
    # launched before the host reads that the batch is done) and is no step of the rollout.
    assert len(out.steps) > 0 and oracle.proposals in (len(out.steps), len(out.steps) + 1)
    assert out.mean_accepted_length() > 2.0  # its proposals are used: right drafts are accepted
    assert eng.drafter is None  # no weights module for a spot trainer
    with pytest.raises(ValueError, match="fuse_step"):
        SpeculativeEngine(target, OracleDrafter(ref.tokens), Strategy(3, 1, 4), max_batch_size=8, max_seq_len=64,
                          fuse_step=True)


def test_a_custom_drafter_runs_with_captured_verify_graphs(target, prompts):
    """A drafter with host-side state drafts eagerly while the verify forward replays its captured graphs."""
    from tlt_kernels.runtime import GraphPool
    from tlt_kernels.runtime.graph_pool import FakeGraphBackend

    ref = reference_generate(target, prompts, max(MAX_NEW))
    pool = GraphPool(backend=FakeGraphBackend(lambda key: 0), warmup_iters=1)
    eng = SpeculativeEngine(target, OracleDrafter(ref.tokens), Strategy(3, 1, 4), pool, max_batch_size=8, max_seq_len=64)
    eng.capture_graphs([2, 8])
    assert eng.graph_error is None, eng.graph_error
    assert {k[0] for k in pool.keys()} == {("verify", 1), ("verify", 4)}
    out = eng.generate(prompts, MAX_NEW)
    for b, n in enumerate(MAX_NEW):
        assert out.tokens[b] == ref.tokens[b, :n].tolist(), f"request {b}"
    assert all(s.graph for s in out.steps) and out.mean_accepted_length() > 2.0


def test_tree_width():
    assert tree_width(Strategy.off(), "eagle") == 1
    assert tree_width(Strategy(3, 2, 7), "eagle") == 7
    assert tree_width(Strategy(4, 1, 5), "ngram") == 5
    assert tree_width(Strategy(2, 1, 3), "ngram") == 3
    assert tree_width(Strategy(3, 2, 7), "ngram") == 7
    assert tree_width(Strategy(3, 3, 8), "ngram") == 7


def test_the_selector_learns_the_lagging_rows_acceptance(target, prompts):
    """Each speculative step's update carries the acceptance of the live rows with the most tokens left (a static
    batch ends when they do): ``accepted_rows`` of them, counts that never exceed them and fall with depth. Budgets
    here are ragged, so the lagging rows are the longest requests: request 3 (30 tokens) alone at first."""
    updates = []

    class Recording(StrategySelector):
        def update(self, strategy, batch_size, emitted, elapsed, accepted=None, accepted_rows=None,
                   batch_progress=None):
            updates.append((strategy, batch_size, accepted, accepted_rows, batch_progress))
            super().update(strategy, batch_size, emitted, elapsed, accepted, accepted_rows=accepted_rows,
                           batch_progress=batch_progress)

    sel = Recording([Strategy(2, 1, 3), Strategy(4, 1, 5)], seed=0)
    eng = SpeculativeEngine(target, "ngram", sel, max_batch_size=8, max_seq_len=64, overlap_steps=False)
    eng.generate(prompts, MAX_NEW)
    speculative = [u for u in updates if u[0].num_steps]
    assert speculative
    for strategy, batch_size, accepted, rows, progress in speculative:
        assert 1 <= rows <= batch_size and len(accepted) == strategy.num_steps
        assert all(0 <= x <= prev for x, prev in zip(accepted, [rows] + accepted[:-1]))
        # the batch's end moves by at most what its slowest lagging row emitted (no EOS here: at least one token)
        every_lagging_row = sum(1 for x in accepted if x == rows)
        assert 1 <= progress <= 1 + every_lagging_row
    assert speculative[0][3] == 1  # request 3 has the most tokens left
    assert all(u[4] is None for u in updates if not u[0].num_steps)  # plain steps: one token, nothing measured


@pytest.mark.parametrize("overlap, step_kernel", [(False, False), (True, False),
                                                  pytest.param(True, True, marks=pytest.mark.triton)])
def test_a_forecast_learns_each_running_rows_accepted_drafts(target, prompts, overlap, step_kernel):
    """A selector with a forecast gets, at every step, the rows still running after it (requests only leave) and,
    for a drafting step, each one's accepted drafts, from the step's one read (the torch path's staging or the step
    kernel's, here in Triton's interpreter): summed with the plain steps' one token, they account for every token a
    request emitted before its last step. The output stays the plain decoding's."""
    from tlt_kernels.ops.rollout_step import can_run_on
    from tlt_kernels.runtime.forecast import AcceptanceForecast

    updates = []

    class Recording(StrategySelector):
        def update(self, strategy, batch_size, emitted, elapsed, accepted=None, **kwargs):
            updates.append((strategy, kwargs["running_rows"], kwargs["rows_accepted"]))
            super().update(strategy, batch_size, emitted, elapsed, accepted, **kwargs)

    sel = Recording([Strategy(2, 1, 3), Strategy(4, 1, 5)], seed=0, forecast=AcceptanceForecast())
    eng = SpeculativeEngine(target, "ngram", sel, max_batch_size=8, max_seq_len=64, overlap_steps=overlap)
    if step_kernel:
        if not can_run_on(next(target.parameters()).device):
            pytest.skip("the tiny target is on the CPU: the kernel runs there only under TRITON_INTERPRET=1")
        eng.step_kernel = True
    out = eng.generate(prompts, MAX_NEW)
    ref = reference_generate(target, prompts, max(MAX_NEW))
    assert [out.tokens[b] for b in range(len(MAX_NEW))] == [ref.tokens[b, :n].tolist() for b, n in enumerate(MAX_NEW)]
    assert any(strategy.num_steps for strategy, _, _ in updates)
    tokens_before_last = [0] * len(MAX_NEW)
    previous = set(range(len(MAX_NEW)))
    for strategy, running, accepted in updates:
        assert len(set(running)) == len(running) and set(running) <= previous
        previous = set(running)
        if not strategy.num_steps:
            assert accepted is None
            accepted = [0] * len(running)
        assert len(accepted) == len(running) and all(0 <= a <= strategy.num_steps for a in accepted)
        for row, a in zip(running, accepted):
            tokens_before_last[row] += a + 1
    assert not previous  # every request finished
    for row, n in enumerate(MAX_NEW):
        assert tokens_before_last[row] < n  # its last step emitted at least one more token


def test_read_counts_per_row_gives_each_rows_context_growth():
    """``row_tokens`` is each step row's context growth from the same read (0 for a row done before), and reading
    without it leaves the rest of the counts unchanged."""
    from tlt_kernels.engine.state import RolloutState, StagedCounts

    rollout = RolloutState.__new__(RolloutState)
    rollout.context_lens_host = [10, 20, 30]
    rows = [2, 0, 1]
    finished, failed, was_done, new_lens = [0, 1, 1], [0, 0, 0], [0, 0, 1], [33, 11, 20]
    values = torch.tensor(finished + failed + was_done + new_lens + [7, 9, 50], dtype=torch.int64)
    counts = rollout.read_counts(StagedCounts(values, None, rows, 0), per_row=True)
    assert counts.row_tokens == [3, 1, 0]
    assert rollout.context_lens_host == [11, 20, 33]  # row 1 had finished before: its length is kept
    rollout.context_lens_host = [10, 20, 30]
    plain = rollout.read_counts(StagedCounts(values, None, rows, 0))
    assert plain.row_tokens is None and plain._replace(row_tokens=[3, 1, 0]) == counts


# ---------------------------------------------------------------------------------------------
# GPU: the verify forward replayed from a GraphPool
# ---------------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["ngram", "eagle"])
def test_gpu_graphs_greedy_matches_plain_decoding(target, prompts, kind):
    from tlt_kernels.runtime import GraphPool

    gpu = tiny_trained_target().cuda()
    sel = StrategySelector([Strategy(2, 1, 3), Strategy(4, 1, 5), Strategy(3, 2, 7)], seed=0)
    eng = SpeculativeEngine(gpu, _drafter(kind, gpu), sel, GraphPool(), max_batch_size=8, max_seq_len=64, backend="torch")
    stats = eng.capture_graphs([1, 2, 4, 8])
    assert eng.graph_error is None, eng.graph_error
    assert stats["graphs"] > 0
    out = eng.generate(prompts, MAX_NEW)
    ref = reference_generate(gpu, prompts, max(MAX_NEW))
    for b, n in enumerate(MAX_NEW):
        assert out.tokens[b] == ref.tokens[b, :n].tolist()
    assert all(s.graph for s in out.steps)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["none", "eagle", "ngram", "union"])
def test_gpu_fused_step_graphs_greedy_matches_plain_decoding(target, prompts, kind):
    from tlt_kernels.runtime import GraphPool

    gpu = tiny_trained_target().cuda()
    sel = StrategySelector([Strategy(2, 1, 3), Strategy(3, 2, 7)], seed=0) if kind != "none" else Strategy.off()
    eng = SpeculativeEngine(gpu, _drafter(kind, gpu), sel, GraphPool(), max_batch_size=8, max_seq_len=64, fuse_step=True)
    eng.capture_graphs([1, 2, 4, 8])
    assert eng.graph_error is None, eng.graph_error
    out = eng.generate(prompts, MAX_NEW)
    ref = reference_generate(gpu, prompts, max(MAX_NEW))
    for b, n in enumerate(MAX_NEW):
        assert out.tokens[b] == ref.tokens[b, :n].tolist()
    assert all(s.graph for s in out.steps)
    assert eng.graph_pool.stats()["misses"] == 0


@pytest.mark.cuda
def test_gpu_eagle_rollouts_compile_nothing_for_new_prompt_lengths():
    """A warmed-up bf16 EAGLE engine (fused steps, graphs) runs rollouts of padded prompt lengths it has not seen
    without a Triton compile: the drafter's prefill takes the dense path, and the rotary kernels do not specialize on
    the length (`bench rl` once compiled the tree-attention kernel mid-rollout: a step's prompts were 61 tokens after
    66 at warm-up, and the fused prefill took the width as a constant)."""
    from bench.jit_compiles import CompileCounter
    from tlt_kernels.runtime import GraphPool

    model = tiny_trained_target().cuda().to(torch.bfloat16)
    sel = StrategySelector([Strategy(2, 1, 3), Strategy(3, 2, 7)], seed=0)
    eng = SpeculativeEngine(model, EagleDrafter.for_target(model), sel, GraphPool(), max_batch_size=4, max_seq_len=128,
                            fuse_step=True)
    eng.capture_graphs([1, 2, 4])
    assert eng.graph_error is None, eng.graph_error
    gen = torch.Generator().manual_seed(0)

    def prompts_of(length):
        return [torch.randint(0, model.config.vocab_size, (length,), generator=gen).tolist() for _ in range(4)]

    eng.generate(prompts_of(30), 8)  # the warm-up: one prompt length
    with CompileCounter() as jit:
        for length in (17, 48, 61, 64, 2):
            out = eng.generate(prompts_of(length), 8)
            assert out.lengths.tolist() == [8] * 4
    assert jit.count == 0, jit.describe("rollouts after the warm-up")


@pytest.mark.cuda
def test_gpu_bf16_kernels_with_graphs():
    """bf16 small target on the tree-attention kernels: runs under graphs; greedy agrees with plain
    bf16 decoding except after floating-point near-ties (checked on the first tokens)."""
    from tlt_kernels.runtime import GraphPool

    model = train_tiny_target(ModelConfig.small(), steps=30, device="cuda", batch_size=8, seq_len=64).to(torch.bfloat16)
    corpus = load_corpus("base", 200_000)
    prompts = sample_windows(corpus, 16, 32, torch.Generator().manual_seed(1)).cuda()
    eng = SpeculativeEngine(model, "ngram", StrategySelector([Strategy(4, 1, 5), Strategy(3, 2, 7)], seed=0), GraphPool(),
                            max_batch_size=16, max_seq_len=128)
    eng.capture_graphs([1, 2, 4, 8, 16])
    out = eng.generate(prompts, [8 + 4 * b for b in range(16)])
    assert out.lengths.tolist() == [8 + 4 * b for b in range(16)]
    ref = reference_generate(model, prompts, 8)
    same = sum(out.tokens[b][:4] == ref.tokens[b, :4].tolist() for b in range(16))
    assert same >= 14


def test_eagle_graph_paths_on_cpu_fake_backend(target, prompts):
    """The padded draft / extend / verify graph inputs (sink rows, prefix outputs) through a GraphPool whose
    fake backend replays the captured closures: greedy output still equals plain decoding, and every step
    ran from "graphs" (draft, extend and verify all hit; a plain step replays the plain step's graph, its drafter
    commit deferred)."""
    from tlt_kernels.runtime import GraphPool
    from tlt_kernels.runtime.graph_pool import FakeGraphBackend

    pool = GraphPool(backend=FakeGraphBackend(lambda key: 0), warmup_iters=1)
    sel = StrategySelector([Strategy(2, 1, 3), Strategy(3, 2, 6)], seed=0)
    eng = SpeculativeEngine(target, EagleDrafter.for_target(target), sel, pool, max_batch_size=8, max_seq_len=64)
    eng.capture_graphs([2, 8])  # sizes 1..8 pad to 2 or 8: padded rows are exercised
    assert eng.graph_error is None, eng.graph_error
    names = {k[0] for k in pool.keys()}
    assert {("draft", 2, 1, 3), ("draft", 3, 2, 6), ("extend", 1), ("extend", 3), ("extend", 6), ("verify", 6)} <= names
    out = eng.generate(prompts, MAX_NEW)
    ref = reference_generate(target, prompts, max(MAX_NEW))
    for b, n in enumerate(MAX_NEW):
        assert out.tokens[b] == ref.tokens[b, :n].tolist(), f"request {b}"
    assert all(s.graph for s in out.steps)
    st = pool.stats()
    assert st["misses"] == 0 and st["hits"] >= 3 * len(out.steps) - 2 * sum(s.strategy == "off" for s in out.steps)


@pytest.mark.parametrize("kind", ["none", "eagle", "ngram", "union"])
def test_fused_step_graphs_on_cpu_fake_backend(target, prompts, kind):
    """fuse_step=True: one "graph" per (strategy, padded size) runs draft, verify, accept, compaction and the
    drafter's extension. Greedy equals plain decoding; sampling equals the unfused engine token for token
    (same seeds, same counter-based coins); every step replays a step graph and nothing else."""
    from tlt_kernels.runtime import GraphPool
    from tlt_kernels.runtime.graph_pool import FakeGraphBackend

    def make(fuse, static=False):
        pool = GraphPool(backend=FakeGraphBackend(lambda key: 0), warmup_iters=1)
        if kind == "none":
            sel = Strategy.off()
        else:  # the selector's choices depend on wall-clock step times: compare sampled tokens under a fixed arm
            sel = Strategy(3, 2, 6) if static else StrategySelector([Strategy(2, 1, 3), Strategy(3, 2, 6)], seed=0)
        torch.manual_seed(0)  # the same drafter weights for both engines
        eng = SpeculativeEngine(target, _drafter(kind, target), sel, pool, max_batch_size=8, max_seq_len=64, fuse_step=fuse)
        eng.capture_graphs([2, 8])
        assert eng.graph_error is None, eng.graph_error
        return eng, pool

    eng, pool = make(True)
    # Besides the step graphs, the drafter's commit graphs (EAGLE's) of the deferred backlog's path widths.
    commits = {spec[0] for spec in eng.tree_drafter.graph_specs([], eng.backlog.widths)} if eng.backlog else set()
    assert bool(commits) == (kind in ("eagle", "union"))
    assert {k[0] for k in pool.keys() if k[0][0] != "step"} == commits
    out = eng.generate(prompts, MAX_NEW)
    ref = reference_generate(target, prompts, max(MAX_NEW))
    for b, n in enumerate(MAX_NEW):
        assert out.tokens[b] == ref.tokens[b, :n].tolist(), f"request {b}"
    assert all(s.graph for s in out.steps)
    # One replay per step, one for an overlapped step launched after the last request finished (no step), and at
    # most one commit replay per plain step (its deferred backlog, committed before the next draft).
    plain_steps = sum(s.tree_width == 1 for s in out.steps)
    assert len(out.steps) <= pool.stats()["hits"] <= len(out.steps) + 1 + plain_steps and pool.stats()["misses"] == 0
    seeds = [3, 1, 4, 1, 5, 9, 2]
    fused = make(True, static=True)[0].generate(prompts, MAX_NEW, temperature=0.8, top_p=0.9, seed=seeds)
    unfused = make(False, static=True)[0].generate(prompts, MAX_NEW, temperature=0.8, top_p=0.9, seed=seeds)
    assert fused.tokens == unfused.tokens
    assert fused.lengths.tolist() == MAX_NEW


def test_trace_probes_replay_the_fused_step_graphs(target, prompts):
    """With fuse_step, every arm's probe replays that arm's step graph (so trace step times are graph times),
    the output is still plain decoding's, and the chosen arm's probe saw at least the tokens the step emitted
    (the step may cut them at a request's budget)."""
    from tlt_kernels.runtime import GraphPool
    from tlt_kernels.runtime.graph_pool import FakeGraphBackend

    pool = GraphPool(backend=FakeGraphBackend(lambda key: 0), warmup_iters=1)
    arms = [Strategy(2, 1, 3), Strategy(3, 2, 6)]
    eng = SpeculativeEngine(target, EagleDrafter.for_target(target), StrategySelector(arms, seed=0), pool, max_batch_size=8,
                            max_seq_len=64, fuse_step=True)
    eng.capture_graphs([2, 8])
    assert eng.graph_error is None, eng.graph_error
    trace = []
    out = eng.generate(prompts, MAX_NEW, trace=trace)
    ref = reference_generate(target, prompts, max(MAX_NEW))
    for b, n in enumerate(MAX_NEW):
        assert out.tokens[b] == ref.tokens[b, :n].tolist(), f"request {b}"
    assert len(trace) == len(out.steps)
    for rec, st in zip(trace, out.steps):
        assert set(rec["arms"]) == {"off", "s2k1v3", "s3k2v6"}
        assert rec["arms"][st.strategy]["emitted"] >= st.emitted
    # Three probes and the real step per decoding step, all from step graphs; a plain step's commit (not deferred
    # while tracing) replays the drafter's width-1 commit graph.
    plain_steps = sum(s.tree_width == 1 for s in out.steps)
    assert pool.stats()["hits"] == 4 * len(out.steps) + plain_steps and pool.stats()["misses"] == 0


def test_bf16_drafter_keeps_greedy_output(target, prompts):
    """Drafting precision changes only which drafts are proposed, never the output: a bf16 EAGLE drafter over an
    fp32 target still reproduces plain greedy decoding."""
    d = EagleDrafter.for_target(target, dtype=torch.bfloat16)
    assert next(d.parameters()).dtype == torch.bfloat16
    eng = SpeculativeEngine(target, d, Strategy(3, 2, 6), max_batch_size=8, max_seq_len=64)
    out = eng.generate(prompts, MAX_NEW)
    ref = reference_generate(target, prompts, max(MAX_NEW))
    for b, n in enumerate(MAX_NEW):
        assert out.tokens[b] == ref.tokens[b, :n].tolist(), f"request {b}"
    assert out.mean_accepted_length() > 1.0


@pytest.mark.parametrize("fuse", [False, True])
def test_measure_cost_table_times_every_strategy_and_size(target, prompts, fuse):
    """The start-up cost table replays each strategy's graphs at every captured size; a selector built from it
    drives the engine, whose greedy output is still plain decoding."""
    from tlt_kernels.runtime import GraphPool
    from tlt_kernels.runtime.graph_pool import FakeGraphBackend
    from tlt_kernels.runtime.policies import CostTable

    arms = [Strategy(2, 1, 3), Strategy(3, 2, 6)]
    pool = GraphPool(backend=FakeGraphBackend(lambda key: 0), warmup_iters=1)
    eng = SpeculativeEngine(target, EagleDrafter.for_target(target), StrategySelector(arms, seed=0), pool,
                            max_batch_size=8, max_seq_len=64, fuse_step=fuse)
    with pytest.raises(ValueError, match="capture_graphs"):
        eng.measure_cost_table()
    eng.capture_graphs([2, 8])
    hits = pool.stats()["hits"]
    table = eng.measure_cost_table(repeats=3)
    assert isinstance(table, CostTable) and pool.stats()["hits"] == hits  # timing replays are not hits
    for s in eng.strategies:
        assert [b for b in table.table[s][0]] == [2, 8]
        assert all(t > 0 for t in table.table[s][1])
    eng.selector = StrategySelector(arms, seed=0, cost_table=table, available=eng.covers)
    out = eng.generate(prompts, MAX_NEW)
    ref = reference_generate(target, prompts, max(MAX_NEW))
    for b, n in enumerate(MAX_NEW):
        assert out.tokens[b] == ref.tokens[b, :n].tolist()


def test_trace_probes_every_arm_without_changing_the_output(target, prompts, tmp_path):
    """generate(trace=...) records every arm's counterfactual outcome per step (the format the simulator
    replays) and still emits plain decoding's tokens; the trace round-trips through JSON and replays."""
    import json

    from tlt_kernels.runtime.simulate import load_trace, replay_selector

    arms = [Strategy(2, 1, 3), Strategy(3, 2, 6)]
    eng = SpeculativeEngine(target, EagleDrafter.for_target(target), StrategySelector(arms, seed=0), max_batch_size=8,
                            max_seq_len=64)
    trace = []
    out = eng.generate(prompts, MAX_NEW, trace=trace)
    ref = reference_generate(target, prompts, max(MAX_NEW))
    for b, n in enumerate(MAX_NEW):
        assert out.tokens[b] == ref.tokens[b, :n].tolist()
    assert len(trace) == len(out.steps)
    for rec, st in zip(trace, out.steps):
        assert rec["batch_size"] == st.batch_size
        assert set(rec["arms"]) == {"off", "s2k1v3", "s3k2v6"}
        assert rec["arms"]["off"]["emitted"] == st.batch_size  # plain decoding emits one token per request
        for name, r in rec["arms"].items():
            acc = r["accepted"]
            assert r["step_time"] > 0
            assert all(a >= b_ for a, b_ in zip(acc, acc[1:]))  # reaching depth j+1 implies depth j
            assert r["emitted"] == st.batch_size + sum(acc)
            # The lagging rows (most tokens left): what the engine's selector learns from.
            lagging, lagging_acc = r["lagging_rows"], r["lagging_accepted"]
            assert 1 <= lagging <= st.batch_size and len(lagging_acc) == len(acc)
            assert all(lagging >= a <= total for a, total in zip(lagging_acc, acc))
    budgets = sorted(MAX_NEW, reverse=True)
    assert trace[0]["arms"]["off"]["lagging_rows"] == budgets.count(budgets[0])  # the longest budgets lag first
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace))
    res = replay_selector(load_trace(str(path)), StrategySelector(arms, seed=0))
    assert 0 < res.oracle_fraction <= 1.0


def test_trace_records_only_the_requests_still_running(target, prompts):
    """Requests that ended at their first token (EOS) are in no trace record: the records' batch sizes are the
    steps'."""
    arms = [Strategy(2, 1, 3), Strategy(3, 2, 6)]
    eng = SpeculativeEngine(target, "ngram", StrategySelector(arms, seed=0), max_batch_size=8, max_seq_len=64)
    sampling = dict(temperature=1.0, seed=list(range(len(MAX_NEW))))
    eos = eng.generate(prompts, MAX_NEW, **sampling).tokens[1][0]
    trace = []
    out = eng.generate(prompts, MAX_NEW, eos_token_id=eos, trace=trace, **sampling)
    assert [t[0] for t in out.tokens].count(eos) >= 1 and out.steps[0].batch_size < sum(n > 1 for n in MAX_NEW)
    assert [rec["batch_size"] for rec in trace] == [st.batch_size for st in out.steps]


class _FailingOnceBackend:
    """A fake graph backend whose ``fail_at``-th capture raises, as an invalidated CUDA capture does."""

    def __init__(self, fail_at: int = 2, times: int = 1):
        from tlt_kernels.runtime.graph_pool import FakeGraphBackend

        self._inner = FakeGraphBackend(lambda key: 0)
        self.fail_at, self.times, self.calls, self.renewed_at = fail_at, times, 0, []

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def renew_pool(self):
        self.renewed_at.append(self.calls)

    def capture(self, fn):
        self.calls += 1
        if self.fail_at <= self.calls < self.fail_at + self.times:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
        return self._inner.capture(fn)


@pytest.mark.parametrize("times", [1, 2])
def test_failed_capture_is_retried_once(target, prompts, times):
    """One failed capture is retried and every graph ends up captured (greedy output unchanged, every step from
    a graph); a second failure falls back to eager verification with the error recorded."""
    from tlt_kernels.runtime import GraphPool

    backend = _FailingOnceBackend(fail_at=2, times=times)
    pool = GraphPool(backend=backend, warmup_iters=1)
    sel = StrategySelector([Strategy(2, 1, 3), Strategy(3, 2, 6)], seed=0)
    eng = SpeculativeEngine(target, EagleDrafter.for_target(target), sel, pool, max_batch_size=8, max_seq_len=64,
                            fuse_step=True)
    stats = eng.capture_graphs([2, 8])
    assert eng.graph_retry_error is not None and "previous error during capture" in eng.graph_retry_error
    assert backend.renewed_at == [2]  # the retry captures into a fresh pool, once, after the failed capture
    out = eng.generate(prompts, MAX_NEW)
    ref = reference_generate(target, prompts, max(MAX_NEW))
    for b, n in enumerate(MAX_NEW):
        assert out.tokens[b] == ref.tokens[b, :n].tolist(), f"request {b}"
    if times == 1:
        assert eng.graph_error is None
        assert stats["graphs"] == len(pool.keys())
        assert all(s.graph for s in out.steps)
    else:
        assert eng.graph_error is not None and "previous error during capture" in eng.graph_error
        assert stats == {"error": eng.graph_error}
        assert not any(s.graph for s in out.steps)


@pytest.mark.parametrize("kind", ["ngram", "eagle"])
def test_separate_runner_plain_steps_replay_one_step_graph(target, prompts, kind):
    """fuse_step=False: a plain ("off") step of a drafting engine replays the whole-step graph a plain engine
    replays (verify, accept, compaction in one graph), so the adaptive engine's "off" arm costs what plain decoding
    costs; the drafter still sees every accepted token (drafting steps after plain ones equal plain decoding)."""
    from tlt_kernels.runtime import GraphPool
    from tlt_kernels.runtime.graph_pool import FakeGraphBackend

    pool = GraphPool(backend=FakeGraphBackend(lambda key: 0), warmup_iters=1)
    off, chain = Strategy.off(), Strategy(2, 1, 3)
    eng = SpeculativeEngine(target, _drafter(kind, target), StrategySelector([chain], seed=0), pool, max_batch_size=8,
                            max_seq_len=64)
    eng.capture_graphs([2, 8])
    assert eng.graph_error is None, eng.graph_error
    step_key = ("step", off.num_steps, off.topk, off.num_verify)
    assert step_key in {k[0] for k in pool.keys()} and ("verify", 1) in {k[0] for k in pool.keys()}
    assert eng.step_runner.graph_names(off) == [step_key] and eng.covers(off, 5)

    def arms(batch_size):  # alternate plain and drafting steps: the drafter's state must follow both
        arms.calls += 1
        return off if arms.calls % 2 else chain
    arms.calls = 0
    eng.selector.select = arms
    plain_runs = []
    run_plain = eng.step_runner.plain.run
    eng.step_runner.plain.run = lambda *a: plain_runs.append(1) or run_plain(*a)
    out = eng.generate(prompts, MAX_NEW)
    ref = reference_generate(target, prompts, max(MAX_NEW))
    for b, n in enumerate(MAX_NEW):
        assert out.tokens[b] == ref.tokens[b, :n].tolist(), f"request {b}"
    plain_steps = [s for s in out.steps if s.strategy == "off"]
    assert plain_steps and all(s.graph and s.tree_width == 1 for s in plain_steps)
    # (and one more when the overlapped step launched after the last request finished was a plain one)
    assert len(plain_runs) in (len(plain_steps), len(plain_steps) + 1)
    assert any(s.strategy != "off" for s in out.steps)
