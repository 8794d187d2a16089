"""tree_attention edge cases (issue 26, "no silent wrong answers"), on every backend (Triton in the CPU interpreter
without a GPU): views of every input of plan/run, NaN in the KV cache, block tables out of the cache's range, and
nonsense plan arguments. The GPU-only tests at the end cover the CUDA backend's sm_90 paths."""
import math

import pytest
import torch
from conftest import need_backend, poison_, sm90_rule_spy
from test_tree_attention import BACKENDS, DEVICE, fill_unused_slots_with_nan_, make_case, make_plan

import tlt_kernels
from tlt_kernels._triton import tree_attention as tk
from tlt_kernels.ops import tree_attention as ta
from tlt_kernels.ops.tree_attention import plan_tree_attention, run
from tlt_kernels.reference.tree_attention import tree_attention_reference
from tlt_kernels.tree import tree_ancestor_mask

# Kernel inputs: fp32 in the interpreter (which computes bf16 as zeros), bf16 on the GPU.
DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
ATOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def _case(dtype=DTYPE, seed=0, D=64, device=DEVICE, num_q_heads=4):
    """Three requests: a long context (several splits at split_len 64), a short one with padding nodes, an empty one;
    two KV heads."""
    return make_case([200, 3, 0], 6, num_q_heads, 2, D, 16, dtype, ("random", "chain", "binary"), [6, 4, 5], seed=seed,
                     device=device)


def _plan(case, **kw):
    """make_plan with every argument overridable (num_blocks included)."""
    q, k = case["q"], case["k_cache"]
    kw = dict(dict(num_q_heads=q.shape[2], num_kv_heads=k.shape[2], head_dim=q.shape[3], block_size=k.shape[1],
                   num_blocks=k.shape[0]), **kw)
    return plan_tree_attention(case["parents"], case["context_lens"], case["block_table"], case["num_nodes"], **kw)


def _run(case, backend, split_len=None, **plan_kw):
    plan = make_plan(case, split_len=split_len, **plan_kw)
    out = poison_(torch.empty_like(case["q"]))
    run(plan, case["q"], case["k_cache"], case["v_cache"], out=out, backend=backend)
    return out


def _cuda_half_only(backend, dtype):
    if backend == "cuda" and dtype == torch.float32:
        pytest.skip("the CUDA backend reads bf16/fp16")


# ------------------------------------------------------------------------------------------------- strides
def _views(case):
    """The same values as ``case``, every tensor a non-contiguous view (stride(-1) == 1 where a kernel reads in place)."""
    B, T, Hq, D = case["q"].shape
    k, v = case["k_cache"], case["v_cache"]
    kv = torch.stack([k, v], dim=1)  # [num_blocks, 2, bs, Hkv, D]: K and V interleaved per page
    wide_q = torch.zeros(B, T, Hq + 3, D, dtype=k.dtype, device=k.device)
    wide_q[:, :, 1 : 1 + Hq] = case["q"]
    table = case["block_table"]
    lens = torch.stack([case["context_lens"], case["num_nodes"]], dim=1)  # columns of stride 2
    return dict(
        q=wide_q[:, :, 1 : 1 + Hq], k_cache=kv[:, 0], v_cache=kv[:, 1],
        block_table=table.t().contiguous().t(), context_lens=lens[:, 0],
        parents=case["parents"].t().contiguous().t(), num_nodes=lens[:, 1],
    )


@pytest.mark.triton
@pytest.mark.parametrize("backend", BACKENDS)
def test_views_give_the_contiguous_result(backend):
    """plan/run on views (a slice of a wider q, K/V interleaved in one buffer, transposed tables, a strided length
    column, a slice of a wider out, and a q whose head dim is strided) give exactly the contiguous result."""
    need_backend("tree_attention", backend, DEVICE)
    _cuda_half_only(backend, DTYPE)
    case = _case()
    want = _run(case, backend, split_len=64)
    views = _views(case)
    assert not any(t.is_contiguous() for t in views.values())
    plan = plan_tree_attention(views["parents"], views["context_lens"], views["block_table"], views["num_nodes"],
                               num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16, split_len=64)
    B, T, Hq, D = case["q"].shape
    wide_out = torch.full((B, T, Hq + 2, D), 7.0, dtype=DTYPE, device=DEVICE)
    got = plan.run(views["q"], views["k_cache"], views["v_cache"], out=wide_out[:, :, 2:], backend=backend)
    assert got.data_ptr() == wide_out[:, :, 2:].data_ptr() and torch.equal(got, want)
    assert (wide_out[:, :, :2] == 7.0).all(), "run wrote outside the out view"
    q_strided = case["q"].transpose(-1, -2).contiguous().transpose(-1, -2)  # stride(-1) == T... : copied by run
    assert torch.equal(plan.run(q_strided, views["k_cache"], views["v_cache"], backend=backend), want)
    assert torch.equal(tlt_kernels.tree_attention(**views, backend=backend), tlt_kernels.tree_attention(**case, backend=backend))


@pytest.mark.triton
@pytest.mark.parametrize("backend", BACKENDS)
def test_out_sharing_memory_is_refused(backend):
    """An out whose elements share memory (an expanded view) cannot hold the result: refused, never written wrong."""
    need_backend("tree_attention", backend, DEVICE)
    case = _case(torch.float16)
    plan = make_plan(case)
    B, T, Hq, D = case["q"].shape
    shared = torch.zeros(1, 1, Hq, D, dtype=torch.float16, device=DEVICE).expand(B, T, Hq, D)
    with pytest.raises(ValueError, match=r"out has elements sharing memory .*strides \(0, 0, 64, 1\)"):
        plan.run(case["q"], case["k_cache"], case["v_cache"], out=shared, backend=backend)
    assert (shared == 0).all()


# ------------------------------------------------------------------------------------------- NaN in the cache
def _slot_location(case, b, slot):
    bs = case["k_cache"].shape[1]
    return int(case["block_table"][b, slot // bs]), slot % bs


def _expected_nan_rows(case, b, slot, kv_head):
    """bool [B, T, Hq]: the rows that attend ``slot`` of request ``b`` through KV head ``kv_head``."""
    B, T, Hq, _ = case["q"].shape
    G = Hq // case["k_cache"].shape[2]
    C, n = int(case["context_lens"][b]), int(case["num_nodes"][b])
    rows = torch.zeros(B, T, Hq, dtype=torch.bool)
    if slot < C:
        sees = torch.arange(T) < n
    else:
        sees = torch.zeros(T, dtype=torch.bool)
        sees[:n] = tree_ancestor_mask(case["parents"][b : b + 1, :n].cpu())[0][:, slot - C]
    rows[b, :, kv_head * G : (kv_head + 1) * G] = sees[:, None]
    return rows


def _check_nan_contract(out, case, clean_ref, nan_rows):
    """Rows that attend the poisoned slot hold a NaN; every other row is finite and equals the NaN-free result."""
    got_nan = out.isnan().any(-1).cpu()
    assert torch.equal(got_nan, nan_rows), (
        f"rows with NaN {got_nan.nonzero().tolist()} != rows that attend the NaN {nan_rows.nonzero().tolist()}")
    fine = ~nan_rows.to(out.device)
    assert torch.isfinite(out[fine]).all()
    err = (out[fine].float() - clean_ref[fine]).abs().max().item()
    assert err <= ATOL[out.dtype], f"rows that do not attend the NaN moved: max error {err:.3g}"


# (which cache, request, slot, KV head): slot 70 is in the context's second 64-token split, slot 200 + 2 is tree
# node 2 of request 0, slot 3 + 0 the root of request 1 (a one-split request next to a split one).
NAN_SITES = {
    "K-context": ("k_cache", 0, 70, 1), "V-context": ("v_cache", 0, 70, 1),
    "K-context-last-split": ("k_cache", 0, 199, 0), "V-context-first-slot": ("v_cache", 0, 0, 0),
    "K-tree": ("k_cache", 0, 202, 1), "V-tree": ("v_cache", 0, 202, 1),
    "V-tree-root": ("v_cache", 1, 3, 0), "K-tree-leaf": ("k_cache", 2, 4, 1),
}


def _case_with_nan_at(site):
    """The test case with a NaN at ``NAN_SITES[site]`` and NaN / inf garbage in every unattended slot: ``(case, the
    NaN-free fp32 result, bool [B, T, Hq] rows that attend the NaN)``."""
    which, b, slot, kv_head = NAN_SITES[site]
    case = _case()
    clean_ref = tree_attention_reference(**case, out_dtype=torch.float32)
    fill_unused_slots_with_nan_(case)
    _fill_unused_slots_with_inf_(case)
    page, off = _slot_location(case, b, slot)
    case[which][page, off, kv_head, 5] = math.nan
    return case, clean_ref, _expected_nan_rows(case, b, slot, kv_head)


@pytest.mark.triton
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("split_len", [64, 128, None], ids=["4-splits", "2-splits", "1-split"])
@pytest.mark.parametrize("site", list(NAN_SITES))
def test_nan_in_an_attended_slot_reaches_exactly_its_rows(backend, split_len, site):
    """A NaN in the K or V of one live slot (context or tree): every row that attends it holds NaN, every other row
    equals the NaN-free result, with NaN and inf garbage in every unattended slot (past the context, padding nodes'
    slots, spare pages) that must never reach the output."""
    need_backend("tree_attention", backend, DEVICE)
    _cuda_half_only(backend, DTYPE)
    case, clean_ref, nan_rows = _case_with_nan_at(site)
    _check_nan_contract(_run(case, backend, split_len), case, clean_ref, nan_rows)
    if backend == "torch":  # the reference follows the same contract
        _check_nan_contract(tree_attention_reference(**case), case, clean_ref, nan_rows)


@pytest.mark.triton
@pytest.mark.parametrize("max_splits", [2, 64], ids=["two-per-trip", "one-trip"])
@pytest.mark.parametrize("site", list(NAN_SITES))
def test_nan_contract_of_the_wide_merge(site, max_splits, monkeypatch):
    """The Triton merge kernel that reads the splits side by side (``WIDE_MERGE_MIN_SPLITS``) keeps the NaN contract:
    a NaN in one split's LSE or rows reaches exactly the rows that attend it, garbage in unattended slots nowhere."""
    need_backend("tree_attention", "triton", DEVICE)
    monkeypatch.setattr(tk, "FUSED_MERGE", 0)
    monkeypatch.setattr(tk, "WIDE_MERGE_MIN_SPLITS", 2)
    monkeypatch.setattr(tk, "WIDE_MERGE_MAX_SPLITS", max_splits)
    case, clean_ref, nan_rows = _case_with_nan_at(site)
    _check_nan_contract(_run(case, "triton", 64), case, clean_ref, nan_rows)


def _fill_unused_slots_with_inf_(case):
    """Half of the NaN-filled unused slots become +inf / -inf instead (0 * inf is NaN too)."""
    g = torch.Generator().manual_seed(3)
    for t in (case["k_cache"], case["v_cache"]):
        nan = t.isnan()
        flip = (torch.rand(t.shape, generator=g) < 0.5).to(t.device)
        t[nan & flip] = math.inf
        t[nan & flip & (torch.arange(t.shape[-1], device=t.device) % 2 == 0)] = -math.inf


@pytest.mark.triton
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("split_len", [64, None], ids=["4-splits", "1-split"])
def test_nan_in_every_split_of_a_request(backend, split_len):
    """A NaN in each of a request's splits (every partial LSE NaN): the merge must still give NaN, not zeros."""
    need_backend("tree_attention", backend, DEVICE)
    _cuda_half_only(backend, DTYPE)
    case = _case()
    clean_ref = tree_attention_reference(**case, out_dtype=torch.float32)
    nan_rows = torch.zeros(case["q"].shape[:3], dtype=torch.bool)
    for slot in (10, 70, 130, 190):
        page, off = _slot_location(case, 0, slot)
        case["k_cache"][page, off, 0, 0] = math.nan
        nan_rows |= _expected_nan_rows(case, 0, slot, 0)
    _check_nan_contract(_run(case, backend, split_len), case, clean_ref, nan_rows)


# ----------------------------------------------------------------------------------- block tables out of range
@pytest.mark.triton
@pytest.mark.parametrize("backend", BACKENDS)
def test_out_of_range_page_raises_at_run_when_the_plan_had_no_num_blocks(backend):
    """plan without num_blocks (it cannot know the cache), then run with a used entry past the cache: a ValueError
    naming block_table, the request, the entry, the value and [0, num_blocks), from the plan's record of the table
    (no sync at run). Entries a request does not use may hold anything."""
    need_backend("tree_attention", backend, DEVICE)
    _cuda_half_only(backend, DTYPE)
    case = _case()
    nb = case["k_cache"].shape[0]
    table = case["block_table"].clone()
    table[2, 1:] = 10 * nb  # request 2 uses one page: junk in the rest is fine
    table[1, 0] = nb + 4
    plan = plan_tree_attention(case["parents"], case["context_lens"], table, case["num_nodes"], num_q_heads=4,
                               num_kv_heads=2, head_dim=64, block_size=16)
    with pytest.raises(ValueError, match=rf"block_table\[1, 0\] = {nb + 4} is used \(request 1 .*\) but not in "
                                         rf"\[0, num_blocks={nb}\) \(k_cache.shape\[0\]\)"):
        plan.run(case["q"], case["k_cache"], case["v_cache"], backend=backend)
    table[1, 0] = case["block_table"][1, 0]
    plan = plan_tree_attention(case["parents"], case["context_lens"], table, case["num_nodes"], num_q_heads=4,
                               num_kv_heads=2, head_dim=64, block_size=16)
    out = plan.run(case["q"], case["k_cache"], case["v_cache"], backend=backend)
    ref = tree_attention_reference(**case, out_dtype=torch.float32)
    assert (out.float() - ref).abs().max() <= ATOL[DTYPE]


@pytest.mark.triton
@pytest.mark.parametrize("backend", BACKENDS)
def test_unchecked_out_of_range_page_is_never_read_and_gives_nan(backend):
    """validate=False (the host never reads the table): a used entry out of [0, num_blocks) is not read (the
    interpreter segfaulted, a GPU would read past the cache) and its request's rows come out NaN; the other requests
    are exact."""
    need_backend("tree_attention", backend, DEVICE)
    _cuda_half_only(backend, DTYPE)
    case = _case()
    ref = tree_attention_reference(**case, out_dtype=torch.float32)
    nb = case["k_cache"].shape[0]
    for b, col, value in ((0, 3, nb), (1, 0, -1), (0, 12, 1 << 30)):  # (0, 12): the tree's page of request 0
        table = case["block_table"].clone()
        table[b, col] = value
        for split_len in (64, None):
            plan = make_plan(dict(case, block_table=table), split_len=split_len, validate=False)
            out = plan.run(case["q"], case["k_cache"], case["v_cache"], backend=backend)
            n = int(case["num_nodes"][b])
            assert out[b, :n].isnan().any(-1).all(), f"request {b}: rows not NaN with block_table[{b}, {col}] = {value}"
            assert (out[b, n:] == 0).all()
            others = torch.arange(3, device=DEVICE) != b
            assert (out[others].float() - ref[others]).abs().max() <= ATOL[DTYPE]


@pytest.mark.triton
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fp8", [None, torch.float8_e4m3fn], ids=str)
def test_unchecked_out_of_range_page_past_a_splits_first_page_scan(backend, fp8):
    """A split of more than ``PAGE_SCAN`` pages (pages of 2 tokens): the Triton context loop only clamps its page ids
    and tests them after the loop, ``PAGE_SCAN`` a load (over fp8 caches the first ``PAGE_SCAN`` before it, their flag
    carried by ``l``); an out-of-range id in the first load, a later one, or the masked tail tile makes the request's
    rows NaN, and the other request stays exact."""
    need_backend("tree_attention", backend, DEVICE)
    dtype = torch.bfloat16 if fp8 else DTYPE  # fp8 caches take bf16/fp16 rows
    _cuda_half_only(backend, dtype)
    case = make_case([700, 90], 3, 4, 2, 64, 2, dtype, ("chain",), device=DEVICE)
    if fp8:
        case = dict(case, k_cache=case["k_cache"].to(fp8), v_cache=case["v_cache"].to(fp8))
    ref = tree_attention_reference(**dict(case, k_cache=case["k_cache"].float(), v_cache=case["v_cache"].float(),
                                          q=case["q"].float()), out_dtype=torch.float32)
    nb = case["k_cache"].shape[0]
    scan = tk.PAGE_SCAN.value
    assert scan + 40 < 640 // 2, "the split below must hold more pages than one scan"
    for col, value in ((5, nb), (scan + 40, -7), (349, nb + 2)):  # first scan, after it, the tail tile
        table = case["block_table"].clone()
        table[0, col] = value
        plan = make_plan(dict(case, block_table=table), split_len=640, validate=False)
        out = plan.run(case["q"], case["k_cache"], case["v_cache"], backend=backend)
        assert out[0].isnan().any(-1).all(), f"rows not NaN with block_table[0, {col}] = {value}"
        assert (out[1].float() - ref[1]).abs().max() <= ATOL[dtype]


@pytest.mark.triton
def test_page_check_of_a_plan_built_during_capture(monkeypatch):
    """A plan built while a CUDA graph was captured could not read the table; its first run outside capture reads it
    once, and later runs check against that record without reading it again."""
    case = _case(torch.float32, device="cpu")
    nb = case["k_cache"].shape[0]
    table = case["block_table"].clone()
    table[0, 2] = nb
    monkeypatch.setattr(ta, "_capturing", lambda: True)
    plan = _plan(dict(case, block_table=table), num_blocks=None, max_context_len=256)
    assert plan.max_page is None and plan.check_pages_at_run
    monkeypatch.setattr(ta, "_capturing", lambda: False)
    with pytest.raises(ValueError, match=rf"block_table\[0, 2\] = {nb} is used"):
        plan.run(case["q"], case["k_cache"], case["v_cache"], backend="torch")
    assert plan.max_page == (nb, 0, 2)
    bigger = torch.cat([case["k_cache"], case["k_cache"][:1]])
    reads = []
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self, *a, **k: reads.append(1) or self.to("cpu"))
    plan.run(case["q"], bigger, bigger, backend="torch")  # nb + 1 pages: in range now, and no second read
    assert reads == []


@pytest.mark.triton
@pytest.mark.parametrize("backend", BACKENDS)
def test_cache_page_count_must_match_the_plan(backend):
    need_backend("tree_attention", backend, DEVICE)
    _cuda_half_only(backend, DTYPE)
    case = _case()
    nb = case["k_cache"].shape[0]
    plan = make_plan(case)  # num_blocks=nb
    k, v = (torch.cat([t, t[:1]]) for t in (case["k_cache"], case["v_cache"]))
    with pytest.raises(ValueError, match=rf"k_cache has {nb + 1} blocks but the plan was built with num_blocks={nb}"):
        plan.run(case["q"], k, v, backend=backend)
    with pytest.raises(ValueError, match=r"k_cache has no blocks"):
        _plan(case, num_blocks=None).run(case["q"], case["k_cache"][:0], case["v_cache"][:0], backend=backend)


# ------------------------------------------------------------------------------------------- plan arguments
@pytest.mark.parametrize("name,value,message", [
    ("block_size", 0, r"block_size must be an int in \[1, 128\], got 0"),
    ("block_size", True, r"block_size must be an int in \[1, 128\], got True"),
    ("block_size", 16.0, r"block_size must be an int in \[1, 128\], got 16.0"),
    ("head_dim", 0, "head_dim must be a positive int, got 0"),
    ("num_q_heads", -4, "num_q_heads must be a positive int, got -4"),
    ("num_kv_heads", 0, "num_kv_heads must be a positive int, got 0"),
    ("split_len", 0, "split_len must be a positive multiple of 64, got 0"),
    ("split_len", 96, "split_len must be a positive multiple of 64, got 96"),
    ("max_context_len", -1, r"max_context_len must be a non-negative int \(or None\), got -1"),
    ("num_blocks", -1, r"num_blocks must be a non-negative int \(or None\), got -1"),
    ("num_blocks", 2.5, r"num_blocks must be a non-negative int \(or None\), got 2.5"),
    ("validate", "yes", "validate must be True or False, got 'yes'"),
])
def test_nonsense_plan_arguments(name, value, message):
    """Each raises a ValueError naming the parameter, the value and what is allowed (before anything divides by it)."""
    case = _case(torch.float32, device="cpu")
    kw = dict(num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16)
    kw[name] = value
    with pytest.raises(ValueError, match=message):
        plan_tree_attention(case["parents"], case["context_lens"], case["block_table"], case["num_nodes"], **kw)


@pytest.mark.triton
@pytest.mark.parametrize("value", ["big", math.nan, math.inf, -0.5, True, torch.ones(3)], ids=str)
def test_bad_sm_scale_is_refused(value):
    """A negative scale made the Triton kernel's running max (kept on unscaled scores) a minimum: NaN where the
    reference is finite. Non-numbers, NaN and inf are refused the same way, naming sm_scale."""
    need_backend("tree_attention", "triton", DEVICE)
    case = _case(torch.float32)
    plan = make_plan(case)
    for backend in ("torch", "triton"):
        with pytest.raises(ValueError, match=r"sm_scale must be a finite number >= 0 \(or None for 1/sqrt\(head_dim\)\)"):
            plan.run(case["q"], case["k_cache"], case["v_cache"], sm_scale=value, backend=backend)


@pytest.mark.parametrize("name,value", [("context_lens", 1.5), ("context_lens", [200, 3.5, 0]), ("num_nodes", 2**31),
                                        ("num_nodes", [6, True, 5])])
def test_per_request_counts_must_be_int32_integers(name, value):
    """A float count was truncated (1.5 -> 1) and one past int32 overflowed: refused, naming the argument."""
    case = _case(torch.float32, device="cpu")
    with pytest.raises(ValueError, match=rf"{name} must hold int32 integers .*got {value if isinstance(value, (int, float)) else ''}"):
        tlt_kernels.tree_attention(**dict(case, **{name: value}))


def test_invalid_tree_names_parents():
    case = _case(torch.float32, device="cpu")
    parents = case["parents"].clone()
    parents[1, 2] = 2
    with pytest.raises(ValueError, match=r"^parents: invalid tree: request 1, node 2 has parent 2"):
        tlt_kernels.tree_attention(**dict(case, parents=parents))


# ------------------------------------------------------------------------------------- CUDA sm_90 paths (GPU)
SM90_PATHS = ["mma-sync", "64", "128", "128-ws", "128-ws-tma"]


def _force_cuda_path(monkeypatch, path):
    """The CUDA backend's kernel for these tests: mma.sync, or the sm_90 kernel at a tile width / build."""
    from tlt_kernels._cuda import tree_attention as cuda_ta

    used = sm90_rule_spy(monkeypatch, path != "mma-sync")
    ws = path.startswith("128-ws")
    monkeypatch.setattr(cuda_ta, "CONTEXT_WARP_SPECIALIZED", ws)
    monkeypatch.setattr(cuda_ta, "CONTEXT_TMA", path == "128-ws-tma")
    block = 64 if path == "64" else 128
    monkeypatch.setattr(cuda_ta, "CONTEXT_BLOCK", block)
    monkeypatch.setattr(cuda_ta, "CONTEXT_BLOCK_FEW_ROWS", block)
    return used


def _sm90_case(seed=0, wide=False):
    """D=128 (the sm_90 kernels' head dim), 16-token pages, T*G = 6*7 = 42 rows (wide: 32*7 = 224, two 128-row blocks
    of the warp-specialized kernel): a long context over several 128-token splits, a short one with padding nodes,
    an empty one."""
    T, n = (32, [32, 20, 9]) if wide else (6, [6, 4, 5])
    return make_case([700, 3, 0], T, 14, 2, 128, 16, torch.bfloat16, ("random", "chain", "binary"), n, seed=seed)


@pytest.mark.cuda
@pytest.mark.parametrize("path", SM90_PATHS + ["128-ws-wide", "128-ws-tma-wide"])
@pytest.mark.parametrize("split_len", [128, 768], ids=["6-splits", "1-split"])
@pytest.mark.parametrize("site", ["K-context", "V-context", "K-tree", "V-tree", "V-tree-root", "K-tree-leaf"])
def test_nan_contract_on_cuda_paths(path, split_len, site, monkeypatch):
    """The NaN contract through each CUDA kernel (NaN/inf garbage in unattended slots, one NaN in a live slot)."""
    need_backend("tree_attention", "cuda", DEVICE)
    wide = path.endswith("-wide")
    path = path.removesuffix("-wide")
    used = _force_cuda_path(monkeypatch, path)
    which, b, slot, kv_head = NAN_SITES[site]
    case = _sm90_case(wide=wide)
    slot = slot + 500 if slot >= 200 else slot  # request 0's context is 700 here
    clean_ref = tree_attention_reference(**case, out_dtype=torch.float32)
    fill_unused_slots_with_nan_(case)
    _fill_unused_slots_with_inf_(case)
    page, off = _slot_location(case, b, slot)
    case[which][page, off, kv_head, 5] = math.nan
    _check_nan_contract(_run(case, "cuda", split_len), case, clean_ref, _expected_nan_rows(case, b, slot, kv_head))
    assert used and all(used) == (path != "mma-sync")


@pytest.mark.cuda
@pytest.mark.parametrize("path", SM90_PATHS)
def test_unchecked_out_of_range_page_on_cuda_paths(path, monkeypatch):
    """validate=False and a used page id past the cache (or negative): never read, the request's rows NaN."""
    need_backend("tree_attention", "cuda", DEVICE)
    _force_cuda_path(monkeypatch, path)
    case = _sm90_case()
    ref = tree_attention_reference(**case, out_dtype=torch.float32)
    nb = case["k_cache"].shape[0]
    for b, col, value in ((0, 3, nb), (0, 44, -1), (1, 0, 1 << 30)):  # (0, 44): the tree's page of request 0
        table = case["block_table"].clone()
        table[b, col] = value
        for split_len in (128, 768):
            out = make_plan(dict(case, block_table=table), split_len=split_len, validate=False).run(
                case["q"], case["k_cache"], case["v_cache"], backend="cuda")
            n = int(case["num_nodes"][b])
            assert out[b, :n].isnan().any(-1).all() and (out[b, n:] == 0).all(), (b, col, value, split_len)
            others = torch.arange(3, device=DEVICE) != b
            assert (out[others].float() - ref[others]).abs().max() <= ATOL[torch.bfloat16]


@pytest.mark.cuda
@pytest.mark.parametrize("backend", BACKENDS)
def test_replayed_graph_with_an_out_of_range_page(backend):
    """A captured run replayed after the table changed (no host check possible): an out-of-range used page gives
    NaN rows for its request, the others stay exact, and the process survives (no illegal address)."""
    need_backend("tree_attention", backend, DEVICE)
    case = _sm90_case()
    ref = tree_attention_reference(**case, out_dtype=torch.float32)
    table = case["block_table"]
    plan = make_plan(case, split_len=128)
    q, k, v = case["q"], case["k_cache"], case["v_cache"]
    out = torch.empty_like(q)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        plan.run(q, k, v, out=out, backend=backend)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.run(q, k, v, out=out, backend=backend)
    saved = int(table[0, 5])
    table[0, 5] = k.shape[0] + 1000
    graph.replay()
    torch.cuda.synchronize()
    assert out[0, :6].isnan().any(-1).all()
    assert (out[1:].float() - ref[1:]).abs().max() <= ATOL[torch.bfloat16]
    table[0, 5] = saved
    graph.replay()
    torch.cuda.synchronize()
    assert (out.float() - ref).abs().max() <= ATOL[torch.bfloat16]
