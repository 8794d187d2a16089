"""Suite "linear": a model's projections at the few rows of a decoding step, the vendor BLAS against ours.

Per case (a projection's shape, ``rows`` = B x T): ``cublas`` (``F.linear``), ``tlt-triton`` (the few-row kernel) and
``tlt-auto`` (what ``tlt_kernels.linear`` picks: :func:`tlt_kernels.ops.linear.few_rows_kernel_applies`). Each row
times a chain of ``LAYERS`` distinct weights, a model's layers, in one CUDA graph, so the weights come from HBM and
every launch waits for the one before, as in a step; ``ms`` is the chain's median over ``LAYERS``. ``bytes_moved``:
the weights, the input rows and the output rows once. Every output is checked against ``F.linear`` before timing.
On a CPU a tiny case runs eagerly (the Triton rows only under the interpreter).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

SUITE = "linear"
LAYERS = 30
# (model, projection): (in_features, out_features); SmolLM2-135M's four (q/k/v and gate/up packed) and two of
# Qwen2.5-0.5B's, one past the auto rule's weight bound.
SHAPES = {
    ("smollm2-135m", "qkv"): (576, 960), ("smollm2-135m", "o"): (576, 576),
    ("smollm2-135m", "gate_up"): (576, 3072), ("smollm2-135m", "down"): (1536, 576),
    ("qwen2.5-0.5b", "qkv"): (896, 1152), ("qwen2.5-0.5b", "down"): (4864, 896),
}
ROWS = (1, 4, 16)


def _impls(ctx):
    from tlt_kernels import linear
    from tlt_kernels._backend import triton_interpret_enabled

    impls = {"cublas": F.linear, "tlt-auto": linear}
    if ctx.device.type == "cuda" or triton_interpret_enabled():
        impls["tlt-triton"] = lambda x, w: linear(x, w, backend="triton")
    else:
        ctx.note("tlt-triton: skipped on the CPU outside the Triton interpreter (TRITON_INTERPRET=1)")
    return impls


def _case(ctx, model: str, proj: str, K: int, N: int, rows: int, impls) -> None:
    gen = torch.Generator(device=ctx.device).manual_seed(rows * 7919 + K + N)
    ws = [torch.randn(N, K, generator=gen, device=ctx.device).mul_(K**-0.5).to(ctx.dtype) for _ in range(LAYERS)]
    x = torch.randn(rows, K, generator=gen, device=ctx.device).to(ctx.dtype)
    want = F.linear(x, ws[0])
    case = {"model": model, "proj": proj, "K": K, "N": N, "rows": rows}
    bytes_moved = N * K * x.element_size() + rows * (K + N) * x.element_size()
    for impl, fn in impls.items():
        got = fn(x, ws[0])
        # Both sum fp32 products and round once: a few ulps of the output's scale at most.
        torch.testing.assert_close(got.float(), want.float(), atol=0.05, rtol=0.02, msg=f"{impl} {case}")

        def chain(fn=fn):
            for w in ws:
                fn(x, w)

        ms = ctx.time_graph_ms(chain) if ctx.device.type == "cuda" else ctx.time_ms(chain)
        ctx.add(case, impl, ms / LAYERS, bytes_moved=bytes_moved)


def run(ctx) -> None:
    impls = _impls(ctx)
    small = ctx.device.type != "cuda"
    shapes = {("tiny", "qkv"): (64, 96)} if small else SHAPES
    for (model, proj), (K, N) in shapes.items():
        for rows in ((1, 4) if small else ROWS):
            _case(ctx, model, proj, K, N, rows, impls)
    ctx.note(f"each row: a chain of {LAYERS} distinct {str(ctx.dtype).replace('torch.', '')} weights in one CUDA "
             "graph (a model's layers), ms per projection; tlt-auto takes the Triton kernel at <= 16 rows and <= 2^21 "
             "weights on a GPU, F.linear elsewhere")
