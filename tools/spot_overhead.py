"""What spot training costs a rollout beyond its drafter: ``python -m tools.spot_overhead [--kinds ...]`` (GPU).

One engine per kind over the same synthetic bf16 target (random weights, ``--layers`` x ``--hidden``), the same
untrained EAGLE drafter (seed 0), the same long-tailed batch and adaptive selector, CUDA graphs and fused steps:

* ``frozen``: the drafter alone (no feature capture);
* ``buffer``: plus a pinned ``RolloutBuffer`` (feature capture at every step, finished requests handed over);
* ``thread``: plus a ``SpotTrainer`` on the same GPU (the engine's side thread trains in the tail);
* ``process``: plus a ``SpotTrainerProcess`` on the same GPU instead;
* ``process-overlap``: the same with the tail's steps overlapped (``spot_overlap_steps``).

Per kind: the wall time of each of ``--repeats`` rollouts (after a warm-up), the steps, the mean step time in the
tail (batch below a quarter) and the trainer's last stats; ``--profile N`` adds one more rollout under cProfile
and prints its N functions of most own time (the host's share of each kind's cost). The random target accepts almost nothing, so the selector
mostly decodes plainly: the differences between kinds are the engine's work for the trainer, not the drafts. A
developer tool to find that cost; figures of record come from ``python -m bench rl``.
"""
from __future__ import annotations

import argparse
import math
import statistics
import time

KINDS = ("frozen", "buffer", "thread", "process", "process-overlap")


def _target(args):
    import torch

    from tlt_kernels.models import LlamaForCausalLM, ModelConfig

    torch.manual_seed(0)
    cfg = ModelConfig.small(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                            num_layers=args.layers, num_q_heads=args.hidden // 64, num_kv_heads=2, head_dim=64)
    return LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()


def _workload(args):
    """``--batch`` prompts of 32 random tokens and log-normal lengths (median ``--median``, at most 256)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, args.vocab, (32,), generator=gen).tolist() for _ in range(args.batch)]
    lengths = [int(min(256, max(2, round(args.median * math.exp(float(z))))))
               for z in torch.randn(args.batch, generator=gen)]
    return prompts, lengths


def _engine(kind: str, target, batch: int):
    import torch

    from tlt_kernels.drafter import EagleDrafter, RolloutBuffer, SpotTrainer, SpotTrainerProcess, WeightsHolder
    from tlt_kernels.engine import SpeculativeEngine
    from tlt_kernels.runtime import GraphPool, Strategy, StrategySelector

    serving, extra = EagleDrafter.for_target(target, seed=0), {}
    if kind != "frozen":
        buffer = RolloutBuffer(capacity_tokens=1 << 22, storage_dtype=torch.bfloat16, pin_memory=True)
        extra["rollout_buffer"] = buffer
        settings = dict(lr=1e-3, warmup_steps=20, unroll_steps=2, autocast_dtype=torch.bfloat16)
        if kind == "thread":
            extra["spot_trainer"] = SpotTrainer(EagleDrafter.for_target(target, seed=0), buffer, **settings)
        elif kind.startswith("process"):
            extra["spot_trainer"] = SpotTrainerProcess(serving, buffer, WeightsHolder(device=target.device),
                                                       device=target.device, **settings)
            extra["spot_overlap_steps"] = kind == "process-overlap"
    arms = [Strategy(2, 1, 3), Strategy(4, 1, 5)]
    eng = SpeculativeEngine(target, serving, StrategySelector(arms, seed=0), GraphPool(), max_batch_size=batch,
                            max_seq_len=32 + 260, fuse_step=True, **extra)
    eng.capture_graphs([b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b < batch] + [batch])
    eng.selector = StrategySelector(arms, seed=0, available=eng.covers, cost_table=eng.measure_cost_table())
    return eng


def _measure(kind: str, target, args) -> str:
    prompts, lengths = _workload(args)
    eng = _engine(kind, target, args.batch)
    try:
        eng.generate(prompts[:4], 8)  # warm-up
        walls, steps, tails = [], [], []
        for _ in range(args.repeats):
            started = time.perf_counter()
            out = eng.generate(prompts, lengths)
            walls.append((time.perf_counter() - started) * 1e3)
            tail = [s.seconds for s in out.steps if s.batch_size < args.batch // 4]
            steps.append(len(out.steps))
            tails.append(1e3 * sum(tail) / max(1, len(tail)))
        stats = getattr(eng.spot_trainer, "last_stats", None)
        if args.profile:
            _profile(eng, prompts, lengths, args.profile)
        return (f"{kind}: wall ms median {statistics.median(walls):.1f} (runs {[round(w) for w in walls]}); steps "
                f"{steps}; tail ms per step {[round(t, 3) for t in tails]}; trainer {stats}")
    finally:
        close = getattr(eng.spot_trainer, "close", None)
        if close is not None:
            close()


def _profile(eng, prompts, lengths, top: int) -> None:
    """One rollout under cProfile; prints its ``top`` functions by own time."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    eng.generate(prompts, lengths)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    print(text.getvalue(), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)}")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--median", type=int, default=40, help="median response length")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=512, help="a multiple of 64")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="one more rollout per kind under cProfile: print its N functions of most own time")
    args = parser.parse_args()
    kinds = args.kinds.split(",")
    unknown = set(kinds) - set(KINDS)
    if unknown:
        parser.error(f"--kinds: unknown {', '.join(sorted(unknown))}; choose from {', '.join(KINDS)}")
    target = _target(args)
    for kind in kinds:
        print(_measure(kind, target, args), flush=True)


if __name__ == "__main__":
    main()
