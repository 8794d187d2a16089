"""Triton tree attention: the pipelined context loop (whole tiles with page ids prefetched one trip
ahead, then a masked tail) against the fp32 reference and against the previous loop (``PIPELINE = 0``).

tests/test_tree_attention.py mostly has contexts of at most one tile per split; these cases run several
whole tiles per split (so the carried page ids matter), tiles that straddle pages, pages larger than a
tile, split starts that are not tile-aligned, and tails of every length class.
"""

import pytest
import torch
from conftest import kernel_devices
from test_tree_attention import check_against_reference, make_case, make_plan

from tlt_kernels._backend import backend_unavailable_reason
from tlt_kernels._triton import tree_attention as tk

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
