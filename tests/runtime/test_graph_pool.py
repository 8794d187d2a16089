"""GraphPool: bookkeeping on the CPU with a fake backend; real capture/replay on the GPU."""
import random

import pytest
import torch

from tlt_kernels.runtime import GraphPool, Strategy
from tlt_kernels.runtime.graph_pool import FakeGraphBackend

STRATS = [Strategy.off(), Strategy(3, 1, 4), Strategy(4, 4, 8)]
SIZES = [1, 3, 8, 16]
H = 16


def _step_fn(s, w):
    def fn(x, pos):
        # Verify-shaped: B * num_verify rows in, one output row per verified token plus a per-request sum.
        h = torch.tanh(x @ w) + pos[:, None].to(x.dtype)
        return h, h.reshape(-1, s.num_verify, H).sum(1)
    return fn


def _inputs(s, gen=None):
    def make(b):
        return (torch.randn(b * s.num_verify, H, generator=gen), torch.arange(b * s.num_verify, dtype=torch.int32))
    return make


def _pool(budget=None, shared=True):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(H, H, generator=gen)
    backend = FakeGraphBackend(lambda key: 1000 * key[1] * key[0].num_verify, shared=shared)
    pool = GraphPool(budget, backend=backend, warmup_iters=1)
    fns = {}
    for s in STRATS:
        fns[s] = _step_fn(s, w)
        pool.add(s, fns[s], SIZES, _inputs(s, gen))
    return pool, fns, backend


def test_capture_order_is_largest_first_and_stats():
    pool, _, backend = _pool()
    order = []
    real = backend.capture
    backend.capture = lambda fn: (order.append(backend._key), real(fn))[1]
    pool.capture()
    peaks = [k[1] * k[0].num_verify for k in order]
    assert peaks == sorted(peaks, reverse=True) and len(order) == len(STRATS) * len(SIZES)
    st = pool.stats()
    assert st["graphs"] == 12 and st["registered"] == 12 and st["hits"] == 0 and st["misses"] == 0
    # Shared pool: the footprint is the largest graph, and the warm-up estimate predicts it exactly here.
    assert st["pool_bytes"] == 1000 * 16 * 8 == st["estimated_bytes"]
    assert st["capture_seconds"] >= 0


def test_replay_in_random_order_matches_eager_with_padding():
    pool, fns, _ = _pool()
    pool.capture()
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(1)
    held = []
    for _ in range(60):
        s = rng.choice(STRATS)
        b = rng.randint(1, 16)
        x, pos = _inputs(s, gen)(b)
        out = pool.run(s, (x, pos), batch_size=b)
        ref = fns[s](x, pos)
        assert out[0].shape == ref[0].shape and out[1].shape == ref[1].shape == (b, H)
        assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
        held.append((s, b, out[1].clone(), ref[1]))
    for s, b, got, ref in held:  # copies taken right after each replay stay correct
        assert torch.equal(got, ref)
    st = pool.stats()
    assert st["hits"] == 60 and st["misses"] == 0 and 0 < st["padding_waste"] < 1


def test_outputs_live_outside_the_pool_and_share_prefix_buffers():
    pool, _, _ = _pool()
    pool.capture()
    e = pool._entries[STRATS[1]]
    big = e.static_out[16][0]
    small = e.static_out[3][0]
    assert small.data_ptr() == big.data_ptr() and small.shape[0] == 3 * STRATS[1].num_verify
    assert pool._inputs_for(e, 8)[0].data_ptr() == e.static_in[0].data_ptr()


def test_eager_fallback_beyond_largest_and_unregistered_name():
    pool, fns, _ = _pool()
    pool.capture()
    x, pos = _inputs(STRATS[2])(20)
    out = pool.run(STRATS[2], (x, pos))
    assert torch.equal(out[1], fns[STRATS[2]](x, pos)[1])
    assert pool.stats()["misses"] == 1 and not pool.covers(STRATS[2], 20) and pool.covers(STRATS[2], 9)
    assert pool.padded_size(STRATS[2], 9) == 16
    with pytest.raises(KeyError, match="not registered"):
        pool.run(Strategy(5, 1, 6), (x, pos))
    with pytest.raises(ValueError, match="already registered"):
        pool.add(STRATS[0], fns[STRATS[0]], [1], _inputs(STRATS[0]))
    with pytest.raises(ValueError, match="input 0"):
        pool.run(STRATS[2], (torch.randn(8, H + 1), pos[:8]), batch_size=1)


def test_budget_at_capture_drops_graphs_that_do_not_fit():
    # Private pools (shared=False): each graph adds its bytes; a budget keeps only what fits.
    pool, fns, _ = _pool(budget=200_000, shared=False)
    pool.capture()
    st = pool.stats()
    assert st["pool_bytes"] <= 200_000 and 0 < st["graphs"] < 12 and st["evictions"] == 12 - st["graphs"]
    for s in STRATS:  # every batch still runs (graph or eager) and is correct
        x, pos = _inputs(s)(5)
        assert torch.equal(pool.run(s, (x, pos))[1], fns[s](x, pos)[1])


def test_lru_eviction_when_the_budget_shrinks():
    pool, fns, backend = _pool(shared=False)
    pool.capture()
    for s in STRATS:
        pool.run(s, _inputs(s)(2), batch_size=2)  # touch the size-3 graphs: most recently used
    pool.set_memory_budget(sum(1000 * 3 * s.num_verify for s in STRATS))
    assert sorted(k[1] for k in pool._lru) == [3, 3, 3]
    assert pool.stats()["pool_bytes"] == sum(backend.live.values())
    x, pos = _inputs(STRATS[1])(2)
    assert torch.equal(pool.run(STRATS[1], (x, pos))[1], fns[STRATS[1]](x, pos)[1])


def test_pool_bytes_is_settled_reserved_growth_across_capture():
    # Regression (H200: 48 graphs read 0.014 GiB, the largest alone 0.779 GiB): warm-up leaves its eager
    # blocks cached and entering torch.cuda.graph empties the cache, so a baseline read with them still
    # cached cancels the pool's growth. The fake models exactly that.
    largest = 1000 * 16 * 8
    pool, fns, backend = _pool()
    backend.external_bytes = 12_345  # weights, static buffers: never pool bytes
    est = pool.warmup()
    backend._key = (STRATS[2], 16)
    backend.run_eager(lambda: None)  # the largest eager run is still cached when capture starts
    unsettled_base = backend.reserved_bytes()
    assert unsettled_base == 12_345 + largest
    pool.capture()
    assert backend.reserved_bytes() - unsettled_base == 0  # what the old accounting reported
    st = pool.stats()
    assert st["pool_bytes"] == largest == est == st["estimated_bytes"] == st["max_capture_growth_bytes"]
    # Later allocations and eager fallbacks (which leave blocks cached) are not the pool's.
    backend.external_bytes += 10**6
    x, pos = _inputs(STRATS[2])(20)
    pool.run(STRATS[2], (x, pos))
    assert pool.stats()["pool_bytes"] == largest
    # A shared pool keeps its segments until its last graph goes.
    keys = list(pool._lru)
    for k in keys[:-1]:
        pool.evict(k)
        assert pool.stats()["pool_bytes"] == largest
    pool.evict(keys[-1])
    assert pool.stats()["pool_bytes"] == 0 and backend.reserved_bytes() == 12_345 + 10**6


def test_private_pools_add_up_and_the_estimate_matches():
    pool, _, backend = _pool(shared=False)
    backend.external_bytes = 777
    pool.capture()
    total = sum(1000 * b * s.num_verify for s in STRATS for b in SIZES)
    st = pool.stats()
    assert st["pool_bytes"] == total == st["estimated_bytes"]
    assert backend.reserved_bytes() == 777 + total
    # The estimate covers the keys of the capture call.
    pool2, _, _ = _pool(shared=False)
    pool2.capture([(STRATS[0], 1), (STRATS[1], 3)])
    assert pool2.stats()["pool_bytes"] == pool2.stats()["estimated_bytes"] == 1000 * (1 + 12)


def test_selector_availability_hook():
    from tlt_kernels.runtime import StrategySelector

    pool, _, _ = _pool()
    pool.capture([(s, b) for s in STRATS[:2] for b in SIZES])
    sel = StrategySelector(STRATS[1:], available=pool.covers, policy="beg")
    for _ in range(30):
        s = sel.select(4)
        assert s in STRATS[:2]
        sel.update(s, 4, 8, 0.01)


# -- GPU ---------------------------------------------------------------------------------------
def _tree_parents(s):
    """Fixed tree of ``s.num_verify`` nodes, breadth-first: node i's parent is ``(i - 1) // topk``."""
    k = max(s.topk, 1)
    return [-1] + [(i - 1) // k for i in range(1, s.num_verify)]


class _TreeAttention:
    """Attention through ``tlt_kernels.tree_attention`` (plan/run, backend auto) over one paged KV
    cache per layer, for a model-like step captured per (strategy, batch size).

    Request r owns pages ``perm[r * P:(r + 1) * P]`` of each layer's cache: ``context_lens[r]`` random
    context tokens (never written; lengths differ per request, not page-aligned) followed by its tree's
    slots, which each layer writes before attending. Every key's plan is built by :meth:`prepare`
    before capture (outside the graph pool) and reused by every layer inside the captured step.
    """

    def __init__(self, layers, max_batch, max_tree, hq, hkv, d, context_len, device, dtype, gen, block_size=16):
        self.hq, self.hkv, self.d, self.block_size = hq, hkv, d, block_size
        self.context_lens = (context_len - (torch.arange(max_batch, device=device) * 37) % 64).to(torch.int32)
        pages = -(-(context_len + max_tree) // block_size)
        perm = torch.randperm(max_batch * pages, device=device, generator=gen)
        self.block_table = perm.view(max_batch, pages).to(torch.int32)
        shape = (max_batch * pages, block_size, hkv, d)
        self.k_cache = [torch.randn(shape, device=device, dtype=dtype, generator=gen) for _ in range(layers)]
        self.v_cache = [torch.randn(shape, device=device, dtype=dtype, generator=gen) for _ in range(layers)]
        self.context_len = context_len
        self.state = {}

    def prepare(self, s, b):
        from tlt_kernels.ops.tree_attention import plan_tree_attention

        if (s, b) in self.state:
            return
        T, dev, bs = s.num_verify, self.block_table.device, self.block_size
        table, ctx = self.block_table[:b], self.context_lens[:b]
        parents = torch.tensor(_tree_parents(s), dtype=torch.int32, device=dev).expand(b, T).contiguous()
        plan = plan_tree_attention(parents, ctx, table, T, num_q_heads=self.hq, num_kv_heads=self.hkv, head_dim=self.d,
                                   block_size=bs, max_context_len=self.context_len, num_blocks=self.k_cache[0].shape[0])
        slot = ctx.long()[:, None] + torch.arange(T, device=dev)  # node j of request r: logical slot C_r + j
        rows = table.long().gather(1, slot // bs) * bs + slot % bs
        self.state[(s, b)] = (plan, rows.reshape(-1))

    def __call__(self, layer, s, b, q, k, v):
        """q ``[b * T, Hq * D]``, k / v ``[b * T, Hkv * D]`` -> ``[b * T, Hq * D]``."""
        if (s, b) not in self.state:
            assert not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()), (s, b)
            self.prepare(s, b)
        plan, rows = self.state[(s, b)]
        kc, vc = self.k_cache[layer], self.v_cache[layer]
        kc.view(-1, self.hkv, self.d).index_copy_(0, rows, k.reshape(-1, self.hkv, self.d))
        vc.view(-1, self.hkv, self.d).index_copy_(0, rows, v.reshape(-1, self.hkv, self.d))
        return plan.run(q.view(b, s.num_verify, self.hq, self.d), kc, vc).view(b * s.num_verify, self.hq * self.d)


def _decoder_stack(layers, hidden, inter, hq, hkv, d, device, dtype, gen, attention=None):
    """``make(strategy)`` -> step ``x [B * num_verify, hidden] -> same``. ``attention``: a
    :class:`_TreeAttention`, or None for torch SDPA over each request's verified tokens (causal)."""
    ws = []
    for _ in range(layers):
        ws.append(dict(
            qkv=torch.randn(hidden, (hq + 2 * hkv) * d, device=device, dtype=dtype, generator=gen) * hidden ** -0.5,
            o=torch.randn(hq * d, hidden, device=device, dtype=dtype, generator=gen) * (hq * d) ** -0.5,
            up=torch.randn(hidden, 2 * inter, device=device, dtype=dtype, generator=gen) * hidden ** -0.5,
            down=torch.randn(inter, hidden, device=device, dtype=dtype, generator=gen) * inter ** -0.5,
            n1=torch.ones(hidden, device=device, dtype=dtype), n2=torch.ones(hidden, device=device, dtype=dtype),
        ))

    def rms(x, w):
        return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w

    def sdpa(b, nv, q, k, v):
        q = q.reshape(b, nv, hq, d).transpose(1, 2)
        k = k.reshape(b, nv, hkv, d).transpose(1, 2).repeat_interleave(hq // hkv, 1)
        v = v.reshape(b, nv, hkv, d).transpose(1, 2).repeat_interleave(hq // hkv, 1)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return a.transpose(1, 2).reshape(b * nv, hq * d)

    def make(s):
        nv = s.num_verify

        def fn(x):
            b = x.shape[0] // nv
            for i, w in enumerate(ws):
                q, k, v = (rms(x, w["n1"]) @ w["qkv"]).split([hq * d, hkv * d, hkv * d], dim=-1)
                a = sdpa(b, nv, q, k, v) if attention is None else attention(i, s, b, q, k, v)
                x = x + a @ w["o"]
                g, u = (rms(x, w["n2"]) @ w["up"]).chunk(2, dim=-1)
                x = x + (torch.nn.functional.silu(g) * u) @ w["down"]
            return x
        return fn
    return make


def test_tree_attention_helper_matches_dense_attention():
    # The model's attention (CPU: torch backend) against dense math: context from the shuffled pages,
    # then the tree's own K/V where the node is an ancestor (or itself).
    from tlt_kernels.tree import tree_ancestor_mask

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    hq, hkv, d, s, b = 4, 2, 64, Strategy(4, 4, 8), 3
    attn = _TreeAttention(2, 4, 8, hq, hkv, d, 40, "cpu", torch.bfloat16, gen)
    T = s.num_verify
    q, k, v = (torch.randn(b * T, n * d, dtype=torch.bfloat16) for n in (hq, hkv, hkv))
    out = attn(1, s, b, q, k, v).float().view(b, T, hq, d)
    anc = tree_ancestor_mask(torch.tensor([_tree_parents(s)]))[0]
    for r in range(b):
        C = int(attn.context_lens[r])
        slots = torch.arange(C)
        pages = attn.block_table[r].long()[slots // 16]
        kk = torch.cat([attn.k_cache[1][pages, slots % 16], k.view(b, T, hkv, d)[r]]).float()
        vv = torch.cat([attn.v_cache[1][pages, slots % 16], v.view(b, T, hkv, d)[r]]).float()
        mask = torch.cat([torch.ones(T, C, dtype=torch.bool), anc], dim=1)
        for h in range(hq):
            sc = (q.view(b, T, hq, d)[r, :, h].float() @ kk[:, h // (hq // hkv)].T) * d ** -0.5
            ref = sc.masked_fill(~mask, float("-inf")).softmax(-1) @ vv[:, h // (hq // hkv)]
            torch.testing.assert_close(out[r, :, h], ref, atol=2e-2, rtol=2e-2)


@pytest.mark.cuda
def test_gpu_capture_replay_random_order_bit_exact_and_no_growth():
    # A model-like step (matmuls, norms, tree attention through our ops over a paged KV cache) captured
    # for every (strategy, batch size), replayed in random order, bit-exact against eager at the padded size.
    dev, dt = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    strats = [Strategy.off(), Strategy(3, 1, 4), Strategy(4, 4, 8), Strategy(6, 4, 16)]
    sizes = [1, 2, 4, 8, 16, 32]
    attn = _TreeAttention(2, sizes[-1], 16, 8, 2, 64, 300, dev, dt, gen)
    make = _decoder_stack(2, 512, 1024, 8, 2, 64, dev, dt, gen, attention=attn)
    pool = GraphPool()
    fns = {}
    for s in strats:
        fns[s] = make(s)
        for b in sizes:
            attn.prepare(s, b)
        pool.add(s, fns[s], sizes, lambda b, s=s: (torch.randn(b * s.num_verify, 512, device=dev, dtype=dt),))
    pool.capture()
    assert pool.stats()["graphs"] == len(strats) * len(sizes)
    assert len(attn.state) == len(strats) * len(sizes)  # no plan was built during capture
    rng = random.Random(0)
    for i in range(300):
        s, b = rng.choice(strats), rng.randint(1, 32)
        x = torch.randn(b * s.num_verify, 512, device=dev, dtype=dt)
        out = pool.run(s, (x,), batch_size=b).clone()
        assert torch.isfinite(out).all()
        if i % 10 == 0:
            p = pool.padded_size(s, b)
            xp = torch.cat([x, pool._inputs_for(pool._entries[s], p)[0][x.shape[0]:]])
            assert torch.equal(out, fns[s](xp)[: x.shape[0]]), (s, b)
    torch.cuda.synchronize()
    before = torch.cuda.memory_reserved()
    for i in range(3000):
        s, b = strats[i % 4], 1 + (i * 7) % 32
        pool.run(s, (torch.zeros(b * s.num_verify, 512, device=dev, dtype=dt),), batch_size=b)
    torch.cuda.synchronize()
    assert torch.cuda.memory_reserved() == before
    st = pool.stats()
    assert st["misses"] == 0 and st["hits"] == 3300


@pytest.mark.cuda
def test_gpu_eviction_under_small_budget_falls_back_to_eager():
    dev, dt = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    make = _decoder_stack(1, 256, 512, 4, 2, 64, dev, dt, gen)
    s = Strategy(3, 1, 4)
    fn = make(s)
    pool = GraphPool(memory_budget_bytes=0)
    pool.add(s, fn, [1, 4, 16], lambda b: (torch.randn(b * 4, 256, device=dev, dtype=dt),))
    pool.capture()
    x = torch.randn(8 * 4, 256, device=dev, dtype=dt)
    assert torch.equal(pool.run(s, (x,), batch_size=8), fn(x))
    st = pool.stats()
    assert st["graphs"] + st["evictions"] == 3 and st["misses"] >= (1 if st["graphs"] == 0 else 0)


@pytest.mark.cuda
def test_gpu_shared_pool_vs_largest_graph_private_pools_and_estimate():
    # The definition the benchmark reports: growth of memory_reserved across capture, read after
    # synchronize + empty_cache, static buffers excluded; the estimate predicts it before capture.
    import gc

    from tlt_kernels.runtime.graph_pool import CudaGraphBackend

    dev, dt = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    make = _decoder_stack(2, 1024, 4096, 8, 2, 128, dev, dt, gen)
    strats = [Strategy.off(), Strategy(3, 1, 4), Strategy(4, 4, 8), Strategy(6, 4, 16)]
    sizes = [1, 4, 16, 32, 64]
    fns = {s: make(s) for s in strats}

    def measure(keys, shared=True):
        pool = GraphPool(backend=CudaGraphBackend(shared_pool=shared))
        for s in [s for s in strats if any(k[0] == s for k in keys)]:
            pool.add(s, fns[s], sizes, lambda b, s=s: (torch.randn(b * s.num_verify, 1024, device=dev, dtype=dt),))
        pool.capture(keys)
        st = pool.stats()
        del pool
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return st["pool_bytes"], st["estimated_bytes"]

    every = [(s, b) for s in strats for b in sizes]
    single, single_est = measure([(strats[-1], sizes[-1])])
    shared, shared_est = measure(every)
    private, private_est = measure(every, shared=False)
    assert 0 < single <= shared < private, (single, shared, private)
    for got, est in ((single, single_est), (shared, shared_est), (private, private_est)):
        assert abs(est - got) <= 0.1 * got, (est, got)


def test_run_fill_rest_resets_padding_rows_to_the_example_inputs():
    """With fill_rest=True, rows past the given inputs get the example inputs' rows (the harmless padding a
    caller registered), not whatever an earlier, larger replay left in the static buffers."""
    pool = GraphPool(backend=FakeGraphBackend(lambda key: 0), warmup_iters=1)
    pad_value = -7.0
    pool.add("double", lambda x: 2 * x, [4], lambda B: (torch.full((B, 3), pad_value),))
    pool.capture()
    full = torch.arange(12, dtype=torch.float32).view(4, 3)
    assert torch.equal(pool.run("double", (full,), batch_size=4), 2 * full)
    out = pool.run("double", (full[:1] + 100,), batch_size=4, fill_rest=True)
    assert torch.equal(out[:1], 2 * (full[:1] + 100))
    assert torch.equal(out[1:], torch.full((3, 3), 2 * pad_value))  # not 2 * full[1:] from the previous replay
    out = pool.run("double", (full[:2],), batch_size=4)  # without fill_rest the old rows stay (documented)
    assert torch.equal(out[2:], torch.full((2, 3), 2 * pad_value))
    with pytest.raises(ValueError, match="takes at most"):
        pool.run("double", (torch.zeros(5, 3),), batch_size=4, fill_rest=True)
    assert pool.stats()["misses"] == 0


@pytest.mark.parametrize("fails", [False, True])
def test_cuda_capture_pauses_the_garbage_collector(monkeypatch, fails):
    """CudaGraphBackend.capture runs the captured function with Python's collector off (a collection mid-capture
    could destroy a dead engine's graphs, which invalidates the capture) and turns it back on afterwards, also when
    the capture raises; torch.cuda.graph is stood in for so this runs without a GPU."""
    import contextlib
    import gc

    from tlt_kernels.runtime.graph_pool import CudaGraphBackend

    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: "graph")
    monkeypatch.setattr(torch.cuda, "graph", lambda *args, **kwargs: contextlib.nullcontext())
    backend = object.__new__(CudaGraphBackend)  # no device: only capture's own logic runs
    backend.pool, backend.stream = None, None
    seen = []

    def body():
        seen.append(gc.isenabled())
        if fails:
            raise RuntimeError("capture invalidated")

    assert gc.isenabled()
    if fails:
        with pytest.raises(RuntimeError, match="invalidated"):
            backend.capture(body)
    else:
        assert backend.capture(body) == "graph"
    assert seen == [False] and gc.isenabled()


def test_renew_pool_gives_a_fresh_handle(monkeypatch):
    """After a failed capture the retry records into a new pool handle (a shared pool only)."""
    from tlt_kernels.runtime.graph_pool import CudaGraphBackend

    handles = iter([(0, 7), (0, 8)])
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: next(handles))
    backend = object.__new__(CudaGraphBackend)
    backend.shared_pool, backend.pool = True, (0, 6)
    backend.renew_pool()
    assert backend.pool == (0, 7)
    backend.shared_pool, backend.pool = False, None  # private pools: torch's default per graph, nothing to renew
    backend.renew_pool()
    assert backend.pool is None
