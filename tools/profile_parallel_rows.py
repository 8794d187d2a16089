"""The CUDA ``verify_tree``'s two row modes, A/B: ``python -m tools.profile_parallel_rows [--out FILE]`` (GPU).

For the acceptance suite's chain cases (its random logits and drafts, bf16 logits, fp32 draft probabilities,
temperature 0.7, with and without top-p 0.9) this times, as CUDA-graph replays (``triton.testing.do_bench``,
median), the visited-rows walk and parallel rows with the rows kernel's C forced to each of 1, 2, 4, 8, 16
(``ROWS_CLUSTER_SIZE``; 0 = the launcher's choice). Where the rows kernel's C is the walk's, the walk takes each
row's sampling plan from it (no pass over the last row), so C is also that trade. Rows print as JSON.
A developer tool: benchmark figures come from ``python -m bench acceptance``.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def _time_us(op) -> float:
    from triton.testing import do_bench

    op()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        op()
    return 1000.0 * do_bench(graph.replay, warmup=25, rep=100, return_mode="median")


def _modes():
    """(label, PARALLEL_ROWS, ROWS_CLUSTER_SIZE) of each timed mode."""
    yield "visited", False, 0
    for c in (0, 1, 2, 4, 8, 16):
        yield f"parallel C={c or 'auto'}", True, c


def _rows(args):
    from bench.suites.acceptance import _case, _engine_sampling, _parents
    from tlt_kernels import verify_tree
    from tlt_kernels._cuda import verify_tree as cv

    dev = torch.device("cuda")
    for V in args.vocab:
        for T in args.chain:
            for B in args.batch:
                parents = _parents("chain", T, B, dev)
                logits, tokens, q = _case(B, T, V, parents, torch.bfloat16, dev)
                for top_p in (None, 0.9):
                    kw = _engine_sampling(B, T, top_p, dev, draft_probs=q, validate=False)
                    cv.PARALLEL_ROWS, cv.ROWS_CLUSTER_SIZE = False, 0  # the reference is the visited-rows walk
                    ref = verify_tree(logits, tokens, parents, backend="cuda", **kw)
                    for label, parallel, rows_c in _modes():
                        cv.PARALLEL_ROWS, cv.ROWS_CLUSTER_SIZE = parallel, rows_c
                        op = lambda: verify_tree(logits, tokens, parents, backend="cuda", **kw)  # noqa: E731
                        same = (op().tokens == ref.tokens).all(1).float().mean().item()
                        yield dict(chain=T - 1, B=B, V=V, top_p=top_p or 1.0, mode=label, us=round(_time_us(op), 2),
                                   same_as_visited=round(same, 4))
    cv.PARALLEL_ROWS, cv.ROWS_CLUSTER_SIZE = None, 0


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, nargs="+", default=[32000, 152064])
    ap.add_argument("--chain", type=int, nargs="+", default=[5, 9], help="tree sizes T (drafts + 1)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--out", type=Path, help="also write the rows here (JSON lines)")
    args = ap.parse_args(argv)
    sink = args.out.open("w") if args.out else None
    for row in _rows(args):
        line = json.dumps(row)
        print(line, flush=True)
        if sink:
            sink.write(line + "\n")


if __name__ == "__main__":
    main()
