"""Where the CUDA ``verify_tree`` time goes at small batch: ``python -m tools.profile_acceptance [--out DIR]`` (GPU).

The acceptance suite's cases (random logits, draft rows close to the target's) time the whole walk; this tool
varies one thing at a time on chain and tree shapes at V=152064 (bf16 logits, fp32 draft probabilities), each
timed as a CUDA-graph replay (median, L2 flushed between replays by ``triton.testing.do_bench``):

* regime: ``bench`` (the suite's drafts), ``accept`` (q = the target's own distribution: every draft accepted,
  the walk visits every row), ``reject`` (each draft is the target's least likely token: rejected at the root,
  one row plus one residual pass), ``greedy`` (temperature 0: one pass per row, no normalizer);
* cluster size C (``TLT_VERIFY_CLUSTER``: 1 .. 16, 0 = the launcher's choice);
* top-p (``--top-p 1,0.9``; 1 = off): the threshold's select passes per visited row (not with ``greedy``);
* ``floor_us``: the visited rows' bytes (logits rows of the walk, draft rows of the nodes whose children were tried)
  over the bandwidth of a 1 GiB device-to-device copy timed here, as the acceptance suite counts them.

Rows print as JSON: ``us``, mean and longest walk (rows), ``us_per_row`` of the longest walk, ``floor_us``.
A developer tool: benchmark figures come from ``python -m bench acceptance``.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def _case(kind, T, B, V, regime, dev, seed=0):
    from bench.suites.acceptance import NOISE, TEMPERATURE, _parents

    g = torch.Generator(device=dev).manual_seed(seed)
    parents = _parents(kind, T, B, dev)
    logits = torch.randn(B, T, V, generator=g, device=dev).mul_(3)
    if regime == "accept":
        q = torch.softmax(logits / TEMPERATURE, -1)
    else:
        q = torch.softmax(torch.randn(B, T, V, generator=g, device=dev).mul_(NOISE).add_(logits, alpha=1 / TEMPERATURE), -1)
    tokens = torch.zeros(B, T, dtype=torch.int64, device=dev)
    par = parents.long()
    for i in range(1, T):
        rows_q = q[torch.arange(B, device=dev), par[:, i]]
        if regime == "reject":  # the target's least likely token, given near-full draft mass: rejected
            tokens[:, i] = logits[torch.arange(B, device=dev), par[:, i]].argmin(-1)
            q[torch.arange(B, device=dev), par[:, i], tokens[:, i]] = 1e3
        elif regime == "greedy":
            tokens[:, i] = logits[torch.arange(B, device=dev), par[:, i]].argmax(-1)
        else:
            tokens[:, i] = torch.multinomial(rows_q, 1, generator=g).squeeze(1)
    if regime == "reject":
        q = q / q.sum(-1, keepdim=True)
    return logits.to(torch.bfloat16), tokens, parents, q


def _shape(name: str):
    """``"chain8"`` -> ``("chain", 8)``."""
    return name.rstrip("0123456789"), int(name.lstrip("chaintre"))


def _verify_kwargs(regime: str, q, B: int, dev, top_p: float) -> dict:
    """verify_tree's keyword arguments for a case of ``_case`` (greedy: no draft rows; top_p 1: off)."""
    from bench.suites.acceptance import TEMPERATURE

    greedy = regime == "greedy"
    return dict(draft_probs=None if greedy else q, temperature=0.0 if greedy else TEMPERATURE,
                top_p=top_p if top_p < 1 else None, seed=torch.arange(B, dtype=torch.int64, device=dev), validate=False,
                backend="cuda")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--shapes", default="chain4,chain8,tree16")
    ap.add_argument("--bs", default="1,16,64")
    ap.add_argument("--regimes", default="bench,accept,reject,greedy")
    ap.add_argument("--clusters", default="0,4,8,16")
    ap.add_argument("--vocab", type=int, default=152064)
    ap.add_argument("--top-p", default="1", help="comma list; 1 = no top-p")
    args = ap.parse_args()
    import tlt_kernels._cuda.verify_tree as cuda_vt
    from bench.harness import BenchContext
    from bench.suites.acceptance import _bytes
    from tlt_kernels import verify_tree

    dev = torch.device("cuda")
    timer = BenchContext("profile-acceptance", dev)  # the suites' do_bench median, graph capture and copy bandwidth
    bandwidth = timer.copy_bandwidth
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s (1 GiB device-to-device copy)", flush=True)
    rows = []
    for shape in args.shapes.split(","):
        kind, T = _shape(shape)
        for B in (int(b) for b in args.bs.split(",")):
            for regime in args.regimes.split(","):
                logits, tokens, parents, q = _case(kind, T, B, args.vocab, regime, dev)
                for top_p in (float(p) for p in args.top_p.split(",")):
                    if top_p < 1 and regime == "greedy":
                        continue
                    kw = _verify_kwargs(regime, q, B, dev, top_p)
                    cuda_vt.CLUSTER_SIZE = 0  # the walk (rows visited) does not depend on C: once per top_p
                    res = verify_tree(logits, tokens, parents, return_stats=True, **kw)
                    visited = res.num_accepted.long() + 1
                    longest = int(visited.max())
                    nbytes = _bytes(res, args.vocab, logits.element_size(), 0 if regime == "greedy" else q.element_size())
                    floor_us = 1e6 * nbytes / bandwidth
                    for C in (int(c) for c in args.clusters.split(",")):
                        cuda_vt.CLUSTER_SIZE = C
                        try:
                            op = lambda lg=logits: verify_tree(lg, tokens, parents, **kw)  # noqa: E731
                            op()
                            us = 1e3 * timer.time_graph_ms(op)
                        except Exception as exc:  # a cluster size the device refuses
                            print(f"{shape} B={B} {regime} top_p={top_p} C={C}: {type(exc).__name__}: {exc}", flush=True)
                            continue
                        row = dict(shape=shape, B=B, regime=regime, top_p=top_p, C=C, us=round(us, 2),
                                   mean_visited=round(visited.float().mean().item(), 2), longest=longest,
                                   us_per_row=round(us / longest, 2), floor_us=round(floor_us, 2))
                        rows.append(row)
                        print(json.dumps(row), flush=True)
                cuda_vt.CLUSTER_SIZE = 0
                del logits, q
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "profile_acceptance.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
