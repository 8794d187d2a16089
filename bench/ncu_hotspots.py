"""Summarize an Nsight Compute report: ``python -m bench.ncu_hotspots REPORT.ncu-rep [--top N]`` (GPU machine, ncu on PATH).

Prints the warp-stall breakdown (``smsp__pcsamp_warps_issue_stalled_*`` samples, largest first) and the N SASS
instructions with the most stall samples, each with its top stall reasons. A developer tool for kernels whose time is
not in their bytes (e.g. ``ncu --set full -k regex:verify_tree -c 1 -o rep python -m bench.profile_acceptance ...``).
"""
from __future__ import annotations

import argparse
import csv
import io
import subprocess


def _ncu_csv(report: str, *args: str) -> list:
    out = subprocess.run(["ncu", "-i", report, "--csv", *args], check=True, capture_output=True, text=True).stdout
    return list(csv.reader(io.StringIO(out[out.find('"'):])))


def _num(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("report")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--cuda-lines", type=int, default=0,
                    help="also the N CUDA source lines with the most stall samples (needs -lineinfo and ncu --import-source yes)")
    args = ap.parse_args()

    raw = _ncu_csv(args.report, "--page", "raw")
    header, values = raw[0], raw[2] if len(raw) > 2 else raw[1]
    stalls = [(h.replace("smsp__pcsamp_warps_issue_stalled_", ""), _num(v)) for h, v in zip(header, values)
              if h.startswith("smsp__pcsamp_warps_issue_stalled_") and not h.endswith("_not_issued")]
    total = sum(v for _, v in stalls) or 1.0
    print("warp stall samples (all instructions):")
    for name, v in sorted(stalls, key=lambda x: -x[1])[:14]:
        print(f"  {name:32s} {v:10.0f}  {100 * v / total:5.1f}%")

    src = _ncu_csv(args.report, "--page", "source", "--print-source", "sass")
    # The source page starts with the kernel's name on a line of its own; the header is the first row naming a
    # stall-sampling column.
    at = next((i for i, r in enumerate(src[:10]) if any(h.startswith("Warp Stall Sampling") for h in r)), 0)
    head, src = src[at], src[at:]
    col = {h: i for i, h in enumerate(head)}
    samp = next((i for h, i in col.items() if h.startswith("Warp Stall Sampling (All")), None)
    text = next((i for h, i in col.items() if h in ("Source", "Sass", "SASS")), None)
    addr = next((i for h, i in col.items() if h.startswith("Address")), None)
    if samp is None or text is None:
        print("source page columns:", head)
        return
    reasons = [i for h, i in col.items() if h.startswith("stall_") or "Stall" in h and i != samp and "Sampling" not in h]
    rows = [r for r in src[1:] if len(r) == len(head)]
    all_samples = sum(_num(r[samp]) for r in rows) or 1.0
    print(f"\ntop {args.top} SASS lines by stall samples ({all_samples:.0f} in all):")
    for r in sorted(rows, key=lambda r: -_num(r[samp]))[:args.top]:
        why = sorted(((head[i], _num(r[i])) for i in reasons), key=lambda x: -x[1])[:3]
        why_s = ", ".join(f"{h}={v:.0f}" for h, v in why if v > 0)
        where = r[addr] if addr is not None else ""
        print(f"  {100 * _num(r[samp]) / all_samples:5.1f}%  {where:>8s}  {r[text][:70]:70s}  {why_s}")

    if args.cuda_lines:
        _cuda_lines(args.report, args.cuda_lines)


def _cuda_lines(report: str, top: int) -> None:
    """Stall samples per CUDA source line (inlined device functions keep their own lines): which phase of a fused
    kernel the time is in."""
    try:
        src = _ncu_csv(report, "--page", "source", "--print-source", "cuda")
    except subprocess.CalledProcessError as exc:
        print("cuda source page failed:", exc.stderr[-500:] if exc.stderr else exc)
        return
    rows, head, file_name = [], None, ""
    for r in src:
        if head is None or (r and r[0] in ("#", "Line", "# Line")):
            if any(h.startswith("Warp Stall Sampling") for h in r):
                head = r
            elif len(r) == 1:
                file_name = r[0]
            continue
        if len(r) == 1:
            file_name = r[0]
            continue
        if len(r) == len(head):
            rows.append((file_name, r))
    if head is None:
        print("cuda source page: no stall-sampling column; first rows:", src[:3])
        return
    col = {h: i for i, h in enumerate(head)}
    samp = next(i for h, i in col.items() if h.startswith("Warp Stall Sampling (All"))
    line = next((i for h, i in col.items() if h in ("#", "Line", "# Line")), 0)
    text = next((i for h, i in col.items() if h == "Source"), len(head) - 1)
    total = sum(_num(r[samp]) for _, r in rows) or 1.0
    print(f"\ntop {top} CUDA source lines by stall samples ({total:.0f} in all):")
    for f, r in sorted(rows, key=lambda x: -_num(x[1][samp]))[:top]:
        print(f"  {100 * _num(r[samp]) / total:5.1f}%  {f.split('/')[-1][:24]:24s}:{r[line]:>5s}  {r[text].strip()[:90]}")


if __name__ == "__main__":
    main()
