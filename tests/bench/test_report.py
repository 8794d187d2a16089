"""The runs of record (bench/results/<card>/<suite>.json) and the report generated from them: docs/PERFORMANCE.md
and the README's Performance table must be what `python -m bench report` makes of the committed records."""
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # `bench` is a top-level folder, not part of the installed package
    sys.path.insert(0, str(ROOT))

from bench.__main__ import SuiteSpec, main as bench_main  # noqa: E402
from bench.headlines import HEADLINES  # noqa: E402
from bench.records import OTHER_RECORDS, RESULTS_DIR, card_slug, load_records  # noqa: E402
from bench.report import (END, MAX_SECTION_LINES, START, main as report_main,  # noqa: E402
                          performance_section_lines, readme_table, replace_readme_table, suite_section)

README = ROOT / "README.md"
PERFORMANCE = ROOT / "docs" / "PERFORMANCE.md"
RECORD_FIELDS = {"suite", "card", "command", "commit", "date", "versions", "rows", "peers", "units"}


def test_report_regenerates_the_committed_files(tmp_path):
    """Regenerate both files from the records into a temp dir: a stale PERFORMANCE.md or README table fails here."""
    docs, readme = tmp_path / "PERFORMANCE.md", tmp_path / "README.md"
    readme.write_text(README.read_text())
    assert report_main(["--docs", str(docs), "--readme", str(readme)]) == 0
    assert docs.read_text() == PERFORMANCE.read_text(), "docs/PERFORMANCE.md is stale: run `python -m bench report`"
    assert readme.read_text() == README.read_text(), "README's Performance table is stale: run `python -m bench report`"
    assert report_main(["--check"]) == 0


def test_check_flags_a_stale_readme(tmp_path, capsys):
    readme = tmp_path / "README.md"
    readme.write_text(README.read_text().replace(f"{START}\n", f"{START}\n| stale |\n"))
    assert report_main(["--check", "--docs", str(PERFORMANCE), "--readme", str(readme)]) == 1
    assert "stale" in capsys.readouterr().err


def test_readme_performance_section_is_short_and_links_the_full_page():
    text = README.read_text()
    assert performance_section_lines(text) <= MAX_SECTION_LINES
    section = text[text.index(START):text.index(END)]
    assert "docs/PERFORMANCE.md" in section
    header = section.splitlines()[1]
    assert [c.strip() for c in header.strip("|").split("|")] == [
        "op or workload", "metric", "H100", "H200", "ratio to the peer, same run"]


def test_readme_table_has_one_number_per_cell():
    rows = [line for line in readme_table(load_records()).splitlines()[2:] if line.startswith("|")]
    assert len(rows) == len(HEADLINES)
    for line in rows:
        for cell in [c.strip() for c in line.strip("|").split("|")][2:]:
            assert cell == "—" or re.fullmatch(r"\d+(\.\d+)?x?( \(H100\))?", cell), f"not one number: {cell!r} in {line}"


def test_every_suite_record_has_the_record_fields():
    records = load_records()
    assert {"h100", "h200"} <= set(records)
    for card, suites in records.items():
        for suite, record in suites.items():
            if suite in OTHER_RECORDS:
                continue
            assert RECORD_FIELDS <= set(record), f"{card}/{suite}.json lacks {RECORD_FIELDS - set(record)}"
            assert record["card"] == card and record["suite"] == suite
            assert record["rows"] and all({"case", "impl", "ms"} <= set(r) for r in record["rows"])


def test_replace_readme_table_needs_the_markers():
    assert replace_readme_table(f"a\n{START}\nold\n{END}\nb", "new") == f"a\n{START}\nnew\n{END}\nb"
    with pytest.raises(ValueError, match="markers"):
        replace_readme_table("no markers here", "new")


@pytest.mark.parametrize("name, slug", [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"),
                                        ("NVIDIA A100-SXM4-80GB", "a100"), (None, "cpu")])
def test_card_slug(name, slug):
    assert card_slug(name) == slug


def _suite_ok(ctx):
    ctx.add({"T": 4}, "tlt-triton", 1.0, bytes_moved=10**6)
    ctx.add({"T": 4}, "flashinfer", 3.0, bytes_moved=10**6)


def _suite_fails(ctx):
    raise RuntimeError("kernel exploded")


def test_record_flag_replaces_the_run_of_record(tmp_path):
    specs = {"demo": SuiteSpec("demo", "fake.demo", run=_suite_ok), "boom": SuiteSpec("boom", "fake.boom", run=_suite_fails)}
    root = tmp_path / "results"
    for _ in range(2):  # a second run replaces the file: one file per suite and card, never appended to
        assert bench_main(["demo", "--device", "cpu", "--out", str(tmp_path / "out"), "--record", str(root)], specs=specs) == 0
    assert [p.relative_to(root).as_posix() for p in root.rglob("*.json")] == ["cpu/demo.json"]
    record = json.loads((root / "cpu" / "demo.json").read_text())
    assert RECORD_FIELDS <= set(record)
    assert set(record["versions"]) >= {"torch", "triton", "cuda", "driver", "device", "python"}
    assert record["peers"]["impls"] == ["flashinfer"]
    assert record["rows"][0]["speedup_vs"] == {"flashinfer": 3.0}
    assert "ms" in record["units"] and (tmp_path / "out" / "demo.json").exists()  # bench/out/ is still written
    assert bench_main(["boom", "--device", "cpu", "--out", str(tmp_path / "out"), "--record", str(root)], specs=specs) == 1
    assert not (root / "cpu" / "boom.json").exists()  # a failed run is never the run of record


def _suite_part(T):
    def run(ctx):
        ctx.add({"T": T}, "tlt-triton", 1.0 + T, bytes_moved=10**6)
        ctx.add({"T": T}, "flashinfer", 2.0 * (1.0 + T), bytes_moved=10**6)
        ctx.note(f"part T={T}")
    return run


def test_record_merge_adds_a_part_of_the_same_commit(tmp_path):
    """--record-merge: a suite recorded in several calls. Each case's rows come from the one run that measured them
    (a re-measured case is replaced), every run is listed with its command and date, each row names its run."""
    root, out = tmp_path / "results", str(tmp_path / "out")

    def record(T, *flags, commit="abc123"):
        specs = {"demo": SuiteSpec("demo", "fake.demo", run=_suite_part(T))}
        return bench_main(["demo", "--device", "cpu", "--out", out, "--record", str(root), "--git-commit", commit,
                           *flags], specs=specs)

    assert record(1) == 0 and record(4, "--record-merge") == 0 and record(1, "--record-merge") == 0
    rec = json.loads((root / "cpu" / "demo.json").read_text())
    assert [(r["case"]["T"], r["impl"], r["run"]) for r in rec["rows"]] == [
        (4, "tlt-triton", 1), (4, "flashinfer", 1), (1, "tlt-triton", 2), (1, "flashinfer", 2)]
    assert [run["cases"] for run in rec["runs"]] == [1, 1, 1]
    assert all({"command", "date", "versions", "copy_bandwidth"} <= set(run) for run in rec["runs"])
    assert rec["peers"]["impls"] == ["flashinfer"] and rec["notes"] == ["part T=1", "part T=4"]
    assert RECORD_FIELDS <= set(rec) and rec["commit"] == "abc123"
    section = "\n".join(suite_section(rec))
    assert "recorded in 3 parts" in section and "  - run 2: " in section
    assert record(8, "--record-merge", commit="def456") == 1  # another commit: not a part of this recording
    assert json.loads((root / "cpu" / "demo.json").read_text()) == rec
    assert record(8) == 0 and "runs" not in json.loads((root / "cpu" / "demo.json").read_text())  # anew
    specs = {"demo": SuiteSpec("demo", "fake.demo", run=_suite_part(1))}
    assert bench_main(["demo", "--device", "cpu", "--out", out, "--record-merge"], specs=specs) == 2


def test_without_record_flag_nothing_is_recorded(tmp_path):
    specs = {"demo": SuiteSpec("demo", "fake.demo", run=_suite_ok)}
    before = sorted(RESULTS_DIR.rglob("*.json"))
    assert bench_main(["demo", "--device", "cpu", "--out", str(tmp_path)], specs=specs) == 0
    assert sorted(RESULTS_DIR.rglob("*.json")) == before


def test_help_names_record_and_report(capsys):
    with pytest.raises(SystemExit):
        bench_main(["--help"])
    out = capsys.readouterr().out
    assert "--record" in out and "python -m bench report" in out


def test_rollout_headlines_read_the_greedy_rows_only():
    """The README's rollout headlines pick the greedy uniform rows: a sampled row of the same batch size (its case
    carries the temperature) is not theirs."""
    rollout = [h for h in HEADLINES if h.suite == "rollout"]
    assert rollout
    greedy = {"workload": "uniform", "B": 1, "tokens": 128}
    for headline in rollout:
        batch = 1 if headline.where({**greedy, "B": 1}) else 64
        assert headline.where({**greedy, "B": batch})
        assert not headline.where({**greedy, "B": batch, "temperature": 1.0})
