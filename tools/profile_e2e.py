"""Where a rollout step's time goes: ``python -m tools.profile_e2e [--out DIR]`` (GPU).

Trains a small target briefly (the e2e suite's model shape), then for plain decoding and one static
EAGLE strategy runs a graphed rollout under ``torch.profiler`` and prints, per configuration, the mean
step time and the top operators by self CUDA time and by self CPU time (``--layers 24 --attn triton``: the e2e
shape with the fp32 Triton attention). A developer tool: the numbers
steer the engine's optimization; benchmark figures come from ``python -m bench e2e``.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch


def _parse_args():
    """The command line's options."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=None, help="write the tables here too")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--tf32", action="store_true", help="allow TF32 matmuls")
    ap.add_argument("--fuse", action="store_true", help="SpeculativeEngine(fuse_step=True): one graph per step")
    ap.add_argument("--layers", type=int, default=6, help="target depth (the e2e suite's default is 24)")
    ap.add_argument("--hidden", type=int, default=512, help="target width, a multiple of 256 (e2e: --hidden)")
    ap.add_argument("--attn", default="auto", choices=("auto", "torch", "triton"),
                    help="tree-attention backend of the verify pass (an fp32 target: auto = torch; e2e: --attn)")
    return ap.parse_args()


def _profile(args, target, prompts, name, strategy) -> list:
    """The report lines of one configuration: a graphed rollout timed, then profiled, and its graphs' cost table."""
    from torch.profiler import ProfilerActivity, profile

    from tlt_kernels.drafter import EagleDrafter
    from tlt_kernels.engine import SpeculativeEngine
    from tlt_kernels.runtime import GraphPool

    lines = []
    drafter = None if strategy.is_off else EagleDrafter.for_target(target, seed=0)
    eng = SpeculativeEngine(target, drafter, strategy, GraphPool(), max_batch_size=args.batch, max_seq_len=64 + args.new + 8,
                            fuse_step=args.fuse, backend=args.attn)
    eng.capture_graphs(sorted({1, 2, 4, 8, 16, 32, 64, args.batch}))
    eng.generate(prompts, 4)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = eng.generate(prompts, args.new)
    wall = time.perf_counter() - t0
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        eng.generate(prompts, args.new)
        torch.cuda.synchronize()
    n = len(out.steps)
    lines.append(f"## {name}: {n} steps, {1e3 * wall / n:.2f} ms/step, accepted length {out.mean_accepted_length():.2f}")
    # The step's graphs alone (replayed on padding rows): the rest of ms/step is the engine's host-side work.
    table = eng.measure_cost_table(repeats=20)
    lines.append("graphs only, ms per step by batch size: " + ", ".join(
        f"B={b}: {1e3 * t:.3f}" for b, t in zip(*table.table[strategy])))
    ka = prof.key_averages()
    lines.append("### by self CUDA time (per step)")
    for e in sorted(ka, key=lambda e: -e.self_device_time_total)[:18]:
        lines.append(f"{e.key[:70]:70s} calls/step {e.count / n:6.1f}  cuda {e.self_device_time_total / n / 1e3:7.3f} ms  cpu {e.self_cpu_time_total / n / 1e3:7.3f} ms")
    lines.append("### by self CPU time (per step)")
    for e in sorted(ka, key=lambda e: -e.self_cpu_time_total)[:18]:
        lines.append(f"{e.key[:70]:70s} calls/step {e.count / n:6.1f}  cpu {e.self_cpu_time_total / n / 1e3:7.3f} ms")
    total_ops = sum(e.count for e in ka if e.key.startswith("aten::"))
    lines.append(f"aten ops per step: {total_ops / n:.0f}")
    return lines


def main() -> None:
    args = _parse_args()
    from bench.suites.e2e import target_config
    from tlt_kernels.models import load_corpus, train_tiny_target
    from tlt_kernels.models.train_tiny import sample_windows
    from tlt_kernels.runtime import Strategy

    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    dev = torch.device("cuda")
    cfg = target_config(args.hidden, args.layers)
    target = train_tiny_target(cfg, steps=200, device=dev, batch_size=32, seq_len=256)
    target = target.to({"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype])
    prompts = sample_windows(load_corpus("base"), args.batch, 64, torch.Generator().manual_seed(0)).to(dev)
    lines = []
    for name, strategy in (("plain", Strategy.off()), ("s2k1v3", Strategy(2, 1, 3)), ("s5k4v16", Strategy(5, 4, 16))):
        lines += _profile(args, target, prompts, name, strategy)
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "profile_e2e.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
