"""The static-batch simulation (tlt_kernels.runtime.static_batch): the feedback rules, the batch's wall time."""
import numpy as np
import pytest

from tlt_kernels.runtime import CostTable, Strategy, StrategySelector
from tlt_kernels.runtime.static_batch import (FIRST_STEP_S, SMALL_MODEL_COST, BatchText, CopyPhases, StaticBatch,
                                              batch_feedback, critical_feedback, good_drafter_batches, grpo_batch,
                                              lagging_feedback, ngram_tail_batch, run_static_batch, selector_observer,
                                              static_batches)

REACH = np.array([3, 0, 2, 1, 0])
LEFT = np.array([9, 12, 12, 5, 12])  # requests 1, 2 and 4 lag


def test_feedback_rules_count_the_rows_they_name():
    assert batch_feedback(REACH, LEFT, 3) == ([3, 2, 1], None)
    assert lagging_feedback(REACH, LEFT, 3) == ([1, 1, 0], 3)  # request 2 reached depth 2, 1 and 4 none
    assert critical_feedback(REACH, LEFT, 3) == ([0, 0, 0], 1)  # the lagging row that accepted fewest
    assert critical_feedback(np.array([3, 2]), np.array([7, 7]), 3) == ([1, 1, 0], 1)


def test_plain_decoding_takes_budget_steps_of_the_plain_step_and_the_first_steps_gap():
    batch = StaticBatch("b", [0.5] * 4, budget=10)
    seconds = run_static_batch(batch, lambda b: Strategy.off())
    assert seconds == pytest.approx(10 * SMALL_MODEL_COST(Strategy.off(), 4) + FIRST_STEP_S)
    observed = []
    run_static_batch(StaticBatch("b", [0.5] * 4, budget=3, noise=0.0), lambda b: Strategy.off(),
                     lambda *step, **requests: observed.append(step[3]))
    assert observed == pytest.approx([SMALL_MODEL_COST(Strategy.off(), 4) + FIRST_STEP_S]
                                     + [SMALL_MODEL_COST(Strategy.off(), 4)] * 2)  # the selector sees it too


@pytest.mark.parametrize("alpha, faster", [(0.95, True), (0.0, False)])
def test_a_static_arm_wins_or_loses_by_its_acceptance(alpha, faster):
    batch = StaticBatch("b", [alpha] * 8, budget=64)
    plain = run_static_batch(batch, lambda b: Strategy.off())
    chain = run_static_batch(batch, lambda b: Strategy(4, 1, 5), seed=1)
    assert (chain < plain) == faster


def test_the_batch_ends_with_its_slowest_request():
    """One request that accepts nothing among ones that accept everything: a chain's wall time is that request's
    budget of steps at the chain's step cost."""
    batch = StaticBatch("b", [0.0] + [0.999] * 7, budget=32)
    arm = Strategy(3, 1, 4)
    assert run_static_batch(batch, lambda b: arm) == pytest.approx(32 * SMALL_MODEL_COST(arm, 8), rel=0.05)


def test_a_selector_fed_the_whole_batch_is_fooled_by_lucky_requests():
    """A few requests accept long drafts, most none: the batch's counts make speculation look good while the
    lagging requests' show it does not shorten the batch (the engine's rule)."""
    batch = StaticBatch("b", [0.9] * 6 + [0.02] * 26, budget=96)
    arms = (Strategy.off(), Strategy(4, 1, 5))
    table = CostTable({a: [(b, batch.cost(a, b)) for b in (1, 8, 32)] for a in arms})
    seconds = {}
    for name, feedback in (("batch", batch_feedback), ("lagging", lagging_feedback)):
        sel = StrategySelector(arms, seed=0, cost_table=table)
        seconds[name] = run_static_batch(batch, sel.select, selector_observer(sel), feedback)
    plain = run_static_batch(batch, lambda b: Strategy.off())
    assert seconds["lagging"] < seconds["batch"] and seconds["lagging"] <= 1.05 * plain


def test_static_batches_cover_the_batch_sizes():
    batches = static_batches((1, 4))
    assert [len(b.alphas) for b in batches] == [1, 1, 1, 4, 4, 4]
    assert all(0.0 <= a <= 1.0 for b in batches for a in b.alphas)


def test_the_good_drafter_batches_gain_from_drafting_at_every_size():
    """A 7B-class target whose drafter pays: every request drafted beats plain decoding at B = 16 and 64, the deep tree
    where verifying is cheap (B = 16) and the chain where 16 tokens a request make the step FLOP-bound (B = 64)."""
    small, large = good_drafter_batches((16, 64))
    assert [len(b.alphas) for b in (small, large)] == [16, 64] and all(0 < a < 1 for a in large.alphas)
    plain = {b.name: run_static_batch(b, lambda n: Strategy.off()) for b in (small, large)}
    assert run_static_batch(small, lambda n: Strategy(5, 4, 16)) < 0.6 * plain[small.name]
    assert run_static_batch(large, lambda n: Strategy(2, 1, 3)) < 0.9 * plain[large.name]
    assert run_static_batch(large, lambda n: Strategy(5, 4, 16)) > run_static_batch(large, lambda n: Strategy(2, 1, 3))


def test_requests_that_stop_early_leave_the_batch():
    """Per-request budgets (an EOS): plain decoding runs 3 steps at B = 2, then 2 at B = 1."""
    batch = StaticBatch("b", [0.5, 0.5], budget=5, budgets=[3, 5])
    off = Strategy.off()
    expected = 3 * SMALL_MODEL_COST(off, 2) + 2 * SMALL_MODEL_COST(off, 1) + FIRST_STEP_S
    assert run_static_batch(batch, lambda b: off) == pytest.approx(expected)
    for bad in ([3], [0, 5], [3, 6]):
        with pytest.raises(ValueError, match="budgets"):
            StaticBatch("b", [0.5, 0.5], budget=5, budgets=bad)


def test_the_grpo_batch_ends_with_its_slowest_response():
    """Half the responses run to the budget and acceptance is low and uneven: a chain barely shortens the batch
    (its slowest response accepts almost nothing), so plain decoding is the best static arm."""
    batch = grpo_batch(size=64, budget=256, seed=0)
    assert sum(b == 256 for b in batch.budgets) >= 24 and min(batch.budgets) >= 25
    plain = run_static_batch(batch, lambda b: Strategy.off())
    chain = run_static_batch(batch, lambda b: Strategy(2, 1, 3))
    assert plain < chain < 1.1 * plain


def test_copy_phases_follow_their_markov_chain():
    """Along the tokens the phases start from the chain's stationary law and keep it; a phase lasts 1 / p_stop tokens
    on average."""
    phases = CopyPhases(p_start=0.02, p_stop=0.08)
    copying = phases.draw(np.random.default_rng(0), 2000, 60)
    assert abs(copying[:, 0].mean() - 0.2) < 0.02 and abs(copying.mean() - 0.2) < 0.01
    stayed = int((copying[:, :-1] & copying[:, 1:]).sum())
    flips = int((copying[:, :-1] & ~copying[:, 1:]).sum())
    assert abs(flips / (stayed + flips) - 0.08) < 0.005
    for bad in (dict(p_start=0.0, p_stop=0.1), dict(p_start=0.1, p_stop=1.5),
                dict(p_start=0.1, p_stop=0.1, copy_alpha=2)):
        with pytest.raises(ValueError, match="CopyPhases"):
            CopyPhases(**bad)


def test_a_seed_fixes_the_text_whatever_the_arm():
    """Common random numbers: a token's draft is decided by the text's uniform for it, so on one seed a deeper chain
    accepts every token a shallower one accepts, and a run repeats exactly."""
    text = BatchText.draw(StaticBatch("b", [0.5] * 6, budget=40, copy_phases=CopyPhases(0.1, 0.2)),
                          np.random.default_rng(3))
    rows, emitted = np.arange(6), np.array([0, 3, 7, 11, 20, 39])
    short, deep = text.reach(Strategy(2, 1, 3), rows, emitted), text.reach(Strategy(5, 1, 6), rows, emitted)
    assert (np.minimum(deep, 2) == short).all() and (deep >= short).all()
    assert (text.reach(Strategy.off(), rows, emitted) == 0).all()
    batch = ngram_tail_batch(seed=1)
    picks = [Strategy.parse(a) for a in ("off", "s2k1v3", "s5k4v16")]
    mixed = lambda b: picks[b % 3]  # noqa: E731
    assert run_static_batch(batch, mixed, seed=5) == run_static_batch(batch, mixed, seed=5)
    assert run_static_batch(batch, mixed, seed=5) != run_static_batch(batch, mixed, seed=6)


def test_the_text_decides_copy_phases_by_token():
    """A request copying from its first token for good (p_stop tiny) accepts at copy_alpha throughout; the phases lie
    on token positions, the same for every arm."""
    text = BatchText.draw(StaticBatch("b", [0.0, 0.0], budget=9, copy_phases=CopyPhases(1.0, 1e-12, copy_alpha=1.0)),
                          np.random.default_rng(0))
    assert text.alpha.shape == (2, 10) and (text.alpha == 1.0).all()
    plain = BatchText.draw(StaticBatch("b", [0.25, 0.5], budget=9), np.random.default_rng(0))
    assert (plain.alpha == np.array([[0.25], [0.5]])).all()


def test_requests_always_copying_accept_at_copy_alpha():
    """Every request copying for good (p_start = 1, copy_alpha = 1) accepts every draft: a 2-deep chain emits 3 tokens
    a step, so 9 tokens take 3 steps whatever the requests' own (zero) acceptance."""
    chain = Strategy(2, 1, 3)
    phases = CopyPhases(p_start=1.0, p_stop=1e-12, copy_alpha=1.0)
    batch = StaticBatch("b", [0.0, 0.0], budget=9, copy_phases=phases, first_step_s=0.0)
    assert run_static_batch(batch, lambda b: chain) == pytest.approx(3 * SMALL_MODEL_COST(chain, 2))
    without = StaticBatch("b", [0.0, 0.0], budget=9, first_step_s=0.0)
    assert run_static_batch(without, lambda b: chain) == pytest.approx(9 * SMALL_MODEL_COST(chain, 2))


def test_the_ngram_tail_batch_favours_a_deep_tree_over_plain_decoding():
    """Copy phases carry the long request: every static speculative arm beats plain decoding, the deep tree most."""
    batch = ngram_tail_batch(seed=0)
    assert max(batch.budgets) == 256 and np.median(batch.budgets) < 64
    seconds = {a: np.mean([run_static_batch(batch, lambda b, a=a: Strategy.parse(a), seed=s) for s in range(4)])
               for a in ("off", "s2k1v3", "s5k4v16")}
    assert seconds["s5k4v16"] < seconds["s2k1v3"] < seconds["off"]


def test_a_loss_budget_told_the_rollouts_length_holds_an_eagle_like_batch_near_plain():
    """EAGLE-like acceptance (Beta(2, 3) per request) at B = 16, where plain decoding is the best arm: the cost policy
    alone loses 5-9% to its plays of drafting arms; with a 2% loss budget told the rollout's length (as the engine
    tells it) every seed stays within the budget and one step's worst case, and the mean is better. The first step
    carries the prefill's gap (FIRST_STEP_S): a budget that took its plain step time from it credited every draft
    with a gain (0.78-0.84 of plain decoding on the suite's EAGLE-like batches)."""
    batch = [b for b in static_batches((16,)) if "eagle-like" in b.name][0]
    arms = tuple(Strategy.parse(a) for a in ("off", "s2k1v3", "s4k1v5", "s5k4v16"))
    table = CostTable({a: [(b, batch.cost(a, b)) for b in (1, 4, 16)] for a in arms})
    ratios = {None: [], 0.02: []}
    for seed in range(3):
        plain = run_static_batch(batch, lambda b: Strategy.off(), seed=seed)
        for budget in ratios:
            sel = StrategySelector(arms, seed=seed, cost_table=table, loss_budget=budget)
            sel.new_rollout(max_tokens=batch.budget)
            ratios[budget].append(plain / run_static_batch(batch, sel.select, selector_observer(sel),
                                                           lagging_feedback, seed))
    assert min(ratios[0.02]) >= 0.975, ratios
    assert np.mean(ratios[0.02]) > np.mean(ratios[None]) + 0.02, ratios


def test_counterfactual_counts_are_each_arms_reach_on_the_same_text_once_known():
    """Under plain decoding every request emits one token a step, so the counts handed over for arm ``a`` drafted at
    step ``t`` are ``a``'s reach at token ``t - 1`` of every request, through the feedback rule, ``num_steps`` steps
    later (counts still held at the end are dropped)."""
    from tlt_kernels.runtime.simulate import CounterfactualDelay

    short, deep = Strategy(2, 1, 3), Strategy(4, 1, 5)

    class Recorder:
        strategies = (Strategy.off(), short, deep)

        def __init__(self):
            self.got = []

        def observe_counterfactual(self, strategy, batch_size, counts, accepted_rows=None):
            self.got.append((strategy, batch_size, list(counts), accepted_rows))

    batch, budget, seed = StaticBatch("b", [0.6, 0.3, 0.9], budget=8), 8, 3
    recorder = Recorder()
    run_static_batch(batch, lambda b: Strategy.off(), seed=seed, counterfactual=CounterfactualDelay(recorder))
    text = BatchText.draw(batch, np.random.default_rng(np.random.SeedSequence(seed).spawn(2)[0]))
    rows, left = np.arange(3), np.full(3, budget)
    expected = {}
    for t in range(budget):
        done = np.full(3, t)
        for arm in (short, deep):
            if t + 1 + arm.num_steps <= budget:  # known by the last step
                counts, lagging = lagging_feedback(text.reach(arm, rows, done), left - t, arm.num_steps)
                expected.setdefault(t + 1 + arm.num_steps, []).append((arm, 3, counts, lagging))
    assert recorder.got == [item for step in sorted(expected) for item in expected[step]]
    assert len(recorder.got) == (budget - 2) + (budget - 4)
