"""Suite "e2e": a long-tailed rollout, plain decoding vs the best static strategy vs the adaptive engine.

1. A byte-level target is trained here on the stdlib corpus (no downloads) so acceptance is real.
2. RL step 0: a plain rollout fills a RolloutBuffer and the EAGLE drafter is trained on it for a fixed number of
   optimizer steps; a copy of it is frozen there (the drafter a static deployment keeps).
3. The policy drifts: ``--drift`` RL updates (default 2), each a fine-tune of the target on the shifted mix
   (``finetune_target``, in place). Between updates the RL step's rollout fills the buffer and the spot trainer
   trains on it for the same number of steps (its idle window), so the timed rollout's drafter is one RL step
   behind the policy, as in TLT, and the frozen one ``--drift`` steps behind. ``--drift 0``: no drift,
   one drafter for every row.
4. The rollout: ``B`` prompts with log-normal response lengths (most short, a few ~10x longer, like
   reasoning RL rollouts), greedy, run by
   * ``plain``: plain decoding, the verify forward replayed from CUDA graphs (GPU);
   * ``static-<s>``: each static speculative strategy with the frozen drafter (same graphs), and with drift
     ``static-<s> (spot drafter)``: the same engine with the spot-trained drafter loaded in place;
   * ``adaptive``: the StrategySelector (cost policy, its start-up cost table from ``measure_cost_table``) over
     the same arms with the spot-trained drafter, cold (a fresh selector); ``adaptive (warm)`` keeps the selector
     of the previous step's rollout, as RL training does; ``adaptive+spot-in-tail`` also trains during the rollout.
   Every run's tokens must equal the plain run's (greedy identity); the row records whether they do.

Rows: ``ms`` = rollout wall time; extras: tokens/s, tail seconds (steps with batch < B/4), mean
accepted length, speedups vs plain (whole rollout and tail), vs the best static strategy (frozen drafter: the issue's
comparison) and vs the best static arm with the spot-trained drafter (the selector's gain alone).
Notes: the per-batch-size oracle over the static arms (an estimate from their step logs: how much any choice among
these arms could gain over the best one), strategies chosen per batch size, and tokens/s over time (ASCII; a PNG too with
``--plot path.png`` when matplotlib is installed).

Parameters: the flags of :data:`FLAGS` (``python -m bench e2e --help``). Sizes (``--batch``, ``--train-steps``,
``--warm-steps``, ``--layers``, ``--hidden``) override the GPU defaults only; ``--small`` has its own. Each decoding
step is one CUDA graph (``SpeculativeEngine(fuse_step=True)``; ``--no-fuse`` captures verify, draft and extend
separately). ``--write-steps path.json`` writes every row's step log (batch size, strategy, emitted tokens, seconds per
step) for offline comparison with the per-batch-size oracle.
Targets (GPU): >= 2x plain on the rollout, >= 2.5x on the tail, >= 1.1x the best static strategy.
"""
from __future__ import annotations

import copy
import hashlib
import math
import time

import torch

from tlt_kernels.engine.records import tail_steps

from ..flags import Flag, defaults, str_list, values

SUITE = "e2e"

FLAGS = (
    Flag("--batch", 128, "requests in the rollout (GPU size)", int, replaces="TLT_E2E_BATCH", metavar="N"),
    Flag("--layers", 24, "target depth (GPU size; real targets have 28-64 layers against the drafter's one)", int,
         replaces="TLT_E2E_LAYERS", metavar="N"),
    Flag("--hidden", 512, "target width, a multiple of 256 (GPU size)", int, replaces="TLT_E2E_HIDDEN", metavar="N"),
    Flag("--train-steps", 1500, "the target's training steps (GPU size)", int, replaces="TLT_E2E_TRAIN_STEPS", metavar="N"),
    Flag("--warm-steps", 2300, "the drafter's optimizer steps per RL step's idle window (GPU size)", int,
         replaces="TLT_E2E_WARM_STEPS", metavar="N"),
    Flag("--drift", 2, "RL updates (target fine-tunes) before the timed rollout; 0: no drift, one drafter", int,
         replaces="TLT_E2E_DRIFT", metavar="N"),
    Flag("--repeats", None, "times each row is run, the median kept (default: 3 on the GPU, 1 on the CPU)", int,
         replaces="TLT_E2E_REPEATS", metavar="N"),
    Flag("--arms", (), "comma-separated speculative arms, e.g. s2k1v3,s4k1v5 (default: the size's set; off is always "
         "an arm)", str_list, replaces="TLT_E2E_ARMS", metavar="LIST"),
    Flag("--deterministic", False, "train every model with deterministic kernels, so two runs on one card compare "
         "the same models", bool, replaces="TLT_E2E_DETERMINISTIC"),
    Flag("--target-dtype", "fp32", "the target's dtype on the GPU", str, ("fp32", "bf16", "fp16"), "TLT_E2E_DTYPE"),
    Flag("--drafter-dtype", None, "the rollout drafters' dtype (default: bf16 on the GPU, fp32 on the CPU)", str,
         ("fp32", "bf16"), "TLT_E2E_DRAFTER_DTYPE"),
    Flag("--attn", "auto", "the target's tree-attention backend (auto: the torch path for an fp32 target)", str,
         ("auto", "torch", "triton"), "TLT_E2E_ATTN"),
    Flag("--fuse", True, "one CUDA graph per decoding step (--no-fuse: verify, draft and extend graphs)", bool,
         replaces="TLT_E2E_FUSE"),
    Flag("--cache-dir", "", "keep the trained target here and reuse it on the next run of the same configuration",
         replaces="TLT_E2E_CACHE_DIR", metavar="DIR"),
    Flag("--write-trace", None, "also record an every-arm trace of the rollout to this JSON file (for the "
         "selector suite's --trace)", replaces="TLT_E2E_TRACE", metavar="PATH"),
    Flag("--write-steps", None, "write every row's step log to this JSON file", replaces="TLT_E2E_STEPS", metavar="PATH"),
    Flag("--plot", None, "also plot tokens/s over time to this PNG (needs matplotlib)", replaces="TLT_E2E_PLOT", metavar="PATH"),
)


def _sizes(small: bool, params=None) -> dict:
    """The run's sizes: the CPU smoke test's when ``small``, else the GPU's, from ``params`` (the flags; defaults when
    None)."""
    if small:
        return dict(cfg="tiny", train_steps=40, train_bs=8, train_seq=64, B=16, prompt_len=16, median=10, max_len=80,
                    warm_steps=300, warm_cap_s=10.0, train_window=(8, 32), drift_steps=20,
                    arms=((2, 1, 3), (4, 1, 5), (3, 2, 6), (4, 4, 12)))
    p = params if params is not None else defaults(FLAGS)
    if p.hidden <= 0 or p.hidden % 256:
        raise ValueError(f"--hidden must be a positive multiple of 256 (heads of 64, 4 per KV head), got {p.hidden}")
    return dict(cfg="medium", layers=p.layers, hidden=p.hidden,
                train_steps=p.train_steps, train_bs=32, train_seq=256,
                B=p.batch, prompt_len=64, median=64, max_len=896,
                warm_steps=p.warm_steps, warm_cap_s=120.0,
                train_window=(16, 128), drift_steps=200,
                # Cheap chains win at large batch sizes, deep trees in the tail (the recorded traces in bench/traces):
                # the arm set spans both so that the selector has a choice to make.
                arms=((1, 1, 2), (2, 1, 3), (3, 1, 4), (4, 1, 5), (4, 2, 8), (5, 4, 16), (6, 4, 24), (8, 4, 32)))


def target_config(hidden: int, layers: int):
    """The GPU target's shape: ``hidden`` wide (a multiple of 256), ``layers`` deep, SwiGLU 3x, heads of 64 with
    4 query heads per KV head (the e2e suite and ``tools.profile_e2e`` build the same model)."""
    from tlt_kernels.models import ModelConfig

    return ModelConfig.small(hidden_size=hidden, intermediate_size=3 * hidden, num_layers=layers,
                             num_q_heads=hidden // 64, num_kv_heads=hidden // 256, head_dim=64)


def _cached_target(cfg, z: dict, dev, det: bool, train, training, cache_dir: str):
    """The trained target, from ``cache_dir`` (``--cache-dir``; "" for none) when an earlier run on this machine saved
    one for the same configuration (shape, training sizes, device name, torch version, deterministic flag), else
    trained and saved there. Training is most of an e2e run's setup, so back-to-back A/B runs on one machine (a
    kernel or selector change) compare the same target and skip it. Returns ``(model, path or None)``."""
    import dataclasses
    import json
    from pathlib import Path

    from tlt_kernels.models import LlamaForCausalLM

    cache_dir = cache_dir.strip()
    if not cache_dir:
        with training():
            return train(), None
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    key = json.dumps(dict(cfg=dataclasses.asdict(cfg), steps=z["train_steps"], bs=z["train_bs"], seq=z["train_seq"],
                          device=name, torch=torch.__version__, deterministic=det), sort_keys=True, default=str)
    path = Path(cache_dir) / f"e2e-target-{hashlib.sha256(key.encode()).hexdigest()[:16]}.pt"
    if path.exists():
        with torch.random.fork_rng(devices=[]):  # as training leaves it: the global RNG untouched
            model = LlamaForCausalLM(cfg)
        model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        return model.to(dev).eval(), path
    with training():
        model = train()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, tmp)
    tmp.replace(path)  # atomic: a run stopped mid-write leaves no half file under the real name
    return model, None


def _copy_selector(sel):
    """A deep copy of a selector's state that shares its ``available`` callback (an engine's bound method: a
    deep copy would copy the engine, its graphs and caches with it)."""
    avail, sel.available = sel.available, None
    try:
        twin = copy.deepcopy(sel)
    finally:
        sel.available = avail
    twin.available = avail
    return twin


def _lengths(B: int, median: int, max_len: int, gen: torch.Generator) -> list:
    """Log-normal response lengths (sigma 1), clamped, at the B stratified quantiles ``(i + 0.5) / B`` of the normal
    (in ``gen``'s random order over the prompts): the longest is ~14x the median at B=128 (the top quantile's
    e^2.66), as "most short, a few 10x longer" asks; independent draws left the longest to the seed."""
    z = torch.special.ndtri((torch.arange(B, dtype=torch.float64) + 0.5) / B)[torch.randperm(B, generator=gen)]
    return [int(min(max_len, max(2, round(median * math.exp(float(v)))))) for v in z]


def _digest(tokens) -> str:
    """A short fingerprint of a rollout's output tokens (rows compare rollouts across runs and machines by it)."""
    return hashlib.sha256(repr(tokens).encode()).hexdigest()[:16]


def _tail_seconds(out, B0: int) -> float:
    return sum(s.seconds for s in tail_steps(out.steps, B0))


def batch_bin(b: int, bins_per_octave: int = 4) -> int:
    """The oracle's geometric batch-size bin: ``bins_per_octave`` bins per doubling."""
    return int(math.floor(math.log2(max(b, 1)) * bins_per_octave))


def oracle_bins(statics: dict, ref, bins_per_octave: int = 4) -> dict:
    """Per batch-size bin of ``ref``'s steps: ``{bin: dict(batches, tokens, seconds, best, rate)}``: ``ref``'s batch
    sizes, emitted tokens and step seconds in the bin, and the static run (a key of ``statics``) with the best
    tokens/s there, sum(emitted) / sum(seconds) over its steps in the bin (``best`` None, ``rate`` 0 where no static
    run has the bin). Runs are anything with ``.steps`` of ``.batch_size``, ``.emitted``, ``.seconds``."""
    rates: dict = {}
    for name, out in statics.items():
        tokens: dict = {}
        seconds: dict = {}
        for s in out.steps:
            k = batch_bin(s.batch_size, bins_per_octave)
            tokens[k] = tokens.get(k, 0) + s.emitted
            seconds[k] = seconds.get(k, 0.0) + s.seconds
        for k, t in tokens.items():
            if seconds[k] > 0 and t / seconds[k] > rates.get(k, (None, 0.0))[1]:
                rates[k] = (name, t / seconds[k])
    bins: dict = {}
    for s in ref.steps:
        k = batch_bin(s.batch_size, bins_per_octave)
        best, rate = rates.get(k, (None, 0.0))
        e = bins.setdefault(k, dict(batches=set(), tokens=0, seconds=0.0, best=best, rate=rate))
        e["batches"].add(s.batch_size)
        e["tokens"] += s.emitted
        e["seconds"] += s.seconds
    return bins


def _static_oracle_s(statics: dict, ref, bins_per_octave: int = 4) -> float:
    """Estimated wall seconds of ``ref``'s rollout had every step used the static arm with the best measured
    throughput at its batch size (:func:`oracle_bins`): ``ref``'s tokens in each bin are charged at the best arm's
    rate (at its own rate where no static run has the bin); ``ref``'s time outside the steps (prefill) is kept. An
    estimate from the runs' step logs, not a run: it bounds what any per-batch-size choice among the static arms
    could gain over the best single one."""
    total = ref.wall_s - sum(s.seconds for s in ref.steps)
    for e in oracle_bins(statics, ref, bins_per_octave).values():
        total += e["tokens"] / e["rate"] if e["rate"] > 0 else e["seconds"]
    return total


def _ascii_curve(outs: dict, width: int = 60) -> str:
    """Tokens/s over normalized time, one row per run (8 levels), so the tail is visible in text."""
    levels = " .:-=+*#"
    peak = max(max((s.tokens_per_s for s in o.steps), default=1.0) for o in outs.values())
    lines = [f"tokens/s over time (each row spans its own wall time; peak {peak:,.0f} tok/s = '#')"]
    name_width = max(len(name) for name in outs)
    for name, o in outs.items():
        cells = [0.0] * width
        for s in o.steps:
            i = min(width - 1, int(width * s.elapsed_s / max(o.wall_s, 1e-9)))
            cells[i] = max(cells[i], s.tokens_per_s)
        lines.append(f"{name:>{name_width}} |" + "".join(levels[min(7, int(8 * c / peak))] for c in cells) + f"| {o.wall_s:.2f}s")
    return "\n".join(lines)


def _plot(outs: dict, path: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:  # optional
        return f"plot skipped ({exc})"
    fig, ax = plt.subplots(figsize=(8, 4))
    for name, o in outs.items():
        ax.plot([s.elapsed_s for s in o.steps], [s.tokens_per_s for s in o.steps], label=name, lw=1)
    ax.set_xlabel("seconds since rollout start")
    ax.set_ylabel("tokens/s (per step)")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return f"plot written to {path}"


def _parse_arms(params, sizes: dict) -> list:
    """The speculative arms of the static rows and the selector: ``--arms`` or the size's set (off is implied)."""
    from tlt_kernels.runtime import Strategy

    arms = [Strategy.parse(a) for a in params.arms] if params.arms else [Strategy(*a) for a in sizes["arms"]]
    if not arms or any(a.is_off for a in arms):
        raise ValueError(f"--arms must list speculative strategies like 's4k1v5' (off is always an arm), got {','.join(params.arms)!r}")
    return arms


class _E2ERun:
    """One e2e run's state, built phase by phase (the module docstring's steps 1-4) by the methods below."""

    def __init__(self, ctx):
        self.t_suite = time.perf_counter()
        self.ctx = ctx
        self.params = values(ctx, FLAGS)
        self.sizes = _sizes(ctx.small, self.params)
        self.arms = _parse_arms(self.params, self.sizes)
        self.dev = ctx.device
        self.cuda = self.dev.type == "cuda"
        self.gen = torch.Generator().manual_seed(0)
        # --deterministic: every training stage (target, drafter warm-up, RL updates, spot training) runs with
        # deterministic kernels, so two runs on the same card train the same models and their rows differ only by
        # timing.
        self.det = bool(self.params.deterministic)
        self.nondet_ops: set = set()
        self.outs: dict = {}  # per timed row: its median run
        self.walls: dict = {}  # per timed row: every run's wall ms
        self.same: dict = {}  # per timed row: whether every run emitted the same tokens

    def training(self):
        """The context every training stage runs in (deterministic kernels with ``--deterministic``)."""
        from tlt_kernels.models import deterministic_training

        return deterministic_training(self.det, self.nondet_ops)

    def train_target(self) -> None:
        """1. The target: trained here (or loaded from ``--cache-dir``), in ``--target-dtype`` on the GPU; noted."""
        from tlt_kernels.models import ModelConfig, train_tiny_target

        z, p = self.sizes, self.params
        t0 = time.perf_counter()
        if z["cfg"] == "tiny":
            cfg = ModelConfig.tiny()
        else:
            # Depth matters more than width here: the EAGLE drafter is one decoder layer, so what one draft step costs
            # next to a target pass is about 1 / num_layers (a real 7B target has 28 layers). --layers overrides.
            # Width sets how much a verified token costs next to a step's fixed cost: a real target's verify pass at
            # batch 128 x 16 tokens is compute-bound (tens of times a plain step), a narrow toy's barely more than a
            # plain step. --hidden (a multiple of 256) overrides; heads of 64, 4 query heads per KV head.
            cfg = target_config(z["hidden"], z["layers"])
        target, cached = _cached_target(cfg, z, self.dev, self.det, lambda: train_tiny_target(
            cfg, steps=z["train_steps"], device=self.dev, batch_size=z["train_bs"], seq_len=z["train_seq"]),
            self.training, p.cache_dir)
        # fp32 by default: plain decoding and tree verification reduce in different orders, and in bf16 that flips
        # greedy near-ties, so "greedy outputs identical" would measure rounding, not the engine.
        # --target-dtype bf16 runs the bf16 kernels instead.
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[p.target_dtype]
        if self.cuda:
            target = target.to(dtype)
        self.target = target
        num_params = sum(w.numel() for w in target.parameters())
        self.ctx.note(f"target {z['cfg']} ({cfg.num_layers} layers, {num_params / 1e6:.1f}M params, {target.dtype}) "
                      + (f"trained {z['train_steps']} steps: loaded from {cached} (--cache-dir)" if cached else
                         f"trained {z['train_steps']} steps in {time.perf_counter() - t0:.1f}s"))

    def plan_rollout(self) -> None:
        """The timed rollout's prompts and response lengths, its engines' graph sizes, ``--fuse`` and ``--attn``."""
        from tlt_kernels.models import load_corpus
        from tlt_kernels.models.train_tiny import sample_windows

        ctx, z = self.ctx, self.sizes
        self.corpus = load_corpus("base")
        B = self.batch = z["B"]
        self.prompts = sample_windows(self.corpus, B, z["prompt_len"], self.gen).to(self.dev)
        lens = self.lens = _lengths(B, z["median"], z["max_len"], self.gen)
        self.max_seq = z["prompt_len"] + max(lens)
        ctx.note(f"rollout: B={B}, prompt {z['prompt_len']} tokens, response lengths median {sorted(lens)[B // 2]}, "
                 f"max {max(lens)}, total {sum(lens)} tokens (log-normal, sigma 1)")
        self.graph_sizes = sorted({1, 2, 4, 8, 16, 32, 64, 128, 256, B} & set(range(1, B + 1)))
        # One graph per decoding step (SpeculativeEngine(fuse_step=True)) for every run, plain included: one launch
        # per step instead of several, each graph launch costing host time (docs/RUNTIME.md, "The e2e suite's
        # settings"); --no-fuse for separate graphs.
        self.fuse = self.cuda and bool(self.params.fuse)
        ctx.note(f"graphs per step: {'one fused step graph' if self.fuse else 'verify + draft + extend graphs'} (--fuse)")
        # Tree attention of the target's verify pass: "auto" (an fp32 target runs the op's torch path: a gather of
        # every request's padded context per layer, which dominates a step) or "triton" (the exact-fp32 Triton
        # kernel). "triton" speeds plain decoding more than the speculative arms, so it shrinks the adaptive engine's
        # margin; the default stays "auto" (docs/RUNTIME.md, "The e2e suite's settings").
        self.attn = self.params.attn
        ctx.note(f"target tree attention: backend={self.attn!r} (--attn)")

    def engine(self, drafter, sel, **kw):
        """A SpeculativeEngine of the target for ``drafter`` and ``sel``, its graphs captured (GPU) and warmed up."""
        from tlt_kernels.engine import SpeculativeEngine
        from tlt_kernels.runtime import GraphPool

        ctx = self.ctx
        t_build = time.perf_counter()
        eng = SpeculativeEngine(self.target, drafter, sel, GraphPool() if self.cuda else None, max_batch_size=self.batch,
                                max_seq_len=self.max_seq, fuse_step=self.fuse, backend=self.attn, **kw)
        if self.cuda:
            st = eng.capture_graphs(self.graph_sizes)
            if eng.graph_retry_error:
                ctx.note(f"graph capture of {sel} failed once and was retried ({eng.graph_retry_error})")
            if eng.graph_error:
                ctx.note(f"graph capture failed ({eng.graph_error}); that run verified eagerly")
            else:
                ctx.note(f"graphs for {sel}: {st['graphs']} captured in {st['capture_seconds']:.1f}s")
        # Warm-up (lazy imports, kernel compilation, allocator) so the timed rollout is steady state.
        buffer, eng.rollout_buffer = eng.rollout_buffer, None
        t_warm = time.perf_counter()
        eng.generate(self.prompts[:2], 4)
        eng.rollout_buffer = buffer
        ctx.progress(f"engine for {sel}: built and captured in {t_warm - t_build:.1f} s, warm-up rollout "
                     f"{time.perf_counter() - t_warm:.1f} s")
        return eng

    def spot_train(self):
        """Trains the drafter for one RL step's idle window; returns the trainer's stats."""
        # A fixed number of optimizer steps, not a time budget: with a time budget, two machines of the same card
        # trained different numbers of steps, so each run's drafter, and its acceptance, depended on the machine's
        # speed. The cap only stops a pathologically slow machine (docs/RUNTIME.md, "The e2e suite's settings").
        with self.training():
            return self.trainer.run(max_steps=self.sizes["warm_steps"], time_budget_s=self.sizes["warm_cap_s"])

    def warm_up_drafter(self) -> None:
        """2. RL step 0: a plain rollout fills a RolloutBuffer and the EAGLE drafter is trained on it (the warm-up)."""
        from tlt_kernels.drafter import EagleDrafter, RolloutBuffer, SpotTrainer
        from tlt_kernels.models.train_tiny import sample_windows
        from tlt_kernels.runtime import Strategy

        ctx, z, cuda = self.ctx, self.sizes, self.cuda
        self.buffer = RolloutBuffer(capacity_tokens=1 << 22, storage_dtype=torch.float32 if not cuda else torch.bfloat16,
                                    pin_memory=cuda)  # pinned: adding a finished request never waits for the GPU
        self.prev_prompts = sample_windows(self.corpus, self.batch, z["prompt_len"], self.gen).to(self.dev)
        self.plain_engine = self.engine(None, Strategy.off(), rollout_buffer=self.buffer)
        self.plain_engine.generate(self.prev_prompts, self.lens)
        self.train_drafter = EagleDrafter.for_target(self.target, seed=0)  # the same initial drafter in every run
        self.trainer = SpotTrainer(self.train_drafter, self.buffer, lr=1e-3, warmup_steps=20,
                                   batch_size=z["train_window"][0], seq_len=z["train_window"][1],
                                   autocast_dtype=torch.bfloat16 if cuda else None)
        st = self.spot_train()
        if st.optimizer_steps < z["warm_steps"]:
            ctx.note(f"drafter warm-up stopped at its {z['warm_cap_s']:.0f} s cap after {st.optimizer_steps} of "
                     f"{z['warm_steps']} steps: this run's drafter is weaker than the configuration's")
        ctx.note(f"drafter warm-up: {st.optimizer_steps} steps in {st.elapsed_s:.1f}s, loss {st.last_loss}")
        # The drafter a static deployment keeps: trained once, for the policy of RL step 0.
        self.frozen_state = {k: v.detach().clone() for k, v in self.train_drafter.state_dict().items()}

    def drift_policy(self) -> None:
        """3. The policy drifts: ``--drift`` RL updates before the timed rollout, the drafter spot-trained between."""
        # Each RL update is a fine-tune of the target on the shifted mix, in place. Between two updates the rollout of
        # that RL step runs, its long tail leaves GPUs idle, and the spot trainer trains the drafter on it (a fixed
        # number of steps, the idle window); the timed rollout's drafter is then one RL step behind its policy, as in
        # TLT, while the frozen one is --drift steps behind.
        from tlt_kernels.models import finetune_target, shifted_corpus
        from tlt_kernels.models.train_tiny import sample_windows

        ctx, z = self.ctx, self.sizes
        drift = self.drift = int(self.params.drift)
        if drift < 0:
            raise ValueError(f"--drift must be >= 0 (RL updates before the timed rollout), got {drift}")
        shifted = shifted_corpus()
        for step in range(1, drift + 1):
            t_rl = time.perf_counter()
            with self.training():
                loss = finetune_target(self.target, shifted, z["drift_steps"], self.gen, lr=1e-3,
                                       batch_size=z["train_bs"], seq_len=z["train_seq"])
            line = f"RL update {step}: target fine-tuned {z['drift_steps']} steps on the shifted mix (loss {loss:.3f}) in {time.perf_counter() - t_rl:.1f}s"
            if step < drift:
                self.plain_engine.generate(sample_windows(self.corpus, self.batch, z["prompt_len"], self.gen).to(self.dev),
                                           self.lens)
                # The same idle-window budget as RL step 0's warm-up: every RL step's tail leaves the GPUs as idle.
                st = self.spot_train()
                line += f"; its rollout spot-trained the drafter {st.optimizer_steps} steps in {st.elapsed_s:.1f}s (loss {st.last_loss})"
            ctx.note(line)
        self.spot_state = {k: v.detach().clone() for k, v in self.train_drafter.state_dict().items()}
        if self.det:
            ctx.note("deterministic training (--deterministic): "
                     + ("ops without a deterministic kernel (still nondeterministic): " + "; ".join(sorted(self.nondet_ops))
                        if self.nondet_ops else "no op warned of a nondeterministic kernel"))

    def choose_drafter_dtype(self) -> None:
        """The rollout drafters' dtype (``--drafter-dtype``), noted."""
        # The rollout's drafter copies draft in bf16 on the GPU (--drafter-dtype fp32 to change): drafts never
        # change the output (verification is lossless), only how many are accepted; the trainer keeps fp32 weights.
        self.draft_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[
            self.params.drafter_dtype or ("bf16" if self.cuda else "fp32")]
        self.ctx.note(f"rollout drafter dtype {self.draft_dtype} (--drafter-dtype); trainer weights float32")

    def drafter_copy(self, state):
        """A rollout drafter (in the rollout's drafter dtype) holding the weights ``state``."""
        from tlt_kernels.drafter import EagleDrafter

        drafter = EagleDrafter.for_target(self.target, dtype=self.draft_dtype)
        drafter.load_state_dict(state)
        return drafter

    def choose_repeats(self) -> None:
        """4. The rollout's ``--repeats``: how many times each row runs (validated)."""
        # Every configuration runs on the same prompts, --repeats times each (default 3 on the GPU, 1 on the CPU): the
        # row keeps the run of median wall time (the upper one of an even count) and every run's tokens must match.
        # One rollout varies between runs by as much as the selector's margins (docs/RUNTIME.md, "The e2e suite's
        # settings").
        p = self.params
        self.repeats = int(p.repeats if p.repeats is not None else 3 if self.cuda else 1)
        if self.repeats < 1:
            raise ValueError(f"--repeats must be >= 1, got {self.repeats}")

    def timed(self, name: str, run_once) -> None:
        """Runs the rollout ``run_once`` ``repeats`` times and records row ``name``'s median run."""
        runs = []
        for _ in range(self.repeats):
            runs.append(run_once())
            o = runs[-1]
            if o.errors:  # shorter outputs would time as a faster rollout
                raise RuntimeError(f"{name}: the target's logits held NaN/+inf for requests {o.errors}; "
                                   "a rollout that stops requests early is not a measurement")
            self.ctx.progress(f"{name}: {o.wall_s * 1e3:.1f} ms, {len(o.steps)} steps, tail {_tail_seconds(o, self.batch):.3f} s, "
                              f"accepted {o.mean_accepted_length():.3f} (suite at {time.perf_counter() - self.t_suite:.0f} s)")
        self.outs[name] = sorted(runs, key=lambda o: o.wall_s)[len(runs) // 2]
        self.walls[name] = [round(o.wall_s * 1e3, 1) for o in runs]
        self.same[name] = all(o.tokens == runs[0].tokens for o in runs)

    def time_plain_and_statics(self) -> None:
        """Times the ``plain`` row and the ``static-<s>`` rows."""
        prompts, lens = self.prompts, self.lens
        self.plain_engine.rollout_buffer = None
        self.timed("plain", lambda: self.plain_engine.generate(prompts, lens))
        # Each static arm once with the frozen drafter (a static deployment: fixed strategy, drafter never retrained)
        # and, with drift, once more with the spot-trained drafter loaded into the same engine (in place: its graphs
        # replay the new weights), which isolates what the selector alone adds.
        for s in self.arms:
            eng_s = self.engine(self.drafter_copy(self.frozen_state), s)
            self.timed(f"static-{s}", lambda: eng_s.generate(prompts, lens))
            if self.drift:
                eng_s.drafter.load_state_dict(self.spot_state)
                self.timed(f"static-{s} (spot drafter)", lambda: eng_s.generate(prompts, lens))

    def time_adaptive(self) -> None:
        """Times the ``adaptive``, ``adaptive (warm)`` and ``adaptive+spot-in-tail`` rows."""
        # The adaptive engine: selector + the spot-trained drafter, one engine for its three rows. TLT trains the
        # drafter on GPUs the long tail leaves idle (other ranks); on this one GPU, training during the rollout
        # competes with it (and with its Python thread for the GIL), so that is a separate row.
        from tlt_kernels.runtime import StrategySelector

        prompts, lens, arms = self.prompts, self.lens, self.arms
        ad = self.adaptive_engine = self.engine(self.drafter_copy(self.spot_state), StrategySelector(arms, seed=0))
        table = None
        if self.cuda and not ad.graph_error:  # the cost policy's start-up table: each arm's graphs replayed at every captured size
            t_table = time.perf_counter()
            table = ad.measure_cost_table()
            self.ctx.progress(f"cost table measured in {time.perf_counter() - t_table:.1f} s")

        def fresh_selector():
            return StrategySelector(arms, seed=0, cost_table=table, available=ad.covers if table else None)

        def cold_run():
            ad.selector = fresh_selector()  # a new selector every run
            return ad.generate(prompts, lens)

        self.timed("adaptive", cold_run)
        # In RL training the selector lives across rollouts: "adaptive (warm)" keeps the one that decoded the previous
        # step's prompts, so the timed rollout pays no first-visit exploration.
        ad.selector = fresh_selector()
        ad.generate(self.prev_prompts, lens)
        warmed = _copy_selector(ad.selector)

        def warm_run():
            ad.selector = _copy_selector(warmed)  # every run starts from the selector of the previous step
            return ad.generate(prompts, lens)

        self.timed("adaptive (warm)", warm_run)
        # Spot training changes the drafter as it runs, so this row is run once whatever --repeats says, and last.
        ad.selector, ad.spot_trainer, ad.rollout_buffer = fresh_selector(), self.trainer, self.buffer
        self.outs["adaptive+spot-in-tail"] = ad.generate(prompts, lens)
        ad.spot_trainer = ad.rollout_buffer = None
        self.walls["adaptive+spot-in-tail"] = [round(self.outs["adaptive+spot-in-tail"].wall_s * 1e3, 1)]
        self.same["adaptive+spot-in-tail"] = True

    def write_trace(self) -> None:
        """``--write-trace``: a recorded trace for the selector suite (its --trace), every arm probed per step."""
        import json

        from tlt_kernels.runtime import StrategySelector

        trace_path = self.params.write_trace
        if not trace_path:
            return
        records = []
        self.engine(self.drafter_copy(self.spot_state), StrategySelector(self.arms, seed=0)).generate(
            self.prompts, self.lens, trace=records)
        with open(trace_path, "w") as f:
            json.dump(records, f)
        self.ctx.note(f"engine trace of {len(records)} steps written to {trace_path} (replay: python -m bench selector --trace {trace_path})")

    def write_step_logs(self) -> None:
        """``--write-steps``: every row's step log (its median run), for offline comparison with the oracle."""
        import dataclasses
        import json

        steps_path = self.params.write_steps
        if not steps_path:
            return
        with open(steps_path, "w") as f:
            json.dump({name: [dataclasses.asdict(st) for st in o.steps] for name, o in self.outs.items()}, f)
        self.ctx.note(f"step logs of {len(self.outs)} rows written to {steps_path} (--write-steps)")


def _best_statics(outs: dict):
    """``(best_name, best_spot_name, spot_statics)``: the fastest static row with the frozen and the spot drafter."""
    # The target's comparison: the best static arm as deployed (frozen drafter). With drift, the same arms with the
    # spot-trained drafter are reported too (the selector's gain alone), and the oracle is taken over those: they are
    # the arms the selector chooses among. Without drift both are the frozen rows.
    statics = {k: v for k, v in outs.items() if k.startswith("static-") and not k.endswith("(spot drafter)")}
    spot_statics = {k: v for k, v in outs.items() if k.endswith("(spot drafter)")} or statics
    best_name = min(statics, key=lambda k: statics[k].wall_s)
    best_spot_name = min(spot_statics, key=lambda k: spot_statics[k].wall_s)
    return best_name, best_spot_name, spot_statics


def _add_rows(e2e: _E2ERun, best_name: str, best_spot_name: str) -> None:
    """One row per timed configuration: wall ms, throughput, tail, acceptance, greedy identity and speedups."""
    outs, B, lens = e2e.outs, e2e.batch, e2e.lens
    plain, ref = outs["plain"], outs["plain"].tokens
    best, best_spot = outs[best_name], outs[best_spot_name]
    tail_plain = _tail_seconds(plain, B)
    case = {"B": B, "tokens": sum(lens), "max_len": max(lens)}
    for name, o in outs.items():
        tail = _tail_seconds(o, B)
        extra = dict(
            tokens_per_s=round(o.tokens_per_s, 1), tail_s=round(tail, 4), accepted_length=round(o.mean_accepted_length(), 3),
            steps=len(o.steps), greedy_identical=o.tokens == ref and e2e.same[name], output_sha=_digest(o.tokens),
            runs_ms=e2e.walls[name],
            speedup_vs_plain=round(plain.wall_s / o.wall_s, 3),
            tail_speedup_vs_plain=round(tail_plain / tail, 3) if tail > 0 else None,
            graph_steps=sum(s.graph for s in o.steps),
        )
        if name.startswith("adaptive"):
            extra["speedup_vs_best_static"] = round(best.wall_s / o.wall_s, 3)
            extra["best_static"] = best_name
            extra["speedup_vs_best_static_spot_drafter"] = round(best_spot.wall_s / o.wall_s, 3)
            if o.spot:
                extra["spot_steps"] = o.spot.get("optimizer_steps")
        e2e.ctx.add(case, name, o.wall_s * 1e3, **extra)


def _note_speedups(e2e: _E2ERun, best_name: str, best_spot_name: str, spot_statics: dict) -> None:
    """Notes: the adaptive rows against plain and the best static arms, the oracle, and greedy identity."""
    ctx, outs, B, drift = e2e.ctx, e2e.outs, e2e.batch, e2e.drift
    plain, ref = outs["plain"], outs["plain"].tokens
    best, best_spot = outs[best_name], outs[best_spot_name]
    tail_plain = _tail_seconds(plain, B)
    for name in ("adaptive", "adaptive (warm)"):
        a = outs[name]
        ctx.note(
            f"{name} vs plain: {plain.wall_s / a.wall_s:.2f}x rollout (target 2x), "
            f"{tail_plain / max(_tail_seconds(a, B), 1e-9):.2f}x tail (target 2.5x); vs best static ({best_name}, "
            f"{'frozen' if drift else 'same'} drafter): {best.wall_s / a.wall_s:.2f}x (target 1.1x)"
            + (f"; vs the best static arm with the same spot-trained drafter ({best_spot_name}, the selector alone): "
               f"{best_spot.wall_s / a.wall_s:.2f}x" if drift else "")
            + f"; greedy identical: {a.tokens == ref}"
        )
    oracle = _static_oracle_s(spot_statics, outs["adaptive (warm)"])
    ctx.note(f"per-batch-size oracle over the static arms{' with the spot-trained drafter' if drift else ''} (estimated "
             f"from their step logs, not run): {oracle:.3f} s, {best_spot.wall_s / oracle:.2f}x the best of them: the most "
             f"any per-batch-size choice among these arms could gain on this workload")
    ctx.note(f"greedy identical in every run: {all(o.tokens == ref for o in outs.values()) and all(e2e.same.values())} "
             f"({e2e.repeats} run(s) per row, --repeats; `ms` is the median run's)")


def _note_strategies_and_curve(e2e: _E2ERun) -> None:
    """Notes: the adaptive row's strategies per batch size, and tokens/s over time (a PNG too with ``--plot``)."""
    ctx, outs = e2e.ctx, e2e.outs
    by_batch = outs["adaptive"].strategies_by_batch()
    lines = ["adaptive: strategies chosen per batch size (steps)"]
    for bsz in sorted(by_batch, reverse=True):
        lines.append(f"  B={bsz:>4}: " + ", ".join(f"{k} x{v}" for k, v in sorted(by_batch[bsz].items(), key=lambda kv: -kv[1])))
    ctx.note("\n".join(lines))
    ctx.note(_ascii_curve(outs))
    path = e2e.params.plot
    if path:
        ctx.note(_plot(outs, path))


def run(ctx) -> None:
    e2e = _E2ERun(ctx)
    e2e.train_target()
    e2e.plan_rollout()
    e2e.warm_up_drafter()
    e2e.drift_policy()
    e2e.choose_drafter_dtype()
    e2e.choose_repeats()
    e2e.time_plain_and_statics()
    e2e.time_adaptive()
    e2e.write_trace()
    e2e.write_step_logs()
    best_name, best_spot_name, spot_statics = _best_statics(e2e.outs)
    _add_rows(e2e, best_name, best_spot_name)
    _note_speedups(e2e, best_name, best_spot_name, spot_statics)
    _note_strategies_and_curve(e2e)
