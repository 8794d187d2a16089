"""What spot training costs a rollout beyond its drafter: ``python -m tools.spot_overhead [--kinds ...]`` (GPU).

One engine per kind over the same synthetic bf16 target (random weights, ``--layers`` x ``--hidden``), the same
untrained EAGLE drafter (seed 0), the same long-tailed batch and adaptive selector, CUDA graphs and fused steps:

* ``frozen``: the drafter alone (no feature capture);
* ``buffer``: plus a pinned ``RolloutBuffer`` (feature capture at every step, finished requests handed over);
* ``thread``: plus a ``SpotTrainer`` (the engine's side thread trains in the tail, its steps read one by one);
* ``thread-overlap``: the same with the tail's steps overlapped (``spot_overlap_steps``);
* ``process``: plus a ``SpotTrainerProcess`` instead (begun and finished by the engine, steps overlapped).

Per kind: the wall time of each of ``--repeats`` rollouts (after a warm-up), the steps, the mean step time before
the tail and in it (batch below a quarter) and the trainer's last stats; ``--profile N`` adds one more rollout under cProfile
and prints its N functions of most own time (the host's share of each kind's cost); ``--trainer-device cuda:1``
trains on a second GPU (thread: a replica there, as ``bench rl --spot-device``); ``--no-priority-stream`` keeps the rollout on
the caller's stream, ``--no-overlap`` reads every step before launching the next. The random target accepts almost nothing, so the selector
mostly decodes plainly: the differences between kinds are the engine's work for the trainer, not the drafts. A
developer tool to find that cost; figures of record come from ``python -m bench rl``.
"""
from __future__ import annotations

import argparse
import math
import statistics
import time

KINDS = ("frozen", "buffer", "thread", "thread-overlap", "process")


def _target(args):
    import torch

    from tlt_kernels.models import LlamaForCausalLM, ModelConfig

    torch.manual_seed(0)
    cfg = ModelConfig.small(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                            num_layers=args.layers, num_q_heads=args.hidden // 64, num_kv_heads=args.kv_heads,
                            head_dim=64)
    return LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()


def _workload(args):
    """``--batch`` prompts of 32 random tokens and log-normal lengths (median ``--median``, at most 256)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, args.vocab, (32,), generator=gen).tolist() for _ in range(args.batch)]
    lengths = [int(min(256, max(2, round(args.median * math.exp(float(z))))))
               for z in torch.randn(args.batch, generator=gen)]
    return prompts, lengths


def _engine(kind: str, target, args):
    import torch

    from tlt_kernels.drafter import EagleDrafter, RolloutBuffer, SpotTrainer, SpotTrainerProcess, WeightsHolder
    from tlt_kernels.engine import SpeculativeEngine
    from tlt_kernels.runtime import GraphPool, Strategy, StrategySelector

    serving, extra = EagleDrafter.for_target(target, seed=0), {}
    trainer_device = torch.device(args.trainer_device) if args.trainer_device else target.device
    batch = args.batch
    if kind != "frozen":
        buffer = RolloutBuffer(capacity_tokens=1 << 22, storage_dtype=torch.bfloat16, pin_memory=True)
        extra["rollout_buffer"] = buffer
        settings = dict(lr=1e-3, warmup_steps=20, unroll_steps=2, autocast_dtype=torch.bfloat16)
        if kind.startswith("thread"):
            trainee = EagleDrafter.for_target(target, seed=0)
            if trainer_device == target.device:
                extra["spot_trainer"] = SpotTrainer(trainee, buffer, **settings)
            else:  # a replica there, its weights published to the rollout's GPU (as bench rl --spot-device does)
                extra["spot_trainer"] = SpotTrainer(trainee.replica(trainer_device), buffer,
                                                    WeightsHolder(device=target.device), **settings)
        elif kind == "process":
            extra["spot_trainer"] = SpotTrainerProcess(serving, buffer, WeightsHolder(device=target.device),
                                                       device=trainer_device, cpu_threads=args.trainer_threads,
                                                       **settings)
    extra["spot_overlap_steps"] = kind == "thread-overlap"
    arms = [Strategy(2, 1, 3), Strategy(4, 1, 5)]
    eng = SpeculativeEngine(target, serving, StrategySelector(arms, seed=0), GraphPool(), max_batch_size=batch,
                            max_seq_len=32 + 260, fuse_step=True,
                            prioritize_rollout=not args.no_priority_stream, overlap_steps=not args.no_overlap,
                            **extra)
    eng.capture_graphs([b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b < batch] + [batch])
    eng.selector = StrategySelector(arms, seed=0, available=eng.covers, cost_table=eng.measure_cost_table())
    return eng


def _measure(kind: str, target, args) -> str:
    prompts, lengths = _workload(args)
    eng = _engine(kind, target, args)
    try:
        eng.generate(prompts[:4], 8)  # warm-up
        walls, steps, tails, bodies = [], [], [], []
        for _ in range(args.repeats):
            started = time.perf_counter()
            out = eng.generate(prompts, lengths)
            walls.append((time.perf_counter() - started) * 1e3)
            tail = [s.seconds for s in out.steps if s.batch_size < args.batch // 4]
            steps.append(len(out.steps))
            tails.append(1e3 * sum(tail) / max(1, len(tail)))
            body = [s.seconds for s in out.steps if s.batch_size >= args.batch // 4]
            bodies.append(1e3 * sum(body) / max(1, len(body)))
        stats = getattr(eng.spot_trainer, "last_stats", None)
        if args.profile:
            _profile(eng, prompts, lengths, args.profile)
        return (f"{kind}: wall ms median {statistics.median(walls):.1f} (runs {[round(w) for w in walls]}); steps "
                f"{steps}; ms per step before the tail {[round(t, 3) for t in bodies]}, in it "
                f"{[round(t, 3) for t in tails]}; trainer {stats}")
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
    parser.add_argument("--kv-heads", type=int, default=2, help="divides --hidden / 64 (the query heads)")
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--trainer-device", default=None,
                        help="where the trainers run (default: the target's GPU), e.g. cuda:1 on a host of two")
    parser.add_argument("--trainer-threads", type=int, default=None,
                        help="SpotTrainerProcess(cpu_threads=): the worker's CPU threads (default: its own)")
    parser.add_argument("--no-priority-stream", action="store_true",
                        help="SpeculativeEngine(prioritize_rollout=False): the rollout stays on the caller's stream")
    parser.add_argument("--no-overlap", action="store_true",
                        help="SpeculativeEngine(overlap_steps=False): every step read before the next is launched")
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
