"""The engine's counterfactual counts (tlt_kernels.engine.counterfactual): every drafting arm scored at every step from
the n-gram drafter's histories, for the counterfactual policy. CPU: the scorer against a direct recomputation, the
tree match against a walk, and greedy identity of an engine that feeds them (separate and fused steps)."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import ragged_prompts
from tlt_kernels.drafter import EagleDrafter, NGramRolloutDrafter
from tlt_kernels.drafter.ngram_drafter import NGramDrafter
from tlt_kernels.engine import SpeculativeEngine
from tlt_kernels.engine.counterfactual import CounterfactualScorer, tree_reach
from tlt_kernels.models import reference_generate
from tlt_kernels.runtime import GraphPool, Strategy, StrategySelector
from tlt_kernels.runtime.graph_pool import FakeGraphBackend

MAX_NEW = [5, 23, 9, 30, 3, 17, 1]
ARMS = [Strategy(2, 1, 3), Strategy(4, 1, 5), Strategy(3, 2, 7)]


def _walk_reach(tokens, parents, num_nodes, continuation):
    """The deepest node whose root path spells a prefix of ``continuation`` (host lists)."""
    best = 0
    for node in range(1, num_nodes):
        path, at = [], node
        while at > 0:
            path.append(tokens[at])
            at = parents[at]
        path.reverse()
        if len(path) <= len(continuation) and path == continuation[:len(path)]:
            best = max(best, len(path))
    return best


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_tree_reach_is_the_deepest_matching_root_path(data):
    rows, nodes, depth = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 9)), data.draw(st.integers(1, 4))
    tokens, parents, counts, continuations = [], [], [], []
    for _ in range(rows):
        row_parents = [-1] + [data.draw(st.integers(0, i - 1)) for i in range(1, nodes)]
        tokens.append(data.draw(st.lists(st.integers(0, 3), min_size=nodes, max_size=nodes)))
        parents.append(row_parents)
        counts.append(data.draw(st.integers(1, nodes)))
        continuations.append(data.draw(st.lists(st.integers(0, 3), min_size=depth, max_size=depth)))
    reach = tree_reach(torch.tensor(tokens), torch.tensor(parents, dtype=torch.int32),
                       torch.tensor(counts, dtype=torch.int32), torch.tensor(continuations))
    assert reach.tolist() == [_walk_reach(*row) for row in zip(tokens, parents, counts, continuations)]


def test_the_scorer_counts_the_drafts_of_the_history_before_its_last_tokens():
    """Against a direct recomputation: a fresh n-gram drafter on each history without its last ``num_steps`` tokens,
    its trees matched against those tokens; only lagging rows whose scored tokens follow the prompt count."""
    generator = torch.Generator().manual_seed(0)
    histories = torch.randint(0, 5, (5, 40), generator=generator)  # a small vocabulary: n-grams recur
    lengths = torch.tensor([40, 33, 12, 27, 40], dtype=torch.int32)
    drafter = NGramRolloutDrafter()
    drafter.bind(strategies=ARMS, fuse_step=False, device="cpu", max_batch_size=5, slots_per_request=64,
                 block_size=16)
    drafter.start(histories, lengths - 1, histories[torch.arange(5), lengths.long() - 1], None)
    rows = torch.tensor([0, 1, 3, 4])
    lagging = torch.tensor([True, False, True, True])
    generated = torch.tensor([10, 10, 3, 10])  # row 3's last 3 tokens include the prompt's
    scorer = CounterfactualScorer(drafter, [Strategy.off()] + ARMS)
    got = scorer.unpack(scorer.stage(rows, lagging, generated).tolist())
    expected = []
    for arm in ARMS:
        back = arm.num_steps
        fresh = NGramDrafter(5, 64)
        fresh.reset(torch.arange(5), histories, lengths - back, validate=False)
        tree = fresh.propose_chain_tree(back) if arm.topk == 1 else fresh.propose_tree(
            (arm.num_verify - 1) // arm.topk, arm.topk)
        scored = [r for r, lag, gen in zip(rows.tolist(), lagging.tolist(), generated.tolist()) if lag and gen > back]
        reach = [_walk_reach(tree.draft_tokens[r].tolist(), tree.parents[r].tolist(), int(tree.num_nodes[r]),
                             histories[r, lengths[r] - back: lengths[r]].tolist()) for r in scored]
        expected.append((arm, [sum(x > j for x in reach) for j in range(back)], len(scored)))
    assert got == expected
    assert drafter.histories.lengths.tolist() == lengths.tolist()  # the histories are left as they were


class _Spy(StrategySelector):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.played, self.told, self.counts = [], [], []

    def update(self, strategy, *args, **kwargs):
        self.played.append(strategy)
        self.told.append([])
        super().update(strategy, *args, **kwargs)

    def observe_counterfactual(self, strategy, *args, **kwargs):
        self.told[-1].append(strategy)
        self.counts.append((strategy, args, kwargs))
        super().observe_counterfactual(strategy, *args, **kwargs)


@pytest.mark.parametrize("fuse", [False, True], ids=["separate", "fused"])
def test_an_engine_feeding_the_counterfactual_policy_matches_plain_decoding(target, fuse):
    """Greedy output is plain decoding's; the selector hears every drafting arm but the played one after its steps;
    plain steps commit at once (no backlog: the scorer reads the histories)."""
    assert _counterfactual_run(target, fuse)


def _counterfactual_run(target, fuse: bool) -> list:
    """One checked rollout of an engine with the counterfactual policy; the counts its selector heard."""
    prompts = ragged_prompts(len(MAX_NEW), seed=0, first=6, step=2)
    # A start-up table: the policy's step times are its (measured ones would make its choices the host clock's).
    table = {s: [(1, 1e-3 * (1 + 0.1 * s.num_steps))] for s in [Strategy.off()] + ARMS}
    selector = _Spy(ARMS, policy="counterfactual", seed=0, cost_table=table)
    pool = GraphPool(backend=FakeGraphBackend(lambda key: 0), warmup_iters=1) if fuse else None
    engine = SpeculativeEngine(target, "ngram", selector, pool, max_batch_size=8, max_seq_len=64, fuse_step=fuse)
    if fuse:
        engine.capture_graphs([2, 8])
        assert engine.graphs.registered(CounterfactualScorer.GRAPH) and engine.counterfactual is engine._captured_scorer
    assert engine.backlog is None and engine.counterfactual is not None
    out = engine.generate(prompts, MAX_NEW)
    reference = reference_generate(target, prompts, max(MAX_NEW))
    for b, n in enumerate(MAX_NEW):
        assert out.tokens[b] == reference.tokens[b, :n].tolist()
    assert selector.policy.counterfactuals == sum(map(len, selector.told)) > 0
    for played, told in zip(selector.played, selector.told):
        assert played not in told and len(told) == len(set(told))
    assert any(len(told) == len(ARMS) for told in selector.told)  # a plain step hears every drafting arm
    return selector.counts


def test_the_captured_scorer_counts_as_the_eager_one(target):
    """A fused engine replays the scorer's graph (padded rows add nothing): the same counts as separate steps."""
    assert _counterfactual_run(target, True) == _counterfactual_run(target, False)


def test_the_counterfactual_policy_needs_a_drafter_that_scores_for_free(target):
    with pytest.raises(ValueError, match="counterfactual policy needs"):
        SpeculativeEngine(target, EagleDrafter.for_target(target), StrategySelector(ARMS, policy="counterfactual"),
                          max_batch_size=4, max_seq_len=64)
    engine = SpeculativeEngine(target, "ngram", StrategySelector(ARMS), max_batch_size=4, max_seq_len=64)
    assert engine.counterfactual is None  # the cost policy: nothing scored


@pytest.mark.cuda
def test_gpu_the_counterfactual_engine_with_captured_step_graphs():
    """Real CUDA graphs (fused steps): the scorer's eager proposals leave the graphs' histories as they were, so the
    greedy output is plain decoding's, with no graph miss."""
    from conftest import tiny_trained_target

    gpu = tiny_trained_target().cuda()
    prompts = ragged_prompts(len(MAX_NEW), seed=0, first=6, step=2)
    selector = StrategySelector(ARMS, policy="counterfactual", seed=0)
    engine = SpeculativeEngine(gpu, "ngram", selector, GraphPool(), max_batch_size=8, max_seq_len=64, fuse_step=True)
    engine.capture_graphs([1, 2, 4, 8])
    out = engine.generate(prompts, MAX_NEW)
    reference = reference_generate(gpu, prompts, max(MAX_NEW))
    for b, n in enumerate(MAX_NEW):
        assert out.tokens[b] == reference.tokens[b, :n].tolist()
    assert all(s.graph for s in out.steps) and engine.graph_pool.stats()["misses"] == 0
    assert selector.policy.counterfactuals > 0


def test_the_scorer_graph_is_captured_only_where_asked(target):
    """A fused n-gram engine captures the scorer with a counterfactual selector or ``counterfactual_graphs``, and only
    then (other engines keep their graph memory); a counterfactual selector set later reuses it."""
    def engine(selector, **kwargs):
        pool = GraphPool(backend=FakeGraphBackend(lambda key: 0), warmup_iters=1)
        eng = SpeculativeEngine(target, "ngram", selector, pool, max_batch_size=8, max_seq_len=64, fuse_step=True,
                                **kwargs)
        eng.capture_graphs([2, 8])
        return eng

    assert not engine(StrategySelector(ARMS)).graphs.registered(CounterfactualScorer.GRAPH)
    later = engine(StrategySelector(ARMS), counterfactual_graphs=True)
    assert later.graphs.registered(CounterfactualScorer.GRAPH)
    later.selector = StrategySelector(ARMS, policy="counterfactual")
    later.generate(ragged_prompts(2, seed=0, first=6, step=2), [6, 4])
    assert later.counterfactual is later._captured_scorer and later.selector.policy.counterfactuals > 0


def test_a_counterfactual_selector_set_after_construction_is_fed(target):
    """The rollout suite swaps selectors on one engine: the scorer is resolved at each generate, and an engine built
    with a backlog (the cost policy's deferred plain commits) defers nothing while the counterfactual policy runs."""
    prompts = ragged_prompts(len(MAX_NEW), seed=0, first=6, step=2)
    engine = SpeculativeEngine(target, "ngram", StrategySelector(ARMS, seed=0), max_batch_size=8, max_seq_len=64)
    assert engine.backlog is not None and engine.counterfactual is None
    engine.selector = StrategySelector(ARMS, policy="counterfactual", seed=0)
    out = engine.generate(prompts, MAX_NEW)
    assert engine.counterfactual is not None and engine.selector.policy.counterfactuals > 0
    reference = reference_generate(target, prompts, max(MAX_NEW))
    assert all(out.tokens[b] == reference.tokens[b, :n].tolist() for b, n in enumerate(MAX_NEW))
    engine.selector = StrategySelector(ARMS, seed=0)
    engine.generate(prompts[:2], [4, 3])
    assert engine.counterfactual is None
