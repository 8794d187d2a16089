"""The rollout suite on the CPU (small): the tiny random model, then a transformers directory with a chat template.

Each run goes through the harness (``run_suite``) as ``python -m bench rollout --small --device cpu`` does, without
transformers' compiled generate (``--no-hf-compile``: compiling takes tens of seconds on a small CPU; the CLI run
covers it).
"""
import pytest
import torch

from bench.flags import parse
from bench.harness import run_suite

pytest.importorskip("transformers")

from bench.suites import rollout  # noqa: E402  (after the skip: the suite's models need transformers)
from conftest import tiny_transformers_directory  # noqa: E402

SMALL_ARMS = ("s2k1v3", "s4k1v5", "s3k2v6")
ENGINE_IMPLS = ({"plain"} | {f"{drafter} {arm}" for drafter in ("ngram", "eagle")
                             for arm in ("off",) + SMALL_ARMS + ("adaptive", "adaptive (warm)")}
                | {"ngram adaptive [counterfactual]", "ngram adaptive [counterfactual] (warm)"})


def _run(argv, out_dir=None):
    params = parse(rollout.FLAGS, ["--no-hf-compile", *argv], prog="rollout")
    return run_suite("rollout", rollout.run, torch.device("cpu"), torch.bfloat16, small=True, params=params,
                     out_dir=out_dir)


@pytest.fixture(scope="module")
def eagle_checkpoint(tmp_path_factory):
    """An untrained EAGLE drafter for the tiny model, saved as a state dict (the suite's --eagle-checkpoint)."""
    from tlt_kernels.drafter import EagleDrafter
    from tlt_kernels.models import LlamaForCausalLM

    hf = rollout.tiny_hf_model()
    target = LlamaForCausalLM.from_hf(hf.config, hf.state_dict())
    path = tmp_path_factory.mktemp("eagle") / "drafter.pt"
    torch.save(EagleDrafter.for_target(target, seed=0).state_dict(), path)
    return path


@pytest.fixture(scope="module")
def small_run(eagle_checkpoint, tmp_path_factory):
    res = _run(["--eagle-checkpoint", str(eagle_checkpoint)], tmp_path_factory.mktemp("out"))
    assert res.status == "ok", res.data["error"]
    return res.data


def test_every_row_of_every_workload(small_run):
    rollouts = [r for r in small_run["rows"] if r["case"]["workload"] != "step-cost"]
    cases = {(r["case"]["workload"], r["case"]["B"]) for r in rollouts}
    assert cases == {("uniform", 1), ("uniform", 4), ("tail", 4)}
    for case in cases:
        impls = {r["impl"] for r in rollouts if (r["case"]["workload"], r["case"]["B"]) == case}
        assert impls == ENGINE_IMPLS | {"hf-eager"}, case
    for r in rollouts:
        assert r["ms"] > 0 and r["tokens_per_s"] > 0 and r["steps"] >= 1 and r["accepted_length"] >= 1.0, r


def test_engine_rows_are_greedy_identical_to_plain_and_emit_every_token(small_run):
    rollouts = [r for r in small_run["rows"] if r["case"]["workload"] != "step-cost"]
    for r in rollouts:
        if not r["impl"].startswith("hf-"):
            assert r["greedy_identical"] is True, r
        assert r["full_length"] is True and r["tokens"] == r["case"]["tokens"], r  # EOS off: every token asked for
    for r in rollouts:
        if r["case"]["workload"] == "uniform":
            assert r["tokens"] == r["case"]["B"] * 8, r  # --max-new-tokens is 8 when small
    # The n-gram drafts of the tiny model's repetitive output are accepted: the identity covers accepted drafts.
    assert max(r["accepted_length"] for r in rollouts if r["impl"].startswith("ngram")) > 1.2
    # Every engine row says how many Triton compiles its timed rollouts paid (none run on the CPU's interpreter).
    assert all(r["jit_compiles"] == 0 for r in rollouts if not r["impl"].startswith("hf-")), rollouts
    # The prefill (a fixed cost per rollout) is part of the row's wall time.
    assert all(0 < r["prefill_ms"] < r["ms"] for r in rollouts if not r["impl"].startswith("hf-")), rollouts
    # So are the steps' summed times (the host's clock on the CPU); the rest is the rollout's fixed cost.
    assert all(0 < r["steps_ms"] < r["ms"] for r in rollouts if not r["impl"].startswith("hf-")), rollouts


def test_adaptive_rows_say_what_the_selector_ran(small_run):
    adaptive = [r for r in small_run["rows"] if "adaptive" in r["impl"]]
    for r in adaptive:
        head = f"{r['impl']}, {r['case']['workload']} B={r['case']['B']}: steps per strategy"
        notes = [n for n in small_run["notes"] if n.startswith(head)]
        assert len(notes) == 1, (head, small_run["notes"])
        # Every step is counted under one strategy: the counts add up to the row's steps.
        counts = [int(part.strip().split(" ")[1].rstrip(",")) for part in notes[0].split(": ", 2)[2].split(";")]
        assert sum(counts) == r["steps"], (notes[0], r["steps"])


def test_arm_summary():
    from tlt_kernels.engine.records import StepLog

    steps = [StepLog(0, 2, "off", 1, 2, 1.0, 0.001, 0.001, True), StepLog(1, 2, "s2k1v3", 3, 5, 2.5, 0.003, 0.004, True),
             StepLog(2, 1, "off", 1, 1, 1.0, 0.002, 0.006, True)]
    assert rollout.arm_summary(steps) == ("steps per strategy (steps, accepted length, ms per step): "
                                          "off 2, 1.00, 1.500; s2k1v3 1, 2.50, 3.000")


def test_step_cost_rows(small_run):
    steps = [r for r in small_run["rows"] if r["case"]["workload"] == "step-cost"]
    expected = {("plain step", b) for b in (1, 4)} | {(f"{d} {a} step", b) for d in ("ngram", "eagle")
                                                      for a in ("off",) + SMALL_ARMS for b in (1, 4)}
    assert {(r["impl"], r["case"]["B"]) for r in steps} == expected
    for r in steps:
        assert r["ms"] > 0 and r["bytes_moved"] > 0 and "kernel_ms_per_step" not in r, r  # no kernel time on the CPU
    assert any("GPU kernel time needs CUDA" in n for n in small_run["notes"])
    assert any("hf-static-compiled not run (--no-hf-compile)" in n for n in small_run["notes"])


def test_model_file_directory_runs_the_chat_template_path(tmp_path):
    tiny_transformers_directory(tmp_path / "model")
    res = _run(["--model-file", str(tmp_path / "model"), "--split", "heldout", "--categories", "chat",
                "--batches", "2", "--tail-batch", "0", "--arms", "s2k1v3", "--step-batches", "2"])
    assert res.status == "ok", res.data["error"]
    rows = res.data["rows"]
    assert {r["impl"] for r in rows} == {"plain", "hf-eager", "ngram off", "ngram s2k1v3", "ngram adaptive",
                                         "ngram adaptive (warm)", "ngram adaptive [counterfactual]",
                                         "ngram adaptive [counterfactual] (warm)", "plain step", "ngram off step",
                                         "ngram s2k1v3 step"}
    assert all(r["greedy_identical"] for r in rows if r["case"]["workload"] == "uniform" and r["impl"] != "hf-eager")
    assert any("chat-template prompts" in n and "4 prompts" in n for n in res.data["notes"])


def test_tail_lengths_are_stratified_clamped_and_seeded():
    lengths = rollout.tail_lengths(64, 16, 64)
    assert lengths == rollout.tail_lengths(64, 16, 64) and len(lengths) == 64
    assert min(lengths) >= 2 and max(lengths) == 64  # the top quantiles (about 11x the median) are clamped
    assert sorted(lengths)[32] in range(14, 19)


def test_helpers():
    assert rollout.first_difference([[1, 2], [3, 4]], [[1, 2], [3, 4]]) is None
    assert rollout.first_difference([[1, 2], [3, 5]], [[1, 2], [3, 4]]) == (1, 1)
    assert rollout.first_difference([[1, 2], [3]], [[1, 2], [3, 4]]) == (1, 1)
    assert rollout.own_tokens([5, 7, 2, 0, 0], 4, eos_id=2) == [5, 7, 2]
    assert rollout.own_tokens([5, 7, 2, 9], 3, eos_id=None) == [5, 7, 2]
    ids, mask = rollout.left_padded([[4, 5, 6], [7]], pad_id=0, device="cpu")
    assert ids.tolist() == [[4, 5, 6], [0, 0, 7]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert rollout.cycle([[1], [2], [3]], 4, start=2) == [[3], [1], [2], [3]]
    gpu = rollout.sizes(False, parse(rollout.FLAGS, [], prog="rollout"))
    assert (gpu.batches, gpu.tail_batch, gpu.max_new_tokens) == ((1, 4, 16, 64, 256), 64, 256)
    assert (gpu.step_batches, gpu.step_tokens, gpu.arms) == ((1, 32), 64, rollout.GPU_ARMS)
    small = rollout.sizes(True, parse(rollout.FLAGS, ["--batches", "2,3"], prog="rollout"))
    assert (small.batches, small.max_new_tokens, small.arms) == ((2, 3), 8, SMALL_ARMS)


def test_median_run_keeps_the_run_of_median_wall_time():
    from types import SimpleNamespace

    walls = iter([3.0, 1.0, 2.0])
    state = SimpleNamespace(z=SimpleNamespace(repeats=3))
    run = rollout.RolloutRun.median_run(state, lambda: SimpleNamespace(wall_s=next(walls)))
    assert run.out.wall_s == 2.0 and run.compiles.count == 0  # nothing compiled while the three ran
    params = parse(rollout.FLAGS, ["--repeats", "5"], prog="rollout")
    assert rollout.sizes(False, params).repeats == 5
    assert rollout.sizes(True, parse(rollout.FLAGS, [], prog="rollout")).repeats == 1


def test_drafters_flag_picks_the_configurations():
    from types import SimpleNamespace

    def names(argv):
        state = SimpleNamespace(p=parse(rollout.FLAGS, argv, prog="rollout"), z=rollout.sizes(True, parse(
            rollout.FLAGS, argv, prog="rollout")))
        return [c.name for c in rollout.RolloutRun.configs(state)]

    assert names([]) == ["plain", "ngram off", "ngram s2k1v3", "ngram s4k1v5", "ngram s3k2v6", "ngram adaptive"]
    assert names(["--drafters", "eagle", "--eagle-checkpoint", "x.pt"])[1:] == [
        "eagle off", "eagle s2k1v3", "eagle s4k1v5", "eagle s3k2v6", "eagle adaptive"]
    with pytest.raises(ValueError, match="--drafters"):
        names(["--drafters", "medusa"])


def test_interleaved_repeats_go_round_the_engines():
    """Each workload's repeats visit every engine's rollouts in turn (A, B, A, B), rows come out per workload in the
    configurations' order, each row the run of median wall time of its own repeats; step-cost rows follow."""
    from types import SimpleNamespace

    calls, rows, step_rows, traced = [], [], [], []
    walls = iter(range(100))
    configs = [SimpleNamespace(name="plain"), SimpleNamespace(name="ngram adaptive")]

    def rollouts(eng, config):
        def rollout(impl):
            return lambda work: calls.append((work, impl)) or SimpleNamespace(wall_s=next(walls), impl=impl)

        impls = [config.name] + ([f"{config.name} (warm)"] if "adaptive" in config.name else [])
        return [(impl, rollout(impl)) for impl in impls]

    work = lambda name: SimpleNamespace(name=name, batch=2)  # noqa: E731
    w1, w2 = work("w1"), work("w2")
    state = SimpleNamespace(z=SimpleNamespace(repeats=3), works=[w1, w2], engine=lambda config: config.name,
                            ctx=SimpleNamespace(progress=lambda message: None),
                            rollouts=rollouts, step_cost_rows=lambda eng, config: step_rows.append(eng),
                            write_traces=lambda eng, config: traced.append(eng),
                            add_engine_row=lambda work, impl, run: rows.append((work, impl, run.out.wall_s)))
    rollout.RolloutRun.run_interleaved(state, configs)
    impls = ["plain", "ngram adaptive", "ngram adaptive (warm)"]
    assert calls == [(w, impl) for w in (w1, w2) for _ in range(3) for impl in impls]
    # w1's walls: plain 0, 3, 6; cold 1, 4, 7; warm 2, 5, 8 -> medians 3, 4, 5 (then w2's: 12, 13, 14).
    assert rows == [(w1, "plain", 3), (w1, "ngram adaptive", 4), (w1, "ngram adaptive (warm)", 5),
                    (w2, "plain", 12), (w2, "ngram adaptive", 13), (w2, "ngram adaptive (warm)", 14)]
    assert step_rows == ["plain", "ngram adaptive"]  # step_cost_rows skips adaptive configurations itself
    assert traced == ["plain", "ngram adaptive"]  # after the rows (write_traces skips static configurations itself)


def test_one_engine_at_a_time_gives_the_same_rows(eagle_checkpoint, small_run):
    """--no-interleave (engines built and freed one after another): the same rows with the same outputs (the adaptive
    rows' step counts follow measured times, so only the static rows' are compared)."""
    res = _run(["--eagle-checkpoint", str(eagle_checkpoint), "--no-interleave"])
    assert res.status == "ok", res.data["error"]
    key = lambda r: (str(r["case"]), r["impl"])  # noqa: E731
    sequential = {key(r): r for r in res.data["rows"]}
    interleaved = {key(r): r for r in small_run["rows"]}
    assert sequential.keys() == interleaved.keys()
    for k, r in sequential.items():
        same = ("tokens", "greedy_identical") + (() if "adaptive" in r["impl"] else ("steps", "accepted_length"))
        assert [r.get(f) for f in same] == [interleaved[k].get(f) for f in same], k


def test_prefill_lengths_reach_every_engine(monkeypatch):
    import tlt_kernels.engine as engine_module

    seen = []
    original = engine_module.SpeculativeEngine

    class Recording(original):
        def __init__(self, *args, **kwargs):
            seen.append(kwargs.get("prefill_lengths"))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(engine_module, "SpeculativeEngine", Recording)
    res = _run(["--prefill-lengths", "16,64", "--drafters", "ngram", "--batches", "2", "--tail-batch", "0",
                "--no-hf-eager"])
    assert res.status == "ok", res.data["error"]
    # 64 is past the small run's capacity (its longest prompt + 8 tokens < 64): it becomes that capacity.
    assert seen and all(lengths[0] == 16 and 16 < lengths[1] < 64 and len(lengths) == 2 for lengths in seen), seen


def test_a_written_trace_record_keeps_its_fields_with_step_times_rounded_to_a_tenth_of_a_microsecond():
    from bench.suites.rollout import _rounded_times

    record = {"batch_size": 2, "drafted_rows": 1, "arms": {
        "off": {"step_time": 0.00161430599996, "emitted": 2, "accepted": []},
        "s2k1v3": {"step_time": 0.0020035559999, "emitted": 3, "accepted": [1, 0], "lagging_rows": 1,
                   "lagging_accepted": [1, 0]}}}
    rounded = _rounded_times(record)
    assert rounded["arms"]["off"]["step_time"] == 0.0016143
    assert rounded["arms"]["s2k1v3"]["step_time"] == 0.0020036
    for name, arm in record["arms"].items():
        assert {k: v for k, v in rounded["arms"][name].items() if k != "step_time"} == \
            {k: v for k, v in arm.items() if k != "step_time"}
    assert {k: v for k, v in rounded.items() if k != "arms"} == {"batch_size": 2, "drafted_rows": 1}
    assert record["arms"]["off"]["step_time"] == 0.00161430599996  # the probe's record is not changed


def test_write_traces_records_every_adaptive_rollout_for_the_selector_suite(tmp_path):
    from tlt_kernels.runtime import Strategy
    from tlt_kernels.runtime.simulate import load_trace

    traces = tmp_path / "traces"
    res = _run(["--drafters", "ngram", "--no-hf-eager", "--write-traces", str(traces)], tmp_path / "out")
    assert res.status == "ok", res.data["error"]
    names = sorted(p.name for p in traces.iterdir())
    assert names == ["ngram-tail-B4.json", "ngram-uniform-B1.json", "ngram-uniform-B4.json"]  # no table on the CPU
    arms = {"off", *SMALL_ARMS}
    for name in names:
        records = load_trace(str(traces / name))
        rollouts = [r["rollout"] for r in records]
        assert rollouts == sorted(rollouts) and set(rollouts) == {0, 1}, name  # warm-up rollout first, then the timed
        batch = int(name.split("-B")[1][:-5])
        for r in records:
            assert set(r["arms"]) == arms and 1 <= r["batch_size"] <= batch
            for arm, outcome in r["arms"].items():
                steps = Strategy.parse(arm).num_steps
                assert len(outcome["accepted"]) == steps
                assert r["batch_size"] <= outcome["emitted"] <= r["batch_size"] * (steps + 1)
                assert outcome["step_time"] > 0 and outcome["step_time"] == round(outcome["step_time"], 7)  # 0.1 us
        # the timed rollout's first step runs the whole batch, as the suite's rows do
        assert next(r for r in records if r["rollout"] == 1)["batch_size"] == batch


def test_selector_min_gain_reaches_every_adaptive_selector(monkeypatch):
    """--selector-min-gain sets CostModelPolicy(min_gain=) of every cost-policy selector the suite builds (cold and
    warm; the counterfactual rows' policy has no margin); a value outside [0, 1] is refused, naming the flag."""
    import tlt_kernels.runtime as runtime_module

    gains = []
    original = runtime_module.StrategySelector

    class Recording(original):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if self.policy.name == "cost":
                gains.append(self.policy.min_gain)

    monkeypatch.setattr(runtime_module, "StrategySelector", Recording)
    res = _run(["--selector-min-gain", "0.04", "--drafters", "ngram", "--batches", "2", "--tail-batch", "0",
                "--no-hf-eager"])
    assert res.status == "ok", res.data["error"]
    assert len(gains) >= 2 and set(gains) == {0.04}, gains
    with pytest.raises(SystemExit):
        _run(["--selector-min-gain", "1.5"])


def test_selector_loss_budget_adds_rows_per_budget(monkeypatch):
    """--selector-loss-budget 0.02,none: the adaptive rows' selectors (cold and warm) take the first budget, and rows
    named `<drafter> adaptive [budget None]` (cold and warm) of the same engine take the second; a budget outside
    [0, 1) is refused, naming the flag."""
    import tlt_kernels.runtime as runtime_module

    budgets = []
    original = runtime_module.StrategySelector

    class Recording(original):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            budgets.append(None if self.budget is None else self.budget.fraction)

    monkeypatch.setattr(runtime_module, "StrategySelector", Recording)
    res = _run(["--selector-loss-budget", "0.02,none", "--drafters", "ngram", "--batches", "2", "--tail-batch", "0",
                "--no-hf-eager"])
    assert res.status == "ok", res.data["error"]
    impls = {r["impl"] for r in res.data["rows"]}
    assert {"ngram adaptive", "ngram adaptive (warm)", "ngram adaptive [budget None]",
            "ngram adaptive [budget None] (warm)"} <= impls, impls
    assert set(budgets) == {0.02, None} and budgets.count(None) >= 2, budgets
    with pytest.raises(SystemExit):
        _run(["--selector-loss-budget", "1"])


def test_the_counterfactual_rows_run_the_counterfactual_policy_fed_by_the_engine(monkeypatch):
    """``ngram adaptive [counterfactual]`` (cold and warm, n-gram only): selectors of the counterfactual policy, which
    the engine feeds (they hear counterfactual counts); --no-selector-counterfactual drops the rows."""
    import tlt_kernels.runtime as runtime_module

    made = []
    original = runtime_module.StrategySelector

    class Recording(original):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(runtime_module, "StrategySelector", Recording)
    args = ["--drafters", "ngram", "--batches", "2", "--tail-batch", "0", "--no-hf-eager", "--step-batches", "2"]
    res = _run(args)
    assert res.status == "ok", res.data["error"]
    impls = {r["impl"] for r in res.data["rows"]}
    assert {"ngram adaptive [counterfactual]", "ngram adaptive [counterfactual] (warm)"} <= impls, impls
    heard = [s.policy.counterfactuals for s in made if s.policy.name == "counterfactual"]
    assert heard and all(n > 0 for n in heard), heard
    res = _run(args + ["--no-selector-counterfactual"])
    assert not any("counterfactual" in r["impl"] for r in res.data["rows"])


def test_selector_forecast_adds_a_forecast_row_per_budgeted_row(monkeypatch):
    """--selector-forecast with budgets 0.02,none: beside each budgeted adaptive row (cold and warm) a row named
    `<drafter> adaptive [budget 0.02, forecast]` whose selectors carry a forecast; none for the unbudgeted row."""
    import tlt_kernels.runtime as runtime_module

    made = []
    original = runtime_module.StrategySelector

    class Recording(original):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append((None if self.budget is None else self.budget.fraction, self.forecast is not None))

    monkeypatch.setattr(runtime_module, "StrategySelector", Recording)
    res = _run(["--selector-loss-budget", "0.02,none", "--selector-forecast", "--drafters", "ngram", "--batches", "2",
                "--tail-batch", "0", "--no-hf-eager"])
    assert res.status == "ok", res.data["error"]
    impls = {r["impl"] for r in res.data["rows"]}
    assert {"ngram adaptive [budget 0.02, forecast]", "ngram adaptive [budget 0.02, forecast] (warm)"} <= impls, impls
    assert not any("None, forecast" in impl for impl in impls), impls
    assert (0.02, True) in made and (None, True) not in made and (0.02, False) in made, made


def test_temperature_samples_every_row_and_compares_none(monkeypatch):
    """--temperature 1: every engine rollout samples at 1 with request i's seed i (recorded at the engine), the hf row
    samples too, the cases carry the temperature, no row claims greedy identity, every request gets its tokens, the
    speculative rows' accepted length is the lossless rule's (>= 1), and there are no step-cost rows (greedy runs
    have them); a negative temperature is refused, naming the flag."""
    from tlt_kernels.engine import SpeculativeEngine

    calls = []
    original = SpeculativeEngine.generate

    def recording(self, prompts, max_new_tokens, *args, **kwargs):
        calls.append((len(prompts), kwargs.get("temperature"), kwargs.get("seed")))
        return original(self, prompts, max_new_tokens, *args, **kwargs)

    monkeypatch.setattr(SpeculativeEngine, "generate", recording)
    res = _run(["--temperature", "1", "--drafters", "ngram", "--batches", "3", "--tail-batch", "0"])
    assert res.status == "ok", res.data["error"]
    rollouts = [r for r in res.data["rows"] if r["case"]["workload"] != "step-cost"]
    assert {r["impl"] for r in rollouts} >= {"plain", "ngram s2k1v3", "ngram adaptive", "hf-eager"}
    for r in rollouts:
        assert r["case"] == {"workload": "uniform", "B": 3, "tokens": 24, "temperature": 1.0}, r
        assert r["greedy_identical"] is None and r["full_length"] is True and r["tokens"] == 24, r
        assert r["accepted_length"] >= 1.0, r
    assert calls and all(t == 1.0 and seed == list(range(batch)) for batch, t, seed in calls), calls
    assert not [r for r in res.data["rows"] if r["case"]["workload"] == "step-cost"]  # greedy rows measure a step
    assert any(n.startswith("sampled at temperature 1.0") for n in res.data["notes"])
    assert not any("greedy identical" in n or "greedy output differs" in n for n in res.data["notes"])
    refused = _run(["--temperature", "-1", "--drafters", "ngram", "--batches", "1", "--tail-batch", "0"])
    assert refused.status != "ok" and "--temperature" in str(refused.data["error"]), refused.data


def test_hf_generate_samples_at_the_workloads_temperature():
    """hf_generate is greedy at temperature 0 and samples at > 0 (seeded: the same tokens twice), with the model's own
    sampling defaults overridden (top-k and top-p off)."""
    hf = rollout.tiny_hf_model()
    hf.generation_config.top_p, hf.generation_config.top_k = 0.5, 3  # defaults a shipped model may carry
    models = rollout.Models(None, hf, pad_id=0, eos_id=None)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    greedy = rollout.Workload("uniform", prompts, [12, 12], prompts)
    sampled = rollout.Workload("uniform", prompts, [12, 12], prompts, temperature=1.5)
    g1, _ = rollout.hf_generate(models, greedy, None)
    s1, _ = rollout.hf_generate(models, sampled, None)
    s2, _ = rollout.hf_generate(models, sampled, None)
    assert [len(t) for t in g1] == [len(t) for t in s1] == [12, 12]
    assert s1 == s2 and s1 != g1


def test_draft_vocab_drafts_from_the_train_answers_most_frequent_tokens(eagle_checkpoint, monkeypatch):
    """--draft-vocab N (default DEFAULT_DRAFT_VOCAB where the vocabulary is larger): every EAGLE engine's drafter drafts
    from the N tokens its target uses most in greedy answers to the train prompts (counted once), and its rows stay
    greedy-identical to plain decoding; 0 keeps the whole vocabulary; N past the vocabulary is refused by name."""
    from tlt_kernels.drafter import EagleDrafter

    vocabularies = []
    original = EagleDrafter.set_draft_vocab
    monkeypatch.setattr(EagleDrafter, "set_draft_vocab",
                        lambda self, ids: vocabularies.append(ids) or original(self, ids))
    monkeypatch.setattr(rollout, "DEFAULT_DRAFT_VOCAB", 48)  # the tiny model's vocabulary is smaller than 8192
    small = ["--eagle-checkpoint", str(eagle_checkpoint), "--drafters", "eagle", "--batches", "1", "--tail-batch", "0"]
    res = _run(small)
    assert res.status == "ok", res.data["error"]
    assert vocabularies and all(v is vocabularies[0] for v in vocabularies)  # counted once, given to every engine
    assert vocabularies[0].shape == (48,) and torch.equal(vocabularies[0], vocabularies[0].sort().values)
    assert any(n.startswith("draft vocabulary (--draft-vocab): the 48 tokens") for n in res.data["notes"])
    for r in res.data["rows"]:
        if r["impl"].startswith("eagle") and r["case"]["workload"] != "step-cost":
            assert r["greedy_identical"] is True, r
    vocabularies.clear()
    res = _run(small + ["--draft-vocab", "0"])
    assert res.status == "ok" and vocabularies and all(v is None for v in vocabularies)
    vocab_size = rollout.tiny_hf_model().config.vocab_size
    res = _run(small + ["--draft-vocab", str(vocab_size + 1)])
    assert res.status != "ok" and "--draft-vocab must be <=" in res.data["error"]
