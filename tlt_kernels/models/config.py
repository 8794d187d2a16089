"""Shape and numerics of a Llama/Qwen2-style decoder, readable from a ``transformers`` config."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, Optional

_SUPPORTED_ROPE = ("default", "linear", "llama3")


@dataclass
class ModelConfig:
    """Everything :class:`~tlt_kernels.models.llama.LlamaForCausalLM` needs to build its weights.

    ``attention_bias`` adds biases to the q/k/v projections (Qwen2 always has them; Llama has a flag),
    ``attention_out_bias`` to the output projection (Llama's ``attention_bias`` flag sets both).
    ``rope_scaling`` is ``None`` (plain RoPE) or a transformers-style dict with ``rope_type`` in
    ``("default", "linear", "llama3")`` and that type's parameters.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    attention_bias: bool = False
    attention_out_bias: bool = False
    rope_scaling: Optional[Dict[str, Any]] = None

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_q_heads", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_q_heads ({self.num_q_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads}) for GQA"
            )
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
            if kind not in _SUPPORTED_ROPE:
                raise NotImplementedError(f"rope_scaling type {kind!r} is not supported; supported: {_SUPPORTED_ROPE}")

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.num_q_heads // self.num_kv_heads

    @classmethod
    def tiny(cls, vocab_size: int = 256, **overrides) -> "ModelConfig":
        """A 2-layer GQA model (about 0.1M parameters at vocab 256) for CPU tests."""
        base = dict(
            vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_layers=2,
            num_q_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=1024,
        )
        base.update(overrides)
        return cls(**base)

    @classmethod
    def small(cls, vocab_size: int = 256, **overrides) -> "ModelConfig":
        """A 4-layer, 256-wide model (about 3M parameters): trains to useful acceptance rates on a GPU in minutes.

        ``head_dim=64`` so the tree-attention kernels (head dims 64/128/256) run it; :meth:`tiny`'s 16
        runs on their torch path only.
        """
        base = dict(
            vocab_size=vocab_size, hidden_size=256, intermediate_size=768, num_layers=4,
            num_q_heads=4, num_kv_heads=2, head_dim=64, max_position_embeddings=4096,
        )
        base.update(overrides)
        return cls(**base)

    @classmethod
    def from_hf(cls, config) -> "ModelConfig":
        """Read a transformers ``LlamaConfig`` / ``Qwen2Config`` (or its ``to_dict()``).

        Handles both transformers 4.x (``rope_theta`` / ``rope_scaling``) and 5.x
        (``rope_parameters``) spellings. Features this decoder does not implement (sliding-window
        attention, MLP biases, activations other than SiLU) raise ``NotImplementedError`` instead of
        silently computing something else.
        """
        d = dict(config) if isinstance(config, dict) else config.to_dict()
        model_type = d.get("model_type", "llama")
        if model_type not in ("llama", "qwen2", "mistral"):
            raise NotImplementedError(f"model_type {model_type!r} is not supported; expected 'llama' or 'qwen2'")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads") if d.get(k) is None]
        if missing:
            raise ValueError(f"HF config is missing {missing}")
        if d.get("hidden_act", "silu") != "silu":
            raise NotImplementedError(f"hidden_act {d['hidden_act']!r} is not supported (only 'silu')")
        if d.get("mlp_bias", False):
            raise NotImplementedError("mlp_bias=True is not supported")
        if d.get("use_sliding_window", False) or (model_type == "mistral" and d.get("sliding_window")):
            raise NotImplementedError("sliding-window attention is not supported")

        rope = dict(d.get("rope_parameters") or {})
        legacy = d.get("rope_scaling")
        if legacy:
            rope.update(legacy)
        rope_theta = float(rope.get("rope_theta", d.get("rope_theta", 10000.0)))
        kind = rope.get("rope_type", rope.get("type", "default"))
        scaling = None
        if kind != "default":
            scaling = {k: v for k, v in rope.items() if k not in ("rope_theta", "type")}
            scaling["rope_type"] = kind
        n_heads = int(d["num_attention_heads"])
        head_dim = d.get("head_dim") or d["hidden_size"] // n_heads
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_q_heads=n_heads,
            num_kv_heads=int(d.get("num_key_value_heads") or n_heads),
            head_dim=int(head_dim),
            rope_theta=rope_theta,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_position_embeddings=int(d.get("max_position_embeddings") or 4096),
            # Qwen2 always carries q/k/v biases and has no flag for them.
            attention_bias=True if model_type == "qwen2" else bool(d.get("attention_bias", False)),
            attention_out_bias=False if model_type == "qwen2" else bool(d.get("attention_bias", False)),
            rope_scaling=scaling,
        )

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)
