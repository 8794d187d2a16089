"""CPU cost of ``select + update`` (pytest-benchmark), checked against a readable reference.

The timed loop runs the optimized code paths (cached per-batch-size tables in ``choose``, one pass over
positions in ``observe``, the fast path of ``update``); the same observation stream replayed through a
reference policy that recomputes every prediction from the readable formulas (``SharedAcceptanceModel.alphas``,
``CostModelPolicy.predict``) must make the same decisions. Timing claims live in the benchmark (median reported by
pytest-benchmark and by ``python -m bench selector``), not in assertions.
"""
import math

import pytest

from tlt_kernels.runtime import POLICIES, CostTable, Strategy, StrategySelector
from tlt_kernels.runtime.policies import CostModelPolicy
from tlt_kernels.runtime.policies.acceptance_model import UNPLAYED_DRIFT, SharedAcceptanceModel
from tlt_kernels.runtime.simulate import DEFAULT_ARMS, StepCost

SIZES = (1, 16, 64, 256)


class _ReferenceAcceptance(SharedAcceptanceModel):
    """Same model, every arm's tokens recomputed from the readable formulas (:meth:`alphas`)."""

    def refresh(self, a, step, var=None, conditional_var=None):  # recomputes both from the formulas
        if self.depth[a] == 0:
            return
        if self.observed_tokens[a] is not None:
            self.tokens[a] = self.observed_tokens[a]
            return
        cov, i = self.cov, self.group[a] + 1
        offset_var = max(cov[i][i] - cov[0][i] ** 2 / cov[0][0], 0.0)
        u = self.ucb * math.sqrt(min(offset_var + UNPLAYED_DRIFT * (step - self.t_arm[a]), self.offset_var_prior))
        reach = total = 1.0
        for alpha in self.alphas(a, step, u):
            reach *= alpha
            total += reach
        self.tokens[a] = total


class _ReferenceCost(CostModelPolicy):
    """Same model, every prediction recomputed from the readable formulas (:meth:`predict`)."""

    def _make_acceptance_model(self, arms, window):
        return _ReferenceAcceptance(arms, window, self.prior_accept, self.model_sd, self.offset_prior,
                                    self.offset_mean, self.ucb)

    def choose(self, bucket, batch_size, allowed, step):
        if self.riding in allowed:  # the last step accepted every draft (ride_runs): the same arm again
            return self.riding
        for a in allowed:
            if self.predict(bucket, a, batch_size) is None:
                return a
        # A never-played speculative arm is played once, the best predicted first, if it brings the model a
        # new width group or depth (or always, without explore_per_group), or if it predicts within
        # explore_margin of the best arm; otherwise the best prediction wins.
        group = self.acceptance.group
        played = [b for b in range(len(self.arms)) if self.depth[b] and self.played[b]]
        groups = {group[b] for b in played}
        deepest = max((self.depth[b] for b in played), default=0)
        unplayed = [a for a in allowed if self.depth[a] and not self.played[a]]
        new = [a for a in unplayed if not self.explore_per_group or group[a] not in groups or self.depth[a] > deepest]
        predict = lambda a: self.predict(bucket, a, batch_size)  # noqa: E731
        if new:
            return max(new, key=predict)
        best = max(allowed, key=predict)
        near = max(unplayed, key=predict, default=None)
        if near is not None and predict(near) >= (1.0 - self.explore_margin) * predict(best):
            return near
        return best


def _table():
    cost = StepCost()
    return CostTable({s: [(b, cost(s, b)) for b in SIZES] for s in DEFAULT_ARMS})


def _observation(i, s, b):
    """A deterministic, varied stream: acceptance drifts up and down so the model keeps moving."""
    p = 0.55 + 0.35 * math.sin(i / 40.0)
    acc, reach = [], float(b)
    for _ in range(s.num_steps):
        reach = float(int(reach * p + 0.5))
        acc.append(reach)
    return b + sum(acc), StepCost()(s, b) * (1.0 + 0.01 * ((i * 7) % 5)), acc if s.num_steps else None


def _stepper(sel, steps=1700):
    """``step()`` = one ``select`` + ``update``; observations are precomputed so only the selector is timed."""
    obs = [[_observation(i, s, SIZES[i & 3]) for s in sel.strategies] for i in range(steps + 1)]
    index = {s: a for a, s in enumerate(sel.strategies)}
    state = {"i": 0, "picks": []}
    picks = state["picks"]

    def step():
        i = state["i"] = state["i"] + 1
        b = SIZES[i & 3]
        s = sel.select(b)
        em, el, acc = obs[i][index[s]]
        sel.update(s, b, em, el, acc)
        picks.append(s)

    return step, picks


def test_select_plus_update_cost_matches_reference(benchmark):
    sel = StrategySelector(DEFAULT_ARMS, cost_table=_table(), seed=0)
    step, picks = _stepper(sel)
    benchmark.pedantic(step, rounds=1500, iterations=1, warmup_rounds=100)
    ref = StrategySelector(DEFAULT_ARMS, policy=_ReferenceCost(cost_table=_table()), seed=0)
    ref_step, ref_picks = _stepper(ref)
    for _ in range(len(picks)):
        ref_step()
    assert picks == ref_picks
    assert len(set(picks)) >= 3  # the stream exercises several arms, not one
    for a in range(len(DEFAULT_ARMS)):
        assert sel.policy.tokens[a] == pytest.approx(ref.policy.tokens[a], rel=1e-9)


@pytest.mark.parametrize("policy", sorted(set(POLICIES) - {"cost"}))
def test_select_plus_update_other_policies(policy, benchmark):
    sel = StrategySelector(DEFAULT_ARMS, policy=policy, seed=0)
    step, picks = _stepper(sel)
    benchmark.pedantic(step, rounds=1000, iterations=1, warmup_rounds=50)
    again = StrategySelector(DEFAULT_ARMS, policy=policy, seed=0)
    step2, picks2 = _stepper(again)
    for _ in range(len(picks)):
        step2()
    assert picks == picks2 and set(picks) <= set(sel.strategies)


def test_fast_path_equals_queued_path():
    """Plain numbers take the fast path of ``update``; the same values wrapped as pending handles take the
    queue; both must fold in identically."""
    from tlt_kernels.runtime import CallbackValue

    a = StrategySelector(DEFAULT_ARMS, cost_table=_table(), seed=0)
    b = StrategySelector(DEFAULT_ARMS, cost_table=_table(), seed=0)
    for i in range(300):
        bs = SIZES[i & 3]
        s, s2 = a.select(bs), b.select(bs)
        assert s == s2
        em, el, acc = _observation(i, s, bs)
        a.update(s, bs, em, el, acc)
        b.update(s, bs, CallbackValue(lambda em=em: em), el, None if acc is None else tuple(acc))
    assert b.observe_ready() == 0 and a.policy.tokens == b.policy.tokens
    with pytest.raises(ValueError, match="elapsed_s"):
        a.update(Strategy.off(), 4, 4, 0.0)
