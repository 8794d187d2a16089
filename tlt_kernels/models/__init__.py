"""Target models that run on tlt-kernels ops (paged KV cache, tree verification).

* :class:`ModelConfig` -- shapes, readable from a transformers Llama/Qwen2 config;
* :class:`PagedKVCache` -- per-layer paged K/V pools and a block allocator;
* :class:`LlamaForCausalLM` -- Llama/Qwen2 decoder with ``prefill`` / ``forward_tree`` / ``decode``;
* :mod:`.reference_decode` -- plain contiguous-cache decoding, the ground truth for speculative decoding;
* :mod:`.train_tiny` -- an offline byte-level corpus and a tiny trainable target;
* :func:`load_checkpoint` -- a local transformers-format checkpoint directory.

Nothing here downloads anything; checkpoints come in as state dicts.
"""
from .checkpoint import load_checkpoint
from .config import ModelConfig
from .kv_cache import PagedKVCache
from .llama import LlamaForCausalLM
from .reference_decode import Generation, reference_generate
from .train_tiny import deterministic_training, finetune_target, load_corpus, shifted_corpus, train_tiny_target

__all__ = [
    "Generation",
    "LlamaForCausalLM",
    "ModelConfig",
    "PagedKVCache",
    "deterministic_training",
    "load_checkpoint",
    "load_corpus",
    "reference_generate",
    "finetune_target",
    "shifted_corpus",
    "train_tiny_target",
]
