"""The CUDA tree-attention kernels over e4m3 caches, timed for a same-run A/B of a csrc change (``tools/ab.sh``):
the warp-specialized sm_90 kernel's cases (T * G > 64 rows) and the lockstep one-warpgroup kernel's (T * G <= 64,
the long-tail shapes), graph replays with the L2 flushed, Triton fp8 beside them as the yardstick the change does
not touch.

    bash tools/ab.sh CHANGE.patch -- python -m tools.fp8_cuda_ab [--reps 60] [--out FILE]

Prints one JSON line per case: the CUDA and Triton times (us), the kernel that ran (``warp_specialized``), and each
output's checksum and NaN flag (the inputs are seeded, so A and B must print the same checksums up to rounding)."""
from __future__ import annotations

import torch

from bench.suites.tree_attention import case_inputs
from tools.ab_timing import graph_us, run_ab

# (model, B, L, T): the warp-specialized kernel's five (T * G > 64), then eight long-tail shapes on the lockstep
# kernel (T * G <= 64), where `tlt-cuda fp8` took 1.4-2.1x `tlt-triton fp8`'s time in the H100 record at af219c7.
CASES = [("qwen2.5-7b", 64, 4096, 16), ("qwen2.5-7b", 64, 16384, 16), ("qwen2.5-32b", 64, 16384, 16),
         ("qwen2.5-32b", 8, 32768, 32), ("qwen2.5-7b", 32, 8192, 64),
         ("qwen2.5-7b", 16, 16384, 8), ("qwen2.5-7b", 16, 4096, 4), ("qwen2.5-7b", 4, 16384, 8),
         ("qwen2.5-7b", 1, 65536, 4), ("qwen2.5-7b", 8, 65536, 8), ("qwen2.5-32b", 16, 8192, 4),
         ("qwen2.5-7b", 16, 16384, 1), ("qwen2.5-7b", 8, 4096, 8)]


def measure(model, B, L, T, flush, reps):
    """Case ``(model, B, L, T)`` over e4m3 caches: each backend's median replay time and its output's checksum."""
    from tlt_kernels._cuda.tree_attention import runs_warp_specialized

    inp, plan_for = case_inputs(model, B, L, T, kv_dtype=torch.float8_e4m3fn)
    plan, q, k8, v8 = plan_for(), inp["q"], inp["k_cache"], inp["v_cache"]
    row = dict(model=model, B=B, L=L, T=T, warp_specialized=runs_warp_specialized(plan, q, k8, v8))
    for backend in ("cuda", "triton"):
        out = torch.full_like(q, float("nan"))  # poisoned: a row the kernel leaves unwritten shows as NaN

        def run(o=out, be=backend):
            return plan.run(q, k8, v8, out=o, backend=be)

        row[f"{backend}_us"] = round(graph_us(run, flush, reps), 2)
        row[f"{backend}_checksum"] = float(out.float().abs().sum())
        row[f"{backend}_nan"] = bool(out.isnan().any())
    return row


def main(argv=None) -> int:
    return run_ab(__doc__.split("\n\n")[0], CASES, measure, default_reps=60, argv=argv)


if __name__ == "__main__":
    raise SystemExit(main())
