"""Suite "group-drafting": n-gram drafts from a request's group (its GRPO siblings) against drafts from its own
history alone, on the real default model (SmolLM2-135M-Instruct, or ``--model-file``; a tiny random model on the CPU).

A batch holds ``P`` arithmetic word problems (``--prompts``) x ``G`` responses each (``--group-sizes``), B = P x G
requests sampled at ``--temperature`` (1.0, as GRPO samples) with EOS on, through our engine (CUDA graphs on the GPU).
Per static n-gram arm (``--arms``) one engine decodes the batch twice: with ``generate(groups=)`` (impl
``group <arm>``: each request drafts from its own history and, where that has no match, from its siblings', finished
ones included) and without (``self <arm>``); ``plain`` is plain decoding. The policy is the model as loaded (no RL
update). Every row sums ``--rollouts`` timed rollouts, each on problems of its own, after one untimed warm-up on
others: ``ms`` = their wall time (so ``speedup_vs`` compares the ways on the same batches), ``tokens_per_s``,
``accepted_length`` (tokens per request per step, bonus included), ``tail_accepted_length`` (the same over the steps
with fewer than a quarter of the requests left: where the finished siblings' text is the draft source the suite
measures), ``steps`` and ``tokens``. Sampled outputs differ between the ways (each consumes its own random stream),
so each way's response lengths, and its tail, are its own.
"""
from __future__ import annotations

from typing import Dict, List, Sequence

from tlt_kernels.engine.probe import synced_seconds
from tlt_kernels.engine.records import tail_steps

from ..flags import PREFILL_LENGTHS_FLAG, Flag, int_list, positive_int, prefill_buckets, str_list, values
from ..rl_task import problems
from . import rl

SUITE = "group-drafting"
MAX_GROUP_SIZE = 16  # the n-gram drafter's siblings per request in the fused step (NGramRolloutDrafter)

FLAGS = (
    *rl.MODEL_FLAGS,
    Flag("--group-sizes", None, f"comma-separated responses per problem, G, each in [2, {MAX_GROUP_SIZE}] "
         "(default: 8,16; small 3)", int_list, metavar="LIST"),
    Flag("--prompts", None, "comma-separated problems per batch, P (B = P x G) (default: 1,4,8; small 1,2)", int_list,
         metavar="LIST"),
    Flag("--arms", ("s2k1v3", "s4k1v5"), "comma-separated static n-gram arms", str_list, metavar="LIST"),
    Flag("--max-new-tokens", None, "response budget (default: 256; small 10)", positive_int),
    Flag("--temperature", 1.0, "sampling temperature (> 0)", float),
    Flag("--rollouts", None, "timed rollouts per row, each on problems of its own (default: 2; small 1)", positive_int),
    Flag("--seed", 0, "problem and sampling seed", int),
    PREFILL_LENGTHS_FLAG,
)


def _sizes(small: bool, p):
    pick = lambda value, big, tiny: value if value is not None else (tiny if small else big)  # noqa: E731
    groups, prompts = pick(p.group_sizes, (8, 16), (3,)), pick(p.prompts, (1, 4, 8), (1, 2))
    bad = [g for g in groups if not 2 <= g <= MAX_GROUP_SIZE]
    if bad or not groups:
        raise ValueError(f"--group-sizes must be in [2, {MAX_GROUP_SIZE}] (a group drafts from its siblings), "
                         f"got {groups}")
    if not prompts or min(prompts) < 1:
        raise ValueError(f"--prompts must be ints >= 1, got {prompts}")
    if not p.temperature > 0:
        raise ValueError(f"--temperature must be > 0 (GRPO samples its groups), got {p.temperature}")
    return groups, prompts, pick(p.max_new_tokens, 256, 10), pick(p.rollouts, 2, 1)


class GroupDraftingRun:
    """The policy, the problems' prompt ids and one engine per way."""

    def __init__(self, ctx):
        self.ctx, self.p = ctx, values(ctx, FLAGS)
        self.cuda = ctx.device.type == "cuda"
        self.groups, self.prompts, self.max_new, self.rollouts = _sizes(ctx.small, self.p)
        from tlt_kernels.runtime import Strategy

        self.arms = [Strategy.parse(a) for a in self.p.arms]
        if any(a.is_off for a in self.arms):
            raise ValueError(f"--arms are speculative n-gram arms (plain decoding is always a row), got {self.p.arms}")

    def load(self) -> None:
        """The policy and the prompt ids of every problem the rows use (each rollout's problems are its own)."""
        count = max(self.prompts) * (self.rollouts + 1)
        drawn = problems(count, self.p.seed)
        policy = rl.load_policy(self.ctx, self.p)
        self.model, self.eos = policy.ours, policy.eos
        self.prompt_ids = [policy.encode(problem) for problem in drawn]
        self.ctx.note(f"{len(drawn)} arithmetic word problems (seed {self.p.seed}), G in {list(self.groups)} responses "
                      f"each, P in {list(self.prompts)} problems per batch, {self.max_new} new tokens, temperature "
                      f"{self.p.temperature}, EOS {'on' if self.eos is not None else 'off'}; {self.rollouts} timed "
                      f"rollout(s) per row after a warm-up; policy {self.model.config.num_layers} layers, "
                      f"{self.model.dtype}")

    def engine(self, strategy):
        """Our engine with the n-gram drafter at one static arm (plain decoding for ``Strategy.off()``)."""
        from tlt_kernels.engine import SpeculativeEngine
        from tlt_kernels.runtime import GraphPool

        batch = max(self.groups) * max(self.prompts)
        capacity = max(len(p) for p in self.prompt_ids) + self.max_new + 1
        engine = SpeculativeEngine(self.model, None if strategy.is_off else "ngram", strategy,
                                   GraphPool() if self.cuda else None, max_batch_size=batch, max_seq_len=capacity,
                                   fuse_step=self.cuda, prefill_lengths=prefill_buckets(self.p.prefill_lengths,
                                                                                        capacity))
        if self.cuda:
            engine.capture_graphs(rl.capture_sizes(batch))
        return engine

    def batch(self, group_size: int, num_prompts: int, index: int):
        """Rollout ``index``'s prompts (problems ``[index * P, (index + 1) * P)``, each ``group_size`` times in a
        row) and their group ids."""
        first = index * num_prompts
        prompts = [self.prompt_ids[first + i // group_size] for i in range(num_prompts * group_size)]
        return prompts, [i // group_size for i in range(len(prompts))]

    def measure(self, engine, group_size: int, num_prompts: int, use_groups: bool) -> Dict[str, float]:
        """The summed outcome of ``--rollouts`` timed rollouts (after a warm-up on the last problems)."""
        totals = dict(seconds=0.0, tokens=0, steps=0, emitted=0, rows=0, tail_emitted=0, tail_rows=0)
        for index in [self.rollouts] + list(range(self.rollouts)):  # the warm-up first, on problems of its own
            prompts, groups = self.batch(group_size, num_prompts, index)
            seeds = [(self.p.seed + index) * 100_003 + i for i in range(len(prompts))]
            kwargs = dict(temperature=self.p.temperature, seed=seeds, eos_token_id=self.eos,
                          groups=groups if use_groups else None)
            seconds, out = synced_seconds(engine.device, lambda: engine.generate(prompts, self.max_new, **kwargs))
            if index == self.rollouts:
                continue
            tail = tail_steps(out.steps, len(prompts))
            totals["seconds"] += seconds
            totals["tokens"] += sum(len(t) for t in out.tokens)
            totals["steps"] += len(out.steps)
            totals["emitted"] += sum(s.emitted for s in out.steps)
            totals["rows"] += sum(s.batch_size for s in out.steps)
            totals["tail_emitted"] += sum(s.emitted for s in tail)
            totals["tail_rows"] += sum(s.batch_size for s in tail)
        return totals

    def add_row(self, group_size: int, num_prompts: int, impl: str, totals: Dict[str, float]) -> None:
        ratio = lambda a, b: round(a / b, 4) if b else None  # noqa: E731
        self.ctx.add({"G": group_size, "P": num_prompts, "B": group_size * num_prompts}, impl,
                     totals["seconds"] * 1e3, tokens_per_s=round(totals["tokens"] / totals["seconds"], 1),
                     accepted_length=ratio(totals["emitted"], totals["rows"]),
                     tail_accepted_length=ratio(totals["tail_emitted"], totals["tail_rows"]),
                     steps=totals["steps"], tokens=totals["tokens"])


def _ways(arms: Sequence) -> List[tuple]:
    """(impl, strategy, use_groups) of every row of a case: plain, then self and group per arm."""
    from tlt_kernels.runtime import Strategy

    ways = [("plain", Strategy.off(), False)]
    for arm in arms:
        ways += [(f"self {arm}", arm, False), (f"group {arm}", arm, True)]
    return ways


def run(ctx) -> None:
    state = GroupDraftingRun(ctx)
    state.load()
    engines: Dict[str, object] = {}
    for impl, strategy, use_groups in _ways(state.arms):
        key = str(strategy)
        if key not in engines:
            engines[key] = state.engine(strategy)
        for group_size in state.groups:
            for num_prompts in state.prompts:
                totals = state.measure(engines[key], group_size, num_prompts, use_groups)
                state.add_row(group_size, num_prompts, impl, totals)
        ctx.progress(f"{impl}: done")
