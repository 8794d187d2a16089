"""CUDA tree attention: the paths the kernel rework added (direct write vs partials + merge, row
chunks made only of padding rows, non-power-of-two pages, the tuning variants, odd ``out`` views).

Reuses the case builder and checker of tests/ops/test_tree_attention_cuda.py (NaN-trapped pages,
poisoned scratch and output, per-split scratch check).
"""
from __future__ import annotations

import pytest
import torch

from conftest import HAS_CUDA, sm90_rule_spy
from test_tree_attention_cuda import check_case, make_case

pytestmark = pytest.mark.cuda

if HAS_CUDA:
    from tlt_kernels import cuda_extension_available


@pytest.fixture(autouse=True)
def _need_extension():
    if HAS_CUDA and not cuda_extension_available():
        pytest.skip("tlt_kernels._C is not built (pip install -e . with nvcc on PATH)")


def _with_nodes(c, nodes):
    c["num_nodes"] = torch.tensor(nodes, dtype=torch.int32, device="cuda")
    return c


# (B, T, Hkv, G, D, block_size, context lengths, num_nodes, dtype, split_len)
CASES = [
    # M = 448 rows in 4 chunks of 128; request 1 has 5 nodes (35 rows), so 3 of its chunks hold only
    # padding rows: zeros written by the chunk in the direct (one split) path ...
    (2, 64, 1, 7, 128, 16, [300, 200], [64, 5], torch.bfloat16, None),
    # ... and by the merge in the multi-split path (request 0 spans 3 splits, request 1 one).
    (2, 64, 1, 7, 128, 16, [700, 100], [64, 5], torch.bfloat16, 256),
    # Non-power-of-two pages (divide instead of shift), tails in every split, tree spanning 2 pages.
    (3, 20, 2, 4, 128, 24, [1000, 47, 0], [20, 13, 1], torch.float16, 320),
    (2, 33, 2, 7, 64, 3, [129, 64], [33, 2], torch.bfloat16, 64),
    # D=256 (32-token tiles): the tree of 40 nodes takes two tree tiles; 64 rows per CTA.
    (2, 40, 2, 1, 256, 16, [500, 1], [40, 31], torch.bfloat16, 128),
    # Context an exact multiple of the tile and of the split: no bounds-masked tile at all.
    (2, 16, 2, 7, 128, 16, [1024, 512], [16, 16], torch.bfloat16, 512),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}-T{c[1]}-G{c[3]}-D{c[4]}-bs{c[5]}-sl{c[9]}-n{c[7]}")
def test_paths_match_reference(case):
    B, T, Hkv, G, D, bs, ctx, nodes, dtype, split_len = case
    c = _with_nodes(make_case(B, T, Hkv, G, D, bs, ctx, dtype, seed=sum(ctx) + T + D + bs), nodes)
    check_case(f"extra {case}", c, dtype, split_len=split_len)


@pytest.mark.parametrize("config", [1, 2, 3, 4, 5, 6, 7])
@pytest.mark.parametrize("shape", [(2, 16, 7, [1500, 33], 512), (2, 64, 7, [900, 0], None), (3, 8, 7, [64, 65, 2], 64)])
def test_tuning_variants_match_reference(config, shape, monkeypatch):
    """Every kernel variant the benchmark sweep can force (bf16, D=128) computes the same thing."""
    from tlt_kernels._cuda import tree_attention as cuda_ta

    B, T, G, ctx, split_len = shape
    monkeypatch.setattr(cuda_ta, "CONFIG_OVERRIDE", config)
    c = make_case(B, T, 2, G, 128, 16, ctx, torch.bfloat16, seed=config + T)
    check_case(f"config {config} {shape}", c, torch.bfloat16, split_len=split_len)


def test_variant_rejected_for_other_shapes(monkeypatch):
    from tlt_kernels._cuda import tree_attention as cuda_ta

    monkeypatch.setattr(cuda_ta, "CONFIG_OVERRIDE", 2)
    c = make_case(1, 4, 1, 2, 64, 16, [10], torch.bfloat16, seed=5)
    with pytest.raises(ValueError, match="config 2 is a tuning variant of bf16 / head_dim 128 only"):
        check_case("bad config", c, torch.bfloat16)


def test_odd_out_view_goes_through_a_temporary():
    """An ``out`` view at an odd element offset cannot take the kernels' 4-byte stores; still correct."""
    from tlt_kernels.ops.tree_attention import plan_tree_attention
    from tlt_kernels.reference.tree_attention import tree_attention_reference

    c = make_case(2, 5, 1, 2, 64, 16, [40, 3], torch.float16, seed=9)
    B, T, Hq, D = c["q"].shape
    flat = torch.full((B * T * Hq * D + 1,), float("nan"), dtype=torch.float16, device="cuda")
    out = flat[1:].view(B, T, Hq, D)
    assert out.data_ptr() % 4 != 0
    plan = plan_tree_attention(c["parents"], c["context_lens"], c["block_table"], c["num_nodes"],
                               num_q_heads=Hq, num_kv_heads=1, head_dim=D, block_size=16)
    plan.run(c["q"], c["k_cache"], c["v_cache"], out=out, backend="cuda")
    ref = tree_attention_reference(c["q"], c["k_cache"], c["v_cache"], c["block_table"], c["context_lens"],
                                   c["parents"], c["num_nodes"], out_dtype=torch.float32)
    torch.testing.assert_close(out.float(), ref, atol=4e-3, rtol=4e-3)


# The sm_90 wgmma path (csrc/tree_attention/tree_attention_ctx_sm90.cu), forced on: (B, T, Hkv, G, block_size,
# context lengths, dtype, split_len, combined_kv). D = 128 (the kernel's only head dim); ragged num_nodes (padding rows) in every case.
SM90_CASES = [
    # 7B-like rows (112 of 128), one split, a tail, an empty context, a context of one tile plus two tokens.
    (3, 16, 2, 7, 16, [4100, 0, 130], torch.bfloat16, None, False),
    # Several splits (the merge), 32-token pages, a request with one split beside two with more.
    (3, 16, 2, 7, 32, [700, 257, 1], torch.float16, 256, False),
    # 64 nodes x G=2 = 128 rows: the ancestor bits span both mask words; one-token pages.
    (2, 64, 1, 2, 1, [300, 129], torch.bfloat16, 128, False),
    # 117 rows; 128-token pages.
    (2, 9, 2, 13, 128, [1000, 5], torch.bfloat16, None, False),
    # Contexts shorter than a tile: every tile masked (no whole context tile).
    (4, 10, 4, 7, 16, [0, 0, 64, 127], torch.float16, None, False),
    # vLLM-style interleaved K/V storage (strided cache views), several splits.
    (2, 16, 2, 7, 16, [513, 300], torch.bfloat16, 128, True),
    # A single node (7 rows: one warpgroup of padding).
    (2, 1, 2, 7, 16, [2000, 1], torch.bfloat16, None, False),
    # More CTAs (B * Hkv * S) than SMs, of every kind (one split written directly, several splits, empty and
    # one-token contexts), several per SM.
    (70, 12, 2, 7, 16, [(37 * i) % 700 for i in range(70)], torch.bfloat16, 256, False),
    # T*G <= 64 (the one-warpgroup kernel at block 64, Q in registers, two CTAs per SM): 7B-like T=8 (56 rows) with
    # a tail, an empty context and a one-tile-plus-two context; 64 nodes x G=1 (both mask words, one-token pages);
    # exactly 64 rows of interleaved K/V over several splits; many CTAs with several splits.
    (3, 8, 2, 7, 16, [4100, 0, 130], torch.bfloat16, None, False),
    (2, 64, 1, 1, 1, [300, 129], torch.float16, 128, False),
    (2, 16, 2, 4, 32, [700, 257], torch.float16, 256, True),
    (70, 8, 2, 7, 16, [(53 * i) % 900 for i in range(70)], torch.bfloat16, 256, False),
]


@pytest.mark.parametrize("block", [128, 64, "128-ws", "128-ws-tma"])
@pytest.mark.parametrize("case", SM90_CASES,
                         ids=lambda c: f"B{c[0]}-T{c[1]}-Hkv{c[2]}-G{c[3]}-bs{c[4]}-{str(c[6])[6:]}-sl{c[7]}-kv{int(c[8])}")
def test_sm90_path_matches_reference(case, block, monkeypatch):
    """tree_attention(backend="cuda") through the sm_90 kernel at each tile width: the tree's tiles, the context tail,
    direct writes and the partial slots the merge reads, against the reference (NaN-trapped pages, poisoned
    scratch and output, per-split scratch check). Block 64 is the one-warpgroup kernel (one CTA per 64-row chunk where
    T*G > 64); block 128 the two-warpgroup one (padding rows where T*G <= 64); 128-ws its warp-specialized build
    (a producer warpgroup, two ping-ponging consumers)."""
    used = sm90_rule_spy(monkeypatch, True)
    from tlt_kernels._cuda import tree_attention as cuda_ta

    B, T, Hkv, G, bs, ctx, dtype, split_len, combined = case
    warp_specialized = block in ("128-ws", "128-ws-tma")
    # TMA copies where the pages allow them (>= 16 tokens; smaller pages keep cp.async in the same build).
    monkeypatch.setattr(cuda_ta, "CONTEXT_TMA", block == "128-ws-tma")
    block = 128 if warp_specialized else block
    monkeypatch.setattr(cuda_ta, "CONTEXT_WARP_SPECIALIZED", warp_specialized)
    if warp_specialized:
        tma_flag = cuda_ta.TMA_FLAG if cuda_ta.CONTEXT_TMA else 0
        assert cuda_ta.context_config(65) == 128 | cuda_ta.WARP_SPECIALIZED_FLAG | tma_flag
    if split_len is None and (block == 64 or T * G <= 64):  # the planner aligns other splits to 128 tokens itself
        split_len = block * max(1, -(-max(ctx) // block))  # one split of whole tiles
    monkeypatch.setattr(cuda_ta, "CONTEXT_BLOCK", block)
    monkeypatch.setattr(cuda_ta, "CONTEXT_BLOCK_FEW_ROWS", block)
    c = make_case(B, T, Hkv, G, 128, bs, ctx, dtype, seed=sum(ctx) + T + bs + block, combined_kv=combined)
    check_case(f"sm90 block {block} {case}", c, dtype, split_len=split_len)
    assert used and all(used), "the sm_90 kernel was not used"


# Wide trees (T * G > 128) through the warp-specialized kernel, one CTA per 128-row block:
# (B, T, Hkv, G, block_size, context lengths, num_nodes, dtype, split_len)
WIDE_CASES = [
    # 448 rows: 3.5 blocks (the last half padding); request 1's 5 nodes (35 rows) leave 3 blocks of padding only.
    (2, 64, 1, 7, 16, [300, 200], [64, 5], torch.bfloat16, None),
    # 512 rows, exactly 4 blocks; several splits (the merge), request 1 in one split.
    (2, 64, 2, 8, 16, [700, 100], [64, 33], torch.float16, 256),
    # 224 rows (7B at T=32): an empty context, a one-node tree, 32-token pages, 128-token splits.
    (3, 32, 2, 7, 32, [1000, 0, 129], [32, 1, 17], torch.bfloat16, 128),
    # 160 rows (32B heads at T=32), whole tiles only, one split.
    (2, 32, 2, 5, 16, [1024, 2048], [32, 32], torch.bfloat16, None),
]


@pytest.mark.parametrize("tma", [None, False], ids=["auto-tma", "cp-async"])
@pytest.mark.parametrize("case", WIDE_CASES, ids=lambda c: f"B{c[0]}-T{c[1]}-Hkv{c[2]}-G{c[3]}-bs{c[4]}-n{c[6]}-sl{c[8]}")
def test_sm90_warp_specialized_wide_trees(case, tma, monkeypatch):
    """T * G > 128 rows: the warp-specialized kernel in 128-row blocks (the blocks of one split adjacent in the grid),
    its whole context tiles by TMA (the auto rule's choice here) or by cp.async, direct writes and partial slots, rows
    of padding-only blocks, against the reference (NaN-trapped pages, poisoned scratch and output)."""
    from tlt_kernels._cuda import tree_attention as cuda_ta

    used = sm90_rule_spy(monkeypatch, None)  # the auto rule takes these rows
    monkeypatch.setattr(cuda_ta, "CONTEXT_WARP_SPECIALIZED", True)
    monkeypatch.setattr(cuda_ta, "CONTEXT_TMA", tma)
    B, T, Hkv, G, bs, ctx, nodes, dtype, split_len = case
    flags = cuda_ta.WARP_SPECIALIZED_FLAG | (cuda_ta.TMA_FLAG if tma is None else 0)
    assert T * G > cuda_ta.CONTEXT_SM90_MAX_ROWS and cuda_ta.context_config(T * G) == 128 | flags
    c = _with_nodes(make_case(B, T, Hkv, G, 128, bs, ctx, dtype, seed=sum(ctx) + T * G + bs), nodes)
    check_case(f"wide {case}", c, dtype, split_len=split_len)
    assert used and all(used), "the sm_90 kernel was not used"


def test_sm90_warp_specialized_empty_request_writes_zeros(monkeypatch):
    """num_nodes = 0 on an empty context breaks the plan's contract (planning refuses it), but a CUDA graph replayed
    with such a row validates nothing: the warp-specialized kernel must not wait for a tile nobody copies. That
    request's rows become zeros; the others match the reference."""
    from tlt_kernels._cuda import tree_attention as cuda_ta
    from tlt_kernels.reference.tree_attention import tree_attention_reference

    used = sm90_rule_spy(monkeypatch, True)
    monkeypatch.setattr(cuda_ta, "CONTEXT_WARP_SPECIALIZED", True)
    c = make_case(3, 16, 2, 7, 128, 16, [0, 700, 300], torch.bfloat16, seed=21)
    plan = plan_for(c)
    plan.num_nodes[0] = 0  # after planning, as a replayed graph's input buffer would be changed
    q = c["q"]
    out = torch.full_like(q, float("nan"))
    plan.run(q, c["k_cache"], c["v_cache"], out=out, backend="cuda")
    torch.cuda.synchronize()
    assert used == [True]
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    ref = tree_attention_reference(q[1:], c["k_cache"], c["v_cache"], c["block_table"][1:], c["context_lens"][1:],
                                   c["parents"][1:], c["num_nodes"][1:], out_dtype=torch.float32)
    torch.testing.assert_close(out[1:].float(), ref, atol=2e-2, rtol=2e-2)


def test_sm90_path_by_default_with_several_splits(monkeypatch):
    """The default rule (auto) takes the sm_90 kernel for a plan the planner splits several ways (a small batch of
    long contexts, 112 rows): its splits are whole 128-token tiles, and the result is right."""
    used = sm90_rule_spy(monkeypatch, None)
    from tlt_kernels._cuda import tree_attention as cuda_ta

    c = make_case(2, 16, 2, 7, 128, 16, [3000, 5000], torch.bfloat16, seed=13)
    plan = plan_for(c)
    assert plan.num_splits > 1 and plan.split_len % cuda_ta.CONTEXT_BLOCK == 0, (plan.num_splits, plan.split_len)
    check_case("sm90 auto, several splits", c, torch.bfloat16)
    assert used == [True]


def test_sm90_path_not_taken_for_other_pages(monkeypatch):
    """Pages the sm_90 kernel cannot address (a non-power-of-two block_size) go to the mma.sync kernel even with the
    path forced on, and the result is still right."""
    used = sm90_rule_spy(monkeypatch, True)
    c = make_case(3, 16, 2, 7, 128, 24, [700, 257, 1], torch.float16, seed=11)
    check_case("sm90 forced, 24-token pages", c, torch.float16, split_len=256)
    assert used == [False]


def test_sm90_kernel_rejects_what_it_does_not_cover():
    """The launcher's own checks (the Python side never sends these): a tile width that is not 64 or 128, a split
    length that is not a whole number of tiles, pages that are not a power of two."""
    from tlt_kernels._cuda import extension, tree_attention as cuda_ta

    c = make_case(1, 4, 1, 2, 128, 16, [300], torch.bfloat16, seed=3)
    plan = plan_for(c, split_len=192)
    args = cuda_ta._launch_args(plan, c["q"], c["k_cache"], c["v_cache"], torch.empty_like(c["q"]), 0.1)
    args["stream"] = torch.cuda.current_stream().cuda_stream
    with pytest.raises(ValueError, match="config is its tile width"):
        extension().tree_attention_sm90(**{**args, "config": 32})
    with pytest.raises(ValueError, match="config is its tile width"):  # warp-specialized: 128-token tiles only
        extension().tree_attention_sm90(**{**args, "config": 64 | cuda_ta.WARP_SPECIALIZED_FLAG})
    with pytest.raises(ValueError, match="split_len must be a positive multiple of the sm_90 kernel's tile width 128"):
        extension().tree_attention_sm90(**{**args, "config": 128})
    with pytest.raises(ValueError, match="power-of-two block_size, got 24"):
        extension().tree_attention_sm90(**{**args, "config": 64, "block_size": 24})


def plan_for(c, **kw):
    from tlt_kernels.ops.tree_attention import plan_tree_attention

    B, T, Hq, D = c["q"].shape
    return plan_tree_attention(c["parents"], c["context_lens"], c["block_table"], c["num_nodes"], num_q_heads=Hq,
                               num_kv_heads=c["k_cache"].shape[2], head_dim=D, block_size=c["k_cache"].shape[1], **kw)


def test_device_memory_bandwidth_query_is_plausible():
    """The auto TMA rule's driver query: a peak bandwidth in the range of real cards (0.5-20 TB/s), the same on every
    call, and has_fast_memory agreeing with the threshold."""
    from tlt_kernels._cuda import tree_attention as ct

    gbps = ct.extension().device_memory_bandwidth_gbps(0)
    assert 500.0 < gbps < 20000.0, gbps
    assert ct.extension().device_memory_bandwidth_gbps(0) == gbps
    assert ct.has_fast_memory(0) == (gbps >= ct.TMA_MIN_BANDWIDTH_GBPS)


def test_auto_tma_follows_the_card_at_t16(monkeypatch):
    """The auto rule at T*G <= 128 (7B heads at T=16): TMA copies exactly where the card has fast memory
    (has_fast_memory), and the output matches the reference either way."""
    from tlt_kernels._cuda import tree_attention as cuda_ta

    used = sm90_rule_spy(monkeypatch, None)
    monkeypatch.setattr(cuda_ta, "CONTEXT_WARP_SPECIALIZED", True)
    monkeypatch.setattr(cuda_ta, "CONTEXT_TMA", None)
    configs = []
    real = cuda_ta.context_config
    monkeypatch.setattr(cuda_ta, "context_config",
                        lambda rows, fast_memory=False, fp8=False: configs.append(real(rows, fast_memory, fp8)) or configs[-1])
    c = make_case(2, 16, 2, 7, 128, 16, [700, 300], torch.bfloat16, seed=5)
    check_case("auto tma at T=16", c, torch.bfloat16)
    fast = cuda_ta.has_fast_memory(torch.cuda.current_device())
    assert configs and all(bool(cfg & cuda_ta.TMA_FLAG) == fast for cfg in configs), (configs, fast)
    assert used and all(used), "the sm_90 kernel was not used"
