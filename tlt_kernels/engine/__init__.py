"""Speculative rollout engine: the package's ops, target model, drafters and runtime put together.

* :class:`SpeculativeEngine` -- ``generate(prompts, max_new_tokens, temperature, top_k, top_p, seed)``
  for a rollout batch whose requests finish at different lengths (the long tail);
* :class:`GenerateOutput` / :class:`StepLog` -- tokens plus the per-step log (batch size, strategy,
  accepted length, tokens/s).

The rollout is ``start -> while active: step -> finish`` (:mod:`.engine`), its state a :class:`.state.RolloutState`;
a step's propose -> verify -> accept runs through a :mod:`.step_runner` (separate or fused CUDA graphs) and any
:class:`tlt_kernels.drafter.Drafter`. See ``docs/INTEGRATION.md`` for how an external engine calls the ops directly.
"""
from .engine import GenerateOutput, SpeculativeEngine, StepLog, tree_width

__all__ = ["GenerateOutput", "SpeculativeEngine", "StepLog", "tree_width"]
