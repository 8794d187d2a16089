"""Experiment (issue 3): the overlapped context kernel of tree attention in Gluon
(``tlt_kernels/_triton/tree_attention_gluon.py``): the softmax of tile j runs while the tensor cores do
P_{j-1} V_{j-1}. It is checked against an fp32 reference of every split's whole tiles and timed against the whole
Triton op and, when ``_C`` is built, the whole CUDA op through its sm_90 twin (``csrc/tree_attention_ctx_sm90.cu``),
in % of the HBM floor of the context.

    python -m bench.gluon_context_attention --compile-only   # CPU: compile for sm_90a, print registers/shared memory
    python -m bench.gluon_context_attention [--sweep] [--out rows.jsonl]   # GPU: check, then time

The whole op with it (``TLT_TREE_ATTENTION_GLUON=1``: Gluon context + Triton tail/tree + merge) is what
``python -m bench tree-attention`` times when that variable is set.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys

import torch
import triton

from bench.harness import measure_copy_bandwidth
from tlt_kernels._triton.tree_attention_gluon import CONFIG, compile_for_sm90, run_context


def _reference_partials(q, k_cache, v_cache, block_table, context_lens, split_len, num_splits, sm_scale, block_n):
    """fp32 (o, lse) of each split's whole tiles, [B, Hkv, S, T*G, D] and [B, Hkv, S, T*G]."""
    B, T, Hq, D = q.shape
    Hkv, page = k_cache.shape[2], k_cache.shape[1]
    G = Hq // Hkv
    out = torch.zeros(B, Hkv, num_splits, T * G, D, dtype=torch.float32, device=q.device)
    lse = torch.full((B, Hkv, num_splits, T * G), float("-inf"), device=q.device)
    for b in range(B):
        ctx = int(context_lens[b])
        slots = torch.arange(ctx, device=q.device)
        pages = block_table[b, slots // page].long()
        k = k_cache[pages, slots % page].float()  # [ctx, Hkv, D]
        v = v_cache[pages, slots % page].float()
        qb = q[b].float().view(T, Hkv, G, D).permute(1, 0, 2, 3).reshape(Hkv, T * G, D)
        for s in range(num_splits):
            lo = s * split_len
            hi = lo + max(min(split_len, ctx - lo), 0) // block_n * block_n
            if hi <= lo:
                continue
            sc = torch.einsum("hmd,nhd->hmn", qb, k[lo:hi]) * sm_scale
            lse[b, :, s] = torch.logsumexp(sc, -1)
            out[b, :, s] = torch.einsum("hmn,nhd->hmd", torch.softmax(sc, -1), v[lo:hi])
    return out, lse


def _case(B, L, T, Hq, Hkv, D, page, dtype, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    blocks_per = -(-L // page)
    nblocks = B * blocks_per + 3
    k_cache = torch.randn(nblocks, page, Hkv, D, generator=g).to(device, dtype)
    v_cache = torch.randn(nblocks, page, Hkv, D, generator=g).to(device, dtype)
    perm = torch.randperm(nblocks, generator=g)[: B * blocks_per].view(B, blocks_per).to(torch.int32)
    q = torch.randn(B, T, Hq, D, generator=g).to(device, dtype)
    return q, k_cache, v_cache, perm.to(device), torch.full((B,), L, dtype=torch.int32, device=device)


def _partials_error(got_o, got_l, ref_o, ref_l):
    """(ok, max |o| error, max |lse| error) over the slots the reference fills; a split without a whole tile must be
    -inf in both (the merge reads lse first)."""
    used = torch.isfinite(ref_l)
    err_o = (got_o - ref_o)[used].abs().max().item()
    err_l = (got_l - ref_l)[used].abs().max().item()
    ok = (err_o < 2e-2 and err_l < 1e-3 and bool(torch.isfinite(got_o[used]).all())
          and torch.equal(torch.isneginf(got_l), ~used))
    return ok, round(err_o, 5), round(err_l, 6)


def check_and_time(B, L, T, Hq, Hkv, D, copy_bytes_per_s, page=16, dtype=torch.bfloat16, **cfg):
    """GPU: compare the Gluon kernel with the fp32 reference, then time it, the Triton tree attention and (when ``_C``
    is built) the CUDA one through its sm_90 kernel (T-node chains, the whole op: context, tree part and merge) on
    the same cache.
    ``copy_bytes_per_s`` (read + write of a device copy, measured once by the caller) sets the HBM floor."""
    from tlt_kernels import plan_tree_attention
    from tlt_kernels._backend import backend_unavailable_reason

    sweep_config = bool(cfg)  # a Gluon config of the sweep: the CUDA kernel was timed in the case's default row
    cfg = {**CONFIG, **cfg}
    dev = torch.device("cuda")
    q, kc, vc, bt, cl = _case(B, L, T, Hq, Hkv, D, page, dtype, dev)
    extra = -(-T // page)  # pages for the tree's own slots (ctx .. ctx + T - 1)
    bt2 = torch.cat([bt, (torch.arange(extra, dtype=torch.int32, device=dev) % kc.shape[0]).expand(B, extra)], 1)
    parents = torch.arange(-1, T - 1, dtype=torch.int32, device=dev).expand(B, T).contiguous()
    plan = plan_tree_attention(parents, cl, bt2.contiguous(), torch.full((B,), T, dtype=torch.int32, device=dev),
                               num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D, block_size=page, num_blocks=kc.shape[0],
                               max_context_len=L)
    split_len = max(cfg["BLOCK_N"], plan.split_len // cfg["BLOCK_N"] * cfg["BLOCK_N"])
    S = -(-L // split_len)
    G = Hq // Hkv
    po = torch.full((B * Hkv * (S + 1) * T * G, D), float("nan"), device=dev)
    pl = torch.full((B * Hkv * (S + 1) * T * G,), float("nan"), device=dev)
    sm_scale = 1.0 / math.sqrt(D)
    run_context(q, kc, vc, bt, cl, split_len, S, sm_scale, po, pl, **cfg)
    torch.cuda.synchronize()
    ref = _reference_partials(q, kc, vc, bt, cl, split_len, S, sm_scale, cfg["BLOCK_N"])
    ok, err_o, err_l = _partials_error(po.view(B, Hkv, S + 1, T * G, D)[:, :, :S], pl.view(B, Hkv, S + 1, T * G)[:, :, :S],
                                       *ref)
    ms = triton.testing.do_bench(lambda: run_context(q, kc, vc, bt, cl, split_len, S, sm_scale, po, pl, **cfg),
                                 warmup=25, rep=200)
    out = torch.empty_like(q)
    ms_triton = triton.testing.do_bench(lambda: plan.run(q, kc, vc, out=out, backend="triton"), warmup=25, rep=200)
    # Byte floor of the context part: K and V of every context token once, q read and the partial rows written.
    nbytes = B * Hkv * L * D * 2 * q.element_size() + q.numel() * (q.element_size() + 4)
    floor_ms = nbytes / copy_bytes_per_s * 1e3
    # The CUDA op through its sm_90 kernel (csrc/tree_attention_ctx_sm90.cu: this kernel's twin, extended to the tail
    # and the tree), when built: the whole op like the Triton one, checked against it; once per case.
    cuda = {}
    if D == 128 and not sweep_config and backend_unavailable_reason("cuda", dev) is None:
        import tlt_kernels._cuda.tree_attention as cuda_ta

        try:
            with cuda_ta.forced_context_path(True):
                out_c = torch.empty_like(q)
                plan.run(q, kc, vc, out=out_c, backend="cuda")
                torch.cuda.synchronize()
                c_err = (out_c.float() - out.float()).abs().max().item()
                c_ms = triton.testing.do_bench(lambda: plan.run(q, kc, vc, out=out_c, backend="cuda"), warmup=25,
                                               rep=200)
            cuda.update({"cuda_op_ok": c_err < (2e-2 if dtype == torch.bfloat16 else 4e-3),
                         "cuda_op_err_vs_triton": round(c_err, 5), "cuda_op_ms": round(c_ms, 4),
                         "cuda_op_pct_floor": round(100 * floor_ms / c_ms, 1)})
        except Exception as exc:  # noqa: BLE001 - an experiment: report it in the row
            cuda.update({"cuda_op_ok": False, "cuda_op_error": f"{type(exc).__name__}: {str(exc)[:200]}"})
    return dict(B=B, L=L, T=T, Hq=Hq, Hkv=Hkv, ok=ok, err_o=err_o, err_lse=err_l, **cuda,
                gluon_ms=round(ms, 4), triton_op_ms=round(ms_triton, 4), gluon_pct_floor=round(100 * floor_ms / ms, 1),
                triton_op_pct_floor=round(100 * floor_ms / ms_triton, 1), split_len=split_len, triton_split_len=plan.split_len,
                copy_gbps=round(copy_bytes_per_s / 1e9), cfg=cfg)


SWEEP = [dict(BLOCK_N=64, NUM_STAGES=3), dict(BLOCK_N=64, NUM_STAGES=4), dict(BLOCK_N=64, NUM_STAGES=5),
         dict(BLOCK_N=128, NUM_STAGES=3), dict(BLOCK_N=32, NUM_STAGES=6)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="also time the SWEEP configs on the two (64, 4096, 16) cases")
    ap.add_argument("--out", help="write every row as JSON lines here")
    args = ap.parse_args(argv)
    if args.compile_only or not torch.cuda.is_available():
        for T, G, D in ((16, 7, 128), (16, 5, 128), (8, 7, 128), (16, 4, 64)):
            k, regs, spills = compile_for_sm90(T=T, G=G, D=D)
            ptx = k.asm["ptx"]
            waits = sorted(set(re.findall(r"wgmma.wait_group.sync.aligned (\d+)", ptx)))
            copies = len(re.findall(r"cp\.async\.c[ag]\.shared\.global[^;]*0x10, 0x10;", ptx))
            print(f"T={T} G={G} D={D}: {regs} registers, {spills} B spilled, {k.metadata.shared} B shared memory, "
                  f"{k.metadata.num_warps} warps; {ptx.count('wgmma.mma_async')} wgmma, {copies} 16-byte cp.async, "
                  f"wgmma wait_group counts {waits}")
        return 0
    rows = []
    cases = [(m, hs, shape) for m, hs in (("7B", (28, 4)), ("32B", (40, 8)))
             for shape in ((64, 4096, 16), (64, 16384, 16), (256, 2048, 8))]
    runs = [(c, {}) for c in cases]
    if args.sweep:
        runs += [(c, cfg) for cfg in SWEEP for c in cases if c[2] == (64, 4096, 16)]
    # The HBM floor's bandwidth, measured once: a 1 GiB device-to-device copy (the harness's measurement).
    bw = measure_copy_bandwidth(torch.device("cuda"), 1 << 30,
                                lambda fn: triton.testing.do_bench(fn, warmup=10, rep=100))
    for (model, (Hq, Hkv), (B, L, T)), cfg in runs:
        r = check_and_time(B, L, T, Hq, Hkv, 128, bw, **cfg)
        r["model"] = model
        rows.append(r)
        print(json.dumps(r), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(r) + "\n")
    # Non-zero when any kernel that ran disagreed with the reference (the CUDA keys are absent where it did not run).
    return 0 if all(r["ok"] and r.get("cuda_op_ok", True) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
