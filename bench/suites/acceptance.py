"""Suite "acceptance": lossless verification of draft chains and trees (``verify_tree``).

Cases: B in {1, 16, 64, 256}, V in {32000, 152064}, chains of 3/7/15 drafts and binary trees of
16/32/64 nodes, temperature 0.7 (``--temperature``; a run at another temperature adds it to each case as
``temperature``) with and without top-p 0.9, bf16 and fp32 target logits (``--logits-dtypes``; the
case's ``logits`` key), draft probabilities given (fp32). Target rows
are random logits (std 3); the drafts are sampled i.i.d. from ``q = softmax(logits / temp + 0.8 * noise)``
of their parent's row, which accepts roughly 60-80% of tried drafts (the achieved rate is reported per
case as ``accept_rate`` = accepted / tried children, and ``mean_accepted`` drafts per request).

Impls: ``tlt-triton`` and ``tlt-cuda`` (the fused kernels; ``-graph`` rows: the same call replayed from a CUDA
graph, i.e. GPU time without Python dispatch), ``torch-composed`` (softmax + top-p + rejection in torch:
the reference, float64), and FlashInfer's ``chain_speculative_sampling`` after a softmax of every row
(chains only) when FlashInfer is importable: ``flashinfer`` eagerly, ``flashinfer-graph`` replayed from a CUDA graph.
The tlt impls get the per-request parameters (temperature, top-p, seeds, offsets, node counts) as ``[B]`` device
tensors, as an engine passes them. Compare ``-graph`` rows with ``flashinfer-graph`` (both without host dispatch, as an engine's captured step runs
them) and eager rows with ``flashinfer``: an eager call at small B is mostly host time on both sides
(``python -m tools.profile_dispatch``). A failed FlashInfer capture is noted and ends its graph rows for the run
(``--no-flashinfer-graphs`` skips them).

Trees are also timed against the chain of the same depth (chain5 for tree16, chain6 for tree32, chain7 for
tree64; added to the run when a tree shape is), the issue's "tree verification with draft probabilities within
1.5x the time of the chain case of the same depth": one note per (tree, B, V, top_p, impl) gives the ratio.

``bytes_moved`` = the rows the walk actually visits: ``(num_accepted + 1)`` logits rows per request
plus one draft-probability row per node whose children were tried. The fused kernel re-reads a
visited row once per pass (max, radix-select levels, normalizer, sample) and writes a scratch row on
rejections; those re-reads mostly hit L2 and are not counted, so the HBM percentage is a ratio to the
ideal one-read floor.
"""
from __future__ import annotations

import argparse
import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch

from tlt_kernels import BackendUnavailableError, verify_tree

from ..flags import Flag, int_list, str_list, values

SUITE = "acceptance"

TEMPERATURE = 0.7
NOISE = 0.8


def _parents(kind: str, n: int, B: int, device) -> torch.Tensor:
    if kind == "chain":
        row = torch.arange(-1, n - 1)
    else:  # binary heap: node i's parent is (i - 1) // 2
        row = torch.div(torch.arange(n) - 1, 2, rounding_mode="floor")
        row[0] = -1
    return row.to(torch.int32).to(device).expand(B, n).contiguous()


def _case(B, T, V, parents, dtype, device, seed=0, temperature=TEMPERATURE):
    g = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g, device=device).mul_(3)
    # In place: at B=256, T=64, V=152064 every fp32 temporary is 10 GB.
    q = torch.randn(B, T, V, generator=g, device=device).mul_(NOISE).add_(logits, alpha=1 / temperature)
    q = torch.softmax(q, -1)
    tokens = torch.zeros(B, T, dtype=torch.int64, device=device)
    par = parents.long()
    for i in range(1, T):  # children of a node are i.i.d. draws from the parent's q row
        rows = q[torch.arange(B, device=device), par[:, i]]
        tokens[:, i] = torch.multinomial(rows, 1, generator=g).squeeze(1)
    return logits.to(dtype), tokens, q


def _heap_depth(T: int) -> int:
    """Depth of the binary-heap tree of T nodes that ``_parents`` builds (node i's parent (i - 1) // 2)."""
    return (T).bit_length() - 1


def _note_tree_vs_chain(ctx, shapes) -> None:
    """One note per tree case: its time over the same-depth chain's (same B, V, top_p, impl; target <= 1.5x)."""
    ms = {(r.case["shape"], r.case["B"], r.case["V"], r.case["top_p"], r.case["logits"], r.impl): r.ms
          for r in ctx.rows}
    for kind, T in shapes:
        if kind != "tree":
            continue
        chain = f"chain{_heap_depth(T) + 1}"
        for (shape, B, V, top_p, logits, impl), t_ms in ms.items():
            c_ms = ms.get((chain, B, V, top_p, logits, impl))
            if shape == f"tree{T}" and impl.startswith("tlt-") and c_ms:
                ctx.note(f"tree{T} / {chain} (depth {_heap_depth(T)}), B={B} V={V} top_p={top_p:g} {logits} logits "
                         f"{impl}: {t_ms / c_ms:.2f}x (target <= 1.5x)")


def _bytes(res, V, logit_bytes, q_bytes):
    rows = (res.num_accepted.long() + 1).sum().item()
    q_rows = (res.stats[:, :, 0] > 0).sum().item()
    return int(rows * V * logit_bytes + q_rows * V * q_bytes)


def _flashinfer_chain(fi, logits, tokens, q, top_p, temperature=TEMPERATURE):
    """FlashInfer chain verification: softmax every row (its fused temperature softmax where it has one, 0.4 and
    later), then chain_speculative_sampling."""
    if hasattr(fi.sampling, "softmax"):
        rows = logits.float().view(-1, logits.shape[-1])
        probs = fi.sampling.softmax(rows, temperature).view(logits.shape)
    else:
        probs = torch.softmax(logits.float() / temperature, -1)
    if top_p is not None:
        probs = fi.sampling.top_p_renorm_probs(probs.view(-1, probs.shape[-1]), top_p).view_as(probs)
    return fi.sampling.chain_speculative_sampling(q[:, :-1].contiguous(), tokens[:, 1:].to(torch.int32).contiguous(), probs)


IMPLS = ("torch-composed", "tlt-triton", "tlt-cuda", "tlt-cuda-visited", "tlt-cuda-parallel", "flashinfer")
# The tlt kernel rows: (impl name, backend, the CUDA walk's row mode forced: None = the launcher's rule). The forced
# rows A/B the two modes of the CUDA walk (visited rows streamed one after another, or every row's statistics first).
KERNEL_ROWS = (("tlt-triton", "triton", None), ("tlt-cuda", "cuda", None), ("tlt-cuda-visited", "cuda", False),
               ("tlt-cuda-parallel", "cuda", True))
GPU_SHAPES = (("chain", 4), ("chain", 8), ("chain", 16), ("tree", 16), ("tree", 32), ("tree", 64))
SHAPES = tuple(f"{kind}{n}" for kind, n in GPU_SHAPES)  # their names, for --shapes


def parse_impls(text: str) -> tuple:
    """The impls to time: ``"tlt-cuda,flashinfer"`` (each with its ``-graph`` row) skips the others, e.g. the Triton
    kernel's compiles and the float64 reference's timing inside a time-limited lease (the reference still runs once
    per case for ``accept_rate`` and ``same_as_ref``). Empty: all."""
    wanted = str_list(text)
    if not wanted:
        return IMPLS
    unknown = sorted(set(wanted) - set(IMPLS))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown impls {unknown}; known: {', '.join(IMPLS)}")
    return wanted


LOGITS_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_logits_dtypes(text: str) -> tuple:
    """``"bf16,fp32"`` -> those names, each one of :data:`LOGITS_DTYPES`."""
    wanted = str_list(text)
    unknown = sorted(set(wanted) - set(LOGITS_DTYPES))
    if unknown or not wanted:
        raise argparse.ArgumentTypeError(f"unknown logits dtypes {unknown or text!r}; known: {', '.join(LOGITS_DTYPES)}")
    return wanted


def parse_shapes(text: str) -> tuple:
    """``"chain8,tree16"`` -> the shapes to run (GPU size), each one of :data:`SHAPES`."""
    wanted = str_list(text)
    unknown = sorted(set(wanted) - set(SHAPES))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown shapes {unknown}; known: {', '.join(SHAPES)}")
    return wanted


# Shorter runs inside a time-limited lease: --batch-sizes 1,16,64 --vocab-sizes 152064 --shapes chain8,tree16
# --impls tlt-cuda,flashinfer.
FLAGS = (
    Flag("--impls", IMPLS, "comma-separated impls to time (each with its -graph row), of " + ", ".join(IMPLS),
         parse_impls, replaces="TLT_ACCEPTANCE_IMPLS", metavar="LIST"),
    Flag("--batch-sizes", (1, 16, 64, 256), "comma-separated batch sizes (GPU size)", int_list,
         replaces="TLT_ACCEPTANCE_BS", metavar="LIST"),
    Flag("--vocab-sizes", (32000, 152064), "comma-separated vocabulary sizes (GPU size)", int_list,
         replaces="TLT_ACCEPTANCE_VS", metavar="LIST"),
    Flag("--shapes", SHAPES, "comma-separated draft shapes (GPU size), of " + ", ".join(SHAPES), parse_shapes,
         replaces="TLT_ACCEPTANCE_SHAPES", metavar="LIST"),
    Flag("--graphs", True, "also time each tlt impl replayed from a CUDA graph (-graph rows)", bool,
         replaces="TLT_ACCEPTANCE_GRAPHS"),
    Flag("--flashinfer-graphs", True, "also time FlashInfer replayed from a CUDA graph", bool,
         replaces="TLT_ACCEPTANCE_FI_GRAPHS"),
    Flag("--logprobs", True, "also time each tlt impl returning both log-probs (-logprobs rows)", bool),
    Flag("--temperature", TEMPERATURE, "every request's sampling temperature (> 0; the drafts' too); other than "
         f"{TEMPERATURE}, each case carries it as 'temperature' (1.0: an RL rollout's)", float),
    Flag("--logits-dtypes", ("bf16", "fp32"), "comma-separated dtypes of the target logits, of bf16, fp16, fp32 (the "
         "draft probabilities stay fp32); each is its own case", parse_logits_dtypes, metavar="LIST"),
    Flag("--eager", True, "also time each impl called eagerly (--no-eager: the -graph rows only, where --graphs; the "
         "graph-against-graph comparison in less time)", bool),
)


def _sizes(ctx, p):
    """``(batch sizes, vocabulary sizes, shapes)`` of the run; shapes include the chain of each tree's depth."""
    if ctx.small:
        Bs, Vs, shapes = [2], [257], [("chain", 4), ("tree", 8)]
    else:
        Bs, Vs = list(p.batch_sizes), list(p.vocab_sizes)
        shapes = [(kind, n) for kind, n in GPU_SHAPES if f"{kind}{n}" in p.shapes]
    # The chain of each tree's depth (binary heap of T nodes: depth floor(log2(T))), for the tree-vs-chain note.
    for kind, T in list(shapes):
        same_depth = ("chain", _heap_depth(T) + 1)
        if kind == "tree" and same_depth not in shapes:
            shapes.append(same_depth)
    return Bs, Vs, shapes


def _sampled_temperature(value: float) -> float:
    """``--temperature``, checked: this suite verifies sampled drafts (the float type is shared with the suites
    that also declare the flag, which check it the same way)."""
    if not 0.0 < value < float("inf"):
        raise ValueError(f"--temperature must be a finite number > 0 (sampled verification), got {value}")
    return float(value)


@dataclass
class _Impls:
    """The impls a run times, and what it learns as it goes: a failed FlashInfer call or capture ends its rows."""

    names: tuple  # --impls
    graphs: bool  # the tlt impls' -graph rows
    fi: Any  # the flashinfer module, None when it is not timed (any more)
    fi_graphs: bool  # the flashinfer-graph rows
    logprobs: bool = False  # the tlt impls' -logprobs rows (return_logprobs and return_raw_logprobs)
    eager: bool = True  # the eager rows (off: graph rows only)
    logits_dtypes: tuple = ("bf16",)  # --logits-dtypes: one case per dtype
    temperature: float = TEMPERATURE  # --temperature: every request's
    unavailable: set = field(default_factory=set)  # kernel backends that could not run here (noted once)


def run(ctx) -> None:
    dev = ctx.device
    p = values(ctx, FLAGS)
    Bs, Vs, shapes = _sizes(ctx, p)
    impls = _Impls(
        names=p.impls,
        fi=ctx.try_import("flashinfer") if dev.type == "cuda" and "flashinfer" in p.impls else None,
        # Graph-replayed rows (``<impl>-graph``): at small B the eager call is mostly Python dispatch on both sides.
        graphs=dev.type == "cuda" and bool(p.graphs),
        # FlashInfer's pipeline replayed from a CUDA graph as well; --no-flashinfer-graphs times it eagerly only.
        fi_graphs=bool(p.flashinfer_graphs),
        logprobs=bool(p.logprobs),
        eager=bool(p.eager) or dev.type != "cuda",  # graph rows need CUDA: the CPU smoke run times eagerly
        logits_dtypes=tuple(p.logits_dtypes),
        temperature=_sampled_temperature(p.temperature),
    )
    for V in Vs:
        for kind, T in shapes:
            for B in Bs:
                _bench_shape(ctx, impls, kind, T, B, V)
    _note_tree_vs_chain(ctx, shapes)


def _bench_shape(ctx, impls: _Impls, kind: str, T: int, B: int, V: int) -> None:
    """Every row of one draft shape at batch size ``B`` and vocabulary ``V``, without and with top-p."""
    dev = ctx.device
    parents = _parents(kind, T, B, dev)
    logits32, tokens, q = _case(B, T, V, parents, torch.float32, dev, temperature=impls.temperature)
    for dtype_name in impls.logits_dtypes:
        logits = logits32.to(LOGITS_DTYPES[dtype_name])
        for top_p in (None, 0.9):
            case = {"shape": f"{kind}{T}", "B": B, "V": V, "top_p": top_p or 1.0, "logits": dtype_name}
            if impls.temperature != TEMPERATURE:  # the default's cases keep their keys (the records' identity)
                case["temperature"] = impls.temperature
            _bench_case(ctx, impls, case, kind, logits, tokens, parents, q, top_p)


def _bench_case(ctx, impls: _Impls, case, kind, logits, tokens, parents, q, top_p) -> None:
    """The rows of one case: the reference, the tlt kernels, torch-composed and (chains) FlashInfer."""
    B, V = logits.shape[0], logits.shape[-1]
    T = tokens.shape[1]
    kw = _engine_sampling(B, T, top_p, ctx.device, impls.temperature, draft_probs=q, validate=False)
    ref = verify_tree(logits, tokens, parents, return_stats=True, backend="torch", **kw)
    tried = ref.stats[:, :, 0].sum().item()
    extra = dict(accept_rate=round(ref.stats[:, :, 1].sum().item() / max(tried, 1), 3),
                 mean_accepted=round(ref.num_accepted.float().mean().item(), 3))
    nbytes = _bytes(ref, V, logits.element_size(), q.element_size())
    heavy = B * T * V > 64 * 16 * 152064 and not ctx.small
    if not heavy and "torch-composed" in impls.names:
        ms = ctx.time_ms(lambda: verify_tree(logits, tokens, parents, backend="torch", **kw))
        ctx.add(case, "torch-composed", ms, bytes_moved=nbytes, **extra)
    _bench_kernels(ctx, impls, case, logits, tokens, parents, kw, ref, nbytes, extra)
    if impls.fi is not None and kind == "chain":
        _bench_flashinfer(ctx, impls, case, logits, tokens, q, top_p, extra)
    if heavy and "torch-composed" in impls.names:
        ctx.note(f"torch-composed skipped for {case} (float64 [B, V] loops take seconds)")


def _engine_sampling(B: int, T: int, top_p, device, temperature: float = TEMPERATURE, **kw) -> dict:
    """verify_tree's per-request arguments as an engine passes them: ``[B]`` device tensors built once per step
    (scalars would cost a fill launch each per call; FlashInfer gets its own fastest form, the scalars)."""
    per_request = lambda value, dtype: torch.full((B,), value, dtype=dtype, device=device)  # noqa: E731
    return dict(temperature=per_request(temperature, torch.float32),
                top_p=None if top_p is None else per_request(top_p, torch.float32),
                seed=torch.arange(B, dtype=torch.int64, device=device), offset=per_request(0, torch.int64),
                num_nodes=per_request(T, torch.int32), **kw)


@contextlib.contextmanager
def _cuda_rows(parallel):
    """The CUDA walk's row mode forced to ``parallel`` (None: the launcher's rule) inside the block."""
    if parallel is None:
        yield
        return
    from tlt_kernels._cuda import verify_tree as cv

    saved, cv.PARALLEL_ROWS = cv.PARALLEL_ROWS, parallel
    try:
        yield
    finally:
        cv.PARALLEL_ROWS = saved


def _bench_kernels(ctx, impls: _Impls, case, logits, tokens, parents, kw, ref, nbytes, extra) -> None:
    """The ``tlt-triton`` / ``tlt-cuda`` rows (and their ``-graph`` rows; ``tlt-cuda-visited`` / ``-parallel`` with
    the CUDA walk's row mode forced), each compared with the reference ``ref``."""
    for name, impl, parallel in KERNEL_ROWS:
        if name in impls.unavailable or name not in impls.names:
            continue
        with _cuda_rows(parallel):
            # Log-prob rows for the launcher's own choice only (the forced rows are an A/B of the plain walk).
            _bench_kernel(ctx, impls, case, name, impl, (logits, tokens, parents), kw, ref, nbytes, extra,
                          logprobs=impls.logprobs and parallel is None)


def _bench_kernel(ctx, impls: _Impls, case, name, impl, tree, kw, ref, nbytes, extra, logprobs: bool) -> None:
    """One tlt kernel's rows of a case (``tree`` = logits, draft tokens, parents)."""
    logits, tokens, parents = tree
    try:
        got = verify_tree(logits, tokens, parents, return_stats=True, backend=impl, **kw)
    except BackendUnavailableError as exc:
        ctx.note(f"{name} skipped: {exc}")
        impls.unavailable.add(name)
        return
    same = (got.tokens == ref.tokens).all(1).float().mean().item()
    op = lambda: verify_tree(logits, tokens, parents, backend=impl, **kw)  # noqa: E731
    if impls.eager:
        ctx.add(case, name, ctx.time_ms(op), bytes_moved=nbytes, same_as_ref=round(same, 4), **extra)
    if impls.graphs:  # GPU time without Python dispatch (how an engine's step graph runs it)
        ctx.add(case, f"{name}-graph", ctx.time_graph_ms(op), bytes_moved=nbytes, same_as_ref=round(same, 4),
                **extra)
    if logprobs:  # the cost of scoring the emitted tokens: each row against its plain row of the case
        _bench_logprobs(ctx, impls, case, name, impl, tree, kw, ref, nbytes, extra)


def _bench_logprobs(ctx, impls: _Impls, case, name, impl, tree, kw, ref, nbytes, extra) -> None:
    """``<impl>-logprobs`` (and ``-logprobs-graph``): the call with both log-prob outputs on (``tree`` = logits,
    draft tokens, parents), through the op's scoring path for the backend (on both, the walk scores its own tokens);
    its tokens are checked against the reference's too."""
    op = lambda: verify_tree(*tree, backend=impl, return_logprobs=True, return_raw_logprobs=True, **kw)  # noqa: E731
    same = (op().tokens == ref.tokens).all(1).float().mean().item()
    if impls.eager:
        ctx.add(case, f"{name}-logprobs", ctx.time_ms(op), bytes_moved=nbytes, same_as_ref=round(same, 4), **extra)
    if impls.graphs:
        ctx.add(case, f"{name}-logprobs-graph", ctx.time_graph_ms(op), bytes_moved=nbytes, same_as_ref=round(same, 4),
                **extra)


def _bench_flashinfer(ctx, impls: _Impls, case, logits, tokens, q, top_p, extra) -> None:
    """The ``flashinfer`` row of a chain and its ``flashinfer-graph`` row; a failure is noted and ends those rows."""
    fi = impls.fi
    try:
        _flashinfer_chain(fi, logits, tokens, q, top_p, impls.temperature)
        ms = (ctx.time_ms(lambda: _flashinfer_chain(fi, logits, tokens, q, top_p, impls.temperature))
              if impls.eager else None)
    except Exception as exc:  # API differences between FlashInfer versions
        ctx.note(f"flashinfer chain_speculative_sampling failed on {case}: {type(exc).__name__}: {exc}")
        impls.fi = None
        return
    # FlashInfer reads every row of the chain (it does not skip rejected ones).
    B, T, V = tokens.shape[0], tokens.shape[1], logits.shape[-1]
    full = B * T * V * logits.element_size() + B * (T - 1) * V * q.element_size()
    if ms is not None:
        ctx.add(case, "flashinfer", ms, bytes_moved=full, **extra)
    if impls.graphs and impls.fi_graphs:  # graph against graph: how an engine's step graph runs it
        try:
            ms = ctx.time_graph_ms(lambda: _flashinfer_chain(fi, logits, tokens, q, top_p, impls.temperature))
        except Exception as exc:
            ctx.note(f"flashinfer-graph: capture failed on {case} ({type(exc).__name__}: {exc}); "
                     "no further flashinfer-graph rows")
            impls.fi_graphs = False
        else:
            ctx.add(case, "flashinfer-graph", ms, bytes_moved=full, **extra)
