"""Tree attention over fp8 (e4m3 / e5m2) K/V caches with per-tensor dequantization scales.

The caches hold ``K / k_scale`` and ``V / v_scale`` in fp8; every backend that reads them must compute attention over
``cache * scale``. Checked: (1) at scales 1 an fp8 cache gives exactly what its bf16/fp16 widening gives (the widening
is exact, and both paths then run the same arithmetic), bit for bit (compiled Triton: within a few output ulps, see
the test); (2) with scales, the output
against a float32 reference over the dequantized caches; (3) "auto" skips the CUDA backend for them (its kernels widen
them in shared memory, slower than triton's), an explicit "cuda" runs them (the CUDA-only checks at the end: every
kernel shape, every finite code through the sm_90 kernels, the NaN contract, v_scale on every sm_90 build, the
launchers' refusals); (4) bad scales are refused, naming the argument."""
import math

import pytest
import torch
from conftest import agreement_backends, kernel_devices, need_backend, poison_
from hypothesis import given
from hypothesis import strategies as st
from strategies import backend_params, budget, seeds

from test_tree_attention import make_case, make_plan

import tlt_kernels
from tlt_kernels._cuda.tree_attention import forced_switches, runs_warp_specialized
from tlt_kernels.ops.tree_attention import AUTO_CUDA, FP8_DTYPES, _choose_backend, run
from tlt_kernels.reference.tree_attention import tree_attention_reference

DEVICE = torch.device(kernel_devices()[0])
# (ctx_lens, T, Hq, Hkv, D, block_size, q dtype, tree kinds, num_nodes, split_len): one split, and splits + merge.
CASES = {
    "gqa2-bs16": ([37, 5, 0], 6, 4, 2, 64, 16, torch.bfloat16, ("random",), [6, 2, 6], None),
    "splits-fp16": ([150, 3], 9, 6, 2, 64, 8, torch.float16, ("binary", "chain"), None, 64),
}


def quantized(case, fp8, k_scale, v_scale):
    """The case with its caches stored as ``fp8(cache / scale)``, and the dequantized fp32 caches they stand for."""
    k8 = (case["k_cache"].float() / k_scale).to(fp8)
    v8 = (case["v_cache"].float() / v_scale).to(fp8)
    return {**case, "k_cache": k8, "v_cache": v8}, k8.float() * k_scale, v8.float() * v_scale


@pytest.mark.parametrize("backend", agreement_backends())
@pytest.mark.parametrize("fp8", FP8_DTYPES, ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_fp8_cache_equals_its_exact_widening(backend, fp8, name):
    """Scales 1: an fp8 cache and the same values widened to q's dtype give the same output, bit for bit."""
    need_backend("tree_attention", backend, DEVICE)
    ctx, T, Hq, Hkv, D, bs, dtype, kinds, n, split_len = CASES[name]
    case, _, _ = quantized(make_case(ctx, T, Hq, Hkv, D, bs, dtype, kinds, n), fp8, 1.0, 1.0)
    plan = make_plan(case, split_len=split_len)
    out8 = run(plan, case["q"], case["k_cache"], case["v_cache"], out=poison_(torch.empty_like(case["q"])),
               backend=backend)
    wide = run(plan, case["q"], case["k_cache"].to(dtype), case["v_cache"].to(dtype), backend=backend)
    assert not out8.isnan().any()
    if backend == "triton" and DEVICE.type == "cuda":
        # Compiled, an fp8 tile widens in registers and may feed a different tensor-core instruction than a tile
        # loaded straight to shared memory, and P V runs in fp16 over fp8 V (P rounds to fp16, not bf16), so fp32 sums
        # can differ in their last bits: a few output ulps, no more.
        eps = torch.finfo(dtype).eps
        torch.testing.assert_close(out8, wide, rtol=4 * eps, atol=4 * eps * wide.abs().max().item())
    else:
        assert torch.equal(out8, wide)


@pytest.mark.parametrize("backend", agreement_backends())
@pytest.mark.parametrize("fp8", FP8_DTYPES, ids=str)
@pytest.mark.parametrize("scales", [(0.5, 2.0), (3.0, 0.25)])
def test_scaled_fp8_cache_matches_the_dequantized_reference(backend, fp8, scales):
    """With scales, the output is attention over ``cache * scale`` (fp32 reference on the dequantized caches) within
    the output dtype's rounding; a wrong or missing scale would be off by the attention output's own size."""
    need_backend("tree_attention", backend, DEVICE)
    ctx, T, Hq, Hkv, D, bs, dtype, kinds, n, split_len = CASES["splits-fp16"]
    case, k_deq, v_deq = quantized(make_case(ctx, T, Hq, Hkv, D, bs, dtype, kinds, n), fp8, *scales)
    out, want = _run_and_dequantized_reference(case, k_deq, v_deq, split_len, backend, k_scale=scales[0],
                                               v_scale=scales[1])
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("backend", agreement_backends())
def test_plan_for_fp8_caches_splits_shorter_and_matches_the_reference(backend):
    """A plan built for e4m3 caches (``kv_dtype``) with the default split: two requests (one empty context) with 7 rows
    per KV head over up to 600 tokens take five 128-token splits (three 256-token ones for two-byte caches), the last
    shorter; the output is attention over the dequantized caches, with scales."""
    need_backend("tree_attention", backend, DEVICE)
    base = make_case([600, 0], 1, 14, 2, 128, 16, torch.bfloat16, ("chain",), None)
    case, k_deq, v_deq = quantized(base, torch.float8_e4m3fn, 0.5, 2.0)
    plan = make_plan(case, max_context_len=600, kv_dtype=torch.float8_e4m3fn)
    assert (plan.num_splits, plan.split_len) == (5, 128)
    assert make_plan(case, max_context_len=600).num_splits == 3
    out = run(plan, case["q"], case["k_cache"], case["v_cache"], out=poison_(torch.empty_like(case["q"])),
              backend=backend, k_scale=0.5, v_scale=2.0)
    want = tree_attention_reference(**{**case, "q": case["q"].float(), "k_cache": k_deq, "v_cache": v_deq},
                                    out_dtype=torch.float32)
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)


def _run_and_dequantized_reference(case, k_deq, v_deq, split_len, backend, sm_scale=None, **scales):
    """``backend``'s output over the quantized ``case`` (poisoned ``out`` first) and the fp32 reference over the
    dequantized caches ``k_deq`` / ``v_deq``."""
    plan = make_plan(case, split_len=split_len)
    out = run(plan, case["q"], case["k_cache"], case["v_cache"], out=poison_(torch.empty_like(case["q"])),
              backend=backend, sm_scale=sm_scale, **scales)
    want = tree_attention_reference(**{**case, "q": case["q"].float(), "k_cache": k_deq, "v_cache": v_deq},
                                    sm_scale=sm_scale, out_dtype=torch.float32)
    return out, want


@pytest.mark.parametrize("backend", agreement_backends())
@pytest.mark.parametrize("q_scale", [2.0**16, 2.0**-20], ids=["q-past-fp16-range", "q-tiny"])
def test_fp8_cache_with_queries_outside_fp16_range(backend, q_scale):
    """bf16 queries far outside fp16's range (|q| up to ~2^18) or deep in its subnormals (~2^-20) over fp8 caches: the
    compiled Triton kernel runs such products in fp16 for small row blocks (this case: 12 rows), scaling the rows by a
    power of two first; an unscaled fp16 copy would overflow to inf (NaN rows) or lose their bits."""
    need_backend("tree_attention", backend, DEVICE)
    ctx, T, Hq, Hkv, D, bs, dtype, kinds, n, split_len = CASES["gqa2-bs16"]
    base = make_case(ctx, T, Hq, Hkv, D, bs, dtype, kinds, n)
    case, k_deq, v_deq = quantized({**base, "q": (base["q"].float() * q_scale).to(dtype)}, torch.float8_e4m3fn,
                                   1.0, 1.0)
    out, want = _run_and_dequantized_reference(case, k_deq, v_deq, split_len, backend, sm_scale=D**-0.5)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)


def test_scales_also_apply_to_caches_of_q_dtype_and_the_public_op():
    """Scales are the caches' dequantization, whatever their dtype: bf16 caches with scales equal the reference over
    ``cache * scale``; the public op passes them through."""
    case = make_case([20, 3], 4, 4, 2, 64, 16, torch.bfloat16, ("random",), [4, 2], device="cpu")
    got = tlt_kernels.tree_attention(**case, backend="torch", k_scale=2.0, v_scale=0.5)
    want = tree_attention_reference(**{**case, "k_cache": case["k_cache"].float() * 2.0,
                                       "v_cache": case["v_cache"].float() * 0.5, "q": case["q"].float()},
                                    out_dtype=torch.float32)
    torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=1e-2)


def test_public_op_plans_for_its_caches_dtype(monkeypatch):
    """The one-shot op builds its plan for the caches it is given (``kv_dtype``: the fp8 split over fp8 caches)."""
    import tlt_kernels.ops.tree_attention as op

    seen, plan = [], op.plan_tree_attention
    monkeypatch.setattr(op, "plan_tree_attention", lambda *a, **kw: seen.append(kw["kv_dtype"]) or plan(*a, **kw))
    case = make_case([20, 3], 4, 4, 2, 64, 16, torch.bfloat16, ("random",), [4, 2], device="cpu")
    for cache in (torch.float8_e4m3fn, torch.bfloat16):
        tlt_kernels.tree_attention(**{**case, "k_cache": case["k_cache"].to(cache),
                                      "v_cache": case["v_cache"].to(cache)}, backend="torch")
    assert seen == [torch.float8_e4m3fn, torch.bfloat16]


def test_auto_skips_the_cuda_backend_for_fp8_caches():
    """"auto" does not pick the CUDA backend for fp8 caches by the backends alone (an explicit "cuda" runs them; the
    plan sizes' rule for its warp-specialized kernel is test_tree_attention's AUTO_CHOICES)."""
    for fp8 in (False, True):
        name = _choose_backend("auto", DEVICE, 4, 64, False, fp8)
        assert not (fp8 and name == "cuda")


def test_rejects_bad_scales_and_dtypes():
    case = make_case([20, 3], 4, 4, 2, 64, 16, torch.bfloat16, ("random",), [4, 2], device="cpu")
    for bad in (0.0, -1.0, float("inf"), float("nan"), True, torch.tensor(1.0), "1"):
        with pytest.raises(ValueError, match="k_scale must be a finite number > 0"):
            tlt_kernels.tree_attention(**case, backend="torch", k_scale=bad)
        with pytest.raises(ValueError, match="v_scale must be a finite number > 0"):
            tlt_kernels.tree_attention(**case, backend="torch", v_scale=bad)
    fp8 = case["k_cache"].to(torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="v_cache must have dtype float8_e4m3fn"):  # both caches fp8, or neither
        tlt_kernels.tree_attention(**{**case, "k_cache": fp8}, backend="torch")
    with pytest.raises(TypeError, match="k_cache must have dtype float32"):  # fp32 q reads fp32 caches only
        tlt_kernels.tree_attention(**{**case, "q": case["q"].float(), "k_cache": fp8}, backend="torch")


@pytest.mark.parametrize("backend", backend_params())
@budget(12)
@given(seed=seeds, T=st.integers(1, 6), G=st.integers(1, 3), bs=st.sampled_from([1, 4, 16]),
       ctx=st.lists(st.integers(0, 90), min_size=1, max_size=3), fp8=st.sampled_from(FP8_DTYPES),
       dtype=st.sampled_from([torch.bfloat16, torch.float16]), k_scale=st.sampled_from([0.05, 1.0, 7.5]),
       v_scale=st.sampled_from([0.125, 1.0, 3.0]), split_len=st.sampled_from([None, 64]))
def test_property_fp8_caches_are_attention_over_cache_times_scale(backend, seed, T, G, bs, ctx, fp8, dtype, k_scale,
                                                                  v_scale, split_len):
    """Any small problem (ragged contexts, page sizes, GQA groups, one split or several): the output over fp8 caches
    with scales is the fp32 reference's over ``cache * scale`` within the output dtype's rounding."""
    case = make_case(ctx, T, 2 * G, 2, 64, bs, dtype, ("random", "chain"), seed=seed, device="cpu")
    case, k_deq, v_deq = quantized(case, fp8, k_scale, v_scale)
    plan = make_plan(case, split_len=split_len)
    out = run(plan, case["q"], case["k_cache"], case["v_cache"], out=poison_(torch.empty_like(case["q"])),
              backend=backend, k_scale=k_scale, v_scale=v_scale)
    want = tree_attention_reference(**{**case, "q": case["q"].float(), "k_cache": k_deq, "v_cache": v_deq},
                                    out_dtype=torch.float32)
    torch.testing.assert_close(out.float(), want, atol=2e-2 * v_scale, rtol=2e-2)


# ----------------------------------------------------------------------------------------- the CUDA backend
# (B, T, Hkv, G, D, block_size, context lengths, q dtype, split_len): every head dim, 4- and 8-warp row tiles
# (T * G <= 64 / > 64, chunks of 128 rows), one-token and 128-token pages, empty contexts, one split and several.
CUDA_SHAPES = [
    (2, 7, 2, 4, 128, 16, [0, 300], torch.bfloat16, None),
    (3, 16, 2, 4, 128, 16, [513, 0, 77], torch.float16, 64),
    (2, 64, 1, 4, 128, 16, [1000, 31], torch.bfloat16, None),
    (2, 16, 2, 7, 128, 1, [130, 257], torch.bfloat16, 64),
    (2, 16, 2, 7, 64, 128, [700, 5], torch.float16, 128),
    (2, 64, 2, 7, 64, 16, [200, 0], torch.bfloat16, None),
    (2, 16, 2, 4, 256, 16, [333, 1024], torch.bfloat16, 256),
    (1, 33, 2, 7, 256, 1, [129], torch.float16, 64),
]


def _cuda_case(shape, fp8, k_scale, v_scale, seed=0):
    """A case of test_tree_attention_cuda's builder (NaN-trapped spare pages and page tails, which the kernel must
    never read) with its caches quantized to ``fp8`` at the scales, and its reference over the dequantized caches."""
    from test_tree_attention_cuda import make_case as make_cuda_case

    B, T, Hkv, G, D, bs, ctx, dtype, split_len = shape
    case = make_cuda_case(B, T, Hkv, G, D, bs, ctx, dtype, seed)
    case, k_deq, v_deq = quantized(case, fp8, k_scale, v_scale)
    ref = tree_attention_reference(**{**case, "q": case["q"].float(), "k_cache": k_deq, "v_cache": v_deq},
                                   out_dtype=torch.float32)
    return case, ref


def _cuda_plan(case, split_len):
    B, T, Hq, D = case["q"].shape
    return tlt_kernels.plan_tree_attention(case["parents"], case["context_lens"], case["block_table"],
                                           case["num_nodes"], num_q_heads=Hq, num_kv_heads=case["k_cache"].shape[2],
                                           head_dim=D, block_size=case["k_cache"].shape[1], split_len=split_len)


@pytest.mark.cuda
@pytest.mark.parametrize("fp8", FP8_DTYPES, ids=str)
@pytest.mark.parametrize("shape", CUDA_SHAPES, ids=lambda s: f"T{s[1]}-G{s[3]}-D{s[4]}-bs{s[5]}-{str(s[7])[6:]}-sl{s[8]}")
def test_cuda_fp8_matches_the_dequantized_reference_and_its_widening(shape, fp8):
    """Every kernel shape: with scales, the fp32 reference over ``cache * scale`` within the output dtype's rounding
    (NaN in every slot no row attends, poisoned output and scratch); at scales 1, the same kernel over the caches
    widened (``_assert_matches_its_widening``): the sm_90 kernels where they take the plan, else the mma.sync one."""
    need_backend("tree_attention", "cuda", DEVICE)

    case, ref = _cuda_case(shape, fp8, 0.5, 2.0)
    plan = _cuda_plan(case, shape[-1])
    poison_(plan.partial_out)
    poison_(plan.partial_lse)
    out = plan.run(case["q"], case["k_cache"], case["v_cache"], out=poison_(torch.empty_like(case["q"])),
                   backend="cuda", k_scale=0.5, v_scale=2.0)
    atol, rtol = {torch.bfloat16: (5e-2, 2e-2), torch.float16: (8e-3, 4e-3)}[case["q"].dtype]
    torch.testing.assert_close(out.float(), ref, atol=atol, rtol=rtol)
    case, _ = _cuda_case(shape, fp8, 1.0, 1.0, seed=1)
    plan = _cuda_plan(case, shape[-1])
    out8 = plan.run(case["q"], case["k_cache"], case["v_cache"], out=poison_(torch.empty_like(case["q"])),
                    backend="cuda")
    _assert_matches_its_widening(out8, plan, case)


def _assert_matches_its_widening(out8, plan, case):
    """``out8`` (the CUDA backend over ``case``'s fp8 caches, scales 1) against the same kernel over the caches widened
    to q's dtype (exact), bit for bit where the math after the widening is the same: the lockstep sm_90 kernels, the
    mma.sync one, and the warp-specialized kernel under fp16 rows. Under bfloat16 rows the warp-specialized kernel
    computes in fp16 (rows scaled by powers of two: the same scores; the probabilities rounded to fp16 for P V, not
    to bfloat16; its widening is the fp16 rows' one, checked bit for bit there), so there against the fp32 reference:
    within 2^-8 of sum(p |v|) / sum(p) (P's fp16 rounding, with room), plus 2^-24 |v| for every attended value (a
    probability below fp16's normals, 2^-14 of the row's largest, keeps an absolute error up to 2^-25), plus the
    bfloat16 output's rounding."""
    fp16_products = runs_warp_specialized(plan, case["q"], case["k_cache"], case["v_cache"])
    if not (fp16_products and case["q"].dtype == torch.bfloat16):
        widened = plan.run(case["q"], case["k_cache"].to(case["q"].dtype), case["v_cache"].to(case["q"].dtype),
                           backend="cuda")
        assert torch.equal(out8, widened)
        return
    fp32 = {**case, "q": case["q"].float(), "k_cache": case["k_cache"].float(), "v_cache": case["v_cache"].float()}
    ref = tree_attention_reference(**fp32, out_dtype=torch.float32)
    magnitude = tree_attention_reference(**{**fp32, "v_cache": fp32["v_cache"].abs()}, out_dtype=torch.float32)
    attended = case["context_lens"].max().item() + plan.num_tree
    largest_v = fp32["v_cache"].abs().nan_to_num(0.0, 0.0, 0.0).amax()  # NaN/inf traps sit in unattended slots
    bound = 2**-8 * magnitude + 2**-8 * ref.abs() + 2**-24 * attended * largest_v
    error = (out8.float() - ref).abs()
    assert (error <= bound).all(), (error - bound).max()


def _finite_codes(fp8):
    """Every bit pattern of ``fp8`` that is a finite value, as uint8."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    return codes[codes.view(fp8).float().isfinite()]


@pytest.mark.cuda
@pytest.mark.parametrize("fp8", FP8_DTYPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("G, warp_specialized", [(4, True), (7, False), (7, True)],
                         ids=["64-rows", "112-rows-lockstep", "112-rows-warp-specialized"])
def test_cuda_fp8_widens_every_finite_code_exactly(G, warp_specialized, dtype, fp8):
    """Caches cycling through every finite code of the format (subnormals, zeros of both signs, the largest values)
    give what the same kernel gives over them widened by torch (``_assert_matches_its_widening``): the sm_90 kernels'
    widening (the lockstep ones': integer ops for e4m3 into bfloat16, conversion instructions else; the
    warp-specialized one's producer: conversion instructions into fp16) is exact for every value, in the one- and the
    two-warpgroup lockstep kernels and the warp-specialized one."""
    need_backend("tree_attention", "cuda", DEVICE)
    case, _ = _cuda_case((2, 16, 2, G, 128, 16, [300, 77], dtype, None), fp8, 1.0, 1.0)
    codes = _finite_codes(fp8).to(DEVICE)
    for name in ("k_cache", "v_cache"):
        cache = case[name]
        bits = cache.view(torch.uint8)
        finite = cache.float().isfinite()  # keep the NaN traps of slots no row may read
        cycled = codes[torch.randperm(bits.numel(), device=DEVICE) % codes.numel()].view(bits.shape)
        bits.copy_(torch.where(finite, cycled, bits))
    plan = _cuda_plan(case, None)
    # Small queries keep the scores of the largest codes finite in fp32 and the softmax away from one-hot rows.
    q = case["q"] * 1e-3
    case = {**case, "q": q}
    with forced_switches(WARP_SPECIALIZED=warp_specialized):
        assert runs_warp_specialized(plan, case["q"], case["k_cache"], case["v_cache"]) == (warp_specialized and G == 7)
        out8 = plan.run(q, case["k_cache"], case["v_cache"], out=poison_(torch.empty_like(q)), backend="cuda")
        assert not out8.isnan().any()
        _assert_matches_its_widening(out8, plan, case)


@pytest.mark.cuda
def test_auto_runs_fp8_caches_on_the_warp_specialized_kernel():
    """At T * G > 64 on sm_90 (here 112 rows), "auto" takes the CUDA backend's warp-specialized kernel for fp8 caches:
    the same bits as the explicit "cuda" backend, eagerly, under torch.compile and replayed from a CUDA graph."""
    need_backend("tree_attention", "cuda", DEVICE)
    case, _ = _cuda_case((3, 16, 2, 7, 128, 16, [300, 1100, 4], torch.bfloat16, 512), torch.float8_e4m3fn, 1.0, 1.0)
    plan = _cuda_plan(case, 512)
    q, k, v = case["q"], case["k_cache"], case["v_cache"]
    if not runs_warp_specialized(plan, q, k, v):
        pytest.skip("the warp-specialized sm_90 kernel does not run this plan here")
    assert _choose_backend("auto", q.device, 16, 128, False, True, (7, 16, 512)) == AUTO_CUDA
    want = plan.run(q, k, v, backend="cuda")
    assert torch.equal(plan.run(q, k, v, out=poison_(torch.empty_like(q))), want)
    compiled = torch.compile(lambda q, k, v: plan.run(q, k, v), fullgraph=True)
    assert torch.equal(compiled(q, k, v), want)
    out = poison_(torch.empty_like(q))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.run(q, k, v, out=out)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)


@pytest.mark.cuda
def test_cuda_v_scale_on_caches_of_q_dtype_on_every_sm90_build():
    """v_scale != 1 over bf16 caches runs on the sm_90 kernels (lockstep and warp-specialized) and scales every row."""
    need_backend("tree_attention", "cuda", DEVICE)
    from tlt_kernels._cuda import tree_attention as cuda_ta

    case, _ = _cuda_case((2, 16, 2, 7, 128, 16, [300, 77], torch.bfloat16, None), torch.float8_e4m3fn, 1.0, 1.0)
    case = {**case, "k_cache": case["k_cache"].to(torch.bfloat16), "v_cache": case["v_cache"].to(torch.bfloat16)}
    plan = _cuda_plan(case, None)
    ref = tree_attention_reference(**{**case, "q": case["q"].float(), "k_cache": case["k_cache"].float() * 0.5,
                                      "v_cache": case["v_cache"].float() * 3.0}, out_dtype=torch.float32)
    for warp_specialized in (True, False):
        with forced_switches(WARP_SPECIALIZED=warp_specialized):
            assert cuda_ta._use_context_sm90(plan, case["q"], case["k_cache"], case["v_cache"])
            out = plan.run(case["q"], case["k_cache"], case["v_cache"], out=poison_(torch.empty_like(case["q"])),
                           backend="cuda", k_scale=0.5, v_scale=3.0)
        torch.testing.assert_close(out.float(), ref, atol=5e-2 * 3.0, rtol=2e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("fp8", FP8_DTYPES, ids=str)
@pytest.mark.parametrize("D, num_q_heads", [(64, 4), (128, 4), (128, 24)],
                         ids=["mma-sync", "sm90-12-rows", "sm90-72-rows-warp-specialized"])
@pytest.mark.parametrize("splits", ["several", "1"])
@pytest.mark.parametrize("site", ["K-context", "V-context", "K-tree", "V-tree", "V-tree-root"])
def test_cuda_fp8_nan_contract(site, splits, D, num_q_heads, fp8):
    """A NaN in one attended fp8 slot reaches exactly the rows that attend it (a tree node's V: only the rows that see
    the node, though every row of the tile multiplies it); NaN in every unattended slot never reaches the output.
    D = 128 runs on the sm_90 kernels (on sm_90: the lockstep one at 12 rows per KV head, the warp-specialized one at
    72, whose tiles are 128 tokens, so its several splits are 128 long), D = 64 on the mma.sync one."""
    need_backend("tree_attention", "cuda", DEVICE)
    from test_tree_attention_edge_cases import (NAN_SITES, _case, _check_nan_contract, _expected_nan_rows,
                                                _slot_location, fill_unused_slots_with_nan_)

    which, b, slot, kv_head = NAN_SITES[site]
    split_len = None if splits == "1" else 128 if num_q_heads == 24 else 64
    case = _case(torch.bfloat16, D=D, num_q_heads=num_q_heads)
    case = {**case, "k_cache": case["k_cache"].to(fp8).to(torch.bfloat16),
            "v_cache": case["v_cache"].to(fp8).to(torch.bfloat16)}  # values an fp8 cache holds exactly
    clean_ref = tree_attention_reference(**case, out_dtype=torch.float32)
    fill_unused_slots_with_nan_(case)
    page, off = _slot_location(case, b, slot)
    case[which][page, off, kv_head, 5] = math.nan
    case8 = {**case, "k_cache": case["k_cache"].to(fp8), "v_cache": case["v_cache"].to(fp8)}
    out = run(make_plan(case8, split_len=split_len), case8["q"], case8["k_cache"], case8["v_cache"],
              out=poison_(torch.empty_like(case8["q"])), backend="cuda")
    _check_nan_contract(out, case, clean_ref, _expected_nan_rows(case, b, slot, kv_head))


@pytest.mark.cuda
def test_cuda_launchers_refuse_fp8_where_they_do_not_read_it():
    """The launchers' own checks (the Python side never sends these): a tuning config of the partial kernel, and the
    warp-specialized sm_90 kernel's TMA build, with fp8 caches."""
    need_backend("tree_attention", "cuda", DEVICE)
    from tlt_kernels._cuda import extension
    from tlt_kernels._cuda import tree_attention as cuda_ta

    case, _ = _cuda_case(CUDA_SHAPES[0], torch.float8_e4m3fn, 1.0, 1.0)
    plan = _cuda_plan(case, None)
    args = cuda_ta._launch_args(plan, case["q"], case["k_cache"], case["v_cache"], torch.empty_like(case["q"]), 0.1)
    args["stream"] = torch.cuda.current_stream().cuda_stream
    with pytest.raises(ValueError, match="tuning variant of caches of q's dtype"):
        extension().tree_attention_partial(**{**args, "config": 2})
    with pytest.raises(ValueError, match="not with the TMA flag"):
        extension().tree_attention_sm90(**{**args, "config": 128 | cuda_ta.WARP_SPECIALIZED_FLAG | cuda_ta.TMA_FLAG})
