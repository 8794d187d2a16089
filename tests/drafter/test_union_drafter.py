"""UnionDrafter: two drafters' trees verified as one (EAGLE's tree with the n-gram branch beside it).

The merged tree keeps every path of both trees (as token sequences from the root); the engine with the pair keeps
plain decoding's greedy output (lossless) and its sampling law, through captured graphs too (a fake graph backend
on the CPU), and both drafters learn the accepted path."""
import random

import pytest
import torch

from conftest import ragged_prompts, two_sample_chi2
from tlt_kernels.drafter import EagleDrafter
from tlt_kernels.drafter.base import DrafterBase, ProposedTree
from tlt_kernels.drafter.union import UnionDrafter, union_tree
from tlt_kernels.engine import SpeculativeEngine, tree_width
from tlt_kernels.models import reference_generate
from tlt_kernels.runtime import Strategy, StrategySelector
from tlt_kernels.tree import validate_tree

MAX_NEW = [5, 23, 9, 30, 3, 17, 1]


@pytest.fixture(scope="module")
def prompts():
    return ragged_prompts(len(MAX_NEW), seed=0, first=6, step=2)


def _random_tree(rng: random.Random, b: int, T: int) -> ProposedTree:
    tokens = torch.randint(0, 50, (b, T), generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
    parents = torch.tensor([[-1] + [rng.randrange(i) for i in range(1, T)] for _ in range(b)], dtype=torch.int32)
    num_nodes = torch.tensor([rng.randint(1, T) for _ in range(b)], dtype=torch.int32)
    return ProposedTree(tokens, parents, num_nodes)


def _paths(tokens, parents, n):
    """The token sequence from below the root to each valid node, as a sorted list (multiset)."""
    out = []
    for i in range(1, n):
        seq, j = [], i
        while j > 0:
            seq.append(int(tokens[j]))
            j = int(parents[j])
        out.append(tuple(reversed(seq)))
    return sorted(out)


@pytest.mark.parametrize("seed", range(20))
def test_union_tree_keeps_every_path_of_both_trees(seed):
    rng = random.Random(seed)
    first, second = _random_tree(rng, 3, rng.randint(1, 6)), _random_tree(rng, 3, rng.randint(1, 6))
    union = union_tree(first, second)
    assert union.tokens.shape[1] == first.tokens.shape[1] + second.tokens.shape[1] - 1
    validate_tree(union.parents, union.num_nodes)
    for b in range(3):
        n1, n2 = int(first.num_nodes[b]), int(second.num_nodes[b])
        assert int(union.num_nodes[b]) == n1 + n2 - 1
        want = _paths(first.tokens[b], first.parents[b], n1) + _paths(second.tokens[b], second.parents[b], n2)
        assert _paths(union.tokens[b], union.parents[b], n1 + n2 - 1) == sorted(want)
        assert torch.equal(union.tokens[b, 1:n1], first.tokens[b, 1:n1])  # the primary's nodes stay first


CONFIGS = [Strategy(3, 2, 6), Strategy(2, 1, 3), "selector"]


@pytest.mark.parametrize("strategy", CONFIGS, ids=str)
def test_eagle_with_ngram_keeps_greedy_output(target, prompts, strategy):
    sel = StrategySelector([Strategy(2, 1, 3), Strategy(3, 2, 6)], seed=0) if strategy == "selector" else strategy
    eng = SpeculativeEngine(target, [EagleDrafter.for_target(target), "ngram"], sel, max_batch_size=8,
                            max_seq_len=64)
    assert isinstance(eng.tree_drafter, UnionDrafter)
    out = eng.generate(prompts, MAX_NEW)
    ref = reference_generate(target, prompts, max(MAX_NEW))
    for b, n in enumerate(MAX_NEW):
        assert out.tokens[b] == ref.tokens[b, :n].tolist(), f"request {b}"
    assert out.mean_accepted_length() > 1.0
    if strategy != "selector":  # both trees, one shared root
        width = tree_width(strategy, "eagle") + tree_width(strategy, "ngram") - 1
        assert eng.tree_drafter.tree_width(strategy) == width and {s.tree_width for s in out.steps} == {width}


def test_union_accepts_at_least_what_each_drafter_alone_accepts_here(target, prompts):
    """On repetitive text the n-gram branch adds accepted drafts to an untrained EAGLE drafter's."""
    repetitive = [list(b"def f(x):\n    return x + 1\n\ndef f(x):\n    return")] * 4
    kw = dict(max_batch_size=8, max_seq_len=96)
    alone = SpeculativeEngine(target, EagleDrafter.for_target(target, seed=1), Strategy(3, 2, 6), **kw)
    both = SpeculativeEngine(target, [EagleDrafter.for_target(target, seed=1), "ngram"], Strategy(3, 2, 6), **kw)
    a, u = alone.generate(repetitive, 24), both.generate(repetitive, 24)
    assert a.tokens == u.tokens
    assert u.mean_accepted_length() >= a.mean_accepted_length()


def test_union_through_captured_graphs_on_a_fake_backend(target, prompts):
    """The EAGLE part's draft and extend graphs are captured for the union's widths; every step replays."""
    from tlt_kernels.runtime import GraphPool
    from tlt_kernels.runtime.graph_pool import FakeGraphBackend

    pool = GraphPool(backend=FakeGraphBackend(lambda key: 0), warmup_iters=1)
    sel = StrategySelector([Strategy(2, 1, 3), Strategy(3, 2, 6)], seed=0)
    eng = SpeculativeEngine(target, [EagleDrafter.for_target(target), "ngram"], sel, pool, max_batch_size=8,
                            max_seq_len=64)
    eng.capture_graphs([2, 8])
    assert eng.graph_error is None, eng.graph_error
    names = {k[0] for k in pool.keys()}
    assert {("draft", 2, 1, 3), ("draft", 3, 2, 6), ("extend", 5), ("extend", 10), ("verify", 10)} <= names
    out = eng.generate(prompts, MAX_NEW)
    ref = reference_generate(target, prompts, max(MAX_NEW))
    for b, n in enumerate(MAX_NEW):
        assert out.tokens[b] == ref.tokens[b, :n].tolist(), f"request {b}"
    assert all(s.graph for s in out.steps)


class _EagerOnly(DrafterBase):
    """A user's drafter without fused step functions (``fused_step_error`` left set)."""

    def tree_width(self, strategy):
        return 1 if strategy.is_off else 2


def test_pairs_are_checked_and_the_fused_step_needs_both_parts(target):
    with pytest.raises(ValueError, match="pair"):
        SpeculativeEngine(target, [EagleDrafter.for_target(target)], Strategy(2, 1, 3), max_batch_size=2,
                          max_seq_len=32)
    for pair in ([EagleDrafter.for_target(target), _EagerOnly()], [_EagerOnly(), "ngram"]):
        with pytest.raises(ValueError, match="fuse_step=True supports"):
            SpeculativeEngine(target, pair, Strategy(2, 1, 3), max_batch_size=2, max_seq_len=32, fuse_step=True)
    fused = SpeculativeEngine(target, [EagleDrafter.for_target(target), "ngram"], Strategy(2, 1, 3), max_batch_size=2,
                              max_seq_len=32, fuse_step=True)
    assert len(fused.tree_drafter.pad_state_rows(3)) == 5  # EAGLE's four state rows, then the n-gram history rows


def test_fused_union_tree_is_capturable(target):
    """The union's fused draft (both parts' drafts merged by union_tree) over padding rows: fixed shapes, and the
    tree the separate steps merge."""
    eng = SpeculativeEngine(target, [EagleDrafter.for_target(target), "ngram"], Strategy(3, 2, 6), max_batch_size=4,
                            max_seq_len=32, fuse_step=True)
    union = eng.tree_drafter
    draft, commit = union.fused_functions(Strategy(3, 2, 6))
    state = union.pad_state_rows(3)
    tokens, parents, num_nodes = draft(*state)
    assert tokens.shape == parents.shape == (3, union.tree_width(Strategy(3, 2, 6))) and num_nodes.shape == (3,)
    want = union.propose(Strategy(3, 2, 6), state[4], state, _Eager())  # the separate steps' merge
    assert all(torch.equal(a, b) for a, b in zip((tokens, parents, num_nodes), want))


class _Eager:
    def call(self, name, fn, inputs, batch_size):
        return fn(*inputs), False


def test_sampling_with_the_pair_matches_plain_sampling_in_distribution(target):
    """Joint law of the first 3 sampled tokens with EAGLE + n-gram trees = plain sampling (chi-square), on a
    repetitive prompt so both branches get drafts accepted."""
    N, n_tok = 1500, 3
    prompt = list(b"        self.x = x\n        self.")
    eng = SpeculativeEngine(target, [EagleDrafter.for_target(target), "ngram"], Strategy(2, 2, 5), max_batch_size=N,
                            max_seq_len=48)
    spec = eng.generate([prompt] * N, n_tok, temperature=0.8, seed=list(range(N)))
    assert spec.mean_accepted_length() > 1.02
    plain = reference_generate(target, [prompt] * N, n_tok, temperature=0.8, seed=torch.arange(N) + 10**6)
    stat, dof, p = two_sample_chi2([tuple(t) for t in spec.tokens], [tuple(t) for t in plain.as_lists()])
    assert dof >= 5 and p > 1e-3, f"chi2={stat:.1f} dof={dof} p={p:.2e}"
