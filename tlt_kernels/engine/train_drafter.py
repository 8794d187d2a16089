"""Offline training of the EAGLE drafter for a real target, from the target's own answers to the shipped prompts.

::

    python -m tlt_kernels.engine.train_drafter --model-file PATH --out eagle.pt [--weights-out eagle_bf16.pt]
        [--steps N] [--max-new-tokens N] [--batch N] [--samples N] [--no-normalize-hidden] [--token-weight W] [--feature-noise A] [--unroll-steps N] [--train-seconds S] [--temperature T] [--seed S] [--device cuda] [--dtype bf16] [--prompts FILE] [--eval]

1. the target and its tokenizer load from ``--model-file`` (:func:`tlt_kernels.models.load_pretrained`);
2. the ``"train"`` prompts of ``--prompts`` (JSON lines with ``messages`` and ``split``; default: the repository's
   ``bench/data/prompts.jsonl``) go through the chat template;
3. a plain :class:`SpeculativeEngine` (whole-step CUDA graphs on a GPU) answers each ``--samples`` times in batches of ``--batch`` (sampling at
   ``--temperature``, 0 = greedy; one seed per answer), its rollout buffer capturing every sequence's target features (last layer, before the final
   norm) and tokens -- the path the spot trainer reads in a live rollout;
4. a :class:`~tlt_kernels.drafter.SpotTrainer` trains a fresh :class:`~tlt_kernels.drafter.EagleDrafter` for
   ``--steps`` optimizer steps on that buffer and saves its checkpoint to ``--out`` at every report and at the end
   (:meth:`SpotTrainer.save_checkpoint`, atomic; ``python -m bench rollout --eagle-checkpoint`` loads it);
5. with ``--weights-out``: the trained drafter's own weights as a bf16 state dict (what ``--eagle-checkpoint`` also
   loads; for SmolLM2-135M 8 MB against the checkpoint's 50, optimizer state included: small enough to carry a
   drafter trained once to another machine);
6. with ``--eval``: the mean accepted length (:func:`~tlt_kernels.drafter.spot_trainer.evaluate_acceptance`) on
   greedy answers to the ``"heldout"`` prompts, before and after training.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch

from ..drafter import EagleDrafter, RolloutBuffer, SpotTrainer
from ..drafter.spot_trainer import evaluate_acceptance
from ..models.pretrained import chat_prompt_ids, load_pretrained, load_tokenizer
from ..runtime import GraphPool, Strategy
from .engine import SpeculativeEngine

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_REPO_PROMPTS = Path(__file__).resolve().parents[2] / "bench" / "data" / "prompts.jsonl"


def read_prompts(path, split: str) -> List[list]:
    """The ``messages`` of every line of the JSON-lines file ``path`` whose ``"split"`` is ``split``."""
    conversations = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        record = json.loads(line)
        if not isinstance(record, dict) or not isinstance(record.get("messages"), list):
            raise ValueError(f"{path}:{number}: expected a JSON object with a 'messages' list")
        if record.get("split") == split:
            conversations.append(record["messages"])
    return conversations


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tlt_kernels.engine.train_drafter", description=__doc__.split("\n")[0])
    p.add_argument("--model-file", required=True, help="transformers directory or .gguf file of the target")
    p.add_argument("--out", required=True, help="where the SpotTrainer checkpoint goes")
    p.add_argument("--weights-out", default=None,
                   help="also write the trained drafter's weights alone, as a bf16 state dict (a file to carry)")
    p.add_argument("--steps", type=int, default=2000, help="optimizer steps")
    p.add_argument("--max-new-tokens", type=int, default=512, help="tokens generated per prompt")
    p.add_argument("--batch", type=int, default=32, help="prompts per rollout batch")
    p.add_argument("--samples", type=int, default=4,
                   help="answers per train prompt (each its own seed; more data, as an RL group gives)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of the rollouts (0 = greedy)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default=None,
                   help="target dtype (default: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--prompts", default=None, help=f"JSON-lines prompt file (default: {_REPO_PROMPTS} if it exists)")
    p.add_argument("--eval", action="store_true", help="report the accepted length on the heldout prompts")
    p.add_argument("--train-seconds", type=float, default=None,
                   help="stop training after this many seconds even before --steps (the checkpoint is still saved)")
    p.add_argument("--report-every", type=int, default=500, help="print the loss every this many optimizer steps")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--train-batch", type=int, default=8, help="windows per optimizer step")
    p.add_argument("--seq-len", type=int, default=256, help="pairs per training window")
    p.add_argument("--token-weight", type=float, default=0.1,
                   help="weight of the token term (soft cross-entropy against the target's distribution) next to the "
                        "feature regression's 1 (eagle_loss)")
    p.add_argument("--feature-noise", type=float, default=0.05,
                   help="uniform noise on the input features, in units of their spread with --normalize-hidden")
    p.add_argument("--unroll-steps", type=int, default=3,
                   help="draft depths in the loss: depth s reads the drafter's own predictions, as a draft does "
                        "(EagleDrafter.forward_unrolled; 1 = teacher forcing only; docs/DRAFTERS.md has the A/B)")
    p.add_argument("--normalize-hidden", action=argparse.BooleanOptionalAction, default=True,
                   help="regress features per dimension in units of their spread (SpotTrainer(normalize_hidden=); "
                        "default on): for targets whose last-layer features hold a few huge dimensions")
    args = p.parse_args(argv)
    if args.prompts is None:
        if not _REPO_PROMPTS.is_file():
            p.error(f"--prompts is required ({_REPO_PROMPTS} does not exist)")
        args.prompts = str(_REPO_PROMPTS)
    if min(args.steps, args.max_new_tokens, args.batch, args.samples, args.train_batch, args.seq_len,
           args.unroll_steps) < 1 or args.temperature < 0:
        p.error("--steps, --max-new-tokens, --batch, --samples, --train-batch, --seq-len and --unroll-steps must be >= 1, "
                "--temperature >= 0")
    if args.report_every < 1 or (args.train_seconds is not None and args.train_seconds <= 0):
        p.error("--report-every must be >= 1 and --train-seconds > 0")
    if not (args.token_weight >= 0 and args.feature_noise >= 0):
        p.error("--token-weight and --feature-noise must be >= 0")
    return args


def load_target(args: argparse.Namespace):
    """``(target, tokenizer)`` of ``--model-file`` on ``--device`` in ``--dtype``."""
    device = torch.device(args.device)
    dtype = _DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    target = load_pretrained(args.model_file, device=device, dtype=dtype)
    return target, load_tokenizer(args.model_file)


def encode_prompts(tokenizer, path, split: str) -> List[List[int]]:
    """Token ids of ``split``'s prompts of ``path`` through the chat template; ValueError when there is none."""
    prompts = [chat_prompt_ids(tokenizer, messages) for messages in read_prompts(path, split)]
    if not prompts:
        raise ValueError(f"{path} has no prompt whose split is {split!r}")
    return prompts


def generate_into(target, prompts: List[List[int]], buffer, *, batch: int, max_new_tokens: int, temperature: float,
                  seed: int, eos_token_id: Optional[int]) -> int:
    """Answers ``prompts`` with plain decoding, ``batch`` at a time; every sequence (prompt + answer) goes to
    ``buffer`` (anything with RolloutBuffer's ``add``). Returns the number of generated tokens."""
    max_seq = max(len(p) for p in prompts) + max_new_tokens + 1
    cuda = target.device.type == "cuda"  # whole-step CUDA graphs there: eager steps are launch-bound
    engine = SpeculativeEngine(target, None, Strategy.off(), GraphPool() if cuda else None,
                               max_batch_size=min(batch, len(prompts)), max_seq_len=max_seq, rollout_buffer=buffer,
                               fuse_step=cuda)
    if cuda:
        engine.capture_graphs()
    generated = 0
    for start in range(0, len(prompts), batch):
        chunk = prompts[start:start + batch]
        seeds = [seed * 1_000_003 + start + i for i in range(len(chunk))]  # one Philox stream per prompt
        out = engine.generate(chunk, max_new_tokens, temperature=temperature, seed=seeds, eos_token_id=eos_token_id)
        generated += int(out.lengths.sum())
    return generated


class _Sequences:
    """Collects the engine's captured sequences (the ``add`` of a RolloutBuffer) for :func:`accepted_length`."""

    def __init__(self):
        self.rows = []

    def add(self, features, tokens, step, lengths=None):
        for b in range(features.shape[0]):
            n = int(lengths[b]) if lengths is not None else features.shape[1]
            self.rows.append((features[b, :n].float().cpu(), tokens[b, :n].cpu()))


def accepted_length(drafter: EagleDrafter, sequences: _Sequences, depth: int = 4) -> float:
    """Mean accepted length of ``drafter``'s trees on greedy sequences (:func:`evaluate_acceptance`, one row each)."""
    rows = [r for r in sequences.rows if r[1].shape[0] > depth + 2]
    if not rows:
        raise ValueError(f"no heldout sequence is longer than depth + 2 = {depth + 2} tokens")
    L, H = max(t.shape[0] for _, t in rows), rows[0][0].shape[1]
    features, tokens = torch.zeros(len(rows), L, H), torch.zeros(len(rows), L, dtype=torch.int64)
    for i, (f, t) in enumerate(rows):
        features[i, :f.shape[0]], tokens[i, :t.shape[0]] = f, t
    lengths = torch.tensor([t.shape[0] for _, t in rows])
    return evaluate_acceptance(drafter, features, tokens, lengths, depth=depth)


def make_trainer(target, buffer: RolloutBuffer, args: argparse.Namespace) -> SpotTrainer:
    """A SpotTrainer of a fresh fp32 drafter for ``target`` (bf16 autocast on CUDA)."""
    drafter = EagleDrafter.for_target(target, seed=args.seed)
    cuda = target.device.type == "cuda"
    return SpotTrainer(drafter, buffer, lr=args.lr, warmup_steps=min(50, max(1, args.steps // 10)),
                       batch_size=args.train_batch, seq_len=args.seq_len, token_weight=args.token_weight,
                       feature_noise=args.feature_noise, unroll_steps=args.unroll_steps, seed=args.seed,
                       normalize_hidden=args.normalize_hidden,
                       autocast_dtype=torch.bfloat16 if cuda else None)


def main(argv: Optional[List[str]] = None) -> Dict:
    """Runs the command; returns a summary dict (also printed), with ``accepted_length`` under ``--eval``."""
    args = parse_args(argv)
    t0 = time.perf_counter()
    target, tokenizer = load_target(args)
    eos = tokenizer.eos_token_id
    cuda = target.device.type == "cuda"
    buffer = RolloutBuffer(capacity_tokens=1 << 24, recency_decay=1.0,
                           storage_dtype=torch.bfloat16 if cuda else torch.float32)
    prompts = encode_prompts(tokenizer, args.prompts, "train")
    train = prompts * args.samples
    generated = generate_into(target, train, buffer, batch=args.batch, max_new_tokens=args.max_new_tokens,
                              temperature=args.temperature, seed=args.seed, eos_token_id=eos)
    summary = {"train_prompts": len(prompts), "answers": len(train), "generated_tokens": generated, "buffer_tokens": buffer.num_tokens,
               "rollout_s": round(time.perf_counter() - t0, 2)}
    print(f"train_drafter: {len(prompts)} prompts, {len(train)} answers, {generated} tokens generated, {buffer.num_tokens} positions buffered in {summary['rollout_s']} s", flush=True)
    trainer = make_trainer(target, buffer, args)
    heldout = _heldout_sequences(target, tokenizer, args, eos) if args.eval else None
    if heldout is not None:
        summary["accepted_length_initial"] = accepted_length(trainer.drafter, heldout)
    steps, train_s, last_loss = run_training(trainer, args)
    trainer.save_checkpoint(args.out)
    summary.update(steps=steps, last_loss=last_loss, train_s=round(train_s, 2), out=str(args.out))
    if args.weights_out:
        save_weights(trainer.drafter, args.weights_out)
        summary["weights_out"] = str(args.weights_out)
    if heldout is not None:
        summary["accepted_length"] = accepted_length(trainer.drafter, heldout)
    print("train_drafter: " + json.dumps(summary))
    return summary


def save_weights(drafter: EagleDrafter, path) -> None:
    """``drafter``'s own weights (not the target's it shares) as a bf16 state dict at ``path``, written atomically.
    A bf16 engine rounds fp32 weights to the same values when it loads them."""
    tmp = f"{path}.tmp"
    torch.save({k: v.detach().to(torch.bfloat16).cpu() for k, v in drafter.state_dict().items()}, tmp)
    Path(tmp).replace(path)


def run_training(trainer: SpotTrainer, args: argparse.Namespace):
    """``--steps`` optimizer steps (fewer when ``--train-seconds`` runs out), printing the loss every
    ``--report-every`` steps and saving the checkpoint to ``--out`` each time (a run cut off by a time limit keeps
    its progress); returns ``(steps, seconds, last loss)``."""
    steps, elapsed_s, last_loss = 0, 0.0, None
    while steps < args.steps:
        budget = None if args.train_seconds is None else args.train_seconds - elapsed_s
        if budget is not None and budget <= 0:
            break
        stats = trainer.run(max_steps=min(args.report_every, args.steps - steps), time_budget_s=budget,
                            publish=False)
        steps, elapsed_s, last_loss = steps + stats.optimizer_steps, elapsed_s + stats.elapsed_s, stats.last_loss
        loss = "n/a" if last_loss is None else f"{last_loss:.4g}"
        trainer.save_checkpoint(args.out)
        print(f"train_drafter: step {steps}, loss {loss}, {elapsed_s:.1f} s, saved {args.out}", flush=True)
        if stats.optimizer_steps == 0:
            break
    return steps, elapsed_s, last_loss


def _heldout_sequences(target, tokenizer, args: argparse.Namespace, eos) -> _Sequences:
    """Greedy answers to the heldout prompts, captured (evaluate_acceptance is exact on greedy rollouts)."""
    sequences = _Sequences()
    generate_into(target, encode_prompts(tokenizer, args.prompts, "heldout"), sequences, batch=args.batch,
                  max_new_tokens=args.max_new_tokens, temperature=0.0, seed=args.seed, eos_token_id=eos)
    return sequences


if __name__ == "__main__":
    main()
