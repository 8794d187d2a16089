"""Host cost of an eager ``verify_tree`` call, layer by layer: ``python -m tools.profile_dispatch [--out FILE]`` (GPU).

The acceptance suite's eager ``tlt-cuda`` rows sit 100-320 us above its graph-replayed rows at B <= 16 (H200,
2026-11-27 05:12): host time an engine's step graph never pays, but an eager caller does. This tool peels the
call into the layers it passes through and times each one's host cost:

* ``binding``: ``_C.verify_tree`` alone, every pointer and output preallocated (pybind11 + the launch);
* ``launch``: the CUDA backend's ``_launch`` (dtype/contiguity checks, output and scratch allocation, binding);
* ``custom_op``: the ``torch.library`` custom op around ``_launch`` (the path under ``torch.compile`` and tracing);
* ``backend``: ``verify_tree_cuda``, the backend entry: ``_launch`` directly in plain eager code (since the direct
  dispatch of ``tlt_kernels._backend.direct_dispatch_ok``; the op with ``TLT_DIRECT_DISPATCH=0``);
* ``public_tensors``: ``verify_tree(..., validate=False)`` with ``[B]`` tensors for every per-request parameter;
* ``public_scalars``: the same with Python scalars for temperature / top-p (the acceptance suite's call);
* ``public_validate``: ``verify_tree`` with its default ``validate=True`` (host syncs by design);
* ``flashinfer``: the suite's FlashInfer pipeline (softmax, top-p renorm, ``chain_speculative_sampling``), when
  importable; ``flashinfer_graph``: its GPU time replayed from a CUDA graph (tried last, after every other row).

Host time: the GPU is first kept busy by ``torch.cuda._sleep`` so that launches only queue, then ``N`` calls are
timed on the host clock (median over repeats, microseconds per call); ``validate=True`` syncs, so its figure is
host plus GPU time. ``gpu_us``: the call replayed from a CUDA graph (``do_bench`` median), for scale. Rows print
as JSON; ``--out`` also writes them to a file. A developer tool: benchmark figures come from ``python -m bench``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


def host_us(fn, calls: int = 50, repeats: int = 7, sleep_cycles: int = 200_000_000) -> float:
    """Median host microseconds per ``fn()`` while the GPU is busy (launches queue, never wait)."""
    fn()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(repeats):
        torch.cuda._sleep(sleep_cycles)  # ~0.1 s of GPU work ahead of the timed launches
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        per_call.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(per_call)


def _layers(B: int, T: int, V: int, top_p, dev):
    from tools.profile_acceptance import _case
    from bench.suites.acceptance import TEMPERATURE
    from tlt_kernels import verify_tree
    from tlt_kernels._cuda import extension, ptr, stream_handle
    from tlt_kernels._cuda import verify_tree as cuda_mod

    logits, tokens, parents, q = _case("chain", T, B, V, "bench", dev)
    seeds = torch.arange(B, dtype=torch.int64, device=dev)
    offset = torch.zeros(B, dtype=torch.int64, device=dev)
    num_nodes = torch.full((B,), T, dtype=torch.int32, device=dev)
    temp = torch.full((B,), TEMPERATURE, dtype=torch.float32, device=dev)
    tp = None if top_p is None else torch.full((B,), top_p, dtype=torch.float32, device=dev)
    args = (logits, tokens, parents, num_nodes, q, temp, None, tp, seeds, offset, T - 1, False)
    out = tuple(t for t in cuda_mod.empty_verify_outputs(logits, T - 1, False))
    scratch = torch.empty(B, 2, V, dtype=torch.float32, device=dev)
    ext = extension()
    kw = dict(
        logits=ptr(logits), draft_probs=ptr(q), draft_tokens=ptr(tokens), parents=ptr(parents),
        num_nodes=ptr(num_nodes), temperature=ptr(temp), top_k=0, top_p=ptr(tp), seed=ptr(seeds),
        offset=ptr(offset), scratch=ptr(scratch), out_tokens=ptr(out[0]), out_num=ptr(out[1]), out_nodes=ptr(out[2]),
        out_error=ptr(out[3]), out_stats=0, logits_stride_b=int(logits.stride(0)), logits_stride_t=int(logits.stride(1)),
        q_stride_b=int(q.stride(0)), q_stride_t=int(q.stride(1)), tokens_stride_b=int(tokens.stride(0)),
        parents_stride_b=int(parents.stride(0)), batch=B, num_tree=T, vocab=V, max_depth=T - 1, tokens_int64=True,
        logits_dtype=cuda_mod.elem_code(logits.dtype), q_dtype=cuda_mod.elem_code(q.dtype),
        stream=stream_handle(dev), cluster_size=0, topp_compact=cuda_mod.TOPP_COMPACT,
    )
    public_kw = dict(draft_probs=q, temperature=temp, top_p=tp, seed=seeds, offset=offset, num_nodes=num_nodes)
    layers = {
        "binding": lambda: ext.verify_tree(**kw),
        "launch": lambda: cuda_mod._launch(*args),
        "custom_op": lambda: cuda_mod.verify_tree_cuda.op(*args),
        "backend": lambda: cuda_mod.verify_tree_cuda(*args),
        "public_tensors": lambda: verify_tree(logits, tokens, parents, validate=False, backend="cuda", **public_kw),
        "public_scalars": lambda: verify_tree(logits, tokens, parents, draft_probs=q, temperature=TEMPERATURE,
                                              top_p=top_p, seed=seeds, validate=False, backend="cuda"),
        "public_validate": lambda: verify_tree(logits, tokens, parents, backend="cuda", **public_kw),
    }
    try:
        import flashinfer  # noqa: F401

        from bench.suites.acceptance import _flashinfer_chain

        layers["flashinfer"] = lambda: _flashinfer_chain(flashinfer, logits, tokens, q, top_p)
    except Exception:
        pass
    return layers, (lambda: verify_tree(logits, tokens, parents, validate=False, backend="cuda", **public_kw))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--bs", default="1,16")
    ap.add_argument("--vocab", default="32000")
    ap.add_argument("--top-p", default="1,0.9", help="comma list; 1 = off")
    ap.add_argument("--T", type=int, default=5, help="chain nodes (root + T-1 drafts)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_dispatch needs a CUDA GPU")
        return 2
    from bench.harness import BenchContext

    dev = torch.device("cuda", torch.cuda.current_device())
    ctx = BenchContext("profile-dispatch", dev)
    rows, fi_cases = [], []
    for V in (int(v) for v in args.vocab.split(",")):
        for B in (int(b) for b in args.bs.split(",")):
            for p in (float(x) for x in args.top_p.split(",")):
                top_p = None if p >= 1 else p
                layers, graphed = _layers(B, args.T, V, top_p, dev)
                gpu_us = ctx.time_graph_ms(graphed) * 1e3
                for name, fn in layers.items():
                    synced = name == "public_validate"  # syncs by design: no busy GPU ahead of it
                    row = dict(B=B, V=V, T=args.T, top_p=p, layer=name,
                               host_us=round(host_us(fn, sleep_cycles=0 if synced else 200_000_000), 1),
                               gpu_us=None if name == "flashinfer" else round(gpu_us, 1))
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                if "flashinfer" in layers:
                    fi_cases.append((dict(B=B, V=V, T=args.T, top_p=p), layers["flashinfer"]))
    # FlashInfer's pipeline from a CUDA graph, last: the acceptance suite times it eagerly only, since a failed
    # capture could leave the context unusable for what follows.
    for case, fn in fi_cases:
        try:
            us = round(ctx.time_graph_ms(fn) * 1e3, 1)
        except Exception as exc:
            print(json.dumps(dict(case, layer="flashinfer_graph", error=f"{type(exc).__name__}: {exc}"[:300])), flush=True)
            break
        row = dict(case, layer="flashinfer_graph", host_us=None, gpu_us=us)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out is not None:
        args.out.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
