"""Tree attention over fp8 (e4m3 / e5m2) K/V caches with per-tensor dequantization scales.

The caches hold ``K / k_scale`` and ``V / v_scale`` in fp8; every backend that reads them must compute attention over
``cache * scale``. Checked: (1) at scales 1 an fp8 cache gives exactly what its bf16/fp16 widening gives (the widening
is exact, and both paths then run the same arithmetic), bit for bit (compiled Triton: within a few output ulps, see
the test); (2) with scales, the output
against a float32 reference over the dequantized caches; (3) the CUDA backend, which reads caches of q's dtype only,
is refused by name and skipped by "auto"; (4) bad scales are refused, naming the argument."""
import pytest
import torch
from conftest import agreement_backends, kernel_devices, need_backend, poison_
from hypothesis import given
from hypothesis import strategies as st
from strategies import backend_params, budget, seeds

from test_tree_attention import make_case, make_plan

import tlt_kernels
from tlt_kernels.ops.tree_attention import FP8_DTYPES, _choose_backend, run
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
    if backend == "cuda":
        with pytest.raises(ValueError, match="fp8 caches and v_scale != 1 run on 'triton' or 'torch'"):
            run(plan, case["q"], case["k_cache"], case["v_cache"], backend="cuda")
        return
    out8 = run(plan, case["q"], case["k_cache"], case["v_cache"], out=poison_(torch.empty_like(case["q"])),
               backend=backend)
    wide = run(plan, case["q"], case["k_cache"].to(dtype), case["v_cache"].to(dtype), backend=backend)
    assert not out8.isnan().any()
    if backend == "triton" and DEVICE.type == "cuda":
        # Compiled, an fp8 tile widens in registers and may feed a different tensor-core instruction than a tile
        # loaded straight to shared memory, so fp32 sums can differ in their last bits: a few output ulps, no more.
        eps = torch.finfo(dtype).eps
        torch.testing.assert_close(out8, wide, rtol=4 * eps, atol=4 * eps * wide.abs().max().item())
    else:
        assert torch.equal(out8, wide)


@pytest.mark.parametrize("backend", [b for b in agreement_backends() if b.values[0] != "cuda"])
@pytest.mark.parametrize("fp8", FP8_DTYPES, ids=str)
@pytest.mark.parametrize("scales", [(0.5, 2.0), (3.0, 0.25)])
def test_scaled_fp8_cache_matches_the_dequantized_reference(backend, fp8, scales):
    """With scales, the output is attention over ``cache * scale`` (fp32 reference on the dequantized caches) within
    the output dtype's rounding; a wrong or missing scale would be off by the attention output's own size."""
    need_backend("tree_attention", backend, DEVICE)
    ctx, T, Hq, Hkv, D, bs, dtype, kinds, n, split_len = CASES["splits-fp16"]
    case, k_deq, v_deq = quantized(make_case(ctx, T, Hq, Hkv, D, bs, dtype, kinds, n), fp8, *scales)
    plan = make_plan(case, split_len=split_len)
    out = run(plan, case["q"], case["k_cache"], case["v_cache"], out=poison_(torch.empty_like(case["q"])),
              backend=backend, k_scale=scales[0], v_scale=scales[1])
    want = tree_attention_reference(**{**case, "q": case["q"].float(), "k_cache": k_deq, "v_cache": v_deq},
                                    out_dtype=torch.float32)
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


def test_auto_skips_the_cuda_backend_for_scaled_caches():
    """"auto" never picks a backend that reads unscaled caches of q's dtype for fp8 caches or v_scale != 1."""
    for scaled in (False, True):
        name = _choose_backend("auto", DEVICE, 4, 64, False, scaled)
        assert not (scaled and name == "cuda")


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
