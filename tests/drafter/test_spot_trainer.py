"""SpotTrainer: learns a deterministic target, stops promptly with loadable weights, checkpoints,
publishes versions; RolloutBuffer bounds and recency; DrafterQuality."""
import threading
import time

import pytest
import torch
from torch import nn

from tlt_kernels.drafter import (
    DrafterQuality,
    EagleDrafter,
    RolloutBuffer,
    SpotTrainer,
    WeightsHolder,
    evaluate_acceptance,
)
from tlt_kernels.models.config import ModelConfig


pytestmark = pytest.mark.usefixtures("one_thread")


class PermutationTarget(nn.Module):
    """Deterministic target: the next token is ``perm[token]``.

    Its feature at a position is a scaled copy of the LM-head row of the next token, so
    ``argmax lm_head(norm(feature)) == perm[token]`` exactly (checked in the constructor).
    """

    def __init__(self, vocab=32, hidden=64, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.config = ModelConfig.tiny(vocab_size=vocab, hidden_size=hidden, intermediate_size=128)
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.norm = nn.RMSNorm(hidden, eps=1e-6)
        with torch.no_grad():
            self.embed_tokens.weight.normal_(generator=g)
            self.lm_head.weight.normal_(generator=g)
        # A buffer, so .to(device) moves it with the weights (the NCCL test runs this on cuda:rank).
        self.register_buffer("perm", torch.randperm(vocab, generator=g))
        feats = self.lm_head(self.norm(3.0 * self.lm_head.weight[self.perm])).argmax(-1)
        assert torch.equal(feats, self.perm)

    @torch.no_grad()
    def rollout(self, first: torch.Tensor, length: int):
        toks = [first]
        for _ in range(length - 1):
            toks.append(self.perm[toks[-1]])
        toks = torch.stack(toks, 1)
        return toks, 3.0 * self.lm_head.weight[self.perm[toks]]


def _setup(seed=0, init_seed=None, **kw):
    tgt = PermutationTarget(seed=seed)
    torch.manual_seed(seed if init_seed is None else init_seed)
    d = EagleDrafter.for_target(tgt, intermediate_size=64)
    buf = RolloutBuffer(capacity_tokens=4096)
    toks, feats = tgt.rollout(torch.arange(16) % 32, 24)
    buf.add(feats, toks, step=0)
    args = dict(lr=3e-3, warmup_steps=5, batch_size=8, seq_len=16, seed=seed)
    args.update(kw)
    return tgt, d, buf, SpotTrainer(d, buf, **args)


def test_trained_drafter_reaches_high_acceptance():
    tgt, d, buf, tr = _setup()
    toks, feats = tgt.rollout(torch.arange(4) * 7 % 32, 20)
    before = evaluate_acceptance(d, feats, toks, depth=4, topk=2, num_verify=8, num_starts=4)
    stats = tr.run(max_steps=150)
    assert stats.stopped_by == "max_steps" and stats.optimizer_steps == 150
    after = evaluate_acceptance(d, feats, toks, depth=4, topk=2, num_verify=8, num_starts=4)
    assert before < 2.0
    assert after >= 4.5, (before, after)  # at most 5 = depth + 1
    assert tr.history[-1][1] < tr.history[0][1] if len(tr.history) > 1 else True


def test_stop_event_returns_within_one_micro_step_with_loadable_weights(tmp_path):
    tgt, d, buf, tr = _setup(grad_accum=3)
    tr.run(max_steps=2)
    stop = threading.Event()
    t_set = []

    def trigger():
        time.sleep(0.3)
        t_set.append(time.perf_counter())
        stop.set()

    th = threading.Thread(target=trigger)
    # Measure one micro-step to bound the stop latency.
    t0 = time.perf_counter()
    tr.micro_step()
    one = time.perf_counter() - t0
    tr.discard_partial()
    th.start()
    stats = tr.run(stop=stop)
    t_ret = time.perf_counter()
    th.join()
    assert stats.stopped_by == "stop"
    assert t_ret - t_set[0] < 3 * one + 0.2
    assert tr._accum == 0 and all(p.grad is None for p in d.parameters())
    # Weights are finite and reload into a fresh drafter; the published version matches.
    w = tr.holder.latest()
    assert w is not None and w.version == d.weights_version
    assert all(torch.isfinite(v).all() for v in w.state_dict.values())
    fresh = EagleDrafter.for_target(tgt, intermediate_size=64)
    assert fresh.maybe_update(tr.holder) and fresh.weights_version == w.version
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, d.state_dict()[k])


def test_time_budget_and_empty_buffer():
    tgt, d, buf, tr = _setup()
    t0 = time.perf_counter()
    stats = tr.run(time_budget_s=0.5)
    assert stats.stopped_by == "time_budget" and time.perf_counter() - t0 < 2.0
    assert stats.tokens_per_s > 0
    empty = SpotTrainer(d, RolloutBuffer(100))
    assert empty.run(max_steps=3).stopped_by == "empty_buffer"


def test_checkpoint_resume_is_exact(tmp_path):
    _, d1, _, tr1 = _setup(seed=3)
    tr1.run(max_steps=4)
    path = str(tmp_path / "ckpt.pt")
    tr1.save_checkpoint(path)
    tr1.run(max_steps=3)
    _, d2, _, tr2 = _setup(seed=3, init_seed=99)
    tr2.load_checkpoint(path)
    assert tr2.optimizer_steps == 4 and tr2.holder.version == 1
    tr2.run(max_steps=3)
    for k, v in d1.state_dict().items():
        torch.testing.assert_close(d2.state_dict()[k], v, atol=0, rtol=0)
    assert tr2.holder.version == tr1.holder.version == 2


def test_published_weights_are_snapshots():
    tgt, d, buf, tr = _setup()
    tr.run(max_steps=1)
    w1 = tr.holder.latest()
    rollout = EagleDrafter.for_target(tgt, intermediate_size=64)
    rollout.maybe_update(tr.holder)
    before = {k: v.clone() for k, v in rollout.state_dict().items()}
    tr.run(max_steps=2, publish=False)
    assert not rollout.maybe_update(tr.holder)
    assert all(torch.equal(before[k], v) for k, v in rollout.state_dict().items())
    assert all(torch.equal(w1.state_dict[k], before[k]) for k in before)
    with pytest.raises(ValueError, match="version must increase"):
        tr.holder.publish(d.state_dict(), version=1)


def test_nonfinite_weights_are_not_published(monkeypatch):
    """A NaN loss that reaches the weights is reported and never published: the rollout keeps its last version."""
    from tlt_kernels.drafter import spot_trainer

    tgt, d, buf, tr = _setup()
    assert tr.run(max_steps=1).published_version == 1
    real = spot_trainer.eagle_loss
    monkeypatch.setattr(spot_trainer, "eagle_loss", lambda *a, **k: (lambda l, st: (l * float("nan"), st))(*real(*a, **k)))
    with pytest.warns(RuntimeWarning, match="no longer finite"):
        stats = tr.run(max_steps=1)
    assert stats.nonfinite_weights and stats.published_version is None and tr.holder.version == 1
    assert all(torch.isfinite(v).all() for v in tr.holder.latest().state_dict.values())


def test_buffer_bounds_and_recency():
    buf = RolloutBuffer(capacity_tokens=100, recency_decay=0.1)
    for step in range(5):
        buf.add(torch.full((2, 20, 4), float(step)), torch.full((2, 20), step), step=step)
    assert buf.num_tokens <= 100
    assert buf.steps().min() >= 2  # the oldest steps were evicted
    batch = buf.sample(200, 8, torch.Generator().manual_seed(0))
    frac_new = (batch.steps == 4).float().mean()
    assert frac_new > 0.8  # weights 1 : 0.1 : 0.01 for steps 4, 3, 2
    assert batch.features.shape == (200, 9, 4) and batch.valid.all()
    # Windows come from a single entry: features equal the entry's step everywhere.
    assert torch.equal(batch.features[:, :, 0], batch.steps.float().unsqueeze(1).expand(200, 9))
    short = RolloutBuffer(100)
    short.add(torch.randn(5, 4), torch.arange(5), step=0)
    b = short.sample(2, 8)
    assert b.valid.sum(1).tolist() == [4, 4] and torch.equal(b.positions[0], torch.arange(9))
    with pytest.raises(ValueError, match="features must be"):
        short.add(torch.randn(5, 4), torch.arange(4), step=1)


def test_quality_tracker():
    q = DrafterQuality(ema=0.5, weak_below=1.5)
    assert q.is_weak
    q.record(torch.tensor([1.0, 1.0]), version=1)
    assert q.is_weak
    q.record([3.0, 3.0], version=2)
    assert q.value == pytest.approx(2.0) and not q.is_weak
    assert q.by_version == {1: 1.0, 2: 3.0}


def test_normalized_hidden_loss_trains_and_tracks_the_feature_spread():
    """normalize_hidden: the regression runs in units of each dimension's spread (a real model's last-layer
    features hold a few huge dimensions); the drafter still learns the target, the scale starts at the first batch's
    per-dimension std, and a batch without two valid pairs leaves it unchanged."""
    from tlt_kernels.drafter.buffer import TrainBatch
    from tlt_kernels.drafter.spot_trainer import eagle_loss

    tgt, d, buf, tr = _setup(normalize_hidden=True, feature_noise=0.05)
    toks, feats = tgt.rollout(torch.arange(4) * 7 % 32, 20)
    stats = tr.run(max_steps=150)
    assert stats.optimizer_steps == 150 and tr.feature_scale is not None and tr.feature_scale.shape == (64,)
    assert evaluate_acceptance(d, feats, toks, depth=4, topk=2, num_verify=8, num_starts=4) >= 4.5

    g = torch.Generator().manual_seed(0)
    features = torch.randn(2, 5, 64, generator=g) * torch.linspace(0.1, 100.0, 64)
    valid = torch.tensor([[True, True, False, True], [False, True, True, False]])
    batch = TrainBatch(features, torch.zeros(2, 5, dtype=torch.int64), torch.arange(5).expand(2, 5), valid,
                       torch.zeros(2, dtype=torch.int64))
    tr.feature_scale = None
    tr._update_feature_scale(batch)
    torch.testing.assert_close(tr.feature_scale, features[:, 1:][valid].std(0, unbiased=False).clamp(min=1e-3))
    before = tr.feature_scale.clone()
    tr._update_feature_scale(TrainBatch(features, batch.tokens, batch.positions, torch.zeros_like(valid),
                                        batch.steps))
    assert torch.equal(tr.feature_scale, before)
    plain, _ = eagle_loss(d, batch)
    ones, _ = eagle_loss(d, batch, feature_scale=torch.ones(64))
    torch.testing.assert_close(plain, ones)


def test_unrolled_loss_is_the_mean_over_depths_and_trains_deep_drafts():
    """unroll_steps = n: the loss is the mean of the per-depth losses of forward_unrolled, each masking the pairs
    before its depth (depth 1 alone is the teacher-forced loss, bit for bit); a trainer with it learns the target
    as well as the teacher-forced one; fewer than one step is refused, naming the argument."""
    from tlt_kernels.drafter.spot_trainer import _depth_losses, eagle_loss

    tgt, d, buf, tr = _setup(unroll_steps=3)
    batch = buf.sample(3, 12, torch.Generator().manual_seed(1))
    one, stats_one = eagle_loss(d, batch, token_weight=0.5)
    three, stats = eagle_loss(d, batch, token_weight=0.5, unroll_steps=3)
    torch.testing.assert_close(stats["hidden_loss"], stats_one["hidden_loss"])
    preds = d.forward_unrolled(batch.features[:, :-1], batch.tokens[:, 1:], batch.positions[:, :-1], steps=3)
    tgt_f = batch.features[:, 1:]
    p_tgt = torch.softmax(d.head_logits(tgt_f).float(), -1)
    want = 0.0
    for depth, pred in enumerate(preds):
        m = batch.valid.float()
        m[:, :depth] = 0
        h, t, top1 = _depth_losses(d, pred, tgt_f, p_tgt, m, None)
        want = want + (h + 0.5 * t) / 3
    torch.testing.assert_close(three, want)
    torch.testing.assert_close(stats["top1_deepest"], top1)
    toks, feats = tgt.rollout(torch.arange(4) * 7 % 32, 20)
    assert tr.run(max_steps=150).optimizer_steps == 150
    assert evaluate_acceptance(d, feats, toks, depth=4, topk=2, num_verify=8, num_starts=4) >= 4.5
    with pytest.raises(ValueError, match="unroll_steps"):
        SpotTrainer(d, buf, unroll_steps=0)


def _tensors(drafter):
    """Data pointers of a drafter's own weights and of its copies of the target's (embedding, head, norm)."""
    shared = [t for module in drafter._shared for t in module.state_dict().values()]
    return {t.data_ptr() for t in list(drafter.state_dict().values()) + shared}


@pytest.mark.parametrize("tied", [False, True])
def test_a_replica_trains_apart_and_takes_the_targets_new_head(tied):
    """EagleDrafter.replica (what a spot trainer on another GPU trains): no tensor shared with the drafter or the
    target, the same drafts; its training reaches the serving drafter only through the holder; copy_shared_from
    brings the target's changed head (an RL policy update) into its frozen copies."""
    tgt, d, buf, _ = _setup()
    if tied:
        tgt.lm_head.weight = tgt.embed_tokens.weight
    twin = d.replica("cpu")
    assert not _tensors(twin) & (_tensors(d) | {t.data_ptr() for t in tgt.state_dict().values()})
    assert (twin._shared[0].weight is twin._shared[1].weight) == tied
    assert all(not p.requires_grad for module in twin._shared for p in module.parameters())
    feature = torch.randn(3, 64)
    torch.testing.assert_close(twin.head_logits(feature), d.head_logits(feature), rtol=0, atol=0)
    serving = {k: v.clone() for k, v in d.state_dict().items()}
    head = {k: v.clone() for k, v in tgt.state_dict().items()}
    trainer = SpotTrainer(twin, buf, holder=WeightsHolder(), lr=3e-3, warmup_steps=1, batch_size=4, seq_len=8)
    trainer.run(max_steps=3)
    assert all(torch.equal(serving[k], v) for k, v in d.state_dict().items())  # untouched until it loads
    assert all(torch.equal(head[k], v) for k, v in tgt.state_dict().items())  # the target never trains here
    assert d.maybe_update(trainer.holder)
    assert all(torch.equal(twin.state_dict()[k], v) for k, v in d.state_dict().items())
    with torch.no_grad():
        tgt.lm_head.weight.add_(1.0)
        tgt.norm.weight.mul_(2.0)
    assert not torch.equal(twin.head_logits(feature), d.head_logits(feature))
    twin.copy_shared_from(d)
    torch.testing.assert_close(twin.head_logits(feature), d.head_logits(feature), rtol=0, atol=0)


def test_copy_shared_from_a_drafter_of_another_shape_is_refused():
    tgt, d, _, _ = _setup()
    other = EagleDrafter.for_target(tgt, intermediate_size=64, final_norm=nn.LayerNorm(64))
    with pytest.raises(ValueError, match="copy_shared_from"):
        d.replica("cpu").copy_shared_from(other)


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second CUDA GPU")
def test_gpu_run_makes_the_drafters_device_current(monkeypatch):
    """A trainer on cuda:1 run from a thread whose current device is cuda:0 launches its micro-steps with cuda:1
    current (Triton launches on the current device), and the caller's device is current again after."""
    _, drafter, buffer, _ = _setup()
    trainer = SpotTrainer(drafter.replica("cuda:1"), buffer, lr=3e-3, warmup_steps=5, batch_size=8, seq_len=16)
    seen, real = [], SpotTrainer.micro_step
    monkeypatch.setattr(SpotTrainer, "micro_step", lambda self: (seen.append(torch.cuda.current_device()),
                                                                 real(self))[1])
    torch.cuda.set_device(0)
    stats = trainer.run(max_steps=2)
    assert stats.optimizer_steps == 2 and set(seen) == {1} and torch.cuda.current_device() == 0


@pytest.mark.parametrize("unroll_steps", [1, 2])
def test_warm_up_changes_nothing_the_training_sees(unroll_steps):
    """warm_up runs the loss forward and backward once and leaves weights, gradients, optimizer, counters and the
    sampling generator as they were: training after it equals training without it."""
    _, _, _, plain = _setup(unroll_steps=unroll_steps, feature_noise=0.1)
    _, _, _, warmed = _setup(unroll_steps=unroll_steps, feature_noise=0.1)
    before = {k: v.clone() for k, v in warmed.drafter.state_dict().items()}
    warmed.warm_up()
    assert all(torch.equal(v, before[k]) for k, v in warmed.drafter.state_dict().items())
    assert all(p.grad is None for p in warmed.params) and not warmed.optimizer.state
    assert (warmed.micro_steps, warmed.optimizer_steps, warmed.tokens_seen) == (0, 0, 0)
    plain.run(max_steps=3)
    warmed.run(max_steps=3)
    for name, value in plain.drafter.state_dict().items():
        assert torch.equal(warmed.drafter.state_dict()[name], value), name


def test_warm_up_refuses_a_partial_accumulation():
    _, _, _, trainer = _setup(grad_accum=2)
    trainer.micro_step()
    with pytest.raises(RuntimeError, match="gradient-accumulation"):
        trainer.warm_up()
