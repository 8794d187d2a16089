"""The EAGLE drafter's draft vocabulary, A/B on a real model: ``python -m tools.draft_vocab_ab --model-file PATH
--eagle-checkpoint FILE``.

The vocabulary is :func:`~tlt_kernels.drafter.frequent_tokens` of the target's own greedy answers to the prompt
set's ``train`` prompts (``--answer-tokens`` each, one plain rollout); the rows decode the ``heldout`` prompts. Per
``--sizes`` (0: the whole vocabulary) one engine at ``--arm`` with its own copy of the drafter, plus the plain engine,
all built first; then per batch size the engines take turns (``--repeats`` rounds, A B C A B C), so drift lands on
every row alike. Each row: the median rollout's wall time, tokens/s, accepted length (tokens per request per step,
bonus included), median step time, its ratio to plain decoding and whether its greedy tokens equal plain's. A
developer tool: a figure worth keeping goes to the rollout suite's record.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def _parse_args():
    ap = argparse.ArgumentParser(prog="python -m tools.draft_vocab_ab", description=__doc__.split("\n")[0])
    ap.add_argument("--model-file", required=True, help="a .gguf file or a transformers directory")
    ap.add_argument("--eagle-checkpoint", required=True, help="an EagleDrafter state dict or SpotTrainer checkpoint")
    ap.add_argument("--sizes", default="0,16384,8192,4096", help="draft vocabulary sizes (0: the whole vocabulary)")
    ap.add_argument("--arm", default="s5k4v16", help="the EAGLE engines' static strategy")
    ap.add_argument("--batches", default="1,16,64", help="comma-separated batch sizes")
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per request")
    ap.add_argument("--answer-tokens", type=int, default=256, help="tokens of each train answer counted")
    ap.add_argument("--repeats", type=int, default=3, help="rounds over the engines per batch size")
    ap.add_argument("--out", type=Path, default=None, help="also write DIR/draft_vocab_ab.{md,json}")
    return ap.parse_args()


def _engine(target, drafter, strategy, max_batch: int, max_seq: int):
    from tlt_kernels.engine import SpeculativeEngine
    from tlt_kernels.runtime import GraphPool

    eng = SpeculativeEngine(target, drafter, strategy, GraphPool(), max_batch_size=max_batch, max_seq_len=max_seq,
                            fuse_step=True)
    eng.capture_graphs(sorted({1 << i for i in range(8) if 1 << i <= max_batch} | {max_batch}))
    eng.generate([[1, 2, 3]], 4)
    return eng


def _answers(target, prompts, tokens: int, max_seq: int):
    """The target's greedy answers to ``prompts`` (one plain rollout of them all)."""
    from tlt_kernels.runtime import Strategy

    eng = _engine(target, None, Strategy.off(), len(prompts), max_seq)
    return eng.generate(prompts, tokens).tokens


def _rows(engines, prompts, batch: int, tokens: int, repeats: int):
    """Per engine the median of ``repeats`` rollouts of ``batch`` heldout prompts (engines take turns)."""
    work = [prompts[i % len(prompts)] for i in range(batch)]
    outs = {name: [] for name in engines}
    for _ in range(repeats):
        for name, eng in engines.items():
            torch.cuda.synchronize()
            outs[name].append(eng.generate(work, tokens))
    rows = []
    for name, runs in outs.items():
        out = sorted(runs, key=lambda o: o.wall_s)[len(runs) // 2]
        steps = sorted(s.seconds for s in out.steps)
        rows.append({"engine": name, "batch": batch, "ms": round(out.wall_s * 1e3, 2),
                     "tokens_per_s": round(sum(len(t) for t in out.tokens) / out.wall_s, 1),
                     "accepted_length": round(out.mean_accepted_length(), 3), "steps": len(out.steps),
                     "median_step_ms": round(steps[len(steps) // 2] * 1e3, 3), "tokens": out.tokens})
    plain_ms, plain_tokens = rows[0]["ms"], rows[0]["tokens"]
    for row in rows:
        row["vs_plain"] = round(plain_ms / row["ms"], 3)
        row["greedy_identical"] = row.pop("tokens") == plain_tokens
    return rows


def main() -> None:
    args = _parse_args()
    from bench.prompts import load_prompts
    from bench.suites.rollout import load_eagle
    from tlt_kernels.drafter import frequent_tokens
    from tlt_kernels.models import chat_prompt_ids, load_pretrained, load_tokenizer
    from tlt_kernels.runtime import Strategy

    dev = torch.device("cuda")
    target = load_pretrained(args.model_file, device=dev, dtype=torch.bfloat16)
    tokenizer = load_tokenizer(args.model_file)
    train, heldout = ([chat_prompt_ids(tokenizer, p.chat()) for p in load_prompts(split=s)] for s in ("train", "heldout"))
    batches = [int(b) for b in args.batches.split(",")]
    max_seq = max(len(p) for p in train + heldout) + max(args.tokens, args.answer_tokens) + 16
    answers = _answers(target, train, args.answer_tokens, max_seq)
    engines = {"plain": _engine(target, None, Strategy.off(), max(batches), max_seq)}
    for size in (int(s) for s in args.sizes.split(",")):
        drafter = load_eagle(args.eagle_checkpoint, target, torch.bfloat16)
        if size:
            drafter.set_draft_vocab(frequent_tokens(answers, size, target.config.vocab_size))
        name = f"eagle {args.arm} vocab {size or target.config.vocab_size}"
        engines[name] = _engine(target, drafter, Strategy.parse(args.arm), max(batches), max_seq)
    rows = [r for b in batches for r in _rows(engines, heldout, b, args.tokens, args.repeats)]
    counted = sum(len(a) for a in answers)
    lines = [f"# draft vocabulary A/B: {torch.cuda.get_device_name()}, {len(train)} train answers ({counted} tokens) "
             f"counted, {len(heldout)} heldout prompts, {args.tokens} tokens, greedy", "",
             "| engine | B | ms | tokens/s | accepted | steps | median step ms | vs plain | identical |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['engine']} | {r['batch']} | {r['ms']} | {r['tokens_per_s']} | {r['accepted_length']} | "
              f"{r['steps']} | {r['median_step_ms']} | {r['vs_plain']} | {r['greedy_identical']} |" for r in rows]
    print("\n".join(lines))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "draft_vocab_ab.md").write_text("\n".join(lines) + "\n")
        (args.out / "draft_vocab_ab.json").write_text(json.dumps({"args": vars(args) | {"out": str(args.out)},
                                                                  "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
