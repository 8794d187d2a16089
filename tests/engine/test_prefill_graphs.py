"""``SpeculativeEngine(prefill_lengths=)``: the prefill replayed from a graph per prompt-length bucket, padded, with
the same outputs as the eager prefill; batches no graph holds run eagerly. On the CPU a fake graph backend replays
the captured function itself, so these tests cover the registration, the padding and the fallbacks; whether the
function captures on a GPU is the GPU tests' (tests/models: ``prefill_fresh`` makes no host read)."""
import pytest
import torch

from conftest import ragged_prompts
from tlt_kernels.engine import SpeculativeEngine
from tlt_kernels.engine.prefill import check_prefill_lengths
from tlt_kernels.runtime import GraphPool, Strategy
from tlt_kernels.runtime.graph_pool import FakeGraphBackend


def _engine(target, prefill_lengths, drafter="ngram", strategy=Strategy(3, 1, 4), **kwargs):
    pool = GraphPool(backend=FakeGraphBackend(lambda key: 0), warmup_iters=1)
    eng = SpeculativeEngine(target, drafter, strategy, pool, max_batch_size=8, max_seq_len=96, fuse_step=True,
                            prefill_lengths=prefill_lengths, **kwargs)
    eng.capture_graphs([2, 8])
    assert eng.graph_error is None, eng.graph_error
    return eng


def _record_replays(eng, monkeypatch) -> list:
    """``(graph name, batch size)`` of every graph ``eng`` replays from now on, in order."""
    replays, run = [], eng.graphs.replay
    monkeypatch.setattr(eng.graphs, "replay", lambda name, inputs, b: replays.append((name, b)) or run(name, inputs, b))
    return replays


def _prefill_replays(replays) -> list:
    return [(name, b) for name, b in replays if name[0] == "prefill"]


@pytest.mark.parametrize("drafter", [None, "ngram"])
def test_replayed_prefill_gives_the_eager_rollout(target, drafter, monkeypatch):
    prompts = ragged_prompts(5, seed=3, first=4, step=5)  # 4 .. 24 tokens: padded into the 32-token bucket
    strategy = Strategy.off() if drafter is None else Strategy(3, 1, 4)
    eager = _engine(target, (), drafter, strategy).generate(prompts, 12)
    eng = _engine(target, (8, 32), drafter, strategy)
    replays = _record_replays(eng, monkeypatch)
    out = eng.generate(prompts, 12)
    assert ("prefill", 32) in [name for name, _ in replays] and eng.graph_pool.padded_size(("prefill", 32), 5) == 8
    assert out.tokens == eager.tokens


def _started_states(eng, monkeypatch):
    """Copies of the EAGLE drafter's state after each rollout's start (``finish`` drops the state)."""
    states, eagle = [], getattr(eng.tree_drafter, "primary", eng.tree_drafter)
    real = eagle.start

    def start(*args, **kwargs):
        real(*args, **kwargs)
        states.append([getattr(eagle.state, f).clone() for f in ("context_lens", "last_hidden", "root_tokens")])
    monkeypatch.setattr(eagle, "start", start)
    return states


@pytest.mark.parametrize("union", [False, True])
def test_eagle_start_replays_its_graph_with_the_eager_state(target, union, monkeypatch):
    """The EAGLE drafter's start is captured per prefill bucket beside the target's prefill: a batch the bucket
    holds replays it (prompts padded to the bucket, padding rows into the sink) and leaves the eager start's state,
    drafts and tokens; alone or as a union's primary (the n-gram part starts eagerly)."""
    from tlt_kernels.drafter import EagleDrafter

    prompts = ragged_prompts(5, seed=3, first=4, step=5)
    runs = []
    for lengths in ((), (8, 32)):
        torch.manual_seed(0)  # the same drafter weights
        eagle = EagleDrafter.for_target(target)
        eng = _engine(target, lengths, [eagle, "ngram"] if union else eagle)
        replays = _record_replays(eng, monkeypatch)
        states = _started_states(eng, monkeypatch)
        runs.append((eng.generate(prompts, 12), states, [name for name, _ in replays]))
    (eager, eager_states, eager_replays), (out, states, replays) = runs
    assert ("start", 32) in replays and ("start", 32) not in eager_replays
    assert eng.graph_pool.captured_sizes(("start", 8)) == [2, 8]
    for mine, theirs in zip(states[0], eager_states[0]):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)
    assert out.tokens == eager.tokens
    assert [(s.strategy, s.emitted) for s in out.steps] == [(s.strategy, s.emitted) for s in eager.steps]


def test_a_drafter_without_start_graphs_is_started_without_them(target):
    """A user's drafter whose ``start`` takes no ``graphs`` (no ``prefill_graph_specs``) beside prefill graphs."""
    from tlt_kernels.drafter import NoDrafter

    class Counting(NoDrafter):
        starts = []

        def start(self, prompts, prompt_lens, first_tokens, prefill_hidden):
            self.starts.append(prompts.shape)

    drafter = Counting()
    eng = _engine(target, (8, 32), drafter, Strategy.off())
    assert not [name for name in eng.graph_pool._entries if name[0] == "start"]
    eng.generate(ragged_prompts(3, seed=3, first=4, step=5), 4)
    assert drafter.starts == [(3, 14)]


def test_batches_no_graph_holds_run_the_eager_prefill(target, monkeypatch):
    eng = _engine(target, (8,))
    calls = []
    eager = eng._eager_prefill
    monkeypatch.setattr(eng, "_eager_prefill", lambda *a: calls.append(a[0].shape) or eager(*a))
    short = ragged_prompts(2, seed=4, first=3, step=2)
    eng.generate(short, 4)
    assert calls == []  # 3 and 5 tokens: the 8-token bucket
    long = ragged_prompts(2, seed=4, first=9, step=2)
    eng.generate(long, 4)
    assert calls == [(2, 11)]  # longer than every bucket


def test_prefill_max_tokens_bounds_the_captured_batches(target, monkeypatch):
    """A bucket's graphs exist only at batch sizes whose ``batch x bucket`` fits ``prefill_max_tokens``; a larger
    batch of that bucket replays in pieces of the captured sizes, with the eager prefill's tokens."""
    eng = _engine(target, (8, 32), prefill_max_tokens=64)
    assert eng.graph_pool.captured_sizes(("prefill", 8)) == [2, 8]
    assert eng.graph_pool.captured_sizes(("prefill", 32)) == [2]
    calls = []
    eager = eng._eager_prefill
    monkeypatch.setattr(eng, "_eager_prefill", lambda *a: calls.append(a[0].shape) or eager(*a))
    replays = _record_replays(eng, monkeypatch)
    eng.generate(ragged_prompts(2, seed=4, first=10, step=3), 4)  # 10, 13 tokens: 2 x 32 replayed
    assert calls == [] and _prefill_replays(replays) == [(("prefill", 32), 2)]
    replays.clear()
    prompts = ragged_prompts(3, seed=4, first=10, step=3)
    out = eng.generate(prompts, 4)  # 4 x 32 > 64 tokens: two requests, then one padded to two
    assert calls == [] and _prefill_replays(replays) == [(("prefill", 32), 2), (("prefill", 32), 1)]
    assert out.tokens == _engine(target, ()).generate(prompts, 4).tokens
    for bad in (0, -5, 1.5, True):
        with pytest.raises(ValueError, match="prefill_max_tokens"):
            _engine(target, (8,), prefill_max_tokens=bad)


@pytest.mark.parametrize("padding_to_tail", [False, True])
def test_prefill_fresh_pads_without_changing_the_valid_outputs(target, padding_to_tail):
    """``prefill_fresh`` on a batch padded to a longer length: the valid positions' logits, hidden states and cached
    K/V are those of ``prefill`` on the unpadded batch, whether padding tokens rewrite the last valid slot or write
    their own slots past the request's end."""
    from tlt_kernels.models import PagedKVCache

    prompts = ragged_prompts(3, seed=5, first=3, step=4)  # 3, 7, 11 tokens
    lens = torch.tensor([len(p) for p in prompts], dtype=torch.int32)
    tokens = torch.zeros(3, 11, dtype=torch.int64)
    for b, p in enumerate(prompts):
        tokens[b, : len(p)] = torch.tensor(p)
    results = []
    for fresh, width in ((False, 11), (True, 16)):
        cache = PagedKVCache(target.config, 3 * 2 + 1, 16)
        table, ctx = cache.allocate(3, 16)
        padded = torch.nn.functional.pad(tokens, (0, width - 11), value=7)  # any token id past the lengths
        logits, hidden = (target.prefill_fresh(padded, lens, cache, table, padding_to_tail=padding_to_tail) if fresh
                          else target.prefill(tokens, lens, cache, table, ctx))
        results.append((logits, hidden, cache.gather(1, table, 11)))
    (logits, hidden, kv), (logits2, hidden2, kv2) = results
    torch.testing.assert_close(logits2, logits, atol=1e-5, rtol=1e-5)
    for b in range(3):
        n = int(lens[b])
        torch.testing.assert_close(hidden2[b, :n], hidden[b, :n], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(kv2[0][b, :n], kv[0][b, :n], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(kv2[1][b, :n], kv[1][b, :n], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("padding_to_tail", [False, True])
def test_prefill_fresh_padding_writes_only_its_requests_slots(target, padding_to_tail):
    """Where padding tokens' K/V land: with ``padding_to_tail`` in the request's own slots past its end (up to the
    padded length), else nowhere past its end; never in another request's blocks or in blocks no table holds."""
    from tlt_kernels.models import PagedKVCache

    cache = PagedKVCache(target.config, 8, 4)
    cache.k_pool.fill_(float("nan"))
    table, _ = cache.allocate(2, 12)  # 3 blocks of 4 slots each: 12 slots per request
    tokens, lens = torch.full((2, 10), 5, dtype=torch.int64), torch.tensor([3, 10], dtype=torch.int32)
    target.prefill_fresh(tokens, lens, cache, table, padding_to_tail=padding_to_tail)
    keys = cache.gather(0, table, 12)[0]  # [2, 12, Hkv, D]
    written = ~keys.isnan().flatten(2).all(2)
    expected = torch.zeros(2, 12, dtype=torch.bool)
    expected[0, : 10 if padding_to_tail else 3] = True
    expected[1, :10] = True
    assert torch.equal(written, expected), written
    held = set(table.flatten().tolist())
    for block in range(8):
        if block not in held:
            assert cache.k_pool[0, block].isnan().all(), block


def test_prefill_fresh_reads_nothing_back_to_the_host(target, monkeypatch):
    """What a CUDA graph cannot capture: a device-to-host read (``item``, ``tolist``, ``bool`` of a tensor, ...)."""
    from tlt_kernels.models import PagedKVCache

    cache = PagedKVCache(target.config, 5, 16)
    table, _ = cache.allocate(2, 16)
    tokens, lens = torch.ones(2, 9, dtype=torch.int64), torch.tensor([9, 4], dtype=torch.int32)
    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__"):
        def read(*args, _name=name, **kwargs):
            raise AssertionError(f"prefill_fresh read the device: Tensor.{_name}")
        monkeypatch.setattr(torch.Tensor, name, read)
    target.prefill_fresh(tokens, lens, cache, table)


def test_prefill_lengths_are_checked():
    assert check_prefill_lengths([64, 16, 64], 128) == (16, 64)
    for bad in ([0], [129], [16.0], [True]):
        with pytest.raises(ValueError, match="prefill_lengths"):
            check_prefill_lengths(bad, 128)


@pytest.mark.cuda
@pytest.mark.parametrize("drafter", [None, "ngram", "eagle"])
def test_gpu_replayed_prefill_gives_the_eager_rollout(drafter):
    """On a GPU, with real CUDA graphs: the prefill captured per bucket and replayed gives the eager engine's tokens
    (plain, n-gram and EAGLE engines; the EAGLE drafter starts from the replayed hidden states, in its own
    replayed graph), and so does a mixed batch replayed bucket by bucket."""
    from conftest import tiny_trained_target
    from tlt_kernels.drafter import EagleDrafter

    gpu = tiny_trained_target().cuda()
    prompts = ragged_prompts(5, seed=3, first=4, step=5)

    def engine(prefill_lengths):
        strategy = Strategy.off() if drafter is None else Strategy(3, 1, 4)
        draft = EagleDrafter.for_target(gpu, seed=0) if drafter == "eagle" else drafter
        eng = SpeculativeEngine(gpu, draft, strategy, GraphPool(), max_batch_size=8, max_seq_len=96, fuse_step=True,
                                prefill_lengths=prefill_lengths)
        eng.capture_graphs([2, 8])
        assert eng.graph_error is None, eng.graph_error
        return eng

    eager_engine = engine(())
    eager = eager_engine.generate(prompts, 12)
    replayed = engine((8, 32))
    assert replayed.prefill_graphs.graphs.padded_size(("prefill", 32), 5) == 8
    if drafter == "eagle":  # the drafter's start is captured beside the target's prefill
        assert replayed.graphs.padded_size(("start", 32), 5) == 8
    for _ in range(2):  # the second rollout replays over the first one's cache contents
        assert replayed.generate(prompts, 12).tokens == eager.tokens
    graphs = replayed.prefill_graphs
    assert set(graphs.replay_s) == {(8, 2), (8, 8), (32, 2), (32, 8)}  # capture_graphs timed every prefill graph
    assert all(0 < s < 1 for s in graphs.replay_s.values())
    mixed = [p[:n] for p, n in zip(ragged_prompts(5, seed=7, first=20, step=1), (3, 20, 5, 4, 30))]
    graphs.replay_s = {key: 1.0 for key in graphs.replay_s} | {(32, 8): 9.0}  # a table where splitting pays
    # one replay of bucket 32 at B = 8 costs 9, the short prompts at bucket 8 (padded to 8) and the long at 32 cost 2
    assert graphs.plan([len(p) for p in mixed]) == [(8, [0, 2, 3]), (32, [1, 4])]
    assert replayed.generate(mixed, 12).tokens == eager_engine.generate(mixed, 12).tokens


@pytest.mark.parametrize("drafter", ["ngram", "eagle"])
def test_a_mixed_batch_replays_each_bucket_with_the_eager_tokens(target, drafter, monkeypatch):
    """A batch whose prompt lengths span buckets replays each bucket's graph on its own requests when that prefills
    fewer padded tokens (``REPLAY_TOKENS`` set to 0 here: at these sizes a replay's overhead outweighs the padding);
    the tokens and the per-step outcome are the eager prefill's (the EAGLE drafter starts from the pieces' hidden
    states, in its graph for the batch's longest bucket)."""
    import tlt_kernels.engine.prefill as prefill
    from tlt_kernels.drafter import EagleDrafter

    def engine(lengths):
        torch.manual_seed(0)  # the same drafter weights
        return _engine(target, lengths, EagleDrafter.for_target(target) if drafter == "eagle" else drafter)

    prompts = [p[:n] for p, n in zip(ragged_prompts(5, seed=7, first=20, step=1), (3, 20, 5, 4, 30))]
    eager = engine(()).generate(prompts, 10)
    eng = engine((8, 32))
    replays = _record_replays(eng, monkeypatch)
    assert eng.prefill_graphs.plan([len(p) for p in prompts]) == [(32, list(range(5)))]  # 8 x 32 + 256 < grouped
    monkeypatch.setattr(prefill, "REPLAY_TOKENS", 0)
    assert eng.prefill_graphs.plan([len(p) for p in prompts]) == [(8, [0, 2]), (8, [3]), (32, [1, 4])]
    out = eng.generate(prompts, 10)
    assert _prefill_replays(replays) == [(("prefill", 8), 2), (("prefill", 8), 1), (("prefill", 32), 2)]
    if drafter == "eagle":
        assert (("start", 32), 5) in replays
    assert out.tokens == eager.tokens
    assert [(s.strategy, s.emitted) for s in out.steps] == [(s.strategy, s.emitted) for s in eager.steps]


def test_the_grouped_prefill_leaves_the_eager_outputs(target, monkeypatch):
    """``PrefillGraphs.run`` on a mixed batch: the logits and each request's valid hidden rows equal the eager
    prefill's, and each request's cached K/V."""
    import tlt_kernels.engine.prefill as prefill

    monkeypatch.setattr(prefill, "REPLAY_TOKENS", 0)
    lens = [3, 20, 5, 8, 30]
    outs = []
    for lengths in ((), (8, 32)):
        eng = _engine(target, lengths, None, Strategy.off())
        tokens = torch.randint(0, target.config.vocab_size, (5, 30), generator=torch.Generator().manual_seed(1))
        lens_dev = torch.tensor(lens, dtype=torch.int32)
        table, _ = eng.cache.allocate(5, eng.slots_per_request)
        replayed = eng.prefill_graphs.run(tokens, lens_dev, table, lens)
        logits, hidden = replayed if replayed is not None else eng._eager_prefill(tokens, lens_dev, table)
        slots = eng.cache.flat_index(table, torch.arange(30).expand(5, -1))
        outs.append((replayed is not None, logits, hidden, eng.cache.read_at(0, slots)))
    (was_eager, *eager), (grouped, *mine) = outs
    assert not was_eager and grouped and len(eng.prefill_graphs.plan(lens)) == 3
    torch.testing.assert_close(mine[0], eager[0], atol=1e-5, rtol=1e-5)
    valid = torch.arange(30).unsqueeze(0) < torch.tensor(lens).unsqueeze(1)
    torch.testing.assert_close(mine[1][valid], eager[1][valid], atol=1e-5, rtol=1e-5)
    for mine_kv, eager_kv in zip(mine[2], eager[2]):
        torch.testing.assert_close(mine_kv[valid], eager_kv[valid], atol=1e-5, rtol=1e-5)


def _token_costs(sizes, bucket):
    """An unmeasured replay's cost at each captured size: its padded tokens plus ``REPLAY_TOKENS``."""
    from tlt_kernels.engine.prefill import REPLAY_TOKENS

    return tuple(size * bucket + REPLAY_TOKENS for size in sizes)


def test_pieces_cost_the_least_of_all_splits():
    """A bucket's requests split into replays at captured sizes, the split of least total cost (a piece pads to a
    captured size only where that costs less than more replays); unmeasured, padded tokens plus ``REPLAY_TOKENS``
    (256) per replay, measured, any cost per size."""
    from tlt_kernels.engine.prefill import replay_pieces

    sizes = (1, 2, 4, 8, 16, 32, 64)
    assert replay_pieces(sizes, _token_costs(sizes, 256), 40) == (32, 8)
    assert replay_pieces((1, 16, 64), _token_costs((1, 16, 64), 256), 40) == (16, 16) + (1,) * 8  # 8 x 512 < 16 x 256 + 256
    assert replay_pieces((1, 16, 64), _token_costs((1, 16, 64), 32), 40) == (16, 16, 8)  # 16 x 32 + 256 < 8 x 288
    assert replay_pieces((16, 64), _token_costs((16, 64), 512), 3) == (3,)  # the smallest size holds them, padded
    assert replay_pieces((1, 16, 64), _token_costs((1, 16, 64), 128), 64) == (64,)
    # measured: a replay's time barely grows with its rows (a launch-bound prefill), so one padded replay wins
    assert replay_pieces((1, 16, 64), (1.0, 1.1, 1.5), 40) == (40,)
    assert replay_pieces((1, 16, 64), (1.0, 1.1, 5.0), 40) == (16, 16, 8)


def test_measured_replay_times_decide_the_plan(target):
    """``measure()`` times every captured prefill graph (the engine calls it on a GPU only: a fake CPU graph's time
    is not a GPU's); a plan then weighs the times instead of padded tokens: one replay where a replay's cost is
    flat, the grouped replays where the whole batch's graph is slow."""
    eng = _engine(target, (8, 32))
    graphs = eng.prefill_graphs
    assert graphs.replay_s == {}
    measured = graphs.measure(repeats=1)
    assert set(measured) == {(8, 2), (8, 8), (32, 2), (32, 8)} and all(s > 0 for s in measured.values())
    assert graphs.replay_s is measured
    lens = [3, 20, 5, 4, 30]  # buckets 8, 32, 8, 8, 32
    graphs.replay_s = {key: 1.0 for key in measured}
    assert graphs.plan(lens) == [(32, list(range(5)))]
    graphs.replay_s[(32, 8)] = 5.0  # the whole batch pads to 8 rows of 32: grouped, 3 rows of 8 and 2 of 32
    assert graphs.plan(lens) == [(8, [0, 2, 3]), (32, [1, 4])]
    assert graphs._cost(graphs.plan(lens)) == 2.0
