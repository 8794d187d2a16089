"""The tree-attention suite's FlashInfer 0.6 peers on the CPU: the XQA call and the decode wrapper get our inputs in
the layout FlashInfer documents (``trtllm_batch_decode_with_kv_cache``: the draft block is the last ``T`` tokens of
each sequence, its mask bit-packed as uint16 half-words of 32-bit rows; ``BatchDecodeWithPagedKVCacheWrapper``:
CSR page indices and the last page's length). The fakes below compute what those documents say in torch; the suite's
rows must then match the tlt reference, and a peer's failure is a note, not a row."""
from types import SimpleNamespace

import pytest
import torch

from bench.suites import tree_attention as suite
from conftest import kernel_devices
from tlt_kernels.tree import tree_ancestor_mask


def _attend(q, k, v, visible, scale):
    """q ``[T, Hq, D]``, k/v ``[N, Hkv, D]``, visible ``bool [T, N]`` -> ``[T, Hq, D]`` (fp32, GQA)."""
    group = q.shape[1] // k.shape[1]
    kk, vv = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
    scores = torch.einsum("thd,nhd->htn", q.float(), kk) * scale
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("htn,nhd->thd", probs, vv)


def _xqa(query, kv_cache, workspace, block_tables, seq_lens, max_seq_len, *, bmm1_scale, bmm2_scale, kv_layout,
         backend, q_len_per_req, mask):
    """FlashInfer's documented XQA speculative decode: row i of request b sees every token before the draft block
    and draft token j where bit j of its mask row is set."""
    assert backend == "xqa" and kv_layout == "NHD" and bmm2_scale == 1.0
    assert workspace.dtype == torch.uint8 and not workspace.any() and seq_lens.dtype == torch.uint32
    k_cache, v_cache = kv_cache
    page = k_cache.shape[1]
    T = q_len_per_req
    B = query.shape[0] // T
    assert mask.dtype == torch.uint16 and mask.shape == (B, T, 2 * (-(-T // 32)))
    words = mask.view(torch.int32).to(torch.int64) & 0xFFFFFFFF  # [B, T, W]: rows aligned to 32 bits
    out = torch.empty(B * T, *query.shape[1:], device=query.device)
    for b in range(B):
        n = int(seq_lens[b].to(torch.int64))
        slots = torch.arange(n, device=query.device)
        rows = block_tables[b, slots // page].long() * page + slots % page
        k = k_cache.reshape(-1, *k_cache.shape[2:])[rows]
        v = v_cache.reshape(-1, *v_cache.shape[2:])[rows]
        j = torch.arange(T, device=query.device)
        draft = ((words[b][:, j // 32] >> (j % 32)) & 1).bool()  # [T, T]
        visible = torch.cat([torch.ones(T, n - T, dtype=torch.bool, device=query.device), draft], 1)
        out[b * T:(b + 1) * T] = _attend(query[b * T:(b + 1) * T], k, v, visible, bmm1_scale)
    return out


class _DecodeWrapper:
    """FlashInfer's documented decode wrapper: request b reads pages indices[indptr[b]:indptr[b+1]], all full but
    the last, which holds last_page_len[b] tokens."""

    def __init__(self, workspace, layout, use_tensor_cores=False):
        assert layout == "NHD"
        self.use_tensor_cores = use_tensor_cores

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *, q_data_type,
             kv_data_type):
        # FlashInfer's CUDA-core decode builds GQA group sizes 1, 2, 3, 4 and 8 only (its documented dispatch).
        assert self.use_tensor_cores or num_qo_heads // num_kv_heads in (1, 2, 3, 4, 8)
        self.indptr, self.indices, self.last, self.page = indptr, indices, last_page_len, page_size

    def run(self, q, kv):
        k_cache, v_cache = kv
        out = torch.empty(q.shape, device=q.device)
        for b in range(q.shape[0]):
            pages = self.indices[self.indptr[b]:self.indptr[b + 1]].long()
            n = (len(pages) - 1) * self.page + int(self.last[b])
            k, v = k_cache[pages].flatten(0, 1)[:n], v_cache[pages].flatten(0, 1)[:n]
            visible = torch.ones(1, n, dtype=torch.bool, device=q.device)
            out[b] = _attend(q[b:b + 1], k, v, visible, q.shape[-1] ** -0.5)[0]
        return out


class _Ctx:
    device = torch.device("cpu")  # timing stays eager (no graph capture of the fakes), whatever device the data is on
    copy_bandwidth = None  # no HBM floor, as on a CPU

    def __init__(self):
        self.rows, self.notes = [], []

    def time_ms(self, fn):
        fn()
        return 1.0

    def add(self, case, impl, ms, **columns):
        self.rows.append((impl, ms, columns))

    def note(self, text):
        self.notes.append(text)


FAKE = SimpleNamespace(decode=SimpleNamespace(trtllm_batch_decode_with_kv_cache=_xqa),
                       BatchDecodeWithPagedKVCacheWrapper=_DecodeWrapper)


@pytest.mark.parametrize("B,L,T,Hq", [(2, 37, 5, 4), (1, 100, 33, 4), (3, 16, 8, 14)])
def test_xqa_and_decode_peers_match_the_tlt_rows(B, L, T, Hq):
    """XQA with the packed tree mask equals our tree attention (T > 32 spans two mask words); the decode wrapper over
    L + 1 tokens equals our T = 1 plan (GQA group 7, Qwen2.5-7B's, through its tensor-core decode); each gets one
    row."""
    Hkv, D = 2, 16
    inp = suite._make_inputs(B, L, T, Hq, Hkv, D, torch.float32, torch.device("cpu"))
    case = {"model": "test", "B": B, "L": L, "T": T}
    plan_for = suite._planner(inp, L)
    reference = plan_for().run(inp["q"], inp["k_cache"], inp["v_cache"], backend="torch")
    decode_reference = plan_for(parents=inp["parents"][:, :1].contiguous()).run(
        inp["q"][:, :1].contiguous(), inp["k_cache"], inp["v_cache"], backend="torch")
    ctx, extra = _Ctx(), lambda ms: {}
    suite._bench_flashinfer_xqa(ctx, FAKE, case, inp, reference, 1, extra)
    suite._bench_flashinfer_decode(ctx, FAKE, case, inp, decode_reference, 1, extra)
    assert ctx.notes == [] and [impl for impl, _, _ in ctx.rows] == ["flashinfer-xqa", "flashinfer decode (T=1)"]


def test_xqa_mask_bits_are_the_ancestor_mask():
    """Half-word h of row i, bit b: node i sees node 16 h + b; rows padded to 32 bits."""
    parents = suite._random_parents(3, 40, torch.Generator().manual_seed(1))
    mask = suite.xqa_tree_mask(parents)
    assert mask.dtype == torch.uint16 and mask.shape == (3, 40, 4)
    halves = mask.view(torch.int16).to(torch.int64) & 0xFFFF
    bits = ((halves.unsqueeze(-1) >> torch.arange(16)) & 1).flatten(-2)[..., :40].bool()
    assert torch.equal(bits, tree_ancestor_mask(parents))


def test_a_peer_that_disagrees_is_a_note_not_a_row():
    """A peer whose output differs from the tlt result is reported and never timed."""
    inp = suite._make_inputs(1, 20, 4, 4, 2, 16, torch.float32, torch.device("cpu"))
    case = {"model": "test", "B": 1, "L": 20, "T": 4}
    ctx = _Ctx()
    suite._bench_flashinfer_xqa(ctx, FAKE, case, inp, torch.zeros_like(inp["q"]), 1, lambda ms: {})
    assert ctx.rows == [] and len(ctx.notes) == 1 and "flashinfer-xqa skipped" in ctx.notes[0]


@pytest.mark.triton
def test_fp8_rows_check_against_the_exact_widening_and_feed_the_xqa_peer():
    """``tlt-triton fp8`` (and ``tlt-cuda fp8`` where the extension runs, else a note) runs over e4m3 caches, is
    checked against the kernel over their bf16 widening, and counts one byte per K/V element; XQA gets the fp8 caches
    and is checked against it. One 64-token split, for two-byte and one-byte caches alike: no split-rule row."""
    B, L, T, Hq, Hkv, D = 2, 40, 5, 4, 2, 64
    # The kernel device: the GPU where there is one (the interpreter is off there), else the CPU's interpreter.
    inp = suite._make_inputs(B, L, T, Hq, Hkv, D, torch.bfloat16, torch.device(kernel_devices()[0]))
    case = {"model": "test", "B": B, "L": L, "T": T}
    plan_for = suite._planner(inp, L)
    cost = SimpleNamespace(B=B, L=L, Hq=Hq, Hkv=Hkv, D=D, extra=lambda ms: {})
    ctx = _Ctx()
    ctx.try_import = lambda name: FAKE
    suite._bench_fp8(ctx, case, plan_for(), plan_for, inp, cost, peers=True)
    from tlt_kernels._backend import backend_unavailable_reason

    why = backend_unavailable_reason("cuda", inp["q"].device)  # the CUDA row runs where the extension does
    assert ctx.notes == ([] if why is None else [f"tlt-cuda fp8 not run: {why}"])
    # D = 64: no 128-key config for its tile, so no key-tile row.
    assert [impl for impl, _, _ in ctx.rows] == ["tlt-triton fp8", "tlt-triton fp8 (e4m3 key products)"] + (
        ["tlt-cuda fp8"] if why is None else []) + ["flashinfer-xqa fp8"]
    assert ctx.rows[0][2]["bytes_moved"] == B * (L + T) * Hkv * D * 2 + 2 * B * T * Hq * D * 2
    assert ctx.rows[1][2]["bytes_moved"] == ctx.rows[0][2]["bytes_moved"]


@pytest.mark.triton
def test_fp8_rows_run_the_one_byte_plan_and_time_the_two_byte_split():
    """Where a plan for e4m3 caches splits otherwise (one request, 7 rows per KV head, 600 tokens: 128-token splits
    against 256), the ``tlt-triton fp8`` row runs it and ``tlt-triton fp8 (two-byte split)`` the bf16 rows' plan, both
    checked against the widened caches."""
    B, L, T, Hq, Hkv, D = 1, 600, 1, 14, 2, 128
    inp = suite._make_inputs(B, L, T, Hq, Hkv, D, torch.bfloat16, torch.device(kernel_devices()[0]))
    plan_for = suite._planner(inp, L)
    two_byte = plan_for()
    assert (two_byte.split_len, plan_for(kv_dtype=torch.float8_e4m3fn).split_len) == (256, 128)
    cost = SimpleNamespace(B=B, L=L, Hq=Hq, Hkv=Hkv, D=D, extra=lambda ms: {})
    ctx = _Ctx()
    suite._bench_fp8(ctx, {"model": "test", "B": B, "L": L, "T": T}, two_byte, plan_for, inp, cost, peers=False)
    rows = {impl: extra for impl, _, extra in ctx.rows}
    assert list(rows)[:2] == ["tlt-triton fp8", "tlt-triton fp8 (two-byte split)"]
    assert (rows["tlt-triton fp8"]["split_len"], rows["tlt-triton fp8 (two-byte split)"]["split_len"]) == (128, 256)
    assert not [n for n in ctx.notes if "failed" in n]


@pytest.mark.triton
def test_fp8_key_product_rule_row_times_the_other_side():
    """Where the default multiplies e4m3 keys as stored (D = 128, a 64-row tile: here 35 rows), the rule's row is the
    kernel with the keys widened, timed under that name and checked like the default row; the rule is restored."""
    import tlt_kernels._triton.tree_attention as tk
    from tlt_kernels.ops.tree_attention import plan_tree_attention

    B, L, T, Hq, Hkv, D = 1, 40, 5, 14, 2, 128
    inp = suite._make_inputs(B, L, T, Hq, Hkv, D, torch.bfloat16, torch.device(kernel_devices()[0]))
    plan = plan_tree_attention(inp["parents"], inp["context_lens"], inp["block_table"], num_q_heads=Hq,
                               num_kv_heads=Hkv, head_dim=D, block_size=suite.PAGE, max_context_len=L)
    k8, v8 = inp["k_cache"].to(torch.float8_e4m3fn), inp["v_cache"].to(torch.float8_e4m3fn)
    widened = plan.run(inp["q"], k8.to(torch.bfloat16), v8.to(torch.bfloat16), backend="triton")
    assert tk.uses_fp8_key_products(torch.bfloat16, k8.dtype, D, 64)
    before = tk.FP8_KEY_PRODUCT_TILES
    ctx = _Ctx()
    suite._bench_fp8_key_product_rule(ctx, {"model": "test", "B": B, "L": L, "T": T}, plan, inp["q"], k8, v8,
                                      widened, 123, SimpleNamespace(extra=lambda ms: {}))
    assert [impl for impl, _, _ in ctx.rows] == ["tlt-triton fp8 (keys widened)"] and ctx.notes == []
    assert ctx.rows[0][2]["bytes_moved"] == 123 and tk.FP8_KEY_PRODUCT_TILES is before


@pytest.mark.triton
@pytest.mark.parametrize("split_len", [64, 4096])
def test_fp8_wide_tile_rule_row_times_the_other_side(split_len):
    """Where the row tile has a 128-key config over e4m3 caches (D = 128, 14 rows), the rule's row is the other key
    tile for the plan's split length, checked against the widened output; the threshold is restored."""
    import tlt_kernels._triton.tree_attention as tk
    from tlt_kernels.ops.tree_attention import plan_tree_attention

    B, L, T, Hq, Hkv, D = 1, 70, 2, 14, 2, 128
    inp = suite._make_inputs(B, L, T, Hq, Hkv, D, torch.bfloat16, torch.device(kernel_devices()[0]))
    plan = plan_tree_attention(inp["parents"], inp["context_lens"], inp["block_table"], num_q_heads=Hq,
                               num_kv_heads=Hkv, head_dim=D, block_size=suite.PAGE, max_context_len=L,
                               split_len=split_len)
    k8, v8 = inp["k_cache"].to(torch.float8_e4m3fn), inp["v_cache"].to(torch.float8_e4m3fn)
    widened = plan.run(inp["q"], k8.to(torch.bfloat16), v8.to(torch.bfloat16), backend="triton")
    wide = tk.kernel_config(D, T * Hq // Hkv, e4m3_split_len=split_len)[2] == 128
    assert wide == (split_len >= tk.FP8_WIDE_TILE_MIN_SPLIT)
    before = tk.FP8_WIDE_TILE_MIN_SPLIT
    ctx = _Ctx()
    suite._bench_fp8_wide_tile_rule(ctx, {"model": "test", "B": B, "L": L, "T": T}, plan, inp["q"], k8, v8, widened,
                                    123, SimpleNamespace(extra=lambda ms: {}))
    name = "tlt-triton fp8 (64-key tiles)" if wide else "tlt-triton fp8 (128-key tiles)"
    assert [impl for impl, _, _ in ctx.rows] == [name] and ctx.notes == []
    assert tk.FP8_WIDE_TILE_MIN_SPLIT == before
    assert all(columns["timing"] == "eager" for _, _, columns in ctx.rows)


class _GraphCtx(_Ctx):
    """A CUDA context whose graph timing works or fails on demand (no GPU needed: the capture is faked)."""

    device = torch.device("cuda")
    params = None

    def __init__(self, capture_fails):
        super().__init__()
        self.capture_fails = capture_fails

    def time_graph_ms(self, fn):
        if self.capture_fails:
            raise RuntimeError("operation not permitted when stream is capturing")
        return 0.5

    def time_ms(self, fn):
        return 2.0


@pytest.mark.parametrize("capture_fails", [False, True])
def test_rows_are_timed_from_a_graph_or_say_they_were_not(capture_fails, monkeypatch):
    """``--graphs``: a row is its graph replay's time (``timing="graph"``); a capture that fails falls back to the
    eager time, says so in the row and in a note; ``--no-graphs`` times eagerly without trying."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    ctx = _GraphCtx(capture_fails)
    ms, timing = suite._timed(ctx, lambda: None)
    assert (ms, timing) == ((2.0, "eager") if capture_fails else (0.5, "graph"))
    assert len(ctx.notes) == int(capture_fails) and all("capture failed" in n for n in ctx.notes)
    ctx = _GraphCtx(capture_fails=False)
    ctx.params = SimpleNamespace(graphs=False)
    assert suite._timed(ctx, lambda: None) == (2.0, "eager") and ctx.notes == []


@pytest.mark.triton
def test_even_split_rows_run_where_the_split_differs():
    """``tlt-triton one-wave split`` / ``two-per-SM split``: plans with ``default_split_len(programs_per_sm=1, 2)``,
    checked against the first tlt row and timed, with their splits, on each backend the data's device runs (CUDA's on a GPU
    with the extension); no row whose split equals the default's or an earlier row's."""
    from tlt_kernels._backend import backend_unavailable_reason

    B, L, T, Hq, Hkv, D = 1, 4000, 4, 4, 2, 64
    inp = suite._make_inputs(B, L, T, Hq, Hkv, D, torch.bfloat16, torch.device(kernel_devices()[0]))
    case = {"model": "test", "B": B, "L": L, "T": T}
    plan_for = suite._planner(inp, L)
    cost = SimpleNamespace(nbytes=lambda t: 1, extra=lambda ms: {})
    q, k, v = inp["q"], inp["k_cache"], inp["v_cache"]
    plan = plan_for(1024)  # 4 splits; both rules': 16 of 256 (2 programs each)
    reference = plan.run(q, k, v, backend="torch")
    ctx = _Ctx()
    suite._bench_even_splits(ctx, case, plan, plan_for, q, k, v, torch.empty_like(q), reference, cost)
    # At L = 4000 both rules hit the 256-token floor: the first rule's rows, one per backend the data's device runs.
    runs = [b for b in ("triton", "cuda") if backend_unavailable_reason(b, q.device) is None]
    assert ctx.notes == [] and [impl for impl, _, _ in ctx.rows] == [f"tlt-{b} one-wave split" for b in runs]
    for _, _, row in ctx.rows:
        assert row["split_len"] == 256 and row["num_splits"] == 16 and row["timing"] == "eager"
    even_split = ctx.rows[0][2]["split_len"]
    ctx = _Ctx()
    even_plan = plan_for(even_split)
    suite._bench_even_splits(ctx, case, even_plan, plan_for, q, k, v, torch.empty_like(q), reference, cost)
    assert ctx.rows == [] and ctx.notes == []


@pytest.mark.triton
@pytest.mark.parametrize("T,wide_from,row", [(1, 16, "tlt-triton (merge kernel)"),
                                             (16, 16, "tlt-triton (merge in partial kernel)"),
                                             (4, 5, "tlt-triton (split walk)")])
def test_merge_placement_row_is_the_other_side_of_the_rule(T, wide_from, row, monkeypatch):
    """A plan with several splits gets one row with the Triton merge placed the other way from the default (below
    ``WIDE_MERGE_MIN_SPLITS`` splits T * G = 2 rows merge in the partial kernel by default, 32 in the merge kernel's
    walk; from it, the merge kernel reads the splits side by side), checked and timed; one split gets none."""
    import tlt_kernels._triton.tree_attention as tk
    from tlt_kernels.ops.tree_attention import plan_tree_attention

    monkeypatch.setattr(tk, "WIDE_MERGE_MIN_SPLITS", wide_from)

    B, L, Hq, Hkv, D = 2, 300, 4, 2, 64
    inp = suite._make_inputs(B, L, T, Hq, Hkv, D, torch.bfloat16, torch.device(kernel_devices()[0]))
    case = {"model": "test", "B": B, "L": L, "T": T}
    q, k, v = inp["q"], inp["k_cache"], inp["v_cache"]
    cost = SimpleNamespace(nbytes=lambda t: 1, extra=lambda ms: {})
    rows = []
    for split_len in (64, 512):
        plan = plan_tree_attention(inp["parents"], inp["context_lens"], inp["block_table"], num_q_heads=Hq,
                                   num_kv_heads=Hkv, head_dim=D, block_size=suite.PAGE, max_context_len=L,
                                   split_len=split_len)
        ctx = _Ctx()
        suite._bench_merge_placement(ctx, case, plan, q, k, v, torch.empty_like(q), plan.run(q, k, v, backend="torch"),
                                     cost)
        assert ctx.notes == []
        rows.append([(impl, extra["num_splits"]) for impl, _, extra in ctx.rows])
    assert rows == [[(row, 5)], []]


def test_cases_flag_takes_shapes_and_the_long_tail_by_context():
    """``--cases``: MODEL:BxLxT (flex-attention rows on), ``long-tail`` / ``long-tail@L`` (the suite's long-tail
    cases, all or at one context length, no flex rows: a run of record in parts); anything else is a usage error."""
    import argparse

    assert suite.parse_cases("7b:64x4096x16, 32B:16x8192x4") == [("qwen2.5-7b", 64, 4096, 16, True),
                                                               ("qwen2.5-32b", 16, 8192, 4, True)]
    at_4k = suite.parse_cases("long-tail@4096")
    assert at_4k == [("qwen2.5-7b", B, 4096, T, False) for B, L, T in suite.LONG_TAIL_CASES if L == 4096]
    assert len(at_4k) == 15 and len(suite.parse_cases("long-tail")) == len(suite.LONG_TAIL_CASES)
    for bad in ("long-tail@1000", "7b:64x4096", "13b:1x1x1", "long-tail@x"):
        with pytest.raises(argparse.ArgumentTypeError, match="long-tail@L"):
            suite.parse_cases(bad)


def test_copy_floor_row_moves_the_case_bytes():
    """``copy (same bytes)`` copies half the case's bytes as int32 words (read once, written once: the bytes the case
    moves, to a whole pair of words) and is timed like the tlt rows."""
    ctx = _Ctx()
    ctx.device = torch.device(kernel_devices()[0])  # the copy kernel runs where kernels run (a CPU: the interpreter)
    ctx.params = SimpleNamespace(graphs=False)
    case = {"model": "test", "B": 1, "L": 40, "T": 5}
    suite._bench_copy_floor(ctx, case, 1007)
    assert ctx.notes == [] and ctx.rows == [(suite.COPY_FLOOR_ROW, 1.0, {"bytes_moved": 1000, "timing": "eager"})]


def _sweep_case(B=1, L=40, T=3, Hq=4, Hkv=2, D=64, dtype=torch.bfloat16):
    inp = suite._make_inputs(B, L, T, Hq, Hkv, D, dtype, torch.device(kernel_devices()[0]))
    return inp, suite._planner(inp, L)(), {"model": "test", "B": B, "L": L, "T": T}


@pytest.mark.triton
def test_sweep_rows_run_each_config_checked_and_leave_the_default(monkeypatch):
    """``_sweep``: one row per (BLOCK_N, warps, stages) config and plan, each run with that config (the kernel sees
    it), checked against the reference and timed; a config that fails is a note; the default config is back after."""
    from tlt_kernels._triton import tree_attention as tk

    inp, plan, case = _sweep_case()
    q, k, v = inp["q"], inp["k_cache"], inp["v_cache"]
    reference = plan.run(q, k, v, backend="torch")
    seen, real_config = [], tk.kernel_config

    def config_spy(*args, **kwargs):
        seen.append(tk.CONFIG_OVERRIDE)
        if tk.CONFIG_OVERRIDE == (128, 8, 3, 128):
            raise RuntimeError("out of shared memory")
        return real_config(*args, **kwargs)

    monkeypatch.setattr(tk, "kernel_config", config_spy)
    ctx = _Ctx()
    suite._sweep(ctx, case, {"split=default": plan}, q, k, v, torch.empty_like(q), reference, 7,
                 lambda ms: {"tflops": 1.0}, stages=(3,))
    names = [impl for impl, _, _ in ctx.rows]
    assert names == [f"sweep bn={bn} w={w} s=3 bm=128 split=default" for bn, w in ((64, 4), (64, 8), (128, 4))]
    assert len(ctx.notes) == 1 and "(128, 8, 3, 128)" in ctx.notes[0] and "out of shared memory" in ctx.notes[0]
    assert {cfg for cfg in seen} == {(bn, w, 3, 128) for bn in (64, 128) for w in (4, 8)}
    assert all(c["bytes_moved"] == 7 and c["tflops"] == 1.0 and c["timing"] == "eager" for _, _, c in ctx.rows)
    assert tk.CONFIG_OVERRIDE is None
    with pytest.raises(AssertionError, match="sweep"):  # an output off the reference stops the sweep
        suite._sweep(_Ctx(), case, {"split=default": plan}, q, k, v, torch.empty_like(q), torch.zeros_like(q), 7,
                     lambda ms: {}, stages=(3,))
    assert tk.CONFIG_OVERRIDE is None


def test_sweep_plans_halve_double_and_quarter_the_split():
    """``_sweep_plans``: the default split, half of it, double it only when the plan splits, a quarter from 256
    tokens; each a distinct split length."""
    made = []

    def plan_for(split_len=None):
        made.append(split_len)
        return SimpleNamespace(split_len=split_len or 2048, num_splits=2)

    plans = suite._sweep_plans(plan_for)
    assert {label: p.split_len for label, p in plans.items()} == {
        "split=default": 2048, "split/2": 1024, "split*2": 4096, "split/4": 512}
    assert made == [None, 1024, 4096, 512]  # one plan each, the library's split first


@pytest.mark.triton
def test_fp8_sweep_rows_come_from_the_fp8_caches():
    """``_bench_fp8(sweep=True)``: the ``sweep fp8`` rows over the e4m3 caches, the default split only, five stages
    in the grid, each checked against the default fp8 output."""
    inp, plan, case = _sweep_case()
    cost = SimpleNamespace(B=1, L=40, Hq=4, Hkv=2, D=64, extra=lambda ms: {})
    ctx = _Ctx()
    suite._bench_fp8(ctx, case, plan, suite._planner(inp, 40), inp, cost, peers=False, sweep=True)
    sweep = [impl for impl, _, _ in ctx.rows if impl.startswith("sweep fp8")]
    assert sweep == [f"sweep fp8 bn={bn} w={w} s={s} bm=128 split=default" for bn in (64, 128) for w in (4, 8)
                     for s in (2, 3, 4, 5)]
    assert ctx.rows[0][0] == "tlt-triton fp8" and not [n for n in ctx.notes if "sweep" in n]
    assert all(c["bytes_moved"] == ctx.rows[0][2]["bytes_moved"] for impl, _, c in ctx.rows if impl in sweep)


@pytest.mark.parametrize("device", ["cuda", "cpu"], ids=["faked-gpu", "cpu"])  # "cuda" in an id means a real GPU
def test_fp8_only_times_the_fp8_rows_alone(device, monkeypatch):
    """``--fp8-only``: a case runs the rows over e4m3 caches and nothing else (no bf16 tlt row, copy floor, split or
    merge rows, sweep or bf16 peers); on CPU none at all. The GPU is faked: inputs stay on the CPU."""
    make_inputs = suite._make_inputs
    monkeypatch.setattr(suite, "_make_inputs", lambda *a, **k: make_inputs(*a[:-1], torch.device("cpu")))
    monkeypatch.setattr(suite, "_matmul_peak_flops", lambda ctx: None)
    calls = []
    monkeypatch.setattr(suite, "_bench_fp8", lambda ctx, case, plan, plan_for, inp, cost, peers, sweep: calls.append(
        (case, inp["k_cache"].dtype, plan.num_tree, peers, sweep)))
    for name in ("_bench_tlt", "_bench_copy_floor", "_bench_context_kernels", "_bench_even_splits",
                 "_bench_merge_placement", "_sweep", "_bench_peers"):
        monkeypatch.setattr(suite, name, lambda *a, name=name, **k: pytest.fail(f"{name} ran under --fp8-only"))
    ctx = _GraphCtx(capture_fails=False)
    ctx.device, ctx.dtype = torch.device(device), torch.bfloat16
    ctx.params = SimpleNamespace(fp8_only=True, peers=True, sweep=True, sweep_caches="fp8", fp8=True, graphs=True)
    suite._bench_case(ctx, "qwen2.5-7b", 1, 40, 3)
    case = {"model": "qwen2.5-7b", "B": 1, "L": 40, "T": 3}
    assert calls == ([(case, torch.bfloat16, 3, True, True)] if device == "cuda" else []) and ctx.rows == []


def test_fp8_key_product_rule_row_is_for_bf16_rows_only():
    """fp16 rows never take e4m3 key products, so there is no other side to time: no row, no note."""
    ctx = _Ctx()
    q = torch.zeros(1, 2, 4, 64, dtype=torch.float16)
    plan = SimpleNamespace(head_dim=64, num_tree=2, group=2)
    suite._bench_fp8_key_product_rule(ctx, {}, plan, q, None, None, None, 1, None)
    assert ctx.rows == [] and ctx.notes == []


@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn])
def test_case_inputs_plan_the_suite_case_as_the_library_does(kv_dtype):
    """The tools' helper: the suite's inputs of a case (caches stored as ``kv_dtype``, the same values, the same for
    the same seed) and a planner whose default split is the library's and whose ``split_len`` is taken as given."""
    from tlt_kernels.ops.tree_attention import plan_tree_attention

    B, L, T = 2, 300, 5
    inp, plan_for = suite.case_inputs("qwen2.5-7b", B, L, T, device="cpu", kv_dtype=kv_dtype)
    Hq, Hkv = suite.MODELS["qwen2.5-7b"]
    torch.randn(5)  # the global generator moves: the inputs come from the seed alone
    bf16 = suite._make_inputs(B, L, T, Hq, Hkv, suite.HEAD_DIM, torch.bfloat16, "cpu")
    assert inp["q"].shape == (B, T, Hq, suite.HEAD_DIM) and inp["q"].dtype == torch.bfloat16
    assert inp["k_cache"].dtype == (kv_dtype or torch.bfloat16)
    assert torch.equal(inp["v_cache"], bf16["v_cache"].to(kv_dtype or torch.bfloat16))
    library = plan_tree_attention(inp["parents"], inp["context_lens"], inp["block_table"], num_q_heads=Hq,
                                  num_kv_heads=Hkv, head_dim=suite.HEAD_DIM, block_size=suite.PAGE,
                                  max_context_len=L, kv_dtype=kv_dtype)
    assert plan_for().split_len == library.split_len and plan_for(64).split_len == 64
    got = plan_for(64).run(inp["q"], inp["k_cache"], inp["v_cache"], backend="torch")
    want = library.run(inp["q"], inp["k_cache"], inp["v_cache"], backend="torch")
    assert torch.allclose(got.float(), want.float(), atol=2e-2)
