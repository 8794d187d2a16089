"""``python -m bench report [--check]``: docs/PERFORMANCE.md and the README's Performance table from the records.

Both are generated from ``bench/results/<card>/<suite>.json`` (:mod:`bench.records`), never edited by hand:
re-record a suite (``python -m bench <suite> --record``), then run the report. ``--check`` writes nothing and
exits 1 when either file differs from what the records give (tests/bench/test_report.py runs the same check).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

from .headlines import CARDS, HEADLINES, RATIO_CARDS
from .records import OTHER_RECORDS, RESULTS_DIR, UNITS, flat_rows, load_records

ROOT = Path(__file__).resolve().parent.parent
PERFORMANCE_MD = ROOT / "docs" / "PERFORMANCE.md"
README_MD = ROOT / "README.md"
START, END = "<!-- perf-table:start -->", "<!-- perf-table:end -->"
MAX_SECTION_LINES = 25  # the README's Performance section, heading to the next heading
CARD_NAMES = {"h100": "H100", "h200": "H200"}
Records = Dict[str, Dict[str, Dict[str, Any]]]


def _card_name(card: str) -> str:
    return CARD_NAMES.get(card, card.upper())


def _headline_cells(records: Records, headline) -> List[str]:
    cells = []
    for card in CARDS:
        record = records.get(card, {}).get(headline.suite)
        value = headline.value(flat_rows(record)) if record else None
        cells.append(headline.fmt.format(value) if value is not None else "—")
    ratio = "—"
    for card in RATIO_CARDS:
        record = records.get(card, {}).get(headline.suite)
        value = headline.ratio_value(flat_rows(record)) if record else None
        if value is not None:
            ratio = (f"{value:.0f}x" if value >= 100 else f"{value:.2f}x") + ("" if card == RATIO_CARDS[0] else f" ({_card_name(card)})")
            break
    return cells + [ratio]


def readme_table(records: Records) -> str:
    """The lines between the README's markers: one table, then where the rest is."""
    head = ["op or workload", "metric"] + [_card_name(c) for c in CARDS] + ["ratio to the peer, same run"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for h in HEADLINES:
        lines.append("| " + " | ".join([h.label, h.metric] + _headline_cells(records, h)) + " |")
    lines += [
        "",
        "Each cell: the median over the rows [docs/PERFORMANCE.md](docs/PERFORMANCE.md) names (every row, command, "
        "commit and version of the runs of record); ratio: the H200's, > 1 means ours is faster.",
    ]
    return "\n".join(lines)


def replace_readme_table(readme: str, table: str) -> str:
    """``readme`` with the text between the perf-table markers replaced by ``table``."""
    try:
        before, rest = readme.split(START, 1)
        _, after = rest.split(END, 1)
    except ValueError:
        raise ValueError(f"README has no {START} ... {END} markers") from None
    return f"{before}{START}\n{table}\n{END}{after}"


def performance_section_lines(readme: str) -> int:
    """Lines of the README's '## Performance' section, its heading included, up to the next '## ' heading."""
    lines = readme.splitlines()
    start = lines.index("## Performance")
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    while end > start and not lines[end - 1].strip():
        end -= 1
    return end - start


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace("|", "/")


def _comparisons(row: Dict[str, Any]) -> str:
    """Ours against the peers (a peer's row: against ours), at most six; the record has every ratio."""
    ratios = row.get("speedup_vs") or {}
    mine = str(row["impl"]).startswith("tlt")
    shown = {k: v for k, v in ratios.items() if k.startswith("tlt") != mine} or ratios
    return "; ".join(f"{v:.2f}x {k}" for k, v in list(shown.items())[:6])


HIDDEN = {"case", "impl", "ms", "bytes_moved", "gbps", "pct_hbm_floor", "speedup_vs", "runs_ms"}


def suite_table(record: Dict[str, Any]) -> List[str]:
    """The record's rows as one Markdown table: case, impl, ms, GB/s, % HBM floor, the suite's columns, ratios."""
    rows = record.get("rows", [])
    if not rows:
        return ["(no rows recorded)"]
    case_cols: List[str] = []
    extra: List[str] = []
    for r in rows:
        case_cols += [k for k in r.get("case", {}) if k not in case_cols]
        extra += [k for k in r if k not in HIDDEN and k not in extra]
    has_gbps = any(r.get("gbps") is not None for r in rows)
    has_floor = any(r.get("pct_hbm_floor") is not None for r in rows)
    head = case_cols + ["impl", "ms"] + ["GB/s"] * has_gbps + ["% HBM floor"] * has_floor + extra
    out = ["| " + " | ".join(head + ["ms(other) / ms(this), same case"]) + " |", "|" + "---|" * (len(head) + 1)]
    for r in rows:
        cells = [_cell(r.get("case", {}).get(c)) for c in case_cols] + [r["impl"], _cell(r.get("ms"))]
        cells += [_cell(r.get("gbps"))] * has_gbps
        cells += [f"{r['pct_hbm_floor']:.1f}" if r.get("pct_hbm_floor") is not None else ""] * has_floor
        cells += [_cell(r.get(c)) for c in extra] + [_comparisons(r)]
        out.append("| " + " | ".join(cells) + " |")
    return out


def _run_line(index: int, run: Dict[str, Any]) -> str:
    bw = run.get("copy_bandwidth")
    return (f"  - run {index}: `{run.get('command')}`, {run.get('date')}, {run.get('cases')} cases"
            + (f", copy bandwidth {bw / 1e9:.0f} GB/s" if bw else ""))


def suite_section(record: Dict[str, Any]) -> List[str]:
    v = record.get("versions", {})
    bw = record.get("copy_bandwidth")
    lines = [f"### {record['suite']}", ""]
    lines.append(f"- command: `{record.get('command')}`")
    lines.append(f"- commit {record.get('commit')}, {record.get('date')}; {v.get('device')}, torch {v.get('torch')}, "
                 f"triton {v.get('triton')}, CUDA {v.get('cuda')}, driver {v.get('driver') or 'not recorded'}, "
                 f"python {v.get('python') or 'not recorded'}")
    if bw:
        lines.append(f"- copy bandwidth (the HBM floor's copy, same run): {bw / 1e9:.0f} GB/s")
    if record.get("runs"):
        lines.append(f"- recorded in {len(record['runs'])} parts of the same commit (`--record-merge`); each row's "
                     "`run` names the part that measured its case, its ratios are within that part:")
        lines += [_run_line(i, run) for i, run in enumerate(record["runs"])]
    peers = {k: p for k, p in (record.get("peers") or {}).items() if k != "impls"}
    peer_text = "; ".join(f"{k} {p.get('version')}" for k, p in peers.items())
    impls = ", ".join(f"`{i}`" for i in (record.get("peers") or {}).get("impls", []))
    lines.append(f"- peer libraries in the same run: {peer_text or 'none'}; impls other than ours: {impls or 'none'}")
    if record.get("source"):
        block = f", run log block \"{record['run_log_block']}\"" if record.get("run_log_block") else ""
        lines.append(f"- source: {record['source']}{block}")
    lines.append("")
    lines += suite_table(record)
    if record.get("notes"):
        lines += ["", "Notes:", ""] + [f"- {n}" for n in record["notes"]]
    return lines + [""]


RULES = """\
## How figures are recorded

1. **Median of many runs.** Every time is the median of `triton.testing.do_bench(warmup=25, rep=100)` (L2 flushed
   between runs) on CUDA, or of `time_cuda_events_ms` without Triton; `-graph` rows replay the call from a CUDA
   graph (no host dispatch). CPU timings are smoke tests and are not recorded, except simulations by nature.
2. **Peers in the same run, on the same card.** A ratio to a peer (FlashInfer, torch SDPA, flex attention, the
   torch reference, plain decoding) is only recorded when both ran in the same invocation on the same card; a peer
   that was unavailable is named in the record's `peers` and notes. H100 and H200 figures are never compared with
   each other: HBM3 against HBM3e changes every memory-bound number.
3. **The HBM floor is measured, not quoted.** `% HBM floor` divides the time a device-to-device copy of the op's
   minimal bytes takes (the copy timed in the same run: `copy_bandwidth`) by the op's time.
4. **One run of record per suite and card**: `bench/results/<card>/<suite>.json` holds its command, commit, date,
   versions (torch, triton, CUDA, driver, device, python), every row, the peers and the units. Replacing the file is
   how a suite is re-recorded; git keeps the history. A suite too long for one call is recorded in parts of one
   commit (`--record-merge`): each case's rows come from one part, and the record lists the parts.

## What each metric means

| column | meaning |
|---|---|
""" + "\n".join(f"| `{k}` | {v} |" for k, v in UNITS.items()) + """

Suite-specific columns are described in each suite's module docstring (`bench/suites/<suite>.py`).

## How to re-record

On an H100 or H200, from the repository root (`bash bench/gpu_check.sh` installs the package first):

```bash
python -m bench tree-attention --record     # replaces bench/results/<card>/tree-attention.json
python -m bench report                      # regenerates this page and the README's Performance table
```

In parts, when one call cannot hold the whole suite (the first part replaces the record, the others add to it):

```bash
python -m bench tree-attention --record
python -m bench tree-attention --cases long-tail@4096 --record --record-merge   # then @16384, @65536
```

On a GPU machine reached through a copy of the tree, write the records where the results come back
(`--record $OUT/bench/results`, or `GPU_CHECK_BENCH_ARGS="--record $OUT/bench/results" bash bench/gpu_check.sh`) and
copy `<card>/<suite>.json` into `bench/results/`. A failed or stopped suite is never recorded. Commit the record and
the regenerated files together; `tests/bench/test_report.py` fails when they disagree.

The rollout suite on the real default model goes through the device tool in five calls on one warm machine (the
model travels in two pieces, `tools/carry_model.sh`; the extension prebuilt here, `tools/carry_extension.sh`):
`tools/device_model.sh 1`, then `tools/device_rollout_record.sh 1 SHA` (joins the model, trains the EAGLE drafter for
60 s, records B = 1 and 4 with the step-cost rows), then parts 2, 3 and 4 of the same script (add B = 16 and the long
tail; B = 64 and 256; B = 1, 16 and the tail sampled at temperature 1); each script's header lists what its call
carries. A drafter trained longer in an earlier session (`tools/device_train_drafter.sh`, kept in `.peer/eagle/`)
rides in a sixth call before them (`tools/device_rollout_record.sh drafter`), and part 1 then trains none; one trained
in the same machine session (`tools/device_train_drafter.sh` in the second call, after `tools/device_model.sh 1`)
is left where part 1 finds it, and part 1's call then carries only `.peer/soz` (the model stays joined).

## Reading the figures

Greedy output is identical to plain decoding in every e2e row. At T >= 32 tree attention is bound by tensor-core
FLOPs rather than bytes (the suite reports `pct_roofline`), and at small batch `verify_tree`'s walk is a chain of
dependent rows: docs/CUDA_NOTES.md and docs/TREE_ATTENTION.md explain both.

The README's plot (`docs/e2e_tokens_per_s.png`) is tokens/s per step over an e2e rollout (H200, B = 128): plain
decoding, the best static strategy (fixed strategy, drafter trained once), the best static arm with the spot-trained
drafter and the adaptive engine, cold and warm. As requests finish the batch shrinks; plain decoding's long tail is
what speculation cuts. Redraw it from the run's step log (the e2e suite's `--write-steps`) with:

```bash
python -m bench.plot_steps bench/step_logs/h200_e2e_b128_2026-11-27_0644.json --out docs/e2e_tokens_per_s.png \\
  --rows "plain,static-s4k2v8,static-s5k4v16 (spot drafter),adaptive,adaptive (warm)"
```

The rl suite's record per RL step (`docs/rl_steps.png`): each way's mean reward and rollout seconds (log scale:
transformers' `generate` is the top line). The policy (SmolLM2-135M-Instruct) solves few of the arithmetic problems,
so the rewards are small and noisy; the lossless check is the record's two-sample test, not the curves. Redraw it
after re-recording with:

```bash
python -m bench.plot_rl bench/results/h200/rl.json --out docs/rl_steps.png
```

![reward and rollout time per RL step](rl_steps.png)
"""


def _headline_doc() -> List[str]:
    lines = ["## The README table", "",
             "Each card cell is the **median** over the rows below of that card's record (one number per cell, not a",
             "range); the ratio column is the median of the same rows' ratio to the peer on the H200 (the H100 where",
             "the H200 has no such rows).", "",
             "| README line | suite | impl | rows | value |", "|---|---|---|---|---|"]
    for h in HEADLINES:
        lines.append(f"| {h.label} | `{h.suite}` | `{h.impl}` | {h.selection} | `{h.column}` |")
    return lines + [""]


def _other_records(card: str, records: Dict[str, Dict[str, Any]]) -> List[str]:
    lines: List[str] = []
    for name in OTHER_RECORDS:
        rec = records.get(name)
        if not rec:
            continue
        lines += [f"### {name} ({_card_name(card)})", "", f"- command: `{rec.get('command')}`",
                  f"- date {rec.get('date')}; {rec.get('versions', {}).get('device')}", ""]
        if rec.get("summary"):
            lines += [rec["summary"], ""]
        lines += ["| what | exit | result | commit |", "|---|---|---|---|"]
        for r in rec.get("rows", []):
            what = r.get("file") or " ".join([r.get("tool", "")] + r.get("pytest_args", []))
            ok = r.get("exit", r.get("exit_code"))
            result = r.get("summary") or r.get("pytest") or ""
            lines.append(f"| `{_cell(what)}` | {ok} | {_cell(result)} | {r.get('commit', '')} |")
        lines.append("")
    return lines


def performance_md(records: Records) -> str:
    lines = ["# Performance", "",
             "<!-- Generated by `python -m bench report` from bench/results/<card>/<suite>.json; edit the records or",
             "bench/report.py, not this file. -->", "",
             "Every figure below was measured by `python -m bench` and comes with the run that produced it.", ""]
    lines += RULES.splitlines() + [""] + _headline_doc()
    for card in sorted(records):
        suites = {k: v for k, v in records[card].items() if k not in OTHER_RECORDS}
        if suites:
            lines += [f"## {_card_name(card)}", ""]
            for name in sorted(suites):
                lines += suite_section(suites[name])
    tests = [line for card in sorted(records) for line in _other_records(card, records[card])]
    if tests:
        lines += ["## GPU tests / sanitizer", ""] + tests
    lines += ["## Earlier runs", "",
              "The dated run log that preceded these records (every A/B, probe and partial run of 2026-11-26/27) was",
              "`bench/RESULTS.md`; it is kept in git history: `git show 42a893b:bench/RESULTS.md` (the last commit",
              "before its removal). Docs that cite a \"run log\" block by its date and time refer to it; each record",
              "converted from it names its block.", ""]
    return "\n".join(lines)


def regenerate(results: Path = RESULTS_DIR, readme_text: Optional[str] = None) -> Dict[str, str]:
    """``{"performance": text, "readme": text}`` from the records under ``results``."""
    records = load_records(results)
    readme = README_MD.read_text() if readme_text is None else readme_text
    return {"performance": performance_md(records), "readme": replace_readme_table(readme, readme_table(records))}


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench report", description=__doc__.splitlines()[0])
    p.add_argument("--results", type=Path, default=RESULTS_DIR, help=f"records folder (default {RESULTS_DIR})")
    p.add_argument("--docs", type=Path, default=PERFORMANCE_MD, help="the performance page to write")
    p.add_argument("--readme", type=Path, default=README_MD, help="the README whose perf-table section is replaced")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if either file is stale")
    args = p.parse_args(argv)
    out = regenerate(args.results, args.readme.read_text())
    targets = {args.docs: out["performance"], args.readme: out["readme"]}
    stale = [path for path, text in targets.items() if not path.exists() or path.read_text() != text]
    if args.check:
        for path in stale:
            print(f"stale: {path} (run `python -m bench report`)", file=sys.stderr)
        return 1 if stale else 0
    for path in stale:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(targets[path])
        print(f"wrote {path}")
    return 0
