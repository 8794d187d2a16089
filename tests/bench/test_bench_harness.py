"""The benchmark harness: row validation, derived columns, reports, suite discovery and the CLI."""
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # `bench` is a top-level folder, not part of the installed package
    sys.path.insert(0, str(ROOT))

from bench.__main__ import SuiteSpec, discover, main
from bench.harness import BenchContext, geomean, render_markdown, run_suite, speedup_text, time_cpu_ms


def _ctx(**kw):
    return BenchContext("unit", device="cpu", **kw)


def test_cpu_context_is_small_and_has_no_floor():
    ctx = _ctx(small=False)
    assert ctx.small is True
    assert ctx.copy_bandwidth is None
    assert ctx.dtype == torch.bfloat16


def test_time_ms_is_positive_median():
    calls = []
    ms = time_cpu_ms(lambda: calls.append(1), reps=5)
    assert ms > 0 and math.isfinite(ms)
    assert len(calls) == 6  # one warm-up + five timed
    assert _ctx().time_ms(lambda: sum(range(1000))) > 0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0, 0.0])
def test_add_rejects_bad_times(bad):
    with pytest.raises(ValueError, match="ms must be a positive finite time"):
        _ctx().add({"B": 1}, "tlt-triton", bad)


def test_add_rejects_bad_arguments():
    ctx = _ctx()
    with pytest.raises(TypeError, match="case must be a dict"):
        ctx.add([("B", 1)], "x", 1.0)
    with pytest.raises(ValueError, match="impl must be a non-empty string"):
        ctx.add({"B": 1}, "", 1.0)
    with pytest.raises(TypeError, match="ms must be a number"):
        ctx.add({"B": 1}, "x", "fast")
    with pytest.raises(ValueError, match="bytes_moved must be a non-negative integer"):
        ctx.add({"B": 1}, "x", 1.0, bytes_moved=-5)
    with pytest.raises(ValueError, match="bytes_moved must be a non-negative integer"):
        ctx.add({"B": 1}, "x", 1.0, bytes_moved=1.5)
    ctx.add({"B": 1}, "x", 1.0)
    with pytest.raises(ValueError, match="duplicate row"):
        ctx.add({"B": 1}, "x", 2.0)


def test_derived_columns_floor_and_ratios():
    ctx = _ctx(copy_bandwidth=2e12)  # 2 TB/s
    case = {"B": 64, "L": 4096, "T": 16}
    ctx.add(case, "tlt-triton", 0.5, bytes_moved=500_000_000, accept=0.75)
    ctx.add(dict(reversed(list(case.items()))), "torch-sdpa", 2.0, bytes_moved=500_000_000)  # key order must not matter
    ctx.add({"B": 1, "L": 4096, "T": 16}, "tlt-triton", 0.1)
    rows = ctx.derived_rows()
    tlt, sdpa, lone = rows
    # floor = 5e8 B / 2e12 B/s = 0.25 ms; 0.25 / 0.5 = 50%
    assert tlt["pct_hbm_floor"] == pytest.approx(50.0)
    assert sdpa["pct_hbm_floor"] == pytest.approx(12.5)
    assert tlt["gbps"] == pytest.approx(1000.0)
    assert tlt["speedup_vs"] == {"torch-sdpa": pytest.approx(4.0)}
    assert sdpa["speedup_vs"] == {"tlt-triton": pytest.approx(0.25)}
    assert lone["speedup_vs"] == {} and lone["pct_hbm_floor"] is None and lone["gbps"] is None
    assert tlt["accept"] == 0.75


def test_speedup_text_and_geomean():
    assert speedup_text(2.0, "peer") == "2.00x faster than peer"
    assert speedup_text(0.8, "peer") == "1.25x slower than peer"
    assert speedup_text(1.0, "peer") == "1.00x faster than peer"
    assert geomean([2.0, 8.0]) == pytest.approx(4.0)


def _suite_ok(ctx):
    for T in (4, 16):
        ctx.add({"T": T}, "tlt-triton", 1.0, bytes_moved=10**6)
        ctx.add({"T": T}, "flashinfer", 3.0 if T == 4 else 0.5, bytes_moved=10**6, accept_rate=torch.tensor(0.5))
    ctx.note("hello note")


def _suite_fails(ctx):
    ctx.add({"T": 1}, "tlt-triton", 1.0)
    raise RuntimeError("kernel exploded")


def test_run_suite_writes_json_and_markdown(tmp_path):
    res = run_suite("demo", _suite_ok, torch.device("cpu"), torch.bfloat16, small=True, out_dir=tmp_path, copy_bandwidth=1e12)
    assert res.status == "ok"
    data = json.loads((tmp_path / "demo.json").read_text())
    assert data["suite"] == "demo" and data["status"] == "ok" and data["error"] is None
    assert len(data["rows"]) == 4 and data["rows"][1]["accept_rate"] == 0.5
    for key in ("date", "command", "torch", "triton", "tlt_kernels", "git_commit", "device_type"):
        assert key in data["env"]
    md = (tmp_path / "demo.md").read_text()
    assert md == res.markdown
    assert "| T | impl | ms | GB/s | % HBM floor | accept_rate | vs others (same case) |" in md
    assert "3.00x faster than flashinfer" in md and "2.00x slower than flashinfer" in md
    # geomean of 3.0 and 0.5 = 1.2247
    assert "tlt-triton: 1.22x faster than flashinfer" in md
    assert "hello note" in md
    assert "FAILED" not in md


def test_markdown_comparisons_put_ours_against_peers():
    def suite(ctx):
        ctx.add({"T": 1}, "tlt-triton", 1.0)
        ctx.add({"T": 1}, "tlt-cuda", 0.5)
        ctx.add({"T": 1}, "torch-sdpa", 2.0)
        for i in range(8):
            ctx.add({"T": 2}, f"peer{i}", 1.0 + i)

    md = run_suite("cmp", suite, torch.device("cpu"), torch.bfloat16, small=True).markdown
    assert "| T | impl | ms | vs others (same case) |" in md  # no bytes: no GB/s or floor columns
    lines = {line.split(" | ")[1]: line for line in md.splitlines() if line.startswith("| 1 |") or line.startswith("| 2 |")}
    assert lines["tlt-triton"].endswith("| 2.00x faster than torch-sdpa |")  # not compared with tlt-cuda
    assert lines["torch-sdpa"].endswith("| 2.00x slower than tlt-triton; 4.00x slower than tlt-cuda |")
    assert lines["peer0"].endswith("7.00x faster than peer6; ... 1 more in the JSON |")  # no tlt impl in the case: all others, capped


def test_run_suite_records_failure_with_traceback(tmp_path):
    res = run_suite("boom", _suite_fails, torch.device("cpu"), torch.float16, small=True, out_dir=tmp_path)
    assert res.status == "failed"
    data = json.loads((tmp_path / "boom.json").read_text())
    assert "RuntimeError: kernel exploded" in data["error"]
    assert len(data["rows"]) == 1  # partial results survive
    assert "Suite FAILED" in res.markdown and "kernel exploded" in res.markdown


def test_try_import_records_reason():
    ctx = _ctx()
    assert ctx.try_import("definitely_not_a_module_xyz") is None
    assert any("definitely_not_a_module_xyz unavailable" in n and "ModuleNotFoundError" in n for n in ctx.notes)
    assert ctx.try_import("json") is json
    assert ctx.try_import("definitely_not_a_module_xyz") is None  # cached: one note only
    assert sum("definitely_not_a_module_xyz" in n for n in ctx.notes) == 1


def test_markdown_without_rows():
    res = run_suite("empty", lambda ctx: None, torch.device("cpu"), torch.bfloat16, small=True)
    assert "(no rows recorded)" in render_markdown(res.data)


def test_discovered_suites_follow_the_api():
    specs = discover()
    assert "copy" in specs
    for name, spec in specs.items():
        assert spec.error is None, f"suite module {spec.module} is broken:\n{spec.error}"
        assert name == name.lower() and "_" not in name, f"SUITE names use dashes: {name!r}"
        assert callable(spec.run)


def test_cli_continues_after_a_failed_suite(tmp_path, capsys):
    specs = {
        "boom": SuiteSpec("boom", "fake.boom", run=_suite_fails),
        "broken": SuiteSpec("broken", "fake.broken", error="importing fake.broken failed: SyntaxError"),
        "demo": SuiteSpec("demo", "fake.demo", run=_suite_ok),
    }
    rc = main(["all", "--device", "cpu", "--out", str(tmp_path)], specs=specs)
    assert rc == 1
    out = capsys.readouterr()
    assert "FAILED suites: boom, broken" in out.err
    assert (tmp_path / "demo.json").exists() and (tmp_path / "boom.json").exists()
    summary = (tmp_path / "summary.md").read_text()
    assert "| demo | ok | 4 |" in summary and "| boom | failed | 1 |" in summary and "| broken | failed | 0 |" in summary
    assert json.loads((tmp_path / "broken.json").read_text())["error"].count("SyntaxError") >= 1


def _suite_stopped_midway(ctx):
    ctx.add({"T": 1}, "tlt-triton", 1.0)
    for T in (2, 3):
        try:  # a suite's own `except Exception` (a failing peer) must not swallow the stop
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        except Exception:
            pass
        ctx.add({"T": T}, "tlt-triton", 1.0)


@pytest.mark.skipif(not hasattr(signal, "SIGTERM") or os.name != "posix", reason="POSIX signals")
def test_cli_sigterm_writes_the_stopped_suite_report_and_starts_no_other(tmp_path, capsys):
    specs = {
        "demo": SuiteSpec("demo", "fake.demo", run=_suite_ok),
        "stopped": SuiteSpec("stopped", "fake.stopped", run=_suite_stopped_midway),
        "after": SuiteSpec("after", "fake.after", run=_suite_ok),
    }
    before = signal.getsignal(signal.SIGTERM)
    t0 = time.perf_counter()
    rc = main(["all", "--device", "cpu", "--out", str(tmp_path)], specs=specs)
    assert rc == 124
    assert time.perf_counter() - t0 < 4, "the signal must interrupt the suite's sleep"
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is removed again
    data = json.loads((tmp_path / "stopped.json").read_text())
    assert data["status"] == "stopped" and [r["case"] for r in data["rows"]] == [{"T": 1}]
    assert "signal" in data["error"]
    assert "**Suite STOPPED**" in (tmp_path / "stopped.md").read_text()
    assert not (tmp_path / "after.json").exists()
    summary = (tmp_path / "summary.md").read_text()
    assert "| demo | ok | 4 |" in summary and "| stopped | stopped | 1 |" in summary
    assert "Not started (stopped by SIGTERM): after" in summary
    assert "FAILED suites: stopped" in capsys.readouterr().err


def test_cli_usage_errors(tmp_path, capsys):
    specs = {"demo": SuiteSpec("demo", "fake.demo", run=_suite_ok)}
    assert main(["nope", "--out", str(tmp_path)], specs=specs) == 2
    assert "unknown suite 'nope'; available: demo" in capsys.readouterr().err
    assert main(["--out", str(tmp_path)], specs=specs) == 2
    assert main(["--list"], specs=specs) == 0
    assert main(["demo", "demo", "--device", "cpu", "--out", str(tmp_path)], specs=specs) == 0  # deduplicated


def test_cli_e2e_help_lists_its_flags_and_an_unknown_flag_is_a_usage_error():
    run = lambda *argv: subprocess.run([sys.executable, "-m", "bench", *argv], cwd=ROOT, capture_output=True,  # noqa: E731
                                       text=True, timeout=120)
    proc = run("e2e", "--help")
    assert proc.returncode == 0, proc.stderr
    for flag in ("--batch", "--drift", "--arms", "--deterministic", "--no-fuse", "--write-steps", "--small", "--out",
                 "--progress"):
        assert flag in proc.stdout, flag
    assert "--impls" not in proc.stdout  # another suite's flag
    proc = run("e2e", "--batch", "8", "--no-such-flag")
    assert proc.returncode == 2 and "unrecognized arguments: --no-such-flag" in proc.stderr, proc.stderr
    proc = run("copy", "--drift", "2")  # a flag of a suite that was not named
    assert proc.returncode == 2 and "unrecognized arguments: --drift 2" in proc.stderr, proc.stderr


def _suite_records_params(ctx):
    ctx.add({"n": ctx.params.n}, "tlt-x", 1.0)
    ctx.note(f"word={ctx.params.word}")
    ctx.progress("visible progress")


def test_cli_passes_each_suite_its_flags(tmp_path, capsys):
    from bench.flags import Flag

    n = Flag("--n", 1, "a number", int)
    specs = {"a": SuiteSpec("a", "fake.a", run=_suite_records_params, flags=(n, Flag("--word", "x", "a word"))),
             "b": SuiteSpec("b", "fake.b", run=_suite_records_params, flags=(Flag("--n", 2, "a number", int), Flag("--word", "y", "a word")))}
    argv = ["all", "--device", "cpu", "--out", str(tmp_path), "--word", "z", "--progress", "--git-commit", "abc123"]
    assert main(argv, specs=specs) == 0
    a, b = (json.loads((tmp_path / f"{k}.json").read_text()) for k in "ab")
    assert a["rows"][0]["case"] == {"n": 1} and b["rows"][0]["case"] == {"n": 2}  # each suite's own default
    assert a["notes"] == ["word=z"] and b["notes"] == ["word=z"]  # a flag both declare applies to both
    assert a["env"]["git_commit"] == "abc123"
    assert "[a] visible progress" in capsys.readouterr().out
    assert main(["a", "--device", "cpu", "--out", str(tmp_path), "--n", "5"], specs=specs) == 0
    assert json.loads((tmp_path / "a.json").read_text())["rows"][0]["case"] == {"n": 5}
    with pytest.raises(SystemExit) as exc:
        main(["a", "--device", "cpu", "--out", str(tmp_path), "--n", "five"], specs=specs)
    assert exc.value.code == 2


def test_suites_declare_flags_and_read_no_environment():
    """Every suite parameter is a flag (documented, with the variable it replaced), the flags of all suites fit one
    parser (a name two suites share has one type), and no suite reads the environment."""
    import argparse

    from bench.flags import add_suite_flags

    specs = discover()
    add_suite_flags(argparse.ArgumentParser(), [(name, spec.flags) for name, spec in specs.items()])
    for name, spec in specs.items():
        for flag in spec.flags:
            assert flag.name.startswith("--") and flag.help, (name, flag)
            # replaces: the environment variable the flag took over; a suite written with flags replaced none
            assert not flag.replaces or flag.replaces.startswith("TLT_"), (name, flag)
    assert {f.dest for f in specs["e2e"].flags} >= {"batch", "drift", "arms", "repeats", "cache_dir"}
    for path in sorted((ROOT / "bench" / "suites").glob("*.py")):
        assert "os.environ" not in path.read_text() and "getenv" not in path.read_text(), path


def test_cli_runs_copy_suite_end_to_end(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "copy", "--small", "--device", "cpu", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads((tmp_path / "copy.json").read_text())
    assert data["status"] == "ok" and data["small"] is True
    assert {r["impl"] for r in data["rows"]} >= {"torch-copy"}
    assert all(r["bytes_moved"] == 2 * int(r["case"]["MiB"] * 2**20) for r in data["rows"])
    assert "| copy | ok |" in proc.stdout


@pytest.mark.parametrize("interpret", [True, False])
def test_copy_suite_has_a_triton_row_only_where_triton_runs(interpret, monkeypatch):
    """On CPU tensors the Triton row needs the interpreter: a CPU run on a GPU machine (no TRITON_INTERPRET there) times
    torch's copy alone instead of failing on a Triton launch with CPU tensors."""
    from bench.suites import copy as copy_suite
    from tlt_kernels import _backend

    monkeypatch.setattr(_backend, "triton_interpret_enabled", lambda: interpret)
    rows = []
    ctx = SimpleNamespace(device=torch.device("cpu"), small=True, try_import=lambda name: object(),
                          time_ms=lambda fn: (fn(), 1.0)[1], add=lambda case, impl, ms, **kw: rows.append(impl))
    if interpret:
        monkeypatch.setattr(copy_suite, "triton_copy", lambda src, dst: dst.copy_(src))
    copy_suite.run(ctx)
    assert rows == (["torch-copy", "triton-copy"] * 2 if interpret else ["torch-copy"] * 2)


@pytest.mark.cuda
def test_copy_bandwidth_on_gpu():
    ctx = BenchContext("unit", device="cuda", small=True)
    bw = ctx.copy_bandwidth
    assert 1e11 < bw < 1e13, bw  # 100 GB/s .. 10 TB/s: anything else means the timing is broken
    x = torch.empty(ctx.copy_bytes, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ctx.add({"n": 1}, "torch-copy", ctx.time_ms(lambda: y.copy_(x)), bytes_moved=2 * ctx.copy_bytes)
    assert 70 < ctx.derived_rows()[0]["pct_hbm_floor"] < 130


def _e2e_params(*argv):
    from bench.flags import parse
    from bench.suites import e2e

    return parse(e2e.FLAGS, list(argv), prog="e2e")


def test_e2e_knobs_fail_with_the_flag_named(capsys):
    """A misspelled e2e knob names the flag and its choices instead of a bare KeyError."""
    from bench.suites import e2e

    with pytest.raises(SystemExit) as exc:
        _e2e_params("--attn", "tritn")
    assert exc.value.code == 2
    assert "argument --attn: invalid choice: 'tritn' (choose from 'auto', 'torch', 'triton')" in capsys.readouterr().err
    assert _e2e_params("--attn", "torch").attn == "torch" and _e2e_params().attn == "auto"
    with pytest.raises(ValueError, match="--hidden must be a positive multiple of 256"):
        e2e._sizes(small=False, params=_e2e_params("--hidden", "700"))
    assert e2e._sizes(small=False, params=_e2e_params("--hidden", "1024"))["hidden"] == 1024
    assert e2e._sizes(small=False)["hidden"] == 512 and e2e._sizes(small=False)["B"] == 128  # the defaults


def test_e2e_selector_copy_keeps_state_and_shares_the_callback():
    from bench.suites.e2e import _copy_selector
    from tlt_kernels.runtime import Strategy, StrategySelector

    class Engine:  # deep-copying this would be a bug (an engine holds graphs and caches)
        def __deepcopy__(self, memo):
            raise AssertionError("the engine was deep-copied")

        def covers(self, s, b):
            return True

    eng = Engine()
    sel = StrategySelector([Strategy(2, 1, 3)], seed=0, available=eng.covers)
    for _ in range(5):
        s = sel.select(8)
        sel.update(s, 8, 12, 0.01, [3, 1] if s.num_steps else None)
    twin = _copy_selector(sel)
    assert twin is not sel and twin.available == eng.covers and sel.available == eng.covers
    assert twin.step == sel.step and twin.select(8) == sel.select(8)


def test_e2e_static_oracle_charges_each_bin_at_the_best_arm():
    """The oracle estimate takes, per batch-size bin, the fastest static arm's tokens/s, and keeps prefill time."""
    from types import SimpleNamespace

    from bench.suites.e2e import _static_oracle_s

    def run(steps, wall):  # steps: (batch_size, emitted, seconds)
        return SimpleNamespace(wall_s=wall, steps=[SimpleNamespace(batch_size=b, emitted=e, seconds=t) for b, e, t in steps])

    # Arm "deep" is twice as fast at B=4 (tail), arm "cheap" twice as fast at B=64; each alone takes 3 s of steps.
    cheap = run([(64, 640, 1.0), (4, 40, 2.0)], wall=3.5)
    deep = run([(64, 640, 2.0), (4, 40, 1.0)], wall=3.5)
    ref = run([(64, 320, 0.7), (64, 320, 0.7), (4, 40, 1.5)], wall=3.4)  # 0.5 s of prefill
    got = _static_oracle_s({"static-cheap": cheap, "static-deep": deep}, ref)
    assert abs(got - (0.5 + 640 / 640 + 40 / 40)) < 1e-9
    # A bin no static run visited keeps the reference's own seconds.
    odd = run([(1000, 10, 0.25)], wall=0.25)
    assert abs(_static_oracle_s({"static-cheap": cheap}, odd) - 0.25) < 1e-9


def test_device_record_script_refuses_bad_arguments_before_installing(tmp_path):
    """tools/device_record.sh needs --commit (the GPU copy has no .git) and names an unknown argument or part, before it
    installs anything."""
    import os

    root = Path(__file__).resolve().parents[2]
    script = str(root / "tools" / "device_record.sh")
    env = {**os.environ, "OUT": str(tmp_path / "out")}
    missing = subprocess.run(["bash", script, "--part", "main"], capture_output=True, text=True, env=env)
    assert missing.returncode == 2 and "--commit" in missing.stderr
    unknown = subprocess.run(["bash", script, "--commit", "abc", "--parts", "main"], capture_output=True, text=True,
                             env=env)
    assert unknown.returncode == 2 and "--parts" in unknown.stderr
    bad_part = subprocess.run(["bash", script, "--commit", "abc", "--part", "main", "--part", "8192"],
                              capture_output=True, text=True, env=env)
    assert bad_part.returncode == 2 and "unknown part 8192" in bad_part.stderr
    if not Path("/tmp/device_record_keep/tree-attention.json").exists():  # a GPU machine's previous call may leave one
        cold = subprocess.run(["bash", script, "--commit", "abc", "--part", "4096", "--continue"], capture_output=True,
                              text=True, env=env)
        assert cold.returncode == 3 and "went cold" in cold.stderr
    assert not (tmp_path / "out").exists()


def test_ab_script_refuses_bad_arguments_before_installing(tmp_path):
    """tools/ab.sh checks its usage and that the patch applies before it installs anything."""
    import os
    import shutil

    if shutil.which("patch") is None:
        pytest.skip("patch(1) not installed")
    root = Path(__file__).resolve().parents[2]
    script = str(root / "tools" / "ab.sh")
    env = {**os.environ, "OUT": str(tmp_path / "out")}
    usage = subprocess.run(["bash", script, "x.patch", "python"], capture_output=True, text=True, env=env)
    assert usage.returncode == 2 and "usage" in usage.stderr
    bad = tmp_path / "bad.patch"
    bad.write_text("--- a/no/such/file.py\n+++ b/no/such/file.py\n@@ -1 +1 @@\n-x = 1\n+x = 2\n")
    proc = subprocess.run(["bash", script, str(bad), "--", "true"], capture_output=True, text=True, env=env, cwd=root)
    assert proc.returncode == 2 and "does not apply" in proc.stderr
    assert not (tmp_path / "out" / "ab_install.log").exists()


def test_profile_phases_parses_marks_into_phase_medians():
    from tools.profile_phases import _parse

    # the clock ticks twice per ns here; the global timer (ns) gives the scale
    text = "\n".join([
        "tltcase visited_req0=2 longest=4",
        "tltrep", "tltprof start 2000 1000", "tltprof row 2000 1000", "tltprof stats 8000 4000", "tltprof row 8000 4000",
        "tltprof stats 12000 6000", "tltprof end 18000 9000",
        "tltrep", "tltprof start 0 0", "tltprof row 0 0", "tltprof stats 10000 5000", "tltprof row 10000 5000",
        "tltprof stats 14000 7000", "tltprof end 24000 12000",
    ])
    out = _parse(text)
    assert out["reps"] == 2 and out["case"] == "visited_req0=2 longest=4"
    assert out["kernel_us"] == 10.0  # medians of 8 and 12 us
    # row->stats happens twice per rep: 3 + 2 and 5 + 2 us, summed per rep, median 6 us
    assert out["phases_us"]["row->stats"] == 6.0
    assert out["phases_us"]["stats->end"] == 4.0
    assert list(out["phases_us"])[0] == "row->stats"  # largest first


def test_acceptance_tree_vs_same_depth_chain_note():
    from types import SimpleNamespace

    from bench.harness import Row
    from bench.suites.acceptance import _heap_depth, _note_tree_vs_chain

    assert [_heap_depth(t) for t in (8, 16, 32, 64)] == [3, 4, 5, 6]
    case = lambda shape, logits="bf16": {"shape": shape, "B": 16, "V": 152064, "top_p": 0.9, "logits": logits}  # noqa
    notes = []
    ctx = SimpleNamespace(rows=[Row(case("tree16"), "tlt-cuda-graph", 0.30), Row(case("chain5"), "tlt-cuda-graph", 0.20),
                                Row(case("chain4"), "tlt-cuda-graph", 0.10), Row(case("tree16"), "flashinfer", 1.0),
                                Row(case("tree16", "fp32"), "tlt-cuda-graph", 0.9)],  # no fp32 chain: no note
                          note=notes.append)
    _note_tree_vs_chain(ctx, [("chain", 4), ("tree", 16), ("chain", 5)])
    assert notes == ["tree16 / chain5 (depth 4), B=16 V=152064 top_p=0.9 bf16 logits tlt-cuda-graph: 1.50x "
                     "(target <= 1.5x)"]


def test_acceptance_impls_knob(tmp_path, capsys):
    from bench.flags import parse
    from bench.suites.acceptance import FLAGS, IMPLS

    assert parse(FLAGS, []).impls == IMPLS
    assert parse(FLAGS, ["--impls", " tlt-triton , flashinfer"]).impls == ("tlt-triton", "flashinfer")
    with pytest.raises(SystemExit) as exc:
        parse(FLAGS, ["--impls", "tlt-cuda,cutlass"])
    assert exc.value.code == 2 and "argument --impls: unknown impls ['cutlass']" in capsys.readouterr().err
    # A small run keeps only the impls asked for (the reference still runs, untimed, for the rates). On a GPU machine
    # it runs on the GPU: Triton on CPU tensors needs the interpreter chosen before Triton is first imported.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert main(["acceptance", "--device", device, "--small", "--out", str(tmp_path), "--impls", "tlt-triton"]) == 0
    data = json.loads((tmp_path / "acceptance.json").read_text())
    impls = {r["impl"].removesuffix("-graph") for r in data["rows"]}  # on a GPU, with the graph rows
    assert impls == {"tlt-triton", "tlt-triton-logprobs"}  # --logprobs is on by default: the scoring's cost
    # Every row carries the acceptance rate; the reference check is made on the eager call (a -graph row replays it).
    assert all("accept_rate" in r for r in data["rows"])
    assert all("same_as_ref" in r for r in data["rows"])
    # One case per logits dtype (bf16 and fp32 by default), each checked against the reference.
    assert {r["case"]["logits"] for r in data["rows"]} == {"bf16", "fp32"}
    assert all(r["same_as_ref"] == 1.0 for r in data["rows"])


def test_acceptance_logits_dtypes_and_eager_flags(capsys):
    from bench.flags import parse
    from bench.suites.acceptance import FLAGS

    p = parse(FLAGS, ["--logits-dtypes", "fp32", "--no-eager"])
    assert p.logits_dtypes == ("fp32",) and p.eager is False
    assert parse(FLAGS, []).logits_dtypes == ("bf16", "fp32") and parse(FLAGS, []).eager is True
    with pytest.raises(SystemExit) as exc:
        parse(FLAGS, ["--logits-dtypes", "fp8"])
    assert exc.value.code == 2 and "unknown logits dtypes ['fp8']" in capsys.readouterr().err


def test_acceptance_temperature_flag(tmp_path, capsys):
    """--temperature sets every request's temperature and the drafts'; a run at other than the default marks each
    case with it (the default's cases keep their keys), and every tlt row still agrees with the reference."""
    from bench.flags import parse
    from bench.suites.acceptance import FLAGS, TEMPERATURE

    assert parse(FLAGS, []).temperature == TEMPERATURE and parse(FLAGS, ["--temperature", "1"]).temperature == 1.0
    for bad in ("0", "-0.5", "nan", "inf"):
        assert main(["acceptance", "--small", "--device", "cpu", "--out", str(tmp_path), "--temperature", bad]) == 1
        captured = capsys.readouterr()
        assert "--temperature must be a finite number > 0" in captured.out + captured.err
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert main(["acceptance", "--device", device, "--small", "--out", str(tmp_path), "--impls", "tlt-triton",
                 "--temperature", "1.0", "--logits-dtypes", "fp32"]) == 0
    rows = json.loads((tmp_path / "acceptance.json").read_text())["rows"]
    assert rows and all(r["case"]["temperature"] == 1.0 for r in rows)
    assert {r["impl"].removesuffix("-graph") for r in rows} == {"tlt-triton", "tlt-triton-logprobs"}
    assert all(r["same_as_ref"] == 1.0 for r in rows)


def test_profile_tree_attention_fit_recovers_fixed_and_per_tile_costs():
    """tools.profile_tree_attention's fit: ms / waves = fixed + tiles * per_tile, exact on exact data whatever the
    waves, and its residual reports a point off the line."""
    from tools.profile_tree_attention import fit_fixed_and_per_tile

    fixed_us, tile_us = 20.0, 3.0
    pts = [(w, t, w * (fixed_us + t * tile_us) / 1e3) for w, t in ((2, 8.125), (2, 32.125), (1, 128.125), (4, 0.125))]
    fixed, per_tile, resid = fit_fixed_and_per_tile(pts)
    assert fixed == pytest.approx(fixed_us, abs=1e-9) and per_tile == pytest.approx(tile_us, abs=1e-9) and resid < 1e-9
    off = pts + [(2, 16.0, 2 * (fixed_us + 16 * tile_us + 4.0) / 1e3)]  # one point 4 us above the line
    assert fit_fixed_and_per_tile(off)[2] > 1.0


def test_profile_tree_attention_over_e4m3_caches_counts_one_byte_and_skips_the_warp_specialized_rows():
    """tools.profile_tree_attention --caches e4m3: a value is one byte (the floor's bytes and the tile's), and the
    warp-specialized rows are left out (that build does not read fp8); bf16 keeps every row. The CUDA backend is
    made available by a stub: only the list is built."""
    from unittest import mock

    import torch

    from tools.profile_tree_attention import _cache_bytes, _impls, _parse_args

    assert _cache_bytes(_parse_args(["--caches", "e4m3"])) == 1 and _cache_bytes(_parse_args([])) == 2
    with mock.patch("tlt_kernels._backend.backend_unavailable_reason", return_value=None):
        bf16 = [row[0] for row in _impls(torch.device("cpu"))]
        fp8 = [row[0] for row in _impls(torch.device("cpu"), fp8=True)]
    assert bf16 == ["tlt-triton", "tlt-cuda sm90", "tlt-cuda sm90 ws", "tlt-cuda sm90 ws tma", "tlt-cuda mma.sync"]
    assert fp8 == ["tlt-triton", "tlt-cuda sm90", "tlt-cuda mma.sync"]


def test_fp8_config_sweep_parses_configs():
    """tools.fp8_config_sweep --configs: each ``N:W:S`` entry is one (BLOCK_N, num_warps, num_stages) override, in
    order; an entry that is not three integers is refused, named."""
    from tools.fp8_config_sweep import CONFIGS, parse_configs

    assert parse_configs("64:4:3;128:8:2") == [(64, 4, 3), (128, 8, 2)]
    assert all(len(cfg) == 3 for cfg in parse_configs(CONFIGS))
    for bad in ("64:4", "64:4:x", "64:4:3;"):
        with pytest.raises(ValueError, match="--configs"):
            parse_configs(bad)


def test_fp8_cuda_ab_cases_cover_both_sm90_fp8_kernels():
    """tools.fp8_cuda_ab: its first five cases run the warp-specialized kernel over e4m3 caches (T * G > 64 rows),
    the rest the lockstep one-warpgroup kernel (T * G <= 64: the long-tail shapes), as its docstring says."""
    from bench.suites.tree_attention import MODELS
    from tlt_kernels._cuda.tree_attention import context_tile, takes_warp_specialized
    from tools.fp8_cuda_ab import CASES

    rows = [T * (MODELS[model][0] // MODELS[model][1]) for model, _, _, T in CASES]
    assert [takes_warp_specialized(r, fp8=True) for r in rows] == [True] * 5 + [False] * (len(CASES) - 5), rows
    assert all(context_tile(r) == 64 for r in rows[5:]), rows  # the one-warpgroup lockstep kernel's tile


def test_triton_loop_sass_counts_the_longest_loop():
    """tools.triton_loop_sass: the loop counted is the backward branch with the most instructions between its label and
    itself (predicated instructions counted by opcode, forward branches and instructions outside loops left out)."""
    from tools.triton_loop_sass import longest_loop

    sass = "\n".join([
        "        /*0000*/                   MOV R1, c[0x0][0x28] ;",
        ".L_x_1:",
        "        /*0010*/                   LDS.U8 R2, [R3] ;",
        "        /*0020*/               @P0 BRA `(.L_x_1) ;",
        ".L_x_2:",
        "        /*0030*/                   LDS.U8 R2, [R3] ;",
        "        /*0040*/                   F2FP.F16.E4M3.UNPACK_B R4, R2 ;",
        "        /*0050*/              @!P1 IMAD.MOV.U32 R5, RZ, RZ, R4 ;",
        "        /*0060*/               @P2 BRA `(.L_x_3) ;",
        "        /*0070*/               @P0 BRA `(.L_x_2) ;",
        ".L_x_3:",
        "        /*0080*/                   EXIT ;",
    ])
    assert longest_loop(sass) == {"LDS": 1, "F2FP": 1, "IMAD": 1, "BRA": 2}


@pytest.mark.parametrize("cases", ["bf16,1,0;int8,1,0", "bf16,1,0;e4m3,x,4096", "bf16,1"])
def test_triton_loop_sass_checks_every_case_first(cases, monkeypatch):
    """tools.triton_loop_sass: a bad case anywhere in --cases stops the run before the first compile."""
    import tools.triton_loop_sass as tool

    compiled = []
    monkeypatch.setattr(tool, "compile_cubin", lambda *args: compiled.append(args))
    with pytest.raises(SystemExit, match="--cases"):
        tool.main(["--cases", cases])
    assert compiled == []


def test_triton_versions_ab_absolute_imports():
    """tools.triton_versions_ab makes a copy of the Triton module loadable from anywhere: each relative import, at any
    depth and indentation, names the same module absolutely; nothing else changes."""
    from tools.triton_versions_ab import absolute_imports

    source = ("from .._backend import triton_interpret_enabled\nfrom .rounding import x\nfrom . import philox\n"
              "def f():\n    from ..ops import tree_attention as op\n    return 'from .x import y'\n")
    assert absolute_imports(source) == (
        "from tlt_kernels._backend import triton_interpret_enabled\nfrom tlt_kernels._triton.rounding import x\n"
        "from tlt_kernels._triton import philox\ndef f():\n    from tlt_kernels.ops import tree_attention as op\n"
        "    return 'from .x import y'\n")


def test_triton_versions_ab_prepares_loadable_versions(tmp_path):
    """tools.triton_versions_ab prepare: the module at a git revision and as it is now, written with absolute imports,
    load as modules of their own with ``run_triton``; the run command's defaults are the suite's T = 16 cases over bf16
    caches."""
    from pathlib import Path

    from tools.triton_versions_ab import _parse_args, load_versions, prepare

    root = Path(__file__).resolve().parents[2]
    paths = prepare(["HEAD", "worktree"], tmp_path, root)
    assert [p.name for p in paths] == ["HEAD.py", "worktree.py"]
    assert all("from ." not in p.read_text() for p in paths)
    versions = load_versions(tmp_path)
    assert sorted(versions) == ["HEAD", "worktree"] and all(callable(m.run_triton) for m in versions.values())
    args = _parse_args(["run"])
    assert [(c[0], c[1], c[2], c[3]) for c in args.cases] == [("qwen2.5-7b", 64, 4096, 16), ("qwen2.5-7b", 64, 16384, 16)]
    fp8 = _parse_args(["run", "--caches", "e4m3", "--cases", "long-tail@4096"])
    assert args.caches == "bf16" and fp8.caches == "e4m3" and len(fp8.cases) == 15


def test_split_rule_ab_lists_the_cases_the_cap_changes():
    """tools.split_rule_ab compares the default split with the rule before the isqrt(L) // 4 cap on exactly the suite
    cases where they differ: 7B T = 1 and 4 (<= 32 rows) at (1, 16384), (2, 16384), (4, 4096), (8, 4096); wider rows
    keep the earlier rule, so its stand-in equals the default there."""
    from bench.suites.tree_attention import LONG_TAIL_CASES
    from tlt_kernels.ops.tree_attention import default_split_len
    from tools.split_rule_ab import changed_cases, previous_split_len

    changed = {(B, L, T): (old, new) for model, B, L, T, old, new in changed_cases()}
    assert set(changed) == {(B, L, T) for B, L in ((1, 16384), (2, 16384), (4, 4096), (8, 4096)) for T in (1, 4)}
    assert changed[(1, 16384, 1)] == (448, 512) and changed[(2, 16384, 4)] == (960, 512)
    for B, L, T in LONG_TAIL_CASES:
        if T * 7 > 32:
            assert previous_split_len(B, 4, L, T * 7) == default_split_len(B, 4, L, 132, T * 7), (B, L, T)


def test_e2e_suite_small_runs_with_drift_and_keeps_greedy_identity(tmp_path):
    """The README main job's e2e suite at CPU size: the policy drifts before the timed rollout, every static arm is
    timed with the frozen drafter and with the spot-trained one, and every row's tokens equal plain decoding's."""
    from bench.suites import e2e

    params = _e2e_params("--drift", "2", "--write-steps", str(tmp_path / "steps.json"))
    res = run_suite("e2e", e2e.run, torch.device("cpu"), torch.float32, small=True, params=params)
    assert res.status == "ok", res.data["error"]
    rows = {r["impl"]: r for r in res.data["rows"]}
    logs = json.loads((tmp_path / "steps.json").read_text())
    assert set(logs) == set(rows) and all(len(logs[k]) == rows[k]["steps"] for k in rows)
    case = rows["plain"]["case"]  # the prefill emits each request's first token; the steps emit the rest
    assert sum(st["emitted"] for st in logs["plain"]) == case["tokens"] - case["B"]
    arms = [k[len("static-"):] for k in rows if k.startswith("static-") and not k.endswith("(spot drafter)")]
    assert arms and all(f"static-{a} (spot drafter)" in rows for a in arms)
    assert {"plain", "adaptive", "adaptive (warm)", "adaptive+spot-in-tail"} <= set(rows)
    assert all(r["greedy_identical"] for r in rows.values())
    for name in ("adaptive", "adaptive (warm)"):
        assert rows[name]["best_static"] in rows and not rows[name]["best_static"].endswith("(spot drafter)")
        assert rows[name]["speedup_vs_best_static_spot_drafter"] > 0
    notes = "\n".join(res.data["notes"])
    assert "RL update 1" in notes and "RL update 2" in notes and "spot-trained the drafter" in notes


def test_e2e_suite_small_without_drift_has_one_drafter():
    """--drift 0: no RL update, one drafter for every row, so both comparisons name the same best arm."""
    from bench.suites import e2e

    params = _e2e_params("--drift", "0", "--deterministic")  # also: the deterministic-training knob runs and is reported
    res = run_suite("e2e", e2e.run, torch.device("cpu"), torch.float32, small=True, params=params)
    assert res.status == "ok", res.data["error"]
    rows = {r["impl"]: r for r in res.data["rows"]}
    assert not any(k.endswith("(spot drafter)") for k in rows) and all(r["greedy_identical"] for r in rows.values())
    for name in ("adaptive", "adaptive (warm)"):
        assert rows[name]["speedup_vs_best_static"] == rows[name]["speedup_vs_best_static_spot_drafter"]
    notes = "\n".join(res.data["notes"])
    assert "RL update" not in notes and "deterministic training (--deterministic)" in notes
    assert not torch.are_deterministic_algorithms_enabled(), "the suite must restore the global setting"


def test_e2e_target_cache_reuses_the_trained_target(tmp_path):
    """--cache-dir: the second run loads the target the first trained, and every row comes out the same."""
    from bench.suites import e2e

    params = _e2e_params("--drift", "0", "--cache-dir", str(tmp_path / "cache"))
    runs = [run_suite("e2e", e2e.run, torch.device("cpu"), torch.float32, small=True, params=params) for _ in range(2)]
    assert all(r.status == "ok" for r in runs), [r.data["error"] for r in runs]
    notes = ["\n".join(r.data["notes"]) for r in runs]
    assert "loaded from" not in notes[0] and "loaded from" in notes[1]
    assert len(list((tmp_path / "cache").glob("e2e-target-*.pt"))) == 1
    # The output tokens depend only on the target (greedy, lossless): every row of both runs must carry the same
    # fingerprint. Steps and accepted lengths are not compared: they also depend on the drafter, whose warm-up is
    # capped in seconds, and on measured step times (the adaptive rows) and a training thread (spot-in-tail).
    digests = [{r["impl"]: r["output_sha"] for r in res.data["rows"]} for res in runs]
    assert len(digests[0]) >= 3 and digests[0] == digests[1], "the cached target must give the same rollout as the trained one"
    assert len(set(digests[0].values())) == 1, "every row must emit the plain rollout's tokens"
    assert all(r["greedy_identical"] for res in runs for r in res.data["rows"])


def test_e2e_drift_knob_is_validated(capsys):
    from bench.suites import e2e

    res = run_suite("e2e", e2e.run, torch.device("cpu"), torch.float32, small=True, params=_e2e_params("--drift", "-1"))
    assert res.status == "failed" and "--drift must be >= 0" in res.data["error"]
    with pytest.raises(SystemExit) as exc:  # --deterministic is an on/off flag: a value is a usage error
        _e2e_params("--drift", "0", "--deterministic", "yes")
    assert exc.value.code == 2 and "unrecognized arguments: yes" in capsys.readouterr().err


def test_finetune_target_updates_parameters_in_place():
    """The RL stand-in keeps every parameter's storage (captured CUDA graphs replay the new weights) and changes it."""
    from tlt_kernels.models import ModelConfig, finetune_target, load_corpus
    from tlt_kernels.models.llama import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(ModelConfig.tiny())
    before = {n: (p.data_ptr(), p.detach().clone()) for n, p in model.named_parameters()}
    loss = finetune_target(model, load_corpus("base", 200_000), 3, torch.Generator().manual_seed(0), batch_size=2, seq_len=16)
    assert math.isfinite(loss) and not model.training
    after = dict(model.named_parameters())
    assert all(after[n].data_ptr() == ptr for n, (ptr, _) in before.items())
    assert any(not torch.equal(after[n].detach(), old) for n, (_, old) in before.items())
    with pytest.raises(ValueError, match="steps must be >= 0"):
        finetune_target(model, load_corpus("base", 200_000), -1, torch.Generator())


def test_selector_vs_oracle_charges_each_bin_and_names_the_best_arm(tmp_path, capsys):
    """tools.selector_vs_oracle on e2e step logs: per bin the row's seconds, the best static row's time for the same
    tokens, the difference and what the row played."""
    from tools.selector_vs_oracle import compare, main

    def steps(*rows):  # (batch_size, strategy, emitted, seconds)
        return [dict(step=i, batch_size=b, strategy=st, tree_width=1, emitted=e, accepted_length=e / b, seconds=t,
                     elapsed_s=0.0, graph=True) for i, (b, st, e, t) in enumerate(rows)]

    logs = {
        "static-a (spot drafter)": steps((64, "a", 640, 1.0), (4, "a", 40, 2.0)),
        "static-b (spot drafter)": steps((64, "b", 640, 2.0), (4, "b", 40, 1.0)),
        "static-b": steps((64, "b", 640, 4.0)),  # not matched by the default filter
        "adaptive (warm)": steps((64, "b", 640, 2.0), (4, "b", 20, 0.5), (4, "b", 20, 0.5)),
    }
    rows = compare(logs, "adaptive (warm)", "(spot drafter)")
    assert [r["batches"] for r in rows] == [(64, 64), (4, 4)]
    assert rows[0]["best"] == "static-a (spot drafter)" and abs(rows[0]["lost_s"] - 1.0) < 1e-12
    assert rows[1]["best"] == "static-b (spot drafter)" and abs(rows[1]["lost_s"]) < 1e-12
    assert rows[1]["played"] == {"b": 2} and rows[1]["steps"] == 2
    with pytest.raises(KeyError, match="no row"):
        compare(logs, "adaptive", "(spot drafter)")
    path = tmp_path / "steps.json"
    path.write_text(json.dumps(logs))
    assert main([str(path)]) == 0
    assert "+1.000 s against the oracle" in capsys.readouterr().out


def test_plot_steps_reads_the_e2e_step_logs(tmp_path, monkeypatch):
    """bench.plot_steps: the step logs' rows become the runs e2e's _plot draws (tokens/s per step over the rollout)."""
    import json

    from bench import plot_steps

    logs = {"plain": [dict(step=0, batch_size=2, emitted=2, seconds=0.5, elapsed_s=0.5),
                      dict(step=1, batch_size=1, emitted=1, seconds=0.25, elapsed_s=0.75)],
            "adaptive": [dict(step=0, batch_size=2, emitted=6, seconds=0.5, elapsed_s=0.5)]}
    runs = plot_steps.load_rows(logs, ["adaptive", "plain"])
    assert list(runs) == ["adaptive", "plain"]
    assert [s.tokens_per_s for s in runs["plain"].steps] == [4.0, 4.0] and runs["plain"].wall_s == 0.75
    with pytest.raises(KeyError, match=r"no rows \['tree'\]"):
        plot_steps.load_rows(logs, ["plain", "tree"])
    path = tmp_path / "steps.json"
    path.write_text(json.dumps(logs))
    drawn = {}
    monkeypatch.setattr(plot_steps, "_plot", lambda outs, out: drawn.update(outs=outs, out=out) or f"plot written to {out}")
    assert plot_steps.main([str(path), "--rows", "plain, adaptive", "--out", str(tmp_path / "p.png")]).startswith("plot written")
    assert list(drawn["outs"]) == ["plain", "adaptive"] and drawn["out"] == str(tmp_path / "p.png")


def test_flashinfer_chain_uses_its_fused_softmax_where_it_has_one():
    """The FlashInfer pipeline's probabilities come from its temperature softmax when the module has one (0.4 and
    later), else from torch; both give chain_speculative_sampling the same rows."""
    from types import SimpleNamespace

    from bench.suites.acceptance import TEMPERATURE, _flashinfer_chain

    seen = []
    chain = lambda q, tokens, probs: seen.append(probs) or probs  # noqa: E731
    fused = SimpleNamespace(softmax=lambda rows, t: torch.softmax(rows / t, -1) * 1.0, chain_speculative_sampling=chain)
    logits = torch.randn(3, 5, 11, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    tokens, q = torch.zeros(3, 5, dtype=torch.int64), torch.rand(3, 5, 11)
    _flashinfer_chain(SimpleNamespace(sampling=fused), logits, tokens, q, None)
    _flashinfer_chain(SimpleNamespace(sampling=SimpleNamespace(chain_speculative_sampling=chain)), logits, tokens, q,
                      None)
    assert seen[0].shape == logits.shape and seen[0].dtype == torch.float32
    torch.testing.assert_close(seen[0], seen[1])
    torch.testing.assert_close(seen[1], torch.softmax(logits.float() / TEMPERATURE, -1))


def test_spot_overhead_workload_and_kinds(monkeypatch, capsys):
    from types import SimpleNamespace

    from tools import spot_overhead

    args = SimpleNamespace(vocab=100, batch=16, median=40)
    prompts, lengths = spot_overhead._workload(args)
    assert (prompts, lengths) == spot_overhead._workload(args)  # seeded
    assert len(prompts) == len(lengths) == 16 and all(len(p) == 32 and max(p) < 100 for p in prompts)
    assert all(2 <= n <= 256 for n in lengths) and max(lengths) > 2 * sorted(lengths)[8]  # a long tail
    monkeypatch.setattr("sys.argv", ["spot_overhead", "--kinds", "frozen,bogus"])
    with pytest.raises(SystemExit):
        spot_overhead.main()
    assert "unknown bogus" in capsys.readouterr().err


def test_device_rollout_record_script_refuses_bad_arguments_before_anything(tmp_path):
    """tools/device_rollout_record.sh needs a part (1 to 4) and the commit, before it joins, installs or records."""
    import os

    script = str(Path(__file__).resolve().parents[2] / "tools" / "device_rollout_record.sh")
    env = {**os.environ, "OUT": str(tmp_path / "out")}
    for args in ([], ["1"], ["5", "abc"], ["0", "abc"]):
        run = subprocess.run(["bash", script, *args], capture_output=True, text=True, env=env)
        assert run.returncode == 64 and "usage" in run.stderr, (args, run.stderr)
    assert not (tmp_path / "out").exists()


def test_device_train_drafter_script_refuses_bad_arguments_before_anything(tmp_path):
    """tools/device_train_drafter.sh needs the training seconds (1 to 360: the rest of the call's 600 s is the answers'
    rollouts and the evaluation) and the commit, before it joins, installs or trains."""
    import os

    script = str(Path(__file__).resolve().parents[2] / "tools" / "device_train_drafter.sh")
    env = {**os.environ, "OUT": str(tmp_path / "out")}
    for args in ([], ["100"], ["0", "abc"], ["361", "abc"], ["ten", "abc"]):
        run = subprocess.run(["bash", script, *args], capture_output=True, text=True, env=env)
        assert run.returncode == 64 and "usage" in run.stderr, (args, run.stderr)
    assert not (tmp_path / "out").exists()


def test_device_install_source_hash_follows_the_extension_sources(tmp_path):
    """A prebuilt extension is used only when built from the same csrc/ and CMakeLists.txt: the hash is the same for
    a copy of them and changes with any byte of a source."""
    import shutil

    root = Path(__file__).resolve().parents[2]
    copy = tmp_path / "tree"
    (copy / "tools").mkdir(parents=True)
    shutil.copy(root / "tools" / "device_install.sh", copy / "tools")
    shutil.copytree(root / "csrc", copy / "csrc")
    shutil.copy(root / "CMakeLists.txt", copy)

    def source_hash(tree):
        out = subprocess.run(["bash", str(tree / "tools" / "device_install.sh"), "--source-hash"], capture_output=True,
                             text=True, check=True)
        return out.stdout.strip()

    original = source_hash(root)
    assert len(original) == 64 and source_hash(copy) == original
    with open(copy / "csrc" / "bindings.cpp", "a") as f:
        f.write("\n")
    assert source_hash(copy) != original


def test_static_batch_budget_sweep_plays_plain_decoding_at_a_zero_budget():
    """tools.static_batch_budget_sweep: a zero loss budget vetoes every draft (each has a reserve and nothing is banked
    yet), so cold and warm equal plain decoding exactly; without a budget the selector drafts and differs."""
    from tools.static_batch_budget_sweep import _row
    from tlt_kernels.runtime import Strategy
    from tlt_kernels.runtime.static_batch import static_batches

    batch, warm_up = static_batches((4,))[2], static_batches((4,), seed=1)[2]  # uniform 0.5: drafts pay
    arms = (Strategy.off(), Strategy(5, 4, 16))
    cells = _row(batch, warm_up, arms, [0], (0.0, None)).strip("| ").split(" | ")
    assert cells[0] == batch.name and cells[1].endswith("(s5k4v16)") and float(cells[1].split()[0]) > 1.2
    assert cells[2] == "1.000 / 1.000"
    assert cells[3] != "1.000 / 1.000"


def test_static_batch_budget_sweep_adds_a_forecast_column_per_budget():
    """tools.static_batch_budget_sweep --forecast: each budget's column is followed by the same budget with the
    requests' forecast; on a uniform batch whose drafts pay, the forecast takes back part of what the budget's tie
    gave away (docs/RUNTIME.md, "The forecast")."""
    from tools.static_batch_budget_sweep import _row
    from tlt_kernels.runtime import Strategy
    from tlt_kernels.runtime.static_batch import static_batches

    batch, warm_up = static_batches((32,))[2], static_batches((32,), seed=1)[2]
    arms = (Strategy.off(), Strategy(2, 1, 3), Strategy(5, 4, 16))
    cells = _row(batch, warm_up, arms, [0], (0.02,), forecast=True).strip("| ").split(" | ")
    assert len(cells) == 4, cells
    budget_only, with_forecast = (float(cell.split(" / ")[0]) for cell in cells[2:])
    assert with_forecast > 1.03 * budget_only, cells


def test_counterfactual_replay_teaches_plain_steps_the_deepest_chains_acceptance():
    """tools.counterfactual_replay: the deepest chain arm of a record (one candidate per level) gives its lagging
    rows' counts; a replay whose selector never drafts (a zero loss budget vetoes every draft) leaves that arm at its
    optimistic prior without the counterfactual and learns its low acceptance with it, playing the same plain steps."""
    from tools.counterfactual_replay import deepest_chain, replay
    from tlt_kernels.runtime import Strategy, StrategySelector

    def record(batch_size=4):
        return {"batch_size": batch_size, "arms": {
            "off": {"step_time": 1e-3, "emitted": batch_size, "accepted": []},
            "s2k1v3": {"step_time": 1.1e-3, "emitted": 3 * batch_size, "accepted": [4, 4]},
            "s4k1v5": {"step_time": 1.2e-3, "emitted": 5 * batch_size, "accepted": [4, 4, 4, 4],
                       "lagging_rows": 2, "lagging_accepted": [1, 0, 0, 0]},
            "s5k4v16": {"step_time": 1.5e-3, "emitted": 6 * batch_size, "accepted": [4, 4, 4, 4, 4]}}}

    assert deepest_chain(record()) == (Strategy(4, 1, 5), [1, 0, 0, 0], 2)
    assert deepest_chain({"batch_size": 1, "arms": {"off": record()["arms"]["off"]}}) is None
    arms = [Strategy(2, 1, 3), Strategy(4, 1, 5), Strategy(5, 4, 16)]
    runs = {}
    for counterfactual in (False, True):
        selector = StrategySelector(arms, seed=0, loss_budget=0.0)
        result = replay([record() for _ in range(12)], selector, counterfactual)
        runs[counterfactual] = result.choices, selector.policy
    assert runs[False][0] == runs[True][0] == {"off": 12}
    deep = runs[True][1].arms.index(Strategy(4, 1, 5))
    assert not runs[False][1].played[deep] and runs[True][1].played[deep]
    assert runs[True][1].tokens[deep] < 2.0 < 3.0 < runs[False][1].tokens[deep]  # the counts, not the prior


def test_wave_cost_fit_recovers_a_lines_slope_and_intercept_per_batch_and_backend():
    """tools.wave_cost_fit: per (B, backend) the least-squares line through the times at L >= 2048 (shorter contexts
    are left out); a batch with one such length has no fit."""
    from tools.wave_cost_fit import fit_fixed_cost

    rows = [dict(B=64, L=L, cuda=48.0 + 0.042 * L, triton=35.0 + 0.0417 * L) for L in (1024, 2048, 4096, 8192)]
    rows[0]["cuda"] = 500.0  # below the fit's lengths: ignored
    rows.append(dict(B=33, L=4096, cuda=1.0, triton=1.0))
    fits = {(f["B"], f["backend"]): f for f in fit_fixed_cost(rows)}
    assert set(fits) == {(64, "cuda"), (64, "triton")}
    assert fits[64, "cuda"]["slope_us_per_token"] == pytest.approx(0.042) and fits[64, "cuda"]["intercept_us"] == 48.0
    assert fits[64, "triton"]["intercept_us"] == 35.0
