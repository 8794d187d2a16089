"""CUDA backend of :func:`tlt_kernels.verify_tree`: one launch of ``_C.verify_tree``.

Same entry point as the Triton backend (:func:`verify_tree_cuda` takes already-validated inputs).
A cluster of C CTAs (256 threads each, two per SM; C = 1, 2, 4, 8 or 16, the largest whose B clusters fit
in two waves, picked by the launcher from B, V and the SM count) walks one request, each CTA owning a slice of the vocabulary: it streams only the visited rows
(root, then each accepted node) with 16-byte loads, finds the top-k / top-p thresholds by 8-bit radix
select on the logits' order-preserving keys (integer histograms: deterministic run to run), folds
every statistic over the cluster in rank order (bit-identical in every CTA), and draws the coins with
the same Philox4x32-10 as :mod:`tlt_kernels.rng`. No host synchronization: CUDA-graph capturable.

Parallel rows (:func:`parallel_rows`: with top-p and at most ``PARALLEL_MAX_ROWS`` rows of ``B * T``): a first kernel
computes every node's row statistics at once, one cluster per (request, node), and the walk reads them instead of
streaming each visited row in turn; more bytes, far less latency where a top-p row's select would otherwise chain
row after row (docs/CUDA_NOTES.md, "Parallel rows").

``verify_tree_cuda_scored`` is the same walk with the emitted tokens' log-probs
(``verify_tree(return_logprobs=, return_raw_logprobs=)``) written by the kernel itself (separate instantiations; the
plain kernel is unchanged): the sampled one from the statistics the walk already folds for each visited row, the raw
one from a temperature-1 normalizer summed in the same pass and folded with them.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from .. import _switches
from ..reference.verify_tree import empty_verify_outputs, make_verify_tree_op, scored_launch
from . import extension, ptr, stream_handle

__all__ = ["verify_tree_cuda", "check_inputs", "elem_code"]

_ELEM = {torch.float32: "ELEM_FLOAT32", torch.float16: "ELEM_FLOAT16", torch.bfloat16: "ELEM_BFLOAT16"}
MAX_DEPTH = 4096  # _C.VERIFY_MAX_DEPTH: min(max_depth, T - 1) is staged in shared memory
# CTAs per request: 0 = the launcher's choice; 1, 2, 4, 8 or 16 force it (tests and tuning only; read at
# import from TLT_VERIFY_CLUSTER by tlt_kernels._switches, tests monkeypatch it).
CLUSTER_SIZE = _switches.VERIFY_CLUSTER.get()
# Top-p threshold among compacted candidates: the full-row radix select's threshold (up to float ties for top-p
# alone, whose need comes from the row's float Z;
# tests/ops/test_verify_tree_cuda.py::test_verify_topp_candidates_same_bits) in fewer passes, so faster
# (docs/CUDA_NOTES.md, "Measurements behind the csrc rules"). On by default; TLT_VERIFY_TOPP_COMPACT=0 at import
# turns it off (tlt_kernels._switches).
TOPP_COMPACT = _switches.VERIFY_TOPP_COMPACT.get()
# Parallel rows: None = the measured rule (parallel_rows), True / False force it (tests and A/B runs; read at import
# from TLT_VERIFY_PARALLEL_ROWS by tlt_kernels._switches, tests monkeypatch it).
PARALLEL_ROWS = _switches.VERIFY_PARALLEL_ROWS.get()
# CTAs per row of the parallel-rows kernel: 0 = the launcher's choice (as for the walk, from B x T rows); 1, 2, 4, 8
# or 16 force it (tuning only).
ROWS_CLUSTER_SIZE = 0
# The measured rule's bound on B x T, the rows the first kernel reads (docs/CUDA_NOTES.md, "Parallel rows").
PARALLEL_MAX_ROWS = 640


def parallel_rows(batch: int, num_tree: int, top_p: bool) -> bool:
    """Whether the CUDA walk gets every node's row statistics from a first kernel (one cluster per row, all at once)
    instead of streaming each visited row in turn. Measured rule: with a top-p filter (``top_p`` given), whose
    threshold costs a visited row several passes and cluster barriers, up to ``PARALLEL_MAX_ROWS`` rows of
    ``batch * num_tree``; without one a visited row is a single pass, and reading every row loses."""
    if PARALLEL_ROWS is not None:
        return bool(PARALLEL_ROWS)
    return top_p and batch * num_tree <= PARALLEL_MAX_ROWS


_ELEM_CODES: dict = {}  # dtype -> the extension's code, filled on first use


def elem_code(dtype: torch.dtype) -> int:
    """The extension's element-type code of a float32/float16/bfloat16 dtype."""
    code = _ELEM_CODES.get(dtype)
    if code is None:
        if dtype not in _ELEM:
            raise TypeError(f"the CUDA verify_tree kernel reads float32, float16 or bfloat16, got {dtype}")
        code = _ELEM_CODES[dtype] = getattr(extension(), _ELEM[dtype])
    return code


def _as(t: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """``t`` as a contiguous ``dtype`` tensor; no dispatcher call when it already is one (the common case: each
    no-op ``.to()`` / ``.contiguous()`` is host time of an eager call, python -m tools.profile_dispatch)."""
    if t is None or (t.dtype == dtype and t.is_contiguous()):
        return t
    return t.to(dtype).contiguous()


def check_inputs(logits: torch.Tensor, draft_probs: Optional[torch.Tensor], max_depth: int) -> None:
    """What the CUDA kernel adds to the op's validation (metadata only, no sync; works on CPU tensors)."""
    B, T, V = logits.shape
    if logits.dtype not in _ELEM:
        raise TypeError(f"logits must be float32/float16/bfloat16 for the CUDA backend, got {logits.dtype}")
    if draft_probs is not None and draft_probs.dtype not in _ELEM:
        raise TypeError(f"draft_probs must be float32/float16/bfloat16 for the CUDA backend, got {draft_probs.dtype}")
    if V > 2**31 - 1 - 2**16 or B * T * V >= 2**62:  # _C's kVerifyMaxVocab: int32 offsets plus a sweep step
        raise ValueError(f"logits shape {tuple(logits.shape)} is too large for int32 vocabulary indexing")
    if min(max_depth, T - 1) > MAX_DEPTH:
        raise ValueError(f"min(max_depth, T - 1) = {min(max_depth, T - 1)} exceeds the CUDA kernel's limit {MAX_DEPTH}")


def _launch(logits, draft_tokens, parents, num_nodes, draft_probs, temperature, top_k, top_p, seed, offset,
            max_depth, return_stats, out=None, scores=None):
    """Launch ``_C.verify_tree``; ``out`` optionally supplies (tokens, num, nodes, error, stats) int32 buffers;
    ``scores``, a contiguous float32 ``[B, max_depth+1, 2]`` buffer, runs the scored kernel, which also writes the
    emitted tokens' (sampled, raw) log-probs there."""
    B, T, V = logits.shape
    dev = logits.device
    if dev.type != "cuda":
        raise ValueError(f"verify_tree (cuda backend) needs CUDA tensors, got logits on {dev}")
    check_inputs(logits, draft_probs, max_depth)
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    if draft_probs is not None and draft_probs.stride(-1) != 1:
        draft_probs = draft_probs.contiguous()
    if draft_tokens.dtype not in (torch.int32, torch.int64):
        draft_tokens = draft_tokens.to(torch.int64)
    draft_tokens = draft_tokens if draft_tokens.stride(-1) == 1 else draft_tokens.contiguous()
    if parents.dtype != torch.int32 or parents.stride(-1) != 1:  # rows may be strided, elements not
        parents = parents.to(torch.int32).contiguous()
    num_nodes, top_k = _as(num_nodes, torch.int32), _as(top_k, torch.int32)
    temperature, top_p = _as(temperature, torch.float32), _as(top_p, torch.float32)
    seed, offset = _as(seed, torch.int64), _as(offset, torch.int64)
    if out is None:
        out = empty_verify_outputs(logits, max_depth, return_stats)
    out_tokens, out_num, out_nodes, out_err, out_stats = out
    if B == 0:
        return out
    ext = extension()
    # Two residual rows per request (ping-pong after rejections), and with parallel rows one top-p candidate row per
    # node before that; never read before the kernels write them.
    parallel = parallel_rows(B, T, top_p is not None)
    scratch = torch.empty(B, max(2, T) if parallel else 2, V, dtype=torch.float32, device=dev)
    row_stats = torch.empty(B, T, ext.VERIFY_ROW_WORDS, dtype=torch.float32, device=dev) if parallel else None
    # The device guard costs two device switches per call: skip it when dev is already current.
    same = dev.index is None or dev.index == torch.cuda.current_device()
    with contextlib.nullcontext() if same else torch.cuda.device(dev):
        ext.verify_tree(
            logits=ptr(logits), draft_probs=ptr(draft_probs), draft_tokens=ptr(draft_tokens), parents=ptr(parents),
            num_nodes=ptr(num_nodes), temperature=ptr(temperature), top_k=ptr(top_k), top_p=ptr(top_p),
            seed=ptr(seed), offset=ptr(offset), scratch=ptr(scratch), out_tokens=ptr(out_tokens),
            out_num=ptr(out_num), out_nodes=ptr(out_nodes), out_error=ptr(out_err),
            out_stats=ptr(out_stats) if return_stats and max_depth > 0 else 0,
            logits_stride_b=int(logits.stride(0)), logits_stride_t=int(logits.stride(1)),
            q_stride_b=int(draft_probs.stride(0)) if draft_probs is not None else 0,
            q_stride_t=int(draft_probs.stride(1)) if draft_probs is not None else 0,
            tokens_stride_b=int(draft_tokens.stride(0)), parents_stride_b=int(parents.stride(0)),
            batch=B, num_tree=T, vocab=V, max_depth=int(max_depth),
            tokens_int64=draft_tokens.dtype == torch.int64, logits_dtype=elem_code(logits.dtype),
            q_dtype=elem_code(draft_probs.dtype) if draft_probs is not None else 0,
            stream=stream_handle(dev), cluster_size=CLUSTER_SIZE, topp_compact=TOPP_COMPACT, scores=ptr(scores),
            row_stats=ptr(row_stats), scratch_rows=int(scratch.shape[1]), rows_cluster=ROWS_CLUSTER_SIZE,
        )
    return out


_verify_tree_op, verify_tree_cuda = make_verify_tree_op("tlt::verify_tree_cuda", _launch)
verify_tree_cuda.__doc__ = """CUDA backend of :func:`tlt_kernels.verify_tree` (inputs already validated by the op).

    Args/returns as :func:`tlt_kernels.reference.verify_tree.verify_tree_reference`: ``logits [B, T, V]``
    fp32/bf16/fp16, ``draft_tokens int32/int64 [B, T]``, ``parents int32 [B, T]``, ``num_nodes int32 [B]``
    or None, ``draft_probs [B, T, V]`` fp32/bf16/fp16 or None, ``temperature float32 [B]`` / ``top_k
    int32 [B]`` / ``top_p float32 [B]`` or None, ``seed, offset int64 [B]``. Visited rows with
    NaN/+inf (or all -inf) set ``error[b] = 1`` instead of raising.
    """


_verify_tree_scored_op, verify_tree_cuda_scored = make_verify_tree_op("tlt::verify_tree_cuda_scored",
                                                                      scored_launch(_launch), scored=True)
# The op's log-prob path on this backend: the walk scores the tokens it emits (no second pass over the rows).
verify_tree_cuda.scored = verify_tree_cuda_scored
