"""EagleDrafter: paged extend/draft agree with the teacher-forced forward, trees are valid, and the
target's shared weights never receive gradients."""
import pytest
import torch

from tlt_kernels.drafter import DrafterKVCache, EagleConfig, EagleDrafter, accepted_length_greedy, num_candidates
from tlt_kernels.models.config import ModelConfig
from tlt_kernels.models.kv_cache import paged_rows
from tlt_kernels.models.llama import LlamaForCausalLM
from tlt_kernels.tree import validate_tree


pytestmark = pytest.mark.usefixtures("one_thread")


def _target(vocab=64, **over):
    torch.manual_seed(0)
    return LlamaForCausalLM(ModelConfig.tiny(vocab_size=vocab, **over)).eval()


def _strong(d):
    """Re-draw the drafter's own weights large: its initialization (``fc = [small | I]``, std-0.02 branches)
    makes the attention's contribution to a score smaller than the tolerance, which would hide attention bugs."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in d.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[1] ** -0.5 * (2.0 if "q_proj" in name or "k_proj" in name else 1.0))
    return d


@pytest.fixture(params=["fused", "dense"])
def decode_path(request, monkeypatch):
    """Both decoding paths of extend and draft: the fused ops (what a drafter of the cache's dtype runs for up to 64
    new tokens) and the dense reference (wider commits and drafts, or a cache of another dtype)."""
    if request.param == "dense":
        monkeypatch.setattr(EagleDrafter, "_fused", lambda self, cache, width: False)
    return request.param


def _ragged_extend(d, st, cache, feats, nxt, splits):
    """Feed pairs in chunks of per-request sizes ``splits[c][b]`` (0 allowed)."""
    B = feats.shape[0]
    done = torch.zeros(B, dtype=torch.long)
    for chunk in splits:
        n = max(max(chunk), 1)
        f = torch.zeros(B, n, feats.shape[2])
        t = torch.zeros(B, n, dtype=torch.long)
        for b in range(B):
            f[b, : chunk[b]] = feats[b, done[b] : done[b] + chunk[b]]
            t[b, : chunk[b]] = nxt[b, done[b] : done[b] + chunk[b]]
        d.extend(st, cache, f, t, torch.tensor(chunk, dtype=torch.int32))
        done += torch.tensor(chunk)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_is_rotate_half_in_float32(dtype):
    """The drafter's q/k rotation, written out: ``x * cos + rotate_half(x) * sin`` at angle ``pos * theta ** (-2i / D)``,
    in float32 and rounded to x's dtype once, with one cos/sin for q and k; bit for bit."""
    from tlt_kernels.drafter.eagle import _rope_cos_sin, _rope_inv_freq, _rotate

    g = torch.Generator().manual_seed(3)
    theta, D = 5e5, 16
    q = torch.randn(2, 5, 4, D, generator=g).to(dtype)
    k = torch.randn(2, 5, 2, D, generator=g).to(dtype)
    pos = torch.randint(0, 3000, (2, 5), generator=g)
    i = torch.arange(D // 2, dtype=torch.float32)
    angle = pos.float().unsqueeze(-1) * (1.0 / theta ** (2 * i / D))  # [B, T, D/2]

    def want(x):
        xf, c, s = x.float(), angle.cos().unsqueeze(-2), angle.sin().unsqueeze(-2)
        x1, x2 = xf[..., : D // 2], xf[..., D // 2 :]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1).to(dtype)

    cos, sin = _rope_cos_sin(pos, _rope_inv_freq(D, theta, "cpu"))
    for x in (q, k):
        assert torch.equal(_rotate(x, cos, sin), want(x))


def _teacher_forced(tgt, B: int, L: int, seed: int):
    """``(d, toks, feats, g)``: a strong drafter for ``tgt``, ``B`` random sequences of ``L + 1`` tokens, the target's
    features of their first ``L`` tokens and the drafter's teacher-forced output over the pairs."""
    d = _strong(EagleDrafter.for_target(tgt).eval())
    toks = torch.randint(0, 64, (B, L + 1), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        feats = tgt(toks[:, :L])[1]
        g = d(feats, toks[:, 1:])
    return d, toks, feats, g


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("heads", [(4, 2), (2, 2), (4, 1)])
def test_extend_matches_forward(block_size, heads, decode_path):
    B, L = 3, 19
    d, toks, feats, g = _teacher_forced(_target(num_q_heads=heads[0], num_kv_heads=heads[1]), B, L, seed=1)
    cache = DrafterKVCache(d.config, 2 + B * d.blocks_per_request(L, block_size), block_size)
    st = d.new_state(cache, B, L)
    _ragged_extend(d, st, cache, feats, toks[:, 1:], [[5, 0, 19], [0, 7, 0], [14, 12, 0]])
    assert st.context_lens.tolist() == [L] * B
    assert torch.equal(st.root_tokens, toks[:, L])
    torch.testing.assert_close(st.last_hidden, g[:, -1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("heads", [(4, 2), (2, 2), (4, 1)])
@pytest.mark.parametrize("steps", [1, 2, 4])
def test_forward_unrolled_is_a_chain_of_drafts(heads, steps):
    """Pass ``s`` at pair ``p`` of the unrolled forward equals the plain forward over the sequence a depth-``s``
    draft sees: the real pairs ``<= p - s + 1``, then pairs ``p - s + 2 .. p`` fed the previous depth's prediction
    (pass ``r`` at pair ``p - s + r``); written out per (s, p), fp32."""
    tgt = _target(num_q_heads=heads[0], num_kv_heads=heads[1])
    d = _strong(EagleDrafter.for_target(tgt).eval())
    B, S = 2, 11
    toks = torch.randint(0, 64, (B, S + 1), generator=torch.Generator().manual_seed(2))
    pos = torch.arange(3, 3 + S).expand(B, S)  # offset positions: RoPE must follow the pairs' own positions
    with torch.no_grad():
        feats = tgt(toks[:, :S])[1]
        passes = d.forward_unrolled(feats, toks[:, 1:], pos, steps=steps)
        assert len(passes) == steps
        torch.testing.assert_close(passes[0], d(feats, toks[:, 1:], pos), atol=1e-5, rtol=1e-5)
        for s in range(2, steps + 1):
            for p in range(s - 1, S):
                chain = feats[:, : p + 1].clone()
                for r in range(2, s + 1):  # pair p - s + r reads pass r - 1's prediction at the pair before it
                    chain[:, p - s + r] = passes[r - 2][:, p - s + r - 1]
                want = d(chain, toks[:, 1 : p + 2], pos[:, : p + 1])[:, -1]
                torch.testing.assert_close(passes[s - 1][:, p], want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="steps"):
        d.forward_unrolled(feats, toks[:, 1:], steps=0)


# (3, 17): 34 expanded nodes, past the 32 the fused path's int32 mask words hold (int64 words then).
@pytest.mark.parametrize("depth,topk", [(1, 3), (2, 3), (3, 2), (3, 17)])
@pytest.mark.parametrize("heads", [(4, 2), (4, 1)])
def test_draft_scores_match_forward_paths(depth, topk, heads, decode_path):
    tgt = _target(num_q_heads=heads[0], num_kv_heads=heads[1])
    d = _strong(EagleDrafter.for_target(tgt).eval())
    B, L = 2, 9
    toks = torch.randint(0, 64, (B, L + 1), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        feats = tgt(toks[:, :L])[1]
    cache = DrafterKVCache(d.config, 1 + B * d.blocks_per_request(L, 4), 4)
    st = d.new_state(cache, B, L)
    d.extend(st, cache, feats, toks[:, 1:], torch.full((B,), L, dtype=torch.int32))
    out = d.draft(st, cache, depth, topk, num_verify=5)
    N = num_candidates(depth, topk)
    assert out.cand_parents.shape == (B, N)
    par = out.cand_parents.long()
    with torch.no_grad():
        for b in range(B):
            for c in range(N):
                # Teacher-forced recomputation: the path's pairs use the drafter's own features.
                path = []
                x = c
                while x >= 0:
                    path.append(x)
                    x = int(par[b, x])
                path.reverse()
                f = feats[b : b + 1]
                t = toks[b : b + 1, 1:]
                g_prev = d(f, t)[:, -1:]
                score = 0.0
                for depth_i, node in enumerate(path):
                    logp = torch.log_softmax(d.head_logits(g_prev[:, -1]).float(), -1)[0]
                    score = score + logp[out.cand_tokens[b, node]]
                    if depth_i < len(path) - 1:
                        f = torch.cat([f, g_prev], 1)
                        t = torch.cat([t, out.cand_tokens[b, node].view(1, 1)], 1)
                        g_prev = d(f, t)[:, -1:]
                assert abs(float(score) - float(out.cand_scores[b, c])) < 1e-4, (b, c, path)
    tree = out.tree
    validate_tree(tree.parents, tree.num_nodes)
    assert torch.equal(tree.draft_tokens[:, 0], st.root_tokens)
    assert int(tree.num_nodes.max()) <= 5


def test_shared_weights_get_no_gradient():
    tgt = _target()
    for p in tgt.parameters():
        p.requires_grad_(True)
    d = EagleDrafter.for_target(tgt)
    toks = torch.randint(0, 64, (2, 8))
    feats = tgt(toks)[1].detach()
    g = d(feats, toks)
    (d.head_logits(g).logsumexp(-1).sum() + g.square().sum()).backward()
    assert all(p.grad is None for p in tgt.parameters())
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in d.parameters())
    names = set(d.state_dict())
    assert not any("embed" in n or "lm_head" in n for n in names)
    assert "fc.weight" in names


def test_seeded_init_is_reproducible_and_leaves_the_global_rng_alone():
    tgt = _target()
    before = torch.random.get_rng_state()
    a, b = EagleDrafter.for_target(tgt, seed=5), EagleDrafter.for_target(tgt, seed=5)
    assert torch.equal(torch.random.get_rng_state(), before), "a seeded init must not consume the global RNG"
    c = EagleDrafter.for_target(tgt, seed=6)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa), "another seed gives other weights"


def test_config_from_target_and_errors():
    tgt = _target()
    cfg = EagleConfig.from_target(tgt.config, intermediate_size=96)
    assert (cfg.hidden_size, cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size) == (64, 4, 2, 16, 96)
    with pytest.raises(ValueError, match="num_kv_heads"):
        EagleConfig(64, 64, 3, 2, 16, 128)

    class NoNorm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = tgt.config
            self.embed_tokens = tgt.embed_tokens
            self.lm_head = tgt.lm_head

    with pytest.raises(ValueError, match="final_norm"):
        EagleDrafter.for_target(NoNorm())
    cache = DrafterKVCache(EagleConfig.from_target(tgt.config), 3, 4)
    with pytest.raises(RuntimeError, match="out of blocks"):
        cache.allocate(2, 8)


def test_accepted_length_greedy():
    parents = torch.tensor([[-1, 0, 0, 1, 2, 4], [-1, 0, 1, 2, 0, 0]], dtype=torch.int32)
    tokens = torch.tensor([[9, 5, 6, 7, 8, 3], [9, 1, 2, 3, 0, 0]])
    cont = torch.tensor([[6, 8, 3, 1], [1, 2, 4, 4]])
    acc = accepted_length_greedy(parents, tokens, torch.tensor([6, 4], dtype=torch.int32), cont)
    # Request 0: path 2 (6) -> 4 (8) -> 5 (3); request 1: 1 -> 2 then 3 (token 3 != 4).
    assert acc.tolist() == [4, 3]


def _bf16_gpu_drafter(B, L, seed=4):
    """A bf16 drafter of head_dim 64 (the attention kernels' size) on the GPU, its cache filled with L pairs."""
    torch.manual_seed(0)
    tgt = LlamaForCausalLM(ModelConfig.small(vocab_size=512, num_q_heads=6, num_kv_heads=2)).cuda().to(torch.bfloat16)
    d = _strong(EagleDrafter.for_target(tgt, seed=0, dtype=torch.float32)).to("cuda", torch.bfloat16).eval()
    d.pack_projections()
    g = torch.Generator(device="cuda").manual_seed(seed)
    feats = torch.randn(B, L, d.config.hidden_size, device="cuda", generator=g).to(torch.bfloat16)
    toks = torch.randint(0, 512, (B, L), device="cuda", generator=g)
    cache = DrafterKVCache(d.config, 1 + 2 * B * d.blocks_per_request(L + 8, 16), 16, device="cuda", dtype=torch.bfloat16)
    return d, cache, feats, toks


@pytest.mark.cuda
@pytest.mark.parametrize("B", [1, 5])
def test_fused_path_on_the_kernels_matches_the_dense_path(B, monkeypatch):
    """bf16 on the GPU: the fused path (the attention, RMSNorm, rotary and SiLU kernels) commits and drafts what the
    dense reference does, within bf16 rounding; the draft replayed from a CUDA graph gives the eager draft's bits."""
    d, cache, feats, toks = _bf16_gpu_drafter(B, 37)
    lens = torch.tensor([37, 20, 1, 33, 9][:B], dtype=torch.int32, device="cuda")
    states, drafts = {}, {}
    for path in ("dense", "fused"):
        with monkeypatch.context() as m:
            if path == "dense":
                m.setattr(EagleDrafter, "_fused", lambda self, cache, width: False)
            st = states[path] = d.new_state(cache, B, 45)
            d.extend(st, cache, feats[:, :30], toks[:, :30], lens.clamp(max=30), validate=False)
            d.extend(st, cache, feats[:, 30:], toks[:, 30:], (lens - 30).clamp(min=0), validate=False)
            drafts[path] = d.draft(st, cache, depth=4, topk=3, num_verify=8)
    fused, dense = states["fused"].last_hidden.float(), states["dense"].last_hidden.float()
    assert float((fused - dense).norm() / dense.norm()) < 0.02
    assert torch.equal(states["fused"].context_lens, lens) and torch.equal(states["fused"].root_tokens, states["dense"].root_tokens)
    # Depth-1 candidates come from last_hidden alone; deeper ones may swap near-ties, so compare the best scores.
    torch.testing.assert_close(drafts["fused"].cand_scores[:, :3], drafts["dense"].cand_scores[:, :3], atol=0.15, rtol=0.05)
    st = states["fused"]
    eager = d.draft(st, cache, depth=4, topk=3, num_verify=8)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        captured = d.draft(st, cache, depth=4, topk=3, num_verify=8)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured.cand_tokens, eager.cand_tokens) and torch.equal(captured.cand_scores, eager.cand_scores)


def _no_fused_extend(monkeypatch):
    """Make the fused extension fail loudly: a test that passes then never took it."""
    import tlt_kernels.drafter.eagle as eagle_module

    def refuse(*args, **kwargs):
        raise AssertionError("extend took the fused path")

    monkeypatch.setattr(eagle_module, "extend_fused", refuse)


def test_extend_fused_false_takes_the_dense_path(monkeypatch):
    """``extend(fused=False)`` runs the dense path even where the fused one applies (n <= 64, the drafter's dtype),
    with the same result as the teacher-forced forward."""
    B, L = 2, 13
    d, toks, feats, g = _teacher_forced(_target(), B, L, seed=4)
    cache = DrafterKVCache(d.config, 2 + B * d.blocks_per_request(L, 4), 4)
    assert d._fused(cache, L)  # the default would take the fused path here
    st = d.new_state(cache, B, L)
    _no_fused_extend(monkeypatch)
    with torch.no_grad():
        d.extend(st, cache, feats, toks[:, 1:], torch.full((B,), L, dtype=torch.int32), fused=False)
    assert st.context_lens.tolist() == [L] * B
    torch.testing.assert_close(st.last_hidden, g[:, -1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("prompt_len", [1, 16, 61])
def test_rollout_start_prefills_on_the_dense_path(monkeypatch, prompt_len):
    """A rollout's prefill (``EagleRolloutDrafter.start``) never takes the fused extension: its width is the padded
    prompt length, a compile-time constant of the fused kernels, so each new length would JIT-compile mid-rollout.
    Its state equals the teacher-forced forward over the prompt and the first sampled token."""
    from tlt_kernels.drafter.eagle_rollout import EagleRolloutDrafter

    tgt = _target()
    d = _strong(EagleDrafter.for_target(tgt).eval())
    B = 2
    prompts = torch.randint(0, 64, (B, prompt_len), generator=torch.Generator().manual_seed(6))
    first = torch.tensor([7, 9])
    lens = torch.full((B,), prompt_len, dtype=torch.int64)
    rollout = EagleRolloutDrafter(d, torch.device("cpu"))
    rollout.bind(strategies=None, fuse_step=False, device=torch.device("cpu"), max_batch_size=B,
                 slots_per_request=prompt_len + 8, block_size=4)
    _no_fused_extend(monkeypatch)
    with torch.no_grad():
        feats = tgt(prompts)[1]
        rollout.start(prompts, lens, first, feats)
        want = d(feats, torch.cat([prompts[:, 1:], first[:, None]], 1))
    assert rollout.state.context_lens.tolist() == [prompt_len] * B
    assert rollout.state.root_tokens.tolist() == first.tolist()
    torch.testing.assert_close(rollout.state.last_hidden, want[:, -1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("heads", [(4, 2), (2, 2), (4, 1)])
def test_prefill_matches_forward_and_extend(block_size, heads, decode_path):
    """``prefill`` of ragged prompts (0 pairs included) leaves the state, and the cache a draft reads, as the
    teacher-forced forward and ``extend`` do: same last hidden at each request's last pair, same draft after it."""
    B, L = 4, 19
    d, toks, feats, g = _teacher_forced(_target(num_q_heads=heads[0], num_kv_heads=heads[1]), B, L, seed=6)
    lens = torch.tensor([19, 7, 0, 12], dtype=torch.int32)
    cache = DrafterKVCache(d.config, 2 + 2 * B * d.blocks_per_request(L, block_size), block_size)
    states = {}
    for name in ("prefill", "extend"):
        st = states[name] = d.new_state(cache, B, L)
        getattr(d, name)(st, cache, feats, toks[:, 1:], lens)
    st = states["prefill"]
    assert st.context_lens.tolist() == lens.tolist()
    for b, n in enumerate(lens.tolist()):
        if n:
            assert int(st.root_tokens[b]) == int(toks[b, n])
            torch.testing.assert_close(st.last_hidden[b], g[b, n - 1], atol=1e-5, rtol=1e-5)
    assert torch.equal(st.last_hidden[2], states["extend"].last_hidden[2])  # no pair: the state's own row kept
    # Every pair's K/V as extend writes them (prefill runs the query and the rest of the layer at the last pair only).
    for b, n in enumerate(lens.tolist()):
        at = {name: paged_rows(s.block_table[b : b + 1], torch.arange(n).unsqueeze(0), block_size)[0]
              for name, s in states.items()}
        for kv in (cache.k, cache.v):
            flat = kv.view(-1, *kv.shape[2:])
            torch.testing.assert_close(flat[at["prefill"]], flat[at["extend"]], atol=1e-6, rtol=1e-6)
    drafts = {name: d.draft(s, cache, depth=3, topk=2, num_verify=5) for name, s in states.items()}
    assert torch.equal(drafts["prefill"].cand_tokens, drafts["extend"].cand_tokens)
    torch.testing.assert_close(drafts["prefill"].cand_scores, drafts["extend"].cand_scores, atol=1e-5, rtol=1e-5)


def test_prefill_bf16_cache_attends_to_the_cached_keys():
    """With a cache of lower precision than the drafter, prefill attends to the K/V as stored (what every later step
    reads back), as the dense extension does."""
    B, L = 2, 11
    d, toks, feats, _ = _teacher_forced(_target(), B, L, seed=7)
    cache = DrafterKVCache(d.config, 2 + 2 * B * d.blocks_per_request(L, 4), 4, dtype=torch.bfloat16)
    lens = torch.tensor([11, 5], dtype=torch.int32)
    states = {name: d.new_state(cache, B, L) for name in ("prefill", "extend")}
    d.prefill(states["prefill"], cache, feats, toks[:, 1:], lens)
    d.extend(states["extend"], cache, feats, toks[:, 1:], lens, fused=False)
    torch.testing.assert_close(states["prefill"].last_hidden, states["extend"].last_hidden, atol=1e-5, rtol=1e-5)


def test_prefill_rejects_a_state_with_pairs_and_bad_counts():
    B, L = 2, 9
    d, toks, feats, _ = _teacher_forced(_target(), B, L, seed=8)
    cache = DrafterKVCache(d.config, 2 + 2 * B * d.blocks_per_request(2 * L, 4), 4)
    st = d.new_state(cache, B, 2 * L)
    d.prefill(st, cache, feats, toks[:, 1:], torch.tensor([9, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match="prefill: request 0 already holds context_lens = 9"):
        d.prefill(st, cache, feats, toks[:, 1:], torch.tensor([9, 3], dtype=torch.int32))
    fresh = d.new_state(cache, B, 2 * L)
    with pytest.raises(ValueError, match=r"^EagleDrafter.prefill: num_new\[1\] = 10 is outside \[0, n=9\]"):
        d.prefill(fresh, cache, feats, toks[:, 1:], torch.tensor([9, 10], dtype=torch.int32))
    with pytest.raises(TypeError, match="next_tokens must have dtype int64"):
        d.prefill(fresh, cache, feats, toks[:, 1:].int(), torch.tensor([9, 3], dtype=torch.int32))


@pytest.mark.cuda
def test_prefill_on_the_gpu_matches_the_dense_extension():
    """bf16 on the GPU (the flash attention kernel): prefill leaves the state the dense extension does, within bf16
    rounding, and the same depth-1 candidates."""
    B, L = 5, 37
    d, cache, feats, toks = _bf16_gpu_drafter(B, L, seed=9)
    lens = torch.tensor([37, 20, 1, 0, 9], dtype=torch.int32, device="cuda")
    states = {name: d.new_state(cache, B, L + 8) for name in ("prefill", "extend")}
    d.prefill(states["prefill"], cache, feats, toks, lens)
    d.extend(states["extend"], cache, feats, toks, lens, fused=False)
    got, want = states["prefill"].last_hidden.float(), states["extend"].last_hidden.float()
    assert float((got - want).norm() / want.norm()) < 0.02
    assert torch.equal(states["prefill"].context_lens, lens)
    assert torch.equal(states["prefill"].root_tokens, states["extend"].root_tokens)
    drafts = {name: d.draft(s, cache, depth=2, topk=3, num_verify=6) for name, s in states.items()}
    torch.testing.assert_close(drafts["prefill"].cand_scores[:, :3], drafts["extend"].cand_scores[:, :3],
                               atol=0.15, rtol=0.05)


@pytest.mark.cuda
def test_new_state_and_prefill_make_no_host_sync():
    """A rollout's drafter start (a new state, then prefill without validation) never waits for the GPU, so its
    launches overlap the target's prefill: under ``set_sync_debug_mode("error")`` a sync would raise."""
    B, L = 3, 21
    d, cache, feats, toks = _bf16_gpu_drafter(B, L, seed=10)
    lens = torch.tensor([21, 4, 13], dtype=torch.int32, device="cuda")
    want = d.new_state(cache, B, L + 8)
    d.prefill(want, cache, feats, toks, lens)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        st = d.new_state(cache, B, L + 8)
        d.prefill(st, cache, feats, toks, lens, validate=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(st.last_hidden, want.last_hidden) and torch.equal(st.context_lens, lens)
    assert not set(st.block_table.flatten().tolist()) & set(want.block_table.flatten().tolist())

