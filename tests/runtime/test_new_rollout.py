"""``new_rollout``: the engine tells the selector that a new batch starts, and the cost policy forgets part of the
acceptance counts its last batch's lagging requests left (``keep_on_rollout``)."""
import pytest

from tlt_kernels.runtime import Strategy, StrategySelector
from tlt_kernels.runtime.policies import CostModelPolicy, Policy

ARMS = [Strategy.parse("s2k1v3"), Strategy.parse("s4k1v5")]
TABLE = {Strategy.off(): [(1, 1e-3)], ARMS[0]: [(1, 1.1e-3)], ARMS[1]: [(1, 1.15e-3)]}


def _selector(**kw):
    return StrategySelector(ARMS, seed=0, cost_table=TABLE, **kw)


def _dry_rollout(sel, steps=40):
    """Speculative steps at B = 1 that accept nothing: the selector's acceptance falls."""
    for _ in range(steps):
        s = sel.select(1)
        sel.update(s, 1, 1, 1e-3, [0] * s.num_steps if s.num_steps else None)


def test_new_rollout_forgets_counts_and_raises_the_prediction():
    sel = _selector()
    _dry_rollout(sel)
    before = list(sel.policy.tokens)
    trials = [list(t) for t in sel.policy.acceptance.own_trials]
    sel.new_rollout()
    sel.select(1)  # predictions are recomputed at the next choice
    for a, t in enumerate(sel.policy.acceptance.own_trials):
        assert t == pytest.approx([x * 0.5 for x in trials[a]])
    spec = [a for a, s in enumerate(sel.strategies) if s.num_steps]
    assert all(sel.policy.tokens[a] > before[a] for a in spec)


def test_keep_on_rollout_one_changes_nothing_and_bad_values_name_the_option():
    kept, plain = _selector(keep_on_rollout=1.0), _selector(keep_on_rollout=1.0)
    _dry_rollout(kept)
    _dry_rollout(plain)
    kept.new_rollout()
    assert [kept.select(1) for _ in range(5)] == [plain.select(1) for _ in range(5)]
    assert kept.policy.tokens == plain.policy.tokens
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="keep_on_rollout"):
            CostModelPolicy(keep_on_rollout=bad)


def test_new_rollout_ends_a_ride():
    sel = _selector()
    s = sel.select(1)
    sel.update(s, 1, 1 + s.num_steps, 1e-3, [1] * s.num_steps)  # every draft accepted: the arm rides
    assert sel.policy.riding >= 0
    sel.new_rollout()
    assert sel.policy.riding == -1


def test_a_policy_without_its_own_new_rollout_inherits_a_no_op():
    class Fixed(Policy):
        def choose(self, bucket, batch_size, allowed, step):
            return allowed[-1]

        def observe(self, *args, **kwargs):
            pass

    sel = StrategySelector(ARMS, policy=Fixed())
    sel.new_rollout()
    assert sel.select(4) == ARMS[-1]
