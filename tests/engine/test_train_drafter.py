"""``python -m tlt_kernels.engine.train_drafter`` on the CPU: a tiny random transformers Llama with a byte-level
tokenizer and a chat template, three train prompts and one heldout prompt."""
import json

import pytest
import torch

pytest.importorskip("transformers")

from tlt_kernels.drafter import EagleDrafter, RolloutBuffer, SpotTrainer  # noqa: E402
from tlt_kernels.engine import train_drafter  # noqa: E402
from tlt_kernels.models import load_pretrained  # noqa: E402
from conftest import tiny_transformers_directory  # noqa: E402


def _prompts_file(path):
    lines = [{"id": f"chat-{i}", "split": "train", "messages": [{"role": "user", "content": text}]}
             for i, text in enumerate(["Tell me about rivers.", "Write a haiku.", "What is 2 + 3?"])]
    lines.append({"id": "chat-9", "split": "heldout", "messages": [{"role": "user", "content": "Explain tides."}]})
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")


def test_train_drafter_writes_a_trained_checkpoint(tmp_path, capsys):
    model, prompts, out = tmp_path / "model", tmp_path / "prompts.jsonl", tmp_path / "eagle.pt"
    tiny_transformers_directory(model, hidden_size=64, head_dim=32)
    _prompts_file(prompts)
    weights = tmp_path / "eagle_bf16.pt"
    summary = train_drafter.main(["--model-file", str(model), "--out", str(out), "--prompts", str(prompts),
                                  "--steps", "6", "--max-new-tokens", "12", "--batch", "2", "--device", "cpu",
                                  "--train-batch", "4", "--seq-len", "16", "--eval", "--report-every", "4",
                                  "--weights-out", str(weights)])
    assert summary["train_prompts"] == 3 and summary["answers"] == 12  # --samples 4 by default
    assert summary["generated_tokens"] > 0 and summary["steps"] == 6
    assert out.is_file()
    assert summary["accepted_length"] >= 1.0 and summary["accepted_length_initial"] >= 1.0
    printed = capsys.readouterr().out
    assert '"accepted_length"' in printed and "step 4, loss" in printed and "step 6, loss" in printed

    target = load_pretrained(model)
    initial = EagleDrafter.for_target(target, seed=0)
    trainer = SpotTrainer(EagleDrafter.for_target(target, seed=0), RolloutBuffer(16), autocast_dtype=None)
    trainer.load_checkpoint(str(out))
    assert trainer.optimizer_steps == 6
    trained = trainer.drafter.state_dict()
    assert any(not torch.equal(v, trained[k]) for k, v in initial.state_dict().items())

    rollout = pytest.importorskip("bench.suites.rollout")  # the rollout suite's --eagle-checkpoint reads it
    loaded = rollout.load_eagle(str(out), target, torch.float32)
    assert all(torch.equal(v, trained[k]) for k, v in loaded.state_dict().items())
    # --weights-out: the drafter's weights alone in bf16; a bf16 drafter loads the same values from either file
    assert summary["weights_out"] == str(weights) and set(torch.load(weights)) == set(trained)
    from_weights = rollout.load_eagle(str(weights), target, torch.bfloat16).state_dict()
    from_checkpoint = rollout.load_eagle(str(out), target, torch.bfloat16).state_dict()
    assert all(v.dtype == torch.bfloat16 and torch.equal(v, from_checkpoint[k]) for k, v in from_weights.items())


def test_read_prompts_takes_the_split_and_names_bad_lines(tmp_path):
    path = tmp_path / "p.jsonl"
    _prompts_file(path)
    assert len(train_drafter.read_prompts(path, "train")) == 3 and len(train_drafter.read_prompts(path, "heldout")) == 1
    path.write_text('{"split": "train"}\n')
    with pytest.raises(ValueError, match="p.jsonl:1"):
        train_drafter.read_prompts(path, "train")


def test_trainer_flags_reach_the_trainer(monkeypatch, tmp_path):
    """--normalize-hidden sets SpotTrainer(normalize_hidden=True) and is on by default; --no-normalize-hidden turns
    it off. --token-weight, --feature-noise and --unroll-steps set the loss's token_weight, feature_noise and
    unroll_steps (defaults 0.1, 0.05, 3); negative weights and fewer than one step are refused."""
    seen = []
    real = train_drafter.SpotTrainer

    def trainer(*args, **kwargs):
        seen.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(train_drafter, "SpotTrainer", trainer)
    model, prompts = tmp_path / "model", tmp_path / "prompts.jsonl"
    tiny_transformers_directory(model, hidden_size=64, head_dim=32)
    _prompts_file(prompts)
    common = ["--model-file", str(model), "--prompts", str(prompts), "--steps", "2", "--max-new-tokens", "4",
              "--batch", "2", "--samples", "1", "--device", "cpu", "--train-batch", "2", "--seq-len", "8"]
    train_drafter.main(common + ["--out", str(tmp_path / "a.pt")])
    train_drafter.main(common + ["--out", str(tmp_path / "b.pt"), "--no-normalize-hidden", "--token-weight", "1.5",
                                 "--feature-noise", "0.2", "--unroll-steps", "2"])
    assert [kw["normalize_hidden"] for kw in seen] == [True, False]
    assert [(kw["token_weight"], kw["feature_noise"], kw["unroll_steps"]) for kw in seen] == [(0.1, 0.05, 3),
                                                                                             (1.5, 0.2, 2)]
    for flag, value in (("--token-weight", "-1"), ("--feature-noise", "-1"), ("--unroll-steps", "0")):
        with pytest.raises(SystemExit):
            train_drafter.parse_args(["--model-file", "m", "--out", "o", flag, value])


def test_train_seconds_stops_early_and_still_saves(tmp_path):
    """--train-seconds bounds the training: a budget that runs out at once leaves fewer steps than --steps, and the
    checkpoint is written all the same (a run inside a timed device call keeps what it trained)."""
    model, prompts, out = tmp_path / "model", tmp_path / "prompts.jsonl", tmp_path / "eagle.pt"
    tiny_transformers_directory(model, hidden_size=64, head_dim=32)
    _prompts_file(prompts)
    summary = train_drafter.main(["--model-file", str(model), "--out", str(out), "--prompts", str(prompts),
                                  "--steps", "1000", "--max-new-tokens", "4", "--batch", "2", "--samples", "1",
                                  "--device", "cpu", "--train-batch", "2", "--seq-len", "8",
                                  "--train-seconds", "1e-6"])
    assert summary["steps"] < 1000 and out.is_file()
    with pytest.raises(SystemExit):
        train_drafter.parse_args(["--model-file", "m", "--out", "o", "--train-seconds", "0"])


def test_a_checkpoint_is_saved_at_every_report(monkeypatch, tmp_path):
    """A run killed by a time limit after a report keeps what it trained up to that report."""
    saved = []
    real = SpotTrainer.save_checkpoint

    def save(self, path):
        saved.append(self.optimizer_steps)
        real(self, path)

    monkeypatch.setattr(SpotTrainer, "save_checkpoint", save)
    model, prompts, out = tmp_path / "model", tmp_path / "prompts.jsonl", tmp_path / "eagle.pt"
    tiny_transformers_directory(model, hidden_size=64, head_dim=32)
    _prompts_file(prompts)
    train_drafter.main(["--model-file", str(model), "--out", str(out), "--prompts", str(prompts), "--steps", "6",
                        "--max-new-tokens", "4", "--batch", "2", "--samples", "1", "--device", "cpu",
                        "--train-batch", "2", "--seq-len", "8", "--report-every", "4"])
    assert saved[:2] == [4, 6] and saved[-1] == 6 and out.is_file()
