"""Gluon kernel (Triton 3.6 ``triton.experimental.gluon``, sm_90) for the *context* part of tree attention: the whole
K/V tiles of every split, with the tensor cores and the softmax working at the same time.

Why: at T=16 the Triton kernel's 112 (7B) / 80 (32B) query rows per KV head pad to 128, and each K/V tile's two MMAs
plus its 128x128 softmax take about as long as the tile's transfer. One warp group does both in order, which caps it
at 67-71% of the HBM floor (bench/RESULTS.md); Triton 3.6's pipeliner waits on each dot at once. Here the waits are
explicit, in FA3's intra-warpgroup order::

    S_j = Q K_j^T;  O += P_{j-1} V_{j-1}     (two async wgmmas, issued back to back)
    wait S_j; P_j = softmax(S_j)             (CUDA cores, while the P V runs)
    wait P V; O = alpha_j O

No accumulator stays in flight across the loop's back edge: where one does, ptxas serializes every wgmma of the
kernel (C7514), which the first version of this kernel ran into. K/V are gathered through the block table by
16-byte cp.async into a ring of ``NUM_STAGES`` slots. Each program writes its split's partial (o, natural-log lse) in
the plan's scratch layout; the Triton kernel adds the last split's tail and the tree part as the extra slot S, and
the merge kernel combines them (``tree_attention.run_triton``). The CUDA twin is csrc/tree_attention_ctx_sm90.cu.

**Experimental, off by default** (``TLT_TREE_ATTENTION_GLUON=1`` or ``tree_attention.GLUON_CONTEXT = True``). Gluon
has no interpreter, so its correctness checks (tests/test_gluon_context_attention.py) run on the GPU only; they pass
on an H100 (2026-11-26). Not adopted: alone it reaches 75-79% of the HBM floor at T=16 (83-86% with BLOCK_N=128),
but as a whole op (plus the tail-and-tree partial and the merge) 53-80%, below the Triton op's 88-98% on the same
H100 (bench/RESULTS.md). ``bench/gluon_context_attention.py`` times it.
Covers bf16/fp16, D in (64, 128), ``T * G <= 128`` and ``split_len`` a multiple of ``CONFIG["BLOCK_N"]``.
"""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from . import ptxas_report

LOG2E = 1.4426950408889634


@gluon.jit
def _issue_tile(k_smem, v_smem, stage, K_head, V_head, pages, n0, offs_n, offs_d, stride_kp, stride_ks, stride_vp,
                stride_vs, PAGE_SIZE: gl.constexpr):
    """cp.async of K and V rows ``n0 .. n0 + BLOCK_N - 1`` (page ids ``pages``) into ring slot ``stage``, one commit
    group per tile. Unmasked, so the copies stay 16-byte vectors: a tile past the split's end comes with page ids 0
    (a real page, read and never used), which keeps the group count uniform."""
    in_page = ((n0 + offs_n) % PAGE_SIZE).to(gl.int64)
    page = pages.to(gl.int64)
    k_rows = gl.expand_dims(page * stride_kp + in_page * stride_ks, 1)
    v_rows = gl.expand_dims(page * stride_vp + in_page * stride_vs, 1)
    cols = gl.expand_dims(offs_d, 0)
    async_copy.async_copy_global_to_shared(k_smem.index(stage), K_head + k_rows + cols)
    async_copy.async_copy_global_to_shared(v_smem.index(stage), V_head + v_rows + cols)
    async_copy.commit_group()


@gluon.jit
def _tile_pages(bt_row, start, tile, n_full, offs_n, BLOCK_N: gl.constexpr, PAGE_SIZE: gl.constexpr):
    """Page id of each row of the split's tile ``tile``; 0 (a real page, read and never used) past the whole tiles."""
    n0 = start + tile * BLOCK_N
    return gl.load(bt_row + (n0 + offs_n) // PAGE_SIZE, mask=(offs_n >= 0) & (tile < n_full), other=0)


@gluon.jit
def _online_softmax(s, m_i, l_i, qk_scale):
    """One tile's online softmax (base 2, the scale folded into the exponent): returns the unnormalized
    probabilities, the new running max and sum, and ``alpha`` that rescales what was accumulated before."""
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
    return p, m_new, l_i * alpha + gl.sum(p, 1), alpha


@gluon.jit
def _context_attn_kernel(
    Q_ptr, K_ptr, V_ptr, BlockTable_ptr, ContextLens_ptr, PartialOut_ptr, PartialLse_ptr,
    qk_scale, split_len, num_splits,
    stride_qb, stride_qt, stride_qh,
    stride_kp, stride_ks, stride_kh,
    stride_vp, stride_vs, stride_vh,
    stride_bt,
    NUM_KV_HEADS: gl.constexpr, T: gl.constexpr, G: gl.constexpr, HEAD_DIM: gl.constexpr, PAGE_SIZE: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, num_warps: gl.constexpr,
):
    split = gl.program_id(0)
    h = gl.program_id(1)
    b = gl.program_id(2)
    b64 = b.to(gl.int64)

    # wgmma layouts: S = Q K^T is [BLOCK_M, BLOCK_N], O = P V is [BLOCK_M, HEAD_DIM]; every warp owns 16-row slabs.
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    # Global loads: 16-byte vectors along D.
    ld_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[256 // HEAD_DIM, HEAD_DIM // 8],
                                               warps_per_cta=[num_warps, 1], order=[1, 0])
    smem_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    dtype: gl.constexpr = Q_ptr.dtype.element_ty

    ctx = gl.load(ContextLens_ptr + b)
    start = split * split_len
    end = gl.minimum(start + split_len, ctx)
    n_full = gl.maximum(end - start, 0) // BLOCK_N

    # Q rows m = t * G + g (node t, query head h * G + g), zero beyond T * G; staged once in shared memory.
    offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ld_layout))
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, ld_layout))
    row_ok = offs_m < T * G
    q_rows = (offs_m // G) * stride_qt + (h * G + offs_m % G) * stride_qh
    q_ptrs = Q_ptr + b64 * stride_qb + gl.expand_dims(q_rows.to(gl.int64), 1) + gl.expand_dims(offs_d, 0)
    q = gl.load(q_ptrs, mask=gl.expand_dims(row_ok, 1) & gl.expand_dims(offs_d >= 0, 0), other=0.0)
    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], smem_layout, q)

    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], smem_layout)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], smem_layout)
    bt_row = BlockTable_ptr + b64 * stride_bt
    K_head = K_ptr + h * stride_kh
    V_head = V_ptr + h * stride_vh
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld_layout))

    # Prologue: tiles 0 .. NUM_STAGES - 1 in flight, one per ring slot (iteration j then refills tile j - 1's slot
    # with tile j + NUM_STAGES - 1, so every tile is issued exactly once).
    for t0 in gl.static_range(NUM_STAGES):
        pages = _tile_pages(bt_row, start, t0, n_full, offs_n, BLOCK_N, PAGE_SIZE)
        _issue_tile(k_smem, v_smem, t0, K_head, V_head, pages, start + t0 * BLOCK_N, offs_n, offs_d, stride_kp,
                    stride_ks, stride_vp, stride_vs, PAGE_SIZE)
    # The page ids of the next tile to issue, read one iteration ahead: the block-table load's latency would
    # otherwise sit between each iteration's barrier and its cp.asyncs.
    next_pages = _tile_pages(bt_row, start, NUM_STAGES, n_full, offs_n, BLOCK_N, PAGE_SIZE)

    # S_0 = Q K_0^T, then P_0 = softmax(S_0) (O is zero: nothing to rescale).
    # Each thread's own copies (and its Q stores) done and made visible to the async proxy that wgmma reads through,
    # then a barrier so every thread's are: fence before the barrier, not after it.
    async_copy.wait_group(NUM_STAGES - 1)  # tile 0 landed
    fence_async_shared()
    gl.thread_barrier()
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    m_i = gl.full([BLOCK_M], -1.0e30, gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_layout))
    p, m_i, l_i, alpha = _online_softmax(s, m_i, l_i, qk_scale)
    o_acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)

    # FA3's intra-warpgroup order: S_j and P_{j-1} V_{j-1} issued back to back, the softmax of S_j runs while
    # P_{j-1} V_{j-1} does, and no accumulator stays in flight across the loop's back edge (where one does, ptxas
    # serializes every wgmma of the kernel: C7514, checked by tests/test_gluon_context_attention.py).
    for j in range(1, n_full):
        prev = (j - 1) % NUM_STAGES
        # Tile j landed (committed: tiles 0 .. j + NUM_STAGES - 2; tiles j + 1 .. may still fly).
        async_copy.wait_group(NUM_STAGES - 2)
        fence_async_shared()
        gl.thread_barrier()
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        s = warpgroup_mma(q_smem, k_smem.index(j % NUM_STAGES).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        o_acc = warpgroup_mma(p_op, v_smem.index(prev), o_acc, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))  # S_j done (issued first)
        p, m_i, l_i, alpha = _online_softmax(s, m_i, l_i, qk_scale)
        o_acc = warpgroup_mma_wait(num_outstanding=0, deps=(o_acc,))
        o_acc = o_acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        # Every warp group is done with tile j - 1: its ring slot takes tile j + NUM_STAGES - 1.
        gl.thread_barrier()
        nt = j + NUM_STAGES - 1
        _issue_tile(k_smem, v_smem, prev, K_head, V_head, next_pages, start + nt * BLOCK_N, offs_n, offs_d, stride_kp,
                    stride_ks, stride_vp, stride_vs, PAGE_SIZE)
        next_pages = _tile_pages(bt_row, start, nt + 1, n_full, offs_n, BLOCK_N, PAGE_SIZE)
    if n_full > 0:  # the last tile's P V
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        o_acc = warpgroup_mma(p_op, v_smem.index((n_full - 1) % NUM_STAGES), o_acc, is_async=True)
        o_acc = warpgroup_mma_wait(num_outstanding=0, deps=(o_acc,))
    async_copy.wait_group(0)

    # Partial of this split in the plan's scratch layout: row ((b * Hkv + h) * (S + 1) + split) * (T * G) + m.
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
    has_keys = (l_o > 0.0) & (n_full > 0)  # without a whole tile, S_0 came from a tile that is not this split's
    o = o_acc / gl.expand_dims(gl.where(has_keys, l_o, 1.0), 1)
    lse = gl.where(has_keys, (gl.convert_layout(m_i, gl.SliceLayout(1, o_layout)) + gl.log2(l_o)) * 0.6931471805599453,
                   float("-inf"))
    rows_o = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
    cols_o = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    ok_o = rows_o < T * G
    row = ((b64 * NUM_KV_HEADS + h) * (num_splits + 1) + split) * (T * G) + rows_o
    gl.store(PartialLse_ptr + row, lse, mask=ok_o)
    gl.store(PartialOut_ptr + gl.expand_dims(row, 1) * HEAD_DIM + gl.expand_dims(cols_o, 0), o,
             mask=gl.expand_dims(ok_o, 1) & gl.expand_dims(cols_o >= 0, 0))


CONFIG = dict(BLOCK_N=64, NUM_STAGES=4, num_warps=8)  # BLOCK_M 128 = two warp groups of 64 rows


def run_context(q, k_cache, v_cache, block_table, context_lens, split_len, num_splits, sm_scale, partial_out,
                partial_lse, **cfg):
    """Launch over every (split, KV head, request): the splits' whole tiles only (see the module docstring)."""
    cfg = {**CONFIG, **cfg}
    B, T, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    G = Hq // Hkv
    if D not in (64, 128) or T * G > 128 or q.dtype not in (torch.bfloat16, torch.float16) or Hq % Hkv:
        raise ValueError(f"this experiment covers D in (64, 128), T * G <= 128, bf16/fp16; got D={D}, T={T}, G={Hq}/{Hkv}, "
                         f"{q.dtype}")
    if cfg["NUM_STAGES"] < 3:
        raise ValueError("NUM_STAGES must be >= 3: tile i + 1 must be in flight while tile i is consumed")
    if split_len % cfg["BLOCK_N"]:
        raise ValueError(f"split_len ({split_len}) must be a multiple of BLOCK_N ({cfg['BLOCK_N']})")
    block_m = 128 if T * G > 64 else 64
    num_warps = cfg["num_warps"] if block_m == 128 else 4
    _context_attn_kernel[(num_splits, Hkv, B)](
        q, k_cache, v_cache, block_table, context_lens, partial_out, partial_lse,
        sm_scale * LOG2E, split_len, num_splits,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0),
        NUM_KV_HEADS=Hkv, T=T, G=G, HEAD_DIM=D, PAGE_SIZE=k_cache.shape[1], BLOCK_M=block_m,
        BLOCK_N=cfg["BLOCK_N"], NUM_STAGES=cfg["NUM_STAGES"], num_warps=num_warps,
    )


def compile_for_sm90(T=16, G=7, D=128, page=16, dtype="bf16", **cfg):
    """Compile for sm_90a without a GPU and run ptxas on the PTX: returns ``(compiled, registers, spill bytes)``."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    cfg = {**CONFIG, **cfg}
    block_m = 128 if T * G > 64 else 64
    consts = dict(NUM_KV_HEADS=4, T=T, G=G, HEAD_DIM=D, PAGE_SIZE=page, BLOCK_M=block_m, BLOCK_N=cfg["BLOCK_N"],
                  NUM_STAGES=cfg["NUM_STAGES"], num_warps=cfg["num_warps"] if block_m == 128 else 4)
    kinds = {"BlockTable_ptr": "*i32", "ContextLens_ptr": "*i32", "PartialOut_ptr": "*fp32", "PartialLse_ptr": "*fp32"}
    names = _context_attn_kernel.arg_names
    sig = {n: "constexpr" if n in consts else kinds.get(n, f"*{dtype}") if n.endswith("_ptr")
           else "fp32" if n == "qk_scale" else "i32" for n in names}
    # What a launch specializes on: 16-byte aligned pointers, strides and split_len divisible by 16.
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
             if sig[n] != "constexpr" and n not in ("qk_scale", "stride_bt", "num_splits")}
    src = GluonASTSource(_context_attn_kernel, sig, consts, attrs)
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": consts["num_warps"]})
    # c.ptxas_log: e.g. C7514, ptxas serialized the wgmmas (an accumulator in flight across a back edge).
    regs, spills, c.ptxas_log = ptxas_report(c.asm["ptx"])
    return c, regs, spills


def supports(q: torch.Tensor, num_rows: int, split_len: int) -> bool:
    """Whether :func:`run_context` covers these inputs (``num_rows = T * G``); the caller checks the device."""
    return (q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] in (64, 128) and num_rows <= 128
            and split_len % CONFIG["BLOCK_N"] == 0)


def run_context_plan(plan, q, k_cache, v_cache, sm_scale: float) -> None:
    """:func:`run_context` over a :class:`~tlt_kernels.ops.tree_attention.TreeAttentionPlan`: slots ``0 .. S-1``."""
    run_context(q, k_cache, v_cache, plan.block_table, plan.context_lens, plan.split_len, plan.num_splits, sm_scale,
                plan.partial_out, plan.partial_lse)
