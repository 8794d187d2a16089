"""Triton tree attention over e4m3 caches with e4m3 key products (``FP8_KEY_PRODUCT_TILES``): the bf16 rows split
into two e4m3 parts ``hi + lo`` (``_query_as_fp8_pair``) and the keys enter the tensor-core products as stored.

Checked: (1) the split itself, on random bf16 blocks of every magnitude: ``(hi + lo) * 2^s`` is the value exactly for
every component within ``2^9`` of the block's largest, within ``2^-10`` of the scaled largest below, non-finite
components become NaN; (2) the kernel on the tiles that use it (D = 128, 64-row tiles: T = 8 and chunked T = 20 at
G = 7, one split and several; the 128-row tile of T = 16; 16/32-row tiles added to the rule) against the same kernel
over the caches' exact bf16 widening (a few output ulps) and against the fp32 reference (no further than the widening's own error
plus an ulp); (3) a row with an inf component comes out NaN, the others as before; (4) the rule: bf16 rows, e4m3 caches,
the listed tiles only; property tests over random problems in the rule's tiles and in 16/32-row tiles added to it,
with scales; (5) the 128-key tiles of the small row tiles over e4m3 caches with long splits (``FP8_WIDE_TILE_CONFIGS``):
picked by split length, and the same attention as the 64-key tiles over the widened caches."""
from unittest import mock

import pytest
import torch
import triton
import triton.language as tl
from conftest import kernel_devices, need_backend, poison_
from hypothesis import example, given
from hypothesis import strategies as st
from strategies import backend_params, budget, seeds
from test_tree_attention import make_case, make_plan

from tlt_kernels._triton import tree_attention as tk
from tlt_kernels._backend import triton_interpret_enabled
from tlt_kernels.ops.tree_attention import run
from tlt_kernels.reference.tree_attention import tree_attention_reference

DEVICE = torch.device(kernel_devices()[0])
# (ctx_lens, T, Hq, Hkv, D, num_nodes, split_len): 56 rows in one 64-row tile; 140 rows in three 64-row chunks; 112
# rows in one 128-row tile.
CASES = {
    "T8-G7-one-split": ([37, 150, 0], 8, 14, 2, 128, [8, 3, 8], None),
    "T20-G7-splits": ([200, 9], 20, 7, 1, 128, [20, 13], 64),
    "T16-G7-splits": ([90, 0, 131], 16, 7, 1, 128, [16, 5, 11], 64),
}
# Row tiles below 64 rows (7 rows in a 16-row tile, 28 in a 32-row one): not in the rule (measured slower there), so
# the tests add their tile to it (the products are mma.sync there), keeping the path right for a retune on another card.
SMALL_TILE_CASES = {
    "T1-G7-splits": ([300, 77, 0], 1, 14, 2, 128, [1, 1, 1], 64),
    "T4-G7-one-split": ([150, 37], 4, 7, 1, 128, [4, 2], None),
}


@triton.jit
def _split_kernel(Q_ptr, Hi_ptr, Lo_ptr, Up_ptr, BLOCK_M: tl.constexpr, D: tl.constexpr, INTERPRET: tl.constexpr):
    offs = tl.arange(0, BLOCK_M)[:, None] * D + tl.arange(0, D)[None, :]
    hi, lo, up = tk._query_as_fp8_pair(tl.load(Q_ptr + offs).to(tl.float32), 1.0, INTERPRET)
    tl.store(Hi_ptr + offs, hi.to(tl.float32))
    tl.store(Lo_ptr + offs, lo.to(tl.float32))
    tl.store(Up_ptr, up)


def _split(q: torch.Tensor):
    """``(hi, lo, 2^s)`` of the bf16 block ``q [M, D]`` as fp32, through the kernel's own helper."""
    hi, lo = torch.empty(q.shape, dtype=torch.float32, device=q.device), torch.empty(q.shape, device=q.device)
    up = torch.empty(1, device=q.device)
    _split_kernel[(1,)](q, poison_(hi), poison_(lo), up, BLOCK_M=q.shape[0], D=q.shape[1],
                        INTERPRET=triton_interpret_enabled())
    return hi, lo, up.item()


@pytest.mark.triton
@budget(20)
@given(seed=seeds, magnitude=st.integers(-120, 120), spread=st.integers(0, 40))
@example(seed=399996, magnitude=-120, spread=5)  # the block's largest below 2^-119: the scale stops at 2^-126
@example(seed=7, magnitude=-124, spread=2)
def test_query_split_is_exact_within_its_range(seed, magnitude, spread):
    """``(hi + lo) * 2^s`` equals each bf16 component whose scaled value is at least ``2^-2`` (its last bit then is at
    least ``lo``'s subnormal step, ``2^-9``), which is every component within ``2^9`` of the block's largest finite one
    when that one lands in ``[2^7, 2^8)``; the smaller ones are missed by at most ``2^-10`` of the scale; both parts are
    e4m3 values. The scale ``2^s`` stays a normal fp32 value: a block whose largest is below ``2^-119`` is scaled by
    ``2^-126`` and lands lower. Normal bf16 components (below ``2^-126``, zeros here: the CPU interpreter does not keep
    subnormal inputs)."""
    need_backend("tree_attention", "triton", DEVICE)
    gen = torch.Generator().manual_seed(seed)
    exponents = torch.randint(-spread, 1, (16, 32), generator=gen).float() + magnitude
    q = torch.randn(16, 32, generator=gen) * torch.exp2(exponents)
    q = torch.where(q.abs() < 2.0**-126, 0.0, q).to(torch.bfloat16)
    hi, lo, up = _split(q.to(DEVICE))
    hi, lo, exact = hi.cpu().double(), lo.cpu().double(), q.double()
    for part in (hi, lo):
        assert torch.equal(part.to(torch.float8_e4m3fn).double(), part)  # e4m3 values
    amax = exact.abs().max()
    assert 2.0**7 <= amax / up < 2.0**8 or amax == 0 or (up == 2.0**-126 and amax / up < 2.0**7)
    big = exact.abs() / up >= 2.0**-2
    assert torch.equal(((hi + lo) * up)[big], exact[big])
    assert ((hi + lo) * up - exact).abs().max() <= 2.0**-10 * up


@pytest.mark.triton
def test_query_split_turns_non_finite_components_into_nan():
    need_backend("tree_attention", "triton", DEVICE)
    q = torch.randn(16, 32).to(torch.bfloat16)
    q[3, 5], q[7, 0], q[9, 9] = float("inf"), float("-inf"), float("nan")
    hi, lo, up = _split(q.to(DEVICE))
    bad = ~q.isfinite()
    assert hi.cpu()[bad].isnan().all() and hi.cpu()[~bad].isfinite().all()
    assert 2.0**7 <= q[~bad].float().abs().max() / up < 2.0**8  # the largest finite component sets the scale


def _outputs(name, cases=CASES):
    """The case's e4m3 caches through the key products, the same kernel over their bf16 widening, the fp32 reference
    over the dequantized caches, and the case."""
    ctx, T, Hq, Hkv, D, n, split_len = cases[name]
    case = make_case(ctx, T, Hq, Hkv, D, 16, torch.bfloat16, ("random",), n)
    k8, v8 = case["k_cache"].to(torch.float8_e4m3fn), case["v_cache"].to(torch.float8_e4m3fn)
    block_m = tk.kernel_config(D, T * (Hq // Hkv))[0]
    assert tk.uses_fp8_key_products(torch.bfloat16, torch.float8_e4m3fn, D, block_m), "the case must use them"
    plan = make_plan(case, split_len=split_len)
    got = run(plan, case["q"], k8, v8, out=poison_(torch.empty_like(case["q"])), backend="triton")
    wide = run(plan, case["q"], k8.to(torch.bfloat16), v8.to(torch.bfloat16), backend="triton")
    want = tree_attention_reference(**{**case, "q": case["q"].float(), "k_cache": k8.float(),
                                       "v_cache": v8.float()}, out_dtype=torch.float32)
    return got, wide, want, {**case, "k_cache": k8, "v_cache": v8}, plan


@pytest.mark.triton
@pytest.mark.parametrize("name", list(CASES) + list(SMALL_TILE_CASES))
def test_key_products_match_the_widened_keys(name, monkeypatch):
    """The same attention as the kernel over the exactly widened caches: a few output ulps apart (the products sum
    the same terms in another order), and no further from the fp32 reference than it plus an ulp; below 64 rows with
    the tile added to the rule."""
    need_backend("tree_attention", "triton", DEVICE)
    if name in SMALL_TILE_CASES:
        _, T, Hq, Hkv, D, _, _ = SMALL_TILE_CASES[name]
        tile = (D, tk.kernel_config(D, T * (Hq // Hkv))[0])
        assert tile[1] < 64
        monkeypatch.setattr(tk, "FP8_KEY_PRODUCT_TILES", tk.FP8_KEY_PRODUCT_TILES | {tile})
    got, wide, want, _, _ = _outputs(name, {**CASES, **SMALL_TILE_CASES})
    assert not got.isnan().any()
    ulp = torch.finfo(torch.bfloat16).eps * want.abs().max().item()
    torch.testing.assert_close(got.float(), wide.float(), rtol=0, atol=4 * ulp)
    assert (got.float() - want).abs().max() <= (wide.float() - want).abs().max() + ulp


@pytest.mark.triton
def test_key_products_nan_row_for_an_inf_query_component():
    """A query row with an inf component comes out NaN (as over widened keys: its scores are +-inf or NaN); the rows
    of the other heads and nodes keep their values."""
    need_backend("tree_attention", "triton", DEVICE)
    _, _, _, case, plan = _outputs("T8-G7-one-split")
    q = case["q"].clone()
    q[0, 2, 3, 17] = float("inf")
    got = run(plan, q, case["k_cache"], case["v_cache"], backend="triton")
    wide = run(plan, q, case["k_cache"].to(torch.bfloat16), case["v_cache"].to(torch.bfloat16), backend="triton")
    assert got[0, 2, 3].isnan().all() and wide[0, 2, 3].isnan().all()
    keep = torch.ones_like(got, dtype=torch.bool)
    keep[0, 2, 3] = False
    ulp = torch.finfo(torch.bfloat16).eps * wide[keep].float().abs().max().item()
    torch.testing.assert_close(got[keep].float(), wide[keep].float(), rtol=0, atol=4 * ulp)


def test_key_products_rule():
    """bf16 rows over e4m3 caches at the listed (head dim, row tile) only: an fp16 value is not the sum of two e4m3
    parts, and e5m2 keys would pair an e4m3 row with an e5m2 key."""
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    for D, block_m in tk.FP8_KEY_PRODUCT_TILES:
        assert tk.uses_fp8_key_products(torch.bfloat16, e4m3, D, block_m)
        assert not tk.uses_fp8_key_products(torch.float16, e4m3, D, block_m)
        assert not tk.uses_fp8_key_products(torch.bfloat16, e5m2, D, block_m)
        assert not tk.uses_fp8_key_products(torch.bfloat16, torch.bfloat16, D, block_m)
    assert not tk.uses_fp8_key_products(torch.bfloat16, e4m3, 128, 16)  # mma.sync tiles: measured slower


@pytest.mark.triton
def test_wide_key_tiles_for_long_splits_match_the_widened_caches():
    """14 rows (a 16-row tile) over e4m3 caches with splits of FP8_WIDE_TILE_MIN_SPLIT tokens take 128-key tiles (two
    splits, whole tiles and a masked tail); the output is the widened caches' (64-key tiles) within a few ulps, as
    close to the fp32 reference; with shorter splits the tile stays at 64 keys."""
    need_backend("tree_attention", "triton", DEVICE)
    case = make_case([tk.FP8_WIDE_TILE_MIN_SPLIT + 104, 30], 2, 14, 2, 128, 16, torch.bfloat16, ("random",), [2, 1])
    k8, v8 = case["k_cache"].to(torch.float8_e4m3fn), case["v_cache"].to(torch.float8_e4m3fn)
    assert tk.kernel_config(128, 14, e4m3_split_len=tk.FP8_WIDE_TILE_MIN_SPLIT)[2] == 128
    assert tk.kernel_config(128, 14, e4m3_split_len=tk.FP8_WIDE_TILE_MIN_SPLIT - 64)[2] == 64
    assert tk.kernel_config(128, 14)[2] == 64  # caches of q's dtype
    plan = make_plan(case, split_len=tk.FP8_WIDE_TILE_MIN_SPLIT)
    assert plan.num_splits == 2
    got = run(plan, case["q"], k8, v8, out=poison_(torch.empty_like(case["q"])), backend="triton")
    wide = run(plan, case["q"], k8.to(torch.bfloat16), v8.to(torch.bfloat16), backend="triton")
    want = tree_attention_reference(**{**case, "q": case["q"].float(), "k_cache": k8.float(), "v_cache": v8.float()},
                                    out_dtype=torch.float32)
    ulp = torch.finfo(torch.bfloat16).eps * want.abs().max().item()
    torch.testing.assert_close(got.float(), wide.float(), rtol=0, atol=4 * ulp)
    assert (got.float() - want).abs().max() <= (wide.float() - want).abs().max() + ulp


@pytest.mark.triton
def test_key_products_with_scales_match_the_dequantized_reference():
    """``k_scale`` folds into the softmax scale beside the rows' power of two, ``v_scale`` into each output row: the
    output is attention over ``cache * scale`` (fp32 reference), as close as over the widened caches with the same
    scales."""
    need_backend("tree_attention", "triton", DEVICE)
    _, _, _, case, plan = _outputs("T20-G7-splits")
    k8, v8 = case["k_cache"], case["v_cache"]
    got = run(plan, case["q"], k8, v8, backend="triton", k_scale=0.375, v_scale=3.0)
    wide = run(plan, case["q"], k8.to(torch.bfloat16), v8.to(torch.bfloat16), backend="triton", k_scale=0.375,
               v_scale=3.0)
    want = tree_attention_reference(**{**case, "q": case["q"].float(), "k_cache": k8.float() * 0.375,
                                       "v_cache": v8.float() * 3.0}, out_dtype=torch.float32)
    ulp = torch.finfo(torch.bfloat16).eps * want.abs().max().item()
    assert (got.float() - want).abs().max() <= (wide.float() - want).abs().max() + ulp
    torch.testing.assert_close(got.float(), wide.float(), rtol=0, atol=4 * ulp)


_PROBLEMS = dict(seed=seeds, bs=st.sampled_from([1, 16]), ctx=st.lists(st.integers(0, 150), min_size=1, max_size=3),
                 k_scale=st.sampled_from([0.05, 1.0, 7.5]), v_scale=st.sampled_from([0.125, 1.0]),
                 split_len=st.sampled_from([None, 64]))


def _check_key_products(backend, seed, T, bs, ctx, k_scale, v_scale, split_len):
    """One problem with 7 query heads per KV head at D = 128 whose row tile takes key products: the output is the
    widened caches' within a few ulps, and the fp32 reference's over ``cache * scale`` within bf16 rounding."""
    assert tk.uses_fp8_key_products(torch.bfloat16, torch.float8_e4m3fn, 128, tk.kernel_config(128, 7 * T)[0])
    case = make_case(ctx, T, 7, 1, 128, bs, torch.bfloat16, ("random", "chain"), seed=seed, device="cpu")
    k8 = (case["k_cache"].float() / k_scale).to(torch.float8_e4m3fn)
    v8 = (case["v_cache"].float() / v_scale).to(torch.float8_e4m3fn)
    plan = make_plan(case, split_len=split_len)
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    got = run(plan, case["q"], k8, v8, out=poison_(torch.empty_like(case["q"])), backend=backend, **scales)
    wide = run(plan, case["q"], k8.to(torch.bfloat16), v8.to(torch.bfloat16), backend=backend, **scales)
    want = tree_attention_reference(**{**case, "q": case["q"].float(), "k_cache": k8.float() * k_scale,
                                       "v_cache": v8.float() * v_scale}, out_dtype=torch.float32)
    ulp = torch.finfo(torch.bfloat16).eps * max(want.abs().max().item(), 1e-30)
    torch.testing.assert_close(got.float(), wide.float(), rtol=0, atol=4 * ulp)
    torch.testing.assert_close(got.float(), want, atol=2e-2 * v_scale, rtol=2e-2)


@pytest.mark.parametrize("backend", backend_params(["triton"]))
@budget(10)
@given(T=st.integers(5, 18), **_PROBLEMS)
def test_property_key_products_are_attention_over_cache_times_scale(backend, seed, T, bs, ctx, k_scale, v_scale,
                                                                    split_len):
    """Any small problem in the key products' tiles (35-126 rows of one KV head at D = 128: 64- and 128-row tiles,
    ragged contexts, empty ones, page sizes, one split or several, scales): ``_check_key_products``."""
    _check_key_products(backend, seed, T, bs, ctx, k_scale, v_scale, split_len)


@pytest.mark.parametrize("backend", backend_params(["triton"]))
@budget(10)
@given(T=st.integers(1, 4), **_PROBLEMS)
def test_property_small_tile_key_products_are_attention_over_cache_times_scale(backend, seed, T, bs, ctx, k_scale,
                                                                               v_scale, split_len):
    """The same below 64 rows (7-28 rows: 16/32-row tiles), with the tile added to the rule."""
    tile = (128, tk.kernel_config(128, 7 * T)[0])
    with mock.patch.object(tk, "FP8_KEY_PRODUCT_TILES", tk.FP8_KEY_PRODUCT_TILES | {tile}):
        _check_key_products(backend, seed, T, bs, ctx, k_scale, v_scale, split_len)
