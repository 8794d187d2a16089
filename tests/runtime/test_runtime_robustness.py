"""No silent wrong answers, for the runtime: garbage measurements never poison a selector, policies stay
finite on legal extremes, cost tables and traces are validated where they are built or loaded."""
import json
import math
import random
import warnings

import pytest

from tlt_kernels.runtime import POLICIES, CallbackValue, CostTable, Strategy, StrategySelector
from tlt_kernels.runtime.simulate import load_trace, record_trace, standard_workloads

ARMS = [Strategy(1, 1, 2), Strategy(3, 1, 4), Strategy(4, 4, 8)]
TABLE = {s: [(1, 0.010 + 0.001 * s.num_steps), (64, 0.012 + 0.004 * s.num_verify)] for s in [Strategy.off()] + ARMS}


def _selector(policy, **kw):
    if policy == "cost":
        kw.setdefault("cost_table", TABLE)
    return StrategySelector(ARMS, policy=policy, seed=5, **kw)


def _good(s, b, rng):
    """A plausible observation of ``s`` at batch ``b``: acceptance 0.8 per position, noisy times."""
    acc, reach = [], b
    for _ in range(s.num_steps):
        reach = sum(1 for _ in range(reach) if rng.random() < 0.8)
        acc.append(reach)
    t = (0.01 + 1e-4 * b * s.num_verify + 0.001 * s.num_steps) * math.exp(0.05 * rng.gauss(0, 1))
    return b + sum(acc), t, (acc if s.num_steps else None)


GARBAGE = {
    "nan emitted": lambda em, el, acc, b: (math.nan, el, acc),
    "inf emitted": lambda em, el, acc, b: (math.inf, el, acc),
    "negative emitted": lambda em, el, acc, b: (-5, el, acc),
    "inf elapsed": lambda em, el, acc, b: (em, math.inf, acc),
    "nan elapsed": lambda em, el, acc, b: (em, math.nan, acc),
    "nan accepted": lambda em, el, acc, b: (em, el, [math.nan] * len(acc)),
    "inf accepted": lambda em, el, acc, b: (em, el, [math.inf] + acc[1:]),
    "negative accepted": lambda em, el, acc, b: (em, el, [-1] * len(acc)),
    "accepted above the batch": lambda em, el, acc, b: (em, el, [b + 1] * len(acc)),
    "accepted growing with depth": lambda em, el, acc, b: (em, el, [0] * (len(acc) - 1) + [b]),
}


def _run(policy, garbage, steps=160, start=40, sizes=(2, 8, 64)):
    """Two selectors with equal seeds and equal observations, except that at the first speculative step from
    ``start`` on one of them gets a garbage observation and the other none. Returns both pick lists, the
    garbage-fed selector and whether the garbage was fed."""
    clean, dirty = _selector(policy), _selector(policy)
    rng = random.Random(7)
    picks, fed = ([], []), False
    for i in range(steps):
        b = sizes[i % len(sizes)]
        s, s2 = clean.select(b), dirty.select(b)
        picks[0].append(s)
        picks[1].append(s2)
        em, el, acc = _good(s, b, rng)
        if not fed and i >= start and s == s2 and not s.is_off:
            dirty.update(s2, b, *GARBAGE[garbage](em, el, acc, b))  # the clean twin skips this step's observation
            fed = True
            continue
        clean.update(s, b, em, el, acc)
        dirty.update(s2, b, em, el, acc)
    return picks, dirty, fed


@pytest.mark.parametrize("garbage", sorted(GARBAGE))
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_one_garbage_observation_never_poisons_a_selector(policy, garbage):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (clean, dirty), sel, fed = _run(policy, garbage)
    assert fed, "the stream never played a speculative arm after the start"
    assert dirty == clean  # ignored: every later decision is the clean twin's
    assert sel.rejected == 1 and sum(sel.rejected_reasons.values()) == 1
    mine = [w for w in caught if "garbage observation" in str(w.message)]
    assert len(mine) == 1 and issubclass(mine[0].category, RuntimeWarning)


def test_garbage_warns_once_per_selector_and_counts_by_field():
    sel = _selector("cost")
    s = Strategy(3, 1, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sel.update(s, 8, math.nan, 0.01, [4, 2, 1])
        sel.update(s, 8, 12, math.inf, [4, 2, 1])
        sel.update(s, 8, 12, 0.01, [4, 5, 1])
        sel.update(s, 8, 12, 0.01, [4, 2, 1])  # a good one
    assert sel.rejected == 3
    assert sel.rejected_reasons == {"emitted_tokens": 1, "elapsed_s": 1, "accepted_per_position": 1}
    assert sum("garbage observation" in str(w.message) for w in caught) == 1
    assert "emitted_tokens=nan" in str(caught[0].message) and "s3k1v4" in str(caught[0].message)
    other = _selector("cost")
    with pytest.warns(RuntimeWarning, match="garbage observation"):  # once per selector, not once per process
        other.update(s, 8, math.nan, 0.01, [4, 2, 1])


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_garbage_that_arrives_later_is_ignored_too(policy):
    """A pending value (a device tensor or a callback) can resolve to garbage: the drain path validates as well."""
    sel = _selector(policy)
    s = Strategy(3, 1, 4)
    with pytest.warns(RuntimeWarning, match="garbage"):
        sel.update(s, 8, CallbackValue(lambda: math.nan), 0.01, [4, 2, 1])
        sel.update(s, 8, 12, CallbackValue(lambda: math.inf), [4, 2, 1])
        sel.update(s, 8, 12, 0.01, CallbackValue(lambda: [4, math.nan, 1]))
    assert sel.observe_ready() == 0 and sel.rejected == 3
    for _ in range(20):
        sel.select(8)


def test_one_element_tensors_are_scalars():
    """``DeferredTensor`` documents a 1-element tensor for ``emitted_tokens``; its ``tolist()`` is a list."""
    torch = pytest.importorskip("torch")
    a, b = _selector("cost"), _selector("cost")
    s = Strategy(3, 1, 4)
    a.update(s, 8, torch.tensor([12]), torch.tensor([0.01]), torch.tensor([4, 2, 1]))
    b.update(s, 8, 12, 0.01, [4, 2, 1])
    assert a.observe_ready() == 0 and a.policy.tokens == b.policy.tokens and a.rejected == 0


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_policies_are_finite_on_legal_extremes(policy):
    """Tiny positive step times (a 1e-300 s step overflowed Thompson's squares: OverflowError on every later select;
    5e-324 s underflowed the cost policy's time ratio to 0.0) and huge counts must not raise or leave NaN/inf behind."""
    sel = _selector(policy)
    rng = random.Random(3)
    extremes = [1e-300, 5e-324, 1e300]
    for i in range(300):
        b = (2, 8, 10**15)[i % 3]
        s = sel.select(b)
        em, el, acc = _good(s, min(b, 64), rng)
        if b == 10**15:
            em, acc = em * 10**13, None if acc is None else [x * 10**13 for x in acc]
        if i % 50 == 7:
            el = extremes[(i // 50) % len(extremes)]
        sel.update(s, b, em, el, acc)
    assert sel.rejected == 0
    pol = sel.policy
    # The cost policy's statistics live in its step-time and acceptance models.
    parts = [pol, getattr(pol, "step_time", None), getattr(pol, "acceptance", None)]
    for name in ("median_reward", "window_reward_sum", "reward_sum", "reward_sq_sum", "ratio", "tokens", "depth_offset",
                 "width_offset"):
        for part in parts:
            values = getattr(part, name, None)
            if values is None:
                continue
            flat = [x for row in values for x in (row if isinstance(row, list) else [row])]
            assert all(math.isfinite(x) for x in flat), (name, flat)
    if policy == "cost":
        assert math.isfinite(pol.acceptance.level)


def test_ucb_sum_recovers_exactly_when_an_extreme_reward_leaves_the_window():
    """Subtracting a reward that dominates the windowed sum cancelled every other reward of the arm (the sum fell to
    0 while the arm still had plays in the window): the sum is recomputed when the leaving reward dominates."""
    sel = StrategySelector(ARMS, policy="ucb", window=4, seed=0)
    s = Strategy(3, 1, 4)
    sel.update(s, 8, 16, 1e-98)  # reward 1.6e99
    for _ in range(4):
        sel.update(s, 8, 16, 0.01)  # reward 1600 each; the extreme one leaves after the 4th
    bucket = sel.bucket(8)
    arm = sel.strategies.index(s)
    assert sel.policy.window_plays[bucket][arm] == 4
    assert sel.policy.window_reward_sum[bucket][arm] == pytest.approx(4 * 1600.0)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "8", None])
def test_batch_size_must_be_a_positive_int(bad):
    sel = _selector("cost")
    with pytest.raises(ValueError, match=r"batch_size must be an int >= 1.*got " + repr(bad).replace("'", ".")):
        sel.update(Strategy(3, 1, 4), bad, 4, 0.01, [1, 1, 1])
    with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
        sel.select(bad)


def test_numpy_ints_are_batch_sizes():
    np = pytest.importorskip("numpy")
    sel = _selector("cost")
    s = sel.select(np.int64(8))
    sel.update(s, np.int64(8), 8 * s.max_tokens_per_step, 0.01, [4] * s.num_steps if s.num_steps else None)
    assert sel.rejected == 0


def test_callers_errors_still_raise():
    sel = _selector("beg")
    with pytest.raises(ValueError, match="elapsed_s must be > 0"):
        sel.update(Strategy(3, 1, 4), 8, 12, 0.0, [4, 2, 1])
    with pytest.raises(ValueError, match="elapsed_s must be > 0"):
        sel.update(Strategy(3, 1, 4), 8, 12, -0.01)
    with pytest.raises(ValueError, match="num_steps=3 entries, got 2"):  # every policy, not only the cost model
        sel.update(Strategy(3, 1, 4), 8, 12, 0.01, [4, 2])
    assert sel.rejected == 0


BAD_POINTS = [
    ((8, math.nan), "step time"),
    ((8, math.inf), "step time"),
    ((8, 0.0), "step time"),
    ((8, -0.01), "step time"),
    ((8, "fast"), "step time"),
    ((0, 0.01), "batch_size must be an int >= 1, got 0"),
    ((-4, 0.01), "batch_size must be an int >= 1, got -4"),
    ((2.5, 0.01), "batch_size must be an int >= 1, got 2.5"),
    ((True, 0.01), "batch_size must be an int >= 1, got True"),
    ((8,), "pair"),
]


@pytest.mark.parametrize("point,why", BAD_POINTS)
def test_cost_table_entries_are_validated_at_construction(point, why):
    s = Strategy(3, 1, 4)
    with pytest.raises(ValueError, match=why) as err:
        CostTable({s: [(1, 0.01), point]})
    assert "s3k1v4" in str(err.value)
    with pytest.raises(ValueError, match=why):  # the policy builds its table from a dict the same way
        StrategySelector(ARMS, cost_table={s: [point]})


def test_cost_table_rejects_duplicates_and_non_strategy_keys():
    with pytest.raises(ValueError, match="two times for batch_size=8"):
        CostTable({Strategy(3, 1, 4): [(8, 0.01), (8, 0.02)]})
    with pytest.raises(TypeError, match="Strategy"):
        CostTable({"s3k1v4": [(8, 0.01)]})
    with pytest.raises(ValueError, match=r"\(8, nan\)"):
        CostTable.measure(lambda s, b: math.nan, [Strategy(3, 1, 4)], [8])


def test_trace_loading_names_the_file_and_the_record(tmp_path):
    bad_json = tmp_path / "broken.json"
    bad_json.write_text('[{"batch_size": 4, "arms": ')
    with pytest.raises(ValueError, match="broken.json is not valid JSON"):
        load_trace(str(bad_json))
    wl = standard_workloads(small=True)[0]
    recs = record_trace(wl, [Strategy.off(), Strategy(3, 1, 4)])[:5]
    good = tmp_path / "good.json"
    good.write_text(json.dumps(recs))
    assert load_trace(str(good)) == recs
    recs[3]["arms"]["s3k1v4"]["step_time"] = float("nan")
    nan = tmp_path / "nan.json"
    nan.write_text(json.dumps(recs))  # json writes NaN, and reads it back
    with pytest.raises(ValueError, match=r"nan.json record 3, arm s3k1v4: step_time must be a finite"):
        load_trace(str(nan))
    recs[3]["arms"]["s3k1v4"]["step_time"] = 0.01
    recs[2]["batch_size"] = 0
    zero = tmp_path / "zero.json"
    zero.write_text(json.dumps(recs))
    with pytest.raises(ValueError, match=r"record 2: batch_size must be an int >= 1, got 0"):
        load_trace(str(zero))
    recs[2]["batch_size"] = 4
    recs[1].update(batch_size=4, drafted_rows=4, lagging_drafted_rows=0)  # an n-gram trace's rows with a draft
    counted = tmp_path / "counted.json"
    counted.write_text(json.dumps(recs))
    assert load_trace(str(counted)) == recs
    for key, value in (("drafted_rows", 5), ("lagging_drafted_rows", -1), ("drafted_rows", "4")):
        recs[1][key] = value
        counted.write_text(json.dumps(recs))
        with pytest.raises(ValueError, match=rf"record 1: {key} must be a count in \[0, batch_size=4\]"):
            load_trace(str(counted))
        recs[1].update(drafted_rows=4, lagging_drafted_rows=0)


def test_policy_parameters_that_would_poison_every_choice():
    with pytest.raises(ValueError, match="c must be a finite number >= 0"):
        StrategySelector(ARMS, policy="ucb", c=math.nan)
    with pytest.raises(ValueError, match="min_rel_std must be a finite number >= 0"):
        StrategySelector(ARMS, policy="thompson", min_rel_std=-0.1)
    with pytest.raises(ValueError, match="offset_mean must be a finite number"):
        StrategySelector(ARMS, policy="cost", offset_mean=math.inf)


def test_replayed_records_are_checked_too():
    from tlt_kernels.runtime.simulate import replay_selector

    recs = record_trace(standard_workloads(small=True)[0], [Strategy.off(), Strategy(3, 1, 4)])[:6]
    recs[4]["arms"]["off"]["step_time"] = math.nan
    with pytest.raises(ValueError, match="trace step 4, arm off: step_time must be a finite number of seconds > 0"):
        replay_selector(recs, StrategySelector([Strategy(3, 1, 4)], seed=0))
