"""Deferred drafter commits (``SpeculativeEngine(lazy_commit_steps=)``, :mod:`tlt_kernels.engine.backlog`).

A plain step of a lazy drafter leaves the drafter alone; the drafter learns the backlog before its next draft or
when the backlog is full. Checked: the backlog's stash/take arithmetic; a scripted run of plain and drafting steps
gives the same tokens, the same drafts (per-step accepted lengths) and the same n-gram histories as committing every
step, with separate and fused steps and a backlog small enough to fill; a static plain engine commits only when the
backlog is full; drafters that do not allow it and ``lazy_commit_steps=0`` keep committing every step."""
import itertools

import pytest
import torch

from conftest import ragged_prompts
from tlt_kernels.drafter import EagleDrafter, NGramRolloutDrafter
from tlt_kernels.drafter.base import DrafterBase, ProposedTree
from tlt_kernels.engine import SpeculativeEngine
from tlt_kernels.engine.backlog import DrafterBacklog
from tlt_kernels.models import reference_generate
from tlt_kernels.runtime import GraphPool, Strategy, StrategySelector
from tlt_kernels.runtime.graph_pool import FakeGraphBackend
from tlt_kernels.tree import chain_parents

MAX_NEW = [30, 22, 9, 26]
ARMS = [Strategy(2, 1, 3), Strategy(4, 1, 5)]
# Plain stretches of several lengths between drafting steps (the cycle repeats through the rollout).
SCRIPT = [Strategy.off()] * 3 + [ARMS[1]] + [Strategy.off()] * 5 + [ARMS[0], ARMS[1]] + [Strategy.off()]


@pytest.fixture(scope="module")
def prompts():
    return ragged_prompts(len(MAX_NEW), seed=1, first=6, step=3)


def _scripted():
    """A selector whose decisions follow SCRIPT, whatever it has learnt."""
    script = itertools.cycle(SCRIPT)
    return StrategySelector(ARMS, seed=0, decision_hook=lambda strategy, batch_size: next(script))


def _engine(target, drafter, lazy_commit_steps, fuse=False, step_kernel=None):
    pool = GraphPool(backend=FakeGraphBackend(lambda key: 0), warmup_iters=1)
    eng = SpeculativeEngine(target, drafter, _scripted(), pool, max_batch_size=4, max_seq_len=64, fuse_step=fuse,
                            lazy_commit_steps=lazy_commit_steps, step_kernel=step_kernel)
    eng.capture_graphs([2, 4])
    assert eng.graph_error is None, eng.graph_error
    return eng


def test_backlog_takes_each_rows_tokens_since_its_first_step():
    """Rows of later steps are a subset of the first step's; a row's tokens are those it emitted since the first
    step (none more once finished or failed); take returns them from the output, with the stashed features, in
    order, and empties the backlog."""
    backlog = DrafterBacklog(6, 4, 3, torch.float32, "cpu", features=True)
    output = torch.arange(60).view(6, 10)  # row b's token at column j: 10 * b + j
    generated = torch.tensor([0, 3, 5, 0, 2, 0])  # rows 1, 2, 4 start at 3, 5, 2 tokens
    rows = torch.tensor([4, 1, 2])
    hidden = lambda b, t: torch.full((b, 3), float(t))  # noqa: E731

    def step(step_rows, counts, t):
        generated[step_rows] += counts
        backlog.stash(step_rows, hidden(len(step_rows), t), generated, counts)

    step(rows, torch.tensor([1, 1, 1]), 0)
    step(rows, torch.tensor([1, 0, 1]), 1)  # row 1 failed or finished
    step(torch.tensor([4, 2]), torch.tensor([1, 0]), 2)  # row 2 finished before this step (rides along)
    assert backlog.size == 3 and not backlog.full
    taken, path = backlog.take(output, generated)
    assert taken.tolist() == [4, 1, 2] and backlog.size == 0 and backlog.rows is None
    assert path.num_new.tolist() == [3, 1, 2]
    assert backlog.widths == [1, 2, 4] and path.tokens.shape == (3, 4)  # 3 steps: padded to the width 4
    assert path.tokens[0, :3].tolist() == [42, 43, 44] and path.tokens[1, :1].tolist() == [13]
    assert path.tokens[2, :2].tolist() == [25, 26]
    assert path.hidden.shape == (3, 4, 3) and path.hidden[0, :3, 0].tolist() == [0.0, 1.0, 2.0]
    with pytest.raises(RuntimeError, match="nothing is stashed"):
        backlog.take(output, generated)


def test_a_full_backlog_refuses_another_stash():
    backlog = DrafterBacklog(2, 1, 3, torch.float32, "cpu", features=False)
    one = torch.ones(1, dtype=torch.int64)
    backlog.stash(torch.tensor([0]), torch.zeros(1, 3), torch.tensor([4, 0]), one)
    assert backlog.full and backlog.hidden is None
    with pytest.raises(RuntimeError, match="full"):
        backlog.stash(torch.tensor([0]), torch.zeros(1, 3), torch.tensor([5, 0]), one)


def _histories(eng, batch):
    """Each request's n-gram history (valid part) after a fused rollout (the persistent buffers stay)."""
    ngram = eng.tree_drafter
    lengths = ngram.persistent.lengths[:batch].tolist()
    return [ngram.persistent.buffer[b, :n].tolist() for b, n in enumerate(lengths)]


@pytest.mark.parametrize("fuse,step_kernel", [(False, None), (True, None), (True, True)],
                         ids=["separate", "fused", "fused-step-kernel"])
@pytest.mark.parametrize("lazy_commit_steps", [2, 32])
def test_lazy_ngram_commits_equal_eager_ones(target, prompts, fuse, step_kernel, lazy_commit_steps):
    """Same tokens and the same drafts (every step's strategy and accepted length) as an engine whose drafter
    commits every step; greedy tokens are plain decoding's. Fused, each history holds the request's prompt and
    tokens (the plain steps after the last draft were never needed, so they may be missing at its end; a drafting
    step's commit may run past the budget, as without deferral)."""
    lazy = _engine(target, NGramRolloutDrafter(), lazy_commit_steps, fuse, step_kernel)
    eager = _engine(target, NGramRolloutDrafter(), 0, fuse, step_kernel)
    assert lazy.backlog is not None and eager.backlog is None
    out_lazy, out_eager = lazy.generate(prompts, MAX_NEW), eager.generate(prompts, MAX_NEW)
    assert out_lazy.tokens == out_eager.tokens
    assert [(s.strategy, s.batch_size, s.emitted) for s in out_lazy.steps] == \
        [(s.strategy, s.batch_size, s.emitted) for s in out_eager.steps]
    assert any(s.strategy != "off" and s.emitted > s.batch_size for s in out_lazy.steps)  # drafts were accepted
    ref = reference_generate(target, prompts, max(MAX_NEW))
    assert all(out_lazy.tokens[b] == ref.tokens[b, :n].tolist() for b, n in enumerate(MAX_NEW))
    if fuse:
        for history, prompt, tokens in zip(_histories(lazy, len(MAX_NEW)), prompts, out_lazy.tokens):
            n = min(len(history), len(prompt) + len(tokens))
            assert len(prompt) < n and history[:n] == (list(prompt) + tokens)[:n]


def test_lazy_eagle_commits_equal_eager_ones(target, prompts):
    """The EAGLE layer learns a backlog in one forward instead of one per token: the same drafts (fp32) and plain
    decoding's greedy tokens."""
    outs = []
    for steps in (3, 0):
        torch.manual_seed(0)  # the same drafter weights
        eng = _engine(target, EagleDrafter.for_target(target), steps, fuse=True)
        outs.append(eng.generate(prompts, MAX_NEW))
    assert outs[0].tokens == outs[1].tokens
    assert [(s.strategy, s.emitted) for s in outs[0].steps] == [(s.strategy, s.emitted) for s in outs[1].steps]


def test_lazy_union_commits_equal_eager_ones(target, prompts):
    """A union of two drafters that defer (EAGLE and n-gram, the GRPO suite's) defers too: the same drafts and
    tokens as committing every step."""
    outs = []
    for steps in (3, 0):
        torch.manual_seed(0)
        eng = _engine(target, [EagleDrafter.for_target(target), NGramRolloutDrafter()], steps, fuse=True)
        assert (eng.backlog is not None) == (steps > 0) and (steps == 0 or eng.backlog.hidden is not None)
        outs.append(eng.generate(prompts, MAX_NEW))
    assert outs[0].tokens == outs[1].tokens
    assert [(s.strategy, s.emitted) for s in outs[0].steps] == [(s.strategy, s.emitted) for s in outs[1].steps]


def test_a_static_plain_engine_commits_only_a_full_backlog(target, prompts, monkeypatch):
    """Steps of the off arm with a lazy drafter: no commit until the backlog is full (every 4th plain step here)."""
    eng = SpeculativeEngine(target, "ngram", Strategy.off(), max_batch_size=4, max_seq_len=64, overlap_steps=False,
                            lazy_commit_steps=4)
    commits = []
    real = eng.tree_drafter.commit
    monkeypatch.setattr(eng.tree_drafter, "commit", lambda *a, **k: (commits.append(a[2].tokens.shape[1]),
                                                                     real(*a, **k)))
    out = eng.generate(prompts, MAX_NEW)
    assert commits == [4] * ((len(out.steps) - 1) // 4)


class ChainOfZeros(DrafterBase):
    """A custom drafter that does not declare ``lazy_commit``: it proposes chains of token 0."""

    def tree_width(self, strategy):
        return 1 if strategy.is_off else 1 + strategy.num_steps

    def propose(self, strategy, rows, state_rows, graphs):
        k = strategy.num_steps
        return ProposedTree(torch.zeros(rows.shape[0], k + 1, dtype=torch.int64),
                            chain_parents(rows.shape[0], k + 1, rows.device),
                            torch.full((rows.shape[0],), k + 1, dtype=torch.int32))


def test_drafters_that_do_not_allow_it_commit_every_step(target, prompts):
    """A custom drafter without ``lazy_commit``, a union with one, and ``lazy_commit_steps=0`` keep no backlog (and
    the custom drafter's engine still decodes greedily as plain decoding); a bad value is named."""
    custom = SpeculativeEngine(target, ChainOfZeros(), _scripted(), max_batch_size=4, max_seq_len=64)
    assert custom.backlog is None
    ref = reference_generate(target, prompts, max(MAX_NEW))
    out = custom.generate(prompts, MAX_NEW)
    assert all(out.tokens[b] == ref.tokens[b, :n].tolist() for b, n in enumerate(MAX_NEW))
    union = SpeculativeEngine(target, [ChainOfZeros(), NGramRolloutDrafter()], _scripted(), max_batch_size=4,
                              max_seq_len=64)
    assert union.backlog is None
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="lazy_commit_steps"):
            SpeculativeEngine(target, "ngram", _scripted(), max_batch_size=4, max_seq_len=64, lazy_commit_steps=bad)
