"""``rollout_step``: a decoding step's token bookkeeping (emit up to budget and EOS, commit the accepted path, the
staging vector for the host) in one Triton launch (:mod:`tlt_kernels._triton.rollout_step`).

Not a registered op: its torch path is :class:`tlt_kernels.engine.state.RolloutState`'s ``emit``, ``commit`` and
``stage_counts`` (the engine's state, which this layer may not import); :meth:`RolloutState.finish_step` picks one.
Triton is imported at the first call, never at package import.
"""
from __future__ import annotations

from typing import Optional

from .._backend import triton_interpret_enabled

MAX_ROWS = 1024  # the kernel's one program holds every row (tlt_kernels._triton.rollout_step.MAX_ROWS)


def can_run_on(device) -> bool:
    """Whether the kernel runs on tensors of ``device``: CUDA, or the CPU under Triton's interpreter."""
    return device.type == "cuda" or triton_interpret_enabled()


def rollout_step(rows, emitted, num_accepted, error, new_context_lens, eos_token_id: Optional[int], depth: int,
                 output_tokens, generated, max_new_tokens, done, context_lens, offsets, root_tokens,
                 block_rows: Optional[int] = None, block_tokens: Optional[int] = None):
    """See :func:`tlt_kernels._triton.rollout_step.rollout_step` (shapes, dtypes, what is updated in place; the block
    bounds that let every step share one compiled kernel).
    Raises ValueError naming ``emitted`` when its device cannot run the kernel (CPU without the interpreter)."""
    if not can_run_on(emitted.device):
        raise ValueError(f"rollout_step: emitted is on {emitted.device}; the kernel needs CUDA tensors "
                         "(or TRITON_INTERPRET=1 on the CPU)")
    from .._triton.rollout_step import rollout_step as launch

    return launch(rows, emitted, num_accepted, error, new_context_lens, eos_token_id, depth,
                  output_tokens, generated, max_new_tokens, done, context_lens, offsets, root_tokens,
                  block_rows=block_rows, block_tokens=block_tokens)
