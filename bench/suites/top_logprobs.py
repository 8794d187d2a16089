"""Suite "top-logprobs": a draft's vocabulary step, the k most likely tokens of each row with their log-probabilities.

An EAGLE draft runs it at every depth on ``rows = B * topk`` rows of the vocabulary head's logits; the rows' count is
small in the long tail, where a step is bound by launches. Each case (rows, V, k, dtype) times, graph against graph
(``ctx.time_graph_ms``: what a step's CUDA graph replays):

* ``tlt-triton``: :func:`tlt_kernels.top_logprobs` (the normaliser and the top k in one read of the row);
* ``torch``: ``torch.log_softmax(logits, -1, dtype=float32).topk(k)``, the drafter's code before the op;
* ``flashinfer top_k``: the same log-softmax, then FlashInfer's radix ``flashinfer.top_k(..., sorted=True)`` (same
  run, checked first: its tokens' logits must be the k largest);

and ``tlt-triton (eager)``, the op called from Python (its direct launch, no graph). ``bytes_moved`` is the logits read
once plus the outputs. On a CPU the op's reference (a stable sort) and the torch row run at small sizes.
"""
from __future__ import annotations

import torch

from tlt_kernels import top_logprobs

SUITE = "top-logprobs"

GPU_ROWS = (1, 4, 16, 64, 256, 1024)
GPU_VOCABS = (49152, 152064)  # SmolLM2 / Llama-style, Qwen2.5
KS = (1, 4, 8)


def _cases(on_gpu: bool, small: bool):
    if not on_gpu:
        return [(rows, 1000, k, torch.float32) for rows in (1, 8) for k in (1, 4)]
    rows_list = (1, 16, 256) if small else GPU_ROWS
    cases = [(rows, V, 4, torch.bfloat16) for V in GPU_VOCABS for rows in rows_list]
    cases += [(rows, 49152, k, torch.bfloat16) for k in KS if k != 4 for rows in (1, 16)]
    cases += [(rows, 49152, 4, torch.float32) for rows in (1, 64)]
    return cases


def _torch_top(logits, k):
    return torch.log_softmax(logits, -1, dtype=torch.float32).topk(k)


def _flashinfer_top(fi, logits, k):
    return fi.top_k(torch.log_softmax(logits, -1, dtype=torch.float32), k, sorted=True)


def _check_flashinfer(fi, logits, k, want_tokens) -> bool:
    """FlashInfer's tokens hold the k largest logits (ties may pick other columns, so compare the logits)."""
    _, tokens = _flashinfer_top(fi, logits, k)
    got = logits.float().gather(-1, tokens.long()).sort(-1, descending=True).values
    return torch.equal(got, logits.float().gather(-1, want_tokens))


def _case(ctx, fi, rows, V, k, dtype):
    g = torch.Generator(device=ctx.device).manual_seed(rows * 7 + V + k)
    logits = (torch.randn(rows, V, generator=g, device=ctx.device) * 4).to(dtype)
    want_logp, want_tokens = top_logprobs(logits, k, backend="torch")
    logp, tokens = top_logprobs(logits, k)
    if not torch.equal(tokens, want_tokens) or (logp - want_logp).abs().max().item() > 1e-5:
        raise AssertionError(f"top_logprobs disagrees with its reference at rows={rows}, V={V}, k={k}, {dtype}")
    case = {"rows": rows, "V": V, "k": k, "dtype": str(dtype).replace("torch.", "")}
    nbytes = logits.numel() * logits.element_size() + rows * k * 12
    on_gpu = ctx.device.type == "cuda"
    timer = ctx.time_graph_ms if on_gpu else ctx.time_ms
    ctx.add(case, "tlt-triton" if on_gpu else "reference (stable sort)", timer(lambda: top_logprobs(logits, k)), bytes_moved=nbytes)
    ctx.add(case, "torch", timer(lambda: _torch_top(logits, k)), bytes_moved=nbytes)
    if on_gpu:
        ctx.add(case, "tlt-triton (eager)", ctx.time_ms(lambda: top_logprobs(logits, k)), bytes_moved=nbytes)
    if fi is not None and hasattr(fi, "top_k"):
        if not _check_flashinfer(fi, logits, k, want_tokens):
            ctx.note(f"flashinfer top_k: wrong tokens at {case}; not timed")
            return
        ctx.add(case, "flashinfer top_k", timer(lambda: _flashinfer_top(fi, logits, k)), bytes_moved=nbytes)


def run(ctx) -> None:
    on_gpu = ctx.device.type == "cuda"
    fi = ctx.try_import("flashinfer") if on_gpu else None
    ctx.note("graph against graph on a GPU (tlt-triton (eager): the op called from Python); bytes_moved: the logits "
             "read once plus the outputs")
    for rows, V, k, dtype in _cases(on_gpu, ctx.small):
        _case(ctx, fi, rows, V, k, dtype)
