"""A Llama/Qwen2/Qwen3-style decoder (RMSNorm, RoPE, GQA, SwiGLU, optional q/k norm) that runs on our ops.

Three ways to run the same weights:

* :meth:`LlamaForCausalLM.forward` -- plain dense causal forward over ``[B, L]`` (training, and the
  ground truth in tests);
* :meth:`LlamaForCausalLM.prefill` -- append prompt tokens to the paged cache (SDPA over the
  request's gathered K/V);
* :meth:`LlamaForCausalLM.forward_tree` -- verify a token tree in one pass: node ``i`` sits at
  position ``context_lens + depth(i)`` (RoPE) and slot ``context_lens + i`` (cache), and attends to
  the committed context plus its ancestors through :func:`tlt_kernels.tree_attention`. Decode is a
  tree of one node (:meth:`decode`).

None of these mutate ``context_lens``: the caller advances it (by ``lengths`` after a prefill, by the
accepted path length after verification, once the accepted K/V are compacted).

Numerics follow transformers' Llama/Qwen2/Qwen3 (RMSNorm in fp32 then cast; cos/sin computed in fp32, scaled
by the RoPE attention factor, then cast to the activation dtype), so :meth:`from_hf` reproduces a
transformers model's logits.
"""
from __future__ import annotations

import math
from typing import Callable, List, Mapping, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from .._backend import BACKENDS
from .._validation import capturing, check_tensor, devices_equal
from ..ops.rms_norm import rms_norm
from ..ops.rotary import apply_rotary, rotary_to_cache
from ..ops.silu_and_mul import silu_and_mul
from ..ops.tree_attention import plan_tree_attention
from ..reference.tree_attention import run_torch
from ..tree import depths_from_ancestor_mask, resolve_num_nodes, validate_tree
from .config import ModelConfig
from .kv_cache import PagedKVCache
from .packing import PackedLinears

_INT = (torch.int32, torch.int64)
BACKEND_NAMES = ("auto",) + tuple(BACKENDS)


def check_token_ids(name: str, tokens: torch.Tensor, vocab_size: int, lengths: Optional[torch.Tensor] = None,
                    valid: Optional[torch.Tensor] = None) -> None:
    """Every token of ``tokens [B, L]`` (the first ``lengths[b]`` of each row, or where ``valid``) lies in
    ``[0, vocab_size)``, else a ValueError naming the request, the position and V. The embedding would otherwise
    raise a bare IndexError on the CPU and a device-side assert on a GPU. One host sync."""
    bad = (tokens < 0) | (tokens >= vocab_size)
    if lengths is not None:
        bad &= torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0) < lengths.to(tokens.device).unsqueeze(1)
    if valid is not None:
        bad &= valid
    if bool(bad.any()):
        b, j = (int(v) for v in bad.nonzero()[0])
        raise ValueError(f"{name}[{b}, {j}] = {int(tokens[b, j])} (request {b}, position {j}) is outside the "
                         f"vocabulary [0, vocab_size={vocab_size})")


# -- building blocks ---------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # y = w * x / sqrt(mean(x^2) + eps), the reduction in fp32 whatever the activation dtype.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(config: ModelConfig, device=None) -> torch.Tensor:
    """fp32 ``[head_dim / 2]`` rotation frequencies ``theta^(-2i/D)``, with linear / Llama-3 / YaRN scaling."""
    D = config.head_dim
    # theta^(2i/D) first, then its inverse: the order transformers uses, so the fp32 rounding matches.
    pos_freqs = config.rope_theta ** (torch.arange(0, D, 2, dtype=torch.int64, device=device).float() / D)
    inv = 1.0 / pos_freqs
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        inv = inv / float(scaling["factor"])
    elif kind == "llama3":
        # Long wavelengths are stretched by `factor`, short ones kept, the band between interpolated.
        factor = float(scaling["factor"])
        lo, hi = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_ctx / lo, inv / factor, inv)
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_ctx / hi) & (wavelen <= old_ctx / lo)
        inv = torch.where(medium, smoothed, scaled)
    elif kind == "yarn":
        inv = _yarn_inv_freq(pos_freqs, config, scaling)
    return inv


def _yarn_inv_freq(pos_freqs: torch.Tensor, config: ModelConfig, scaling) -> torch.Tensor:
    """YaRN frequencies from ``pos_freqs = theta^(2i/D)`` (fp32 ``[D/2]``), as transformers computes them.

    Dimension pairs that turn more than ``beta_fast`` times over the original context keep their frequency
    (extrapolation), those turning fewer than ``beta_slow`` times are divided by ``factor`` (interpolation),
    and a linear ramp over the pair index blends the two between those correction dimensions.
    """
    D, base = config.head_dim, config.rope_theta
    factor = float(scaling["factor"])
    old_ctx = float(scaling["original_max_position_embeddings"])
    # null (or 0) means the paper's defaults, as transformers reads them with `or`.
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        # The (fractional) dimension whose wavelength fits `rotations` times into the original context.
        return D * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, D - 1)
    if low == high:
        high += 0.001  # a one-point ramp would divide by zero
    ramp = ((torch.arange(D // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1).to(pos_freqs.device)
    extrapolation_weight = 1 - ramp
    interpolated, extrapolated = 1.0 / (factor * pos_freqs), 1.0 / pos_freqs
    return interpolated * (1 - extrapolation_weight) + extrapolated * extrapolation_weight


def rope_attention_factor(config: ModelConfig) -> float:
    """The factor transformers multiplies cos and sin by (1.0 except for YaRN).

    YaRN: ``attention_factor`` when given; else ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` when
    both are set, else ``mscale(factor)``, with ``mscale(s, m=1) = 0.1 * m * ln(s) + 1`` for ``s > 1`` and 1 below.
    It scales every attention logit by its square (q and k are both rotated), keeping the softmax
    entropy of long contexts close to the pre-training one.
    """
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type")) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if m and m_all:
        return mscale(factor, float(m)) / mscale(factor, float(m_all))
    return mscale(factor)


def rope_freqs(inv_freq: torch.Tensor) -> torch.Tensor:
    """fp32 ``[D]``: the ``[D / 2]`` frequencies of :func:`rope_inv_freq` twice, dims ``j`` and ``j + D / 2``
    rotating alike; what :func:`rope_cos_sin` takes (kept by its callers: no concatenation per call)."""
    return torch.cat((inv_freq, inv_freq))


def rope_cos_sin(freqs: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype,
                 attention_factor: float = 1.0) -> Tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin: [B, T, D]`` for integer ``positions: [B, T]`` and ``freqs: fp32 [D]`` (:func:`rope_freqs`):
    angles ``float(position) * freqs`` in fp32, cos and sin in fp32, scaled by ``attention_factor``
    (:func:`rope_attention_factor`) in fp32, then rounded to ``dtype``."""
    # Both halves' angles in one product (the int positions converted inside it) and each trig function rounding
    # to dtype as it stores: three launches a call where a float(), a product, a cat, the two functions and two
    # casts took seven, with the same bits (elementwise fp32 math on the same values).
    emb = positions.unsqueeze(-1) * freqs
    if attention_factor != 1.0:
        return (emb.cos() * attention_factor).to(dtype), (emb.sin() * attention_factor).to(dtype)
    cos, sin = (torch.empty(emb.shape, dtype=dtype, device=emb.device) for _ in range(2))
    return torch.cos(emb, out=cos), torch.sin(emb, out=sin)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x: [B, T, H, D]``; the pairs are (i, i + D/2) ("rotate half", as in transformers)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(2) + rotated * sin.unsqueeze(2)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        H, D = config.hidden_size, config.head_dim
        self.num_q_heads, self.num_kv_heads, self.head_dim = config.num_q_heads, config.num_kv_heads, D
        self.q_proj = nn.Linear(H, config.num_q_heads * D, bias=config.attention_bias)
        self.k_proj = nn.Linear(H, config.num_kv_heads * D, bias=config.attention_bias)
        self.v_proj = nn.Linear(H, config.num_kv_heads * D, bias=config.attention_bias)
        self.o_proj = nn.Linear(config.num_q_heads * D, H, bias=config.attention_out_bias)
        # Qwen3: one RMSNorm over each head's D features of q and of k, shared by all heads.
        self.q_norm = RMSNorm(D, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(D, config.rms_norm_eps) if config.qk_norm else None
        self.packed_qkv: Optional[PackedLinears] = None  # see LlamaForCausalLM.pack_projections

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """``x: [B, T, H]`` -> rotated ``q: [B, T, Hq, D]``, rotated ``k`` and ``v: [B, T, Hkv, D]``.

        With ``qk_norm`` q and k are normalised per head before the rotation, as transformers' Qwen3 does."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_q_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.packed_gate_up: Optional[PackedLinears] = None  # see LlamaForCausalLM.pack_projections

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)


def _projections(x: torch.Tensor, packed: Optional[PackedLinears], linears) -> List[torch.Tensor]:
    """``[lin(x) for lin in linears]``: one GEMM when ``packed`` (from :meth:`LlamaForCausalLM.pack_projections`)
    still holds their weights, else one each."""
    if packed is not None and packed.valid():
        return packed(x)
    return [lin(x) for lin in linears]


# Attention callback: (layer index, q [B,T,Hq,D], k [B,T,Hkv,D], v [B,T,Hkv,D]) -> out [B,T,Hq,D]; k and v are None
# when a StoreKV callback already stored them.
Attend = Callable[[int, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]], torch.Tensor]
# Rotate-and-store callback of the fused trunk: (layer index, q, k, v before RoPE, cos, sin) -> rotated q, with the
# rotated k and v stored in the layer's cache (one launch: tlt_kernels.rotary_to_cache).
StoreKV = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _prefill_context(cache: PagedKVCache, block_table: torch.Tensor, positions: torch.Tensor, end: torch.Tensor,
                     num_slots: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """A continued prefill's read index (int64 ``[B, S]``: slots ``0 .. S-1`` of every request, one index for every
    layer) and mask (bool ``[B, 1, L, S]``): query ``j`` sees the slots up to its own position; padding rows are
    clamped to the request's last valid token so no row is empty."""
    slots = torch.arange(num_slots, device=positions.device)
    last = positions.minimum(end.unsqueeze(1) - 1).unsqueeze(2)
    read_slots = cache.flat_index(block_table, slots.view(1, -1).expand(positions.shape[0], -1))
    return read_slots, (slots.view(1, 1, -1) <= last).unsqueeze(1)


def _prefill_writes(cache: PagedKVCache, block_table: torch.Tensor, j: torch.Tensor, lens: torch.Tensor,
                    ctx: Optional[torch.Tensor], to_tail: bool) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """A prefill's cache rows (int64 ``[B * L]``, one index for every layer) and the K/V rows written there (int64
    ``[B * L]``, or None: every token's own). ``to_tail``: token ``j`` writes slot ``j`` (padding tokens land past the
    request's end: prefill_fresh's ``padding_to_tail``). Else a padding token writes its request's last valid slot
    with that token's own K/V (the same values twice): no masked write (a host sync per layer), and nothing lands
    outside the request's valid slots."""
    B, L = lens.shape[0], j.shape[1]
    if to_tail:
        return cache.flat_index(block_table, j.expand(B, L)).flatten(), None
    source = torch.minimum(j, lens.unsqueeze(1) - 1)
    write_slots = cache.flat_index(block_table, source if ctx is None else ctx.unsqueeze(1) + source).flatten()
    return write_slots, (torch.arange(B, device=j.device).unsqueeze(1) * L + source).flatten()


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], causal: bool, scale: float) -> torch.Tensor:
    """SDPA on ``[B, T, H, D]`` layouts. GQA: without a mask SDPA shares each K/V head with its query heads
    (``enable_gqa``; no repeated copies); with one the heads are repeated, since the fused kernel a mask takes does not
    accept ``enable_gqa`` and torch would fall back to the math kernel."""
    group = q.shape[2] // k.shape[2]
    gqa = group > 1 and mask is None
    if group > 1 and not gqa:
        k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, is_causal=causal, scale=scale,
        enable_gqa=gqa,
    )
    return out.transpose(1, 2)


# -- the model ---------------------------------------------------------------------------------------
class LlamaForCausalLM(nn.Module):
    """Llama / Mistral / Qwen2 / Qwen3 causal LM. Weights: ``embed_tokens``, ``layers[i]``
    (``self_attn.{q,k,v,o}_proj``, with ``config.qk_norm`` also ``self_attn.{q,k}_norm``,
    ``mlp.{gate,up,down}_proj``, ``input_layernorm``, ``post_attention_layernorm``), ``norm``, ``lm_head``
    (tied to ``embed_tokens`` when ``config.tie_word_embeddings``)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # A plain attribute, not a buffer: ``model.to(bfloat16)`` must not round the frequencies.
        self._rope_freqs = rope_freqs(rope_inv_freq(config))
        self._rope_attention_factor = rope_attention_factor(config)
        self.sm_scale = config.head_dim**-0.5

    # -- shared trunk --------------------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def _trunk(self, tokens: torch.Tensor, positions: torch.Tensor, attend: Attend, fused: bool = False,
               store_kv: Optional[StoreKV] = None) -> torch.Tensor:
        x = self.embed_tokens(tokens)
        if not devices_equal(self._rope_freqs.device, x.device):
            self._rope_freqs = rope_freqs(rope_inv_freq(self.config, x.device))
        cos, sin = rope_cos_sin(self._rope_freqs, positions, x.dtype, self._rope_attention_factor)
        if fused:
            return self._fused_trunk(x, cos, sin, attend, store_kv)
        for i, layer in enumerate(self.layers):
            q, k, v = layer.self_attn.project(layer.input_layernorm(x), cos, sin)
            o = attend(i, q, k, v)
            x = x + layer.self_attn.o_proj(o.flatten(2))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return x

    def _fused_trunk(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend,
                     store_kv: Optional[StoreKV] = None) -> torch.Tensor:
        """The layers on the fused ops, the same rounding as the unfused loop (inference only: no autograd
        formulas): each residual add rides in the next RMSNorm's kernel, q and k rotate in one launch (with
        ``store_kv``, the launch that also stores k and v in the cache), SiLU * up in one. A step of a small model
        is bound by its launch count, not by bytes (docs/MODELS.md)."""
        eps, layers = self.config.rms_norm_eps, self.layers
        h, residual = rms_norm(x, layers[0].input_layernorm.weight, eps)
        for i, layer in enumerate(layers):
            attn, mlp = layer.self_attn, layer.mlp
            B, T, _ = h.shape
            q, k, v = _projections(h, attn.packed_qkv, (attn.q_proj, attn.k_proj, attn.v_proj))
            q = q.view(B, T, attn.num_q_heads, attn.head_dim)
            k = k.view(B, T, attn.num_kv_heads, attn.head_dim)
            v = v.view(B, T, attn.num_kv_heads, attn.head_dim)
            if attn.q_norm is not None:
                q, k = rms_norm(q, attn.q_norm.weight, eps)[0], rms_norm(k, attn.k_norm.weight, eps)[0]
            if store_kv is None:
                q, k = apply_rotary(q, k, cos, sin)
                o = attn.o_proj(attend(i, q, k, v).flatten(2))
            else:
                o = attn.o_proj(attend(i, store_kv(i, q, k, v, cos, sin), None, None).flatten(2))
            h, residual = rms_norm(o, layer.post_attention_layernorm.weight, eps, residual=residual)
            m = mlp.down_proj(silu_and_mul(*_projections(h, mlp.packed_gate_up, (mlp.gate_proj, mlp.up_proj))))
            if i + 1 == len(layers):
                return residual + m
            h, residual = rms_norm(m, layers[i + 1].input_layernorm.weight, eps, residual=residual)
        return x  # no layers

    def pack_projections(self) -> None:
        """Pack every layer's q/k/v and gate/up weights into one tensor each (:mod:`.packing`): the inference path
        (:meth:`forward_tree`) then runs one GEMM for each group. The parameters become views of the packed
        tensors (no extra memory); a parameter given new storage later (``model.to(...)``) unpacks that layer's
        group, which then runs separately again. Idempotent."""
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if attn.packed_qkv is None or not attn.packed_qkv.valid():
                attn.packed_qkv = PackedLinears([attn.q_proj, attn.k_proj, attn.v_proj])
            if mlp.packed_gate_up is None or not mlp.packed_gate_up.valid():
                mlp.packed_gate_up = PackedLinears([mlp.gate_proj, mlp.up_proj])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``lm_head(norm(hidden))``: ``[..., H]`` -> ``[..., V]``."""
        return self.lm_head(self.norm(hidden))

    def forward(self, tokens: torch.Tensor, positions: Optional[torch.Tensor] = None, *,
                validate: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
        """Plain dense causal forward, no cache.

        Args:
            tokens: int64 ``[B, L]``, each in ``[0, vocab_size)``.
            positions: int ``[B, L]`` RoPE positions (default ``0 .. L-1``).
            validate: check the token ids (one host sync; skipped during CUDA-graph capture). Training loops whose
                tokens are in range by construction pass False.
        Returns:
            ``logits [B, L, V]`` and ``hidden [B, L, H]`` (last layer, before the final norm), model dtype.
        """
        check_tensor("tokens", tokens, dtype=_INT, ndim=2)
        if validate and not capturing(tokens.device):
            check_token_ids("tokens", tokens, self.config.vocab_size)
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
        hidden = self._trunk(tokens, positions, lambda i, q, k, v: _sdpa(q, k, v, None, True, self.sm_scale))
        return self.logits(hidden), hidden

    # -- paged paths ---------------------------------------------------------------------------------
    def _check_cache(self, cache: PagedKVCache, block_table, context_lens, batch: int) -> None:
        c = self.config
        if cache.config.num_layers != c.num_layers or cache.k[0].shape[2:] != (c.num_kv_heads, c.head_dim):
            raise ValueError(
                f"cache holds {cache.config.num_layers} layers of [.., .., {cache.k[0].shape[2]}, {cache.k[0].shape[3]}] "
                f"but the model needs {c.num_layers} layers of [.., .., num_kv_heads={c.num_kv_heads}, head_dim={c.head_dim}]"
            )
        if not devices_equal(cache.device, self.device) or cache.dtype != self.dtype:
            raise ValueError(f"cache is {cache.dtype} on {cache.device} but the model is {self.dtype} on {self.device}; "
                             "build the PagedKVCache with the model's device and dtype")
        cache.check_block_table(block_table, context_lens, batch)

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, lengths: torch.Tensor, cache: PagedKVCache, block_table: torch.Tensor,
                context_lens: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Append prompt tokens to the paged cache.

        Token ``j < lengths[b]`` of request ``b`` gets position and slot ``context_lens[b] + j`` and attends
        causally to the request's cached slots ``0 .. context_lens[b]-1`` and the new tokens before it
        (``context_lens`` is 0 for a fresh request; larger values continue a prefix, chunk by chunk).
        Synchronizes with the device (not for CUDA graphs).

        Args:
            tokens: int64 ``[B, L]``, right-padded; entries at or past ``lengths[b]`` are ignored.
            lengths: int32 ``[B]``, ``1 <= lengths[b] <= L``.
            cache, block_table (int32 ``[B, max_blocks]``), context_lens (int32 ``[B]``): the paged cache;
                the table must cover ``context_lens + lengths`` slots.
        Returns:
            ``logits [B, V]`` at each request's last valid token and ``hidden [B, L, H]`` (last layer,
            before the final norm; rows past ``lengths`` are garbage).
        """
        check_tensor("tokens", tokens, dtype=_INT, ndim=2, device=self.device)
        B, L = tokens.shape
        check_tensor("lengths", lengths, dtype=_INT, shape=(B,), device=self.device)
        self._check_cache(cache, block_table, context_lens, B)
        lens, ctx = lengths.long(), context_lens.long()
        end = ctx + lens
        S, fresh = self._check_prefill_lengths(tokens, lens, ctx, end, block_table.shape[1] * cache.block_size)
        return self._prefill(tokens, lens, cache, block_table, None if fresh else (ctx, end, S))

    @torch.no_grad()
    def prefill_fresh(self, tokens: torch.Tensor, lengths: torch.Tensor, cache: PagedKVCache,
                      block_table: torch.Tensor, padding_to_tail: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
        """:meth:`prefill` of prompts with no cached context (every ``context_lens`` 0), without its checks or its host
        sync, so it can be captured in a CUDA graph: the caller guarantees what :meth:`prefill` checks (shapes and
        dtypes, ``1 <= lengths[b] <= L``, token ids in the vocabulary, a table covering ``lengths`` slots, the cache
        built with the model's dtype). Tokens past a request's length may be anything in the vocabulary, so a batch
        can be padded to a fixed ``L``: the outputs of its valid positions do not change.

        ``padding_to_tail``: the caller also guarantees that each request's table covers ``L`` slots of its own (no
        block shared with another request up to slot ``L - 1``), so a padding token writes its K/V into its own
        slot past the request's end, which nothing reads before a later step writes it; the K/V go to the cache as
        computed, with no per-layer gather. Without it a padding token rewrites the request's last valid slot with
        that token's K/V (gathered per layer), and only ``lengths`` slots need be covered.
        Returns:
            ``logits [B, V]`` at each request's last valid token and ``hidden [B, L, H]`` (rows past ``lengths``
            are garbage), as :meth:`prefill`.
        """
        return self._prefill(tokens, lengths.long(), cache, block_table, None, padding_to_tail)

    def _prefill(self, tokens, lens, cache: PagedKVCache, block_table, continued,
                 padding_to_tail: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
        """The prefill after its checks. ``continued``: None for fresh prompts (causal over their own tokens, no
        read-back of the cache), else ``(context_lens int64 [B], context_lens + lens, the longest of those)``;
        ``padding_to_tail``: :meth:`prefill_fresh`'s."""
        B, L = tokens.shape
        j = torch.arange(L, device=tokens.device).unsqueeze(0)
        valid = j < lens.unsqueeze(1)
        ctx = None if continued is None else continued[0]
        positions = j.expand(B, L) if ctx is None else ctx.unsqueeze(1) + j
        write_slots, source_rows = _prefill_writes(cache, block_table, j, lens, ctx, padding_to_tail and ctx is None)
        context = None if ctx is None else _prefill_context(cache, block_table, positions, continued[1], continued[2])

        def attend(i, q, k, v):
            if source_rows is None:
                cache.write_at(i, write_slots, k, v)
            else:
                cache.write_at(i, write_slots, k.flatten(0, 1)[source_rows], v.flatten(0, 1)[source_rows])
            if context is None:  # k, v are what the cache now holds (its dtype is the model's: _check_cache)
                return _sdpa(q, k, v, None, True, self.sm_scale)
            read_slots, mask = context
            k_context, v_context = cache.read_at(i, read_slots)
            return _sdpa(q, k_context.to(q.dtype), v_context.to(q.dtype), mask, False, self.sm_scale)

        # Half-precision models run the fused layer ops, as in forward_tree (fewer launches, the same rounding).
        fused = self.dtype in (torch.bfloat16, torch.float16)
        hidden = self._trunk(tokens.masked_fill(~valid, 0), positions, attend, fused=fused)
        last_hidden = hidden[torch.arange(B, device=tokens.device), lens - 1]
        return self.logits(last_hidden), hidden

    def _check_prefill_lengths(self, tokens, lens, ctx, end, room: int) -> Tuple[int, bool]:
        """prefill's value checks in one host sync (plus the token ids'); returns the longest ``context + length`` and
        whether every request starts fresh (no cached context)."""
        L = tokens.shape[1]
        lens_min, lens_max, ctx_min, ctx_max, end_max = (
            int(v) for v in torch.stack([lens.min(), lens.max(), ctx.min(), ctx.max(), end.max()]).tolist())
        if lens_min < 1 or lens_max > L:
            raise ValueError(f"lengths must lie in [1, L={L}], got {lens.tolist()}")
        if ctx_min < 0:
            raise ValueError(f"context_lens must be >= 0, got {ctx.tolist()}")
        check_token_ids("tokens", tokens, self.config.vocab_size, lens)
        if end_max > room:
            raise ValueError(f"block_table covers {room} slots but context_lens + lengths reaches {end_max}")
        return end_max, ctx_max == 0

    def plan_tree(self, parents: torch.Tensor, num_nodes: Optional[torch.Tensor], cache: PagedKVCache, block_table: torch.Tensor,
                  context_lens: torch.Tensor, max_context_len: Optional[int] = None, validate: bool = True):
        """The :class:`~tlt_kernels.ops.tree_attention.TreeAttentionPlan` of one step, shared by every layer.

        Build it outside a CUDA graph (or pass ``max_context_len``) to size the context split by the real
        lengths; during capture the table's capacity is used.
        """
        c = self.config
        return plan_tree_attention(
            parents, context_lens, block_table, num_nodes, num_q_heads=c.num_q_heads, num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim, block_size=cache.block_size, max_context_len=max_context_len,
            num_blocks=cache.num_blocks, validate=validate, kv_dtype=cache.dtype,
        )

    @torch.no_grad()
    def forward_tree(self, tokens: torch.Tensor, parents: torch.Tensor, num_nodes: Optional[torch.Tensor], cache: PagedKVCache,
                     block_table: torch.Tensor, context_lens: torch.Tensor, plan=None, *, validate: bool = True,
                     backend: str = "auto", max_context_len: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """Run a batch of token trees (verification; ``T = 1`` is plain decode).

        Node ``i`` of request ``b`` has position ``context_lens[b] + depth(i)`` and its K/V is written at
        slot ``context_lens[b] + i`` (every one of the ``T`` slots is written, padding nodes included,
        so the table must cover ``context_lens + T`` slots; slots past the accepted path are scratch).
        Attention is :func:`tlt_kernels.tree_attention` through one plan shared by every layer
        (``plan``, from :meth:`plan_tree`, or built here). No host synchronization when
        ``validate=False`` and a plan or ``max_context_len`` is given, or while a CUDA graph is captured.

        bf16/fp16 models run the op's kernels (``backend``). fp32 models run its ``torch`` backend on the
        same plan under ``"auto"`` (what CPU tests use), and the op's exact-fp32 Triton kernel with
        ``backend="triton"`` (the CUDA kernel is half precision only).

        Args:
            tokens: int64 ``[B, T]``; node 0 is the last accepted token (not yet in the cache).
            parents: int32 ``[B, T]`` (see :mod:`tlt_kernels.tree`); num_nodes: int32 ``[B]`` or None (all T).
            cache, block_table (int32 ``[B, max_blocks]``), context_lens (int32 ``[B]``): committed tokens.
        Returns:
            ``logits [B, T, V]`` (node i's row predicts the token after the path root..i) and
            ``hidden [B, T, H]`` (last layer, before the final norm). Padding rows are garbage.
        """
        kernel = self._check_tree_args(tokens, parents, cache, block_table, context_lens, backend)
        B, T = tokens.shape
        checked = validate and not capturing(tokens.device)
        n = validate_tree(parents, num_nodes) if checked else resolve_num_nodes(parents, num_nodes)
        idx = torch.arange(T, device=tokens.device).unsqueeze(0)
        pad = idx >= n.unsqueeze(1)
        if checked:
            self._check_tree_inputs(tokens, pad, cache, block_table, context_lens)
        # Padding entries may hold anything; tree helpers index with them, so make them a harmless 0.
        parents = parents.masked_fill(pad, 0)
        if plan is None:
            plan = self.plan_tree(parents, n, cache, block_table, context_lens, max_context_len, validate=False)
        elif (plan.batch_size, plan.num_tree) != (B, T):
            raise ValueError(f"plan was built for B={plan.batch_size}, T={plan.num_tree}; the tokens are B={B}, T={T}")
        ctx = context_lens.long().unsqueeze(1)
        if T == 1:  # a plain step: the root alone, at slot and position context_len (three launches fewer)
            slots = positions = ctx
        else:
            slots = ctx + idx  # node i at slot context_len + i
            # Its position adds its depth, which the plan's ancestor mask holds (its bit count less one): fewer
            # launches than jumping the parents again. The int32 depths widen inside the add.
            positions = ctx + depths_from_ancestor_mask(plan.tree_mask)
        flat_slots = cache.flat_index(block_table, slots).flatten()  # one index for every layer's K/V write

        def store_kv(i, q, k, v, cos, sin):  # the K/V write rides in the rotation's launch
            return rotary_to_cache(q, k, v, cos, sin, *cache.layer_rows(i), flat_slots, validate=False)

        def attend(i, q, k, v):
            if k is not None:
                cache.write_at(i, flat_slots, k, v)
            # Padding rows come back as zeros (the op's contract), so their K/V in later layers -- written
            # to scratch slots that kernels load and mask -- stay finite.
            if kernel:
                return plan.run(q, cache.k[i], cache.v[i], sm_scale=self.sm_scale, backend=backend)
            return run_torch(plan, q, cache.k[i], cache.v[i], torch.empty_like(q), self.sm_scale)

        hidden = self._trunk(tokens.masked_fill(pad, 0), positions, attend, fused=kernel,
                             store_kv=store_kv if cache.dtype == self.dtype else None)
        return self.logits(hidden), hidden

    def _check_tree_args(self, tokens, parents, cache: PagedKVCache, block_table, context_lens, backend: str) -> bool:
        """forward_tree's metadata checks (no sync): dtypes, shapes, devices, the cache and the backend. Returns
        whether attention runs the op's kernels (half-precision models, or ``backend="triton"``)."""
        check_tensor("tokens", tokens, dtype=_INT, ndim=2, device=self.device)
        B, T = tokens.shape
        check_tensor("parents", parents, dtype=_INT, shape=(B, T), device=self.device)
        self._check_cache(cache, block_table, context_lens, B)
        half = self.dtype in (torch.bfloat16, torch.float16)
        if backend not in BACKEND_NAMES:
            raise ValueError(f"backend={backend!r} is not one of {BACKEND_NAMES}")
        if not half and backend == "cuda":
            raise ValueError(f"backend={backend!r} needs a bf16/fp16 model (the CUDA tree-attention kernel is half precision); "
                             f"this model is {self.dtype}: use backend='auto', 'torch' or 'triton'")
        return half or backend == "triton"

    def _check_tree_inputs(self, tokens, pad, cache: PagedKVCache, block_table, context_lens) -> None:
        """forward_tree's host checks (one sync each): token ids of the real nodes, context lengths and room."""
        T = tokens.shape[1]
        check_token_ids("tokens", tokens, self.config.vocab_size, valid=~pad)
        lo, hi = (int(v) for v in torch.stack([context_lens.min(), context_lens.max()]).tolist())
        if lo < 0:
            raise ValueError(f"context_lens must be >= 0, got a minimum of {lo}")
        room = block_table.shape[1] * cache.block_size
        if hi + T > room:
            raise ValueError(f"block_table covers {room} slots but context_lens + T reaches {hi + T}")

    def decode(self, tokens: torch.Tensor, cache: PagedKVCache, block_table: torch.Tensor, context_lens: torch.Tensor,
               **kwargs) -> Tuple[torch.Tensor, torch.Tensor]:
        """One token per request: ``tokens: int64 [B]`` at slot/position ``context_lens`` -> ``logits [B, V]``, ``hidden [B, H]``."""
        check_tensor("tokens", tokens, dtype=_INT, ndim=1, device=self.device)
        parents = torch.full((tokens.shape[0], 1), -1, dtype=torch.int32, device=tokens.device)
        logits, hidden = self.forward_tree(tokens.unsqueeze(1), parents, None, cache, block_table, context_lens, **kwargs)
        return logits[:, 0], hidden[:, 0]

    # -- checkpoints -----------------------------------------------------------------------------
    def load_hf_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Copy weights named as in transformers' ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM``.

        ``model.layers.{i}.self_attn.q_proj.weight`` -> ``layers.{i}.self_attn.q_proj.weight`` etc.;
        ``lm_head.weight`` may be absent (or is ignored) when embeddings are tied. Values are cast to
        the model's dtype/device. Missing, unexpected or mis-shaped keys raise ``KeyError``/``ValueError``.
        """
        own = dict(self.named_parameters())
        tied = self.config.tie_word_embeddings
        seen = set()
        unexpected = []
        with torch.no_grad():
            for key, value in state_dict.items():
                if key.endswith("rotary_emb.inv_freq"):
                    continue
                name = key[len("model."):] if key.startswith("model.") else key
                if tied and name == "lm_head.weight":
                    continue
                if name not in own:
                    unexpected.append(key)
                    continue
                param = own[name]
                if tuple(value.shape) != tuple(param.shape):
                    raise ValueError(f"{key} has shape {tuple(value.shape)}, the model expects {tuple(param.shape)}")
                param.copy_(value)
                seen.add(name)
        missing = sorted(set(own) - seen - ({"lm_head.weight"} if tied else set()))
        if unexpected or missing:
            raise KeyError(f"state dict does not match the model: missing {missing[:6]}{'...' if len(missing) > 6 else ''}, "
                           f"unexpected {unexpected[:6]}{'...' if len(unexpected) > 6 else ''}")

    @classmethod
    def from_hf(cls, config, state_dict: Mapping[str, torch.Tensor], device=None, dtype: Optional[torch.dtype] = None) -> "LlamaForCausalLM":
        """Build from a transformers config (or :class:`ModelConfig`) and state dict; nothing is downloaded.

        ``dtype`` defaults to the state dict's floating dtype, ``device`` to the CPU. Weights are not
        randomly initialised first (the module is created on the meta device).
        """
        cfg = config if isinstance(config, ModelConfig) else ModelConfig.from_hf(config)
        if dtype is None:
            dtype = next((v.dtype for v in state_dict.values() if v.is_floating_point()), torch.float32)
        device = torch.device(device or "cpu")
        with torch.device("meta"):
            model = cls(cfg)
        model = model.to_empty(device=device).to(dtype)
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        model._rope_freqs = rope_freqs(rope_inv_freq(cfg, device))
        model.load_hf_state_dict(state_dict)
        return model.eval()
