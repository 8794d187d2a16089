"""Suite "tree-attention": draft-tree attention over a paged KV cache.

Cases ``(B, L, T)`` for Qwen2.5-7B (Hq=28, Hkv=4) and 32B (Hq=40, Hkv=8) geometry, D=128, page 16,
every request with context L and a random tree of T nodes. Impls:

* ``tlt-triton`` / ``tlt-cuda``: ``plan.run`` (the plan is built once per step, outside the timing);
* ``tlt-<backend> one-wave split`` / ``tlt-<backend> two-per-SM split``: the op with the most context splits whose
  programs fit one (two) per SM (``default_split_len(programs_per_sm=1 or 2)``), where that differs from the default
  split and from the rows before it;
* ``tlt-triton (split walk)`` / ``tlt-triton (merge kernel)`` / ``tlt-triton (merge in partial kernel)``: for a plan
  with several splits, the Triton op with its splits merged on the other side of its rule (from
  ``WIDE_MERGE_MIN_SPLITS`` splits the merge kernel reads them side by side, else in the partial kernel at <= 16 rows
  per program, else the merge kernel walks them);
* ``tlt-cuda+ctx-sm90`` / ``tlt-cuda (no ctx-sm90)`` (sm_90): the CUDA op on the
  other side of its context-path rule (``csrc/tree_attention/tree_attention_ctx_sm90.cu``, see ``tlt_kernels/_cuda/tree_attention.py``);
* ``torch-sdpa``: gather the request's K/V from the pages into contiguous tensors, then
  ``scaled_dot_product_attention`` with a boolean ``[B, 1, T, L+T]`` mask -- what a rollout engine
  without a tree kernel pays per layer;
* ``torch-sdpa (pre-gathered)``: the same SDPA on K/V already contiguous (gather excluded: a lower
  bound for any dense-mask approach, not an end-to-end option with a paged cache);
* ``flex-attention (pre-gathered)``: compiled ``flex_attention`` with a block mask built from the tree
  (block mask outside the timing), on contiguous K/V like the row above;
* ``flashinfer``: ``BatchPrefillWithPagedKVCacheWrapper`` with ``custom_mask`` over the same pages
  (``plan`` outside the timing), when FlashInfer imports;
* ``tlt-triton fp8`` / ``tlt-cuda fp8`` / ``flashinfer-xqa fp8`` (``--fp8``, on by default on the GPU): the same case
  over e4m3 K/V caches (scales 1; ``bytes_moved`` counts one byte per K/V element), ours checked against the Triton
  kernel over the caches' exact bf16 widening (the CUDA row: the sm_90 kernels where they take the plan, else the
  mma.sync one; ``tlt-cuda fp8 (mma.sync)``: that one, where the sm_90 path runs; ``tlt-cuda fp8 (lockstep)``: the
  two-warpgroup kernel where the warp-specialized one takes at most 128 rows), XQA's against ours;
  ``tlt-triton fp8 (keys widened)`` / ``(e4m3 key products)`` and ``(64-key tiles)`` / ``(128-key tiles)``: the Triton
  row on the other side of its key-product rule (``FP8_KEY_PRODUCT_TILES``) and of its key-tile rule
  (``FP8_WIDE_TILE_CONFIGS``). The fp8 rows run a plan built for e4m3 caches (``kv_dtype``); ``tlt-triton fp8
  (two-byte split)``: the Triton row with the bf16 rows' plan, where the two split differently;
* ``flashinfer-xqa``: FlashInfer's speculative-decode attention (``trtllm_batch_decode_with_kv_cache(backend="xqa",
  q_len_per_req=T, mask=...)``, 0.6 and later): the tree's nodes are the last ``T`` tokens of each sequence and its
  mask is bit-packed over them (:func:`xqa_tree_mask`); ``flashinfer decode (T=1)``: its decode wrapper for one
  token over the same context as the tlt rows' ``decode_ms`` (the "a tree costs little more than a token" yardstick).
  Every peer's output is checked against the tlt result before it is timed; a peer that fails is a note, not a row.

``bytes_moved`` = K and V of context + tree, plus q and out, each once (the HBM floor; block-table and
tree-mask reads are < 0.1% and left out). Extra columns: ``tflops`` (QK^T and PV of the valid
entries, ``4 * B * Hq * T * (L + T) * D``; the T=64, G=7 cases have 448 query rows per KV head and are
bounded by tensor-core throughput rather than HBM) and, on the tlt rows, ``decode_ms`` (the same kernel
with T=1 over the same context), ``tree_over_decode`` (time ratio) and ``ideal_ratio`` (bytes ratio:
what the tree would cost if both were at the HBM floor).

``copy (same bytes)``: a copy kernel moving the case's bytes, timed as the tlt rows are (graph-replayed, L2
flushed): at a few MB one launch's latency, not the bandwidth, bounds it, so it says how far below 100% of the HBM
floor a small case's ceiling lies (the long tail at B <= 2).

``pct_roofline``: percent of max(HBM floor, tensor-core floor), the floor FLOPs taken at the dense
matmul peak measured in the same run -- the honest target for the compute-bound T=64 rows.

Timing (``timing`` column): every row replayed from a CUDA graph (``--graphs``, the default on CUDA), as a captured
rollout step runs it: GPU time, without Python dispatch or launch costs, which are most of a small case's eager time;
a row whose capture fails is timed eagerly and says so. The tlt rows add ``eager_ms`` (a plain call, dispatch
included).

``--sweep`` adds tuning rows for the Triton kernel (see docs/TREE_ATTENTION.md); ``--cases 7b:64x4096x16,...``
restricts the cases and ``--no-peers`` skips the non-tlt rows (both for tuning runs on a time budget).
"""
from __future__ import annotations

import argparse
from unittest import mock

import torch
import torch.nn.functional as F

from ..flags import Flag, values

SUITE = "tree-attention"

MODELS = {"qwen2.5-7b": (28, 4), "qwen2.5-32b": (40, 8)}
CASES = [(64, 4096, 16), (64, 16384, 16), (256, 2048, 8), (32, 8192, 64), (1, 32768, 64), (8, 32768, 32)]
SMALL_GPU_CASES = [(8, 2048, 16), (2, 4096, 64)]
CPU_CASES = [(2, 100, 4)]
# Where a rollout's tail spends its time: a handful of requests, short trees, long contexts (--long-tail; 7B).
LONG_TAIL_CASES = [(B, L, T) for B in (1, 2, 4, 8, 16) for T in (1, 4, 8) for L in (4096, 16384, 65536)]
HEAD_DIM = 128
PAGE = 16


def _random_parents(B: int, T: int, gen: torch.Generator) -> torch.Tensor:
    p = torch.stack([torch.randint(0, max(i, 1), (B,), generator=gen) for i in range(T)], dim=1).to(torch.int32)
    p[:, 0] = -1
    return p


def _make_inputs(B, L, T, Hq, Hkv, D, dtype, device, seed=0):
    """A case's inputs, the same for the same ``seed``: shuffled pages, random q/K/V (drawn on ``device``)."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.Generator(device=device).manual_seed(seed)  # on the device: gigabytes of caches at long contexts
    pages_per_req = -(-(L + T) // PAGE)
    num_blocks = B * pages_per_req
    table = torch.randperm(num_blocks, generator=gen).to(torch.int32).view(B, pages_per_req)
    k = torch.randn(num_blocks, PAGE, Hkv, D, dtype=dtype, device=device, generator=values)
    v = torch.randn(num_blocks, PAGE, Hkv, D, dtype=dtype, device=device, generator=values)
    q = torch.randn(B, T, Hq, D, dtype=dtype, device=device, generator=values)
    ctx = torch.full((B,), L, dtype=torch.int32)
    return dict(q=q, k_cache=k, v_cache=v, block_table=table.to(device), context_lens=ctx.to(device),
                parents=_random_parents(B, T, gen).to(device))


def case_inputs(model, B, L, T, device="cuda", kv_dtype=None, seed=0):
    """The suite's inputs of case ``(model, B, L, T)`` (bf16 rows; ``kv_dtype`` ``torch.float8_e4m3fn``: the same
    cache values stored as e4m3, scales 1) and their planner (``_planner``; ``plan_for()`` plans them as the library
    does). For the tools that time tree attention outside the suite."""
    Hq, Hkv = MODELS[model]
    inp = _make_inputs(B, L, T, Hq, Hkv, HEAD_DIM, torch.bfloat16, device, seed)
    if kv_dtype is not None:
        inp["k_cache"], inp["v_cache"] = inp["k_cache"].to(kv_dtype), inp["v_cache"].to(kv_dtype)
    return inp, _planner(inp, L, kv_dtype)


def _planner(inp, L, kv_dtype=None):
    """``plan_for(split_len=None, parents=None, kv_dtype=kv_dtype)``: a plan of ``inp``'s requests as the library
    builds it (``parents`` None: ``inp``'s tree; another tree, e.g. its first node for the decode rows, or another
    cache dtype, for the suite's other rows; ``split_len`` None: the library's split). Head counts and size from
    ``inp``'s q ``[B, T, Hq, D]`` and K cache ``[pages, PAGE, Hkv, D]``."""
    from tlt_kernels.ops.tree_attention import plan_tree_attention

    Hq, D, Hkv = inp["q"].shape[2], inp["q"].shape[3], inp["k_cache"].shape[2]
    default_kv_dtype = kv_dtype

    def plan_for(split_len=None, parents=None, kv_dtype=default_kv_dtype):
        return plan_tree_attention(inp["parents"] if parents is None else parents, inp["context_lens"],
                                   inp["block_table"], num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D,
                                   block_size=PAGE, max_context_len=L, split_len=split_len, kv_dtype=kv_dtype)

    return plan_for


def _dense_mask(parents: torch.Tensor, L: int) -> torch.Tensor:
    """``bool [B, T, L + T]``: every context token, then the ancestor mask."""
    from tlt_kernels.tree import tree_ancestor_mask

    anc = tree_ancestor_mask(parents)
    B, T = parents.shape
    return torch.cat([torch.ones(B, T, L, dtype=torch.bool, device=parents.device), anc], dim=2)


def _gather_dense(k_cache, v_cache, block_table, n_tokens):
    """K, V of slots ``0 .. n_tokens-1`` of every request as ``[B, Hkv, n_tokens, D]`` (contiguous)."""
    Hkv, D = k_cache.shape[2], k_cache.shape[3]
    slots = torch.arange(n_tokens, device=k_cache.device)
    flat = block_table.long()[:, slots // PAGE] * PAGE + slots % PAGE  # [B, n]
    k = k_cache.view(-1, Hkv, D)[flat].transpose(1, 2).contiguous()
    v = v_cache.view(-1, Hkv, D)[flat].transpose(1, 2).contiguous()
    return k, v


def _sdpa(q, k, v, mask):
    """q ``[B, T, Hq, D]``, k/v ``[B, Hkv, N, D]``, mask ``[B, T, N]`` -> ``[B, T, Hq, D]``."""
    return F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask[:, None], enable_gqa=True).transpose(1, 2)


def _check(name, got, want, ctx):
    err = (got.float() - want.float()).abs().max().item()
    if not err < 3e-2:
        raise AssertionError(f"{name}: max |diff| {err:.3g} vs the tlt result on case {ctx}")


class _CaseCost:
    """A case's HBM bytes and tensor-core FLOPs, and the roofline columns of a row timed at ``ms``."""

    def __init__(self, ctx, B, L, T, Hq, Hkv, D, element_size):
        self.B, self.L, self.T, self.Hq, self.Hkv, self.D, self.element_size = B, L, T, Hq, Hkv, D, element_size
        self.flops = 4 * B * Hq * T * (L + T) * D
        self.peak = _matmul_peak_flops(ctx)
        self.bw = ctx.copy_bandwidth

    def nbytes(self, t_nodes: int) -> int:
        """K and V of the context and ``t_nodes`` tree nodes, plus q and out, each read or written once."""
        elt = self.element_size
        return self.B * (self.L + t_nodes) * self.Hkv * self.D * 2 * elt + 2 * self.B * t_nodes * self.Hq * self.D * elt

    def extra(self, ms: float) -> dict:
        """The ``tflops`` column and, on the GPU, ``pct_roofline``."""
        row = {"tflops": self.flops / (ms * 1e-3) / 1e12}
        if self.peak and self.bw:
            # The roofline floor: the larger of the HBM floor and the tensor-core floor (T=64, G=7 rows
            # have ~2.4x more MMA time than HBM time, so 80% of the byte floor is out of reach there).
            row["pct_roofline"] = 100.0 * max(self.nbytes(self.T) / self.bw, self.flops / self.peak) / (ms * 1e-3)
        return row


def _bench_case(ctx, model, B, L, T, flex=True):
    Hq, Hkv = MODELS[model]
    D, dtype, dev = HEAD_DIM, ctx.dtype, ctx.device
    inp = _make_inputs(B, L, T, Hq, Hkv, D, dtype, dev)
    q, k_cache, v_cache, parents = inp["q"], inp["k_cache"], inp["v_cache"], inp["parents"]
    case = {"model": model, "B": B, "L": L, "T": T}
    cost = _CaseCost(ctx, B, L, T, Hq, Hkv, D, q.element_size())
    plan_for = _planner(inp, L)
    plan = plan_for()
    p = values(ctx, FLAGS)
    if p.fp8_only:  # the rows over e4m3 caches alone (CUDA: the interpreter is too slow for these sizes)
        if dev.type == "cuda":
            _bench_fp8(ctx, case, plan, plan_for, inp, cost, p.peers, p.sweep and p.sweep_caches != "bf16")
        return
    decode_plan = plan_for(parents=parents[:, :1].contiguous())
    out = torch.empty_like(q)
    reference = _bench_tlt(ctx, case, plan, decode_plan, q, k_cache, v_cache, out, cost)
    _bench_copy_floor(ctx, case, cost.nbytes(T))
    if reference is not None and dev.type == "cuda":
        _bench_context_kernels(ctx, case, plan, q, k_cache, v_cache, out, reference, cost.nbytes(T), cost.extra)
        _bench_even_splits(ctx, case, plan, plan_for, q, k_cache, v_cache, out, reference, cost)
        _bench_merge_placement(ctx, case, plan, q, k_cache, v_cache, out, reference, cost)
    if reference is not None and p.sweep and p.sweep_caches != "fp8" and dev.type == "cuda":
        _sweep(ctx, case, _sweep_plans(plan_for), q, k_cache, v_cache, out, reference, cost.nbytes(T),
               cost.extra)
    if p.fp8 and reference is not None and dev.type == "cuda":
        _bench_fp8(ctx, case, plan, plan_for, inp, cost, p.peers, p.sweep and p.sweep_caches != "bf16")
    if p.peers:
        decode_reference = None
        if reference is not None:  # the tlt decode kernel's output: what the T=1 peer is checked against
            decode_reference = decode_plan.run(q[:, :1].contiguous(), k_cache, v_cache)
        _bench_peers(ctx, case, inp, reference, decode_reference, cost, flex)


def _bench_tlt(ctx, case, plan, decode_plan, q, k_cache, v_cache, out, cost):
    """The ``tlt-<backend>`` rows; returns the first one's output (the reference for the other rows) or None."""
    from tlt_kernels._backend import backend_unavailable_reason

    T = q.shape[1]
    nbytes = cost.nbytes(T)
    q1 = q[:, :1].contiguous()
    out1 = torch.empty_like(q1)
    reference = None
    for backend in ("triton", "cuda"):
        if backend_unavailable_reason(backend, ctx.device) is not None:
            continue
        plan.run(q, k_cache, v_cache, out=out, backend=backend)
        if reference is None:
            reference = out.clone()
        else:
            _check(f"tlt-{backend}", out, reference, case)
        call = lambda: plan.run(q, k_cache, v_cache, out=out, backend=backend)  # noqa: E731
        ms, timing = _timed(ctx, call)
        ms1, _ = _timed(ctx, lambda: decode_plan.run(q1, k_cache, v_cache, out=out1, backend=backend))
        # eager_ms: what a caller without graphs pays per call, the op's Python dispatch and launches included.
        eager_ms = ctx.time_ms(call) if timing == "graph" else ms
        row = cost.extra(ms)
        ctx.add(case, f"tlt-{backend}", ms, bytes_moved=nbytes, num_splits=plan.num_splits, split_len=plan.split_len,
                decode_ms=ms1, tree_over_decode=ms / ms1, ideal_ratio=nbytes / cost.nbytes(1), timing=timing,
                eager_ms=eager_ms, **row)
        if ctx.copy_bandwidth:
            print(f"{case} tlt-{backend}: {ms:.4f} ms, {100 * nbytes / ctx.copy_bandwidth / (ms * 1e-3):.1f}% of the HBM "
                  f"floor, {row.get('pct_roofline', 0):.1f}% of the roofline, S={plan.num_splits}", flush=True)
    return reference


COPY_FLOOR_ROW = "copy (same bytes)"


def _bench_copy_floor(ctx, case, nbytes: int) -> None:
    """The ``copy (same bytes)`` row: a copy kernel moving the case's ``nbytes`` (half read, half written, as int32
    words), timed as the tlt rows are. The HBM floor's bandwidth is a large copy's, which no kernel reaches on a few
    MB: this row is what one launch moving these bytes takes, the floor a small case can be held to. A kernel, not
    ``copy_``: a graph-replayed cudaMemcpy ran at 63-64% of the copy bandwidth on two of three 0.5-1 GB cases (H200)."""
    from .copy import triton_copy

    src = torch.zeros(nbytes // 8, dtype=torch.int32, device=ctx.device)
    dst = torch.empty_like(src)
    ms, timing = _timed(ctx, lambda: triton_copy(src, dst))
    ctx.add(case, COPY_FLOOR_ROW, ms, bytes_moved=8 * src.numel(), timing=timing)


# The split rules timed beside the default: programs per SM -> row name.
EVEN_SPLIT_ROWS = {1: "one-wave split", 2: "two-per-SM split"}


def _bench_even_splits(ctx, case, plan, plan_for, q, k_cache, v_cache, out, reference, cost):
    """``tlt-<backend> one-wave split`` / ``two-per-SM split``: the same op with
    ``default_split_len(programs_per_sm=k)`` (the most splits whose programs fit k per SM; the default's count can
    overshoot a wave by a few programs, which then share an SM), where that differs from the default split and from
    the rows before; checked against the first tlt row."""
    from tlt_kernels._backend import backend_unavailable_reason
    from tlt_kernels.ops.tree_attention import _sm_count_of, default_split_len

    B, T, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    timed = {plan.split_len}
    for per_sm, label in EVEN_SPLIT_ROWS.items():
        split_len = default_split_len(B, Hkv, case["L"], _sm_count_of(q.device), T * (Hq // Hkv), D,
                                      programs_per_sm=per_sm)
        if split_len in timed:
            continue
        timed.add(split_len)
        even_plan = plan_for(split_len)
        for backend in ("triton", "cuda"):
            if backend_unavailable_reason(backend, q.device) is None:  # the data's device runs the rows
                _time_split_row(ctx, case, f"tlt-{backend} {label}", backend, even_plan, q, k_cache, v_cache, out,
                                reference, cost)


def _bench_merge_placement(ctx, case, plan, q, k_cache, v_cache, out, reference, cost):
    """The Triton merge on the other side of its rule (``WIDE_MERGE_MIN_SPLITS``, ``FUSED_MERGE_MAX_ROWS`` in
    _triton/tree_attention.py), for a plan with several splits: ``tlt-triton (split walk)`` where the default reads the
    splits side by side, ``tlt-triton (merge kernel)`` where it merges in the partial kernel, ``tlt-triton (merge in
    partial kernel)`` where it launches the merge kernel's walk; checked against the first tlt row."""
    import tlt_kernels._triton.tree_attention as tk
    from tlt_kernels._backend import backend_unavailable_reason

    if plan.num_splits == 1 or backend_unavailable_reason("triton", q.device) is not None:
        return
    block_m, chunks = tk.kernel_config(plan.head_dim, plan.num_tree * plan.group, q.dtype == torch.float32)[:2]
    if tk.merges_splits_side_by_side(plan):
        name, flags = "tlt-triton (split walk)", dict(WIDE_MERGE_MIN_SPLITS=plan.num_splits + 1)
    elif tk.merges_in_partial_kernel(plan, block_m, chunks):
        name, flags = "tlt-triton (merge kernel)", dict(FUSED_MERGE=0)
    else:
        name, flags = "tlt-triton (merge in partial kernel)", dict(FUSED_MERGE_MAX_ROWS=block_m)
    with mock.patch.multiple(tk, **flags):  # the module flags for this row only
        _time_split_row(ctx, case, name, "triton", plan, q, k_cache, v_cache, out, reference, cost)


def _time_split_row(ctx, case, name, backend, plan, q, k_cache, v_cache, out, reference, cost):
    try:
        plan.run(q, k_cache, v_cache, out=out, backend=backend)
        _check(name, out, reference, case)
        ms, timing = _timed(ctx, lambda: plan.run(q, k_cache, v_cache, out=out, backend=backend))
    except Exception as exc:  # noqa: BLE001 - an experiment: report and go on
        ctx.note(f"{name} failed on {case}: {type(exc).__name__}: {str(exc)[:300]}")
        return
    ctx.add(case, name, ms, bytes_moved=cost.nbytes(q.shape[1]), num_splits=plan.num_splits, split_len=plan.split_len,
            timing=timing, **cost.extra(ms))


def _bench_peers(ctx, case, inp, reference, decode_reference, cost, flex=True):
    """The non-tlt rows: torch SDPA with and without the gather, flex-attention and FlashInfer (CUDA): its custom-mask
    prefill, and from 0.6 on its XQA speculative-decode attention and its decode kernel (T=1)."""
    L, T = case["L"], case["T"]
    Hq, Hkv = MODELS[case["model"]]
    mask = _dense_mask(inp["parents"], L)
    _bench_sdpa(ctx, case, inp, mask, reference, cost, flex)  # its gathered K/V are freed before FlashInfer's workspace
    fi = ctx.try_import("flashinfer")
    if fi is None or ctx.device.type != "cuda":
        return
    _bench_flashinfer(ctx, fi, case, inp, mask, Hq, Hkv, HEAD_DIM, L, T, reference, cost.nbytes(T), cost.extra)
    if hasattr(getattr(fi, "decode", None), "trtllm_batch_decode_with_kv_cache"):  # 0.6 and later
        _bench_flashinfer_xqa(ctx, fi, case, inp, reference, cost.nbytes(T), cost.extra)
        _bench_flashinfer_decode(ctx, fi, case, inp, decode_reference, cost.nbytes(1), cost.extra)


def _bench_sdpa(ctx, case, inp, mask, reference, cost, flex=True):
    """The ``torch-sdpa`` rows (gather included, then pre-gathered) and, on CUDA with ``flex``, flex-attention on the
    same K/V."""
    q, table = inp["q"], inp["block_table"]
    L, T = case["L"], case["T"]
    nbytes = cost.nbytes(T)
    ms, timing = _timed(ctx, lambda: _sdpa(q, *_gather_dense(inp["k_cache"], inp["v_cache"], table, L + T), mask))
    ctx.add(case, "torch-sdpa", ms, bytes_moved=nbytes, timing=timing, **cost.extra(ms))
    k, v = _gather_dense(inp["k_cache"], inp["v_cache"], table, L + T)
    got = _sdpa(q, k, v, mask)
    if reference is not None:
        _check("torch-sdpa", got, reference, case)
    ms, timing = _timed(ctx, lambda: _sdpa(q, k, v, mask))
    ctx.add(case, "torch-sdpa (pre-gathered)", ms, bytes_moved=nbytes, timing=timing, **cost.extra(ms))
    if flex and ctx.device.type == "cuda":
        _bench_flex(ctx, case, q, k, v, mask, reference, nbytes, cost.extra)


def _bench_context_kernels(ctx, case, plan, q, k_cache, v_cache, out, reference, nbytes, extra):
    """Rows of the CUDA op on the other side of its context-path rule: ``tlt-cuda+ctx-sm90`` where the default does
    not take the sm_90 context kernel, ``tlt-cuda (no ctx-sm90)`` where it does (sm_90, bf16/fp16, T * G <= 128), and
    ``tlt-cuda ctx-sm90 64-row chunks`` where the default is its two-warpgroup build (T * G > 64: the one-warpgroup
    build, one CTA per 64 rows), with ``tlt-cuda ctx-sm90 warp-specialized`` (or ``lockstep``) the other build of the
    128-token kernel (csrc/tree_attention/tree_attention_ctx_sm90.cu, csrc/tree_attention/tree_attention_ctx_sm90_ws.cu),
    each checked against the first tlt row. A failure is noted, not fatal."""
    import tlt_kernels._cuda.tree_attention as ct
    from tlt_kernels._backend import backend_unavailable_reason

    if torch.cuda.get_device_capability(q.device)[0] != 9:
        return
    variants = []  # (row, the CONTEXT_ switch it sets, its value)
    if backend_unavailable_reason("cuda", q.device) is None:
        # The tlt-cuda row is the default rule (the context path where T*G <= 128); these rows force each side of it.
        if ct._use_context_sm90(plan, q, k_cache, v_cache):
            variants.append(("tlt-cuda (no ctx-sm90)", "SM90", False))
            rows = plan.num_tree * plan.group
            if ct.context_tile(rows) != 64 and rows <= 128:  # the 64-row build takes at most two CTAs' rows
                variants.append(("tlt-cuda ctx-sm90 64-row chunks", "BLOCK", 64))
                # The 128-token kernel's other build: warp-specialized (producer + ping-pong) or lockstep.
                ws = not ct.CONTEXT_WARP_SPECIALIZED
                variants.append((f"tlt-cuda ctx-sm90 {'warp-specialized' if ws else 'lockstep'}", "WARP_SPECIALIZED",
                                 ws))
        else:
            variants.append(("tlt-cuda+ctx-sm90", "SM90", True))
    for name, switch, value in variants:
        try:
            with ct.forced_switches(**{switch: value}):  # this row's path only
                if switch == "SM90" and ct._use_context_sm90(plan, q, k_cache, v_cache) != value:
                    continue
                plan.run(q, k_cache, v_cache, out=out, backend="cuda")
                _check(name, out, reference, case)
                ms, timing = _timed(ctx, lambda: plan.run(q, k_cache, v_cache, out=out, backend="cuda"))
        except Exception as exc:  # noqa: BLE001 - an experiment: report and go on with the peers
            ctx.note(f"{name} failed on {case}: {type(exc).__name__}: {str(exc)[:300]}")
            continue
        ctx.add(case, name, ms, bytes_moved=nbytes, num_splits=plan.num_splits, split_len=plan.split_len, timing=timing,
                **extra(ms))
        if ctx.copy_bandwidth:
            print(f"{case} {name}: {ms:.4f} ms, {100 * nbytes / ctx.copy_bandwidth / (ms * 1e-3):.1f}% of the HBM floor",
                  flush=True)


_PEAK = {}


def _matmul_peak_flops(ctx):
    """Dense tensor-core FLOP/s of this GPU in ``ctx.dtype``, measured in this run (None on CPU)."""
    if ctx.device.type != "cuda":
        return None
    key = (str(ctx.device), ctx.dtype)
    if key not in _PEAK:
        n = 8192
        a = torch.randn(n, n, dtype=ctx.dtype, device=ctx.device)
        b = torch.randn(n, n, dtype=ctx.dtype, device=ctx.device)
        ms = ctx.time_ms(lambda: a @ b)
        _PEAK[key] = 2 * n**3 / (ms * 1e-3)
        ctx.note(f"dense {ctx.dtype} matmul peak measured for pct_roofline: {_PEAK[key] / 1e12:.0f} TFLOP/s")
        del a, b
    return _PEAK[key]


def _selected_cases(models, cases, selected=()):
    """``(model, B, L, T, flex)`` per case: ``selected`` (``--cases``, parsed) restricts the run (tuning on a budget, a
    run of record in parts), else the size's cases, with flex-attention rows."""
    return list(selected) if selected else [(m, *c, True) for m in models for c in cases]


def _long_tail_cases(item: str):
    """``long-tail`` -> the long-tail cases (no flex-attention rows); ``long-tail@16384`` -> those at that L."""
    lengths = {L for _, L, _ in LONG_TAIL_CASES}
    if item == "long-tail":
        keep = lengths
    else:
        keep = {int(item.split("@", 1)[1])}
        if not keep <= lengths:
            raise ValueError(item)
    return [("qwen2.5-7b", B, L, T, False) for B, L, T in LONG_TAIL_CASES if L in keep]


def parse_cases(spec: str):
    """``"7b:64x4096x16,32b:256x2048x8,long-tail@4096"`` -> ``[(model, B, L, T, flex), ...]`` (flex-attention rows on
    the named cases, not on the long-tail ones)."""
    out = []
    for item in (i.strip().lower() for i in spec.split(",")):
        if not item:
            continue
        try:
            if item.startswith("long-tail"):
                out += _long_tail_cases(item)
                continue
            tag, shape = item.split(":")
            model = next(m for m in MODELS if m.endswith("-" + tag))
            B, L, T = (int(x) for x in shape.split("x"))
        except (ValueError, StopIteration):
            lengths = ", ".join(str(L) for L in sorted({L for _, L, _ in LONG_TAIL_CASES}))
            raise argparse.ArgumentTypeError(
                f"cases must look like 7b:64x4096x16 (model tag of {', '.join(MODELS)}: BxLxT), long-tail or "
                f"long-tail@L (L one of {lengths}); got {item!r}") from None
        out.append((model, B, L, T, True))
    return out


FLAGS = (
    Flag("--sweep", False, "add tuning rows for the Triton kernel (CUDA)", bool, replaces="TLT_TREE_ATTENTION_SWEEP"),
    Flag("--sweep-caches", "both", "with --sweep: the caches whose config grid is swept (fp8 needs --fp8)",
         choices=("bf16", "fp8", "both")),
    Flag("--cases", (), "comma-separated cases MODEL:BxLxT, e.g. 7b:64x4096x16, and long-tail or long-tail@L (the "
         "long-tail cases, or those at context L) (default: the size's)", parse_cases,
         replaces="TLT_TREE_ATTENTION_CASES", metavar="LIST"),
    Flag("--fp8", True, "also time the Triton kernel (and FlashInfer's XQA with the peers) over e4m3 caches (CUDA)",
         bool),
    Flag("--fp8-only", False, "only the rows over e4m3 caches (tlt fp8, each Triton rule's other side, XQA fp8 with "
         "the peers): a quick A/B of the fp8 paths, not a run of record (CUDA)", bool),
    Flag("--long-tail", False, "add the long-tail cases (7B; B 1-16, T 1/4/8, L 4k-64k) after the others (CUDA)",
         bool),
    Flag("--peers", True, "also time the non-tlt rows (torch SDPA, flex-attention, FlashInfer)", bool,
         replaces="TLT_TREE_ATTENTION_PEERS"),
    Flag("--graphs", True, "time every row replayed from a CUDA graph, as a captured step runs it (CUDA; eager where "
         "capture fails); the tlt rows also report eager_ms (--no-graphs: eager timing only)", bool),
)


def _timed(ctx, fn):
    """``(ms, timing)``: ``fn``'s median GPU time replayed from a CUDA graph (rollout engines capture their steps, so
    this is the time a step pays, without Python dispatch or launch costs), else its eager time (``"eager"``: off,
    not on CUDA, or a capture that failed, noted)."""
    if values(ctx, FLAGS).graphs and ctx.device.type == "cuda":
        try:
            return ctx.time_graph_ms(fn), "graph"
        except Exception as exc:  # noqa: BLE001 - a peer that cannot be captured is timed eagerly
            torch.cuda.synchronize()
            ctx.note(f"capture failed, timed eagerly: {type(exc).__name__}: {str(exc)[:120]}")
    return ctx.time_ms(fn), "eager"


def _sweep_plans(plan_for):
    """The default plan and half / double / a quarter of its split length (double only when it splits), by label."""
    from tlt_kernels.ops.tree_attention import SPLIT_ALIGN

    base = plan_for()
    plans = {"split=default": base}
    for factor, label in ((0.5, "split/2"), (2.0, "split*2")):
        split_len = max(SPLIT_ALIGN, int(base.split_len * factor) // SPLIT_ALIGN * SPLIT_ALIGN)
        if split_len != base.split_len and (factor < 1 or base.num_splits > 1):
            plans[label] = plan_for(split_len)
    quarter = max(SPLIT_ALIGN, base.split_len // 4 // SPLIT_ALIGN * SPLIT_ALIGN)
    if quarter >= 256 and quarter not in {p.split_len for p in plans.values()}:
        plans["split/4"] = plan_for(quarter)
    return plans


def _sweep(ctx, case, plans, q, k_cache, v_cache, out, reference, nbytes, extra, name="sweep", stages=(2, 3, 4)):
    """Tuning rows ``<name> bn=.. w=.. s=.. bm=.. <plan label>`` for the Triton kernel: every (BLOCK_N, num_warps,
    num_stages) of a small grid on each of ``plans`` (label -> plan), each checked against ``reference`` and timed as
    the tlt rows are. Copy the winners into PARTIAL_CONFIGS / SPLIT_WAVES."""
    import itertools

    from tlt_kernels._triton import tree_attention as tk

    M = q.shape[1] * (q.shape[2] // k_cache.shape[2])
    grid = [(bn, w, s, 128) for bn in (64, 128) for w in (4, 8) for s in stages]
    if M > 64:  # row chunks of 64: half the registers per program, the chunks share K/V through L2
        grid += [(bn, 4, s, 64) for bn in (64, 128) for s in stages]
    for (label, plan), cfg in itertools.product(plans.items(), grid):
        call = lambda p=plan: p.run(q, k_cache, v_cache, out=out, backend="triton")  # noqa: E731
        with mock.patch.object(tk, "CONFIG_OVERRIDE", cfg):  # this config for this row's compile and capture
            try:
                call()
            except Exception as exc:  # e.g. out of shared memory for this config
                ctx.note(f"{name} {case} {label} {cfg}: {type(exc).__name__}: {str(exc)[:120]}")
                continue
            _check(f"{name} {cfg}", out, reference, case)
            ms, timing = _timed(ctx, call)
        ctx.add(case, f"{name} bn={cfg[0]} w={cfg[1]} s={cfg[2]} bm={cfg[3]} {label}", ms, bytes_moved=nbytes,
                num_splits=plan.num_splits, split_len=plan.split_len, timing=timing, **extra(ms))
        # Also printed as it goes, so a sweep cut short by a time limit still leaves its rows.
        pct = f"{100 * nbytes / ctx.copy_bandwidth / (ms * 1e-3):.1f}%" if ctx.copy_bandwidth else "-"
        print(f"{name} {case} {cfg} {label} S={plan.num_splits}: {ms:.4f} ms {pct} floor", flush=True)


_FLEX = None


def _bench_flex(ctx, case, q, k, v, mask, reference, nbytes, extra):
    global _FLEX
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        if _FLEX is None:
            # One compiled graph per case shape: lift dynamo's recompile cap above the case count.
            for knob in ("recompile_limit", "cache_size_limit"):
                if hasattr(torch._dynamo.config, knob):
                    setattr(torch._dynamo.config, knob, max(64, getattr(torch._dynamo.config, knob)))
            _FLEX = torch.compile(flex_attention, dynamic=False)
        B, T, _, _ = q.shape
        N = k.shape[2]
        L = N - T
        tree = mask[:, :, L:].contiguous()

        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx < L) | tree[b, q_idx, (kv_idx - L).clamp(min=0)]

        block_mask = create_block_mask(mask_mod, B, None, T, N, device=q.device)
        qt = q.transpose(1, 2)
        fn = lambda: _FLEX(qt, k, v, block_mask=block_mask, enable_gqa=True)  # noqa: E731
        got = fn().transpose(1, 2)
        if reference is not None:
            _check("flex-attention", got, reference, case)
        ms, timing = _timed(ctx, fn)
        ctx.add(case, "flex-attention (pre-gathered)", ms, bytes_moved=nbytes, timing=timing, **extra(ms))
    except Exception as exc:  # optional peer: report, do not fail the suite
        ctx.note(f"flex-attention skipped for {case}: {type(exc).__name__}: {str(exc)[:200]}")


def xqa_tree_mask(parents: torch.Tensor) -> torch.Tensor:
    """``uint16 [B, T, 2 * ceil(T / 32)]``: XQA's draft-block mask (bit ``j % 16`` of half-word ``j // 16`` of row
    ``i``: node ``i`` sees node ``j``; rows aligned to 32 bits), the bit-packed ancestor mask's int32 words read as
    little-endian half-words."""
    from tlt_kernels.tree import tree_ancestor_mask_packed

    return tree_ancestor_mask_packed(parents).view(torch.uint16)


def _bench_fp8(ctx, case, two_byte_plan, plan_for, inp, cost, peers, sweep=False):
    """``tlt-triton fp8``, ``tlt-cuda fp8`` (where the extension runs) and ``flashinfer-xqa fp8`` (with the peers): the
    same case over e4m3 caches (scales 1) with a plan built for them (``plan_for(kv_dtype=...)``), ours
    checked against the Triton kernel over the caches' exact bf16 widening; the Triton row with ``two_byte_plan`` (the
    bf16 rows') where it splits otherwise. Bytes: K/V at one byte per element. ``sweep``: also the Triton kernel's
    config grid over these caches (``sweep fp8`` rows, the default split; half the bytes per tile leave room for a
    fifth stage)."""
    from tlt_kernels._backend import backend_unavailable_reason

    q = inp["q"]
    k8, v8 = inp["k_cache"].to(torch.float8_e4m3fn), inp["v_cache"].to(torch.float8_e4m3fn)
    plan = plan_for(kv_dtype=k8.dtype)
    T = case["T"]
    nbytes = cost.B * (cost.L + T) * cost.Hkv * cost.D * 2 + 2 * cost.B * T * cost.Hq * cost.D * q.element_size()
    try:
        widened = plan.run(q, k8.to(q.dtype), v8.to(q.dtype), backend="triton")
    except Exception as exc:  # noqa: BLE001 - report, go on with the other rows
        ctx.note(f"tlt-triton fp8 failed on {case}: {type(exc).__name__}: {str(exc)[:300]}")
        return
    out = _fp8_row(ctx, "triton", case, plan, q, k8, v8, widened, nbytes, cost)
    if out is None:
        return
    if two_byte_plan.split_len != plan.split_len:  # the split rule's other side
        _fp8_row(ctx, "triton", case, two_byte_plan, q, k8, v8, widened, nbytes, cost,
                 impl="tlt-triton fp8 (two-byte split)")
    _bench_fp8_key_product_rule(ctx, case, plan, q, k8, v8, widened, nbytes, cost)
    _bench_fp8_wide_tile_rule(ctx, case, plan, q, k8, v8, widened, nbytes, cost)
    if sweep:
        _sweep(ctx, case, {"split=default": plan}, q, k8, v8, torch.empty_like(out), out, nbytes, cost.extra,
               name="sweep fp8", stages=(2, 3, 4, 5))
    why = backend_unavailable_reason("cuda", q.device)
    if why is None:
        _bench_cuda_fp8(ctx, case, plan, q, k8, v8, widened, nbytes, cost)
    else:
        ctx.note(f"tlt-cuda fp8 not run: {why}")
    fi = ctx.try_import("flashinfer") if peers else None
    if fi is not None and hasattr(getattr(fi, "decode", None), "trtllm_batch_decode_with_kv_cache"):
        _bench_flashinfer_xqa(ctx, fi, case, {**inp, "k_cache": k8, "v_cache": v8}, out, nbytes, cost.extra,
                              impl="flashinfer-xqa fp8")


def _bench_cuda_fp8(ctx, case, plan, q, k8, v8, reference, nbytes, cost):
    """``tlt-cuda fp8``: the CUDA backend over the e4m3 caches (its sm_90 kernels where they take the plan, else the
    mma.sync one); where the sm_90 path runs, ``tlt-cuda fp8 (mma.sync)`` too, and where that path is the
    warp-specialized kernel over at most 128 rows, ``tlt-cuda fp8 (lockstep)`` (the two-warpgroup kernel, which took
    those rows before), each checked against ``reference``."""
    import tlt_kernels._cuda.tree_attention as ct

    _fp8_row(ctx, "cuda", case, plan, q, k8, v8, reference, nbytes, cost)
    if ct._use_context_sm90(plan, q, k8, v8):
        with ct.forced_context_path(False):
            _fp8_row(ctx, "cuda", case, plan, q, k8, v8, reference, nbytes, cost, impl="tlt-cuda fp8 (mma.sync)")
        if ct.runs_warp_specialized(plan, q, k8, v8) and plan.num_tree * plan.group <= ct.CONTEXT_SM90_MAX_ROWS:
            with ct.forced_switches(WARP_SPECIALIZED=False):
                _fp8_row(ctx, "cuda", case, plan, q, k8, v8, reference, nbytes, cost, impl="tlt-cuda fp8 (lockstep)")


def _bench_fp8_key_product_rule(ctx, case, plan, q, k8, v8, reference, nbytes, cost):
    """The Triton kernel over the e4m3 caches on the other side of its key-product rule (``FP8_KEY_PRODUCT_TILES`` in
    _triton/tree_attention.py): ``tlt-triton fp8 (keys widened)`` where the default multiplies the keys as stored,
    ``tlt-triton fp8 (e4m3 key products)`` elsewhere; checked against the widened caches' output. bf16 rows only
    (fp16 rows never take key products)."""
    import tlt_kernels._triton.tree_attention as tk

    if q.dtype != torch.bfloat16:
        return
    tile = (plan.head_dim, tk.kernel_config(plan.head_dim, plan.num_tree * plan.group)[0])
    if tk.uses_fp8_key_products(q.dtype, k8.dtype, *tile):
        impl, tiles = "tlt-triton fp8 (keys widened)", tk.FP8_KEY_PRODUCT_TILES - {tile}
    else:
        impl, tiles = "tlt-triton fp8 (e4m3 key products)", tk.FP8_KEY_PRODUCT_TILES | {tile}
    with mock.patch.object(tk, "FP8_KEY_PRODUCT_TILES", frozenset(tiles)):  # the rule's other side, this row only
        _fp8_row(ctx, "triton", case, plan, q, k8, v8, reference, nbytes, cost, impl=impl)


def _bench_fp8_wide_tile_rule(ctx, case, plan, q, k8, v8, reference, nbytes, cost):
    """Where the row tile has a 128-key config over e4m3 caches (``FP8_WIDE_TILE_CONFIGS``), the other side of its
    split-length rule: ``tlt-triton fp8 (64-key tiles)`` where the default takes 128-key tiles, ``tlt-triton fp8
    (128-key tiles)`` where its splits are too short for them; checked against the widened caches' output."""
    import tlt_kernels._triton.tree_attention as tk

    block_m = tk.kernel_config(plan.head_dim, plan.num_tree * plan.group)[0]
    if (plan.head_dim, block_m) not in tk.FP8_WIDE_TILE_CONFIGS:
        return
    if plan.split_len >= tk.FP8_WIDE_TILE_MIN_SPLIT:
        impl, min_split = "tlt-triton fp8 (64-key tiles)", plan.split_len + 1
    else:
        impl, min_split = "tlt-triton fp8 (128-key tiles)", plan.split_len
    with mock.patch.object(tk, "FP8_WIDE_TILE_MIN_SPLIT", min_split):  # the rule's other side, this row only
        _fp8_row(ctx, "triton", case, plan, q, k8, v8, reference, nbytes, cost, impl=impl)


def _fp8_row(ctx, backend, case, plan, q, k8, v8, reference, nbytes, cost, impl=None):
    """The ``tlt-<backend> fp8`` row (or ``impl``): ``backend`` over the e4m3 caches, checked against ``reference``,
    then timed. Its output, or None after a note when it fails."""
    impl = impl or f"tlt-{backend} fp8"
    try:
        out = plan.run(q, k8, v8, backend=backend)
        _check(impl, out, reference, case)
        ms, timing = _timed(ctx, lambda: plan.run(q, k8, v8, out=out, backend=backend))
        ctx.add(case, impl, ms, bytes_moved=nbytes, num_splits=plan.num_splits, split_len=plan.split_len,
                timing=timing, **cost.extra(ms))
        return out
    except Exception as exc:  # noqa: BLE001 - report, go on with the other rows
        ctx.note(f"{impl} failed on {case}: {type(exc).__name__}: {str(exc)[:300]}")
        return None


def xqa_call(fi, inp, L: int):
    """FlashInfer's XQA over ``inp``'s caches (``inp["k_cache"]`` / ``inp["v_cache"]``, bf16 or e4m3) as a
    zero-argument call returning ``[B * T, Hq, D]``: the tree's nodes are the last T of L + T tokens, the mask covers
    them only."""
    q, table = inp["q"], inp["block_table"]
    B, T, Hq, D = q.shape
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device=q.device)  # its semaphores must start at 0
    seq_lens = torch.full((B,), L + T, dtype=torch.uint32, device=q.device)
    mask = xqa_tree_mask(inp["parents"]) if T > 1 else None
    flat = q.reshape(B * T, Hq, D)
    return lambda: fi.decode.trtllm_batch_decode_with_kv_cache(
        flat, (inp["k_cache"], inp["v_cache"]), workspace, table, seq_lens, table.shape[1] * PAGE,
        bmm1_scale=D**-0.5, bmm2_scale=1.0, kv_layout="NHD", backend="xqa", q_len_per_req=T, mask=mask)


def _bench_flashinfer_xqa(ctx, fi, case, inp, reference, nbytes, extra, impl="flashinfer-xqa"):
    """The ``flashinfer-xqa`` row (:func:`xqa_call`), checked against ``reference`` before it is timed."""
    try:
        call = xqa_call(fi, inp, case["L"])
        got = call().view(inp["q"].shape)
        if reference is not None:
            _check(impl, got, reference, case)
        ms, timing = _timed(ctx, call)
        ctx.add(case, impl, ms, bytes_moved=nbytes, timing=timing, **extra(ms))
    except Exception as exc:  # optional peer: report, do not fail the suite
        ctx.note(f"{impl} skipped for {case}: {type(exc).__name__}: {str(exc)[:200]}")


def _bench_flashinfer_decode(ctx, fi, case, inp, decode_reference, nbytes, extra):
    """The ``flashinfer decode (T=1)`` row: the decode wrapper for each request's first node over its L + 1 tokens."""
    try:
        q, table = inp["q"], inp["block_table"]
        B, _, Hq, D = q.shape
        Hkv, L, dev = inp["k_cache"].shape[2], case["L"], q.device
        pages = -(-(L + 1) // PAGE)
        # Its CUDA-core decode builds GQA groups 1, 2, 3, 4 and 8 only; groups of 4 and more run best on tensor cores.
        wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(torch.empty(256 << 20, dtype=torch.uint8, device=dev), "NHD",
                                                        use_tensor_cores=Hq // Hkv >= 4)
        indptr = torch.arange(B + 1, dtype=torch.int32, device=dev) * pages
        last = torch.full((B,), (L + 1) - (pages - 1) * PAGE, dtype=torch.int32, device=dev)
        wrapper.plan(indptr, table[:, :pages].reshape(-1), last, Hq, Hkv, D, PAGE, q_data_type=q.dtype,
                     kv_data_type=inp["k_cache"].dtype)
        q1, kv = q[:, 0].contiguous(), (inp["k_cache"], inp["v_cache"])
        got = wrapper.run(q1, kv).view(B, 1, Hq, D)
        if decode_reference is not None:
            _check("flashinfer decode (T=1)", got, decode_reference, case)
        ms, timing = _timed(ctx, lambda: wrapper.run(q1, kv))
        ctx.add(case, "flashinfer decode (T=1)", ms, bytes_moved=nbytes, timing=timing, **extra(ms))
    except Exception as exc:  # optional peer: report, do not fail the suite
        ctx.note(f"flashinfer decode skipped for {case}: {type(exc).__name__}: {str(exc)[:200]}")


def _bench_flashinfer(ctx, fi, case, inp, mask, Hq, Hkv, D, L, T, reference, nbytes, extra):
    try:
        B = inp["q"].shape[0]
        dev = inp["q"].device
        pages = inp["block_table"].shape[1]
        workspace = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
        wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        qo_indptr = torch.arange(B + 1, dtype=torch.int32, device=dev) * T
        kv_indptr = torch.arange(B + 1, dtype=torch.int32, device=dev) * pages
        last = torch.full((B,), (L + T) - (pages - 1) * PAGE, dtype=torch.int32, device=dev)
        wrapper.plan(qo_indptr, kv_indptr, inp["block_table"].reshape(-1), last, Hq, Hkv, D, PAGE,
                     custom_mask=mask.reshape(-1), q_data_type=inp["q"].dtype)
        q = inp["q"].reshape(B * T, Hq, D)
        kv = (inp["k_cache"], inp["v_cache"])
        got = wrapper.run(q, kv).view(B, T, Hq, D)
        if reference is not None:
            _check("flashinfer", got, reference, case)
        ms, timing = _timed(ctx, lambda: wrapper.run(q, kv))
        ctx.add(case, "flashinfer", ms, bytes_moved=nbytes, timing=timing, **extra(ms))
    except Exception as exc:
        ctx.note(f"flashinfer skipped for {case}: {type(exc).__name__}: {str(exc)[:200]}")


def run(ctx) -> None:
    if ctx.device.type != "cuda":
        cases, models = CPU_CASES, ["qwen2.5-7b"]
        ctx.note("CPU: Triton runs in its interpreter; timings are a smoke test only")
    elif ctx.small:
        cases, models = SMALL_GPU_CASES, list(MODELS)
    else:
        cases, models = CASES, list(MODELS)
    ctx.note("torch-sdpa includes gathering K/V out of the pages; the '(pre-gathered)' rows start from contiguous K/V")
    selected = _selected_cases(models, cases, values(ctx, FLAGS).cases)
    if values(ctx, FLAGS).long_tail and ctx.device.type == "cuda":
        selected += [("qwen2.5-7b", *c, False) for c in LONG_TAIL_CASES]
    if values(ctx, FLAGS).fp8_only:
        ctx.note("--fp8-only: the rows over e4m3 caches alone" + ("" if ctx.device.type == "cuda" else " (none on CPU)"))
    if not all(flex for *_, flex in selected):
        # No flex-attention there: a compile per shape (most of a case's time), and far off the pace at these shapes.
        ctx.note("long-tail cases: no flex-attention rows")
    for model, B, L, T, flex in selected:
        _bench_case(ctx, model, B, L, T, flex)
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()
