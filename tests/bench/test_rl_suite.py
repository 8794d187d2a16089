"""The RL suite (``python -m bench rl``) and its parts: the task, GRPO's arithmetic, the tiny CPU run."""
import json

import pytest
import torch

from bench.__main__ import main
from bench.grpo import (common_prefix_diffs, group_advantages, grpo_loss, permutation_pvalue,
                        response_logprobs)
from bench.rl_task import problems, reward


def test_problems_are_reproducible_and_their_answers_hold():
    a, b = problems(50, seed=3), problems(50, seed=3)
    assert a == b and problems(50, seed=4) != a
    for problem in a:
        assert problem.answer >= 0 and "?" in problem.question
        assert reward(f"So the answer is {problem.answer}.", problem.answer) == 1.0
    assert reward("It is 1,234 in all", 1234) == 1.0
    assert reward("first 5, then 7", 5) == 0.0  # the last integer counts
    assert reward("no number", 3) == 0.0


def test_group_advantages_are_normalized_per_group():
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0]), group_size=3)
    assert torch.allclose(adv[:3], torch.tensor([2 ** 0.5, -(2 ** -0.5), -(2 ** -0.5)]), atol=1e-3)
    assert torch.equal(adv[3:], torch.zeros(3))  # a group with one reward carries no signal


def test_grpo_loss_raises_the_logprob_of_rewarded_responses():
    """On policy (ratio 1) the loss's gradient pushes a positive-advantage response's log-probs up and a negative
    one's down; the clip stops the push once the ratio leaves [1 - eps, 1 + eps]."""
    logp = torch.tensor([[-1.0, -2.0], [-1.5, -0.5]], requires_grad=True)
    mask = torch.tensor([[True, True], [True, False]])
    loss = grpo_loss(logp, logp.detach(), mask, torch.tensor([1.0, -1.0]))
    loss.backward()
    assert (logp.grad[0] < 0).all() and logp.grad[1, 0] > 0 and logp.grad[1, 1] == 0
    far = logp.detach() + 1.0  # ratio e > 1 + eps with a positive advantage: clipped, no gradient
    far.requires_grad_(True)
    grpo_loss(far, logp.detach(), mask, torch.tensor([1.0, 1.0])).backward()
    assert torch.equal(far.grad, torch.zeros_like(far.grad))


def test_response_logprobs_equal_log_softmax_at_the_response_tokens():
    torch.manual_seed(0)
    table = torch.randn(20, 11)
    logits_fn = lambda t: table[t]  # noqa: E731  (logits depend on the token at each position)
    prompts, responses = [[1, 2, 3], [4]], [[5, 6], [7, 8, 9]]
    logp, mask = response_logprobs(logits_fn, "cpu", prompts, responses)
    assert mask.tolist() == [[True, True, False], [True, True, True]]
    want = torch.log_softmax(table, 1)
    assert torch.allclose(logp[0, :2], torch.stack([want[3, 5], want[5, 6]]))
    assert torch.allclose(logp[1], torch.stack([want[4, 7], want[7, 8], want[8, 9]]))


def test_permutation_test_and_common_prefix():
    assert permutation_pvalue([1.0] * 30, [0.0] * 30) < 0.01
    assert permutation_pvalue([1.0, 0.0] * 20, [0.0, 1.0] * 20) > 0.5
    # Each pair's common prefix only: request 0 shares tokens 1, 2; request 1 shares nothing.
    assert common_prefix_diffs([[1, 2, 3], [5]], [[-0.1, -0.2, -0.3], [-1.0]], [[1, 2, 4], [6]],
                               [[-0.1, -0.25, -9.0], [-2.0]]) == pytest.approx([0.0, 0.05])


def test_small_run_writes_every_way_and_the_lossless_notes(tmp_path):
    assert main(["rl", "--small", "--device", "cpu", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "rl.json").read_text())
    rows = data["rows"]
    assert {r["impl"] for r in rows} == {"spec", "spec-ngram", "spec-self", "spec-eagle", "spec-eagle-frozen", "plain",
                                         "hf"}
    per_step = [r for r in rows if r["case"]["step"] != "all"]
    assert len(per_step) == 7 * 2 and all(r["tokens"] > 0 and r["ms"] > 0 for r in per_step)
    assert all(r["tail_s"] is not None for r in per_step if r["impl"] != "hf")
    notes = " ".join(data["notes"])
    assert "permutation test" in notes and "median difference" in notes and "(float32 logits)" in notes
    assert "spec: decoding steps per strategy" in notes and "hf: decoding steps" not in notes
    # Each engine way says how many steps its tails took and how long; the spot-trained way what its trainer did.
    tails = {n.split(":")[0]: n for n in data["notes"] if "decoding steps per strategy" in n}
    assert all("tail: " in note for note in tails.values()), tails
    assert "spot trainer: " in tails["spec-eagle"] and "spot trainer" not in tails["spec-eagle-frozen"]
    assert "spot trainer" not in tails["plain"]
    # Each strategy's steps come with their mean time and tokens per request per step: plain decoding emits one.
    plain_arm = tails["plain"].split("timed rollouts: ")[1]
    assert plain_arm.startswith("off ") and " ms, 1.00 tokens)" in plain_arm, plain_arm
    diff = float(notes.split(", largest ")[1].split()[0])
    assert diff < 1e-4  # fp32 on the CPU: the two engines score shared tokens alike


def test_plot_series_reads_the_per_step_rows(tmp_path):
    from bench.plot_rl import series

    assert main(["rl", "--small", "--device", "cpu", "--out", str(tmp_path), "--ways", "plain,hf"]) == 0
    points = series(json.loads((tmp_path / "rl.json").read_text()))
    assert set(points) == {"plain", "hf"}
    assert [p[0] for p in points["plain"]] == [0, 1] and all(p[2] > 0 for p in points["hf"])


def test_the_rollouts_log_probs_are_the_losss_at_any_temperature():
    """On policy the GRPO ratio must be 1: the engine's rollout log-probs (under the sampling law) equal the loss's
    forward over logits / temperature at the same tokens, at a temperature other than 1."""
    from bench.suites.rollout import tiny_hf_model
    from tlt_kernels.engine import SpeculativeEngine
    from tlt_kernels.models import LlamaForCausalLM

    hf = tiny_hf_model()
    model = LlamaForCausalLM.from_hf(hf.config, hf.state_dict(), dtype=torch.float32)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    out = SpeculativeEngine(model, "ngram", None, max_batch_size=2, max_seq_len=32, logprobs=True).generate(
        prompts, 8, temperature=0.7, seed=[1, 2])
    logp, mask = response_logprobs(lambda t: model(t, validate=False)[0] / 0.7, "cpu", prompts, out.tokens)
    for b in range(2):
        assert torch.allclose(logp[b][mask[b]], torch.tensor(out.logprobs[b]), atol=1e-4)


def test_the_temperature_must_be_positive(tmp_path):
    assert main(["rl", "--small", "--device", "cpu", "--out", str(tmp_path), "--temperature", "0"]) == 1


def test_tail_steps_are_the_steps_with_fewer_than_a_quarter_of_the_requests():
    from tlt_kernels.engine.records import StepLog, tail_steps

    steps = [StepLog(i, batch, "off", 1, batch, 1.0, seconds, 0.0, True)
             for i, (batch, seconds) in enumerate([(16, 1.0), (4, 2.0), (3, 4.0), (1, 8.0)])]
    assert sum(step.seconds for step in tail_steps(steps, 16)) == 12.0  # 3 and 1 are fewer than 16 / 4; 4 is not
    assert sum(step.seconds for step in tail_steps(steps, 4)) == 0.0


def test_tail_note_gives_the_tails_steps_and_the_trainers_work():
    from collections import Counter
    from types import SimpleNamespace

    from bench.suites.rl import tail_note

    way = SimpleNamespace(name="spec-eagle", tail_steps=4, rows=[{"tail_s": 0.004}, {"tail_s": 0.006}],
                          spot=Counter(micro_steps=7, optimizer_steps=3, seconds=0.5))
    assert tail_note(way) == "tail: 4 steps, 2.500 ms each; spot trainer: 7 micro-steps, 3 optimizer steps, 0.50 s"
    assert tail_note(SimpleNamespace(name="spec", tail_steps=0, rows=[{"tail_s": 0.0}], spot=Counter())) == (
        "tail: 0 steps; spot trainer: did not run")
    plain = SimpleNamespace(name="plain", tail_steps=2, rows=[{"tail_s": 0.004}], spot=Counter())
    assert tail_note(plain) == "tail: 2 steps, 2.000 ms each"


def _saved_eagle(tmp_path):
    """``(state dict, path)`` of a seeded EAGLE drafter for the small suite's tiny target, saved under ``tmp_path``."""
    from bench.suites.rollout import tiny_hf_model
    from tlt_kernels.drafter import EagleDrafter
    from tlt_kernels.models import LlamaForCausalLM

    hf = tiny_hf_model()
    target = LlamaForCausalLM.from_hf(hf.config, hf.state_dict(), dtype=torch.float32)
    saved = EagleDrafter.for_target(target, seed=7).state_dict()
    path = tmp_path / "eagle.pt"
    torch.save(saved, path)
    return saved, path


def _record_engines(monkeypatch) -> list:
    """A list that receives every SpeculativeEngine the suite builds from now on (after its own __init__)."""
    from tlt_kernels.engine import SpeculativeEngine

    engines = []
    real_init = SpeculativeEngine.__init__

    def recording_init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        engines.append(self)

    monkeypatch.setattr(SpeculativeEngine, "__init__", recording_init)
    return engines


def test_the_eagle_ways_start_from_the_given_checkpoint(tmp_path, monkeypatch):
    """--eagle-checkpoint: the serving drafter and the spot trainer's copy both load it (two loads per way)."""
    import bench.suites.rl as rl

    saved, path = _saved_eagle(tmp_path)
    loaded = []

    def recording_load(*args):  # what each load returns, checked before training can move it
        drafter = load_eagle(*args)
        assert all(torch.equal(drafter.state_dict()[k].cpu(), v) for k, v in saved.items())
        loaded.append(drafter)
        return drafter

    load_eagle = rl.load_eagle
    monkeypatch.setattr(rl, "load_eagle", recording_load)
    argv = ["rl", "--small", "--device", "cpu", "--out", str(tmp_path), "--ways", "spec-eagle",
            "--eagle-checkpoint", str(path)]
    assert main(argv) == 0
    assert len(loaded) == 2 and loaded[0] is not loaded[1]  # the serving drafter and the trainer's own copy


def test_frozen_eagle_way_serves_the_checkpoint_without_a_spot_trainer(tmp_path, monkeypatch):
    """spec-eagle-frozen loads --eagle-checkpoint once, serves it, and its engine has no spot trainer, so its drafter's
    weights at the end are the checkpoint's."""
    saved, path = _saved_eagle(tmp_path)
    engines = _record_engines(monkeypatch)
    argv = ["rl", "--small", "--device", "cpu", "--out", str(tmp_path), "--ways", "spec-eagle-frozen",
            "--eagle-checkpoint", str(path)]
    assert main(argv) == 0
    assert len(engines) == 1 and engines[0].spot_trainer is None
    served = engines[0].drafter.state_dict()
    assert all(torch.equal(served[k].cpu(), v) for k, v in saved.items())


def test_spot_flags_reach_the_trainer_and_the_engine(tmp_path, monkeypatch):
    """--spot-unroll-steps sets the spot trainer's unroll_steps, --spot-batch-fraction the engine's
    spot_batch_fraction, --spot-switch-interval its spot_switch_interval_s, --spot-overlap-steps its
    spot_overlap_steps (defaults 1, 0.25, 2e-4 and off); a fraction
    outside (0, 1] and an interval that is not a finite number > 0 are usage errors."""
    from bench.flags import parse
    from bench.suites.rl import FLAGS

    engines = _record_engines(monkeypatch)
    base = ["rl", "--small", "--device", "cpu", "--out", str(tmp_path), "--ways", "spec-eagle"]
    assert main(base) == 0
    assert main(base + ["--spot-unroll-steps", "2", "--spot-batch-fraction", "0.5", "--spot-switch-interval",
                        "2e-5", "--spot-overlap-steps"]) == 0
    got = [(e.spot_trainer.unroll_steps, e.spot_batch_fraction, e.spot_switch_interval_s, e.spot_overlap_steps)
           for e in engines]
    assert got == [(1, 0.25, 2e-4, False), (2, 0.5, 2e-5, True)]
    for bad in ("0", "1.5", "x"):
        with pytest.raises(SystemExit):
            parse(FLAGS, ["--spot-batch-fraction", bad])
    for bad in ("0", "-1e-4", "inf", "x"):
        with pytest.raises(SystemExit):
            parse(FLAGS, ["--spot-switch-interval", bad])


def test_prefill_lengths_reach_every_engine_cut_to_its_capacity(tmp_path, monkeypatch):
    """--prefill-lengths sets every way's engine's buckets (default 64 .. 1024), each cut to the engine's capacity;
    '' gives the eager prefill."""
    from bench.flags import PREFILL_LENGTHS_FLAG

    engines = _record_engines(monkeypatch)
    base = ["rl", "--small", "--device", "cpu", "--out", str(tmp_path), "--ways", "plain,spec-ngram"]
    assert main(base) == 0
    assert main(base + ["--prefill-lengths", ""]) == 0
    capacity = engines[0].max_seq_len
    expected = tuple(sorted({min(b, capacity) for b in PREFILL_LENGTHS_FLAG.default}))
    assert capacity < 1024 and expected[-1] == capacity
    assert [e.prefill_graphs.lengths for e in engines] == [expected, expected, (), ()]


def test_spot_device_trains_a_replica_whose_head_follows_the_policy(tmp_path, monkeypatch):
    """--spot-device --no-spot-process: the spot-trained ways' trainer is a thread trainer of a replica of the serving
    drafter (no tensor shared with it or the policy), publishing into a holder on the policy's device; after every
    policy update the replica's copy of the head equals the policy's. A device that does not exist is refused,
    naming the flag."""
    from tlt_kernels.drafter import SpotTrainer

    engines = _record_engines(monkeypatch)
    argv = ["rl", "--small", "--device", "cpu", "--out", str(tmp_path), "--ways", "spec-eagle", "--no-spot-process",
            "--spot-device", "cpu"]
    assert main(argv) == 0
    (engine,) = engines
    trainer, serving = engine.spot_trainer, engine.drafter
    assert isinstance(trainer, SpotTrainer)
    assert trainer.drafter is not serving and trainer.holder.device == torch.device("cpu")
    policy = {t.data_ptr() for t in engine.target.state_dict().values()}
    replica_head = [t for module in trainer.drafter._shared for t in module.state_dict().values()]
    assert not {t.data_ptr() for t in replica_head} & policy
    for mine, theirs in zip(trainer.drafter._shared, serving._shared):  # refreshed after the last update
        for name, value in theirs.state_dict().items():
            assert torch.equal(mine.state_dict()[name], value), name
    for bad in ("gpu:0", "cuda:99"):
        assert main(argv[:-1] + [bad]) != 0


def test_spot_process_trains_in_a_worker_that_ends_with_its_way(tmp_path, monkeypatch):
    """--spot-device (--spot-process by default): the spot-trained way's trainer is a SpotTrainerProcess there, which
    trains in the rollouts' tails, is sent the policy's head after every update, publishes what the serving drafter
    loads, and ends with its way."""
    from tlt_kernels.drafter import SpotTrainerProcess
    from tlt_kernels.engine import SpeculativeEngine

    engines, heads = _record_engines(monkeypatch), []
    real_refresh, real_generate = SpotTrainerProcess.refresh_head, SpeculativeEngine.generate
    monkeypatch.setattr(SpotTrainerProcess, "refresh_head",
                        lambda self, source: (heads.append(source), real_refresh(self, source)))
    # EOS is off in the small run, so every request would end together: all but the last end early, a long tail.
    monkeypatch.setattr(SpeculativeEngine, "generate", lambda self, prompts, max_new, **kw: real_generate(
        self, prompts, [4] * (len(prompts) - 1) + [max_new], **kw))
    # No --spot-process: a trainer given a device of its own is a process by default.
    argv = ["rl", "--small", "--device", "cpu", "--out", str(tmp_path), "--ways", "spec-eagle",
            "--spot-device", "cpu", "--max-new-tokens", "40"]
    assert main(argv) == 0
    (engine,) = engines
    trainer = engine.spot_trainer
    assert isinstance(trainer, SpotTrainerProcess) and not trainer.alive
    # Closing collected the last rollout's weights; the serving drafter loaded those that had landed before.
    assert trainer.holder.version >= 1 and engine.drafter.weights_version <= trainer.holder.version
    assert len(heads) == 2 and all(head is engine.drafter for head in heads)  # --small runs 2 steps
    notes = (tmp_path / "rl.md").read_text()
    assert "spec-eagle: decoding steps" in notes and "spot trainer: did not run" not in notes


def test_the_warm_up_updates_a_copy_and_leaves_the_way_untouched(tmp_path, monkeypatch):
    """Each way's warm-up runs one untimed update (the first backward's set-up) on a copy of its weights: the way's
    first timed step starts from the initial weights, with a fresh optimizer."""
    import bench.suites.rl as rl

    updated, first_steps = [], []
    real_update, real_step = rl.RLRun._update, rl.RLRun.step

    def recording_update(self, way, prompts, out, rewards):
        updated.append(way.model)
        return real_update(self, way, prompts, out, rewards)

    def recording_step(self, way, index):
        if index == 0:
            initial = self.ours.state_dict() if way.name != "hf" else self.hf.state_dict()
            same = all(torch.equal(initial[k], v) for k, v in way.model.state_dict().items())
            first_steps.append((way.name, same, len(way.optimizer.state), way.model))
        return real_step(self, way, index)

    monkeypatch.setattr(rl.RLRun, "_update", recording_update)
    monkeypatch.setattr(rl.RLRun, "step", recording_step)
    assert main(["rl", "--small", "--device", "cpu", "--out", str(tmp_path), "--ways", "plain,hf"]) == 0
    assert [(name, same, state) for name, same, state, _ in first_steps] == [("plain", True, 0), ("hf", True, 0)]
    # Per way: the warm-up's update of another model, then the two timed steps' updates of the way's own.
    models = [model for *_, model in first_steps]
    assert len(updated) == 6 and updated[0] not in models and updated[1:3] == [models[0]] * 2
    assert updated[3] not in models and updated[4:] == [models[1]] * 2


def test_selector_min_gain_reaches_the_speculative_ways_selectors(tmp_path):
    """--selector-min-gain: every speculative way's adaptive selector plays a speculative arm only past that margin
    over plain decoding (CostModelPolicy(min_gain=)); a value outside [0, 1] is refused."""
    from tlt_kernels.engine import SpeculativeEngine

    gains = []
    real_generate = SpeculativeEngine.generate

    def recording_generate(self, *args, **kwargs):
        gains.append(self.selector.policy.min_gain)
        return real_generate(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(SpeculativeEngine, "generate", recording_generate)
        argv = ["rl", "--small", "--device", "cpu", "--out", str(tmp_path), "--ways", "spec-ngram"]
        assert main(argv + ["--selector-min-gain", "0.05"]) == 0
    assert len(gains) == 3 and set(gains) == {0.05}  # the warm-up and two steps
    with pytest.raises(SystemExit):
        main(argv + ["--selector-min-gain", "-0.1"])


def test_draft_vocab_reaches_every_eagle_drafter_of_the_ways(tmp_path, monkeypatch):
    """--draft-vocab N: the serving drafter of each EAGLE way (and the thread trainer's copy) drafts from one set of N
    tokens counted once from the initial policy's greedy answers; off by default; N past the vocabulary is refused."""
    from tlt_kernels.drafter import EagleDrafter

    sets = []
    original = EagleDrafter.set_draft_vocab
    monkeypatch.setattr(EagleDrafter, "set_draft_vocab", lambda self, ids: sets.append(ids) or original(self, ids))
    base = ["rl", "--small", "--device", "cpu", "--out", str(tmp_path), "--ways", "spec-eagle-frozen,spec-eagle"]
    assert main(base) == 0
    assert sets and all(s is None for s in sets)  # the default: the whole vocabulary
    sets.clear()
    engines = _record_engines(monkeypatch)
    assert main(base + ["--draft-vocab", "40"]) == 0
    assert len(sets) == 3 and all(s is sets[0] for s in sets) and sets[0].shape == (40,)  # frozen; serving + trainer
    assert all(engine.drafter.draft_vocab is not None for engine in engines if engine.drafter is not None)
    record = json.loads((tmp_path / "rl.json").read_text())
    assert any(n.startswith("draft vocabulary (--draft-vocab): the 40 tokens") for n in record["notes"])
    assert main(base + ["--draft-vocab", "100000"]) != 0
