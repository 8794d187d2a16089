"""Phase times inside one CUDA ``verify_tree`` walk: ``python -m tools.profile_phases [--shape chain4 --B 16 ...]`` (GPU).

Needs ``_C`` built with the kernel's developer marks::

    CUDAFLAGS=-DTLT_VERIFY_PROFILE=1 python -m pip install --no-build-isolation --no-deps -e .

(a fresh build directory: CMake reads CUDAFLAGS only when it configures). CTA 0's thread 0 then prints the GPU's
SM clock and global timer at each mark of request 0's walk (stored, printed at the kernel's end) (``row`` pass start, ``stats`` fold, top-p ``cand``idates, ``select``,
``norm``alizer, ``resid``ual, ``walk`` end, final sample ``end``); this tool runs the case ``--reps`` times (eager,
after a warm-up) in a child process, parses the marks and prints the median duration of each consecutive pair of
marks (e.g. ``stats->cand``: the candidate pass) and of the whole kernel. Request 0's walk is not always the longest:
the cases here use the acceptance profile's drafts with a fixed seed, and the tool prints how many rows it visited.
A developer tool for where a fused kernel's time goes; benchmark figures come from ``python -m bench acceptance``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections import defaultdict


def _child(args) -> None:
    import torch

    from tools.profile_acceptance import _case, _shape, _verify_kwargs
    from tlt_kernels import verify_tree

    dev = torch.device("cuda")
    kind, T = _shape(args.shape)
    logits, tokens, parents, q = _case(kind, T, args.B, args.vocab, args.regime, dev)
    kw = _verify_kwargs(args.regime, q, args.B, dev, args.top_p)
    res = verify_tree(logits, tokens, parents, **kw)
    torch.cuda.synchronize()
    sys.stdout.flush()
    print(f"tltcase visited_req0={int(res.num_accepted[0]) + 1} longest={int(res.num_accepted.max()) + 1}", flush=True)
    for _ in range(args.reps):
        print("tltrep", flush=True)
        verify_tree(logits, tokens, parents, **kw)
        torch.cuda.synchronize()


def _parse(text: str) -> dict:
    """Marks are ``tltprof NAME CLOCK GLOBAL_NS`` (SM clock cycles and the global timer): durations come from the
    clock, which ticks finer than the global timer, scaled to us by the rep's global / clock ratio."""
    reps, cur, info = [], None, ""
    for line in text.splitlines():
        if line.startswith("tltcase"):
            info = line[len("tltcase "):]
        elif line.startswith("tltrep"):
            cur = []
            reps.append(cur)
        elif line.startswith("tltprof") and cur is not None:
            _, name, clock, glob = line.split()
            cur.append((name, int(clock), int(glob)))
    pairs = defaultdict(list)
    totals = []
    for marks in reps:
        if len(marks) < 2:
            continue
        clocks = marks[-1][1] - marks[0][1]
        us_per_clock = (marks[-1][2] - marks[0][2]) / 1e3 / clocks if clocks > 0 else 0.0
        totals.append(clocks * us_per_clock)
        per = defaultdict(float)
        for (a, ca, _), (b, cb, _) in zip(marks, marks[1:]):
            per[f"{a}->{b}"] += (cb - ca) * us_per_clock
        for k, v in per.items():
            pairs[k].append(v)
    out = {"case": info, "reps": len(totals), "kernel_us": round(statistics.median(totals), 2) if totals else None}
    out["phases_us"] = {k: round(statistics.median(v), 2) for k, v in sorted(pairs.items(), key=lambda kv: -statistics.median(kv[1]))}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="chain4")
    ap.add_argument("--B", type=int, default=16)
    ap.add_argument("--regime", default="bench")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--vocab", type=int, default=152064)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args)
        return
    proc = subprocess.run([sys.executable, "-m", "tools.profile_phases", "--child", *sys.argv[1:]], capture_output=True,
                          text=True, env=os.environ.copy())
    if proc.returncode != 0:
        sys.exit(proc.stderr[-2000:])
    out = _parse(proc.stdout)
    if not out["reps"]:
        sys.exit("no tltprof marks: build _C with CUDAFLAGS=-DTLT_VERIFY_PROFILE=1 (see the module docstring)")
    out.update(shape=args.shape, B=args.B, regime=args.regime, top_p=args.top_p,
               cluster=os.environ.get("TLT_VERIFY_CLUSTER", "auto"))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
