"""Variant microbenchmark of the Triton tree-attention kernel (issue 3): ``python bench/tree_attention_variants.py``.

Times candidate variants of ``tlt_kernels/_triton/tree_attention.py`` on the cases of the
``tree-attention`` suite (Qwen2.5-7B / 32B geometry, D=128, page 16, bf16) in one process, next to the
current default (timed first, and again last so its drift shows the noise), and checks each against
the default's output (max abs error). A :class:`Variant` sets ``CONFIG_OVERRIDE`` (``(BLOCK_N,
num_warps, num_stages[, BLOCK_M[, maxnreg]])``), ``LAZY_RESCALE``, ``PIPELINE`` and a split-length factor.

Percent of floor: ``bytes_moved`` (K/V of context + tree, q and out, each once; the suite's formula)
over the bandwidth of a large device-to-device copy measured in the same run.

Env: ``TLT_VARIANT_CASES="7b:64x4096x16,32b:256x2048x8"`` restricts the cases, ``TLT_VARIANT_ONLY="lazy8,..."``
the variants (exact labels; the default always runs; ``legacy`` adds the pre-pipelining loop),
``TLT_VARIANT_REPS`` the timed runs per variant (default 100, split over ``TLT_VARIANT_ROUNDS`` interleaved
rounds, default 5), ``TLT_VARIANT_JSON`` a path for the raw rows. On CPU (no GPU) it runs two tiny cases
under the Triton interpreter as a smoke test.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402

from bench.harness import COPY_BYTES, measure_copy_bandwidth, time_cuda_events_ms  # noqa: E402
from bench.suites.tree_attention import HEAD_DIM, MODELS, PAGE, _make_inputs, parse_cases  # noqa: E402
from tlt_kernels._triton import tree_attention as tk  # noqa: E402
from tlt_kernels.ops.tree_attention import SPLIT_ALIGN, plan_tree_attention  # noqa: E402

GPU_CASES = [
    ("qwen2.5-7b", 64, 4096, 16), ("qwen2.5-7b", 64, 16384, 16), ("qwen2.5-7b", 256, 2048, 8),
    ("qwen2.5-32b", 64, 4096, 16), ("qwen2.5-32b", 64, 16384, 16), ("qwen2.5-32b", 256, 2048, 8),
    # Compute-bound rows: only checked for "no slower than before".
    ("qwen2.5-7b", 32, 8192, 64), ("qwen2.5-7b", 8, 32768, 32), ("qwen2.5-7b", 1, 32768, 64),
    ("qwen2.5-32b", 32, 8192, 64), ("qwen2.5-32b", 8, 32768, 32), ("qwen2.5-32b", 1, 32768, 64),
]
CPU_CASES = [("qwen2.5-7b", 2, 300, 8), ("qwen2.5-7b", 1, 200, 16)]


@dataclass(frozen=True)
class Variant:
    """One kernel variant: ``config`` is ``tk.CONFIG_OVERRIDE`` (``(BLOCK_N, num_warps, num_stages[, BLOCK_M[,
    maxnreg]])``, None = the default table), ``split`` scales the plan's default split length, ``lazy`` is
    ``tk.LAZY_RESCALE`` and ``pipeline`` ``tk.PIPELINE`` (0 = the legacy loop)."""

    label: str
    config: tuple | None = None
    split: float = 1.0
    lazy: float = 0.0
    pipeline: int = 1


DEFAULT = Variant("default")
ROUNDS = int(os.environ.get("TLT_VARIANT_ROUNDS", "5"))


def variants_for(rows: int):
    """Candidates for ``rows = T * G`` query rows per KV head; the default first (the reference) and again last
    (its drift over the case is the noise floor of the comparison)."""
    if rows <= 64:  # BLOCK_M = 64, 4 warps: the default runs 2 programs per SM (112 KB of shared memory)
        v = [Variant("lazy8", lazy=8.0), Variant("bn=32 w4 s3 (3/SM)", (32, 4, 3)), Variant("bn=32 w4 s4", (32, 4, 4))]
    elif rows <= 128:  # BLOCK_M = 128: the default (128, 8, 3) fills the SM's shared memory (1 program per SM)
        # Two programs per SM, so one's MMAs overlap the other's softmax: 32-token tiles at 8 warps compile to
        # <= 128 registers (ptxas, sm_90a) and 80-112 KB of shared memory; one warp group over all 128 rows
        # (4 warps, <= 255 registers); or 64-row programs (each K/V tile read twice, the second time from L2).
        v = [Variant("lazy8", lazy=8.0),
             Variant("bn=32 w8 s4 r128 (2/SM)", (32, 8, 4, None, 128)),
             Variant("bn=32 w4 s3", (32, 4, 3)), Variant("bn=32 w4 s4", (32, 4, 4)), Variant("bn=64 w4 s2", (64, 4, 2)),
             Variant("bm=64 bn=64 w4 s3", (64, 4, 3, 64)), Variant("bm=64 bn=32 w4 s4", (32, 4, 4, 64)),
             Variant("bn=64 w8 s3", (64, 8, 3))]
    else:  # chunked rows (64-row programs)
        v = [Variant("lazy8", lazy=8.0), Variant("bn=32 w4 s4", (32, 4, 4, 64))]
    only = [x.strip() for x in os.environ.get("TLT_VARIANT_ONLY", "").split(",") if x.strip()]
    if only:
        v = [x for x in v if x.label in only]
        if "legacy" in only:
            v.append(Variant("legacy", pipeline=0))
    return [DEFAULT] + v + [Variant("default (again)")]


def _selected(cases):
    spec = os.environ.get("TLT_VARIANT_CASES", "").strip()
    return parse_cases(spec) if spec else cases


def time_ms(fn, reps: int) -> float:
    """Median ms over ``reps`` runs after warm-up (CUDA events per run on GPU, perf_counter on CPU)."""
    if torch.cuda.is_available():
        return time_cuda_events_ms(fn, warmup=5, reps=reps)
    for _ in range(5):
        fn()
    ts = []
    for _ in range(max(1, reps)):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def copy_bandwidth(dev) -> float | None:
    """Bytes/s (read + write) of a 1 GiB device-to-device copy, as the harness measures it."""
    return measure_copy_bandwidth(dev, COPY_BYTES, lambda fn: time_ms(fn, 20)) if dev.type == "cuda" else None


def run_case(model, B, L, T, dev, reps, bw, rows_out):
    Hq, Hkv = MODELS[model]
    D = HEAD_DIM
    inp = _make_inputs(B, L, T, Hq, Hkv, D, torch.bfloat16, dev)
    q, k_cache, v_cache = inp["q"], inp["k_cache"], inp["v_cache"]
    elt = q.element_size()
    nbytes = B * (L + T) * Hkv * D * 2 * elt + 2 * B * T * Hq * D * elt

    def plan_for(factor):
        base = plan_tree_attention(inp["parents"], inp["context_lens"], inp["block_table"], num_q_heads=Hq,
                                   num_kv_heads=Hkv, head_dim=D, block_size=PAGE, max_context_len=L)
        if factor == 1.0:
            return base
        split_len = max(SPLIT_ALIGN, int(base.split_len * factor) // SPLIT_ALIGN * SPLIT_ALIGN)
        return plan_tree_attention(inp["parents"], inp["context_lens"], inp["block_table"], num_q_heads=Hq,
                                   num_kv_heads=Hkv, head_dim=D, block_size=PAGE, max_context_len=L, split_len=split_len)

    defaults = (tk.PIPELINE, tk.CONFIG_OVERRIDE, tk.LAZY_RESCALE)
    out = torch.empty_like(q)

    def runner(var, plan):
        def fn():
            tk.PIPELINE, tk.CONFIG_OVERRIDE, tk.LAZY_RESCALE = var.pipeline, var.config, var.lazy
            try:
                plan.run(q, k_cache, v_cache, out=out, backend="triton")
            finally:
                tk.PIPELINE, tk.CONFIG_OVERRIDE, tk.LAZY_RESCALE = defaults
        return fn

    # First pass: compile, check against the default's output.
    reference, ready = None, []
    for var in variants_for(T * (Hq // Hkv)):
        plan = plan_for(var.split)
        fn = runner(var, plan)
        try:
            out.fill_(float("nan"))
            fn()
            if dev.type == "cuda":
                torch.cuda.synchronize()
        except Exception as exc:  # e.g. out of shared memory for this config
            print(f"{model:12s} ({B},{L},{T}) {var.label:28s} FAILED {type(exc).__name__}: {str(exc)[:100]}", flush=True)
            continue
        if reference is None:
            reference = out.clone()
        ready.append((var, plan, fn, (out.float() - reference.float()).abs().max().item()))
    # Timed in interleaved rounds (the order rotating each round), each variant's figure the median of its
    # per-round medians: the clock drifts over a case (seen: the default 13% slower a few seconds later on an
    # H200), which back-to-back timing would charge to whichever variant ran late.
    rounds = ROUNDS if dev.type == "cuda" else 1
    per = {id(v): [] for v, *_ in ready}
    for r in range(rounds):
        for i in range(len(ready)):
            var, _, fn, _ = ready[(i + r) % len(ready)]
            per[id(var)].append(time_ms(fn, max(1, reps // rounds)))
    base_ms = None
    for var, plan, _, err in ready:
        ms = statistics.median(per[id(var)])
        base_ms = base_ms or ms
        pct = 100.0 * nbytes / bw / (ms * 1e-3) if bw else float("nan")
        spread = (max(per[id(var)]) - min(per[id(var)])) / ms
        row = dict(model=model, B=B, L=L, T=T, variant=var.label, ms=ms, pct_floor=pct, speedup=base_ms / ms,
                   max_abs_err=err, num_splits=plan.num_splits, split_len=plan.split_len, bytes_moved=nbytes,
                   round_ms=per[id(var)])
        rows_out.append(row)
        print(f"{model:12s} ({B},{L},{T}) {var.label:28s} S={plan.num_splits:<2d} {ms:8.4f} ms {pct:6.1f}% floor "
              f"x{base_ms / ms:5.2f} vs default  err {err:.2e}  rounds spread {100 * spread:4.1f}%", flush=True)
    reference = None
    del inp, q, k_cache, v_cache, out, reference
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def summary(rows) -> str:
    """Markdown: per case the default, the fastest other variant, and its speedup / error."""
    lines = ["| model | B | L | T | default ms (% floor) | default again | best variant | ms (% floor) | speedup | max err |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    cases = {}
    for r in rows:
        cases.setdefault((r["model"], r["B"], r["L"], r["T"]), []).append(r)
    for (model, B, L, T), rs in cases.items():
        d = rs[0]
        again = [r for r in rs if r["variant"] == "default (again)"]
        others = [r for r in rs[1:] if not r["variant"].startswith("default")]
        best = min(others, key=lambda r: r["ms"]) if others else d
        lines.append(f"| {model} | {B} | {L} | {T} | {d['ms']:.4f} ({d['pct_floor']:.1f}) | "
                     f"{again[0]['ms']:.4f} | {best['variant']} | {best['ms']:.4f} ({best['pct_floor']:.1f}) | "
                     f"{d['ms'] / best['ms']:.3f}x | {best['max_abs_err']:.1e} |" if again else
                     f"| {model} | {B} | {L} | {T} | {d['ms']:.4f} ({d['pct_floor']:.1f}) | - | {best['variant']} | "
                     f"{best['ms']:.4f} ({best['pct_floor']:.1f}) | {d['ms'] / best['ms']:.3f}x | {best['max_abs_err']:.1e} |")
    return "\n".join(lines)


def main() -> None:
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    reps = int(os.environ.get("TLT_VARIANT_REPS", "100" if dev.type == "cuda" else "1"))
    bw = copy_bandwidth(dev)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (TRITON_INTERPRET=1)"
    print(f"device: {name}; copy bandwidth: {bw / 1e9:.0f} GB/s" if bw else f"device: {name}", flush=True)
    print(f"start {datetime.now(timezone.utc):%Y-%m-%d %H:%M:%S} UTC; torch {torch.__version__}, triton {triton.__version__}",
          flush=True)
    rows = []
    for model, B, L, T in _selected(GPU_CASES if dev.type == "cuda" else CPU_CASES):
        run_case(model, B, L, T, dev, reps, bw, rows)
    print(summary(rows))
    print(f"end {datetime.now(timezone.utc):%Y-%m-%d %H:%M:%S} UTC", flush=True)
    path = os.environ.get("TLT_VARIANT_JSON")
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(dict(device=name, copy_bandwidth=bw, rows=rows), indent=1))


if __name__ == "__main__":
    main()
