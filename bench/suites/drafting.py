"""Suite "ngram": n-gram (prompt-lookup) proposal over a batch of histories.

``bytes_moved`` = the valid histories read once (``sum(lengths) * itemsize``) plus the drafts
written: the kernel's floor when no early exit happens. Two history kinds bracket the kernel:
``random`` (a 32k vocabulary, so long n-grams rarely recur and the whole history is scanned) and
``repetitive`` (a 16-token vocabulary: the longest n matches near the end and the backward scan
stops after a tile, so the row can beat the "floor"). ``torch-ref`` is the vectorized reference.
"""
from __future__ import annotations

import torch

from tlt_kernels import BackendUnavailableError
from tlt_kernels.ops.ngram import ngram_propose, ngram_propose_tree

SUITE = "ngram"


def _histories(B, L, vocab, device):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (B, L), generator=g)
    lengths = torch.randint(L - L // 8, L + 1, (B,), generator=g).to(torch.int32)
    return tokens.to(device), lengths.to(device)


def run(ctx) -> None:
    if ctx.small:
        cases = [(4, 256, 8, 4)]
    else:
        cases = [(64, 2048, 8, 4), (256, 8192, 8, 4), (256, 32768, 8, 4)]
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
            ms = ctx.time_ms(lambda: ngram_propose(tokens, lengths, k, 1, max_n, validate=False, backend="triton"))
            ctx.add(case, "tlt-triton", ms, bytes_moved=nbytes, mean_drafts=float(out.num_drafts.float().mean()))
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
    if ctx.device.type == "cuda":
        ctx.note("ngram target (issue 6): B=256, L=8192, k=8, n in [1,4] under 20 us on H100/H200.")
