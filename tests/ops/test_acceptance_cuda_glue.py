"""The acceptance kernels' CUDA glue as a whole (verify_tree, compact_kv, build_draft_tree through tlt_kernels._C).

The CPU tests check what needs no GPU: the launchers' argument checks, the glue's checks and the fake
implementations for torch.compile. The GPU test checks that eager calls dispatching straight to _C give the same
bits as the custom-op path.
"""
from __future__ import annotations

import pytest
import torch

from cuda_cases import compact_case, ext_or_skip, need_gpu_ext, verify_cuda_backend, verify_inputs  # noqa: F401
from tlt_kernels import compact_kv, verify_tree


# ---------------------------------------------------------------------------------------------
# CPU: launcher argument checks, glue checks
# ---------------------------------------------------------------------------------------------

def _verify_args(**kw):
    args = dict(logits=0, draft_probs=0, draft_tokens=0, parents=0, num_nodes=0, temperature=0, top_k=0, top_p=0,
                seed=0, offset=0, scratch=0, out_tokens=0, out_num=0, out_nodes=0, out_error=0, out_stats=0,
                logits_stride_b=0, logits_stride_t=0, q_stride_b=0, q_stride_t=0, tokens_stride_b=0,
                parents_stride_b=0, batch=1, num_tree=3, vocab=5, max_depth=2, tokens_int64=True, logits_dtype=0,
                q_dtype=0, stream=0)
    args.update(kw)
    return args


def test_launcher_argument_checks_need_no_gpu():
    ext = ext_or_skip()
    # Every check below fails before any CUDA call, so these run on a machine without a GPU.
    with pytest.raises(ValueError, match="device pointers"):
        ext.verify_tree(**_verify_args())
    with pytest.raises(ValueError, match="max_depth"):
        ext.verify_tree(**_verify_args(max_depth=-1))
    with pytest.raises(ValueError, match="logits dtype"):
        ext.verify_tree(**_verify_args(logits_dtype=7))
    with pytest.raises(ValueError, match="need T >= 1"):
        ext.verify_tree(**_verify_args(num_tree=0))
    with pytest.raises(ValueError, match="cluster must be 0 .auto., 1, 2, 4, 8 or 16, got 3"):
        ext.verify_tree(**_verify_args(cluster_size=3))
    with pytest.raises(ValueError, match="exceeds the CUDA kernel's limit"):
        ext.verify_tree(**_verify_args(vocab=2**31 - 2))
    ext.verify_tree(**_verify_args(batch=0))  # nothing to do: no launch, no error
    ext.verify_tree(**_verify_args(batch=0, cluster_size=8))
    ext.verify_tree(**_verify_args(batch=0, cluster_size=16))
    with pytest.raises(ValueError, match="got 32"):
        ext.verify_tree(**_verify_args(cluster_size=32))
    cargs = dict(cache_ptrs=0, block_table=0, context_lens=0, accepted_nodes=0, num_accepted=0, bt_stride_b=4,
                 nodes_stride_b=3, row_bytes=64, num_caches=2, batch=1, path_len=3, block_size=16, unit=16, stream=0)
    with pytest.raises(ValueError, match="unit must be"):
        ext.compact_kv(**{**cargs, "unit": 3})
    with pytest.raises(ValueError, match="multiple of unit"):
        ext.compact_kv(**{**cargs, "row_bytes": 24})
    with pytest.raises(ValueError, match="device pointers"):
        ext.compact_kv(**cargs)
    bargs = dict(cand_parents=0, cand_tokens=0, cand_scores=0, root_tokens=0, parents=0, draft_tokens=0, cand_index=0,
                 num_nodes=0, tree_mask=0, cp_stride_b=5, ct_stride_b=5, cs_stride_b=5, batch=1, num_cand=5,
                 num_verify=4, stream=0)
    with pytest.raises(ValueError, match="up to 2048 candidates"):
        ext.build_draft_tree(**{**bargs, "num_cand": 4096})
    with pytest.raises(ValueError, match="num_verify"):
        ext.build_draft_tree(**{**bargs, "num_verify": 0})
    assert ext.BUILD_TREE_MAX_CANDIDATES == 2048 and ext.VERIFY_MAX_DEPTH == 4096


def test_glue_checks_on_cpu_tensors():
    from tlt_kernels._cuda import build_draft_tree as cb
    from tlt_kernels._cuda import compact_kv as cc
    from tlt_kernels._cuda import verify_tree as cv

    assert cb.MAX_CANDIDATES == 2048 and cv.MAX_DEPTH == 4096
    with pytest.raises(ValueError, match="N=3000"):
        cb.check_inputs(torch.zeros(2, 3000), 8)
    cb.check_inputs(torch.zeros(2, 2048), 8)
    with pytest.raises(TypeError, match="float64"):
        cv.check_inputs(torch.zeros(1, 2, 3, dtype=torch.float64), None, 1)
    with pytest.raises(ValueError, match="limit 4096"):
        cv.check_inputs(torch.zeros(1, 5000, 1), None, 4999)
    cv.check_inputs(torch.zeros(1, 5, 3, dtype=torch.bfloat16), torch.zeros(1, 5, 3, dtype=torch.float16), 4)
    caches = [torch.zeros(4, 2, 3, 8, dtype=torch.bfloat16)]  # 48-byte slots
    assert cc.access_unit(caches) == 16
    assert cc.access_unit([torch.zeros(4, 2, 1, 7, dtype=torch.float16)]) == 2  # 14-byte slots
    assert cc.access_unit([torch.zeros(64, dtype=torch.bfloat16)[1:].view(7, 1, 1, 9)]) == 2  # odd address
    with pytest.raises(ValueError, match="CUDA tensors"):
        cc.compact_kv_(caches, caches, torch.zeros(1, 2, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                       torch.zeros(1, 2, dtype=torch.int32), torch.zeros(1, dtype=torch.int32))


def test_fake_implementations_for_torch_compile():
    from torch._subclasses.fake_tensor import FakeTensorMode

    import tlt_kernels._cuda.build_draft_tree  # noqa: F401  (registers the custom ops)
    import tlt_kernels._cuda.compact_kv  # noqa: F401
    import tlt_kernels._cuda.verify_tree  # noqa: F401

    with FakeTensorMode():
        B, T, V, D = 3, 6, 11, 4
        i32 = lambda *s: torch.empty(s, dtype=torch.int32)  # noqa: E731
        i64 = lambda *s: torch.empty(s, dtype=torch.int64)  # noqa: E731
        out = torch.ops.tlt.verify_tree_cuda(torch.empty(B, T, V), i64(B, T), i32(B, T), i32(B), None, torch.empty(B),
                                             None, None, i64(B), i64(B), D, True)
        assert [tuple(t.shape) for t in out] == [(B, D + 1), (B,), (B, D + 1), (B,), (B, D, 2)]
        assert all(t.dtype == torch.int32 for t in out)
        tree = torch.ops.tlt.build_draft_tree_cuda(i32(B, 9), i64(B, 9), torch.empty(B, 9), 40, i64(B), True)
        assert [tuple(t.shape) for t in tree] == [(B, 40), (B, 40), (B, 40), (B,), (B, 40, 2)]
        assert tree[1].dtype == torch.int64
        k = torch.empty(5, 4, 2, 8, dtype=torch.bfloat16)
        new_ctx = torch.ops.tlt.compact_kv_cuda([k], [k.clone()], i32(B, 2), i32(B), i32(B, 3), i32(B))
        assert tuple(new_ctx.shape) == (B,) and new_ctx.dtype == torch.int32


# ---------------------------------------------------------------------------------------------
# GPU: eager direct dispatch against the custom op
# ---------------------------------------------------------------------------------------------

@pytest.mark.cuda
def test_eager_direct_dispatch_matches_the_custom_op_on_the_gpu(monkeypatch):
    """Plain eager calls launch _C without the torch.library op (tlt_kernels._backend.direct_dispatch_ok); the
    op path (TLT_DIRECT_DISPATCH=0, torch.compile) must give the same bits for verify_tree and compact_kv."""
    need_gpu_ext()
    import tlt_kernels._backend as backend
    from tlt_kernels._cuda import compact_kv as ccv
    from tlt_kernels._cuda import verify_tree as cvt

    B, T, V = 5, 9, 4099
    lg, toks, par, n, q = (t.cuda() if t is not None else None
                           for t in verify_inputs(B, T, V, seed=17, use_q=True, dtype=torch.bfloat16))
    kw = dict(num_nodes=n, draft_probs=q, temperature=0.8, top_p=0.9, seed=torch.arange(B, device="cuda"),
              return_stats=True, validate=False, backend="cuda")
    ks, vs, table, ctx, nodes, nacc = compact_case(4, 2, 2, 64, 16, 5, torch.bfloat16, seed=9)
    counts = {"verify": [], "compact": []}
    for name, entry in (("verify", cvt.verify_tree_cuda), ("compact", ccv.compact_kv)):
        real = entry.op
        monkeypatch.setattr(entry, "op", lambda *a, real=real, name=name: counts[name].append(1) or real(*a))
    results = []
    for direct in (True, False):
        monkeypatch.setattr(backend, "DIRECT_DISPATCH", direct)
        res = verify_tree(lg, toks, par, **kw)
        gk, gv = [t.cuda() for t in ks], [t.cuda() for t in vs]
        new_ctx = compact_kv(gk, gv, table.cuda(), ctx.cuda(), nodes.cuda(), nacc.cuda(), backend="cuda", validate=False)
        torch.cuda.synchronize()
        results.append((res, new_ctx.cpu(), [t.cpu() for t in gk + gv]))
        assert counts == ({"verify": [], "compact": []} if direct else {"verify": [1], "compact": [1]})
    (a, ctx_a, caches_a), (b, ctx_b, caches_b) = results
    for field in ("tokens", "num_accepted", "accepted_nodes", "error", "stats"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field
    assert torch.equal(ctx_a, ctx_b) and all(torch.equal(x, y) for x, y in zip(caches_a, caches_b))
