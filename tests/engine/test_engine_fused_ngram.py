"""``fuse_step=True`` with the n-gram drafter and the EAGLE + n-gram union: the histories (and the group sibling table)
live in buffers bound once, the step graph drafts from them and appends the accepted path in place.

On the CPU the step "graphs" replay their captured closures on the pool's static (padded) inputs
(``FakeGraphBackend``): fused and separate steps give the same greedy and sampled tokens (same seeds), with and
without request groups; the buffers survive rollouts; padding rows write only the sink row; too wide a group is
refused by name. The GPU tests capture real CUDA graphs."""
import pytest
import torch

from conftest import ragged_prompts, tiny_trained_target
from tlt_kernels.drafter import EagleDrafter, NGramRolloutDrafter
from tlt_kernels.engine import SpeculativeEngine
from tlt_kernels.models import reference_generate
from tlt_kernels.runtime import GraphPool, Strategy, StrategySelector
from tlt_kernels.runtime.graph_pool import FakeGraphBackend

MAX_NEW = [5, 23, 9, 30, 3, 17, 1]
GROUPS = [0, 0, 1, 1, 1, 2, 2]  # three groups of G <= 3 (GRPO: responses to one prompt)
SEEDS = [3, 1, 4, 1, 5, 9, 2]
ARMS = [Strategy(2, 1, 3), Strategy(4, 1, 5), Strategy(3, 2, 7)]


@pytest.fixture(scope="module")
def prompts():
    return ragged_prompts(len(MAX_NEW), seed=0, first=6, step=2)


def _drafter(kind, target, max_group_size=16):
    ngram = NGramRolloutDrafter(max_group_size=max_group_size)
    return ngram if kind == "ngram" else [EagleDrafter.for_target(target), ngram]


def _engine(target, kind, fuse, strategy=None, sizes=(2, 8), max_group_size=16, device=None):
    """An engine whose graphs are captured at ``sizes`` (fake backend on the CPU, CUDA graphs with ``device``)."""
    pool = GraphPool(backend=FakeGraphBackend(lambda key: 0), warmup_iters=1) if device is None else GraphPool()
    torch.manual_seed(0)  # the same EAGLE weights in every engine
    sel = strategy or StrategySelector(ARMS, seed=0)
    eng = SpeculativeEngine(target, _drafter(kind, target, max_group_size), sel, pool, max_batch_size=8,
                            max_seq_len=64, fuse_step=fuse)
    eng.capture_graphs(list(sizes))
    assert eng.graph_error is None, eng.graph_error
    return eng


def _ngram_part(eng) -> NGramRolloutDrafter:
    drafter = eng.tree_drafter
    return drafter if isinstance(drafter, NGramRolloutDrafter) else drafter.secondary


def _assert_plain_greedy(target, prompts, out):
    ref = reference_generate(target, prompts, max(MAX_NEW))
    for b, n in enumerate(MAX_NEW):
        assert out.tokens[b] == ref.tokens[b, :n].tolist(), f"request {b}"


@pytest.mark.parametrize("groups", [None, GROUPS], ids=["self", "groups"])
@pytest.mark.parametrize("kind", ["ngram", "union"])
def test_fused_equals_separate_steps(target, prompts, kind, groups):
    """Greedy: both are plain decoding, with the same steps (same drafts, same acceptances); sampled (fixed arm,
    same seeds): the same tokens. Every fused step replays a step graph."""
    fused, separate = _engine(target, kind, True), _engine(target, kind, False)
    out = fused.generate(prompts, MAX_NEW, groups=groups)
    _assert_plain_greedy(target, prompts, out)
    _assert_plain_greedy(target, prompts, separate.generate(prompts, MAX_NEW, groups=groups))
    assert all(s.graph for s in out.steps) and fused.graph_pool.stats()["misses"] == 0
    commits = {spec[0] for spec in fused.tree_drafter.graph_specs([], fused.backlog.widths)} if fused.backlog else set()
    assert {k[0] for k in fused.graph_pool.keys() if k[0][0] != "step"} == commits  # the backlog's commit graphs
    arm = Strategy(3, 2, 7)
    fused_static, separate_static = _engine(target, kind, True, arm), _engine(target, kind, False, arm)
    greedy = fused_static.generate(prompts, MAX_NEW, groups=groups)
    assert [s.emitted for s in greedy.steps] == [s.emitted for s in separate_static.generate(
        prompts, MAX_NEW, groups=groups).steps]
    assert greedy.mean_accepted_length() > 1.0
    kw = dict(temperature=0.8, top_p=0.9, seed=SEEDS, groups=groups)
    sampled = fused_static.generate(prompts, MAX_NEW, **kw)
    assert sampled.tokens == separate_static.generate(prompts, MAX_NEW, **kw).tokens
    assert sampled.lengths.tolist() == MAX_NEW


def test_groups_change_the_fused_drafts(target):
    """The fused graph reads the sibling table: a straggler drafts from its finished sibling's text (fewer steps
    than self-only), as the separate steps do (test_engine_groups)."""
    from tlt_kernels.models import load_corpus
    from tlt_kernels.models.train_tiny import sample_windows

    prompt = sample_windows(load_corpus("base", 200_000), 6, 16, torch.Generator().manual_seed(1))[1, :8].tolist()
    continuation = reference_generate(target, [prompt], 30).tokens[0].tolist()
    batch, max_new = [prompt, prompt + continuation], [30, 1]
    eng = _engine(target, "ngram", True, Strategy(6, 1, 7))
    alone = eng.generate(batch, max_new)
    grouped = eng.generate(batch, max_new, groups=["p", "p"])
    assert grouped.tokens[0] == alone.tokens[0] == continuation
    assert len(grouped.steps) < len(alone.steps)
    assert eng.generate(batch, max_new).tokens == alone.tokens  # the next rollout without groups: no siblings left


@pytest.mark.parametrize("kind", ["ngram", "union"])
def test_buffers_survive_rollouts(target, prompts, kind):
    """Several generate() calls reuse the bound buffers (same storage); a rollout after others (a different batch,
    groups, sampling) equals a fresh engine's."""
    eng = _engine(target, kind, True, Strategy(3, 2, 7))
    histories = _ngram_part(eng).persistent
    addresses = (histories.buffer.data_ptr(), histories.lengths.data_ptr(), histories.siblings.data_ptr())
    kw = dict(temperature=0.8, top_p=0.9, seed=SEEDS, groups=GROUPS)
    eng.generate(prompts[:3], [30, 12, 4], groups=[0, 0, 0])
    eng.generate(prompts, MAX_NEW, temperature=1.0, seed=[s + 7 for s in SEEDS])
    again = eng.generate(prompts, MAX_NEW, **kw)
    fresh = _engine(target, kind, True, Strategy(3, 2, 7)).generate(prompts, MAX_NEW, **kw)
    assert again.tokens == fresh.tokens
    assert [s.emitted for s in again.steps] == [s.emitted for s in fresh.steps]
    assert (histories.buffer.data_ptr(), histories.lengths.data_ptr(), histories.siblings.data_ptr()) == addresses


def test_padding_rows_write_only_the_sink_row(target, prompts):
    """Three requests replay the size-8 graph: five padding rows draft and commit, into the sink row only. Request
    rows hold prompt + emitted tokens; the unused slots stay empty."""
    eng = _engine(target, "ngram", True, Strategy(4, 1, 5), sizes=(8,))
    histories = _ngram_part(eng).persistent
    sink = _ngram_part(eng).sink_row
    assert sink == 8 and histories.buffer.shape[0] == 9
    assert int(histories.lengths[:sink].abs().sum()) == 0 and int(histories.buffer[:sink].abs().sum()) == 0
    batch, max_new = prompts[:3], [20, 9, 14]
    out = eng.generate(batch, max_new)
    assert all(s.graph for s in out.steps) and int(histories.lengths[sink]) > 0  # the padding rows did commit
    assert int(histories.lengths[3:sink].abs().sum()) == 0 and int(histories.buffer[3:sink].abs().sum()) == 0
    for b, prompt in enumerate(batch):
        history = histories.buffer[b, : int(histories.lengths[b])].tolist()
        expected = list(prompt) + out.tokens[b]
        assert history[: len(expected)] == expected, f"request {b}"


def test_a_group_wider_than_max_group_size_is_refused(target, prompts):
    eng = _engine(target, "ngram", True, Strategy(3, 1, 4), max_group_size=2)
    with pytest.raises(ValueError, match=r"max_group_size=2"):
        eng.generate(prompts[:3], 4, groups=[0, 0, 0])
    assert eng.generate(prompts[:4], 4, groups=[0, 0, 1, 1]).lengths.tolist() == [4] * 4  # still usable
    # Separate steps take groups of any size, as before.
    separate = SpeculativeEngine(target, NGramRolloutDrafter(max_group_size=2), Strategy(3, 1, 4), max_batch_size=8,
                                 max_seq_len=64)
    assert separate.generate(prompts[:3], 4, groups=[0, 0, 0]).lengths.tolist() == [4] * 3


def test_max_group_size_one_drafts_self_only(target, prompts):
    """max_group_size=1: no sibling table (the self-only kernel); single-request groups still pass."""
    eng = _engine(target, "ngram", True, Strategy(4, 1, 5), max_group_size=1)
    assert _ngram_part(eng).persistent.siblings is None
    out = eng.generate(prompts, MAX_NEW, groups=list(range(len(MAX_NEW))))
    _assert_plain_greedy(target, prompts, out)
    with pytest.raises(ValueError, match="max_group_size=1"):
        eng.generate(prompts, MAX_NEW, groups=GROUPS)
    with pytest.raises(ValueError, match="max_group_size"):
        NGramRolloutDrafter(max_group_size=0)


def test_trace_probes_leave_the_histories_as_they_were(target, prompts):
    """A trace probes every arm through its step graph, whose commit appends in place; the histories are restored
    after each probe, so the rollout's steps are the untraced rollout's."""
    arms = [Strategy(2, 1, 3), Strategy(4, 1, 5)]
    eng = _engine(target, "ngram", True, StrategySelector(arms, seed=0))
    eng.selector.select = lambda batch_size: arms[1]  # a fixed arm: steps comparable with and without the trace
    trace = []
    traced = eng.generate(prompts, MAX_NEW, trace=trace)
    plain = eng.generate(prompts, MAX_NEW)
    _assert_plain_greedy(target, prompts, traced)
    assert len(trace) == len(traced.steps) and traced.tokens == plain.tokens
    assert [s.emitted for s in traced.steps] == [s.emitted for s in plain.steps]


@pytest.mark.parametrize("fuse", [False, True], ids=["separate", "fused"])
@pytest.mark.parametrize("groups", [None, GROUPS], ids=["self", "groups"])
def test_trace_counts_the_rows_with_a_draft(target, prompts, fuse, groups):
    """An n-gram trace counts, per step, the rows whose history has a match (``drafted_rows``, and of the lagging
    rows): no more rows accept a first draft than have one, on any arm, and (prompts of random tokens) some steps have
    rows without a match when each request drafts from itself alone (with groups a row also matches its siblings)."""
    eng = _engine(target, "ngram", fuse, StrategySelector(ARMS, seed=0))
    trace = []
    eng.generate(prompts, MAX_NEW, trace=trace, groups=groups)
    assert trace and all("drafted_rows" in rec and "lagging_drafted_rows" in rec for rec in trace)
    for rec in trace:
        drafted, lagging_drafted = rec["drafted_rows"], rec["lagging_drafted_rows"]
        assert 0 <= lagging_drafted <= min(drafted, rec["arms"]["off"]["lagging_rows"]) and drafted <= rec["batch_size"]
        for name, arm in rec["arms"].items():
            assert all(a <= drafted for a in arm["accepted"][:1]), (name, rec)  # depth 1 needs a draft
            assert all(a <= lagging_drafted for a in arm["lagging_accepted"][:1]), (name, rec)
    assert any(rec["drafted_rows"] for rec in trace)
    assert groups is not None or any(rec["drafted_rows"] < rec["batch_size"] for rec in trace)


def test_trace_of_a_model_drafter_has_no_draft_counts(target, prompts):
    eng = _engine(target, "eagle", True, StrategySelector(ARMS, seed=0))
    trace = []
    eng.generate(prompts, MAX_NEW, trace=trace)
    assert trace and not any("drafted_rows" in rec for rec in trace)


# ---------------------------------------------------------------------------------------------
# GPU: real CUDA graphs
# ---------------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("groups", [None, GROUPS], ids=["self", "groups"])
@pytest.mark.parametrize("kind", ["ngram", "union"])
def test_gpu_fused_graphs_equal_separate_steps(prompts, kind, groups):
    """Captured step graphs (draft from the bound histories, in-place append) replay to the separate steps'
    tokens, greedy and sampled, and a second rollout equals the first."""
    gpu = tiny_trained_target().cuda()
    arm = Strategy(3, 2, 7)
    fused = _engine(gpu, kind, True, arm, sizes=(1, 2, 4, 8), device="cuda")
    separate = _engine(gpu, kind, False, arm, sizes=(1, 2, 4, 8), device="cuda")
    greedy = fused.generate(prompts, MAX_NEW, groups=groups)
    _assert_plain_greedy(gpu, prompts, greedy)
    assert all(s.graph for s in greedy.steps) and fused.graph_pool.stats()["misses"] == 0
    assert [s.emitted for s in greedy.steps] == [s.emitted for s in separate.generate(
        prompts, MAX_NEW, groups=groups).steps]
    kw = dict(temperature=0.8, top_p=0.9, seed=SEEDS, groups=groups)
    first = fused.generate(prompts, MAX_NEW, **kw)
    assert first.tokens == separate.generate(prompts, MAX_NEW, **kw).tokens
    assert fused.generate(prompts, MAX_NEW, **kw).tokens == first.tokens


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["ngram", "union"])
def test_gpu_no_jit_compile_after_the_first_rollout(prompts, kind):
    """Once an engine has captured its graphs and run one rollout, later rollouts compile no Triton kernel, whatever
    batch sizes their steps shrink through and whatever arms a fresh selector picks: a compile in the middle of a
    rollout costs hundreds of milliseconds (the step kernel's launch sizes are the engine's, not the step's)."""
    import triton

    gpu = tiny_trained_target().cuda()
    eng = _engine(gpu, kind, True, sizes=(1, 2, 4, 8), device="cuda")
    sampled = dict(temperature=1.0, seed=[7] * len(MAX_NEW))
    eng.generate(prompts, 12, **sampled)  # warm-up: every request runs every step (the batch does not shrink)
    compiled, sizes, arms = [], set(), set()
    hook = triton.knobs.runtime.jit_post_compile_hook
    triton.knobs.runtime.jit_post_compile_hook = lambda *args, **kwargs: compiled.append(kwargs["repr"])
    try:
        for seed in range(3):
            eng.selector = StrategySelector(ARMS, seed=seed, available=eng.covers)
            out = eng.generate(prompts, MAX_NEW, **sampled)
            sizes |= {s.batch_size for s in out.steps}
            arms |= {s.strategy for s in out.steps}
    finally:
        triton.knobs.runtime.jit_post_compile_hook = hook
    assert len(sizes) > 3 and len(arms) > 1, (sizes, arms)
    assert not compiled, compiled
