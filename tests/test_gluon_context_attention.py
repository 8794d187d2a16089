"""bench/gluon_context_attention.py (issue 3 experiment): compiles for sm_90a with the QK^T / softmax overlap (CPU),
and matches the fp32 reference on the GPU."""
import math

import pytest
import torch

from conftest import compile_for_sm90, sm90_rule_spy

_COMPILE = r"""
import re, sys
sys.path.insert(0, ".")
from tlt_kernels._triton.tree_attention_gluon import compile_for_sm90
for T, G, D in ((16, 7, 128), (16, 5, 128), (8, 7, 128), (16, 4, 64)):
    c, regs, spills = compile_for_sm90(T=T, G=G, D=D)
    ptx = c.asm["ptx"]
    assert spills == 0, (T, G, D, spills)
    assert c.metadata.shared <= 227 * 1024, c.metadata.shared
    # The point of the kernel: an async wgmma (S of the next tile) left in flight (wait_group 1) across the softmax.
    assert "wgmma.mma_async" in ptx and "wgmma.wait_group.sync.aligned 1" in ptx, (T, G, D)
    # ...and ptxas keeps the wgmmas asynchronous (C7514: it serializes them all when an accumulator is read while
    # in flight, as happened with an O accumulator carried in flight across the loop's back edge).
    assert "C7514" not in c.ptxas_log, c.ptxas_log
    # K/V gathered by 16-byte cp.async (masks or unknown alignment would split them into 2-byte copies).
    assert re.search(r"cp\.async\.cg\.shared\.global[^;]*0x10, 0x10;", ptx), (T, G, D)
    print(T, G, D, regs, c.metadata.shared)
"""


def test_compiles_for_sm90_with_overlap():
    compile_for_sm90(_COMPILE)


@pytest.mark.parametrize("D,T,G", [(128, 16, 7), (128, 8, 7), (64, 16, 4)])
def test_triton_tail_and_tree_mode_compiles_for_sm90(D, T, G):
    """The Triton partial kernel in its tail + tree mode (CONTEXT_DONE_BLOCK=64) compiles for sm_90 without spills:
    on a GPU it only runs behind the Gluon context kernel."""
    from test_tree_attention_triton_variants import _COMPILE_SM90

    compile_for_sm90(_COMPILE_SM90.format(D=D, T=T, G=G, fp32=False, done=64, checks="assert spills == 0, spills"))


@pytest.mark.cuda
@pytest.mark.parametrize("L,T,Hq,Hkv,D,dtype,split_len", [
    (512, 16, 28, 4, 128, torch.bfloat16, 256),   # 7B heads, two splits
    (448, 16, 40, 8, 128, torch.bfloat16, 128),   # 32B heads, rows 80 of 128, four splits (the last one short)
    (1024, 8, 28, 4, 128, torch.float16, 1024),   # 56 rows: one warp group, one split
    (320, 16, 8, 2, 64, torch.bfloat16, 192),     # D=64; request 1's second split has no whole tile
])
def test_matches_reference_gpu(L, T, Hq, Hkv, D, dtype, split_len):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from bench.gluon_context_attention import _case, _reference_partials
    from tlt_kernels._triton.tree_attention_gluon import CONFIG, run_context

    B = 3
    q, kc, vc, bt, cl = _case(B, L, T, Hq, Hkv, D, 16, dtype, torch.device("cuda"))
    cl[1] = L - 100  # ragged: request 1's last split ends in a tail the kernel leaves to the Triton one
    S = -(-L // split_len)
    G = Hq // Hkv
    po = torch.full((B * Hkv * (S + 1) * T * G, D), float("nan"), device="cuda")
    pl = torch.full((B * Hkv * (S + 1) * T * G,), float("nan"), device="cuda")
    sm_scale = 1.0 / math.sqrt(D)
    run_context(q, kc, vc, bt, cl, split_len, S, sm_scale, po, pl)
    ref_o, ref_l = _reference_partials(q, kc, vc, bt, cl, split_len, S, sm_scale, CONFIG["BLOCK_N"])
    got_o = po.view(B, Hkv, S + 1, T * G, D)[:, :, :S]
    got_l = pl.view(B, Hkv, S + 1, T * G)[:, :, :S]
    used = torch.isfinite(ref_l)
    assert used.any()
    # Splits without a whole tile: lse -inf, never NaN (the merge reads lse first).
    assert torch.equal(torch.isneginf(got_l), ~used)
    torch.testing.assert_close(got_l[used], ref_l[used], atol=2e-3, rtol=0)
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    torch.testing.assert_close(got_o[used], ref_o[used], atol=tol, rtol=0)
    # The last slot (the tree's, S) belongs to the Triton kernel: untouched here.
    assert torch.isnan(po.view(B, Hkv, S + 1, T * G, D)[:, :, S]).all()


def _torch_context_fn(block):
    """Stands in for the Gluon context kernel on the CPU: each split's whole tiles of ``block`` tokens, fp32, in the
    plan's scratch slots 0 .. S-1 (the same partials the kernel writes)."""
    from bench.gluon_context_attention import _reference_partials

    def run(plan, q, k_cache, v_cache, sm_scale):
        run.calls += 1
        S = plan.num_splits
        o, lse = _reference_partials(q, k_cache, v_cache, plan.block_table, plan.context_lens, plan.split_len, S,
                                     sm_scale, block)
        plan.partial_out[:, :, :S] = torch.nan_to_num(o)  # the kernel writes 0 rows for splits without a tile
        plan.partial_lse[:, :, :S] = lse

    run.calls = 0
    return run


# (ctx_lens, T, Hq, Hkv, D, dtype, split_len): tails of every length class, a context without a whole tile, an empty
# context, one split and several, 7B-like rows (T*G = 112 of 128), D=64.
SPLIT_CASES = {
    "tails-multi-split": ([300, 64, 1, 0], 16, 7, 1, 128, torch.bfloat16, 128),
    "one-split-gqa4-d64": ([130, 63, 200], 8, 8, 2, 64, torch.float16, 256),
    "deep-tree-rows-128": ([257, 100], 16, 8, 1, 64, torch.bfloat16, 64),
}


# GPU cases on top of SPLIT_CASES (same tuple layout): model-sized heads, ragged contexts.
GPU_CASES = {
    **SPLIT_CASES,
    "qwen7b-like": ([4096, 3000, 70, 0], 16, 28, 4, 128, torch.bfloat16, 1024),
    "qwen32b-like-fp16": ([2048, 333], 16, 40, 8, 128, torch.float16, 512),
    "one-split": ([200, 64, 5], 8, 14, 2, 128, torch.bfloat16, 256),
    # Splits of exactly 3 tiles of 128 (the 128-token kernel's ring, kStages = 3) or 6 of 64; request 1's second split
    # has no whole tile, request 2 none at all.
    "ring-boundary": ([1000, 400, 100], 8, 14, 2, 128, torch.float16, 384),
    # 192-token splits (64-token tiles only): 3 tiles, fewer than that kernel's 4 ring slots; tails everywhere.
    "split192": ([700, 250, 60], 16, 28, 4, 128, torch.bfloat16, 192),
}

# The sm_90 CUDA kernel's tile widths (tlt_kernels._cuda.tree_attention.CONTEXT_BLOCKS); "128-ws" is the 128-token
# tile's warp-specialized build (CONTEXT_WARP_SPECIALIZED).
CUDA_CONTEXT_BLOCKS = (64, 128, "128-ws")


def _cuda_context_cases(names):
    """(case, tile width) pairs where the case's split_len is a whole number of tiles."""
    return [pytest.param(n, blk, id=f"{n}-block{blk}") for n in names for blk in CUDA_CONTEXT_BLOCKS
            if GPU_CASES[n][-1] % (128 if blk == "128-ws" else blk) == 0]


def _need_sm90(with_extension: bool = False):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm_90 GPU")
    if with_extension:
        from tlt_kernels._backend import backend_unavailable_reason

        if backend_unavailable_reason("cuda", torch.device("cuda")) is not None:
            pytest.skip("tlt_kernels._C not built")


@pytest.mark.triton
@pytest.mark.parametrize("name", list(SPLIT_CASES))
def test_tail_and_tree_after_context_kernel_cpu(name):
    """The Triton side of the Gluon path (tail + tree into slot S, then the merge of every slot) matches the reference
    when the context partials come from a torch stand-in: runs under TRITON_INTERPRET=1 on the CPU."""
    from test_tree_attention import check_against_reference, make_case, make_plan, poison_

    from tlt_kernels._triton.tree_attention import run_triton

    ctx, T, Hq, Hkv, D, dtype, split_len = SPLIT_CASES[name]
    case = make_case(ctx, T, Hq, Hkv, D, 16, dtype, ("random", "chain"))
    plan = make_plan(case, split_len=split_len)
    plan.partial_out.fill_(float("nan"))
    plan.partial_lse.fill_(float("nan"))
    out = poison_(torch.empty_like(case["q"]))
    context_fn = _torch_context_fn(64)
    run_triton(plan, case["q"], case["k_cache"], case["v_cache"], out, 1.0 / math.sqrt(D), context_fn=context_fn)
    check_against_reference(out, case)
    assert context_fn.calls == 1
    # The tail + tree program wrote slot S of every request (its lse is finite: the tree's root sees itself).
    assert torch.isfinite(plan.partial_lse[:, :, plan.num_splits]).all()


def test_context_fn_needs_whole_tiles_per_split():
    from test_tree_attention import make_case, make_plan

    from tlt_kernels._triton.tree_attention import run_triton

    case = make_case([100], 4, 2, 1, 64, 16, torch.bfloat16)
    plan = make_plan(case, split_len=64)  # plans keep split_len a multiple of 64; a 128-token context tile needs more
    with pytest.raises(ValueError, match="not a multiple of the context kernel's tile"):
        run_triton(plan, case["q"], case["k_cache"], case["v_cache"], torch.empty_like(case["q"]), 0.125,
                   context_fn=_torch_context_fn(128), context_block=128)


@pytest.mark.cuda
@pytest.mark.parametrize("name", list(SPLIT_CASES) + ["qwen7b-like"])
def test_whole_op_with_gluon_context_gpu(name, monkeypatch):
    """tree_attention(backend="triton") with GLUON_CONTEXT on: the Gluon kernel is really used (its launcher is
    called) and the output matches the reference."""
    _need_sm90()
    from test_tree_attention import check_against_reference, make_case, make_plan, poison_

    import tlt_kernels._triton.tree_attention as ta
    import tlt_kernels._triton.tree_attention_gluon as tg

    ctx, T, Hq, Hkv, D, dtype, split_len = GPU_CASES[name]
    calls = []
    real = tg.run_context_plan
    monkeypatch.setattr(ta, "GLUON_CONTEXT", True)
    monkeypatch.setattr(tg, "run_context_plan", lambda *a: (calls.append(1), real(*a)))
    case = make_case(ctx, T, Hq, Hkv, D, 16, dtype, ("random", "chain"), device="cuda")
    plan = make_plan(case, split_len=split_len)
    out = poison_(torch.empty_like(case["q"]))
    plan.run(case["q"], case["k_cache"], case["v_cache"], out=out, backend="triton")
    torch.cuda.synchronize()
    assert calls, "the Gluon context kernel was not used"
    check_against_reference(out, case)


@pytest.mark.cuda
@pytest.mark.parametrize("name,block", _cuda_context_cases(
    ["tails-multi-split", "qwen7b-like", "qwen32b-like-fp16", "one-split", "ring-boundary", "split192"]))
def test_whole_cuda_op_with_context_kernel_gpu(name, block, monkeypatch):
    """tree_attention(backend="cuda") with CONTEXT_SM90 on and each tile width (CONTEXT_BLOCK): the sm_90 kernel
    (csrc/tree_attention_ctx_sm90.cu, the CUDA twin of the Gluon kernel extended to the tail and the tree) and the
    merge give the reference output on the Gluon kernel's cases."""
    _need_sm90(with_extension=True)
    from test_tree_attention import check_against_reference, make_case, make_plan, poison_

    import tlt_kernels._cuda.tree_attention as ct

    ctx, T, Hq, Hkv, D, dtype, split_len = GPU_CASES[name]
    used = sm90_rule_spy(monkeypatch, True)
    monkeypatch.setattr(ct, "CONTEXT_WARP_SPECIALIZED", block == "128-ws")
    monkeypatch.setattr(ct, "CONTEXT_BLOCK", 128 if block == "128-ws" else block)
    case = make_case(ctx, T, Hq, Hkv, D, 16, dtype, ("random", "chain"), device="cuda")
    plan = make_plan(case, split_len=split_len)
    out = poison_(torch.empty_like(case["q"]))
    plan.run(case["q"], case["k_cache"], case["v_cache"], out=out, backend="cuda")
    torch.cuda.synchronize()
    assert used and all(used), "the sm_90 context kernel was not used"
    check_against_reference(out, case)
