"""``generate``-compatible speculative generation for a ``transformers`` causal LM, our engine underneath.

Change one call in an existing script::

    out = model.generate(input_ids, attention_mask=mask, max_new_tokens=128, do_sample=True, temperature=0.7)
    out = speculative_generate(model, input_ids, attention_mask=mask, max_new_tokens=128, do_sample=True,
                               temperature=0.7)

The output has ``generate``'s layout: ``[B, L + N]`` int64, the input ids as given (padding included) followed by
each row's new tokens, rows that stopped early (EOS) padded with ``pad_token_id`` to the longest. Greedy output
equals ``generate``'s (lossless verification); sampled output has its law (temperature, then top-k, then top-p,
``generate``'s order; unset values come from the model's ``generation_config``, as there), drawn from per-request
Philox seeds (default: drawn from torch's default generator, so ``torch.manual_seed`` makes a run reproducible).

Supported models: those :meth:`tlt_kernels.models.LlamaForCausalLM.from_hf` reads (Llama, Mistral without sliding
windows, Qwen2, Qwen3); their weights are converted on each call of :func:`speculative_generate`. A loop that calls
it often keeps a :class:`SpeculativeGenerator` (converted weights and the engine, with CUDA graphs on a GPU) and calls
its ``refresh()`` after the model's weights change (an optimizer step): until then it generates from the weights it
converted.
"""
from __future__ import annotations

import numbers
from typing import List, Optional, Sequence

import torch

from ..engine import SpeculativeEngine
from ..models import LlamaForCausalLM
from ..runtime import GraphPool, Strategy, StrategySelector

__all__ = ["SpeculativeGenerator", "speculative_generate"]

DEFAULT_ARMS = ("s2k1v3", "s4k1v5")


def _one_eos(eos_token_id) -> Optional[int]:
    if eos_token_id is None or isinstance(eos_token_id, numbers.Integral):
        return None if eos_token_id is None else int(eos_token_id)
    ids = list(eos_token_id)
    if len(ids) == 1:
        return int(ids[0])
    raise ValueError(f"eos_token_id: one EOS id is supported, got {ids}")


def _prompts(input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor]) -> List[List[int]]:
    """Each row's tokens without its padding (``attention_mask`` 0), left or right."""
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be [batch, length >= 1], got {tuple(input_ids.shape)}")
    if attention_mask is None:
        return input_ids.tolist()
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask must have input_ids' shape {tuple(input_ids.shape)}, "
                         f"got {tuple(attention_mask.shape)}")
    rows = [[t for t, keep in zip(ids, mask) if keep] for ids, mask in zip(input_ids.tolist(), attention_mask.tolist())]
    empty = [b for b, row in enumerate(rows) if not row]
    if empty:
        raise ValueError(f"attention_mask: rows {empty} have no token")
    return rows


class SpeculativeGenerator:
    """A ``transformers`` causal LM converted once, with a speculative engine over it (see the module docstring).

    Args:
        model: a ``transformers`` ``PreTrainedModel`` with a causal LM head.
        max_batch_size, max_seq_len: the engine's capacity (prompt + new tokens per request).
        drafter: ``"ngram"`` (default; no weights to train) or a drafter object for the converted target.
        arms: the speculative strategies the adaptive selector picks from (plain decoding is always one).
        cuda_graphs: capture the steps' CUDA graphs (default: on a GPU).
    """

    def __init__(self, model, max_batch_size: int, max_seq_len: int, drafter="ngram",
                 arms: Sequence[str] = DEFAULT_ARMS, cuda_graphs: Optional[bool] = None):
        self.model, self.max_batch_size, self.max_seq_len = model, max_batch_size, max_seq_len
        self.drafter, self.arms = drafter, tuple(arms)
        self.cuda_graphs = model.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        self.refresh()

    def refresh(self) -> None:
        """Convert the model's current weights and rebuild the engine (after the weights change)."""
        dtype = next(self.model.parameters()).dtype
        self.target = LlamaForCausalLM.from_hf(self.model.config.to_dict(), self.model.state_dict(),
                                               device=self.model.device, dtype=dtype)
        selector = StrategySelector([Strategy.parse(a) for a in self.arms])
        self.engine = SpeculativeEngine(self.target, self.drafter, selector, GraphPool() if self.cuda_graphs else None,
                                        max_batch_size=self.max_batch_size, max_seq_len=self.max_seq_len)
        if self.cuda_graphs:
            self.engine.capture_graphs()

    def generate(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None, *,
                 generation_config=None, seed=None, **kwargs) -> torch.Tensor:
        """``generate``'s output layout (module docstring) for ``input_ids`` ``[B, L]``; keyword arguments as
        ``generate`` takes them: ``max_new_tokens``, ``do_sample``, ``temperature``, ``top_k``, ``top_p``,
        ``eos_token_id``, ``pad_token_id``. ``seed``: an int or ``B`` ints (Philox seeds per request)."""
        config = _settings(self.model, generation_config, kwargs, input_ids.shape[1])
        prompts = _prompts(input_ids, attention_mask)
        if seed is None:
            seed = torch.randint(0, 2**62, (len(prompts),)).tolist()
        out = self.engine.generate(prompts, config["max_new_tokens"], temperature=config["temperature"],
                                   top_k=config["top_k"], top_p=config["top_p"], seed=seed,
                                   eos_token_id=config["eos"])
        width = max(len(t) for t in out.tokens)
        new = torch.full((len(prompts), width), config["pad"], dtype=torch.int64)
        for b, tokens in enumerate(out.tokens):
            new[b, : len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
        return torch.cat([input_ids.to(torch.int64).cpu(), new], dim=1).to(input_ids.device)


_KNOWN = {"max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "eos_token_id", "pad_token_id"}


def _settings(model, generation_config, kwargs: dict, prompt_len: int) -> dict:
    """``generate``'s settings: keyword arguments over the generation config (the model's by default)."""
    unknown = sorted(set(kwargs) - _KNOWN)
    if unknown:
        raise TypeError(f"speculative_generate does not take {unknown}; it takes {sorted(_KNOWN)}")
    config = generation_config if generation_config is not None else getattr(model, "generation_config", None)
    get = lambda name, default=None: kwargs.get(name, getattr(config, name, default))  # noqa: E731
    max_new = get("max_new_tokens")
    if max_new is None:
        max_new = max(1, (get("max_length", 20) or 20) - prompt_len)
    sample = bool(get("do_sample", False))
    top_k = get("top_k") if sample else None
    top_p = get("top_p") if sample else None
    eos = _one_eos(get("eos_token_id"))
    pad = get("pad_token_id")
    pad = pad if pad is not None else (eos if eos is not None else 0)
    return dict(max_new_tokens=int(max_new), temperature=float(get("temperature", 1.0) or 1.0) if sample else 0.0,
                top_k=top_k or None, top_p=top_p if top_p is not None and top_p < 1.0 else None, eos=eos,
                pad=int(pad))


def speculative_generate(model, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None, *,
                         generation_config=None, seed=None, drafter="ngram", cuda_graphs: bool = False,
                         **kwargs) -> torch.Tensor:
    """One call in place of ``model.generate(input_ids, attention_mask=..., **kwargs)`` (module docstring): the
    weights are converted for this call (no CUDA graphs by default: capturing costs more than one short call
    saves; keep a :class:`SpeculativeGenerator` for a loop)."""
    prompts = _prompts(input_ids, attention_mask)
    config = _settings(model, generation_config, kwargs, input_ids.shape[1])
    max_seq_len = max(len(p) for p in prompts) + config["max_new_tokens"] + 1
    generator = SpeculativeGenerator(model, max_batch_size=len(prompts), max_seq_len=max_seq_len, drafter=drafter,
                                     cuda_graphs=cuda_graphs)
    return generator.generate(input_ids, attention_mask, generation_config=generation_config, seed=seed, **kwargs)
