"""CUDA backend of tree attention: launches ``_C.tree_attention_partial`` (mma.sync, every covered shape) or
``_C.tree_attention_sm90`` (wgmma, see :data:`CONTEXT_SM90`), then ``_C.tree_attention_merge`` when the plan has
more than one context split.

Scratch use (narrower than the plan's table, like the Triton backend): the tree is folded into each
request's last non-empty context split; a request whose context fits one split is finished by the
partial kernel, which writes ``out`` directly; otherwise slots ``s < ceil(context_lens[b] / split_len)``
of ``partial_out`` / ``partial_lse`` are written (the last one includes the tree) and merged. Slot
``S`` is never used. See ``docs/TREE_ATTENTION.md`` ("CUDA backend").

Called by :func:`tlt_kernels.ops.tree_attention.run` (inside the ``tlt::tree_attention_run`` custom
op) after shape / dtype / device validation; it only checks what the CUDA kernels add (head dim,
16-byte alignment of the cp.async sources) and never synchronizes, so it is CUDA-graph capturable.

NaN and page ids follow ``run``'s contract in every kernel (csrc/tree_attention/tree_attention.h says how); the page bound is
``cache_tokens // block_size``, the smaller cache's page count.
"""
from __future__ import annotations

import contextlib
import functools
import sys
from typing import Iterator, Optional

import torch

from .. import _switches
from .._backend import cuda_capability
from .._validation import FP8_DTYPES
from . import dtype_code, extension, kv_fp8_code, ptr, stream_handle, strides

__all__ = ["run_cuda", "unsupported_reason"]

HEAD_DIMS = (64, 128, 256)
# Kernel configuration passed to the launcher: 0 picks per shape; 1-7 force a tuning variant (listed
# in csrc/tree_attention/tree_attention.cu: launch_partial, and launch_partial_fp8 for fp8 caches, which takes 1 and
# 5 only). Only benchmark sweeps and tests set it.
CONFIG_OVERRIDE = 0


# sm_90 path: step 1 on the wgmma kernel (csrc/tree_attention/tree_attention_ctx_sm90.cu) instead of the mma.sync one,
# same outputs (the tree folded into each request's last split, out written for one-split requests, the merge for
# the rest). Covers sm_90, D=128, T <= 64, split_len a multiple of the tile (context_tile), power-of-two pages of
# contiguous token rows (stride(0) == block_size * stride(1)), and T*G <= 128 rows, or any T*G with the
# warp-specialized build (CONTEXT_WARP_SPECIALIZED), one CTA per 128-row block (wide trees: T = 32, 64).
# None (default, TLT_TREE_ATTENTION_CUDA_CTX unset or "auto"): on where T*G >= CONTEXT_SM90_MIN_ROWS: both the
# two-warpgroup kernel (T*G > 64) and the one-warpgroup kernel (T*G <= 64) measured faster than the mma.sync kernel,
# one split or several (figures: docs/CUDA_NOTES.md, "Measurements behind the csrc rules").
# True ("1"): wherever covered; False ("0"): off.
CONTEXT_SM90: Optional[bool] = _switches.TREE_ATTENTION_CUDA_CTX.get()
CONTEXT_SM90_MIN_ROWS = 1  # the auto rule: T*G at least this
CONTEXT_SM90_MAX_ROWS = 128  # the lockstep kernels' rows (two warpgroups of 64); the warp-specialized one takes any
# The sm_90 kernel's tile (kBlockN) where T*G > 64: 128 (the two-warpgroup kernel, the default: half the per-tile
# barriers and waits of 64) or 64 (the one-warpgroup kernel once per 64-row chunk: slower, docs/CUDA_NOTES.md). The one value is the kernel's config and the split_len divisibility the path
# needs (default_split_len rounds to it), so they cannot disagree.
CONTEXT_BLOCK = 128
CONTEXT_BLOCKS = (64, 128)
# The tile where T*G <= 64 (one warpgroup's rows): 64 launches the one-warpgroup kernel (Q in registers, 97.75 KB of
# shared memory, two CTAs per SM); 128 the two-warpgroup kernel with its second warpgroup all padding rows.
CONTEXT_BLOCK_FEW_ROWS = 64
ONE_WARPGROUP_ROWS = 64
# The 128-token kernel's build (T*G > 64). True (default; TLT_TREE_ATTENTION_CUDA_WS unset or 1): warp-specialized
# (csrc/tree_attention/tree_attention_ctx_sm90_ws.cu: a producer warpgroup fills the K/V ring under per-slot
# mbarriers, the two consumer warpgroups ping-pong their GEMMs, Q in registers). False (0): the lockstep two-warpgroup
# kernel (csrc/tree_attention/tree_attention_ctx_sm90.cu). The default because it measured faster on both cards
# (docs/CUDA_NOTES.md, "Measurements behind the csrc rules").
CONTEXT_WARP_SPECIALIZED: bool = _switches.TREE_ATTENTION_CUDA_WS.get()
WARP_SPECIALIZED_FLAG = 1024  # csrc/tree_attention/tree_attention.h, kSm90WarpSpecialized: ORed into the launch config
# The warp-specialized kernel's copies of whole context tiles: TMA (one instruction per 16-token page half; pages of
# 16 tokens or more, else the kernel keeps cp.async) or 16-byte cp.async from every producer thread. None (default,
# TLT_TREE_ATTENTION_CUDA_TMA unset or "auto"): TMA where the consumers' math is the limit, which the cp.async
# producer's issue slots slow: wide trees (T*G > 128, bit-identical outputs), and every T*G on cards whose memory
# outruns the math (peak bandwidth >= TMA_MIN_BANDWIDTH_GBPS); cp.async at T*G <= 128 on slower memory, which streams
# at its copy bandwidth either way (figures: docs/CUDA_NOTES.md, "Measurements behind the csrc rules").
# True ("1") / False ("0"): everywhere / nowhere.
CONTEXT_TMA: Optional[bool] = _switches.TREE_ATTENTION_CUDA_TMA.get()
TMA_FLAG = 2048  # csrc/tree_attention/tree_attention.h, kSm90Tma
# Between the peak bandwidths of the slower and the faster card measured (2 x memory clock x bus width, as the driver
# reports them; the two cards' figures are in docs/CUDA_NOTES.md).
TMA_MIN_BANDWIDTH_GBPS = 3700.0


@functools.lru_cache(maxsize=None)
def has_fast_memory(device_index: int) -> bool:
    """Whether the card's peak memory bandwidth (``_C.device_memory_bandwidth_gbps``) reaches
    :data:`TMA_MIN_BANDWIDTH_GBPS`: one driver query per device and process, made at the first launch."""
    return extension().device_memory_bandwidth_gbps(device_index) >= TMA_MIN_BANDWIDTH_GBPS


MAX_TREE_SM90 = 64  # a row's ancestor bits are one 64-bit word (tree_attn::kMaxTree)


def _context_block(block: Optional[int]) -> int:
    block = CONTEXT_BLOCK if block is None else block
    if block not in CONTEXT_BLOCKS:
        raise ValueError(f"the sm_90 kernel's tile is one of {CONTEXT_BLOCKS} tokens, got {block!r}")
    return block


def forced_context_path(sm90: Optional[bool]) -> Iterator[None]:
    """Sets :data:`CONTEXT_SM90` inside the block (True / False force the sm_90 path on / off where it is covered,
    None is the auto rule) and restores it after: for benchmarks that time both paths in one process. Check
    :func:`_use_context_sm90` inside the block to know which path a plan takes."""
    return forced_switches(SM90=sm90)


@contextlib.contextmanager
def forced_switches(**switches) -> Iterator[None]:
    """Sets this module's ``CONTEXT_`` + name switches (``SM90``, ``WARP_SPECIALIZED``, ``TMA``, ...) to the given
    values inside the block and restores them after, also when the block raises. An unknown name raises
    ``AttributeError`` before anything is set."""
    module = sys.modules[__name__]
    saved = {name: getattr(module, f"CONTEXT_{name}") for name in switches}
    try:
        for name, value in switches.items():
            setattr(module, f"CONTEXT_{name}", value)
        yield
    finally:
        for name, value in saved.items():
            setattr(module, f"CONTEXT_{name}", value)


def context_tile(rows: int) -> int:
    """The sm_90 kernel's tile (its launch config) for a plan of ``rows = T * G`` query rows per KV head."""
    return _context_block(CONTEXT_BLOCK_FEW_ROWS if rows <= ONE_WARPGROUP_ROWS else None)


def context_config(rows: int, fast_memory: bool = False, fp8: bool = False) -> int:
    """The sm_90 kernel's launch config for ``rows = T * G``: its tile width, with the warp-specialized flag where
    :data:`CONTEXT_WARP_SPECIALIZED` is on and the tile is 128 tokens, and then the TMA flag where
    :data:`CONTEXT_TMA` wants it (auto: rows > 128, or any rows when ``fast_memory``, see :func:`has_fast_memory`).
    ``fp8`` caches: never the TMA flag (the warp-specialized kernel's producer copies fp8 tiles by ``cp.async`` into a
    staging ring and widens them to fp16, docs/TREE_ATTENTION.md, "fp8 caches")."""
    tile = context_tile(rows)
    if not (CONTEXT_WARP_SPECIALIZED and tile == 128):
        return tile
    tma = (rows > CONTEXT_SM90_MAX_ROWS or fast_memory) if CONTEXT_TMA is None else CONTEXT_TMA
    return tile | WARP_SPECIALIZED_FLAG | (TMA_FLAG if tma and not fp8 else 0)


def context_rows_covered(rows: int) -> bool:
    """Whether the sm_90 kernels take ``rows = T * G`` query rows per KV head: up to two warpgroups' 128 in the
    lockstep kernels, any number in 128-row blocks in the warp-specialized one (caches of q's dtype or fp8 alike)."""
    return rows >= 1 and (rows <= CONTEXT_SM90_MAX_ROWS or CONTEXT_WARP_SPECIALIZED)


def _use_context_sm90(plan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    fp8 = k_cache.dtype in FP8_DTYPES
    bs = plan.block_size
    # The kernel addresses a row as token * stride_token (token = page * block_size + slot): pages of contiguous token
    # rows (power-of-two pages: context_kernel_takes); fp8 rows are copied 16 values at a time.
    pages_ok = (all(c.stride(0) == bs * c.stride(1) for c in (k_cache, v_cache))
                and k_cache.shape[0] * bs < 2**31)  # tokens are int32
    rows16 = not fp8 or all(c.stride(d) % 16 == 0 for c in (k_cache, v_cache) for d in (1, 2))
    return (pages_ok and rows16 and q.dtype in (torch.bfloat16, torch.float16)
            and context_kernel_takes(plan.num_tree, plan.group, plan.head_dim, bs, plan.split_len, q.device, fp8))


def takes_warp_specialized(rows: int, fp8: bool = False) -> bool:
    """Whether the sm_90 path's launch config for ``rows = T * G`` (caches of q's dtype or ``fp8``) is the
    warp-specialized kernel's (carries :data:`WARP_SPECIALIZED_FLAG`): the size-only part of
    :func:`runs_warp_specialized`, which the op's "auto" asks too."""
    return context_config(rows, fp8=fp8) & WARP_SPECIALIZED_FLAG != 0


def runs_warp_specialized(plan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the CUDA backend runs ``plan`` over these tensors on the warp-specialized sm_90 kernel (the sm_90 path
    takes them and :func:`takes_warp_specialized` their rows)."""
    return (_use_context_sm90(plan, q, k_cache, v_cache)
            and takes_warp_specialized(plan.num_tree * plan.group, fp8=k_cache.dtype in FP8_DTYPES))


def context_kernel_takes(num_tree: int, group: int, head_dim: int, block_size: int, split_len: int,
                         device: torch.device, fp8: bool = False) -> bool:
    """Whether the sm_90 context kernel runs a plan of these sizes over caches in contiguous pages, of q's dtype or
    ``fp8``: the part of the path rule that needs no tensor (the op's "auto" asks it too)."""
    rows = num_tree * group
    # auto: where it was measured faster (every T*G <= 128, one split or several).
    wanted = rows >= CONTEXT_SM90_MIN_ROWS if CONTEXT_SM90 is None else CONTEXT_SM90
    return (wanted and block_size & (block_size - 1) == 0 and head_dim == 128 and context_rows_covered(rows)
            and num_tree <= MAX_TREE_SM90 and split_len % context_tile(rows) == 0 and cuda_capability(device)[0] == 9)


def _aligned16(t: torch.Tensor, dims) -> bool:
    """True when every row the kernel copies with 16-byte cp.async starts 16-byte aligned."""
    return t.data_ptr() % 16 == 0 and all(t.stride(d) % 8 == 0 for d in dims)


def unsupported_reason(plan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> Optional[str]:
    """Why the CUDA kernels cannot run these inputs (None when they can); metadata only, no sync."""
    if q.device.type != "cuda":
        return f"the CUDA backend needs CUDA tensors, got {q.device}"
    if plan.head_dim not in HEAD_DIMS:
        return f"head_dim={plan.head_dim} is not one of {HEAD_DIMS}"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"q must be bfloat16 or float16, got {q.dtype}"
    if k_cache.dtype not in (q.dtype, *FP8_DTYPES) or v_cache.dtype != k_cache.dtype:
        return (f"k_cache and v_cache must both have q's dtype ({q.dtype}) or both one fp8 dtype, got {k_cache.dtype} "
                f"and {v_cache.dtype}")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.stride(-1) != 1 or not _aligned16(c, (0, 1, 2)):
            return (f"{name} rows must be 16-byte aligned (data_ptr % 16 == 0, strides of dims 0-2 multiples of 8, "
                    f"stride(-1) == 1); got data_ptr % 16 = {c.data_ptr() % 16}, strides {tuple(c.stride())}")
    return None


def run_cuda(plan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor, sm_scale: float,
             v_scale: float = 1.0) -> torch.Tensor:
    """Tree attention with the CUDA kernels; writes and returns ``out``.

    Args:
        plan: a :class:`~tlt_kernels.ops.tree_attention.TreeAttentionPlan` (its int32 tables, packed
            ``tree_mask [B, T, ceil(T/32)]`` and fp32 scratch ``partial_out [B, Hkv, S+1, T*G, D]`` /
            ``partial_lse [B, Hkv, S+1, T*G]`` are used as is).
        q: ``[B, T, Hq, D]`` bf16/fp16, ``stride(-1) == 1``.
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]``, q's dtype or both one fp8 dtype (``float8_e4m3fn``
            / ``float8_e5m2``, widened exactly to q's dtype in shared memory), rows 16-byte aligned.
        out: ``[B, T, Hq, D]`` q's dtype, ``stride(-1) == 1``; rows ``t >= num_nodes[b]`` become zeros.
        sm_scale: softmax scale (natural units), the K cache's dequantization scale folded in.
        v_scale: the V cache's dequantization scale (it holds ``V / v_scale``): each output row times it.
    """
    why = unsupported_reason(plan, q, k_cache, v_cache)
    if why is not None:
        raise ValueError(f"tree_attention (cuda backend): {why}")
    if not _aligned16(q, (0, 1, 2)):
        q = q.contiguous()  # q is small (T * Hq * D per request); the caches are never copied
    if out.stride(-1) != 1:
        raise ValueError(f"out must be contiguous along head_dim (stride(-1) == 1), got strides {tuple(out.stride())}")
    if out.data_ptr() % 4 or any(out.stride(d) % 2 for d in (0, 1, 2)):
        # The kernels store two elements (4 bytes) at a time; an odd view goes through a temporary.
        out.copy_(run_cuda(plan, q, k_cache, v_cache, torch.empty_like(out, memory_format=torch.contiguous_format),
                           sm_scale, v_scale))
        return out
    for name in ("partial_out", "partial_lse", "tree_mask", "block_table", "context_lens", "num_nodes"):
        t = getattr(plan, name)
        if not t.is_contiguous() or t.device != q.device:
            raise ValueError(f"plan.{name} must be contiguous on {q.device} (got strides {tuple(t.stride())} on {t.device})")
    B = plan.batch_size
    if B == 0:
        return out
    ext = extension()
    args = _launch_args(plan, q, k_cache, v_cache, out, sm_scale, v_scale)
    with torch.cuda.device(q.device):
        args["stream"] = stream_handle(q.device)
        if _use_context_sm90(plan, q, k_cache, v_cache):
            # config selects the tile width here (CONFIG_OVERRIDE stays the partial kernel's); 64 with T*G <= 64 rows
            # is the one-warpgroup kernel, 128 | WARP_SPECIALIZED_FLAG the warp-specialized one.
            rows = plan.num_tree * plan.group
            config = context_config(rows, fast_memory=has_fast_memory(q.device.index),
                                    fp8=k_cache.dtype in FP8_DTYPES)
            ext.tree_attention_sm90(**{**args, "config": config})
        else:
            ext.tree_attention_partial(**args)
        if plan.num_splits > 1:  # with one split every request is finished by step 1
            ext.tree_attention_merge(**args)
    return out


def _launch_args(plan, q, k_cache, v_cache, out, sm_scale, v_scale: float = 1.0) -> dict:
    """Keyword arguments of the ``_C`` tree-attention entry points (everything but the stream)."""
    return dict(
        q=ptr(q), k_cache=ptr(k_cache), v_cache=ptr(v_cache), block_table=ptr(plan.block_table),
        context_lens=ptr(plan.context_lens), num_nodes=ptr(plan.num_nodes), tree_mask=ptr(plan.tree_mask),
        partial_out=ptr(plan.partial_out), partial_lse=ptr(plan.partial_lse), out=ptr(out),
        q_strides=strides(q, (0, 1, 2)), k_strides=strides(k_cache, (0, 1, 2)),
        v_strides=strides(v_cache, (0, 1, 2)), out_strides=strides(out, (0, 1, 2)),
        bt_stride_b=int(plan.block_table.stride(0)), batch=plan.batch_size, num_tree=plan.num_tree,
        num_q_heads=plan.num_q_heads, num_kv_heads=plan.num_kv_heads, head_dim=plan.head_dim,
        block_size=plan.block_size, num_splits=plan.num_splits, split_len=plan.split_len,
        sm_scale=float(sm_scale), dtype=dtype_code(q.dtype), config=int(CONFIG_OVERRIDE),
        # Token rows the caches hold: the extent of the TMA build's tensor maps.
        cache_tokens=min(k_cache.shape[0], v_cache.shape[0]) * plan.block_size,
        kv_fp8=kv_fp8_code(k_cache.dtype), v_scale=float(v_scale),
    )
