"""The counterfactual policy: follow the leader over every arm's observed progress, and the selector's
``observe_counterfactual`` that feeds it."""
import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tlt_kernels.runtime import CounterfactualPolicy, Strategy, StrategySelector
from tlt_kernels.runtime.policies import POLICIES, make_policy
from tlt_kernels.runtime.simulate import replay_selector

from test_selector import ARMS as TOY_ARMS
from test_selector import _best, _true_rate

OFF, SHORT, DEEP = Strategy.off(), Strategy(2, 1, 3), Strategy(4, 1, 5)
ARMS = [OFF, SHORT, DEEP]
# Plain decoding 10 ms, the chains 11 and 12 ms at every batch size.
TABLE = {OFF: [(1, 0.010), (64, 0.010)], SHORT: [(1, 0.011), (64, 0.011)], DEEP: [(1, 0.012), (64, 0.012)]}


def _bound(**kw):
    pol = CounterfactualPolicy(**{"cost_table": TABLE, **kw})
    pol.bind(ARMS, num_buckets=2, rng=random.Random(0), window=32)
    return pol


def _selector(**kw):
    return StrategySelector([SHORT, DEEP], policy="counterfactual", cost_table=TABLE, **kw)


def test_it_is_a_named_policy():
    assert POLICIES["counterfactual"] is CounterfactualPolicy
    assert isinstance(make_policy("counterfactual"), CounterfactualPolicy)


def test_plain_decoding_until_an_arm_is_observed_to_pay():
    pol = _bound()
    assert pol.tokens == [1.0, 1.0, 1.0]
    assert pol.choose(0, 4, [0, 1, 2], step=1) == 0  # the prior is plain decoding's one token, at more time
    # DEEP's counterfactual: of 4 rows, 2 accepted at least 1 draft, 1 at least 2 -> progress 1 + 3 / 4.
    pol.observe_counterfactual(2, [2.0, 1.0, 0.0, 0.0], rows=4)
    assert pol.tokens[2] == pytest.approx((1.0 + 1.75) / 2)  # the prior weighs one step
    assert pol.counterfactuals == 1
    assert pol.choose(0, 4, [0, 1, 2], step=2) == 2  # 1.375 tokens / 12 ms beats 1 / 10 ms
    assert pol.choose(0, 4, [0, 1], step=2) == 0  # DEEP not allowed: SHORT has only its prior


def test_the_choice_is_the_best_tokens_per_second():
    pol = _bound()
    for _ in range(20):
        pol.observe_counterfactual(1, [3.0, 3.0], rows=4)  # 2.5 tokens in 11 ms
        pol.observe_counterfactual(2, [4.0, 2.0, 1.0, 1.0], rows=4)  # 3 tokens in 12 ms
    rates = [pol.tokens[a] / s for a, s in ((0, 0.010), (1, 0.011), (2, 0.012))]
    assert pol.choose(0, 4, [0, 1, 2], step=1) == max(range(3), key=rates.__getitem__) == 2
    assert pol.predict(0, 2, 4) == pytest.approx(4 * pol.tokens[2] / 0.012)


def test_a_played_step_counts_as_the_counterfactual_does():
    played, told = _bound(), _bound()
    played.observe(0, 2, 4, emitted=9.0, elapsed=0.012, accepted=[2.0, 1.0, 1.0, 0.0], step=1, accepted_rows=2)
    told.observe_counterfactual(2, [2.0, 1.0, 1.0, 0.0], rows=2)
    assert played.tokens == told.tokens
    played.observe(0, 0, 4, emitted=4.0, elapsed=0.010, accepted=None, step=2)  # plain decoding: a time alone
    assert played.tokens == told.tokens


def test_observed_step_times_do_not_replace_the_table():
    pol = _bound()
    pol.observe(0, 0, 4, emitted=4.0, elapsed=0.5, accepted=None, step=1)  # a rollout's slow first plain step
    assert pol.step_seconds(0, 0, 4) == pytest.approx(0.010)
    untimed = _bound(cost_table={OFF: [(1, 0.010)]})
    assert untimed.choose(0, 4, [0, 1, 2], step=1) == 1  # no table entry: one play times it
    untimed.observe(0, 1, 4, emitted=4.0, elapsed=0.02, accepted=[0.0, 0.0], step=1)
    assert untimed.step_seconds(0, 1, 4) == pytest.approx(0.02)


def test_memory_and_new_rollout():
    pol = _bound(memory=2, keep_on_rollout=0.0)
    for _ in range(30):
        pol.observe_counterfactual(1, [4.0, 4.0], rows=4)
    assert pol.tokens[1] == pytest.approx(3.0, abs=1e-6)  # memory 2 forgets the prior
    pol.new_rollout()
    assert pol.tokens[1] == 1.0  # keep_on_rollout=0: the prior again
    kept = _bound()
    kept.observe_counterfactual(1, [4.0, 4.0], rows=4)
    kept.new_rollout()
    assert kept.tokens[1] == pytest.approx(2.0)  # default: every observation kept


@pytest.mark.parametrize("kw, name", [
    (dict(prior_tokens=0.5), "prior_tokens"), (dict(prior_tokens=float("nan")), "prior_tokens"),
    (dict(prior_weight=0.0), "prior_weight"), (dict(memory=1), "memory"), (dict(memory=True), "memory"),
    (dict(keep_on_rollout=1.5), "keep_on_rollout"),
])
def test_bad_options_name_the_argument(kw, name):
    with pytest.raises(ValueError, match=name):
        CounterfactualPolicy(**kw)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([1, 2]), st.integers(1, 8), st.data()), min_size=1, max_size=30))
def test_tokens_are_the_mean_progress_with_the_prior(steps):
    pol, sums = _bound(), {1: [1.0, 1.0], 2: [1.0, 1.0]}
    for arm, rows, data in steps:
        counts = sorted(data.draw(st.lists(st.integers(0, rows), min_size=ARMS[arm].num_steps,
                                           max_size=ARMS[arm].num_steps)), reverse=True)
        pol.observe_counterfactual(arm, [float(c) for c in counts], rows)
        sums[arm][0] += 1.0 + sum(counts) / rows
        sums[arm][1] += 1.0
    for arm in (1, 2):
        assert pol.tokens[arm] == pytest.approx(sums[arm][0] / sums[arm][1])
        assert 1.0 <= pol.tokens[arm] <= 1.0 + ARMS[arm].num_steps
    choice = pol.choose(0, 4, [0, 1, 2], step=1)
    rates = [pol.tokens[a] / pol.step_seconds(0, a, 4) for a in range(3)]
    assert rates[choice] == max(rates)


def test_the_selector_feeds_the_policy():
    sel = _selector()
    assert sel.select(4) == OFF
    sel.observe_counterfactual(DEEP, 4, [3, 2, 1, 1], accepted_rows=3)
    sel.observe_counterfactual(SHORT, 4, torch.tensor([1, 0]))  # a CPU tensor, over the whole batch
    assert sel.policy.tokens[2] == pytest.approx((1.0 + 1.0 + 7 / 3) / 2)
    assert sel.policy.tokens[1] == pytest.approx((1.0 + 1.25) / 2)
    assert sel.select(4) == DEEP


def test_other_policies_ignore_counterfactuals():
    sel = StrategySelector([SHORT, DEEP], cost_table=TABLE)
    before = list(sel.policy.tokens)
    sel.observe_counterfactual(DEEP, 4, [4, 4, 4, 4])
    assert sel.policy.tokens == before


@pytest.mark.parametrize("args, match", [
    ((OFF, 4, []), "speculative arm"),
    ((Strategy(3, 1, 4), 4, [0, 0, 0]), "speculative arm"),
    ((DEEP, 0, [0, 0, 0, 0]), "batch_size"),
    ((DEEP, 4, [0, 0]), "num_steps=4"),
    ((DEEP, 4, "0000"), "accepted_per_position"),
    ((DEEP, 4, torch.zeros(2, 2)), "accepted_per_position"),
])
def test_bad_counterfactuals_name_the_argument(args, match):
    with pytest.raises(ValueError, match=match):
        _selector().observe_counterfactual(*args)


def test_accepted_rows_is_checked():
    with pytest.raises(ValueError, match="accepted_rows"):
        _selector().observe_counterfactual(DEEP, 4, [0, 0, 0, 0], accepted_rows=5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_device_tensor_is_refused_rather_than_synchronized():
    with pytest.raises(ValueError, match="host counts"):
        _selector().observe_counterfactual(DEEP, 4, torch.zeros(4, device="cuda"))


@pytest.mark.parametrize("counts", [[1, 2, 0, 0], [5, 0, 0, 0], [float("nan"), 0, 0, 0], [-1, 0, 0, 0]])
def test_garbage_counts_are_ignored_and_counted(counts):
    sel = _selector()
    with pytest.warns(RuntimeWarning, match="garbage"):
        sel.observe_counterfactual(DEEP, 4, counts)
    assert sel.rejected == 1 and sel.policy.counterfactuals == 0


def _record(counts_by_arm, batch_size=2):
    times = {OFF: 0.010, SHORT: 0.011, DEEP: 0.012}
    arms = {}
    for s, counts in counts_by_arm.items():
        arms[str(s)] = {"step_time": times[s], "emitted": batch_size * (1 + (counts[0] if counts else 0)),
                        "accepted": counts, "lagging_rows": 1, "lagging_accepted": [min(c, 1) for c in counts]}
    return {"batch_size": batch_size, "arms": arms}


def test_the_replay_hands_over_each_arm_once_its_drafts_are_scored():
    """``replay_selector(counterfactual=True)``: an arm of ``num_steps`` drafts is known that many steps later, over
    the lagging rows where the record counts them; the played arm's counts come through ``update``."""
    records = [_record({OFF: [], SHORT: [2, 2], DEEP: [2, 2, 2, 2]}) for _ in range(6)]
    sel = _selector()
    res = replay_selector(records, sel, counterfactual=True)
    assert res.picks[:4] == ["off", "off", "off", str(SHORT)]  # SHORT's first count is known after step 3
    assert res.picks[5] == str(DEEP)  # DEEP's after step 5: 5 tokens in 12 ms beat SHORT's 3 in 11
    # Handed over: SHORT of steps 1-3 (known after steps 3-5; steps 4 and 5 ran it), DEEP of steps 1-2 (known after
    # steps 5-6; step 6 ran it); each arm's own steps come through update.
    assert sel.policy.counterfactuals == 3 + 2
    assert sel.policy.tokens[1] == pytest.approx((1 + 5 * 3) / 6)  # the prior, 3 counterfactuals, 2 own steps
    assert sel.policy.tokens[2] == pytest.approx((1 + 3 * 5) / 4)  # the prior, 2 counterfactuals, 1 own step


def test_it_finds_the_best_arm_per_bucket_from_counterfactuals():
    """test_selector.py's toy world (speculation pays at small batches, not at large ones), each step also handing
    over every other arm's expected counts: no table, so each arm is played once per bucket to time it."""
    sel = StrategySelector(TOY_ARMS, policy="counterfactual", seed=3)
    rng, picks = random.Random(0), []
    for i in range(400):
        b = (2, 512)[i % 2]
        played = sel.select(b)
        tokens, seconds = _true_rate(played, b)
        counts = {s: [b * (0.8 if s.topk == 1 else 0.88) ** (j + 1) for j in range(s.num_steps)] for s in TOY_ARMS}
        sel.update(played, b, tokens * b, seconds * math.exp(0.03 * rng.gauss(0, 1)), counts.get(played))
        for s in TOY_ARMS:
            if s != played:
                sel.observe_counterfactual(s, b, counts[s])
        picks.append((b, played))
    for b in (2, 512):
        assert [s for bb, s in picks[-100:] if bb == b] == [_best(b, sel.strategies)] * 50


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_a_one_hot_trees_acceptance_has_the_law_of_matching_plain_samples(temperature):
    """The counterfactual policy's premise (docs/RUNTIME.md, "The counterfactual policy"): verifying a tree of one-hot
    candidates (an n-gram drafter's: no draft distribution) accepts a path exactly as often as plain decoding's
    samples match it. Root candidates 3, 5, 7; node 1 (token 3) has candidates 2 and 9: depth >= 1 has probability
    ``p0(3) + p0(5) + p0(7)``, depth 2 ``p0(3) * (p1(2) + p1(9))``. 400k draws put a 1% bias at 6-12 standard
    errors."""
    from tlt_kernels.ops.verify_tree import verify_tree

    draws, vocab = 400_000, 12
    generator = torch.Generator().manual_seed(7)
    logits = torch.randn(6, vocab, generator=generator)
    logits[0, 3] += 4.0  # a path that carries most of the mass, so the bias to catch is large
    logits[1, [2, 9]] += 3.5
    parents = torch.tensor([-1, 0, 0, 0, 1, 1], dtype=torch.int32).repeat(draws, 1)
    tokens = torch.tensor([0, 3, 5, 7, 2, 9]).repeat(draws, 1)
    result = verify_tree(logits.repeat(draws, 1, 1), tokens, parents, temperature=temperature,
                         seed=torch.arange(draws), backend="torch", validate=False)
    p = torch.softmax(logits.double() / temperature, -1)
    laws = {1: p[0, [3, 5, 7]].sum().item(), 2: (p[0, 3] * p[1, [2, 9]].sum()).item()}
    for depth, law in laws.items():
        seen = (result.num_accepted >= depth).double().mean().item()
        assert abs(seen - law) < 4 * (law * (1 - law) / draws) ** 0.5, (depth, seen, law)
