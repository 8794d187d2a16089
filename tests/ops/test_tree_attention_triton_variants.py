"""Triton tree attention: the pipelined context loop (whole tiles with page ids prefetched one trip
ahead, then a masked tail) against the fp32 reference and against the previous loop (``PIPELINE = 0``).

tests/ops/test_tree_attention.py mostly has contexts of at most one tile per split; these cases run several
whole tiles per split (so the carried page ids matter), tiles that straddle pages, pages larger than a
tile, split starts that are not tile-aligned, and tails of every length class.
"""

import dataclasses

import pytest
import torch
from conftest import kernel_devices
from test_tree_attention import check_against_reference, make_case, make_plan

from tlt_kernels._backend import backend_unavailable_reason
from tlt_kernels._triton import tree_attention as tk
from tools.sm90_partial_compile import PARTIAL_KERNEL_SM90

DEVICE = torch.device(kernel_devices()[0])

# (ctx_lens, T, Hq, Hkv, D, block_size, dtype, num_nodes, split_len)
CASES = {
    # BLOCK_M=16 -> BLOCK_N=64: 4 whole tiles + tail 45 / exactly 3 tiles / tail only.
    "multi-tile-bs16": ([301, 192, 20], 4, 4, 2, 64, 16, torch.bfloat16, [4, 2, 4], None),
    # Page size 1 (every token its own page) and 3 whole tiles before a 1-token tail.
    "multi-tile-bs1-fp16": ([193, 64], 3, 2, 1, 64, 1, torch.float16, None, None),
    # Pages of 128 tokens, larger than a 64-token tile: consecutive tiles share a page id.
    "big-pages-bs128": ([450, 129], 5, 3, 1, 64, 128, torch.bfloat16, [5, 1], None),
    # split_len 192 with BLOCK_N=64: several splits of 3 whole tiles, then a merged tail split.
    "splits-of-three-tiles": ([700, 5], 6, 2, 2, 64, 16, torch.bfloat16, None, 192),
    # BLOCK_M=128 (T*G=128) -> BLOCK_N=128, split starts at multiples of 64 (not of the tile).
    "d128-bm128-unaligned-splits": ([520, 300], 16, 8, 1, 128, 16, torch.bfloat16, [16, 11], 320),
}


def _need_triton():
    reason = backend_unavailable_reason("triton", DEVICE)
    if reason is not None:
        pytest.skip(reason)


def _case(name):
    ctx, T, Hq, Hkv, D, bs, dtype, n, split = CASES[name]
    return make_case(ctx, T, Hq, Hkv, D, bs, dtype, num_nodes=n, device=DEVICE), split


@pytest.mark.triton
@pytest.mark.parametrize("name", list(CASES))
def test_pipelined_loop_matches_reference(name):
    _need_triton()
    case, split = _case(name)
    plan = make_plan(case, split_len=split)
    out = torch.full_like(case["q"], float("nan"))
    plan.run(case["q"], case["k_cache"], case["v_cache"], out=out, backend="triton")
    check_against_reference(out, case)


@pytest.mark.triton
@pytest.mark.parametrize("hoist", [True, False])
@pytest.mark.parametrize("name", ["multi-tile-bs16", "multi-tile-bs1-fp16", "big-pages-bs128", "splits-of-three-tiles"])
def test_tree_loads_before_or_after_the_context_loop_match_reference(name, hoist, monkeypatch):
    """The tree's operands loaded before the context loop (``hoists_tree``) or after it: the same attention, with
    splits (the tree rides in the last non-empty one, the other splits' loads masked off) and without."""
    _need_triton()
    case, split = _case(name)
    ctx, T, Hq, Hkv, D, _, dtype, _, _ = CASES[name]
    block_m = tk.row_tile(D, T * (Hq // Hkv))
    assert tk.hoists_tree(max(16, tk._next_pow2(T)), block_m, D, dtype)  # these cases hoist by default
    if not hoist:
        monkeypatch.setattr(tk, "HOIST_TREE_MAX_BYTES", 0)
    plan = make_plan(case, split_len=split)
    out = torch.full_like(case["q"], float("nan"))
    plan.run(case["q"], case["k_cache"], case["v_cache"], out=out, backend="triton")
    check_against_reference(out, case)


def test_hoists_tree_rule():
    """Small accumulators and tree tiles hoist (SmolLM2 at T <= 16, 7B rows at T <= 4); 64-row tiles at D = 128
    (7B at T = 8), 128-row ones, fp32 D = 256 trees and one-byte caches do not."""
    assert tk.hoists_tree(16, 16, 64, torch.bfloat16) and tk.hoists_tree(16, 64, 64, torch.bfloat16)
    assert tk.hoists_tree(16, 32, 128, torch.bfloat16) and not tk.hoists_tree(16, 32, 128, torch.float8_e4m3fn)
    assert not tk.hoists_tree(16, 64, 128, torch.bfloat16) and not tk.hoists_tree(16, 128, 128, torch.bfloat16)
    assert not tk.hoists_tree(32, 16, 128, torch.bfloat16) and not tk.hoists_tree(16, 16, 256, torch.float32)


@pytest.mark.triton
def test_tree_loads_before_the_loop_over_fp8_caches_match_reference(monkeypatch):
    """Over e4m3 caches (``HOIST_TREE_ONE_BYTE``, off by default): the hoisted loads widen as the others do."""
    _need_triton()
    case = make_case([301, 20], 4, 4, 2, 64, 16, torch.bfloat16, num_nodes=[4, 2], device=DEVICE)
    k8, v8 = case["k_cache"].to(torch.float8_e4m3fn), case["v_cache"].to(torch.float8_e4m3fn)
    monkeypatch.setattr(tk, "HOIST_TREE_ONE_BYTE", True)
    assert tk.hoists_tree(16, 16, 64, torch.float8_e4m3fn)
    plan = make_plan(case, split_len=128)
    got = plan.run(case["q"], k8, v8, out=torch.full_like(case["q"], float("nan")), backend="triton")
    want = plan.run(case["q"], k8, v8, backend="torch")
    assert torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2), (got.float() - want.float()).abs().max()


@pytest.mark.triton
@pytest.mark.parametrize("name", ["multi-tile-bs16", "big-pages-bs128", "splits-of-three-tiles"])
def test_pipelined_loop_matches_previous_loop(name, monkeypatch):
    _need_triton()
    case, split = _case(name)
    plan = make_plan(case, split_len=split)
    outs = []
    for pipeline in (0, 1):
        monkeypatch.setattr(tk, "PIPELINE", pipeline)
        out = torch.full_like(case["q"], float("nan"))
        plan.run(case["q"], case["k_cache"], case["v_cache"], out=out, backend="triton")
        outs.append(out.float())
    # Same math up to where the scale is applied (one fp32 rounding) and bf16 rounding of p.
    torch.testing.assert_close(outs[1], outs[0], atol=2e-2, rtol=0)


def _growing_scores_case(device):
    """Keys scaled up along the context (x0.25 at slot 0 to x4 at the end), so each request's running max grows
    across tiles by small and by large steps: lazy rescaling must take both branches (keep a stale max, rescale)."""
    case = make_case([700, 333], 8, 4, 2, 64, 16, torch.bfloat16, num_nodes=[8, 5], device=device)
    k = case["k_cache"].float()
    table, bs = case["block_table"].cpu(), k.shape[1]
    for b, C in enumerate(case["context_lens"].tolist()):
        for i in range(C):
            k[int(table[b, i // bs]), i % bs] *= 0.25 + 3.75 * i / C
    case["k_cache"] = k.to(torch.bfloat16)
    return case


@pytest.mark.triton
@pytest.mark.parametrize("tau", [1.0, 8.0])
@pytest.mark.parametrize("name", ["multi-tile-bs16", "splits-of-three-tiles", "d128-bm128-unaligned-splits", "growing"])
def test_lazy_rescale_matches_reference(name, tau, monkeypatch):
    """FA4-style lazy rescaling (stale running max unless it grows by more than tau): same attention, any tau."""
    _need_triton()
    if name == "growing":
        case, split = _growing_scores_case(DEVICE), 256
    else:
        case, split = _case(name)
    plan = make_plan(case, split_len=split)
    monkeypatch.setattr(tk, "LAZY_RESCALE", tau)
    out = torch.full_like(case["q"], float("nan"))
    plan.run(case["q"], case["k_cache"], case["v_cache"], out=out, backend="triton")
    check_against_reference(out, case)


# name: (case, split_len, whether the partial kernel merges): rows of at most FUSED_MERGE_MAX_ROWS merge in the
# last split; more rows (a 128-row tile; 64-row chunks, each with its own counter) in the merge kernel.
MERGE_CASES = {
    "decode-gqa7": (([700, 130, 0], 1, 7, 1, 128, 16, torch.bfloat16, None), 128, True),
    "splits-of-three-tiles": (CASES["splits-of-three-tiles"][:-1], 192, True),
    "fp16-gqa4-ragged": (([1000, 64, 333, 65], 3, 8, 2, 64, 16, torch.float16, [3, 1, 2, 3]), 128, True),
    "d128-bm128-unaligned-splits": (CASES["d128-bm128-unaligned-splits"][:-1], 320, False),
    "row-chunk-splits": (([700, 130, 0], 48, 3, 1, 64, 16, torch.bfloat16, [48, 20, 48]), 128, False),
}


@pytest.mark.triton
@pytest.mark.parametrize("name", list(MERGE_CASES))
def test_fused_merge_matches_merge_kernel(name, monkeypatch):
    """The merge in each request's last split to finish (``FUSED_MERGE``) gives the merge kernel's rows and leaves the
    arrival counters at zero, so the next run (a graph replay) starts clean; a plan without counters takes the
    kernel."""
    _need_triton()
    (ctx, T, Hq, Hkv, D, bs, dtype, n), split, fused = MERGE_CASES[name]
    case = make_case(ctx, T, Hq, Hkv, D, bs, dtype, num_nodes=n, device=DEVICE)
    plan = make_plan(case, split_len=split)
    block_m, chunks = tk.kernel_config(D, T * (Hq // Hkv))[:2]
    assert plan.num_splits > 1 and tk.merges_in_partial_kernel(plan, block_m, chunks) == fused
    # Counters not shaped [B, Hkv, >= chunks] (here flattened) would be indexed out of range: the merge kernel runs.
    flat = dataclasses.replace(plan, split_counters=plan.split_counters.view(-1))
    assert not tk.merges_in_partial_kernel(flat, block_m, chunks)
    outs = []
    for on, counters in ((0, plan.split_counters), (1, plan.split_counters), (1, None)):
        monkeypatch.setattr(tk, "FUSED_MERGE", on)
        for _ in range(2):  # a second run on the same plan reads the counters the first one left
            out = torch.full_like(case["q"], float("nan"))
            dataclasses.replace(plan, split_counters=counters).run(case["q"], case["k_cache"], case["v_cache"],
                                                                   out=out, backend="triton")
            assert not plan.split_counters.any(), "the last split must reset its counter"
            outs.append(out)
    check_against_reference(outs[0], case)
    for out in outs[1:]:
        # The same merge arithmetic per row (the loop's unrolling may differ): equal up to one rounding of the output.
        torch.testing.assert_close(out.float(), outs[0].float(), atol=0, rtol=2 ** -7)


# (WIDE_MERGE_MIN_SPLITS, WIDE_MERGE_MAX_SPLITS): the walk over splits, the splits side by side in one trip, and
# side by side two at a time (several trips, the last one partly past the request's splits).
MERGE_FORMS = {"walk": (1 << 30, 64), "wide-one-trip": (2, 64), "wide-two-per-trip": (2, 2)}


@pytest.mark.triton
@pytest.mark.parametrize("name", list(MERGE_CASES))
def test_wide_merge_matches_the_split_walk(name, monkeypatch):
    """The merge kernel reading the splits side by side (``WIDE_MERGE_MIN_SPLITS``) gives the walk's rows, up to one
    rounding of the output (it sums the splits in another order), and the reference's."""
    _need_triton()
    (ctx, T, Hq, Hkv, D, bs, dtype, n), split, _ = MERGE_CASES[name]
    case = make_case(ctx, T, Hq, Hkv, D, bs, dtype, num_nodes=n, device=DEVICE)
    plan = make_plan(case, split_len=split)
    assert plan.num_splits > 1
    monkeypatch.setattr(tk, "FUSED_MERGE", 0)
    outs = {}
    for form, (min_splits, max_splits) in MERGE_FORMS.items():
        monkeypatch.setattr(tk, "WIDE_MERGE_MIN_SPLITS", min_splits)
        monkeypatch.setattr(tk, "WIDE_MERGE_MAX_SPLITS", max_splits)
        outs[form] = torch.full_like(case["q"], float("nan"))
        plan.run(case["q"], case["k_cache"], case["v_cache"], out=outs[form], backend="triton")
        check_against_reference(outs[form], case)
    for form in ("wide-one-trip", "wide-two-per-trip"):
        torch.testing.assert_close(outs[form].float(), outs["walk"].float(), atol=1e-5, rtol=2 ** -7)


def test_kernel_config_table_and_override(monkeypatch):
    """``kernel_config`` reads an optional ``maxnreg`` from the table and from a 5-element override."""
    block_m, chunks, block_n, warps, stages, maxnreg = tk.kernel_config(128, 112)
    assert (block_m, chunks) == (128, 1)
    entry = tk.PARTIAL_CONFIGS[(128, 128)]
    assert (block_n, warps, stages) == tuple(entry[:3]) and maxnreg == (entry[3] if len(entry) > 3 else None)
    monkeypatch.setattr(tk, "CONFIG_OVERRIDE", (32, 8, 4, None, 128))
    assert tk.kernel_config(128, 112) == (128, 1, 32, 8, 4, 128)
    monkeypatch.setattr(tk, "CONFIG_OVERRIDE", (64, 4, 3, 64))
    assert tk.kernel_config(128, 112) == (64, 2, 64, 4, 3, None)


@pytest.mark.triton
@pytest.mark.parametrize("cfg", [(32, 8, 4, None, 128), (32, 8, 5, None, 128), (32, 4, 3)])
def test_two_programs_per_sm_configs_match_reference(cfg, monkeypatch):
    """The 32-token-tile configs measured for T=16 (several whole tiles and a tail per split, 128-row tile)."""
    _need_triton()
    case, split = _case("d128-bm128-unaligned-splits")
    plan = make_plan(case, split_len=split)
    monkeypatch.setattr(tk, "CONFIG_OVERRIDE", cfg)
    out = torch.full_like(case["q"], float("nan"))
    plan.run(case["q"], case["k_cache"], case["v_cache"], out=out, backend="triton")
    check_against_reference(out, case)


# Checks for PARTIAL_KERNEL_SM90's `{checks}` (they see `c`, `regs`, `spills`, `smem` and the config's names).
_T16_CHECKS = """
waits = [int(x) for x in re.findall(r"async_wait.*?num = (\\d+)", c.asm["ttgir"])]
assert waits and max(waits) >= 2, f"K/V copies not kept in flight across the math: async_wait nums {waits}"
if maxnreg is not None:
    # The point of the cap: two programs of `warps` warps per SM (65536 registers, 228 KB shared memory).
    assert regs * 32 * warps * 2 <= 65536 and spills == 0, (regs, spills)
    assert 2 * (smem + 1024) <= 228 * 1024, smem
"""

_FP32_CHECKS = """
assert "wgmma" not in c.asm["ptx"] and "mma.sync" not in c.asm["ptx"], "fp32 products must not use tensor cores (TF32)"
assert smem <= 227 * 1024, smem
# A little over 256 at D=256 since the context loop carries its page-range flags (issue 26).
assert spills <= 288, f"{spills} bytes of register spills: shrink FP32_MAX_BLOCK_M / FP32_CONFIG"
"""


def test_t16_default_config_compiles_for_sm90_with_pipelined_loads():
    """The T=16 default (7B: D=128, T*G=112) compiles for sm_90 with K/V copies in flight across the math
    (``async_wait num >= 2``) and, when it caps registers, fits two programs per SM without spills (the
    premise of its speed)."""
    from conftest import compile_for_sm90

    compile_for_sm90(PARTIAL_KERNEL_SM90.format(D=128, T=16, G=7, fp32=False, kv=None, split=None, checks=_T16_CHECKS))


@pytest.mark.parametrize("D,T,G", [(64, 32, 4), (64, 1, 4), (128, 24, 3), (256, 16, 4)])
def test_fp32_config_compiles_for_sm90(D, T, G):
    """The exact-fp32 path (an fp32 model's verify pass: ``input_precision="ieee"``, no TF32) compiles for sm_90
    within the shared-memory limit and (nearly) without register spills at the e2e target's shape (D=64,
    T*G=128) and the other head dims."""
    from conftest import compile_for_sm90

    compile_for_sm90(PARTIAL_KERNEL_SM90.format(D=D, T=T, G=G, fp32=True, kv=None, split=None, checks=_FP32_CHECKS))


@pytest.mark.parametrize("kv,T,split", [("*fp8e4nv", 16, None), ("*fp8e5", 16, None), ("*fp8e4nv", 4, None),
                                        ("*fp8e4nv", 8, None), ("*fp8e5", 8, None), ("*fp8e4nv", 4, 4096),
                                        ("*fp8e4nv", 1, 4096)])
def test_fp8_cache_config_compiles_for_sm90(kv, T, split):
    """bf16 queries over fp8 (e4m3 / e5m2) caches: the partial kernel widens each V tile as loaded to fp16, and each K
    tile to fp16 against fp16-scaled rows where a KV head has at most FP16_KEYS_MAX_ROWS query rows, else to bf16,
    except over e4m3 at FP8_KEY_PRODUCT_TILES (T = 8: 56 rows in a 64-row tile; T = 16: 112 in a 128-row one), where
    K enters e4m3 products as stored; tensor-core products throughout, within the shared-memory limit and (nearly)
    without spills; also the 128-key tiles of long splits over e4m3 caches (``split``: the plan's split length,
    FP8_WIDE_TILE_CONFIGS)."""
    from conftest import compile_for_sm90

    checks = """
ptx = c.asm["ptx"]
assert "wgmma" in ptx or "mma.sync" in ptx, "products over fp8 caches must use tensor cores"
# A few bytes of spills at most: the T = 4 fp16-keys build spills 4 bytes under Triton 3.8 (none under 3.6); its
# 128-key tiles spill 128 bytes under Triton 3.6, and were measured faster than its 64-key tiles all the same.
assert smem <= 227 * 1024 and spills <= (256 if SPLIT else 16), (smem, spills)
if block_m <= 32:  # this test's long splits take 128-key tiles there, else 64
    assert (block_n == 128) == (SPLIT is not None), (SPLIT, block_n)
key_products = consts["FP8_KEY_PRODUCTS"]
assert key_products == (KV == "*fp8e4nv" and T in (8, 16)), (KV, T, block_m)
assert ("e4m3.e4m3" in ptx) == key_products, "e4m3 key products must reach the tensor cores as e4m3"
if KV == "*fp8e4nv":  # e4m3 K reaches bf16 through fp16 (fp16 -> bf16 conversions); fp16 keys and e4m3 products none
    widened_to_bf16 = T * G > m.FP16_KEYS_MAX_ROWS and not key_products
    assert ("cvt.bf16.f16" in ptx) == widened_to_bf16, (T * G, ptx.count("cvt.bf16.f16"))
"""
    compile_for_sm90(PARTIAL_KERNEL_SM90.format(D=128, T=T, G=7, fp32=False, kv=kv, split=split,
                                          checks=checks))
