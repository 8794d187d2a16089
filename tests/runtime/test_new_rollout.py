"""``new_rollout``: the engine tells the selector that a new batch starts, and the cost policy forgets part of the
acceptance counts its last batch's lagging requests left (``keep_on_rollout``), returns the shared level to its prior
(``prior_level_on_rollout``) and probes once per bucket when it would decode plainly (``probe_on_rollout``)."""
import pytest

from tlt_kernels.runtime.policies.acceptance_model import LEVEL_PRIOR_VAR, cloglog

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
    kept, plain = (_selector(keep_on_rollout=1.0, probe_on_rollout=False, prior_level_on_rollout=False)
                   for _ in range(2))
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


def _settled_on_plain(**kw):
    """A selector whose dry rollout (speculative steps at their table times, accepting nothing) left it on plain
    decoding, nothing forgotten at the new rollout."""
    sel = _selector(**{"keep_on_rollout": 1.0, "prior_level_on_rollout": False, **kw})
    seconds = {s: t[0][1] for s, t in TABLE.items()}
    for _ in range(60):
        s = sel.select(1)
        sel.update(s, 1, 1, seconds[s], [0] * s.num_steps if s.num_steps else None)
    assert sel.policy.plain_run[0] >= 3 and sel.select(1).is_off  # in a plain-decoding run, past any probe
    return sel


def test_a_new_rollout_probes_once_where_the_selector_decodes_plainly():
    sel = _settled_on_plain()
    sel.new_rollout()
    probe = sel.select(1)
    assert probe.num_steps > 0  # the new requests' drafts are seen at once, not probe_every steps later
    sel.update(probe, 1, 1, TABLE[probe][0][1], [0] * probe.num_steps)
    assert [sel.select(1).is_off for _ in range(3)] == [True] * 3  # one probe, then the model's choice
    quiet = _settled_on_plain(probe_on_rollout=False)
    quiet.new_rollout()
    assert quiet.select(1).is_off
    for bad in (1, None, "yes"):
        with pytest.raises(ValueError, match="probe_on_rollout"):
            CostModelPolicy(probe_on_rollout=bad)


def test_new_rollout_returns_the_level_to_its_prior_and_keeps_the_offsets():
    sel = _selector()
    _dry_rollout(sel)
    model = sel.policy.acceptance
    assert model.level < cloglog(0.7) - 1.0  # the dry rollout pulled the level down
    offsets, depth_offsets = list(model.width_offset), list(model.depth_offset)
    sel.new_rollout()
    assert model.level == pytest.approx(cloglog(sel.policy.prior_accept))
    assert model.cov[0][0] >= LEVEL_PRIOR_VAR
    assert model.width_offset == offsets and model.depth_offset == depth_offsets
    kept = _selector(prior_level_on_rollout=False)
    _dry_rollout(kept)
    level = kept.policy.acceptance.level
    kept.new_rollout()
    assert kept.policy.acceptance.level == level
    for bad in (1, None, "yes"):
        with pytest.raises(ValueError, match="prior_level_on_rollout"):
            CostModelPolicy(prior_level_on_rollout=bad)


def test_a_warm_selector_drafts_for_new_requests_that_accept():
    """After a dry batch that left it on plain decoding, the new batch's requests accept every draft: with the level
    back at its prior the selector drafts from the first steps; with the dry batch's level it decodes plainly
    between probes."""
    def speculative_steps(**kw):
        sel = _settled_on_plain(probe_on_rollout=False, **kw)
        sel.new_rollout()
        picks = []
        for _ in range(8):
            s = sel.select(1)
            picks.append(s.num_steps > 0)
            sel.update(s, 1, 1 + s.num_steps, TABLE[s][0][1], [1] * s.num_steps if s.num_steps else None)
        return sum(picks)

    assert speculative_steps(prior_level_on_rollout=True) == 8
    assert speculative_steps() == 0
