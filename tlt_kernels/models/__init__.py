"""Target models that run on tlt-kernels ops (paged KV cache, tree verification).

* :class:`ModelConfig` -- shapes, readable from a transformers Llama/Qwen2 config;
* :class:`PagedKVCache` -- per-layer paged K/V pools and a block allocator;
* :class:`LlamaForCausalLM` -- Llama/Qwen2 decoder with ``prefill`` / ``forward_tree`` / ``decode``;
* :mod:`.reference_decode` -- plain contiguous-cache decoding, the ground truth for speculative decoding;
* :mod:`.train_tiny` -- an offline byte-level corpus and a tiny trainable target.

Nothing here downloads anything; checkpoints come in as state dicts.
"""
from .config import ModelConfig
from .kv_cache import PagedKVCache
from .llama import LlamaForCausalLM
from .reference_decode import reference_generate

__all__ = ["LlamaForCausalLM", "ModelConfig", "PagedKVCache", "reference_generate"]
