"""Target model: paged prefill / tree verification / decode equal a plain dense forward, HF parity, training."""
import pytest
import torch

from conftest import HAS_CUDA
from tlt_kernels import BackendUnavailableError
from tlt_kernels.models import LlamaForCausalLM, ModelConfig, PagedKVCache
from tlt_kernels.models.reference_decode import reference_generate, sample_from_logits
from tlt_kernels.models.train_tiny import (corpus_files, deterministic_training, eval_loss, load_corpus, sample_windows,
                                          shifted_corpus, train_tiny_target)
from tlt_kernels.rng import PURPOSE_SAMPLE, uniform


pytestmark = pytest.mark.usefixtures("one_thread")


def make_model(cfg=None, seed=0, device="cpu", dtype=torch.float32):
    cfg = cfg or ModelConfig.tiny()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg)
        # Non-trivial norm weights and biases so a wrong load or a skipped term shows.
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("bias"):
                p.data.uniform_(0.5, 1.5) if name.endswith("weight") else p.data.normal_(0, 0.5)
    return model.to(device=device, dtype=dtype).eval()


def random_tree(B, T, gen, min_nodes=1):
    """parents int32 [B, T] with garbage past num_nodes, num_nodes int32 [B]."""
    n = torch.randint(min_nodes, T + 1, (B,), generator=gen).to(torch.int32)
    n[0] = T
    parents = torch.full((B, T), 77, dtype=torch.int32)
    parents[:, 0] = -1
    for i in range(1, T):
        parents[:, i] = torch.randint(0, i, (B,), generator=gen).to(torch.int32)
    parents[torch.arange(T).unsqueeze(0) >= n.unsqueeze(1).long()] = 77
    parents[:, 0] = -1
    return parents, n


def path_to(parents, b, i):
    path = [i]
    while parents[b, path[-1]] >= 0:
        path.append(int(parents[b, path[-1]]))
    return path[::-1]


def prefilled(model, prompts_lens, gen, block_size=4, extra=16, num_blocks=None):
    """Prefill random prompts of the given lengths into a cache with shuffled (non-contiguous) blocks."""
    cfg, device = model.config, model.device
    B, L = len(prompts_lens), max(prompts_lens)
    per = -(-(L + extra) // block_size)
    cache = PagedKVCache(cfg, num_blocks or B * per + 3, block_size, device=device, dtype=model.dtype)
    table, ctx = cache.allocate(B, L + extra, generator=gen)
    tokens = torch.randint(0, cfg.vocab_size, (B, L), generator=gen).to(device)
    lens = torch.tensor(prompts_lens, dtype=torch.int32, device=device)
    logits, hidden = model.prefill(tokens, lens, cache, table, ctx)
    return cache, table, tokens, lens, logits, hidden


def dense(model, seq):
    logits, hidden = model(torch.as_tensor(seq, device=model.device).view(1, -1))
    return logits[0], hidden[0]


# -- config / cache ------------------------------------------------------------------------------
def test_config_from_hf_dicts():
    llama = dict(model_type="llama", vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, rope_parameters={"rope_theta": 5e5, "rope_type": "default"},
                 rms_norm_eps=1e-5, tie_word_embeddings=True, max_position_embeddings=128, attention_bias=False)
    c = ModelConfig.from_hf(llama)
    assert (c.head_dim, c.num_kv_heads, c.rope_theta, c.tie_word_embeddings, c.attention_bias, c.rope_scaling) == (16, 2, 5e5, True, False, None)
    legacy = dict(llama, rope_parameters=None, rope_theta=1e4, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    c = ModelConfig.from_hf(legacy)
    assert c.rope_theta == 1e4 and c.rope_scaling["rope_type"] == "llama3" and c.rope_scaling["factor"] == 8.0
    qwen = dict(llama, model_type="qwen2", head_dim=None)
    qwen.pop("attention_bias")
    assert ModelConfig.from_hf(qwen).attention_bias
    with pytest.raises(NotImplementedError, match="sliding"):
        ModelConfig.from_hf(dict(qwen, use_sliding_window=True, sliding_window=16))
    with pytest.raises(NotImplementedError, match="rope_scaling type 'dynamic' is not supported .dynamic NTK"):
        ModelConfig.from_hf(dict(llama, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}))
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ModelConfig.tiny(num_kv_heads=3)


def test_kv_cache_allocator():
    cfg = ModelConfig.tiny()
    cache = PagedKVCache(cfg, num_blocks=10, block_size=4)
    assert len(cache.k) == cfg.num_layers and cache.k[1].shape == (10, 4, cfg.num_kv_heads, cfg.head_dim)
    table, ctx = cache.allocate(2, 9)  # 3 blocks each
    assert table.dtype == torch.int32 and table.shape == (2, 3) and ctx.tolist() == [0, 0]
    assert cache.num_free_blocks == 4
    with pytest.raises(RuntimeError, match="out of blocks"):
        cache.allocate(2, 9)
    cache.free(table[:1])
    with pytest.raises(ValueError, match="double free"):
        cache.free(table[:1])
    t2, _ = cache.allocate(1, 12, generator=torch.Generator().manual_seed(0))
    assert set(t2.flatten().tolist()).isdisjoint(table[1].tolist())
    # write/gather round trip through a shuffled table
    k = torch.randn(1, 12, cfg.num_kv_heads, cfg.head_dim)
    slots = torch.arange(12).view(1, 12)
    cache.write(1, t2, slots, k, -k)
    kg, vg = cache.gather(1, t2, 12)
    assert torch.equal(kg, k) and torch.equal(vg, -k)
    assert cache.k_pool[0].abs().sum() == 0  # layer 0 untouched


# -- exactness against the dense forward ----------------------------------------------------------
@pytest.mark.parametrize("bias,tie,block_size", [(False, False, 4), (True, True, 3), (True, False, 16)])
def test_prefill_matches_dense(bias, tie, block_size, gen):
    model = make_model(ModelConfig.tiny(attention_bias=bias, tie_word_embeddings=tie))
    lens = [7, 1, 13]
    cache, table, tokens, lens_t, logits, hidden = prefilled(model, lens, gen, block_size=block_size)
    assert logits.shape == (3, model.config.vocab_size) and hidden.shape == (3, 13, model.config.hidden_size)
    for b, n in enumerate(lens):
        ref_logits, ref_hidden = dense(model, tokens[b, :n])
        torch.testing.assert_close(logits[b], ref_logits[-1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(hidden[b, :n], ref_hidden, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("context", [0, 3])
def test_prefill_writes_only_each_requests_valid_slots(context, gen):
    """A right-padded batch (a fresh one, or a chunk after ``context`` cached slots) writes slots
    ``context .. context + length - 1`` of each request and nothing else: the padding tokens' writes land on their
    request's last valid slot with that slot's own K/V, and no other request's block is touched."""
    model = make_model()
    lens = torch.tensor([6, 1, 11], dtype=torch.int32)
    B, L, block = 3, 11, 4
    cache = PagedKVCache(model.config, 3 * 5 + 4, block)
    table, ctx = cache.allocate(B, L + context + 2, generator=gen)
    ctx += context
    poison = 12345.0  # finite: a masked slot still enters attention as 0 * V, and NaN would spread
    for pool in (cache.k_pool, cache.v_pool):
        pool.fill_(poison)
    tokens = torch.randint(0, model.config.vocab_size, (B, L), generator=gen)
    if context:  # the cached prefix must hold finite K/V: prefill it first, one request per call
        for b in range(B):
            model.prefill(tokens[b : b + 1, :context], torch.tensor([context], dtype=torch.int32), cache,
                          table[b : b + 1], torch.zeros(1, dtype=torch.int32))
    model.prefill(tokens, lens, cache, table, ctx)
    written = torch.zeros(cache.num_blocks * block, dtype=torch.bool)
    for b in range(B):
        end = context + int(lens[b])
        slots = cache.flat_index(table[b : b + 1], torch.arange(end).view(1, -1)).flatten()
        written[slots] = True
    for pool in (cache.k_pool, cache.v_pool):
        changed = (pool.flatten(1, 2) != poison).flatten(2).any(-1)  # [layers, slots]
        assert torch.equal(changed, written.expand_as(changed))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_prefill_matches_dense(dtype, gen):
    """Half-precision models prefill on the fused layer ops; the dense forward runs the unfused ones, with the same
    rounding: the two agree to half-precision accuracy on a right-padded batch."""
    model = make_model(dtype=dtype)
    lens = [7, 1, 13]
    _, _, tokens, _, logits, hidden = prefilled(model, lens, gen, block_size=4)
    for b, n in enumerate(lens):
        ref_logits, ref_hidden = dense(model, tokens[b, :n])
        torch.testing.assert_close(logits[b].float(), ref_logits[-1].float(), atol=3e-2, rtol=3e-2)
        torch.testing.assert_close(hidden[b, :n].float(), ref_hidden.float(), atol=3e-2, rtol=3e-2)


def test_fresh_prefill_attends_without_reading_the_cache_back(gen, monkeypatch):
    """Prompts with no cached context attend causally to their own K/V; a continued chunk reads its context back."""
    model = make_model()
    reads = []
    original = PagedKVCache.read_at
    monkeypatch.setattr(PagedKVCache, "read_at", lambda self, *a: reads.append(a[0]) or original(self, *a))
    cache, table, tokens, lens, _, _ = prefilled(model, [6, 3], gen, block_size=4)
    assert reads == []
    model.prefill(tokens[:, :2], torch.tensor([2, 1], dtype=torch.int32), cache, table, lens)
    assert reads == list(range(model.config.num_layers))


def test_chunked_prefill_matches_one_shot(gen):
    model = make_model()
    cache, table, tokens, lens, logits, _ = prefilled(model, [9, 5], gen, block_size=4)
    # Same prompts again, split 4 + rest, into a fresh cache with another block order.
    cache2 = PagedKVCache(model.config, cache.num_blocks, 4)
    table2, ctx2 = cache2.allocate(2, 25, generator=gen)
    first = torch.tensor([4, 2], dtype=torch.int32)
    model.prefill(tokens[:, :4], first, cache2, table2, ctx2)
    rest = tokens.clone()
    rest[0, :5], rest[1, :3] = tokens[0, 4:9], tokens[1, 2:5]
    logits2, _ = model.prefill(rest[:, :5], lens - first, cache2, table2, ctx2 + first)
    torch.testing.assert_close(logits2, logits, atol=1e-5, rtol=1e-5)
    for b in range(2):
        n = int(lens[b])
        k1, v1 = cache.gather(1, table[b : b + 1], n)
        k2, v2 = cache2.gather(1, table2[b : b + 1], n)
        torch.testing.assert_close(k2, k1, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v2, v1, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("T,block_size", [(1, 4), (7, 4), (11, 5)])
def test_tree_forward_matches_dense_paths(T, block_size, gen):
    """Node i's logits = the plain model's logits at the end of prompt + path(root..i)."""
    model = make_model(ModelConfig.tiny(attention_bias=True))
    lens = [6, 3, 10]
    cache, table, prompt, lens_t, _, _ = prefilled(model, lens, gen, block_size=block_size, extra=T + 1)
    B = len(lens)
    parents, n = random_tree(B, T, gen)
    tokens = torch.randint(0, model.config.vocab_size, (B, T), generator=gen)
    tokens[torch.arange(T).unsqueeze(0) >= n.unsqueeze(1).long()] = -1  # padding must be ignored
    logits, hidden = model.forward_tree(tokens, parents, n, cache, table, lens_t)
    assert logits.shape == (B, T, model.config.vocab_size) and hidden.shape == (B, T, model.config.hidden_size)
    for b in range(B):
        for i in range(int(n[b])):
            path = path_to(parents, b, i)
            ref_logits, ref_hidden = dense(model, torch.cat([prompt[b, : lens[b]], tokens[b, path]]))
            torch.testing.assert_close(logits[b, i], ref_logits[-1], atol=2e-5, rtol=2e-5)
            torch.testing.assert_close(hidden[b, i], ref_hidden[-1], atol=2e-5, rtol=2e-5)
    for layer in range(model.config.num_layers):
        assert torch.isfinite(cache.k[layer]).all() and torch.isfinite(cache.v[layer]).all()


def test_tree_forward_launches_do_not_grow_with_the_tree(gen, monkeypatch):
    """A verify step is launch-bound on a small target: its launches outside the plan (counted as one op) are the
    same for a tree of 2 or 16 nodes (positions come from the plan's mask, not from a round of jumps per doubling of
    the tree), and a plain step's (T = 1) fewer."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import tlt_kernels.models.llama as llama

    class Launches(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count, self.inside = 0, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not self.inside and not func.is_view:
                self.count += 1
            return func(*args, **(kwargs or {}))

    counter = Launches()
    real_plan = llama.plan_tree_attention

    def plan_once(*args, **kwargs):
        counter.count += 1
        counter.inside += 1
        try:
            return real_plan(*args, **kwargs)
        finally:
            counter.inside -= 1

    monkeypatch.setattr(llama, "plan_tree_attention", plan_once)
    model = make_model(ModelConfig.tiny(num_layers=2), dtype=torch.bfloat16)
    cache, table, _, lens_t, _, _ = prefilled(model, [9, 3], gen, block_size=8, extra=20)
    counts = {}
    for T in (1, 2, 16):
        parents, n = random_tree(2, T, gen)
        tokens = torch.randint(0, model.config.vocab_size, (2, T), generator=gen)
        counter.count = 0
        with torch.no_grad(), counter:
            model.forward_tree(tokens, parents, n, cache, table, lens_t, validate=False, max_context_len=16)
        counts[T] = counter.count
    # A plain step has no depths to read and no slots to offset: at least four launches fewer than a tree's.
    assert counts[16] == counts[2] and counts[1] <= counts[2] - 4, counts


def test_decode_matches_reference_generate(gen):
    model = make_model()
    lens, N = [5, 9], 12
    cache, table, prompt, lens_t, logits, _ = prefilled(model, lens, gen, block_size=4, extra=N + 1)
    ref = reference_generate(model, [prompt[b, :n] for b, n in enumerate(lens)], N, return_logits=True)
    ctx, out = lens_t.clone(), []
    for t in range(N):
        torch.testing.assert_close(logits, ref.logits[:, t], atol=2e-5, rtol=2e-5)
        tok = logits.argmax(-1)
        out.append(tok)
        logits, _ = model.decode(tok, cache, table, ctx)
        ctx = ctx + 1
    assert torch.stack(out, 1).tolist() == ref.tokens.tolist()


def _half_tree_check(model, gen, backend, lens=(9, 3), T=5):
    cache, table, prompt, lens_t, _, _ = prefilled(model, list(lens), gen, block_size=8, extra=T)
    parents, n = random_tree(len(lens), T, gen)
    tokens = torch.randint(0, model.config.vocab_size, (len(lens), T), generator=gen)
    dev = model.device
    logits, _ = model.forward_tree(tokens.to(dev), parents.to(dev), n.to(dev), cache, table, lens_t, backend=backend)
    tokens = tokens.to(prompt.device)
    for b in range(len(lens)):
        for i in range(int(n[b])):
            ref, _ = dense(model, torch.cat([prompt[b, : lens[b]], tokens[b, path_to(parents, b, i)]]))
            torch.testing.assert_close(logits[b, i].float(), ref[-1].float(), atol=5e-2, rtol=5e-2)


def test_tree_forward_bf16_torch_backend(gen):
    """The half-precision path (plan.run) on the op's torch backend."""
    _half_tree_check(make_model(ModelConfig.tiny(head_dim=64, num_layers=1), dtype=torch.bfloat16), gen, "torch")


@pytest.mark.triton
def test_tree_forward_bf16_triton_backend(gen):
    """The Triton kernel inside the model (CPU interpreter when there is no GPU)."""
    model = make_model(ModelConfig.tiny(head_dim=64, num_layers=1), dtype=torch.bfloat16, device="cuda" if HAS_CUDA else "cpu")
    _half_tree_check(model, gen, "triton")


def test_fp32_model_rejects_the_cuda_backend(gen):
    model = make_model()
    cache, table, _, lens, _, _ = prefilled(model, [4], gen, block_size=4, extra=4)
    with pytest.raises(ValueError, match="needs a bf16/fp16 model"):
        model.forward_tree(torch.zeros(1, 2, dtype=torch.int64), torch.tensor([[-1, 0]], dtype=torch.int32), None, cache, table, lens, backend="cuda")


@pytest.mark.triton
def test_tree_forward_fp32_triton_backend_matches_torch(gen):
    """An fp32 model with backend="triton" runs the op's exact-fp32 Triton kernel: the same logits as the
    torch path up to fp32 rounding, so greedy choices agree."""
    dev = "cuda" if HAS_CUDA else "cpu"
    model = make_model(ModelConfig.tiny(head_dim=64, num_layers=2), device=dev)
    cache, table, _, lens_t, _, _ = prefilled(model, [9, 3, 20], gen, block_size=8, extra=6)
    parents, n = random_tree(3, 6, gen)
    tokens = torch.randint(0, model.config.vocab_size, (3, 6), generator=gen).to(dev)
    args = (tokens, parents.to(dev), n.to(dev), cache, table, lens_t)
    torch_logits, _ = model.forward_tree(*args, backend="torch")
    triton_logits, _ = model.forward_tree(*args, backend="triton")
    valid = torch.arange(6)[None, :] < n[:, None]
    torch.testing.assert_close(triton_logits[valid.to(dev)], torch_logits[valid.to(dev)], atol=1e-4, rtol=1e-4)
    assert (triton_logits[valid.to(dev)].argmax(-1) == torch_logits[valid.to(dev)].argmax(-1)).all()


@pytest.mark.triton
def test_tree_forward_stores_k_and_v_in_the_rotation_launch(gen, monkeypatch):
    """On the kernel path every layer's K/V write rides in rotary_to_cache (one call per layer, no separate copy),
    and the cache it leaves equals the torch path's."""
    import tlt_kernels.models.llama as llama

    calls = []
    real = llama.rotary_to_cache
    monkeypatch.setattr(llama, "rotary_to_cache", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    dev = "cuda" if HAS_CUDA else "cpu"
    model = make_model(ModelConfig.tiny(head_dim=64, num_layers=2), device=dev)
    cache, table, _, lens_t, _, _ = prefilled(model, [9, 3], gen, block_size=8, extra=6)
    parents, n = random_tree(2, 5, gen)
    tokens = torch.randint(0, model.config.vocab_size, (2, 5), generator=gen).to(dev)
    args = (tokens, parents.to(dev), n.to(dev), cache, table, lens_t)
    model.forward_tree(*args, backend="triton")
    assert len(calls) == model.config.num_layers
    kernel_k = [layer.clone() for layer in cache.k]
    kernel_v = [layer.clone() for layer in cache.v]
    model.forward_tree(*args, backend="torch")  # rewrites the same slots through the cache's own write
    for got, want in zip(kernel_k + kernel_v, cache.k + cache.v):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def _compact(cache, table, ctx, accepted):
    """Move K/V of slots ctx + accepted[k] to ctx + k (torch stand-in for compact_kv)."""
    for b, acc in enumerate(accepted):
        src = (int(ctx[b]) + torch.tensor(acc, device=ctx.device)).view(1, -1)
        dst = int(ctx[b]) + torch.arange(len(acc), device=ctx.device).view(1, -1)
        si, di = cache.flat_index(table[b : b + 1], src).flatten(), cache.flat_index(table[b : b + 1], dst).flatten()
        for pool in (cache.k, cache.v):
            for layer in pool:
                flat = layer.view(-1, *layer.shape[2:])
                flat[di] = flat[si].clone()


def _greedy_spec_check(model, gen, lens, N, T):
    """Mini greedy speculative loop: random trees seeded with the true continuation, verified by argmax."""
    dev = model.device
    cache, table, prompt, lens_t, logits, _ = prefilled(model, lens, gen, block_size=4 if dev.type == "cpu" else 16, extra=N + T + 2)
    ref = reference_generate(model, [prompt[b, :n] for b, n in enumerate(lens)], N).tokens.cpu()
    B = len(lens)
    out = [[int(t)] for t in logits.argmax(-1)]
    ctx = lens_t.clone()
    steps = 0
    while min(len(o) for o in out) < N:
        steps += 1
        parents, n = random_tree(B, T, gen, min_nodes=2)
        tokens = torch.randint(0, model.config.vocab_size, (B, T), generator=gen)
        for b in range(B):
            tokens[b, 0] = out[b][-1]
            # The true continuation along one random path, each node right with probability 0.85.
            path = path_to(parents, b, int(torch.randint(0, int(n[b]), (1,), generator=gen)))
            g = len(out[b])
            for d, node in enumerate(path[1:]):
                if g + d < N and torch.rand(1, generator=gen) < 0.85:
                    tokens[b, node] = ref[b, g + d]
        logits, _ = model.forward_tree(tokens.to(dev), parents.to(dev), n.to(dev), cache, table, ctx)
        want = logits.argmax(-1).cpu()
        accepted = []
        for b in range(B):
            acc = [0]
            while True:
                child = [c for c in range(1, int(n[b])) if parents[b, c] == acc[-1] and tokens[b, c] == want[b, acc[-1]]]
                if not child:
                    break
                acc.append(child[0])
            out[b] += [int(tokens[b, c]) for c in acc[1:]] + [int(want[b, acc[-1]])]
            accepted.append(acc)
        _compact(cache, table, ctx, accepted)
        ctx = ctx + torch.tensor([len(a) for a in accepted], dtype=torch.int32, device=dev)
    assert steps < N  # drafts were accepted
    assert [o[:N] for o in out] == ref.tolist()


def test_greedy_speculative_equals_plain_greedy(gen):
    """Issue 7's criterion at model level: trees verified greedily reproduce plain greedy decoding."""
    _greedy_spec_check(make_model(), gen, lens=[4, 8], N=20, T=6)


# -- validation ----------------------------------------------------------------------------------
def test_validation_errors(gen):
    model = make_model()
    cache, table, prompt, lens, _, _ = prefilled(model, [4, 4], gen, block_size=4, extra=4)
    parents = torch.tensor([[-1, 0, 1], [-1, 2, 0]], dtype=torch.int32)
    tokens = torch.zeros(2, 3, dtype=torch.int64)
    with pytest.raises(ValueError, match="request 1, node 1"):
        model.forward_tree(tokens, parents, None, cache, table, lens)
    with pytest.raises(ValueError, match="covers 8 slots"):
        model.forward_tree(torch.zeros(2, 5, dtype=torch.int64), torch.tensor([[-1, 0, 1, 2, 3]] * 2, dtype=torch.int32), None, cache, table, lens)
    with pytest.raises(ValueError, match=r"lengths must lie in \[1, L=4\]"):
        model.prefill(prompt, torch.tensor([0, 4], dtype=torch.int32), cache, table, torch.zeros_like(lens))
    with pytest.raises(TypeError, match="parents must have dtype"):
        model.forward_tree(tokens, parents.float(), None, cache, table, lens)
    other = PagedKVCache(ModelConfig.tiny(num_kv_heads=4), 8, 4)
    with pytest.raises(ValueError, match="num_kv_heads=2"):
        model.forward_tree(tokens, parents, None, other, table, lens)
    half = PagedKVCache(model.config, cache.num_blocks, 4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="cache is torch.bfloat16 on cpu but the model is torch.float32"):
        model.forward_tree(tokens, parents, None, half, table, lens)


# -- reference decoding --------------------------------------------------------------------------
def test_sample_from_logits_inverse_cdf():
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4]] * 64))
    seed = torch.arange(64, dtype=torch.int64)
    off = torch.full((64,), 5, dtype=torch.int64)
    tok = sample_from_logits(logits, 1.0, seed, off)
    u = uniform(seed, off, 0, PURPOSE_SAMPLE)
    expect = (u.unsqueeze(1) >= torch.tensor([0.1, 0.3, 0.6])).sum(1)
    assert torch.equal(tok, expect)
    assert torch.equal(sample_from_logits(logits, 0.0, seed, off), torch.full((64,), 3))


def test_reference_generate_sampling_and_eos():
    model = make_model()
    prompts = [[1, 2, 3], [4, 5]]
    a = reference_generate(model, prompts, 8, temperature=1.0, seed=torch.tensor([7, 8]))
    b = reference_generate(model, prompts, 8, temperature=1.0, seed=torch.tensor([7, 8]))
    c = reference_generate(model, prompts, 8, temperature=1.0, seed=torch.tensor([9, 8]))
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.tokens[1], c.tokens[1])
    eos = int(a.tokens[0, 2])
    d = reference_generate(model, prompts, 8, temperature=1.0, seed=torch.tensor([7, 8]), eos_token_id=eos)
    first = a.tokens[0].tolist().index(eos)
    assert d.as_lists()[0] == a.tokens[0, : first + 1].tolist() and (d.tokens[0, first + 1 :] == -1).all()


# -- transformers parity -------------------------------------------------------------------------
def _yarn(**params):
    """A YaRN scaling whose ramp and attention factor are both non-trivial at the tests' 40 positions."""
    return dict({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}, **params)


def _hf_cases():
    return [
        ("llama", dict(attention_bias=False, tie_word_embeddings=False)),
        ("llama", dict(attention_bias=True, tie_word_embeddings=True,
                       rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 16})),
        ("llama", dict(rope_scaling=_yarn(beta_fast=8.0, beta_slow=0.05, truncate=False))),
        ("llama", dict(rope_scaling=_yarn(mscale=0.8, mscale_all_dim=0.5))),
        ("llama", dict(rope_scaling=_yarn(attention_factor=1.3))),
        ("qwen2", dict(tie_word_embeddings=False)),
        ("qwen2", dict(rope_scaling=_yarn())),
        # Qwen3: an explicit head_dim (16) unlike hidden_size / heads (8), q/k norms, no biases.
        ("qwen3", dict(head_dim=16, tie_word_embeddings=True)),
        ("qwen3", dict(head_dim=16, attention_bias=True, rope_scaling=_yarn(factor=2.0))),
    ]


def _hf_classes(transformers, kind):
    return {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
            "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
            "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[kind]


@pytest.mark.parametrize("kind,extra", _hf_cases())
def test_from_hf_matches_transformers(kind, extra, gen):
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6,
                  num_key_value_heads=2, max_position_embeddings=128, rope_theta=1000.0)
    cls_cfg, cls_model = _hf_classes(transformers, kind)
    hf_cfg = cls_cfg(**common, **extra)
    torch.manual_seed(0)
    hf = cls_model(hf_cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.normal_(1.0 if "norm" in name else 0.0, 0.3)
    ours = LlamaForCausalLM.from_hf(hf_cfg, hf.state_dict())
    assert ours.config.attention_bias == (kind == "qwen2" or extra.get("attention_bias", False))
    assert ours.config.qk_norm == (kind == "qwen3") and ours.config.head_dim == extra.get("head_dim", 8)
    if "rope_scaling" in extra:  # the config dict reached transformers' rotary embedding as that type
        assert hf.model.rotary_emb.rope_type == ours.config.rope_scaling["rope_type"]
    tokens = torch.randint(0, 97, (2, 40), generator=gen)
    with torch.no_grad():
        ref = hf(tokens).logits
    logits, _ = ours(tokens)
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)
    # And through the paged path: prefill 30 tokens, then the last 10 as a chain.
    cache = PagedKVCache(ours.config, 32, 4)
    table, ctx = cache.allocate(2, 40, generator=gen)
    lens = torch.tensor([30, 30], dtype=torch.int32)
    ours.prefill(tokens[:, :30], lens, cache, table, ctx)
    chain = torch.tensor([[-1] + list(range(9))] * 2, dtype=torch.int32)
    tl, _ = ours.forward_tree(tokens[:, 30:], chain, None, cache, table, lens)
    torch.testing.assert_close(tl, ref[:, 30:], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("safe", [True, False])
def test_load_checkpoint_dir(tmp_path, safe, gen):
    transformers = pytest.importorskip("transformers")
    if safe:
        pytest.importorskip("safetensors")
    from tlt_kernels.models import load_checkpoint

    cfg = transformers.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=1, tie_word_embeddings=True)
    torch.manual_seed(1)
    hf = transformers.Qwen2ForCausalLM(cfg).eval()
    if safe:
        hf.save_pretrained(tmp_path)
    else:  # transformers 5 only writes safetensors; the legacy .bin layout by hand
        cfg.to_json_file(str(tmp_path / "config.json"))
        torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")
    assert any(tmp_path.glob("*.safetensors" if safe else "*.bin"))
    ours = load_checkpoint(tmp_path)
    tokens = torch.randint(0, 64, (1, 12), generator=gen)
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens)[0], hf(tokens).logits, atol=1e-4, rtol=1e-4)
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_checkpoint(tmp_path / "nowhere")


def test_load_hf_state_dict_errors():
    model = make_model()
    sd = {("model." + k if not k.startswith("lm_head") else k): v for k, v in model.state_dict().items()}
    fresh = LlamaForCausalLM(model.config)
    fresh.load_hf_state_dict(sd)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    bad = dict(sd)
    bad.pop("model.layers.1.mlp.up_proj.weight")
    bad["model.layers.9.foo"] = torch.zeros(1)
    with pytest.raises(KeyError, match=r"missing \['layers.1.mlp.up_proj.weight'\].*unexpected \['model.layers.9.foo'\]"):
        fresh.load_hf_state_dict(bad)
    with pytest.raises(ValueError, match="model.norm.weight has shape"):
        fresh.load_hf_state_dict(dict(sd, **{"model.norm.weight": torch.ones(3)}))


# -- tiny target training ------------------------------------------------------------------------
def test_corpus_mixes_differ():
    base, shifted = corpus_files("base"), corpus_files("shifted")
    assert base and shifted and not set(base) & set(shifted)
    assert all(p.parent.name != "test" for p in shifted)
    b = load_corpus("base", 4096)
    assert b.dtype == torch.int64 and b.numel() == 4096 and int(b.max()) < 256
    assert not torch.equal(b, shifted_corpus(4096))


def test_train_tiny_target_loss_decreases():
    corpus = load_corpus("base", 300_000)
    losses = []
    model = train_tiny_target(ModelConfig.tiny(), steps=15, seed=0, batch_size=8, seq_len=32, lr=1e-2, corpus=corpus, losses=losses)
    assert len(losses) == 15 and not model.training
    # From ~ln(256) = 5.5 nats (uniform bytes) to well under it.
    assert sum(losses[-3:]) / 3 < losses[0] - 1.5, losses
    assert eval_loss(model, corpus, num=4, seq_len=32) < losses[0] - 1.5
    windows = sample_windows(corpus, 3, 10, torch.Generator().manual_seed(0))
    assert windows.shape == (3, 10)
    # Deterministic for a seed.
    again = []
    train_tiny_target(ModelConfig.tiny(), steps=2, seed=0, batch_size=8, seq_len=32, lr=1e-2, corpus=corpus, losses=again)
    assert again == losses[:2] or torch.allclose(torch.tensor(again), torch.tensor(losses[:2]))


def test_deterministic_training_restores_settings_and_collects_warnings():
    import warnings

    def sdpa_backends():  # flash, memory-efficient, cuDNN, math
        b = torch.backends.cuda
        return (b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.cudnn_sdp_enabled(), b.math_sdp_enabled())

    before = (torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory,
              sdpa_backends())
    found = set()
    with pytest.warns(UserWarning, match="an unrelated warning"):  # passed on after the block
        with deterministic_training(True, found) as seen:
            assert seen is found and torch.are_deterministic_algorithms_enabled()
            assert torch.is_deterministic_algorithms_warn_only_enabled() and not torch.utils.deterministic.fill_uninitialized_memory
            # the fused attention backwards only warn under warn_only: attention must take the math backend
            assert sdpa_backends() == (False, False, False, True)
            warnings.warn("index_add_cuda_ does not have a deterministic implementation, but you set ...\nmore")
            warnings.warn("an unrelated warning")
    assert found == {"index_add_cuda_ does not have a deterministic implementation, but you set ..."}
    shown = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(warnings, "showwarning", lambda message, *a, **k: shown.append(str(message)))
        with deterministic_training():
            warnings.warn("an unrelated warning")
    assert shown == ["an unrelated warning"], "other warnings are passed on, not swallowed"
    assert (torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory,
            sdpa_backends()) == before
    with pytest.raises(RuntimeError, match="boom"):  # restored on an exception too
        with deterministic_training():
            raise RuntimeError("boom")
    assert (torch.are_deterministic_algorithms_enabled(), sdpa_backends()) == (before[0], before[2])
    with deterministic_training(False) as seen:  # a no-op
        assert torch.are_deterministic_algorithms_enabled() == before[0] and seen == set()


# -- GPU -----------------------------------------------------------------------------------------
def _gpu_config(**over):
    # head_dim 64: a size the tree-attention kernels cover (tiny's 16 would fall back to torch).
    base = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_q_heads=8, num_kv_heads=2, head_dim=64, attention_bias=True)
    base.update(over)
    return ModelConfig.tiny(**base)


def _run_or_skip(fn):
    try:
        return fn()
    except BackendUnavailableError as exc:  # e.g. the CUDA extension was not built
        pytest.skip(str(exc))


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["auto", "triton", "cuda"])
def test_tree_forward_bf16_cuda(backend):
    gen = torch.Generator().manual_seed(3)
    model = make_model(_gpu_config(), device="cuda", dtype=torch.bfloat16)
    lens, T = [37, 5, 300, 64], 24
    cache, table, prompt, lens_t, _, _ = prefilled(model, lens, gen, block_size=16, extra=T)
    parents, n = random_tree(len(lens), T, gen)
    tokens = torch.randint(0, model.config.vocab_size, (len(lens), T), generator=gen)
    logits, _ = _run_or_skip(lambda: model.forward_tree(tokens.cuda(), parents.cuda(), n.cuda(), cache, table, lens_t, backend=backend))
    for b in range(len(lens)):
        for i in range(int(n[b])):
            path = path_to(parents, b, i)
            ref, _ = dense(model, torch.cat([prompt[b, : lens[b]].cpu(), tokens[b, path]]))
            torch.testing.assert_close(logits[b, i].float(), ref[-1].float(), atol=6e-2, rtol=5e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_tree_cuda_graph(dtype):
    """Capture forward_tree (planning included) in a CUDA graph; replay with new tokens and lengths."""
    gen = torch.Generator().manual_seed(4)
    model = make_model(_gpu_config(), device="cuda", dtype=dtype)
    cache, table, prompt, lens_t, _, _ = prefilled(model, [9, 17], gen, block_size=16, extra=16)
    parents, n = random_tree(2, 8, gen)
    parents, n = parents.cuda(), n.cuda()
    tokens = torch.randint(0, 512, (2, 8), generator=gen).cuda()
    ctx = lens_t.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        model.forward_tree(tokens, parents, n, cache, table, ctx, validate=False)  # warm-up (kernel compilation)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _ = model.forward_tree(tokens, parents, n, cache, table, ctx, validate=False)
    tokens.copy_(torch.randint(0, 512, (2, 8), generator=gen))
    ctx.copy_(lens_t - torch.tensor([2, 5], dtype=torch.int32, device="cuda"))
    graph.replay()
    eager, _ = model.forward_tree(tokens, parents, n, cache, table, ctx)
    torch.cuda.synchronize()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    valid = torch.arange(8, device="cuda") < n.unsqueeze(1)
    torch.testing.assert_close(out[valid], eager[valid], atol=tol, rtol=tol)


@pytest.mark.cuda
def test_greedy_decode_bf16_cuda_matches_reference():
    gen = torch.Generator().manual_seed(5)
    model = make_model(_gpu_config(), device="cuda", dtype=torch.bfloat16)
    lens, N = [11, 30, 3], 24
    cache, table, prompt, lens_t, logits, _ = prefilled(model, lens, gen, block_size=16, extra=N + 1)
    ref = reference_generate(model, [prompt[b, :n] for b, n in enumerate(lens)], N, return_logits=True)
    ctx = lens_t.clone()
    for t in range(N):
        torch.testing.assert_close(logits.float(), ref.logits[:, t].float(), atol=6e-2, rtol=5e-2)
        tok = ref.tokens[:, t]  # teacher-forced so a bf16 near-tie cannot derail the comparison
        logits, _ = model.decode(tok, cache, table, ctx)
        ctx = ctx + 1


@pytest.mark.cuda
def test_greedy_speculative_equals_plain_greedy_cuda(gen):
    """The same check as on the CPU, fp32 on the GPU (bf16 greedy would differ at near-ties by design)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = make_model(_gpu_config(), device="cuda")
    with sdpa_kernel(SDPBackend.MATH):  # true fp32 everywhere (no TF32 inside fused attention)
        _greedy_spec_check(model, gen, lens=[40, 7, 100], N=48, T=12)


@pytest.mark.cuda
def test_train_tiny_target_cuda():
    losses = []
    corpus = load_corpus("base", 1_000_000)
    model = train_tiny_target(ModelConfig.small(), steps=100, device="cuda", batch_size=32, seq_len=128, corpus=corpus, losses=losses)
    assert model.device.type == "cuda"
    assert sum(losses[-10:]) / 10 < 3.0, losses[-10:]


@pytest.mark.cuda
def test_deterministic_training_repeats_bit_for_bit_on_the_gpu():
    """deterministic_training: two GPU trainings with the same seed give the same weights (the e2e suite's
    --deterministic relies on it); the warnings name any op still nondeterministic."""
    if not HAS_CUDA:
        pytest.skip("needs a CUDA GPU")
    corpus = load_corpus("base", 300_000)
    states, warned = [], set()
    for _ in range(2):
        with deterministic_training(True, warned):
            model = train_tiny_target(_gpu_config(vocab_size=256), steps=25, seed=3, device="cuda", batch_size=16,
                                      seq_len=128, corpus=corpus)
        states.append({k: v.detach().cpu() for k, v in model.state_dict().items()})
    assert not warned, f"ops without a deterministic kernel: {sorted(warned)}"
    diff = [k for k in states[0] if not torch.equal(states[0][k], states[1][k])]
    assert not diff, f"weights differ between two deterministic runs: {diff[:5]}"



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("qk_norm", [False, True])
def test_fused_trunk_equals_the_unfused_layers(dtype, qk_norm):
    """The inference trunk on the fused ops (residual add inside the next RMSNorm, q and k rotated together,
    SwiGLU in one op) rounds exactly as the layer-by-layer trunk: on the ops' reference backends the hidden states
    are bit-identical, in fp32 and in bf16."""
    import dataclasses

    torch.manual_seed(0)
    config = dataclasses.replace(ModelConfig.tiny(), qk_norm=qk_norm)
    model = LlamaForCausalLM(config).to(dtype)
    with torch.no_grad():  # non-trivial norm weights, so a misplaced residual or weight shows
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    tokens = torch.randint(0, config.vocab_size, (2, 5))
    positions = torch.arange(5).expand(2, 5) + 3

    def attend(i, q, k, v):  # any function of q, k and v will do: both trunks call it with the same tensors
        group = q.shape[2] // k.shape[2]
        return 0.5 * q + k.repeat_interleave(group, 2) + v.repeat_interleave(group, 2)
    with torch.no_grad():
        fused = model._trunk(tokens, positions, attend, fused=True)
        plain = model._trunk(tokens, positions, attend, fused=False)
    assert torch.equal(fused, plain)


def test_packed_projections_run_one_gemm_and_unpack_when_a_weight_moves(monkeypatch):
    """pack_projections: q/k/v and gate/up weights become views of one tensor each (no copy), the fused trunk's
    output is unchanged, in-place updates of a parameter reach the packed tensor, and a parameter given new storage
    unpacks its group (the separate projections run again, still right)."""
    import dataclasses

    torch.manual_seed(0)
    config = dataclasses.replace(ModelConfig.tiny(), attention_bias=True)
    model = LlamaForCausalLM(config)
    tokens = torch.randint(0, config.vocab_size, (2, 4))
    positions = torch.arange(4).expand(2, 4)

    def attend(i, q, k, v):
        group = q.shape[2] // k.shape[2]
        return q + k.repeat_interleave(group, 2) * v.repeat_interleave(group, 2)

    def trunk():
        with torch.no_grad():
            return model._trunk(tokens, positions, attend, fused=True)

    before = trunk()
    model.pack_projections()
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    assert attn.packed_qkv.valid() and mlp.packed_gate_up.valid()
    assert attn.q_proj.weight.data_ptr() == attn.packed_qkv.weight.data_ptr()  # a view, not a copy
    assert attn.k_proj.bias.untyped_storage().data_ptr() == attn.packed_qkv.bias.untyped_storage().data_ptr()
    from tlt_kernels.models.packing import PackedLinears

    calls = []
    packed_call = PackedLinears.__call__
    monkeypatch.setattr(PackedLinears, "__call__", lambda self, x: calls.append(len(self.sizes)) or packed_call(self, x))
    torch.testing.assert_close(trunk(), before, rtol=1e-6, atol=1e-6)
    assert calls == [3, 2] * config.num_layers  # one GEMM for q/k/v and one for gate/up, per layer
    with torch.no_grad():
        mlp.up_proj.weight.mul_(2.0)  # in place: the packed tensor sees it
    assert mlp.packed_gate_up.valid() and torch.equal(mlp.packed_gate_up.weight[mlp.gate_proj.out_features:],
                                                      mlp.up_proj.weight)
    updated = trunk()
    mlp.up_proj.weight.data = mlp.up_proj.weight.data.clone()  # new storage: the group unpacks
    assert not mlp.packed_gate_up.valid()
    calls.clear()
    torch.testing.assert_close(trunk(), updated, rtol=1e-6, atol=1e-6)
    assert calls == [3] + [3, 2] * (config.num_layers - 1)  # layer 0's gate/up ran separately
    model.pack_projections()  # packs the moved group again
    assert mlp.packed_gate_up.valid()


def _rope_cos_sin_written_out(inv_freq, positions, dtype, attention_factor):
    """The RoPE tables as transformers' Llama computes them: fp32 angles of both halves, cos and sin, the factor,
    then the cast."""
    freqs = positions.float().unsqueeze(-1) * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos() * attention_factor, emb.sin() * attention_factor
    return cos.to(dtype), sin.to(dtype)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("attention_factor", [1.0, 1.2])
def test_rope_cos_sin_is_the_written_out_formula_bit_for_bit(device, dtype, attention_factor):
    """``rope_cos_sin``'s fewer launches (one product for both halves, the trig functions storing ``dtype``) give the
    written-out formula's bits, for int64 and int32 positions up to 2^18 (angles of up to ~2.6e5 radians)."""
    from tlt_kernels.models.llama import rope_cos_sin, rope_freqs

    g = torch.Generator().manual_seed(7)
    for head_dim in (8, 64, 128):
        inv_freq = (1.0 / 5e5 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)).to(device)
        for positions_dtype in (torch.int64, torch.int32):
            positions = torch.randint(0, 2**18, (3, 17), generator=g).to(device, positions_dtype)
            got = rope_cos_sin(rope_freqs(inv_freq), positions, dtype, attention_factor)
            want = _rope_cos_sin_written_out(inv_freq, positions, dtype, attention_factor)
            assert all(t.dtype == dtype and t.shape == (3, 17, head_dim) for t in got)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_paged_rows_is_page_times_block_size_plus_offset(device, block_size):
    """``paged_rows``: slot ``s`` of request ``b`` is row ``table[b, s // bs] * bs + s % bs`` (int64, page ids up to
    2^31 - 1 without overflow), slots past the table's width taking its last page, for int32 and int64 slots."""
    from tlt_kernels.models.kv_cache import paged_rows

    g = torch.Generator().manual_seed(block_size)
    table = torch.randint(0, 2**31 - 1, (3, 6), generator=g, dtype=torch.int64).to(torch.int32)
    table[0, 0] = 2**31 - 1
    for slots_dtype in (torch.int32, torch.int64):
        slots = torch.randint(0, 6 * block_size + 9, (3, 11), generator=g).to(slots_dtype)
        slots[0, 0] = 0  # the largest page id
        rows = paged_rows(table.to(device), slots.to(device), block_size).cpu()
        col = (slots.long() // block_size).clamp(max=5)
        want = [[int(table[b, col[b, t]]) * block_size + int(slots[b, t]) % block_size for t in range(11)]
                for b in range(3)]
        assert rows.dtype == torch.int64 and rows.tolist() == want


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_paged_rows_of_step_major_slots(device):
    """Slots laid out ``[S, B, T]`` against the table expanded over S: the rows of ``[B, S * T]`` slots, step by
    step, each step's ``[B, T]`` block contiguous (how a draft lays out its nodes' rows)."""
    from tlt_kernels.models.kv_cache import paged_rows

    g = torch.Generator().manual_seed(3)
    S, B, T, bs = 4, 3, 2, 4
    table = torch.randperm(40, generator=g)[: B * 8].view(B, 8).to(torch.int32).to(device)
    slots = torch.randint(0, 8 * bs, (B, S * T), generator=g).to(device)
    step_major = slots.view(B, S, T).transpose(0, 1).contiguous()
    rows = paged_rows(table.expand(S, -1, -1), step_major, bs)
    assert rows.shape == (S, B, T) and rows.is_contiguous()
    assert torch.equal(rows, paged_rows(table, slots, bs).view(B, S, T).transpose(0, 1))
