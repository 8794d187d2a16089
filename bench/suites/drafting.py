"""Suite "ngram": n-gram (prompt-lookup) proposal over a batch of histories.

``bytes_moved`` = the valid histories read once (``sum(lengths) * itemsize``) plus the drafts
written: the floor of a kernel that reads every history. Two history kinds: ``random`` (a 32k
vocabulary, so long n-grams rarely recur) and ``repetitive`` (a 16-token vocabulary: the longest n
matches near the end, where the tree kernel's backward scan stops early). ``torch-ref`` is the
vectorized reference.

Rows per case (impl):

* ``tlt-triton``: the public op (validation off), host overhead included when the GPU outruns it;
* ``tlt-triton-graph`` (CUDA): the same op captured in a CUDA graph and replayed: GPU time only,
  the number to hold against the n-gram target (B=256, L=8192, k=8, n in [1,4] under 20 us);
* ``tlt-triton-rowscan-graph`` (CUDA): the previous one-program-per-request kernel, replayed the same
  way: the same-machine baseline for the chunked design;
* tree rows: ``ngram_propose_tree`` (one program per request, unchanged design);
* group rows (histories up to 8k): ``tlt-triton-group`` / ``tlt-triton-group-tree`` (and ``-graph``), each request
  drafting from its group of 8 consecutive rows (``siblings=``), checked against the torch reference.

Sweep: ``python -m bench ngram --sweep`` also times the chunked kernel for every
``CHUNKxWARPS`` config of ``--sweep-configs`` (default below) on the ``random`` histories,
as graph replays on CUDA (rows ``chunk<C>-w<W>``, with ``chunk`` / ``warps`` columns). The winner
goes into ``tlt_kernels/_triton/ngram.py`` (``CHUNK``, ``NUM_WARPS``).
"""
from __future__ import annotations

import argparse

import torch

from tlt_kernels import BackendUnavailableError
from tlt_kernels.ops.ngram import ngram_propose, ngram_propose_tree

from ..flags import Flag, values

SUITE = "ngram"

SWEEP_CONFIGS = "256x2,512x2,512x4,1024x4,1024x8,2048x4,2048x8,4096x8,4096x16"
SWEEP_CONFIGS_SMALL = "16x1,32x1"  # CPU / --small: exercises the sweep path only


def _histories(B, L, vocab, device):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (B, L), generator=g)
    lengths = torch.randint(L - L // 8, L + 1, (B,), generator=g).to(torch.int32)
    return tokens.to(device), lengths.to(device)


def _parse_configs(spec):
    configs = []
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        try:
            chunk, warps = (int(x) for x in item.lower().split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"entries must look like 1024x4 (CHUNKxWARPS), got {item!r}") from None
        configs.append((chunk, warps))
    return configs


FLAGS = (
    Flag("--sweep", False, "also time the chunked kernel for every --sweep-configs config (tuning)", bool,
         replaces="TLT_NGRAM_SWEEP"),
    Flag("--sweep-configs", None, f"comma-separated CHUNKxWARPS configs of the sweep (default: {SWEEP_CONFIGS}; "
         f"{SWEEP_CONFIGS_SMALL} when small)", _parse_configs, replaces="TLT_NGRAM_SWEEP_CONFIGS", metavar="LIST"),
)


def _sweep(ctx, case, tokens, lengths, k, max_n, ref, nbytes):
    from tlt_kernels._triton.ngram import ngram_propose_out

    B = tokens.shape[0]
    configs = values(ctx, FLAGS).sweep_configs or _parse_configs(SWEEP_CONFIGS_SMALL if ctx.small else SWEEP_CONFIGS)
    drafts = torch.empty(B, k, dtype=torch.int64, device=ctx.device)
    num = torch.empty(B, dtype=torch.int32, device=ctx.device)
    for chunk, warps in configs:
        def fn(chunk=chunk, warps=warps):
            ngram_propose_out(tokens, lengths, 1, max_n, drafts, num, chunk=chunk, num_warps=warps)

        drafts.fill_(-12345)
        num.fill_(-12345)
        fn()
        if not (torch.equal(drafts, ref.drafts) and torch.equal(num, ref.num_drafts)):
            raise AssertionError(f"ngram chunked kernel != torch for {case}, chunk={chunk}, num_warps={warps}")
        ms = ctx.time_graph_ms(fn) if ctx.device.type == "cuda" else ctx.time_ms(fn)
        ctx.add(case, f"chunk{chunk}-w{warps}", ms, bytes_moved=nbytes, chunk=chunk, warps=warps)


GROUP = 8  # responses per prompt of the group rows (GRPO's G)


def _bench_group(ctx, case, tokens, lengths, k: int, max_n: int) -> None:
    """``tlt-triton-group`` (chain) and ``tlt-triton-group-tree`` rows: every request drafts from its group of
    GROUP consecutive rows (``siblings=``), checked against the torch reference; ``bytes_moved`` = each request's
    group's histories read once. Graph-replayed rows on CUDA."""
    from tlt_kernels.engine.groups import sibling_table

    B = tokens.shape[0]
    siblings = sibling_table([b // GROUP for b in range(B)], B, tokens.device)
    nbytes = int(lengths.sum()) * tokens.element_size() * min(GROUP, B)
    # The chain and tree rows share their self-only rows' cases, so the report holds them side by side.
    for name, fn, extra, gcase in (("tlt-triton-group", ngram_propose, (k,), case),
                                   ("tlt-triton-group-tree", ngram_propose_tree, (k // 2, 4),
                                    dict(case, k=k // 2, branches=4))):
        call = lambda backend, fn=fn, extra=extra: fn(tokens, lengths, *extra, 1, max_n, validate=False,  # noqa: E731
                                                      backend=backend, siblings=siblings)
        want, got = call("torch"), call("triton")
        if not all(torch.equal(a, b) for a, b in zip(want, got)):
            raise AssertionError(f"{name} != torch for {gcase}")
        ctx.add(gcase, name, ctx.time_ms(lambda: call("triton")), bytes_moved=nbytes, group=min(GROUP, B))
        if ctx.device.type == "cuda":
            ctx.add(gcase, f"{name}-graph", ctx.time_graph_ms(lambda: call("triton")), bytes_moved=nbytes,
                    group=min(GROUP, B))


def run(ctx) -> None:
    if ctx.small:
        cases = [(4, 256, 8, 4)]
    else:
        cases = [(64, 2048, 8, 4), (256, 8192, 8, 4), (256, 32768, 8, 4)]
    cuda = ctx.device.type == "cuda"
    sweep = bool(values(ctx, FLAGS).sweep)
    for B, L, k, max_n in cases:
        for kind, vocab in (("random", 32000), ("repetitive", 16)):
            tokens, lengths = _histories(B, L, vocab, ctx.device)
            nbytes = int(lengths.sum()) * tokens.element_size() + B * k * 8
            case = {"B": B, "L": L, "k": k, "max_n": max_n, "history": kind}
            ref = ngram_propose(tokens, lengths, k, 1, max_n, validate=False, backend="torch")
            ctx.add(case, "torch-ref", ctx.time_ms(lambda: ngram_propose(tokens, lengths, k, 1, max_n, validate=False, backend="torch")), bytes_moved=nbytes)
            try:
                out = ngram_propose(tokens, lengths, k, 1, max_n, validate=False, backend="triton")
            except BackendUnavailableError as exc:
                ctx.note(f"ngram tlt-triton skipped: {exc}")
                continue
            if not (torch.equal(out.drafts, ref.drafts) and torch.equal(out.num_drafts, ref.num_drafts)):
                raise AssertionError(f"ngram_propose triton != torch for {case}")
            op = lambda: ngram_propose(tokens, lengths, k, 1, max_n, validate=False, backend="triton")  # noqa: E731
            ctx.add(case, "tlt-triton", ctx.time_ms(op), bytes_moved=nbytes, mean_drafts=float(out.num_drafts.float().mean()))
            if cuda:
                from tlt_kernels._triton.ngram import ngram_propose_rowscan_out

                ctx.add(case, "tlt-triton-graph", ctx.time_graph_ms(op), bytes_moved=nbytes)
                d = torch.empty(B, k, dtype=torch.int64, device=ctx.device)
                n = torch.empty(B, dtype=torch.int32, device=ctx.device)
                ngram_propose_rowscan_out(tokens, lengths, 1, max_n, d, n)
                if not (torch.equal(d, ref.drafts) and torch.equal(n, ref.num_drafts)):
                    raise AssertionError(f"ngram rowscan baseline != torch for {case}")
                ctx.add(case, "tlt-triton-rowscan-graph", ctx.time_graph_ms(lambda: ngram_propose_rowscan_out(tokens, lengths, 1, max_n, d, n)),
                        bytes_moved=nbytes)
            if sweep and kind == "random":
                _sweep(ctx, case, tokens, lengths, k, max_n, ref, nbytes)
            if L <= 8192:  # the reference's memory grows with B * GROUP * L * max_n
                _bench_group(ctx, case, tokens, lengths, k, max_n)
            R = 4
            tcase = dict(case, k=k // 2, branches=R)
            tree_args = (tokens, lengths, k // 2, R, 1, max_n)
            ref_t = ngram_propose_tree(*tree_args, validate=False, backend="torch")
            out_t = ngram_propose_tree(*tree_args, validate=False, backend="triton")
            if not all(torch.equal(a, b) for a, b in zip(out_t, ref_t)):
                raise AssertionError(f"ngram_propose_tree triton != torch for {tcase}")
            ctx.add(tcase, "torch-ref-tree", ctx.time_ms(lambda: ngram_propose_tree(*tree_args, validate=False, backend="torch")), bytes_moved=nbytes)
            ctx.add(tcase, "tlt-triton-tree", ctx.time_ms(lambda: ngram_propose_tree(*tree_args, validate=False, backend="triton")), bytes_moved=nbytes,
                    mean_nodes=float(out_t.num_nodes.float().mean()))
    if cuda:
        from tlt_kernels._triton import ngram as kern

        ctx.note(f"ngram target: B=256, L=8192, k=8, n in [1,4] under 20 us on H100/H200 (compare the tlt-triton-graph row). "
                 f"Chunked kernel defaults: CHUNK={kern.CHUNK}, NUM_WARPS={kern.NUM_WARPS}, MIN_PROGRAMS={kern.MIN_PROGRAMS}.")
