"""tools.real_trace_replay: the req-5 scores of selector configurations on the real traces."""
import os

import pytest

from bench.suites import selector
from tools import real_trace_replay as replay


def test_configs_parse_on_top_of_the_defaults_and_bad_ones_are_named():
    configs = replay._parse_configs(["w128=dict(window=128)"])
    assert configs == {"default": {}, "w128": {"window": 128}}
    with pytest.raises(SystemExit, match="NAME=EXPR"):
        replay._parse_configs(["w128"])
    with pytest.raises(SystemExit, match="dict of keyword arguments"):
        replay._parse_configs(["w=128"])


def test_every_real_trace_is_replayed_and_the_lagging_score_only_where_counted():
    traces = replay._traces()
    assert len(traces) == 25
    directory, path = next(t for t in traces if t[1].endswith("h200_smollm2_weak_eagle/eagle-uniform-B4.json"))
    rows = replay._trace_rows((directory, path, {}, 1, False))
    assert [start for _, start, _ in rows] == ["cold", "warm"]
    for _, _, means in rows:
        for best, plain in means.values():  # plain decoding is one of the static arms, so the best is at least it
            assert 0 < best <= plain + 1e-9
    first = next(t for t in traces if os.path.basename(t[0]) == "h200_smollm2")
    assert all(means["lagging"] is None for _, _, means in replay._trace_rows((*first, {}, 1, False)))


def test_the_default_matches_the_selector_suite_on_one_trace():
    """The tool's default config is the suite's default selector: the same per-step and lagging ratios to plain."""
    from tlt_kernels.runtime.simulate import load_trace

    directory = os.path.join(selector.TRACES_DIR, "h200_smollm2_drafted")
    records = load_trace(os.path.join(directory, "ngram-uniform-B4.json"))
    table = selector.trace_cost_table(directory, "ngram")
    suite = selector.real_trace_scores(records, table)
    tool = replay.replay_scores(records, table, {})
    for start in ("cold", "warm"):
        row = suite[f"cost, {start}"]
        assert tool[start]["per_step"][1] == pytest.approx(row["vs_off_per_step"], abs=1e-4)
        assert tool[start]["per_step"][0] == pytest.approx(row["vs_best_static_per_step"], abs=1e-4)
        assert tool[start]["lagging"][1] == pytest.approx(row["vs_off_lagging"], abs=1e-4)
        assert tool[start]["lagging"][0] == pytest.approx(row["vs_best_static_lagging"], abs=1e-4)


def test_counterfactual_replays_match_the_suite_on_the_n_gram_traces():
    """``--counterfactual``: the n-gram traces only, and a ``policy="counterfactual"`` config scores as the suite's
    counterfactual rows."""
    from tlt_kernels.runtime.simulate import load_trace

    traces = replay._traces(ngram_only=True)
    assert len(traces) == 17 and all(os.path.basename(p).startswith("ngram-") for _, p in traces)
    directory = os.path.join(selector.TRACES_DIR, "h200_smollm2_lagging")
    records = load_trace(os.path.join(directory, "ngram-uniform-B4.json"))
    table = selector.trace_cost_table(directory, "ngram")
    suite = selector.counterfactual_rows(records, table)
    tool = replay.replay_scores(records, table, {"policy": "counterfactual"}, counterfactual=True)
    for start in ("cold", "warm"):
        row = suite[f"counterfactual, {start}"]
        assert tool[start]["lagging"] == pytest.approx((row["vs_best_static_lagging"], row["vs_off_lagging"]),
                                                       abs=1e-4)


def test_summary_counts_rows_against_both_bounds():
    rows = [("a", "cold", {"per_step": (0.96, 0.975), "lagging": None}),
            ("a", "warm", {"per_step": (1.0, 1.2), "lagging": (0.99, 0.99)})]
    s = replay.summarize(rows)
    assert s["per_step"] == dict(rows=2, mean=pytest.approx(0.98), lowest=0.96, below_3pct=1, below_plain=1,
                                 lowest_vs_plain=0.975)
    assert s["lagging"]["rows"] == 1 and s["lagging"]["below_3pct"] == 0 and s["lagging"]["below_plain"] == 0
