"""tree_attention: every backend against the fp32 reference, plan reuse, capture, validation."""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import kernel_devices, need_backend, poison_

import tlt_kernels
from tlt_kernels._backend import backend_unavailable_reason
from tlt_kernels.ops.tree_attention import default_split_len, plan_tree_attention, run
from tlt_kernels.reference.tree_attention import gather_request_kv, request_mask, tree_attention_reference

DEVICE = torch.device(kernel_devices()[0])
ON_GPU = DEVICE.type == "cuda"
BACKENDS = ["torch", "triton", "cuda"]


# ----------------------------------------------------------------------------------------- inputs
def make_parents(kind: str, T: int, gen: torch.Generator) -> torch.Tensor:
    """``int32 [T]`` parents of one tree of the given shape."""
    if kind in ("chain", "deep"):
        return torch.arange(-1, T - 1, dtype=torch.int32)
    if kind == "star":
        p = torch.zeros(T, dtype=torch.int32)
    elif kind == "binary":
        p = ((torch.arange(T) - 1) // 2).to(torch.int32)
    elif kind == "random":
        p = torch.tensor([0] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, T)], dtype=torch.int32)
    else:
        raise ValueError(kind)
    p[0] = -1
    return p


def make_case(ctx_lens, T, Hq, Hkv, D, block_size, dtype, kinds=("random",), num_nodes=None, seed=0, device=DEVICE):
    """Random paged cache with shuffled pages, unused table entries set to -1 (kernels must not read them)."""
    gen = torch.Generator().manual_seed(seed)
    B = len(ctx_lens)
    ctx = torch.tensor(ctx_lens, dtype=torch.int32)
    n = torch.full((B,), T, dtype=torch.int32) if num_nodes is None else torch.tensor(num_nodes, dtype=torch.int32)
    parents = torch.stack([make_parents(kinds[b % len(kinds)], T, gen) for b in range(B)])
    pages_per_req = [-(-(c + T) // block_size) for c in ctx_lens]
    max_blocks = max(pages_per_req) + 1
    num_blocks = sum(pages_per_req) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.full((B, max_blocks), -1, dtype=torch.int32)
    used = 0
    for b, p in enumerate(pages_per_req):
        table[b, :p] = perm[used : used + p].to(torch.int32)
        used += p
    k = torch.randn(num_blocks, block_size, Hkv, D, generator=gen).to(dtype)
    v = torch.randn(num_blocks, block_size, Hkv, D, generator=gen).to(dtype)
    q = torch.randn(B, T, Hq, D, generator=gen).to(dtype)
    to = lambda t: t.to(device)  # noqa: E731
    return dict(q=to(q), k_cache=to(k), v_cache=to(v), block_table=to(table), context_lens=to(ctx),
                parents=to(parents), num_nodes=to(n))


def low_precision_error(case, ref, sm_scale=None) -> float:
    """Max error vs the fp32 reference of torch's own SDPA in the input dtype on the same inputs."""
    q, k_cache, v_cache = case["q"], case["k_cache"], case["v_cache"]
    B, T, Hq, D = q.shape
    G = Hq // k_cache.shape[2]
    err = 0.0
    for b in range(B):
        C, n = int(case["context_lens"][b]), int(case["num_nodes"][b])
        k, v = gather_request_kv(k_cache, v_cache, case["block_table"], b, C + n)
        mask = request_mask(case["parents"][b], C, n)
        o = F.scaled_dot_product_attention(
            q[b, :n].transpose(0, 1), k.repeat_interleave(G, 1).transpose(0, 1), v.repeat_interleave(G, 1).transpose(0, 1),
            attn_mask=mask, scale=sm_scale,
        ).transpose(0, 1)
        err = max(err, (o.float() - ref[b, :n]).abs().max().item())
    return err


def check_against_reference(out, case, sm_scale=None):
    ref = tree_attention_reference(**case, sm_scale=sm_scale, out_dtype=torch.float32)
    assert out.dtype == case["q"].dtype and out.shape == case["q"].shape
    n = case["num_nodes"].cpu()
    T = out.shape[1]
    valid = (torch.arange(T)[None, :] < n[:, None]).to(out.device)
    assert not out.isnan().any(), "unwritten (NaN-poisoned) or NaN outputs"
    assert (out[~valid] == 0).all(), "rows past num_nodes must be exactly zero"
    ours = (out.float() - ref)[valid].abs().max().item()
    theirs = low_precision_error(case, ref, sm_scale)
    # fp32: both errors are rounding noise of one accumulation order against another (~1e-7 per add).
    slack = 1e-5 if case["q"].dtype == torch.float32 else 1e-6
    assert ours <= 2 * theirs + slack, f"error {ours:.3g} > 2x torch's own {case['q'].dtype} error {theirs:.3g}"


def make_plan(case, **kw):
    q, k = case["q"], case["k_cache"]
    return plan_tree_attention(
        case["parents"], case["context_lens"], case["block_table"], case["num_nodes"],
        num_q_heads=q.shape[2], num_kv_heads=k.shape[2], head_dim=q.shape[3], block_size=k.shape[1],
        num_blocks=k.shape[0], **kw,
    )


# ----------------------------------------------------------------------------------- correctness
# (ctx_lens, T, Hq, Hkv, D, block_size, dtype, tree kinds, num_nodes, split_len)
CPU_CASES = {
    "chain-gqa3-bs16": ([0, 5, 37], 5, 6, 2, 64, 16, torch.bfloat16, ("chain",), None, None),
    "star-mha-bs1-fp16": ([17, 1, 64], 8, 2, 2, 64, 1, torch.float16, ("star",), None, None),
    "random-gqa7-d128-bs128-ragged": ([33, 0, 100], 7, 7, 1, 128, 128, torch.bfloat16, ("random",), [7, 3, 1], None),
    "deep-splits-merge": ([200, 3, 129], 16, 3, 1, 64, 16, torch.bfloat16, ("deep", "random", "binary"), [16, 9, 16], 64),
    "single-node-fp16": ([3, 70], 1, 2, 1, 64, 16, torch.float16, ("chain",), None, 64),
    "two-mask-words": ([10], 40, 1, 1, 64, 16, torch.bfloat16, ("binary",), None, None),
    "row-chunks": ([50, 7], 48, 3, 1, 64, 16, torch.bfloat16, ("random",), [48, 31], 64),
    # fp32 (an fp32 model's verify pass): exact fp32 products on the triton backend.
    "fp32-splits-merge": ([130, 2, 65], 9, 4, 1, 64, 16, torch.float32, ("random", "chain"), [9, 4, 9], 64),
    "fp32-d128-row-chunks": ([20, 45], 24, 6, 2, 128, 8, torch.float32, ("binary",), [24, 11], None),
}
GPU_CASES = {
    "qwen7b-t16": ([4096, 1000, 17, 2047], 16, 28, 4, 128, 16, torch.bfloat16, ("random", "chain", "star"), [16, 5, 1, 16], None),
    "qwen7b-t64-chunks": ([3000, 513], 64, 28, 4, 128, 16, torch.bfloat16, ("random", "binary"), [64, 40], None),
    "d256-fp16": ([777, 0, 64, 1500], 12, 8, 2, 256, 32, torch.float16, ("random",), None, 256),
    "qwen32b-bs128": ([5000, 130], 32, 40, 8, 128, 128, torch.bfloat16, ("star", "deep"), None, None),
    "bs1-gqa3-d64": ([300, 301, 1], 24, 12, 4, 64, 1, torch.bfloat16, ("random",), None, 64),
    "fp32-e2e-shape": ([900, 64, 513, 1], 32, 8, 2, 64, 16, torch.float32, ("random", "chain"), [32, 5, 32, 1], None),
    "fp32-d256": ([700, 33], 16, 8, 2, 256, 16, torch.float32, ("random",), None, 256),
}


# The CPU cases run everywhere (the kernels in the interpreter without a GPU); the model-sized GPU cases need a GPU.
AGREEMENT_CASES = ([pytest.param(name, id=name) for name in CPU_CASES]
                   + [pytest.param(name, marks=pytest.mark.cuda, id=name) for name in GPU_CASES])


@pytest.mark.triton
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", AGREEMENT_CASES)
def test_matches_reference(backend, name):
    need_backend("tree_attention", backend, DEVICE)
    ctx, T, Hq, Hkv, D, bs, dtype, kinds, n, split_len = {**CPU_CASES, **GPU_CASES}[name]
    case = make_case(ctx, T, Hq, Hkv, D, bs, dtype, kinds, n)
    plan = make_plan(case, split_len=split_len)
    out = poison_(torch.empty_like(case["q"]))
    if _cuda_refuses_fp32(backend, dtype, plan, case, out):
        return
    res = run(plan, case["q"], case["k_cache"], case["v_cache"], out=out, backend=backend)
    assert res is out
    check_against_reference(out, case)


def _cuda_refuses_fp32(backend, dtype, plan, case, out) -> bool:
    """The CUDA kernel reads half precision only: asked for fp32 by name it must raise, not compute."""
    if backend != "cuda" or dtype != torch.float32:
        return False
    with pytest.raises(ValueError, match="reads bf16/fp16"):
        run(plan, case["q"], case["k_cache"], case["v_cache"], out=out, backend=backend)
    return True


def fill_unused_slots_with_nan_(case) -> int:
    """Set every cache slot no request uses (spare pages, page tails, slots of padding nodes) to NaN.

    Engines reuse freed pages without clearing them, so those slots may hold anything; a backend that
    multiplies a zero softmax weight by such a V row (0 * NaN = NaN) poisons the whole output row.
    Returns the number of NaN-filled slots.
    """
    k, v, table = case["k_cache"], case["v_cache"], case["block_table"].cpu().long()
    bs = k.shape[1]
    used = torch.zeros(k.shape[0] * bs, dtype=torch.bool)
    for b, (c, n) in enumerate(zip(case["context_lens"].tolist(), case["num_nodes"].tolist())):
        slots = torch.arange(c + n)
        used[table[b, slots // bs] * bs + slots % bs] = True
    unused = (~used).view(k.shape[0], bs).to(k.device)
    k.masked_fill_(unused[:, :, None, None], float("nan"))
    v.masked_fill_(unused[:, :, None, None], float("nan"))
    return int((~used).sum())


@pytest.mark.triton
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["deep-splits-merge", "random-gqa7-d128-bs128-ragged"])
def test_nan_in_unused_cache_slots(backend, name):
    """Garbage (NaN) in freed pages, page tails and padding-node slots must not reach the output."""
    _check_nan_in_unused_cache_slots(backend, CPU_CASES[name])


@pytest.mark.cuda
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["qwen7b-t16", "qwen7b-t64-chunks", "d256-fp16"])
def test_nan_in_unused_cache_slots_gpu(backend, name):
    _check_nan_in_unused_cache_slots(backend, GPU_CASES[name])


def _check_nan_in_unused_cache_slots(backend, spec):
    need_backend("tree_attention", backend, DEVICE)
    ctx, T, Hq, Hkv, D, bs, dtype, kinds, n, split_len = spec
    case = make_case(ctx, T, Hq, Hkv, D, bs, dtype, kinds, n)
    assert fill_unused_slots_with_nan_(case) > 0
    plan = make_plan(case, split_len=split_len)
    out = poison_(torch.empty_like(case["q"]))
    run(plan, case["q"], case["k_cache"], case["v_cache"], out=out, backend=backend)
    check_against_reference(out, case)


@pytest.mark.triton
@pytest.mark.parametrize("backend", BACKENDS)
def test_plan_reused_across_layers_and_scale(backend):
    need_backend("tree_attention", backend, DEVICE)
    layers = [make_case([45, 9], 6, 4, 2, 64, 16, torch.bfloat16, ("random", "star"), [6, 4], seed=s) for s in (1, 2)]
    # Same tree and tables in every layer; only q / k / v differ.
    for key in ("block_table", "context_lens", "parents", "num_nodes"):
        layers[1][key] = layers[0][key]
    plan = make_plan(layers[0], split_len=64)
    for i, case in enumerate(layers):
        scale = None if i == 0 else 0.3
        out = plan.run(case["q"], case["k_cache"], case["v_cache"], sm_scale=scale, backend=backend)
        check_against_reference(out, case, sm_scale=scale)


@pytest.mark.triton
@pytest.mark.parametrize("backend", BACKENDS)
def test_public_op(backend):
    need_backend("tree_attention", backend, DEVICE)
    case = make_case([20, 66], 4, 4, 1, 64, 16, torch.float16, ("binary",), [4, 2])
    out = tlt_kernels.tree_attention(**case, backend=backend)
    check_against_reference(out, case)


def test_torch_backend_any_head_dim_and_large_trees():
    """Shapes outside the kernels' range still work on the torch path (auto on CPU)."""
    case = make_case([9, 0], 70, 2, 1, 32, 8, torch.bfloat16, ("random",), [70, 12], device="cpu")
    check_against_reference(tlt_kernels.tree_attention(**case), case)


@pytest.mark.triton
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_kernel_backends_reject_unsupported_shapes(backend):
    need_backend("tree_attention", backend, DEVICE)
    big_tree = make_case([9], 65, 2, 1, 64, 16, torch.bfloat16)
    with pytest.raises(ValueError, match="T=65"):
        tlt_kernels.tree_attention(**big_tree, backend=backend)
    odd_dim = make_case([9], 4, 2, 1, 32, 16, torch.bfloat16)
    with pytest.raises(ValueError, match="head_dim=32"):
        tlt_kernels.tree_attention(**odd_dim, backend=backend)


@pytest.mark.cuda
def test_auto_falls_back_with_warning():
    case = make_case([9], 65, 2, 1, 64, 16, torch.bfloat16)
    with pytest.warns(UserWarning, match="falling back"):
        out = tlt_kernels.tree_attention(**case)
    check_against_reference(out, case)


@pytest.fixture
def sm90_with_both_kernels(monkeypatch):
    """Backend choice as on an sm_90 GPU with Triton and the CUDA extension (no GPU needed: nothing launches)."""
    import tlt_kernels._backend as backend_mod
    import tlt_kernels._cuda.tree_attention as cuda_glue
    import tlt_kernels.ops.tree_attention as op

    monkeypatch.setattr(backend_mod, "backend_unavailable_reason", lambda name, device: None)
    monkeypatch.setattr(op, "backend_unavailable_reason", lambda name, device: None)
    capability = {"value": (9, 0)}
    monkeypatch.setattr(cuda_glue, "cuda_capability", lambda device: capability["value"])
    return op, capability


# (T, G, D, block_size, split_len, fp32, fp8) -> what "auto" runs on sm_90
AUTO_CHOICES = [
    ((16, 7, 128, 16, 4096, False, False), "cuda (auto)"),  # 112 rows: measured faster on CUDA
    ((16, 5, 128, 16, 8192, False, False), "cuda (auto)"),  # 80 rows: the bound
    ((64, 7, 128, 16, 1024, False, False), "cuda (auto)"),  # 448 rows
    ((8, 7, 128, 16, 4096, False, False), "triton"),  # 56 rows: measured faster on triton
    ((1, 7, 128, 16, 256, False, False), "triton"),
    ((16, 7, 64, 16, 4096, False, False), "triton"),  # no sm_90 CUDA kernel at D = 64
    ((16, 7, 128, 24, 4096, False, False), "triton"),  # pages of 24 tokens: not a power of two
    ((16, 7, 128, 16, 4160, False, False), "triton"),  # splits not whole 128-token tiles
    ((16, 7, 128, 16, 4096, True, False), "triton"),  # fp32: the CUDA kernels read half precision
    ((16, 7, 128, 16, 4096, False, True), "cuda (auto)"),  # fp8 caches, 112 rows: the warp-specialized kernel
    ((16, 5, 128, 16, 8192, False, True), "cuda (auto)"),  # fp8, 80 rows: one row block
    ((32, 7, 128, 16, 4096, False, True), "cuda (auto)"),  # fp8, 224 rows: two row blocks, still faster
    ((64, 5, 128, 16, 1024, False, True), "cuda (auto)"),  # fp8, 320 rows (32B heads at T = 64)
    ((8, 7, 128, 16, 4096, False, True), "triton"),  # fp8, 56 rows: the lockstep kernels, slower than triton
    ((16, 7, 128, 24, 4096, False, True), "triton"),  # fp8, pages of 24 tokens: no sm_90 kernel
]


@pytest.mark.parametrize("sizes,want", AUTO_CHOICES)
def test_auto_takes_cuda_where_a_kv_head_has_many_rows(sm90_with_both_kernels, sizes, want):
    op, _ = sm90_with_both_kernels
    T, G, D, bs, split_len, fp32, fp8 = sizes
    cuda = torch.device("cuda", 0)
    assert op._choose_backend("auto", cuda, T, D, fp32, fp8, (G, bs, split_len)) == want
    assert op._choose_backend("triton", cuda, T, D, fp32, fp8, (G, bs, split_len)) == "triton"


@pytest.mark.parametrize("fp8", [False, True])
def test_takes_warp_specialized_follows_the_launch_config(fp8, monkeypatch):
    """The size-only rule "auto" and the CUDA glue share: the warp-specialized kernel where the launch config carries
    its flag (128-token tiles, rows > 64), never with the switch off."""
    from tlt_kernels._cuda import tree_attention as cuda_rule

    for rows in (1, 56, 64, 65, 112, 128, 224, 448):
        flagged = cuda_rule.context_config(rows, fp8=fp8) & cuda_rule.WARP_SPECIALIZED_FLAG != 0
        assert cuda_rule.takes_warp_specialized(rows, fp8=fp8) == flagged, rows
    assert cuda_rule.takes_warp_specialized(112, fp8=fp8) and not cuda_rule.takes_warp_specialized(56, fp8=fp8)
    monkeypatch.setattr(cuda_rule, "CONTEXT_WARP_SPECIALIZED", False)
    assert not any(cuda_rule.takes_warp_specialized(rows, fp8=fp8) for rows in (65, 112, 448))


def test_auto_keeps_triton_off_sm90_or_without_the_extension(sm90_with_both_kernels, monkeypatch):
    op, capability = sm90_with_both_kernels
    cuda = torch.device("cuda", 0)
    capability["value"] = (8, 0)
    assert op._choose_backend("auto", cuda, 16, 128, False, False, (7, 16, 4096)) == "triton"
    capability["value"] = (9, 0)
    monkeypatch.setattr(op, "backend_unavailable_reason",
                        lambda name, device: "no extension" if name == "cuda" else None)
    assert op._choose_backend("auto", cuda, 16, 128, False, False, (7, 16, 4096)) == "triton"


@pytest.mark.triton
def test_auto_cuda_choice_runs_triton_where_the_cuda_kernels_refuse_the_inputs():
    """``AUTO_CUDA`` runs the CUDA kernels, or triton for inputs they refuse (here CPU tensors, in the interpreter;
    on a GPU a cache whose rows are not 16-byte aligned)."""
    import tlt_kernels.ops.tree_attention as op

    need_backend("tree_attention", "triton", DEVICE)
    case = make_case([70, 5], 4, 4, 2, 64, 16, torch.bfloat16)
    plan = make_plan(case)
    misaligned = torch.empty(case["k_cache"].numel() + 1, dtype=torch.bfloat16, device=DEVICE)[1:]
    k_cache = misaligned.view(case["k_cache"].shape).copy_(case["k_cache"])
    out = poison_(torch.empty_like(case["q"]))
    op._kernel(op.AUTO_CUDA)(plan, case["q"], k_cache, case["v_cache"], out, case["q"].shape[-1] ** -0.5, 1.0)
    check_against_reference(out, case)


@pytest.mark.parametrize("per_sm", [1, 2])
@pytest.mark.parametrize("B,L,T", [(1, 65536, 1), (8, 65536, 8), (4, 65536, 4), (2, 16384, 8), (16, 16384, 4),
                                   (1, 4096, 1), (64, 4096, 16), (3, 1000, 5)])
def test_split_len_with_even_programs_per_sm(B, L, T, per_sm):
    """``programs_per_sm = k``: the split covers the context in whole tiles, its programs (B x 4 KV heads per split)
    never exceed k x the 132 SMs when there is more than one split; at B = 8, L = 64k one per SM takes 4 splits
    (128 programs) and two per SM 8 (256)."""
    split = default_split_len(B, 4, L, 132, num_rows=T * 7, programs_per_sm=per_sm)
    splits = max(1, -(-L // split))
    assert split % 64 == 0 and split >= 256 and splits * split >= L
    assert splits == 1 or B * 4 * splits <= per_sm * 132
    if (B, L, T) == (8, 65536, 8):
        assert splits == {1: 4, 2: 8}[per_sm]


def test_split_len_rejects_a_count_below_one():
    with pytest.raises(ValueError, match="programs_per_sm"):
        default_split_len(1, 4, 4096, 132, programs_per_sm=0)


def test_default_split_len():
    # A batch with a program per SM is not split (64 requests x 4 KV heads >= 132 SMs).
    assert default_split_len(64, 4, 4096, num_rows=16 * 7) >= 4096
    # A small batch gets >= one program per SM, in whole 64-token tiles of >= 256 tokens.
    s = default_split_len(1, 4, 32768, num_rows=1 * 7)
    assert s % 64 == 0 and s >= 256 and 4 * -(-32768 // s) >= 132
    # Row chunks count as programs: 448 rows = 7 chunks of 64, so fewer splits are needed.
    s64 = default_split_len(1, 4, 32768, num_rows=64 * 7)
    assert 28 * -(-32768 // s64) >= 132 and s64 > s
    # Chunked rows (T * G > 128) cap a split at 4096 tokens even when the batch fills the GPU...
    assert default_split_len(32, 4, 8192, num_rows=64 * 7) == 4096
    assert default_split_len(8, 4, 32768, num_rows=32 * 7) <= 4096
    # ...while a single row tile keeps long splits (extra splits only add partial traffic).
    assert default_split_len(64, 4, 16384, num_rows=16 * 7) >= 16384
    assert default_split_len(1, 1, 100) == 128  # never more splits than 256-token chunks
    assert default_split_len(2, 2, 0) == 64
    # One split where the CUDA sm_90 context kernel may run (D=128, T*G <= 128): whole tiles of it, 128 tokens for
    # two warpgroups' rows (T*G > 64), 64 for one.
    assert default_split_len(64, 4, 4100, num_rows=16 * 7) == 4224
    assert default_split_len(64, 4, 4100, num_rows=8 * 7) == 4160
    # The rounding follows the CUDA glue's rule (one place holds its numbers).
    from tlt_kernels._cuda import tree_attention as cuda_rule

    for rows in (cuda_rule.CONTEXT_SM90_MIN_ROWS, 64, 65, cuda_rule.CONTEXT_SM90_MAX_ROWS, 32 * 7, 64 * 7):
        assert default_split_len(64, 4, 4100, num_rows=rows) % cuda_rule.context_tile(rows) == 0, rows
    assert cuda_rule.context_tile(65) == cuda_rule.CONTEXT_BLOCK == 128
    # ... and several splits of such rows too: whole 128-token tiles (7B heads, B=16, L=16500: the even rule's 4
    # splits of 4125 tokens round up to 4224 = 33 tiles), 64-token ones below the rule's rows (4160).
    s_ctx = default_split_len(16, 4, 16500, num_rows=16 * 7)
    assert s_ctx == 4224 and s_ctx % cuda_rule.CONTEXT_BLOCK == 0 and -(-16500 // s_ctx) == 4
    assert default_split_len(16, 4, 16500, num_rows=8 * 7) == 4160


@pytest.mark.parametrize("B,L,T,splits", [(1, 65536, 1, 64), (2, 65536, 4, 32), (4, 16384, 1, 16), (8, 16384, 8, 8),
                                          (16, 4096, 1, 4), (16, 65536, 8, 4), (2, 16384, 4, 32), (8, 4096, 4, 8)])
def test_default_split_is_even_at_two_programs_per_sm(B, L, T, splits):
    """Rows in one program, few requests, long contexts: the default gives every one of the 132 SMs two programs of
    equal splits (B x 4 KV heads x splits <= 264, lengths rounded up, no short remainder split), where that takes no
    more than ``isqrt(L) // 4`` splits (T * G <= 32) or splits of >= 1024 tokens (wider rows)."""
    split = default_split_len(B, 4, L, 132, num_rows=T * 7)
    assert -(-L // split) == splits and B * 4 * splits <= 264
    assert splits <= math.isqrt(L) // 4 if T * 7 <= 32 else split >= 1024
    assert split == default_split_len(B, 4, L, 132, num_rows=T * 7, programs_per_sm=2)
    assert L - (splits - 1) * split > split - 128  # the last split is not a remainder


@pytest.mark.parametrize("B,L,T,splits", [(1, 4096, 1, 16), (1, 16384, 1, 32), (1, 16384, 4, 32), (2, 4096, 4, 16),
                                          (4, 4096, 4, 16), (1, 1000, 1, 4)])
def test_default_split_stops_at_the_balanced_count(B, L, T, splits):
    """At most 32 query rows per KV head (T <= 4 at G = 7): where two programs per SM would take more splits, the
    default takes ``isqrt(L) // 4`` (16 at 4k, 32 at 16k: a program's serial walk over its split and the merge's over
    the splits balance there), never below 256 tokens (four at L = 1000), in whole 64-token tiles, the last split no
    remainder."""
    split = default_split_len(B, 4, L, 132, num_rows=T * 7)
    two_per_sm = default_split_len(B, 4, L, 132, num_rows=T * 7, programs_per_sm=2)
    assert split % 64 == 0 and split >= 256 and -(-L // split) == splits
    assert splits == min(math.isqrt(L) // 4, -(-L // 256)) and split >= two_per_sm
    assert L - (splits - 1) * split > split - 64


@pytest.mark.parametrize("B,L,T,splits", [(1, 4096, 1, 32), (2, 4096, 4, 32), (1, 16384, 4, 64), (2, 16384, 1, 32),
                                          (4, 4096, 1, 16), (1, 65536, 1, 64), (1, 1000, 1, 8), (1, 100, 1, 1)])
def test_default_split_over_one_byte_caches(B, L, T, splits):
    """Planned for fp8 caches (``kv_dtype``, at most 32 rows per KV head): up to twice the balanced count of splits
    (``2 * isqrt(L) // 4``: 32 at 4k, 64 at 16k), as short as 128 tokens, still within two programs per SM (32 at
    B = 2, L = 16k; 16 at B = 4, L = 4k: the two-byte split), whole 64-token tiles, the last split no remainder;
    wider rows and two-byte dtypes keep the two-byte split."""
    fp8 = torch.float8_e4m3fn
    split = default_split_len(B, 4, L, 132, num_rows=T * 7, kv_dtype=fp8)
    assert split % 64 == 0 and split >= min(128, -(-L // 64) * 64) and -(-L // split) == splits
    assert splits <= max(1, 2 * (math.isqrt(L) // 4)) and (splits == 1 or B * 4 * splits <= 264)
    assert splits == 1 or L - (splits - 1) * split > split - 64
    assert split <= default_split_len(B, 4, L, 132, num_rows=T * 7)
    assert default_split_len(B, 4, L, 132, num_rows=T * 7, kv_dtype=torch.float8_e5m2) == split
    for dtype in (torch.bfloat16, torch.float16, None):
        assert default_split_len(B, 4, L, 132, num_rows=T * 7, kv_dtype=dtype) == default_split_len(
            B, 4, L, 132, num_rows=T * 7)
    assert default_split_len(B, 4, L, 132, num_rows=8 * 7, kv_dtype=fp8) == default_split_len(B, 4, L, 132,
                                                                                              num_rows=8 * 7)


def test_kv_dtype_must_be_a_dtype():
    case = make_case([70], 1, 4, 2, 64, 16, torch.bfloat16, device="cpu")
    with pytest.raises(TypeError, match="kv_dtype"):
        make_plan(case, kv_dtype="fp8")
    with pytest.raises(TypeError, match="kv_dtype"):
        default_split_len(1, 4, 4096, kv_dtype=1)


@pytest.mark.parametrize("B,L,T", [(1, 16384, 8), (2, 16384, 8), (4, 4096, 8), (8, 4096, 8), (1, 16384, 5)])
def test_default_split_keeps_the_wave_rule_for_wider_rows(B, L, T):
    """More than 32 rows per KV head (T >= 5 at G = 7): where two programs per SM would cut splits below 1024 tokens,
    the default keeps its one-wave rounding: at least one program per SM (132), whole 64-token tiles of >= 256
    tokens, the splits' count not capped at ``isqrt(L) // 4``."""
    split = default_split_len(B, 4, L, 132, num_rows=T * 7)
    assert default_split_len(B, 4, L, 132, num_rows=T * 7, programs_per_sm=2) < 1024
    assert split % 64 == 0 and split >= 256 and B * 4 * -(-L // split) >= 132
    assert split == max(256, L // -(-132 // (B * 4)) // 64 * 64)


def test_plan_contents():
    case = make_case([130, 5], 6, 6, 2, 64, 16, torch.bfloat16, ("random",), [6, 2], device="cpu")
    plan = make_plan(case, split_len=64)
    assert (plan.batch_size, plan.num_tree, plan.group, plan.num_splits, plan.split_len) == (2, 6, 3, 3, 64)
    assert plan.partial_out.shape == (2, 2, 4, 18, 64) and plan.partial_out.dtype == torch.float32
    assert plan.partial_lse.shape == (2, 2, 4, 18)
    assert plan.split_counters.shape == (2, 2, 2) and plan.split_counters.dtype == torch.int32
    assert not plan.split_counters.any()
    assert torch.equal(plan.tree_mask, tlt_kernels.tree_ancestor_mask_packed(case["parents"], case["num_nodes"]))
    for t in (plan.tree_mask, plan.context_lens, plan.num_nodes, plan.block_table):
        assert t.dtype == torch.int32 and t.is_contiguous()


@pytest.mark.triton
def test_eager_run_launches_directly_and_compile_keeps_the_op(monkeypatch):
    """plan.run in plain eager code calls the kernel without the mutating custom op (its dispatch is host time per
    layer); TLT_DIRECT_DISPATCH=0 and torch.compile go through the op; all give the same bits."""
    import tlt_kernels._backend as backend_mod

    need_backend("tree_attention", "triton", DEVICE)
    case = make_case([40, 7], 4, 4, 2, 64, 16, torch.bfloat16, ("random",), [4, 2])
    plan = make_plan(case)
    calls = []
    real = torch.ops.tlt.tree_attention_run
    monkeypatch.setattr(torch.ops.tlt, "tree_attention_run", lambda *a: calls.append(1) or real(*a))
    direct = plan.run(case["q"], case["k_cache"], case["v_cache"], backend="triton")
    assert calls == []
    monkeypatch.setattr(backend_mod, "DIRECT_DISPATCH", False)
    through_op = plan.run(case["q"], case["k_cache"], case["v_cache"], backend="triton")
    assert calls == [1] and torch.equal(direct, through_op)
    check_against_reference(direct, case)


# -------------------------------------------------------------------------- compile / CUDA graphs
@pytest.mark.triton
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_dynamo_traces_plan_run_without_graph_breaks(backend):
    need_backend("tree_attention", backend, DEVICE)
    case = make_case([40, 7], 4, 4, 2, 64, 16, torch.bfloat16, ("random",), [4, 2])
    plan = make_plan(case)

    @torch.compile(backend="eager", fullgraph=True)
    def layer(q, k, v):
        return plan.run(q * 1.0, k, v, backend=backend) + 0.0

    check_against_reference(layer(case["q"], case["k_cache"], case["v_cache"]), case)


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_cuda_graph_capture_and_replay(backend):
    need_backend("tree_attention", backend, DEVICE)
    case = make_case([300, 1100, 4], 8, 28, 4, 128, 16, torch.bfloat16, ("random",), [8, 3, 8])
    plan = make_plan(case, split_len=256)
    q, k, v = case["q"], case["k_cache"], case["v_cache"]
    out = torch.empty_like(q)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        plan.run(q, k, v, out=out, backend=backend)  # warm-up compiles outside capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.run(q, k, v, out=out, backend=backend)
    for seed in (5, 6):
        fresh = make_case([300, 1100, 4], 8, 28, 4, 128, 16, torch.bfloat16, ("random",), [8, 3, 8], seed=seed)
        q.copy_(fresh["q"])
        k.copy_(fresh["k_cache"])
        v.copy_(fresh["v_cache"])
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check_against_reference(out, dict(case, q=q, k_cache=k, v_cache=v))


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_torch_compile(backend):
    need_backend("tree_attention", backend, DEVICE)
    case = make_case([300, 77], 8, 28, 4, 128, 16, torch.bfloat16, ("random",), [8, 5])
    plan = make_plan(case)

    @torch.compile(fullgraph=True)
    def layer(q, k, v):
        return plan.run(q * 1.0, k, v, backend=backend) + 0.0

    out = layer(case["q"], case["k_cache"], case["v_cache"])
    check_against_reference(out, case)
    # The convenience op too (graph breaks allowed around the host-side validation).
    out2 = torch.compile(tlt_kernels.tree_attention)(**case, backend=backend)
    check_against_reference(out2, case)


# ------------------------------------------------------------------------------------ validation
@pytest.fixture
def good():
    return make_case([20, 3], 4, 4, 2, 64, 16, torch.bfloat16, ("random",), [4, 2], device="cpu")


def _call(case, **override):
    args = dict(case)
    args.update(override)
    return tlt_kernels.tree_attention(**args, backend="torch")


def test_rejects_bad_dtypes(good):
    with pytest.raises(TypeError, match="q must have dtype bfloat16, float16, float32, got float64"):
        _call(good, q=good["q"].double())
    with pytest.raises(TypeError, match="k_cache must have dtype float32, got bfloat16"):
        _call(good, q=good["q"].float())  # fp32 q needs fp32 caches
    with pytest.raises(TypeError, match="k_cache must have dtype bfloat16"):
        _call(good, k_cache=good["k_cache"].half())
    with pytest.raises(TypeError, match="v_cache must have dtype bfloat16"):
        _call(good, v_cache=good["v_cache"].half())
    with pytest.raises(TypeError, match="block_table must have dtype int32, got int64"):
        _call(good, block_table=good["block_table"].long())
    with pytest.raises(TypeError, match="context_lens must have dtype int32"):
        _call(good, context_lens=good["context_lens"].long())
    with pytest.raises(TypeError, match="num_nodes must have dtype int32"):
        _call(good, num_nodes=good["num_nodes"].float())


def test_rejects_bad_shapes(good):
    with pytest.raises(ValueError, match="num_q_heads=3 must be a multiple of num_kv_heads=2"):
        _call(good, q=good["q"][:, :, :3])
    with pytest.raises(ValueError, match="head_dim"):
        _call(good, q=good["q"][..., :32])
    with pytest.raises(ValueError, match="v_cache has size"):
        _call(good, v_cache=good["v_cache"][:-1])
    with pytest.raises(ValueError, match="parents has size"):
        _call(good, parents=good["parents"][:, :3])
    with pytest.raises(ValueError, match="block_table has 1 rows"):
        _call(good, block_table=good["block_table"][:1])
    big_pages = torch.zeros(4, 129, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"block_size must be an int in \[1, 128\], got 129"):
        _call(good, k_cache=big_pages, v_cache=big_pages)
    plan = make_plan(good)
    with pytest.raises(ValueError, match="q has size 3 on dim 1"):
        plan.run(good["q"][:, :3], good["k_cache"], good["v_cache"])
    with pytest.raises(ValueError, match="k_cache has size 8 on dim 1"):
        plan.run(good["q"], good["k_cache"][:, :8], good["v_cache"][:, :8])
    with pytest.raises(ValueError, match="out has size"):
        plan.run(good["q"], good["k_cache"], good["v_cache"], out=torch.empty_like(good["q"])[:1])
    with pytest.raises(ValueError, match="stride"):
        plan.run(good["q"], good["k_cache"], good["v_cache"], out=torch.empty_like(good["q"]).transpose(2, 3).contiguous().transpose(2, 3))


def test_rejects_mixed_devices(good):
    with pytest.raises(ValueError, match="k_cache is on meta"):
        _call(good, k_cache=good["k_cache"].to("meta"), v_cache=good["v_cache"].to("meta"))
    with pytest.raises(ValueError, match="block_table is on meta"):
        _call(good, block_table=good["block_table"].to("meta"))


def test_rejects_bad_table_values(good):
    table = good["block_table"].clone()
    table[1, 0] = -1
    with pytest.raises(ValueError, match=r"block_table\[1, 0\] = -1 is used"):
        _call(good, block_table=table)
    table = good["block_table"].clone()
    table[0, 1] = good["k_cache"].shape[0]
    with pytest.raises(ValueError, match=rf"block_table\[0, 1\] = {good['k_cache'].shape[0]} is used .* num_blocks"):
        _call(good, block_table=table)
    with pytest.raises(ValueError, match="exceeds the block table's capacity"):
        _call(good, context_lens=torch.tensor([60, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"context_lens\[1\] = -2 is negative"):
        _call(good, context_lens=torch.tensor([20, -2], dtype=torch.int32))
    # Entries past a request's used range may hold anything.
    table = good["block_table"].clone()
    table[1, 1:] = -7
    check_against_reference(_call(good, block_table=table), dict(good, block_table=table))


def test_rejects_bad_trees(good):
    parents = good["parents"].clone()
    parents[1, 1] = 1
    with pytest.raises(ValueError, match="invalid tree: request 1, node 1 has parent 1"):
        _call(good, parents=parents)
    parents = good["parents"].clone()
    parents[0, 0] = 0
    with pytest.raises(ValueError, match="node 0"):
        _call(good, parents=parents)
    with pytest.raises(ValueError, match=r"num_nodes\[0\] = 0 is outside"):
        _call(good, num_nodes=torch.tensor([0, 2], dtype=torch.int32))
    # validate=False skips value checks (the caller vouches for them).
    parents = good["parents"].clone()
    parents[1, 3] = 3  # node 3 of request 1 is padding (num_nodes=2), but would be invalid if checked
    _call(good, parents=parents, validate=False)


def test_rejects_bad_plan_arguments(good):
    with pytest.raises(ValueError, match="split_len must be a positive multiple of 64, got 100"):
        make_plan(good, split_len=100)
    long = make_case([200, 3], 4, 4, 2, 64, 16, torch.bfloat16, device="cpu")
    with pytest.raises(ValueError, match="context_lens reaches 200 but max_context_len=8"):
        make_plan(long, max_context_len=8)
    with pytest.raises(ValueError, match="num_kv_heads must be a positive int"):
        plan_tree_attention(good["parents"], good["context_lens"], good["block_table"], num_q_heads=4,
                            num_kv_heads=0, head_dim=64, block_size=16)


def test_unknown_backend(good):
    with pytest.raises(ValueError, match="unknown backend 'tpu'"):
        tlt_kernels.tree_attention(**good, backend="tpu")


@pytest.mark.cuda
def test_fp32_runs_on_triton_and_cuda_refuses_it():
    """The CUDA kernel reads half precision: under "auto" fp32 inputs go to triton; asked for by name, a clear error."""
    from tlt_kernels.ops.tree_attention import _choose_backend

    need_backend("tree_attention", "triton", DEVICE)
    case = make_case([40, 3], 4, 4, 2, 64, 16, torch.float32)
    assert _choose_backend("auto", DEVICE, 4, 64, True) == "triton"
    plan = make_plan(case)
    out = poison_(torch.empty_like(case["q"]))
    run(plan, case["q"], case["k_cache"], case["v_cache"], out=out)
    check_against_reference(out, case)
    if backend_unavailable_reason("cuda", DEVICE) is None:
        with pytest.raises(ValueError, match="reads bf16/fp16; fp32 inputs run on 'triton' or 'torch'"):
            run(plan, case["q"], case["k_cache"], case["v_cache"], backend="cuda")
