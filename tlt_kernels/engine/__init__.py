"""Speculative rollout engine: the package's ops, target model, drafters and runtime put together.

* :class:`SpeculativeEngine` -- ``generate(prompts, max_new_tokens, temperature, top_k, top_p, seed)``
  for a rollout batch whose requests finish at different lengths (the long tail);
* :class:`GenerateOutput` / :class:`StepLog` -- tokens plus the per-step log (batch size, strategy,
  accepted length, tokens/s).

See ``docs/INTEGRATION.md`` for how an external engine calls the ops directly.
"""
from .engine import GenerateOutput, SpeculativeEngine, StepLog, tree_width

__all__ = ["GenerateOutput", "SpeculativeEngine", "StepLog", "tree_width"]
