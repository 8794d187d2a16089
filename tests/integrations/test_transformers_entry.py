"""``tlt_kernels.integrations.transformers``: one call in place of ``model.generate``.

Greedy output equal to transformers' own ``generate`` (left padding, EOS and its padding after it), sampled output
with the law of ``generate``'s warpers (temperature, top-k), the generation config's defaults, the generator's
refresh after a weight update, and named errors."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from tlt_kernels.integrations.transformers import SpeculativeGenerator, _settings, speculative_generate  # noqa: E402


def _model(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return transformers.LlamaForCausalLM(cfg).eval()


def _batch():
    ids = torch.tensor([[0, 0, 0] + list(b"abcabca"), list(b"x = 1; x =")])
    mask = (torch.arange(10) >= torch.tensor([[3], [0]])).long()  # row 0 left-padded
    return ids, mask


def test_greedy_equals_transformers_generate_with_left_padding():
    model, (ids, mask) = _model(), _batch()
    want = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0)
    got = speculative_generate(model, ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0)
    assert got.dtype == torch.int64 and torch.equal(got, want)


def test_eos_stops_a_row_and_pads_it_like_generate():
    model, (ids, mask) = _model(), _batch()
    free = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0)
    eos = int(free[0, 10 + 3])  # row 0's fourth new token
    want = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=7,
                          eos_token_id=eos)
    got = speculative_generate(model, ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=7,
                               eos_token_id=eos)
    assert torch.equal(got, want)
    assert (got[0, 10 + 4:] == 7).all()


def test_sampled_first_tokens_follow_temperature_and_top_k():
    """4,000 rows of one prompt at temperature 0.8 and top-k 4: the first new token's frequencies against the
    warped softmax of the model's logits (5 standard errors)."""
    model = _model(1)
    prompt = torch.tensor([list(b"hello")])
    with torch.no_grad():
        logits = model(prompt).logits[0, -1].double() / 0.8
    kth = logits.topk(4).values[-1]
    want = torch.softmax(logits.masked_fill(logits < kth, float("-inf")), -1)
    rows = 4000
    out = speculative_generate(model, prompt.expand(rows, 5), max_new_tokens=1, do_sample=True, temperature=0.8,
                               top_k=4, seed=list(range(rows)))
    got = torch.bincount(out[:, 5], minlength=256).double() / rows
    assert (got > 0).sum() <= 4
    assert ((got - want).abs() <= 5 * (want * (1 - want) / rows).sqrt() + 1e-9).all()


def test_settings_come_from_the_generation_config_like_generate():
    model = _model()
    model.generation_config.top_k, model.generation_config.top_p = 50, 0.9
    model.generation_config.max_new_tokens = 9
    config = _settings(model, None, dict(do_sample=True, temperature=0.5), prompt_len=4)
    assert config["max_new_tokens"] == 9 and config["temperature"] == 0.5
    assert config["top_k"] == 50 and config["top_p"] == 0.9
    greedy = _settings(model, None, dict(do_sample=False), prompt_len=4)
    assert greedy["temperature"] == 0.0 and greedy["top_k"] is None and greedy["top_p"] is None


def test_a_generator_follows_its_model_after_refresh():
    model, (ids, mask) = _model(), _batch()
    generator = SpeculativeGenerator(model, max_batch_size=2, max_seq_len=32)
    before = generator.generate(ids, mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    stale = generator.generate(ids, mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    generator.refresh()
    fresh = generator.generate(ids, mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    want = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(stale, before) and torch.equal(fresh, want) and not torch.equal(fresh, before)


def test_bad_arguments_are_named():
    model, (ids, mask) = _model(), _batch()
    with pytest.raises(ValueError, match="eos_token_id"):
        speculative_generate(model, ids, max_new_tokens=2, eos_token_id=[1, 2])
    with pytest.raises(TypeError, match="num_beams"):
        speculative_generate(model, ids, max_new_tokens=2, num_beams=4)
    with pytest.raises(ValueError, match="attention_mask"):
        speculative_generate(model, ids, attention_mask=torch.zeros_like(mask), max_new_tokens=2)
    with pytest.raises(ValueError, match="input_ids"):
        speculative_generate(model, ids[0], max_new_tokens=2)
