"""Suite "integrations": the engine adapters' cost over the walk they wrap, and FlashInfer's own call.

One chain of ``n`` drafts per request, drawn from its draft rows, at temperature 1. Rows per case (each with its
``-graph`` row, replayed from a CUDA graph, on a GPU):

* ``verify_tree``: the walk called directly (target logits, draft rows): the floor of every adapter;
* ``flashinfer-adapter``: :func:`tlt_kernels.integrations.flashinfer.chain_speculative_sampling` (target
  probabilities: pays a log over them and a copy of the draft rows);
* ``vllm-adapter``: :func:`tlt_kernels.integrations.vllm.rejection_sample` (flattened rows: pays their regrouping);
* ``sglang-adapter``: :func:`tlt_kernels.integrations.sglang.tree_speculative_sampling_target_only` (the chain as
  linked lists: pays the renumbering and a gather of the logits rows; drafts without draft rows);
* ``flashinfer``: FlashInfer's ``chain_speculative_sampling`` on the same probabilities (peer, when importable;
  first checked on its documented example, whose outcome is forced).

``bytes_moved``: the logits (or probabilities) and draft rows read once. Compare each adapter with ``verify_tree``
(its overhead) and ``flashinfer-adapter`` with ``flashinfer`` (the call it replaces), graph with graph.
"""
from __future__ import annotations

import torch

from ..flags import Flag, int_list, values

SUITE = "integrations"

FLAGS = (
    Flag("--batch-sizes", None, "comma-separated batch sizes (default: 1,16,64,256; small 1,4)", int_list,
         metavar="LIST"),
    Flag("--vocab-sizes", None, "comma-separated vocabulary sizes (default: 32000,152064; small 64)", int_list,
         metavar="LIST"),
    Flag("--drafts", None, "comma-separated chain lengths n (default: 3,7; small 3)", int_list, metavar="LIST"),
    Flag("--graphs", True, "also time each call replayed from a CUDA graph (-graph rows)", bool),
)


def _inputs(B: int, n: int, V: int, device):
    g = torch.Generator(device=device).manual_seed(B * 1000 + n)
    logits = 3 * torch.randn(B, n + 1, V, generator=g, device=device)
    draft = torch.softmax(logits[:, :n] + torch.randn(B, n, V, generator=g, device=device), -1)
    ids = torch.multinomial(draft.reshape(-1, V), 1, generator=g).reshape(B, n)
    return logits, draft, ids


def _calls(logits, draft, ids, fi):
    """``{impl: fn}`` for one case: every call reads the same inputs, prepared outside the timed region."""
    from tlt_kernels import chain_parents, verify_tree
    from tlt_kernels.integrations import flashinfer as fi_adapter
    from tlt_kernels.integrations import sglang, vllm

    B, n1, V = logits.shape
    dev = logits.device
    probs = torch.softmax(logits, -1)
    seed = torch.arange(B, device=dev)
    rows = torch.cat([draft, draft.new_zeros(B, 1, V)], 1)
    tokens = torch.cat([ids.new_zeros(B, 1), ids], 1)
    parents = chain_parents(B, n1, dev)
    flat_logits, flat_draft = logits[:, :-1].reshape(-1, V).contiguous(), draft.reshape(-1, V).contiguous()
    cu = torch.arange(1, B + 1, device=dev) * (n1 - 1)
    bonus = torch.zeros(B, 1, dtype=torch.int64, device=dev)
    links = torch.arange(1, n1 + 1, device=dev).where(torch.arange(1, n1 + 1, device=dev) < n1, -1)
    next_token, next_sibling = links.expand(B, n1).contiguous(), torch.full((B, n1), -1, device=dev)
    index = torch.arange(B * n1, device=dev).reshape(B, n1)
    calls = {
        "verify_tree": lambda: verify_tree(logits, tokens, parents, draft_probs=rows, temperature=1.0, seed=seed,
                                           validate=False),
        "flashinfer-adapter": lambda: fi_adapter.chain_speculative_sampling(draft, ids, probs, seed=seed,
                                                                            validate=False),
        "vllm-adapter": lambda: vllm.rejection_sample(ids.reshape(-1), cu, n1 - 1, flat_draft, flat_logits, bonus,
                                                      temperature=1.0, seed=seed, validate=False),
        "sglang-adapter": lambda: sglang.tree_speculative_sampling_target_only(
            tokens, index, next_token, next_sibling, logits, n1, temperature=1.0, seed=seed, validate=False),
    }
    if fi is not None:
        ids32 = ids.to(torch.int32)
        calls["flashinfer"] = lambda: fi.sampling.chain_speculative_sampling(draft, ids32, probs)
    return calls


def _flashinfer_checked(ctx):
    """FlashInfer, or None (noted) when missing or when its documented example does not come out as forced."""
    fi = ctx.try_import("flashinfer") if ctx.device.type == "cuda" else None
    if fi is None:
        return None
    dev = ctx.device
    draft = torch.tensor([[[0.1, 0.2, 0.3, 0.4], [0.2, 0.3, 0.4, 0.1]]], device=dev)
    target = torch.tensor([[[0.0, 0.1, 0.6, 0.3], [1.0, 0.0, 0.0, 0.0], [0.7, 0.1, 0.1, 0.1]]], device=dev)
    try:
        out = fi.sampling.chain_speculative_sampling(draft, torch.tensor([[2, 1]], dtype=torch.int32, device=dev),
                                                     target)
        tokens = out[0] if isinstance(out, tuple) else out
        ok = tokens.tolist() == [[2, 0, -1]]
    except Exception as exc:  # API differences between versions
        ctx.note(f"flashinfer chain_speculative_sampling failed its check: {type(exc).__name__}: {exc}")
        return None
    if not ok:
        ctx.note(f"flashinfer chain_speculative_sampling gave {tokens.tolist()} on its documented example "
                 "(forced: [[2, 0, -1]]); not timed")
        return None
    return fi


def run(ctx) -> None:
    p = values(ctx, FLAGS)
    big = not ctx.small
    batches = p.batch_sizes or ((1, 16, 64, 256) if big else (1, 4))
    vocabs = p.vocab_sizes or ((32000, 152064) if big else (64,))
    chains = p.drafts or ((3, 7) if big else (3,))
    graphs = bool(p.graphs) and ctx.device.type == "cuda"
    fi = _flashinfer_checked(ctx)
    for V in vocabs:
        for n in chains:
            for B in batches:
                logits, draft, ids = _inputs(B, n, V, ctx.device)
                bytes_moved = (logits.numel() + draft.numel()) * 4
                case = {"B": B, "n": n, "V": V}
                for impl, fn in _calls(logits, draft, ids, fi).items():
                    fn()  # compile / warm up outside the timing
                    ctx.add(case, impl, ctx.time_ms(fn), bytes_moved=bytes_moved)
                    if graphs:
                        ctx.add(case, f"{impl}-graph", ctx.time_graph_ms(fn), bytes_moved=bytes_moved)
                del logits, draft, ids
