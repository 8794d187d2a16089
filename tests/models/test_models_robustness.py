"""Issue 26 ("no silent wrong answers") for the models and the engine: obscure errors become messages that name the
parameter, the value and what is allowed; devices compare after normalization ("cuda" is "cuda:<current>"); the
engine's per-step path gains no host checks."""
import json

import pytest
import torch

from tlt_kernels.drafter import EagleDrafter
from tlt_kernels.engine import SpeculativeEngine
from tlt_kernels.models import LlamaForCausalLM, ModelConfig, load_checkpoint, reference_generate
from tlt_kernels.models.kv_cache import PagedKVCache
from tlt_kernels.models.reference_decode import sample_from_logits
from tlt_kernels.runtime import Strategy
from tlt_kernels.runtime.graph_pool import cuda_device


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return LlamaForCausalLM(ModelConfig.tiny()).eval()  # vocab 256; random weights are enough here


def _cache(model, B=2, tokens=16, block_size=4):
    cache = PagedKVCache(model.config, B * (-(-tokens // block_size)) + 1, block_size, device=model.device)
    table, ctx = cache.allocate(B, tokens)
    return cache, table, ctx


# -- token ids outside the vocabulary -----------------------------------------------------------------------------
def test_engine_names_the_request_position_and_vocabulary(model):
    eng = SpeculativeEngine(model, "ngram", Strategy(2, 1, 3), max_batch_size=4, max_seq_len=32)
    with pytest.raises(ValueError, match=r"prompts\[1, 3\] = 300 \(request 1, position 3\) is outside the vocabulary "
                                         r"\[0, vocab_size=256\)"):
        eng.generate([[1, 2, 3], [4, 5, 6, 300, 7]], 3)
    with pytest.raises(ValueError, match=r"prompts\[0, 0\] = -1"):
        eng.generate(torch.tensor([[-1, 5], [3, 4]]), 3)
    with pytest.raises(ValueError, match=r"eos_token_id must be an int in \[0, vocab_size=256\) or None, got 256"):
        eng.generate([[1, 2, 3]], 3, eos_token_id=256)
    assert eng.generate([[1, 2, 3], [4, 5, 6, 255, 7]], 3).lengths.tolist() == [3, 3]  # the cache is still usable


def test_model_entries_check_token_ids(model):
    V = model.config.vocab_size
    with pytest.raises(ValueError, match=r"tokens\[0, 2\] = 256 \(request 0, position 2\).*vocab_size=256"):
        model(torch.tensor([[1, 2, V]]))
    cache, table, ctx = _cache(model)
    toks = torch.tensor([[1, 2, 3, 4], [5, 6, 999, 0]])
    with pytest.raises(ValueError, match=r"tokens\[1, 2\] = 999"):
        model.prefill(toks, torch.tensor([4, 4], dtype=torch.int32), cache, table, ctx)
    # Past lengths[b] a prompt is padding: anything may stand there.
    model.prefill(toks, torch.tensor([4, 2], dtype=torch.int32), cache, table, ctx)
    parents = torch.tensor([[-1, 0, 1], [-1, 0, 0]], dtype=torch.int32)
    tree = torch.tensor([[3, 4, -7], [5, 6, 7]])
    with pytest.raises(ValueError, match=r"tokens\[0, 2\] = -7"):
        model.forward_tree(tree, parents, None, cache, table, torch.tensor([4, 2], dtype=torch.int32))
    n = torch.tensor([2, 3], dtype=torch.int32)  # node 2 of request 0 is padding now
    model.forward_tree(tree, parents, n, cache, table, torch.tensor([4, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"prompts\[0, 1\] = 256"):
        reference_generate(model, [[1, V]], 2)


def test_negative_context_lens_are_named(model):
    cache, table, ctx = _cache(model)
    toks = torch.tensor([[1, 2], [3, 4]])
    with pytest.raises(ValueError, match="context_lens must be >= 0"):
        model.prefill(toks, torch.tensor([2, 2], dtype=torch.int32), cache, table, torch.tensor([0, -1], dtype=torch.int32))
    with pytest.raises(ValueError, match="context_lens must be >= 0, got a minimum of -3"):
        model.decode(torch.tensor([1, 2]), cache, table, torch.tensor([-3, 0], dtype=torch.int32))


def test_engine_prefill_path_is_not_checked_twice_per_step(model, monkeypatch):
    """The drafter calls skip their host checks (validate=False): neither the n-gram drafter's start nor the EAGLE
    drafter's checks anything (the engine guarantees their arguments, and a sync there would hold the host behind
    the target's prefill: docs/RUNTIME.md, "The rollout's start")."""
    import tlt_kernels.drafter.eagle as eagle
    import tlt_kernels.drafter.ngram_drafter as ngram

    calls = {"extend": 0, "counts": 0}
    real_extend, real_counts = eagle._check_extend, ngram._check_counts
    monkeypatch.setattr(eagle, "_check_extend",
                        lambda *a, **k: (calls.__setitem__("extend", calls["extend"] + 1), real_extend(*a, **k)))
    monkeypatch.setattr(ngram, "_check_counts", lambda *a: (calls.__setitem__("counts", calls["counts"] + 1), real_counts(*a)))
    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    out = SpeculativeEngine(model, EagleDrafter.for_target(model, seed=0), Strategy(2, 2, 4), max_batch_size=2,
                            max_seq_len=32).generate(prompts, 12)
    assert len(out.steps) > 2 and calls["extend"] == 0
    out = SpeculativeEngine(model, "ngram", Strategy(3, 1, 4), max_batch_size=2, max_seq_len=32).generate(prompts, 12)
    assert len(out.steps) > 2 and calls["counts"] == 0


# -- block sizes, backends, sampling arguments ---------------------------------------------------------------------
def test_block_size_zero_is_named(model):
    with pytest.raises(ValueError, match="block_size must be an int >= 1, got 0"):
        SpeculativeEngine(model, None, max_batch_size=2, max_seq_len=16, block_size=0)
    with pytest.raises(ValueError, match="block_size must be an int >= 1, got 0"):
        PagedKVCache(model.config, 4, 0)
    with pytest.raises(ValueError, match="block_size must be an int >= 1, got 2.5"):
        PagedKVCache(model.config, 4, 2.5)
    cache = PagedKVCache(model.config, 4, 4)
    with pytest.raises(ValueError, match="max_tokens must be an int >= 1, got 0"):
        cache.allocate(2, 0)


def test_engine_sizes_must_be_ints(model):
    with pytest.raises(ValueError, match="max_batch_size must be an int >= 1 and max_seq_len an int >= 2, got 2.5"):
        SpeculativeEngine(model, None, max_batch_size=2.5, max_seq_len=16)
    eng = SpeculativeEngine(model, None, max_batch_size=2, max_seq_len=16)
    with pytest.raises(ValueError, match=r"max_new_tokens must be an int >= 1 or 1 of them, got 2.5"):
        eng.generate([[1, 2]], 2.5)  # was truncated to 2


def test_bogus_backend_is_named_with_the_allowed_ones(model):
    cache, table, ctx = _cache(model)
    toks, parents = torch.tensor([[1], [2]]), torch.full((2, 1), -1, dtype=torch.int32)
    allowed = r"\('auto', 'torch', 'triton', 'cuda'\)"
    with pytest.raises(ValueError, match=r"backend='bogus' is not one of " + allowed):
        model.forward_tree(toks, parents, None, cache, table, ctx, backend="bogus")
    with pytest.raises(ValueError, match=r"backend='bogus' is not one of " + allowed):
        SpeculativeEngine(model, None, max_batch_size=2, max_seq_len=16, backend="bogus")
    with pytest.raises(ValueError, match="backend='cuda' needs a bf16/fp16 model"):  # a real backend, wrong dtype
        model.forward_tree(toks, parents, None, cache, table, ctx, backend="cuda")


def test_reference_sampling_arguments(model):
    logits = torch.randn(2, 8)
    seed, off = torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"temperature must be a finite number >= 0 \(0 = greedy\), got -0.5"):
        sample_from_logits(logits, -0.5, seed, off)  # would sample the least likely tokens
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1, got 0"):
        reference_generate(model, [[1, 2]], 0)


# -- configs and checkpoints ------------------------------------------------------------------------------------
LLAMA = dict(model_type="llama", vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, rope_theta=1e4)
L3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 64}


@pytest.mark.parametrize("scaling,why", [
    ({"rope_type": "linear"}, "rope_scaling of type 'linear' needs 'factor'"),
    ({"type": "linear", "factor": 0}, r"rope_scaling\['factor'\] must be a finite number > 0 for type 'linear', got 0"),
    (dict(L3, low_freq_factor=None), r"rope_scaling\['low_freq_factor'\] must be a finite number > 0"),
    ({k: v for k, v in L3.items() if k != "original_max_position_embeddings"}, "needs 'original_max_position_embeddings'"),
    (dict(L3, factor=float("nan")), r"rope_scaling\['factor'\] must be a finite number > 0"),
    (dict(L3, high_freq_factor=1.0), "needs high_freq_factor > low_freq_factor"),
    ("linear", "rope_scaling must be a dict"),
])
def test_rope_scaling_is_validated_where_the_config_is_built(scaling, why):
    with pytest.raises(ValueError, match=why):
        ModelConfig.tiny(rope_scaling=scaling)
    if isinstance(scaling, dict):
        with pytest.raises(ValueError, match=why):
            ModelConfig.from_hf(dict(LLAMA, rope_scaling=scaling))
    with pytest.raises(NotImplementedError, match="rope_scaling type 'dynamic' is not supported"):
        ModelConfig.tiny(rope_scaling={"rope_type": "dynamic", "factor": 2.0})


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


@pytest.mark.parametrize("scaling,why", [
    ({"rope_type": "yarn", "factor": 4.0}, "rope_scaling of type 'yarn' needs 'original_max_position_embeddings'"),
    (dict(YARN, factor=-2.0), r"rope_scaling\['factor'\] must be a finite number > 0 for type 'yarn'"),
    (dict(YARN, attention_factor=0.0), r"rope_scaling\['attention_factor'\] must be null or a finite number > 0"),
    (dict(YARN, beta_fast="32"), r"rope_scaling\['beta_fast'\] must be null or a finite number > 0"),
    (dict(YARN, mscale=float("inf")), r"rope_scaling\['mscale'\] must be null or a finite number > 0"),
    (dict(YARN, beta_fast=1.0, beta_slow=4.0), "needs beta_fast >= beta_slow"),
    (dict(YARN, truncate="yes"), r"rope_scaling\['truncate'\] must be a bool"),
])
def test_yarn_parameters_are_validated(scaling, why):
    with pytest.raises(ValueError, match=why):
        ModelConfig.tiny(rope_scaling=scaling)


def test_hf_yarn_defaults_follow_transformers():
    """A config.json may leave out what transformers fills in: the pre-training length (max_position_embeddings,
    unless a top-level original_max_position_embeddings says otherwise) and a null yarn factor (their ratio)."""
    yarn = {"rope_type": "yarn", "factor": 4.0}
    assert ModelConfig.from_hf(dict(LLAMA, max_position_embeddings=256, rope_scaling=yarn)).rope_scaling == dict(
        yarn, original_max_position_embeddings=256)
    top = ModelConfig.from_hf(dict(LLAMA, max_position_embeddings=256, original_max_position_embeddings=32, rope_scaling=yarn))
    assert top.rope_scaling["original_max_position_embeddings"] == 32
    null_factor = dict(yarn, factor=None, original_max_position_embeddings=64)
    assert ModelConfig.from_hf(dict(LLAMA, max_position_embeddings=256, rope_scaling=null_factor)).rope_scaling["factor"] == 4.0
    transformers = pytest.importorskip("transformers")
    hf = transformers.Qwen3Config(**{k: v for k, v in LLAMA.items() if k != "model_type"}, max_position_embeddings=256,
                                  rope_parameters=dict(yarn, rope_theta=1e4))
    assert ModelConfig.from_hf(hf) == ModelConfig.from_hf(dict(LLAMA, model_type="qwen3", max_position_embeddings=256,
                                                               rope_scaling=yarn))


QWEN3 = dict(LLAMA, model_type="qwen3", head_dim=32, use_sliding_window=False, sliding_window=None, max_window_layers=28)


def test_qwen3_config_reads_its_fields():
    c = ModelConfig.from_hf(QWEN3)
    assert (c.qk_norm, c.head_dim, c.attention_bias, c.attention_out_bias) == (True, 32, False, False)
    c = ModelConfig.from_hf(dict(QWEN3, attention_bias=True, sliding_window=4096, layer_types=["full_attention"] * 2))
    assert (c.attention_bias, c.attention_out_bias) == (True, True)  # a window size alone slides nothing
    assert not ModelConfig.from_hf(LLAMA).qk_norm
    no_head_dim = {k: v for k, v in QWEN3.items() if k != "head_dim"}
    assert ModelConfig.from_hf(no_head_dim).head_dim == 128  # Qwen3Config's default, not hidden_size / heads


@pytest.mark.parametrize("fields,why", [
    (dict(use_sliding_window=True, sliding_window=4096), r"use_sliding_window=True .*sliding_window=4096, max_window_layers=28"),
    (dict(layer_types=["full_attention", "sliding_attention"]), r"layer_types \['sliding_attention'\] are not supported"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor=0.5 is not supported"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25}),
     "partial_rotary_factor=0.25"),
    (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}), "rope_scaling type 'longrope' is not supported"),
    (dict(model_type="gemma"), r"model_type 'gemma' is not supported; expected one of \('llama', 'mistral', 'qwen2', 'qwen3'\)"),
])
def test_qwen3_features_we_do_not_compute_are_named(fields, why):
    with pytest.raises(NotImplementedError, match=why):
        ModelConfig.from_hf(dict(QWEN3, **fields))


@pytest.mark.parametrize("field,value,why", [
    ("num_key_value_heads", 0, "'num_key_value_heads' must be a positive int, got 0"),  # was read as "absent": MHA
    ("head_dim", 0, "'head_dim' must be a positive int, got 0"),
    ("vocab_size", 300.5, "'vocab_size' must be a positive int, got 300.5"),  # was truncated to 300
    ("num_hidden_layers", "2", "'num_hidden_layers' must be a positive int, got '2'"),
    ("rms_norm_eps", float("nan"), "'rms_norm_eps' must be a finite number"),
    ("rope_theta", -1.0, "rope_theta must be a finite number > 0, got -1.0"),
    ("rope_scaling", [1, 2], "'rope_scaling' must be a dict or null"),
    ("max_position_embeddings", -5, "'max_position_embeddings' must be a positive int, got -5"),
])
def test_malformed_hf_fields_are_named(field, value, why):
    with pytest.raises(ValueError, match=why):
        ModelConfig.from_hf(dict(LLAMA, **{field: value}))


def test_hf_configs_that_cannot_be_read_faithfully():
    nested = {"full_attention": {"rope_type": "default", "rope_theta": 1e6}, "sliding_attention": {"rope_theta": 1e4}}
    with pytest.raises(NotImplementedError, match="per-layer-type rope_parameters"):
        ModelConfig.from_hf(dict(LLAMA, rope_parameters=nested))  # its rope_theta would have been 10000 silently
    with pytest.raises(TypeError, match="config must be a transformers config or its to_dict"):
        ModelConfig.from_hf(42)
    assert ModelConfig.from_hf(dict(LLAMA, vocab_size=300.0, num_key_value_heads=None)).num_kv_heads == 4


def test_checkpoint_files_are_named(tmp_path, model):
    (tmp_path / "config.json").write_text('{"model_type": "llama", "vocab_size": 256,')
    with pytest.raises(ValueError, match=r"config.json is not valid JSON"):
        load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"config.json must hold a JSON object"):
        load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(dict(LLAMA, rope_scaling={"rope_type": "linear"})))
    with pytest.raises(ValueError, match=r"config.json: rope_scaling of type 'linear' needs 'factor'"):
        load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(dict(LLAMA, vocab_size=256, intermediate_size=128,
                                                          num_key_value_heads=2, tie_word_embeddings=False)))
    (tmp_path / "pytorch_model.bin").write_bytes(b"truncated")
    with pytest.raises(ValueError, match=r"pytorch_model.bin is not a readable weight shard"):
        load_checkpoint(tmp_path)
    torch.save({k: v for k, v in model.state_dict().items()}, tmp_path / "pytorch_model.bin")
    assert load_checkpoint(tmp_path).config.vocab_size == 256


# -- devices ----------------------------------------------------------------------------------------------------
def _pretend_cuda_is_up(monkeypatch, current=0):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)


def test_cache_on_cuda_is_accepted_by_a_model_on_cuda_0(model, monkeypatch):
    """No GPU here: the model reports cuda:0 and the cache "cuda" (as a cache built with device="cuda" did before it
    stored its pool's device); only the comparison runs."""
    cache, table, ctx = _cache(model)
    cache.device = torch.device("cuda")
    monkeypatch.setattr(cache, "check_block_table", lambda *a: None)
    monkeypatch.setattr(LlamaForCausalLM, "device", property(lambda self: torch.device("cuda", 0)))
    _pretend_cuda_is_up(monkeypatch)
    model._check_cache(cache, table, ctx, 2)
    cache.device = torch.device("cuda", 1)
    with pytest.raises(ValueError, match="cache is torch.float32 on cuda:1 but the model is torch.float32 on cuda:0"):
        model._check_cache(cache, table, ctx, 2)


def test_graph_backend_device_is_normalized(monkeypatch):
    _pretend_cuda_is_up(monkeypatch, current=1)
    assert cuda_device(None) == torch.device("cuda", 1)
    assert cuda_device("cuda") == torch.device("cuda", 1)
    assert cuda_device(torch.device("cuda")) == cuda_device("cuda:1")
    assert cuda_device("cuda:0") == torch.device("cuda", 0)
    with pytest.raises(ValueError, match="needs a CUDA device, got device='cpu'"):
        cuda_device("cpu")


def test_engine_rejects_a_drafter_on_another_device(model):
    d = EagleDrafter.for_target(model, seed=0).to("meta")
    with pytest.raises(ValueError, match="the EagleDrafter is on meta but the target is on cpu"):
        SpeculativeEngine(model, d, Strategy(2, 2, 4), max_batch_size=2, max_seq_len=16)


@pytest.mark.cuda
def test_gpu_cache_built_with_cuda_serves_a_model_on_cuda_0():
    torch.manual_seed(0)
    model = LlamaForCausalLM(ModelConfig.tiny()).to("cuda:0").eval()
    cache = PagedKVCache(model.config, 16, 4, device="cuda")
    assert cache.device == torch.device("cuda", torch.cuda.current_device())
    table, ctx = cache.allocate(2, 12)
    tokens = torch.randint(0, 256, (2, 5), device="cuda:0")
    lens = torch.tensor([5, 3], dtype=torch.int32, device="cuda:0")
    logits, _ = model.prefill(tokens, lens, cache, table, ctx)
    nxt = logits.argmax(-1)
    step, _ = model.decode(nxt, cache, table, lens)
    for b in range(2):
        seq = torch.cat([tokens[b, : int(lens[b])], nxt[b : b + 1]]).unsqueeze(0)
        dense, _ = model(seq)
        torch.testing.assert_close(step[b], dense[0, -1], rtol=1e-4, atol=1e-4)
    from tlt_kernels.drafter import NGramDrafter
    from tlt_kernels.runtime import GraphPool

    assert NGramDrafter(2, 8, device="cuda").device == torch.device("cuda", torch.cuda.current_device())
    assert GraphPool(device="cuda").backend.device == torch.device("cuda", torch.cuda.current_device())
    eng = SpeculativeEngine(model, "ngram", Strategy(2, 1, 3), max_batch_size=2, max_seq_len=32)
    assert eng.generate([[1, 2, 3], [4, 5]], 4).lengths.tolist() == [4, 4]
