"""The selector suite's replay of the recorded real-model traces (bench/traces/h200_smollm2)."""
import os

import pytest

from bench.suites import selector


class _Rows:
    def __init__(self):
        self.rows, self.notes = [], []

    def add(self, case, impl, ms, **extra):
        self.rows.append((case["workload"], impl, ms, extra))

    def note(self, text):
        self.notes.append(text)


@pytest.fixture(scope="module")
def real_rows():
    ctx = _Rows()
    selector._real_model_traces(ctx)
    return ctx


def test_every_recorded_real_trace_gives_static_and_selector_rows(real_rows):
    directory = os.path.join(selector.TRACES_DIR, selector.REAL_TRACES)
    traces = sorted(n[:-5] for n in os.listdir(directory) if "-B" in n)
    assert len(traces) == 10
    cases = sorted({w for w, *_ in real_rows.rows})
    assert [c.split(" ")[2] for c in cases] == traces
    for case in cases:
        rows = {impl: (ms, extra) for w, impl, ms, extra in real_rows.rows if w == case}
        assert set(rows) == {"static off", "static s2k1v3", "static s4k1v5", "static s5k4v16", "cost, cold",
                             "cost, warm"}
        assert rows["static off"][1]["vs_off"] == 1.0
        assert max(extra["vs_best_static"] for impl, (ms, extra) in rows.items() if impl.startswith("static")) == 1.0
        for ms, extra in rows.values():  # ms is the same work at each row's rate: inverse to vs_off
            assert ms * extra["vs_off"] == pytest.approx(rows["static off"][0], rel=1e-3)
    assert "h200_smollm2" in real_rows.notes[0]


def test_the_default_selector_on_the_real_traces(real_rows):
    """Cold and warm, never below plain decoding by more than 2%, and never below 0.85 of the best static arm: a
    warm selector that settled on plain decoding in the warm-up rollout and never probed sat there through the
    whole timed rollout of eagle-uniform-B1 (0.74 of the best static arm)."""
    for workload, impl, _, extra in real_rows.rows:
        if impl.startswith("cost"):
            assert extra["vs_off"] >= 0.98, (workload, impl, extra)
            assert extra["vs_best_static"] >= 0.85, (workload, impl, extra)


def test_trace_rate_is_tokens_over_seconds_of_the_picks():
    records = [{"arms": {"off": {"emitted": 2, "step_time": 0.5}, "s2k1v3": {"emitted": 4, "step_time": 1.0}}}] * 2
    assert selector._trace_rate(records, ["off", "s2k1v3"]) == pytest.approx(6 / 1.5)
