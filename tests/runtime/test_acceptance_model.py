"""The cost policy's shared acceptance model alone: groups, prior, fitting, the own-count fallback, forgetting."""
import math
import random

import pytest

from tlt_kernels.runtime import Strategy
from tlt_kernels.runtime.policies import SharedAcceptanceModel
from tlt_kernels.runtime.policies.acceptance_model import LEVEL_PRIOR_VAR, candidates_per_level, cloglog

OFF, CHAIN2, CHAIN4, TREE = Strategy.off(), Strategy(2, 1, 3), Strategy(4, 1, 5), Strategy(4, 4, 13)
ARMS = [OFF, CHAIN2, CHAIN4, TREE]


def _model(prior=0.7, ucb=0.0, **kw):
    args = dict(window=32, prior_accept=prior, model_sd=0.1, offset_prior=0.5, offset_mean=1.0, ucb=ucb)
    args.update(kw)
    return SharedAcceptanceModel(ARMS, **args)


def _observe(model, arm, accepted, batch_size, step):
    """One observed step of ``arm``, in the order the cost policy runs it."""
    own = model.own_weight(arm, step)
    sum_w, sum_wr, *_ = model.score_positions(arm, accepted, batch_size, step, own)
    model.grow_level_variance(step)
    if sum_w > 0:
        model.fit_level(arm, sum_w, sum_wr)
    model.add_own_counts(arm, accepted, batch_size, step, own)
    model.refresh_all(step)


def test_arms_of_equal_width_share_a_group_and_start_at_the_width_bound():
    model = _model()
    assert model.group[0] == -1 and model.group[1] == model.group[2] != model.group[3]
    assert candidates_per_level(TREE) == 3.0
    assert model.width_offset[model.group[3]] == pytest.approx(math.log(3.0))
    assert model.width_offset[model.group[1]] == 0.0
    assert _model(offset_mean=0.0).width_offset == [0.0, 0.0]


def test_the_prior_predicts_prior_accept_per_position_of_a_chain():
    model = _model(prior=0.6)
    assert model.alphas(2, 0) == pytest.approx([0.6] * 4)
    assert model.tokens[2] == pytest.approx(1 + 0.6 + 0.6 ** 2 + 0.6 ** 3 + 0.6 ** 4)
    assert model.tokens[0] == 1.0  # plain decoding emits one token
    tree = model.alphas(3, 0)
    assert tree == pytest.approx([1 - 0.4 ** 3] * 4)  # three independent candidates per level


def test_fitting_moves_the_level_and_with_it_every_arm():
    model = _model(prior=0.8)
    rng = random.Random(0)
    for step in range(1, 101):
        reach, accepted = 64, []
        for _ in range(4):
            reach = sum(rng.random() < 0.4 for _ in range(reach))
            accepted.append(float(reach))
        _observe(model, 2, accepted, 64, step)
    # Level and the chains' offset are identified only jointly (one arm played): their sum is what is learned.
    assert model.level + model.width_offset[model.group[2]] == pytest.approx(cloglog(0.4), abs=0.1)
    assert model.level < cloglog(0.8) - 0.5  # the level took most of the change
    assert model.alphas(1, 100) == pytest.approx([0.4, 0.4], abs=0.05)  # never played: moved with the model
    assert model.alphas(2, 100) == pytest.approx([0.4] * 4, abs=0.05)
    assert model.alphas(3, 100)[0] < 1 - 0.2 ** 3  # the tree moved down too


def test_score_positions_counts_the_draft_tokens_tried_and_accepted():
    model = _model()
    *_, trials, hits, expected = model.score_positions(2, [6.0, 3.0, 1.0, 0.0], 8, 1, own=1.0)
    assert trials == 8 + 6 + 3 + 1 and hits == 10
    assert expected == pytest.approx(0.7 * trials, rel=1e-6)  # no own counts yet: the prior's rate


def test_refresh_equals_the_readable_product_of_alphas():
    model = _model(ucb=0.0)
    _observe(model, 2, [5.0, 4.0, 2.0, 1.0], 8, 1)
    for a in (1, 2, 3):
        reach, total = 1.0, 1.0
        for alpha in model.alphas(a, 1):
            reach *= alpha
            total += reach
        assert model.tokens[a] == pytest.approx(total, rel=1e-9)
    assert _model(ucb=1.0).tokens[3] > _model(ucb=0.0).tokens[3]  # optimism raises an uncertain offset


def test_observed_tokens_are_the_fallback_without_accepted_counts():
    model = _model()
    model.add_observed_tokens(2, 3.0, step=1)
    assert model.tokens[2] == 3.0
    model.add_observed_tokens(2, 1.0, step=2)
    assert model.tokens[2] == pytest.approx((1 - 1 / 32) * 3.0 + 1.0 / 32)
    model.refresh(2, 2)
    assert model.tokens[2] == pytest.approx((1 - 1 / 32) * 3.0 + 1.0 / 32)


def test_forget_keeps_the_offsets_and_resets_the_level_variance():
    model = _model()
    _observe(model, 3, [8.0, 6.0, 4.0, 2.0], 8, 1)
    offsets, before = list(model.width_offset), [list(r) for r in model.own_accepts]
    model.add_observed_tokens(1, 2.0, step=1)
    assert model.cov[0][0] < LEVEL_PRIOR_VAR
    model.forget(0.5)
    assert model.cov[0][0] == LEVEL_PRIOR_VAR and model.width_offset == offsets
    assert model.own_accepts == [[0.5 * x for x in r] for r in before]
    assert model.observed_tokens == [None] * len(ARMS)


def test_the_level_variance_grows_between_fits_up_to_its_prior():
    model = _model()
    _observe(model, 2, [5.0, 4.0, 2.0, 1.0], 8, 1)
    fitted = model.cov[0][0]
    assert model.model_variance(11) == pytest.approx(0.01 + fitted / (1 - 1 / 32) ** 10)
    model.grow_level_variance(10_000)
    assert model.cov[0][0] == LEVEL_PRIOR_VAR and model.model_variance(10_000) == pytest.approx(0.01 + 1.0)
