"""Shape and numerics of a Llama/Qwen2/Qwen3-style decoder, readable from a ``transformers`` config."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Dict, Optional

_SUPPORTED_ROPE = ("default", "linear", "llama3", "yarn")
_SUPPORTED_MODELS = ("llama", "mistral", "qwen2", "qwen3")

# The parameters each supported RoPE scaling reads (rope_inv_freq); each must be a finite number > 0.
_ROPE_PARAMS = {"default": (), "linear": ("factor",),
                "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
                "yarn": ("factor", "original_max_position_embeddings")}
# Parameters a type may carry; null means "use the default" (transformers reads them with `or`/`get`).
_ROPE_OPTIONAL = {"yarn": ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")}
# Types transformers ships that this decoder cannot reproduce, and why.
_ROPE_UNSUPPORTED_WHY = {
    "dynamic": "dynamic NTK recomputes the frequencies from the current sequence length once it passes "
               "max_position_embeddings, while a paged cache keeps keys rotated at earlier lengths",
}


def _number(x, low: float) -> bool:
    """``x`` is a finite real number (not a bool) above ``low``."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > low


def _check_rope_scaling(rs) -> None:
    """A transformers-style ``rope_scaling`` dict of a supported type with every parameter that type reads: a
    missing one would otherwise surface as a KeyError at model construction, and a zero or NaN one as NaN angles."""
    if not isinstance(rs, dict):
        raise ValueError(f"rope_scaling must be a dict with 'rope_type' (one of {_SUPPORTED_ROPE}) or None, got {rs!r}")
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind not in _SUPPORTED_ROPE:
        why = f" ({_ROPE_UNSUPPORTED_WHY[kind]})" if kind in _ROPE_UNSUPPORTED_WHY else ""
        raise NotImplementedError(f"rope_scaling type {kind!r} is not supported{why}; supported: {_SUPPORTED_ROPE}")
    for key in _ROPE_PARAMS[kind]:
        if key not in rs:
            raise ValueError(f"rope_scaling of type {kind!r} needs {key!r} (a finite number > 0), got {rs!r}")
        if not _number(rs[key], 0.0):
            raise ValueError(f"rope_scaling[{key!r}] must be a finite number > 0 for type {kind!r}, got {rs[key]!r}")
    for key in _ROPE_OPTIONAL.get(kind, ()):
        if rs.get(key) is not None and not _number(rs[key], 0.0):
            raise ValueError(f"rope_scaling[{key!r}] must be null or a finite number > 0 for type {kind!r}, got {rs[key]!r}")
    if kind == "llama3" and not rs["high_freq_factor"] > rs["low_freq_factor"]:
        raise ValueError(f"rope_scaling of type 'llama3' needs high_freq_factor > low_freq_factor (the smoothing band "
                         f"divides by their difference), got {rs['high_freq_factor']!r} and {rs['low_freq_factor']!r}")
    if kind == "yarn" and not isinstance(rs.get("truncate", True), bool):
        raise ValueError(f"rope_scaling['truncate'] must be a bool for type 'yarn', got {rs['truncate']!r}")
    if kind == "yarn" and (rs.get("beta_fast") or 32) < (rs.get("beta_slow") or 1):
        # The ramp between the two correction dimensions would run backwards.
        raise ValueError(f"rope_scaling of type 'yarn' needs beta_fast >= beta_slow (defaults 32 and 1), got "
                         f"{rs.get('beta_fast')!r} and {rs.get('beta_slow')!r}")


@dataclass
class ModelConfig:
    """Everything :class:`~tlt_kernels.models.llama.LlamaForCausalLM` needs to build its weights.

    ``attention_bias`` adds biases to the q/k/v projections (Qwen2 always has them; Llama and Qwen3 have a
    flag), ``attention_out_bias`` to the output projection (Llama's and Qwen3's ``attention_bias`` flag sets
    both). ``qk_norm`` applies a per-head RMSNorm (weights of size ``head_dim``) to q and k after the
    projection and before RoPE (Qwen3). ``rope_scaling`` is ``None`` (plain RoPE) or a transformers-style
    dict with ``rope_type`` in ``("default", "linear", "llama3", "yarn")`` and that type's parameters.
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
    qk_norm: bool = False

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
        if not _number(self.rope_theta, 0.0):
            raise ValueError(f"ModelConfig.rope_theta must be a finite number > 0, got {self.rope_theta!r}")
        if not (_number(self.rms_norm_eps, -1.0) and self.rms_norm_eps >= 0):
            raise ValueError(f"ModelConfig.rms_norm_eps must be a finite number >= 0, got {self.rms_norm_eps!r}")
        mpe = self.max_position_embeddings
        if isinstance(mpe, bool) or not isinstance(mpe, int) or mpe < 1:
            raise ValueError(f"ModelConfig.max_position_embeddings must be a positive int, got {mpe!r}")
        if self.rope_scaling is not None:
            _check_rope_scaling(self.rope_scaling)

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
        """Read a transformers ``LlamaConfig`` / ``MistralConfig`` / ``Qwen2Config`` / ``Qwen3Config`` (or its
        ``to_dict()``).

        Handles both transformers 4.x (``rope_theta`` / ``rope_scaling``) and 5.x (``rope_parameters``)
        spellings. Features this decoder does not implement (sliding-window attention, MLP biases,
        activations other than SiLU, partial rotary embeddings) raise ``NotImplementedError`` naming the
        field instead of silently computing something else.
        """
        if isinstance(config, dict):
            d = dict(config)
        elif callable(getattr(config, "to_dict", None)):
            d = config.to_dict()
        else:
            raise TypeError(f"config must be a transformers config or its to_dict(), got {type(config).__name__}")
        model_type = d.get("model_type", "llama")
        if model_type not in _SUPPORTED_MODELS:
            raise NotImplementedError(f"model_type {model_type!r} is not supported; expected one of {_SUPPORTED_MODELS}")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads") if d.get(k) is None]
        if missing:
            raise ValueError(f"HF config is missing {missing}")
        _check_hf_features(d, model_type)

        rope_theta, scaling = _hf_rope(d)
        n_heads = _hf_int(d, "num_attention_heads")
        hidden = _hf_int(d, "hidden_size")
        # Qwen2 always carries q/k/v biases (and none on o_proj) and has no flag for them; the others' flag biases all four.
        in_bias = True if model_type == "qwen2" else bool(d.get("attention_bias", False))
        # Qwen3Config's head_dim defaults to 128 whatever hidden_size / heads is; the others derive it.
        head_dim = _hf_int(d, "head_dim", 128 if model_type == "qwen3" else hidden // n_heads)
        return cls(
            vocab_size=_hf_int(d, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_hf_int(d, "intermediate_size"),
            num_layers=_hf_int(d, "num_hidden_layers"),
            num_q_heads=n_heads,
            num_kv_heads=_hf_int(d, "num_key_value_heads", n_heads),
            head_dim=head_dim,
            rope_theta=rope_theta,
            rms_norm_eps=_hf_float(d, "rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_position_embeddings=_hf_int(d, "max_position_embeddings", 4096),
            attention_bias=in_bias,
            attention_out_bias=False if model_type == "qwen2" else in_bias,
            rope_scaling=scaling,
            qk_norm=model_type == "qwen3",
        )

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


def _check_hf_features(d: Dict[str, Any], model_type: str) -> None:
    """NotImplementedError naming the first field of the HF config dict ``d`` that asks for something this decoder
    does not compute."""
    if d.get("hidden_act", "silu") != "silu":
        raise NotImplementedError(f"hidden_act {d['hidden_act']!r} is not supported (only 'silu')")
    if d.get("mlp_bias", False):
        raise NotImplementedError("mlp_bias=True is not supported")
    # Qwen2/Qwen3 slide a window over layers >= max_window_layers only when use_sliding_window is set (their
    # configs carry a sliding_window size either way); Mistral slides whenever sliding_window is set.
    if d.get("use_sliding_window", False):
        raise NotImplementedError(f"use_sliding_window=True (sliding-window attention, sliding_window="
                                  f"{d.get('sliding_window')!r}, max_window_layers={d.get('max_window_layers')!r}) is not supported")
    if model_type == "mistral" and d.get("sliding_window"):
        raise NotImplementedError(f"sliding-window attention (sliding_window={d['sliding_window']!r}) is not supported")
    layer_types = d.get("layer_types")
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        other = sorted({str(t) for t in layer_types if t != "full_attention"})
        raise NotImplementedError(f"layer_types {other} are not supported: every layer must be 'full_attention'")
    partial = d.get("partial_rotary_factor")
    for rope in (d.get("rope_parameters"), d.get("rope_scaling")):
        if isinstance(rope, dict) and rope.get("partial_rotary_factor") is not None:
            partial = rope["partial_rotary_factor"]
    if partial is not None and partial != 1:
        raise NotImplementedError(f"partial_rotary_factor={partial!r} is not supported (RoPE over the whole head only)")


def _hf_int(d: Dict[str, Any], key: str, default: Optional[int] = None) -> int:
    """``d[key]`` as an int >= 1 (``default`` when absent or null): a ValueError naming the field otherwise, where
    ``int()`` would truncate 2.5 and a falsy 0 would quietly fall back to the default."""
    v = d.get(key)
    if v is None:
        if default is None:
            raise ValueError(f"HF config is missing {key!r}")
        return default
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"HF config field {key!r} must be a positive int, got {v!r}")
    return v


def _hf_float(d: Dict[str, Any], key: str, default: float) -> float:
    v = d.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"HF config field {key!r} must be a finite number, got {v!r}")
    return float(v)


def _hf_rope(d: Dict[str, Any]):
    """``(rope_theta, rope_scaling or None)`` from transformers 4.x (``rope_theta``, ``rope_scaling``) or 5.x
    (``rope_parameters``) spellings; the scaling is validated by :class:`ModelConfig`."""
    params, legacy = d.get("rope_parameters"), d.get("rope_scaling")
    for key, value in (("rope_parameters", params), ("rope_scaling", legacy)):
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"HF config field {key!r} must be a dict or null, got {value!r}")
        if value and any(isinstance(v, dict) for v in value.values()):
            # transformers 5 nests them per layer type (e.g. sliding and full attention), which this decoder lacks.
            raise NotImplementedError(f"per-layer-type {key} are not supported, got {value!r}")
    rope = dict(params or {})
    if legacy:
        rope.update(legacy)
    rope_theta = _hf_float(rope, "rope_theta", _hf_float(d, "rope_theta", 10000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return rope_theta, None
    scaling = {k: v for k, v in rope.items() if k not in ("rope_theta", "type", "partial_rotary_factor")}
    scaling["rope_type"] = kind
    if kind in ("llama3", "yarn"):
        _hf_fill_original_context(d, scaling)
    return rope_theta, scaling


def _hf_fill_original_context(d: Dict[str, Any], scaling: Dict[str, Any]) -> None:
    """Fill the pre-training context length of a llama3/yarn ``scaling`` dict as transformers'
    ``standardize_rope_params`` does: a top-level ``original_max_position_embeddings`` wins (Phi-3 style
    configs), else the dict's own, else ``max_position_embeddings``. A yarn ``factor`` of null is the ratio of
    the two lengths (DeepSeek-V3 style configs)."""
    if d.get("original_max_position_embeddings") is not None:
        scaling["original_max_position_embeddings"] = d["original_max_position_embeddings"]
    elif scaling.get("original_max_position_embeddings") is None and d.get("max_position_embeddings") is not None:
        scaling["original_max_position_embeddings"] = d["max_position_embeddings"]
    original = scaling.get("original_max_position_embeddings")
    if scaling["rope_type"] == "yarn" and scaling.get("factor") is None and _number(original, 0.0):
        scaling["factor"] = _hf_int(d, "max_position_embeddings", 4096) / original
