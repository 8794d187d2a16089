"""EAGLE-style adaptive drafter: one decoder layer over (token embedding, target feature) pairs.

Notation. The target's *feature* ``f_p`` is its last-layer hidden state (before the final norm) at
position ``p``; ``t_p`` is the token at position ``p``. The drafter consumes *pairs*
``(f_p, t_{p+1})`` -- a feature and the token that followed it -- and predicts ``f_{p+1}``::

    x_p   = fc(concat(embed(t_{p+1}), f_p))                         # [H]
    h_p   = x_p + attn(rms_norm(x_p))      (causal over pairs 0..p, RoPE at position p)
    g_p   = h_p + mlp(rms_norm(h_p))       (SwiGLU)                 # predicted f_{p+1}
    q(t_{p+2}) = softmax(lm_head(final_norm(g_p)))

``embed``, ``final_norm`` and ``lm_head`` are the target's own (shared, frozen: the drafter reads
their weights detached, so no gradient ever reaches the target). The drafter's KV cache holds one
slot per pair: slot ``p`` <-> pair ``(f_p, t_{p+1})``, RoPE position ``p``.

Decoding flow (per request):

1. target prefill of ``t_0..t_{L-1}`` gives ``f_0..f_{L-1}``; the root ``t_L`` is sampled;
   ``extend(state, f_{0..L-1}, t_{1..L})`` fills slots ``0..L-1``; ``state.last_hidden = g_{L-1}``
   predicts the root's feature ``f_L`` and ``state.root_tokens = t_L``.
2. ``draft(state, ...)`` grows a tree below the root: depth-1 candidates are the top-k of
   ``q(. | g_{L-1})``; expanding a depth-``d`` candidate ``c`` runs the pair (feature predicted for
   its parent, ``c``) at slot ``L + d - 1`` (EAGLE's feature re-use), attending to the cached context
   and to its drafted ancestors only. The candidates (cumulative log-probs) go to
   :func:`tlt_kernels.build_draft_tree`. Drafted pairs are never committed: the fused path stores their K/V in
   scratch slots past the context, which the next commit overwrites (:mod:`.eagle_fused`).
3. the target verifies the tree; with accepted nodes ``a_1..a_m`` (features ``f_root, f_{a_1}..``)
   and the bonus token ``x``, ``extend(state, [f_root, f_{a_1}, .., f_{a_m}], [a_1, .., a_m, x])``
   commits ``m + 1`` pairs computed from the *target's* features.

Top-k expansion is deterministic, so verify the tree with :func:`tlt_kernels.verify_tree`'s
deterministic-candidate rule (``draft_probs=None``), which is lossless for any candidate set.
"""
from __future__ import annotations

import copy
import math
import numbers
from dataclasses import dataclass
from typing import List, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .._validation import capturing, check_positive_ints, check_tensor
from ..models.kv_cache import paged_rows
from ..models.llama import rope_freqs
from ..models.packing import PackedLinears
from ..ops.draft_frontier import draft_frontier
from ..ops.rms_norm import rms_norm
from ..ops.top_logprobs import top_logprobs
from . import constants
from .eagle_fused import SCRATCH_SLOTS, FusedExpansion, extend_fused

# ---------------------------------------------------------------------------------------------
# Configuration and shared target pieces
# ---------------------------------------------------------------------------------------------


@dataclass
class EagleConfig:
    """Shape of the drafter; everything but ``intermediate_size`` must match the target."""

    vocab_size: int
    hidden_size: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False

    @classmethod
    def from_target(cls, cfg, intermediate_size: Optional[int] = None) -> "EagleConfig":
        """Build from a target ``ModelConfig`` (or any object with the same attribute names)."""
        return cls(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            num_q_heads=cfg.num_q_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            intermediate_size=cfg.intermediate_size if intermediate_size is None else intermediate_size,
            rope_theta=getattr(cfg, "rope_theta", 10000.0),
            rms_norm_eps=getattr(cfg, "rms_norm_eps", 1e-6),
            attention_bias=getattr(cfg, "attention_bias", False),
        )

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "num_q_heads", "num_kv_heads", "head_dim", "intermediate_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
                raise ValueError(f"EagleConfig.{name} must be a positive int, got {v!r}")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"num_q_heads ({self.num_q_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"EagleConfig.head_dim must be even (RoPE rotates pairs), got {self.head_dim}")
        if not (math.isfinite(self.rope_theta) and self.rope_theta > 0):
            raise ValueError(f"EagleConfig.rope_theta must be a finite number > 0, got {self.rope_theta!r}")


def _find_final_norm(target: nn.Module) -> nn.Module:
    for path in ("norm", "final_norm", "model.norm", "final_layernorm", "model.final_layernorm"):
        mod = target
        for part in path.split("."):
            mod = getattr(mod, part, None)
            if mod is None:
                break
        if isinstance(mod, nn.Module) and getattr(mod, "weight", None) is not None:
            return mod
    raise ValueError(
        "could not find the target's final RMSNorm (looked for .norm, .final_norm, .model.norm); "
        "pass final_norm= explicitly to EagleDrafter.for_target"
    )


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return _rms_norm(x, self.weight, self.eps)


def _rope_inv_freq(head_dim: int, theta: float, device) -> torch.Tensor:
    """float32 ``[D/2]``: ``theta ** (-2i / D)``, the rotation frequencies."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))


def _rope_cos_sin(pos: torch.Tensor, inv_freq: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """float32 ``cos, sin [..., T, 1, D]`` of positions ``pos int [..., T]``, made once for every head of q and k."""
    ang = pos.to(torch.float32).unsqueeze(-1) * inv_freq  # [..., T, D/2]
    cos, sin = ang.cos(), ang.sin()
    return torch.cat([cos, cos], -1).unsqueeze(-2), torch.cat([sin, sin], -1).unsqueeze(-2)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (Llama/Qwen2) of ``x [..., T, Hx, D]`` in float32, rounded to x's dtype once."""
    D = x.shape[-1]
    xf = x.float()
    rot = torch.cat([-xf[..., D // 2 :], xf[..., : D // 2]], -1)
    return (xf * cos + rot * sin).to(x.dtype)


# ---------------------------------------------------------------------------------------------
# The drafter's paged KV cache
# ---------------------------------------------------------------------------------------------


class DrafterKVCache:
    """Paged K/V of the drafter's single layer: ``k, v [num_blocks, block_size, Hkv, D]``.

    Block 0 is reserved as a write sink: padded (invalid) writes land there, so writes never need a
    data-dependent shape and the whole decode step stays CUDA-graph friendly. Allocation is a host
    operation done when a request is admitted.
    """

    def __init__(self, config: EagleConfig, num_blocks: int, block_size: int = 16, device="cpu", dtype=torch.float32):
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, numbers.Integral) or num_blocks < 2:
            raise ValueError(f"num_blocks must be an int >= 2 (block 0 is the write sink), got {num_blocks!r}")
        if isinstance(block_size, bool) or not isinstance(block_size, numbers.Integral) or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r} (slots per block)")
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self._free = list(range(num_blocks - 1, 0, -1))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, batch_size: int, max_tokens: int) -> torch.Tensor:
        """``int32 [batch_size, ceil(max_tokens / block_size)]`` block table of fresh blocks."""
        check_positive_ints("DrafterKVCache.allocate", batch_size=batch_size, max_tokens=max_tokens)
        nb = -(-max_tokens // self.block_size)
        if nb * batch_size > len(self._free):
            raise RuntimeError(
                f"drafter KV cache out of blocks: need {nb * batch_size} for batch_size={batch_size}, "
                f"max_tokens={max_tokens}, have {len(self._free)} free; raise num_blocks"
            )
        ids = torch.tensor([self._free.pop() for _ in range(nb * batch_size)], dtype=torch.int32)
        if self.k.device.type != "cuda":
            return ids.view(batch_size, nb).to(self.k.device)
        # Through pinned memory, no host sync: a rollout allocates right after launching the target's prefill, and a
        # pageable copy would wait for it. The caching host allocator keeps the pinned buffer until the copy is done.
        return ids.view(batch_size, nb).pin_memory().to(self.k.device, non_blocking=True)

    def free(self, block_table: torch.Tensor) -> None:
        """Return a table's blocks (the sink block 0 of padding rows is skipped). A block freed twice would be handed
        to two requests, which would then overwrite each other's K/V: duplicates and double frees raise."""
        blocks = [b for b in block_table.flatten().tolist() if b != 0]
        bad = [b for b in blocks if not 0 < b < self.num_blocks]
        if bad or len(set(blocks)) != len(blocks):
            raise ValueError(f"block_table holds duplicate or out-of-range block ids (valid: 1..{self.num_blocks - 1}"
                             f"{', got ' + str(sorted(bad)[:8]) if bad else ''}); it was not allocated by this cache")
        again = set(self._free).intersection(blocks)
        if again:
            raise ValueError(f"blocks {sorted(again)[:8]} are already free (double free)")
        self._free.extend(blocks)


@dataclass
class EagleState:
    """Per-batch decoding state; every field is a device tensor updated in place.

    ``block_table int32 [B, max_blocks]``, ``context_lens int32 [B]`` (pairs cached),
    ``last_hidden [B, H]`` (the drafter's prediction of the root's feature),
    ``root_tokens int64 [B]`` (token of the last cached pair = root of the next tree).
    """

    block_table: torch.Tensor
    context_lens: torch.Tensor
    last_hidden: torch.Tensor
    root_tokens: torch.Tensor


class EagleDraft(NamedTuple):
    """Output of :meth:`EagleDrafter.draft`.

    ``tree``: :class:`tlt_kernels.DraftTree` (``parents int32 [B, V]``, ``draft_tokens int64 [B, V]``,
    ``cand_index int32 [B, V]``, ``num_nodes int32 [B]``, mask or None).
    ``cand_parents int32 [B, N]``, ``cand_tokens int64 [B, N]``, ``cand_scores float32 [B, N]``: all
    candidates drafted, ``N = topk + (depth - 1) * topk**2``.
    """

    tree: object
    cand_parents: torch.Tensor
    cand_tokens: torch.Tensor
    cand_scores: torch.Tensor


# ---------------------------------------------------------------------------------------------
# The drafter
# ---------------------------------------------------------------------------------------------


class EagleDrafter(nn.Module):
    """One-layer EAGLE drafter (see the module docstring for the math and the decoding flow).

    Args:
        config: :class:`EagleConfig`.
        embed_tokens: the target's ``nn.Embedding`` (shared, never trained here).
        lm_head: the target's output ``nn.Linear`` (shared, never trained here).
        final_norm: the target's final RMSNorm (module with ``weight`` and ``eps`` /
            ``variance_epsilon``; shared, never trained here).

    The shared modules are kept outside ``parameters()`` / ``state_dict()``: the drafter's weights
    are only its own (``fc``, the layer), which is what the spot trainer trains and publishes.
    """

    def __init__(self, config: EagleConfig, embed_tokens: nn.Module, lm_head: nn.Module, final_norm: nn.Module):
        super().__init__()
        c = config
        self.config = c
        H, D = c.hidden_size, c.head_dim
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.input_norm = RMSNorm(H, c.rms_norm_eps)
        self.q_proj = nn.Linear(H, c.num_q_heads * D, bias=c.attention_bias)
        self.k_proj = nn.Linear(H, c.num_kv_heads * D, bias=c.attention_bias)
        self.v_proj = nn.Linear(H, c.num_kv_heads * D, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.num_q_heads * D, H, bias=False)
        self.post_norm = RMSNorm(H, c.rms_norm_eps)
        self.gate_proj = nn.Linear(H, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(H, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, H, bias=False)
        # A plain tuple hides the target's modules from parameters()/state_dict()/.to().
        self._shared = (embed_tokens, lm_head, final_norm)
        # RoPE frequencies per device ([D / 2] and both halves), float32 whatever the weights' dtype (not a buffer:
        # .to(dtype) would round them); made on first use, outside any graph capture (the graphs' warm-up runs first).
        self._rope_tables_by_device: dict = {}
        self._packed_qkv: Optional[PackedLinears] = None  # see pack_projections
        self._packed_gate_up: Optional[PackedLinears] = None
        self.weights_version = 0
        # int64 [N] token ids a draft may propose (set_draft_vocab); None: the whole vocabulary. A buffer that is
        # not saved: it moves with .to(device), and a published state dict (the drafter's own weights) leaves it.
        self.register_buffer("draft_vocab", None, persistent=False)
        self.draft_vocab_version = 0  # counts set_draft_vocab calls (an engine's captured graphs keep one version)
        self._init_weights()

    def _init_weights(self):
        H = self.config.hidden_size
        with torch.no_grad():
            for lin in (self.q_proj, self.k_proj, self.v_proj, self.o_proj, self.gate_proj, self.up_proj, self.down_proj):
                nn.init.normal_(lin.weight, std=0.02)
                if lin.bias is not None:
                    lin.bias.zero_()
            # Start as "predict the target feature unchanged": fc = [0 | I] makes x_p = f_p, and the
            # small residual branches keep g_p ~ f_p, a sensible prior before any training.
            self.fc.weight.zero_()
            self.fc.weight[:, H:] = torch.eye(H)
            self.fc.weight[:, :H].normal_(std=0.02)

    @classmethod
    def for_target(
        cls,
        target: nn.Module,
        intermediate_size: Optional[int] = None,
        final_norm: Optional[nn.Module] = None,
        dtype: torch.dtype = torch.float32,
        seed: Optional[int] = None,
    ) -> "EagleDrafter":
        """A drafter for a Llama/Qwen2-style target (``.config``, ``.embed_tokens``, ``.lm_head``).

        The drafter lives on the target's device in ``dtype`` (float32 by default: it is one layer,
        and AdamW on bf16 weights loses small updates). ``seed``: its initial weights come from
        ``torch.manual_seed(seed)`` in a forked RNG (the same weights in every process, the global RNG
        untouched); None draws them from the global CPU RNG, which recent torch seeds differently in every
        process.
        """
        cfg = EagleConfig.from_target(target.config, intermediate_size)
        embed = getattr(target, "embed_tokens", None) or getattr(getattr(target, "model", None), "embed_tokens", None)
        if embed is None:
            raise ValueError("target has no embed_tokens (looked for .embed_tokens and .model.embed_tokens)")
        norm = final_norm if final_norm is not None else _find_final_norm(target)
        if seed is None:
            drafter = cls(cfg, embed, target.lm_head, norm)
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                drafter = cls(cfg, embed, target.lm_head, norm)
        p = next(target.parameters())
        return drafter.to(device=p.device, dtype=dtype)

    # -- shared head ---------------------------------------------------------------------------

    @property
    def embed_weight(self) -> torch.Tensor:
        return self._shared[0].weight.detach()

    def replica(self, device) -> "EagleDrafter":
        """A copy of this drafter on ``device`` that shares nothing with it or with the target: its own weights (a
        copy, same dtype) and frozen copies of the target's embedding, head and final norm (tied ones stay tied).
        What a spot trainer on another GPU trains; :meth:`copy_shared_from` refreshes the head after the target
        changed (an RL policy update)."""
        device = torch.device(device)
        head = copy.deepcopy(self._shared)  # one memo: a tied embedding and head stay one tensor
        for module in head:
            module.to(device).requires_grad_(False)
        twin = EagleDrafter(self.config, *head)
        twin.load_state_dict(self.state_dict())
        twin.weights_version = self.weights_version
        twin.draft_vocab = None if self.draft_vocab is None else self.draft_vocab.clone()
        param = next(self.parameters())
        return twin.to(device=device, dtype=param.dtype)

    @property
    def shared_modules(self) -> tuple:
        """The target's modules this drafter reads (embedding, LM head, final norm), frozen."""
        return tuple(self._shared)

    def copy_shared_from(self, source: "EagleDrafter") -> None:
        """Copy ``source``'s view of the target (embedding, head, final norm) into this drafter's (a
        :meth:`replica`'s) frozen copies, in place; its own weights are left alone."""
        self.load_shared_states([m.state_dict() for m in source._shared])

    @torch.no_grad()
    def load_shared_states(self, states) -> None:
        """Copy one state dict per shared module (:attr:`shared_modules`' order) into this drafter's frozen copies,
        in place; a state dict whose tensor names differ from the module's raises ValueError."""
        for mine, values in zip(self._shared, states):
            targets = mine.state_dict(keep_vars=True)
            if targets.keys() != values.keys():
                raise ValueError(f"copy_shared_from: the source's shared module has tensors {sorted(values)}, "
                                 f"this drafter's {sorted(targets)}")
            for name, tensor in targets.items():
                tensor.copy_(values[name])

    def head_logits(self, feature: torch.Tensor, fused: bool = False, head=None) -> torch.Tensor:
        """``lm_head(final_norm(feature))`` with the target's weights (no grad into them). ``fused``: the norm in one
        kernel when the feature has the norm's dtype (decoding only: the kernel has no autograd formula). ``head``:
        ``(weight [N, H], bias [N] or None)`` in place of the LM head's (:meth:`draft_head`: the draft vocabulary's
        rows), so the logits are ``[..., N]``."""
        _, lm_head, norm = self._shared
        eps = getattr(norm, "eps", None) or getattr(norm, "variance_epsilon", None) or self.config.rms_norm_eps
        if fused and feature.dtype == norm.weight.dtype:
            x = rms_norm(feature, norm.weight.detach(), eps)[0]
        else:
            x = _rms_norm(feature, norm.weight.detach(), eps)
        w, bias = head if head is not None else self._full_head()
        # Cast the activations, never the [V, H] weight (a copy of it per call would dominate).
        return F.linear(x.to(w.dtype), w, bias)

    def _full_head(self):
        lm_head = self._shared[1]
        bias = lm_head.bias.detach() if getattr(lm_head, "bias", None) is not None else None
        return lm_head.weight.detach(), bias

    def draft_head(self):
        """``(weight, bias)`` of the head a draft scores with: the LM head's rows of :attr:`draft_vocab`, gathered
        from the live weight at each call (an RL update of the target's head is seen at the next draft; inside a
        CUDA graph the gather replays too), or None with the whole vocabulary."""
        if self.draft_vocab is None:
            return None
        w, bias = self._full_head()
        return F.embedding(self.draft_vocab, w), None if bias is None else bias[self.draft_vocab]

    @torch.no_grad()
    def set_draft_vocab(self, token_ids: Optional[torch.Tensor]) -> None:
        """Let drafts propose only ``token_ids`` (FR-Spec, Zhao et al. 2025: a frequency-ranked subset of the
        vocabulary): each draft depth then scores ``N`` rows of the LM head instead of ``V``, a GEMM and a top-k
        ``V / N`` times smaller. Lossless: the target verifies drafted tokens as deterministic candidates, whatever
        set they come from; only the accepted length can fall (a token outside the set is never drafted).

        Args:
            token_ids: int ``[N]``, distinct ids in ``[0, vocab_size)`` (:func:`frequent_tokens` ranks them from the
                model's own text); their order is kept as given (ascending ids keep ``top_logprobs``' tie order of
                the whole vocabulary). None: the whole vocabulary again.

        Set it before an engine is built: its captured draft graphs keep the vocabulary they were captured with, so
        an engine refuses to start a rollout once the vocabulary changed under it.
        Training (:func:`~tlt_kernels.drafter.eagle_loss`) always scores the whole vocabulary.
        """
        if token_ids is None:
            self.draft_vocab = None
            self.draft_vocab_version += 1
            return
        if not isinstance(token_ids, torch.Tensor):
            raise ValueError(f"token_ids must be a 1-D integer tensor, got {type(token_ids).__name__}")
        if token_ids.dim() != 1 or token_ids.dtype.is_floating_point or token_ids.is_complex() \
                or token_ids.dtype == torch.bool:
            raise ValueError(f"token_ids must be a 1-D integer tensor, got {token_ids.dtype} of shape "
                             f"{tuple(token_ids.shape)}")
        V = self.config.vocab_size
        ids = token_ids.detach().to(device="cpu", dtype=torch.int64)
        if ids.numel() == 0:
            raise ValueError("token_ids must hold at least one token id")
        if int(ids.min()) < 0 or int(ids.max()) >= V:
            raise ValueError(f"token_ids must lie in [0, vocab_size={V}), got ids from {int(ids.min())} to {int(ids.max())}")
        if ids.unique().numel() != ids.numel():
            raise ValueError("token_ids must be distinct (a token listed twice would take two of a draft's top-k)")
        self.draft_vocab = ids.to(next(self.parameters()).device)
        self.draft_vocab_version += 1

    @property
    def draft_vocab_size(self) -> int:
        """How many tokens a draft chooses from: ``len(draft_vocab)``, or the whole vocabulary."""
        return self.config.vocab_size if self.draft_vocab is None else int(self.draft_vocab.numel())

    # -- building blocks -----------------------------------------------------------------------

    def _input(self, feature: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        dt = self.fc.weight.dtype
        emb = F.embedding(next_tokens, self.embed_weight).to(dt)
        return self.fc(torch.cat([emb, feature.to(dt)], dim=-1))

    def _qkv(self, x: torch.Tensor, pos: torch.Tensor, query_at: Optional[torch.Tensor] = None):
        """Rotated ``q, k`` and ``v`` of the pairs ``x [..., T, H]`` at positions ``pos [..., T]``; with ``query_at``
        (int64 ``[B]``, ``x`` of shape ``[B, T, H]``) the query of each request's pair ``query_at`` only: ``q [B, Hq,
        D]`` (a prompt's start reads only its last pair's output)."""
        c = self.config
        h = self.input_norm(x)
        shp = x.shape[:-1]
        k = self.k_proj(h).view(*shp, c.num_kv_heads, c.head_dim)
        v = self.v_proj(h).view(*shp, c.num_kv_heads, c.head_dim)
        cos, sin = _rope_cos_sin(pos, self.rope_inv_freq(x.device))
        if query_at is None:
            q = self.q_proj(h).view(*shp, c.num_q_heads, c.head_dim)
            return _rotate(q, cos, sin), _rotate(k, cos, sin), v
        rows = torch.arange(x.shape[0], device=x.device)
        q = self.q_proj(h[rows, query_at]).view(x.shape[0], c.num_q_heads, c.head_dim)
        return _rotate(q, cos[rows, query_at], sin[rows, query_at]), _rotate(k, cos, sin), v

    def qkv_projections(self, h: torch.Tensor):
        """``q, k, v`` of ``h [..., H]``: one GEMM once :meth:`pack_projections` has packed them, else three."""
        if self._packed_qkv is not None and self._packed_qkv.valid():
            return self._packed_qkv(h)
        return self.q_proj(h), self.k_proj(h), self.v_proj(h)

    def gate_up_projections(self, h: torch.Tensor):
        """``gate, up`` of ``h [..., H]``: one GEMM once packed, else two."""
        if self._packed_gate_up is not None and self._packed_gate_up.valid():
            return self._packed_gate_up(h)
        return self.gate_proj(h), self.up_proj(h)

    def pack_projections(self) -> None:
        """Pack q/k/v and gate/up into one weight each (:mod:`tlt_kernels.models.packing`) for the decoding paths:
        the parameters become views of the packed tensors, so in-place updates (``load_state_dict``, an optimizer
        step) keep them packed; anything giving a parameter new storage unpacks (the separate GEMMs run). Idempotent."""
        if self._packed_qkv is None or not self._packed_qkv.valid():
            self._packed_qkv = PackedLinears([self.q_proj, self.k_proj, self.v_proj])
        if self._packed_gate_up is None or not self._packed_gate_up.valid():
            self._packed_gate_up = PackedLinears([self.gate_proj, self.up_proj])

    def rope_inv_freq(self, device) -> torch.Tensor:
        """float32 ``[D/2]`` RoPE frequencies on ``device`` (made on first use, outside any graph capture)."""
        return self._rope_tables(device)[0]

    def rope_freqs(self, device) -> torch.Tensor:
        """float32 ``[D]``: :meth:`rope_inv_freq` twice (:func:`tlt_kernels.models.llama.rope_freqs`), kept alike."""
        return self._rope_tables(device)[1]

    def _rope_tables(self, device):
        tables = self._rope_tables_by_device.get(device)
        if tables is None:
            inv_freq = _rope_inv_freq(self.config.head_dim, self.config.rope_theta, device)
            tables = self._rope_tables_by_device[device] = (inv_freq, rope_freqs(inv_freq))
        return tables

    def _finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        h = x + self.o_proj(attn.flatten(-2))
        m = self.post_norm(h)
        return h + self.down_proj(F.silu(self.gate_proj(m)) * self.up_proj(m))

    def _attend_parts(self, q, parts):
        """Attention of ``q [B, Tq, Hq, D]`` over the union of key parts, without concatenating K/V or repeating
        them per query head: ``parts`` = ``[(k_t [B, Hkv, D, L], v [B, Hkv, L, D], mask bool [B, Tq, L]), ...]``.
        The query heads of a KV group become extra rows (``[B, Hkv, G * Tq, D]``), the scores of every part
        are concatenated (``L`` columns: small next to K/V) and one softmax in fp32 spans them. Every query
        row must see at least one key (the drafter's rows always see themselves)."""
        B, Tq, Hq, D = q.shape
        Hkv = parts[0][0].shape[1]
        G = Hq // Hkv
        qg = (q * D**-0.5).view(B, Tq, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * Tq, D)
        scores, widths = [], []
        for k_t, _, mask in parts:
            sc = torch.matmul(qg, k_t.to(q.dtype)).float()  # [B, Hkv, G*Tq, L]
            rows = mask.unsqueeze(1).unsqueeze(2).expand(B, 1, G, Tq, mask.shape[-1]).reshape(B, 1, G * Tq, -1)
            scores.append(sc.masked_fill(~rows, float("-inf")))
            widths.append(mask.shape[-1])
        prob = torch.softmax(torch.cat(scores, -1), -1).to(q.dtype)
        out = None
        for (_, v, _), pr in zip(parts, prob.split(widths, -1)):
            o = torch.matmul(pr, v.to(q.dtype))
            out = o if out is None else out + o
        return out.view(B, Hkv, G, Tq, D).permute(0, 3, 1, 2, 4).reshape(B, Tq, Hq, D)

    # -- training ------------------------------------------------------------------------------

    def forward(self, features: torch.Tensor, next_tokens: torch.Tensor, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Teacher-forced pass over whole sequences (training and evaluation).

        Args:
            features: ``[B, S, H]`` target features ``f_p`` (float32/bf16/fp16).
            next_tokens: ``int64 [B, S]`` tokens ``t_{p+1}``.
            positions: ``int [B, S]`` RoPE positions (default ``0..S-1``).

        Returns:
            ``[B, S, H]`` predicted features ``g_p ~ f_{p+1}`` (causal: pair p sees pairs <= p).
        """
        B, S, _ = features.shape
        if positions is None:
            positions = torch.arange(S, device=features.device).expand(B, S)
        x = self._input(features, next_tokens)
        q, k, v = self._qkv(x, positions)
        G = self.config.num_q_heads // self.config.num_kv_heads
        attn = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(G, 1), v.transpose(1, 2).repeat_interleave(G, 1), is_causal=True
        ).transpose(1, 2)
        return self._finish(x, attn)

    def forward_unrolled(self, features: torch.Tensor, next_tokens: torch.Tensor,
                         positions: Optional[torch.Tensor] = None, steps: int = 1) -> List[torch.Tensor]:
        """Teacher-forced pass unrolled over ``steps`` draft depths ("training-time test"): what a draft computes.

        At draft depth ``s`` a node's input feature is its parent's prediction, not a target feature, and it sees
        the real context before the draft plus its own ancestors. Pass 1 is :meth:`forward`. Pass ``s`` feeds pair
        ``p`` the prediction of pass ``s - 1`` at pair ``p - 1`` (with the real token ``t_{p+1}``: only accepted
        paths, whose tokens are the real ones, matter) and lets it attend to pass 1's keys of pairs
        ``<= p - s + 1`` (real features) and to pass ``r``'s key of pair ``p - s + r`` for ``r = 2..s`` (its
        ancestors and itself).

        Args: as :meth:`forward`; ``steps`` >= 1.

        Returns:
            ``[g^1, ..., g^steps]``, each ``[B, S, H]``: ``g^s[:, p]`` predicts ``f_{p+1}`` from real features of
            pairs ``<= p - s + 1``. Pairs ``p < s - 1`` have no such draft; their entries are defined but
            meaningless (callers mask them).
        """
        check_positive_ints("EagleDrafter.forward_unrolled", steps=steps)
        B, S, _ = features.shape
        if positions is None:
            positions = torch.arange(S, device=features.device).expand(B, S)
        x = self._input(features, next_tokens)
        q, k, v = self._qkv(x, positions)
        causal = torch.ones(S, S, dtype=torch.bool, device=features.device).tril()
        diagonal = torch.eye(S, dtype=torch.bool, device=features.device)
        real = (k.permute(0, 2, 3, 1), v.transpose(1, 2))  # k_t [B, Hkv, D, S], v [B, Hkv, S, D]
        own = [self._finish(x, self._attend_parts(q, [(*real, causal.expand(B, S, S))]))]
        drafted = []  # (k_t, v) of passes 2..s
        for s in range(2, steps + 1):
            parent = torch.cat([own[-1][:, :1], own[-1][:, :-1]], 1)  # pair p reads pass s-1's prediction at p-1
            x = self._input(parent, next_tokens)
            q, k, v = self._qkv(x, positions)
            drafted.append((k.permute(0, 2, 3, 1), v.transpose(1, 2)))
            parts = [(*real, causal.tril(-(s - 1)).expand(B, S, S))]
            # pass r's key of pair p - s + r: the diagonal moved s - r columns left (wrapped columns are past p)
            parts += [(k_t, v_r, (diagonal.roll(-(s - r), 1) & causal).expand(B, S, S))
                      for r, (k_t, v_r) in enumerate(drafted, 2)]
            own.append(self._finish(x, self._attend_parts(q, parts)))
        return own

    # -- decoding ------------------------------------------------------------------------------

    @staticmethod
    def blocks_per_request(max_tokens: int, block_size: int) -> int:
        """Blocks :meth:`new_state` takes per request: ``max_tokens`` pairs plus the fused path's
        :data:`~tlt_kernels.drafter.eagle_fused.SCRATCH_SLOTS` slots past them."""
        return -(-(max_tokens + SCRATCH_SLOTS) // block_size)

    def new_state(self, cache: DrafterKVCache, batch_size: int, max_tokens: int) -> EagleState:
        """A state of ``batch_size`` requests of up to ``max_tokens`` pairs each, whose tables take
        :meth:`blocks_per_request` blocks each from ``cache``."""
        dev = cache.k.device
        return EagleState(
            block_table=cache.allocate(batch_size, max_tokens + SCRATCH_SLOTS),
            context_lens=torch.zeros(batch_size, dtype=torch.int32, device=dev),
            last_hidden=torch.zeros(batch_size, self.config.hidden_size, dtype=self.fc.weight.dtype, device=dev),
            root_tokens=torch.zeros(batch_size, dtype=torch.int64, device=dev),
        )

    def _gather_context(self, cache: DrafterKVCache, block_table: torch.Tensor):
        B, MB = block_table.shape
        bs = cache.block_size
        k = cache.k[block_table.long()].reshape(B, MB * bs, *cache.k.shape[2:])
        v = cache.v[block_table.long()].reshape(B, MB * bs, *cache.v.shape[2:])
        return k, v

    @torch.no_grad()
    def extend(self, state: EagleState, cache: DrafterKVCache, features: torch.Tensor, next_tokens: torch.Tensor,
               num_new: torch.Tensor, validate: bool = True, fused: bool = True) -> None:
        """Append pairs ``(features[:, i], next_tokens[:, i])`` for ``i < num_new[b]`` (prefill and commit).

        Args:
            state: :class:`EagleState`, updated in place (``context_lens += num_new``; ``last_hidden``
                and ``root_tokens`` from the last new pair of each request with ``num_new > 0``).
            cache: the drafter's :class:`DrafterKVCache`.
            features: ``[B, n, H]`` target features of the new positions.
            next_tokens: ``int64 [B, n]``, the token following each feature.
            num_new: ``int32 [B]`` valid pairs per request, in ``[0, n]``.
            validate: check ``num_new`` and that ``context_lens + num_new`` fits the state's block table less its
                scratch slots (one host sync; skipped while a CUDA graph is captured). Past the table a write would
                land in its last block and overwrite earlier pairs. ``False``: the caller guarantees both (the engine
                does, by construction), with no host sync.
            fused: take the fused path (:mod:`.eagle_fused`) where it applies (``n <= SCRATCH_SLOTS``, the cache in
                the drafter's dtype); ``False``: the dense path always. A prompt's pairs go to :meth:`prefill`.
        """
        n = self._check_pairs(state, features, next_tokens, num_new)
        if validate and not capturing(features.device):
            _check_extend(state, cache, num_new, n)
        x = self._input(features, next_tokens)
        if fused and self._fused(cache, n):
            g = extend_fused(self, state, cache, x)
        else:
            g = self._extend_dense(state, cache, x, num_new)
        _advance(state, g, next_tokens, num_new)

    @torch.no_grad()
    def prefill(self, state: EagleState, cache: DrafterKVCache, features: torch.Tensor, next_tokens: torch.Tensor,
                num_new: torch.Tensor, validate: bool = True) -> None:
        """:meth:`extend` of a state that holds no pair yet (the prompts of a rollout), for any ``n``.

        Later steps read two things of the new pairs: every pair's K/V (from its input alone) and the last pair's
        output (``last_hidden``). So K/V are computed for all ``n`` pairs, and the query, the attention, the output
        projection and the MLP (most of the layer's FLOPs) for each request's last pair only, which with no cached
        pair sees exactly the new pairs up to itself; :meth:`extend`'s dense path runs the whole layer over every
        pair. Same arguments as :meth:`extend`; ``validate`` also checks that ``state.context_lens`` is all zero (in
        the same host sync)."""
        n = self._check_pairs(state, features, next_tokens, num_new)
        if validate and not capturing(features.device):
            _check_extend(state, cache, num_new, n, empty=True)
        x = self._input(features, next_tokens)
        B, dev = x.shape[0], x.device
        slot = torch.arange(n, device=dev).expand(B, n)
        last = (num_new.to(torch.int64) - 1).clamp(min=0)  # a request with no pair: garbage its state never takes
        rows = torch.arange(B, device=dev)
        q, k, v = self._qkv(x, slot, query_at=last)
        valid = slot < num_new.to(torch.int64).unsqueeze(1)
        k, v = _store_pairs(state, cache, slot, valid, k, v)  # attend to what later steps read back from the cache
        sees = (slot <= last.unsqueeze(1)).view(B, 1, 1, n)
        attn = F.scaled_dot_product_attention(q.unsqueeze(2), k.to(q.dtype).transpose(1, 2),
                                              v.to(q.dtype).transpose(1, 2), attn_mask=sees, enable_gqa=True)
        g_last = self._finish(x[rows, last].unsqueeze(1), attn.transpose(1, 2))
        _advance(state, g_last, next_tokens, num_new, last_only=True)

    def _check_pairs(self, state: EagleState, features: torch.Tensor, next_tokens: torch.Tensor,
                     num_new: torch.Tensor) -> int:
        """Shapes, dtypes and devices of :meth:`extend`'s arguments (no host sync); returns ``n``."""
        if features.dim() != 3:
            raise ValueError(f"features must be [B, n, H], got shape {tuple(features.shape)}")
        B, n, _ = features.shape
        dev = features.device
        check_tensor("features", features, shape=(B, n, self.config.hidden_size))
        check_tensor("next_tokens", next_tokens, dtype=torch.int64, shape=(B, n), device=dev)
        check_tensor("num_new", num_new, dtype=(torch.int32, torch.int64), shape=(B,), device=dev)
        check_tensor("state.context_lens", state.context_lens, shape=(B,), device=dev)
        return n

    def _fused(self, cache: DrafterKVCache, width: int) -> bool:
        """Whether ``width`` new tokens run the fused path (:mod:`.eagle_fused`): the kernels take that many, and the
        cache holds the drafter's dtype (the K/V store rides in the rotation's launch)."""
        return width <= SCRATCH_SLOTS and cache.k.dtype == self.fc.weight.dtype

    def _extend_dense(self, state: EagleState, cache: DrafterKVCache, x: torch.Tensor, num_new: torch.Tensor):
        """The reference commit: ``g [B, n, H]`` of the pairs ``x [B, n, H]``, each seeing every cached slot up to its
        own through the whole gathered table; the valid pairs' K/V written first (the others to the sink block 0)."""
        B, n, _ = x.shape
        ctx = state.context_lens.to(torch.int64)
        i = torch.arange(n, device=x.device)
        valid = i.unsqueeze(0) < num_new.to(torch.int64).unsqueeze(1)  # [B, n]
        slot = ctx.unsqueeze(1) + i  # [B, n]
        q, k, v = self._qkv(x, slot)
        _store_pairs(state, cache, slot, valid, k, v)
        ck, cv = self._gather_context(cache, state.block_table)
        mask = torch.arange(ck.shape[1], device=x.device).view(1, 1, -1) <= slot.unsqueeze(2)
        return self._finish(x, self._attend_parts(q, [(ck.permute(0, 2, 3, 1), cv.transpose(1, 2), mask)]))

    @torch.no_grad()
    def draft(self, state: EagleState, cache: DrafterKVCache, depth: int, topk: int, num_verify: int, return_mask: bool = False) -> EagleDraft:
        """Draft a token tree below each root (EAGLE-2 dynamic tree).

        Step 1 takes the top-``topk`` of ``q(. | last_hidden)``; each of the ``depth - 1`` further
        steps expands the ``topk`` best frontier candidates (by cumulative log-prob) into ``topk``
        children each. All ``N = topk + (depth-1) * topk**2`` candidates go to
        :func:`tlt_kernels.build_draft_tree`, which keeps the best ``num_verify - 1``.

        Returns:
            :class:`EagleDraft`.
        """
        from ..ops.build_draft_tree import build_draft_tree

        if depth < 1 or num_verify < 1 or not 1 <= topk <= self.draft_vocab_size:
            bound = (f"vocab_size={self.config.vocab_size}" if self.draft_vocab is None
                     else f"the draft vocabulary's {self.draft_vocab_size} tokens")
            raise ValueError(f"depth, topk and num_verify must be >= 1 and topk <= {bound}, got depth={depth}, "
                             f"topk={topk}, num_verify={num_verify}")
        B, H = state.last_hidden.shape
        K = topk
        dev = state.last_hidden.device
        fused = self._fused(cache, (depth - 1) * K)
        expand = FusedExpansion(self, state, cache, depth, K) if fused else _DenseExpansion(self, state, cache)
        head, vocab = self.draft_head(), self.draft_vocab  # the head's rows gathered once per draft
        score, tok = self._top_candidates(state.last_hidden, fused, head, vocab, K)  # [B, K]
        # Depth 1 hangs from the root: a kept constant where only the cat below reads it, else returned as made.
        cand_par = [constants.full(K, -1, torch.int32, dev).expand(B, K) if depth > 1
                    else torch.full((B, K), -1, dtype=torch.int32, device=dev)]
        cand_tok, cand_score = [tok], [score]
        if depth > 1:  # the frontier: scores, candidate indices, rows among the expanded nodes (-1: the root), inputs
            scores, cand_index = score, constants.arange(K, dev).expand(B, K)
            parent_rows = constants.full(K, -1, torch.int64, dev).expand(B, K)
            x = self._input(state.last_hidden.unsqueeze(1).expand(B, K, H), tok)
        for step in range(1, depth):
            g = expand(x, parent_rows, step)  # [B, K, H]
            c_score, c_tok = self._top_candidates(g, fused, head, vocab, K)  # [B, K, K]
            keep = K if step < depth - 1 else 0  # the last depth needs no next frontier
            f = draft_frontier(scores, cand_index, c_score, c_tok, g, self.embed_weight, keep,
                               first_index=K + (step - 1) * K * K, first_row=(step - 1) * K,
                               ancestor_words=expand.ancestor_words, validate=False)
            cand_par.append(f.cand_parents)
            cand_tok.append(c_tok.view(B, K * K))
            cand_score.append(f.cand_scores)
            scores, cand_index, parent_rows, x = f.scores, f.cand_index, f.parent_rows, self.fc(f.inputs)
        cand_parents, cand_tokens, cand_scores = (torch.cat(c, 1) if depth > 1 else c[0]
                                                  for c in (cand_par, cand_tok, cand_score))
        tree = build_draft_tree(cand_parents, cand_tokens, cand_scores, num_verify, state.root_tokens, return_mask=return_mask, validate=False)
        return EagleDraft(tree, cand_parents, cand_tokens, cand_scores)

    def _top_candidates(self, feature, fused: bool, head, vocab, K: int):
        """The ``K`` best next tokens of each feature and their log-probabilities (over the draft vocabulary)."""
        return top_logprobs(self.head_logits(feature, fused, head), K, token_ids=vocab)  # columns read as tokens

    # -- versioned weights -----------------------------------------------------------------------

    def load_weights(self, weights) -> None:
        """Load a published :class:`~tlt_kernels.drafter.DrafterWeights` (between decoding steps)."""
        self.load_state_dict(weights.state_dict)
        self.weights_version = weights.version

    def maybe_update(self, holder) -> bool:
        """Swap in the holder's latest weights if newer than ours; returns whether it did."""
        w = holder.latest()
        if w is None or w.version <= self.weights_version:
            return False
        self.load_weights(w)
        return True


class _DenseExpansion:
    """The reference of :class:`~tlt_kernels.drafter.eagle_fused.FusedExpansion` (same call): the context gathered
    once per draft (``keys [B, Hkv, D, Lc]``, ``values [B, Hkv, Lc, D]``, a mask of the cached slots), the expanded
    nodes' K/V kept per step, attention over both parts in one fp32 softmax."""

    def __init__(self, drafter: "EagleDrafter", state: EagleState, cache: DrafterKVCache):
        self.drafter = drafter
        ck, cv = drafter._gather_context(cache, state.block_table)
        self.context_lens = state.context_lens.to(torch.int64)
        self.context_mask = torch.arange(ck.shape[1], device=ck.device).unsqueeze(0) < self.context_lens.unsqueeze(1)
        self.context = (ck.permute(0, 2, 3, 1).contiguous(), cv.transpose(1, 2).contiguous())
        self.keys, self.values = [], []
        self.ancestors = None  # bool [B, P, P] over the P nodes expanded so far (row i: its ancestors and itself)
        self.ancestor_words = None  # the frontier step writes no words for this path (it keeps `ancestors`)

    def __call__(self, x: torch.Tensor, parent_rows: torch.Tensor, step: int) -> torch.Tensor:
        B, K, _ = x.shape
        d = self.drafter
        ancestors = self.ancestors = _extend_ancestors(self.ancestors, parent_rows, K)
        q, k, v = d._qkv(x, (self.context_lens + step - 1).unsqueeze(1).expand(B, K))
        self.keys.append(k)
        self.values.append(v)
        P = ancestors.shape[1]
        tree_k, tree_v = torch.cat(self.keys, 1), torch.cat(self.values, 1)  # [B, P, Hkv, D]
        parts = [(*self.context, self.context_mask.unsqueeze(1).expand(B, K, -1)),
                 (tree_k.permute(0, 2, 3, 1), tree_v.transpose(1, 2), ancestors[:, P - K :])]
        return d._finish(x, d._attend_parts(q, parts))


def _extend_ancestors(ancestors: Optional[torch.Tensor], parent_rows: torch.Tensor, K: int) -> torch.Tensor:
    """The ancestor mask with K new nodes appended: a node sees its parent's ancestors, plus itself."""
    B = parent_rows.shape[0]
    dev = parent_rows.device
    P = K if ancestors is None else ancestors.shape[1] + K
    new = torch.zeros(B, K, P, dtype=torch.bool, device=dev)
    if ancestors is not None:
        par_rows = ancestors.gather(1, parent_rows.clamp(min=0).unsqueeze(2).expand(B, K, ancestors.shape[2]))
        new[:, :, : P - K] = par_rows & (parent_rows >= 0).unsqueeze(2)
        widened = torch.cat([ancestors, torch.zeros(B, ancestors.shape[1], K, dtype=torch.bool, device=dev)], 2)
        ancestors = torch.cat([widened, new], 1)
    else:
        ancestors = new
    ancestors[:, P - K :, P - K :] |= torch.eye(K, dtype=torch.bool, device=dev)
    return ancestors


def _store_pairs(state: EagleState, cache: DrafterKVCache, slot: torch.Tensor, valid: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Write new pairs' ``k, v [B, n, Hkv, D]`` at their ``slot [B, n]``: valid pairs to their paged rows, the others to
    the sink block 0 (a fixed-shape write with no host sync). Returns ``k, v`` in the cache's dtype."""
    rows = torch.where(valid, paged_rows(state.block_table, slot, cache.block_size), slot % cache.block_size)
    k, v = k.to(cache.k.dtype), v.to(cache.v.dtype)
    cache.k.view(-1, *cache.k.shape[2:])[rows] = k
    cache.v.view(-1, *cache.v.shape[2:])[rows] = v
    return k, v


def _advance(state: EagleState, g: torch.Tensor, next_tokens: torch.Tensor, num_new: torch.Tensor,
             last_only: bool = False) -> None:
    """The state after appending ``num_new`` pairs whose outputs are ``g [B, n, H]`` (``last_only``: ``g [B, 1, H]``,
    each request's last new pair's): each request with a new pair takes its last one's output and token as
    ``last_hidden`` and ``root_tokens``."""
    B = g.shape[0]
    last = (num_new.to(torch.int64) - 1).clamp(min=0)
    has = (num_new > 0).unsqueeze(1)
    rows = constants.arange(B, g.device)
    g_last = g[:, 0] if last_only else g[rows, last]
    # Each select writes the state in place (out= may be one of its inputs: elementwise, same positions).
    torch.where(has, g_last.to(state.last_hidden.dtype), state.last_hidden, out=state.last_hidden)
    torch.where(has.squeeze(1), next_tokens[rows, last], state.root_tokens, out=state.root_tokens)
    state.context_lens.add_(num_new.to(state.context_lens.dtype))


def _check_extend(state: EagleState, cache: DrafterKVCache, num_new: torch.Tensor, n: int, empty: bool = False) -> None:
    """``0 <= num_new <= n`` and ``context_lens + num_new <= `` the table's slots, per request, and with ``empty``
    ``context_lens == 0`` (one host sync)."""
    room = state.block_table.shape[1] * cache.block_size - SCRATCH_SLOTS  # new_state's scratch stays free
    ctx = state.context_lens.to(torch.int64)
    new = num_new.to(torch.int64)
    bad = (new < 0) | (new > n) | (ctx < 0) | (ctx + new > room)
    if empty:
        bad |= ctx != 0
    if not bool(bad.any()):
        return
    b = int(bad.nonzero()[0, 0])
    c, k = int(ctx[b]), int(new[b])
    caller = "EagleDrafter.prefill" if empty else "EagleDrafter.extend"
    if not 0 <= k <= n:
        raise ValueError(f"{caller}: num_new[{b}] = {k} is outside [0, n={n}] (the pairs given per request)")
    if empty and c != 0:
        raise ValueError(f"EagleDrafter.prefill: request {b} already holds context_lens = {c} pairs; prefill takes a "
                         f"state with none (new_state), extend appends to one")
    raise ValueError(f"{caller}: request {b} holds context_lens = {c} pairs and adds num_new = {k}, past the "
                     f"{room} slots of its block table ({state.block_table.shape[1]} blocks of {cache.block_size}, "
                     f"less {SCRATCH_SLOTS} scratch slots); allocate the state with a larger max_tokens")


def num_candidates(depth: int, topk: int) -> int:
    return topk + (depth - 1) * topk * topk


def accepted_length_greedy(parents: torch.Tensor, draft_tokens: torch.Tensor, num_nodes: torch.Tensor, continuation: torch.Tensor) -> torch.Tensor:
    """Accepted length (drafts accepted + 1 bonus) of a tree verified greedily.

    For greedy decoding the target's continuation is known in advance (``continuation int64 [B, C]``,
    the tokens following the root); a node is accepted iff its parent is and its token equals the
    continuation at its depth. Returns ``int64 [B]`` = 1 + depth of the deepest accepted node.
    """
    B, T = parents.shape
    C = continuation.shape[1]
    dev = parents.device
    ok = torch.zeros(B, T, dtype=torch.bool, device=dev)
    depth = torch.zeros(B, T, dtype=torch.int64, device=dev)
    ok[:, 0] = True
    rows = torch.arange(B, device=dev)
    for i in range(1, T):
        p = parents[:, i].long().clamp(min=0)
        d = depth[rows, p] + 1
        depth[:, i] = d
        want = continuation.gather(1, (d - 1).clamp(max=C - 1).unsqueeze(1)).squeeze(1)
        ok[:, i] = ok[rows, p] & (draft_tokens[:, i] == want) & (d <= C) & (i < num_nodes.long())
    return 1 + torch.where(ok, depth, torch.zeros_like(depth)).max(dim=1).values
