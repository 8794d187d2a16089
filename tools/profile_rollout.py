"""Where a real model's rollout step goes, host and GPU: ``python -m tools.profile_rollout --model-file PATH``.

For plain decoding and each of ``--drafters`` (n-gram, EAGLE) at ``--arm`` at each ``--batches`` size: a graphed rollout of ``--tokens``
tokens per request on the chat prompts of ``bench/data/prompts.jsonl``, then the same rollout under ``cProfile``
(the host's Python functions by own time, per step) and under ``torch.profiler`` (the GPU's kernels per step, their
count and time, and the host's operators by self CPU time). A developer tool: its figures steer the engine's
optimisation; recorded figures come from ``python -m bench rollout`` (its step-cost rows).

``--random-smollm2`` builds the default model's shapes (30 layers, 576 wide, GQA 9/3, vocabulary 49152) with random
bf16 weights instead (the same kernels and step cost, nothing to load; prompts of random tokens, so drafts are rarely
accepted); ``--overlap off|on|both`` sets ``SpeculativeEngine(overlap_steps=)``, ``both`` runs each configuration
twice for a same-run A/B; ``--step-kernel`` runs the step's bookkeeping in one launch; ``--no-detail`` prints only the summary lines (no cProfile, no torch.profiler).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
from pathlib import Path
from typing import List

import torch


def _parse_args():
    ap = argparse.ArgumentParser(prog="python -m tools.profile_rollout", description=__doc__.split("\n")[0])
    source = ap.add_mutually_exclusive_group(required=True)
    source.add_argument("--model-file", help="a .gguf file or a transformers directory")
    source.add_argument("--random-smollm2", action="store_true", help="the default model's shapes, random weights")
    ap.add_argument("--overlap", choices=("off", "on", "both"), default="on", help="overlapped steps (default on)")
    ap.add_argument("--step-kernel", choices=("off", "on", "both"), default="on",
                    help="SpeculativeEngine(step_kernel=): the step's bookkeeping in one Triton launch (default on)")
    ap.add_argument("--detail", action=argparse.BooleanOptionalAction, default=True,
                    help="cProfile and torch.profiler tables (default on)")
    ap.add_argument("--batches", default="1,32", help="comma-separated batch sizes")
    ap.add_argument("--tokens", type=int, default=96, help="new tokens per request")
    ap.add_argument("--arm", default="s4k1v5", help="the drafters' static strategy ('off' included; '' for plain only)")
    ap.add_argument("--drafters", default="ngram",
                    help="comma-separated drafters run with --arm: ngram, eagle (an untrained bf16 EAGLE layer)")
    ap.add_argument("--adaptive", default="",
                    help="comma-separated arms of an adaptive selector (its start-up cost table measured) profiled "
                         "per drafter beside --arm (default: none)")
    ap.add_argument("--loss-budget", type=float, default=None, metavar="FRACTION",
                    help="the adaptive selector's loss budget (StrategySelector(loss_budget=); default none): with a "
                         "small one most steps are plain, so their time under a selector compares with plain "
                         "decoding's")
    ap.add_argument("--prefill-lengths", default="",
                    help="comma-separated prompt-length buckets whose prefill replays a CUDA graph, profiled beside "
                         "the eager prefill (default: the eager prefill only)")
    ap.add_argument("--kernels", type=int, default=15, help="GPU kernels listed per configuration (default 15)")
    ap.add_argument("--out", type=Path, default=None, help="also write the report to DIR/profile_rollout.md")
    return ap.parse_args()


def _engine(target, drafter, strategy, max_batch: int, max_seq: int, overlap: bool, step_kernel: bool,
            prefill_lengths=(), loss_budget=None):
    """A warmed-up engine, graphs captured; ``strategy`` a list of arms: an adaptive selector over them (with
    ``loss_budget``), started from the measured cost table as the suites start theirs."""
    from tlt_kernels.engine import SpeculativeEngine
    from tlt_kernels.runtime import GraphPool, StrategySelector

    adaptive = isinstance(strategy, list)
    if adaptive:
        strategy = StrategySelector(strategy, seed=0)

    eng = SpeculativeEngine(target, drafter, strategy, GraphPool(), max_batch_size=max_batch, max_seq_len=max_seq,
                            fuse_step=True, overlap_steps=overlap, step_kernel=step_kernel,
                            prefill_lengths=prefill_lengths)
    eng.capture_graphs(sorted({1, 2, 4, 8, 16, 32, max_batch}))
    if adaptive:
        eng.selector = StrategySelector(eng.strategies, seed=0, available=eng.covers,
                                        cost_table=eng.measure_cost_table(), loss_budget=loss_budget)
    eng.generate([[1, 2, 3]], 4)
    return eng


def _host_profile(eng, prompts, tokens: int, steps: int) -> List[str]:
    """cProfile's top functions by own time, per step."""
    prof = cProfile.Profile()
    prof.enable()
    eng.generate(prompts, tokens)
    torch.cuda.synchronize()
    prof.disable()
    stream = io.StringIO()
    pstats.Stats(prof, stream=stream).sort_stats("tottime").print_stats(25)
    lines = ["### host Python by own time (cProfile, whole rollout; divide by the steps)", f"steps: {steps}", "```"]
    lines += [line for line in stream.getvalue().splitlines() if line.strip()][-27:]
    return lines + ["```"]


def _torch_profile(eng, prompts, tokens: int, steps: int, num_kernels: int = 15) -> List[str]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        eng.generate(prompts, tokens)
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = [e for e in events if e.device_time_total > 0 and e.device_type.name == "CUDA"]
    lines = [f"### GPU kernels per step: {sum(e.count for e in kernels) / steps:.0f} launches, "
             f"{sum(e.self_device_time_total for e in kernels) / steps / 1e3:.3f} ms"]
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:num_kernels]:
        lines.append(f"- {e.key[:90]}: {e.count / steps:.1f}/step, {e.self_device_time_total / steps:.1f} us/step")
    lines.append("### GPU kernels by launches per step (a launch-bound step's count to cut)")
    for e in sorted(kernels, key=lambda e: -e.count)[:num_kernels]:
        lines.append(f"- {e.key[:90]}: {e.count / steps:.1f}/step, {e.self_device_time_total / max(e.count, 1):.1f} us each")
    lines.append("### host operators by self CPU time (per step)")
    host = [e for e in events if e.device_type.name == "CPU"]
    for e in sorted(host, key=lambda e: -e.self_cpu_time_total)[:20]:
        lines.append(f"- {e.key[:90]}: {e.count / steps:.1f}/step, {e.self_cpu_time_total / steps:.1f} us/step")
    return lines


def _profile(name, eng, prompts, tokens: int, detail: bool, num_kernels: int = 15) -> List[str]:
    """The summary line (medians of 3 rollouts: decode ms per step, prefill excluded), then the tables."""
    per_step, medians, prefills, walls = [], [], [], []
    for _ in range(3):
        torch.cuda.synchronize()
        out = eng.generate(prompts, tokens)
        decode_s = out.wall_s - out.prefill_s
        per_step.append(1e3 * decode_s / len(out.steps))
        medians.append(sorted(s.seconds for s in out.steps)[len(out.steps) // 2] * 1e3)
        prefills.append(out.prefill_s * 1e3)
        walls.append(out.wall_s * 1e3)
    steps = len(out.steps)
    lines = [f"## {name}, B={len(prompts)}: {steps} steps, decode {sorted(per_step)[1]:.3f} ms/step (median step "
             f"{sorted(medians)[1]:.3f} ms), prefill {sorted(prefills)[1]:.2f} ms, wall {sorted(walls)[1]:.1f} ms, "
             f"accepted length {out.mean_accepted_length():.2f}, graph steps {sum(s.graph for s in out.steps)}"
             + _arm_summary(out.steps)]
    if not detail:
        return lines
    return lines + _host_profile(eng, prompts, tokens, steps) + _torch_profile(eng, prompts, tokens, steps, num_kernels)


def _arm_summary(steps) -> str:
    """``; <arm> <steps> x <median ms>`` per strategy, when more than one ran (an adaptive engine)."""
    by_arm = {}
    for step in steps:
        by_arm.setdefault(step.strategy, []).append(step.seconds * 1e3)
    if len(by_arm) < 2:
        return ""
    return "; " + ", ".join(f"{arm} {len(ms)} x {sorted(ms)[len(ms) // 2]:.3f} ms" for arm, ms in by_arm.items())


def _target_and_prompts(args):
    """The target (bf16, CUDA) and prompt token lists: the chat prompts through the model's tokenizer, or random
    tokens of the prompt set's lengths for the random model."""
    from bench.prompts import load_prompts
    from tlt_kernels.models import LlamaForCausalLM, ModelConfig, chat_prompt_ids, load_pretrained, load_tokenizer

    if args.model_file:
        target = load_pretrained(args.model_file, device=torch.device("cuda"), dtype=torch.bfloat16)
        tokenizer = load_tokenizer(args.model_file)
        return target, [chat_prompt_ids(tokenizer, p.chat()) for p in load_prompts()]
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_q_heads=9,
                         num_kv_heads=3, head_dim=64, rope_theta=100000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=True, max_position_embeddings=8192)
    target = LlamaForCausalLM(config).to(device="cuda", dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    return target, [torch.randint(0, 49152, (96 + 8 * (i % 16),), generator=g).tolist() for i in range(96)]


def _drafter(name: str, target):
    """The engine's ``drafter=`` for a ``--drafters`` name."""
    if name == "ngram":
        return "ngram"
    if name == "eagle":
        from tlt_kernels.drafter import EagleDrafter

        return EagleDrafter.for_target(target, dtype=torch.bfloat16, seed=0)
    raise ValueError(f"--drafters: unknown drafter {name!r} (ngram, eagle)")


def _variants(args):
    """(overlap, step kernel, prefill buckets) of every engine profiled per configuration."""
    choices = {"off": [False], "on": [True], "both": [False, True]}
    buckets = tuple(int(b) for b in args.prefill_lengths.split(",") if b)
    prefills = [()] + ([buckets] if buckets else [])
    return [(o, k, p) for o in choices[args.overlap] for k in choices[args.step_kernel] for p in prefills]


def main() -> None:
    args = _parse_args()
    from tlt_kernels.runtime import Strategy

    target, prompt_ids = _target_and_prompts(args)
    batches = [int(b) for b in args.batches.split(",")]
    max_seq = max(len(p) for p in prompt_ids) + args.tokens + 16
    configs = [("plain", None, Strategy.off())]
    if args.arm:
        configs += [(f"{name} {args.arm}", _drafter(name, target), Strategy.parse(args.arm))
                    for name in args.drafters.split(",")]
    if args.adaptive:
        arms = [Strategy.parse(a) for a in args.adaptive.split(",")]
        label = "adaptive" if args.loss_budget is None else f"adaptive [budget {args.loss_budget:g}]"
        configs += [(f"{name} {label}", _drafter(name, target), arms) for name in args.drafters.split(",")]
    lines = []
    for name, drafter, strategy in configs:
        for overlap, step_kernel, prefill in _variants(args):
            eng = _engine(target, drafter, strategy, max(batches), max_seq, overlap, step_kernel, prefill,
                          args.loss_budget)
            label = (f"{name} (overlap {'on' if overlap else 'off'}, step kernel {'on' if step_kernel else 'off'}, "
                     f"prefill {'graphs ' + ','.join(map(str, prefill)) if prefill else 'eager'})")
            for batch in batches:
                prompts = [prompt_ids[i % len(prompt_ids)] for i in range(batch)]
                lines += _profile(label, eng, prompts, args.tokens, args.detail, args.kernels)
            del eng
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "profile_rollout.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
