"""A tiny target model trained offline, so draft acceptance rates in tests and benchmarks are real.

Corpus: the Python standard library's own source files (read from ``sysconfig.get_paths()["stdlib"]``,
present on every CPython install, nothing downloaded), byte-level tokens (vocab 256), files separated
by byte 0 (:data:`SEPARATOR`, never present in source). Two mixes:

* ``"base"``: the top-level modules (``argparse.py``, ``typing.py``, ...), the training distribution;
* ``"shifted"``: modules inside packages (``asyncio/``, ``email/``, ``json/``, ...), a different
  style and vocabulary that stands in for the policy drift of RL training (the drafter, trained on the
  base mix, sees its acceptance drop on it).
"""
from __future__ import annotations

import contextlib
import math
import os
import sysconfig
import warnings
from pathlib import Path
from typing import Iterator, List, Optional, Set

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .config import ModelConfig
from .llama import LlamaForCausalLM

SEPARATOR = 0
VOCAB_SIZE = 256
_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


def corpus_files(kind: str = "base") -> List[Path]:
    """Sorted ``.py`` files of one mix (``"base"`` or ``"shifted"``)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    if kind == "base":
        files = root.glob("*.py")
    elif kind == "shifted":
        files = []
        for top in sorted(d for d in root.iterdir() if d.is_dir() and d.name not in _SKIP_DIRS):
            for dirpath, dirnames, filenames in os.walk(top):
                # Prune in place so test suites (and site-packages, which lives here) are never walked.
                dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
                files += [Path(dirpath) / f for f in filenames if f.endswith(".py")]
    else:
        raise ValueError(f"kind must be 'base' or 'shifted', got {kind!r}")
    out = sorted(files)
    if not out:
        raise FileNotFoundError(f"no {kind} corpus files under {root}: is the Python standard library source installed?")
    return out


def load_corpus(kind: str = "base", max_bytes: int = 4_000_000) -> torch.Tensor:
    """``int64 [N]`` byte tokens of the first files of a mix (sorted by path) up to ``max_bytes``."""
    chunks, total = [], 0
    for path in corpus_files(kind):
        data = path.read_bytes().replace(b"\x00", b"")
        chunks.append(data + bytes([SEPARATOR]))
        total += len(chunks[-1])
        if total >= max_bytes:
            break
    buf = b"".join(chunks)[:max_bytes]
    return torch.frombuffer(bytearray(buf), dtype=torch.uint8).to(torch.int64)


def shifted_corpus(max_bytes: int = 4_000_000) -> torch.Tensor:
    """The ``"shifted"`` mix as ``int64 [N]`` byte tokens (see the module docstring)."""
    return load_corpus("shifted", max_bytes)


def sample_windows(corpus: torch.Tensor, num: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """``int64 [num, length]`` random contiguous windows of ``corpus`` (e.g. prompts)."""
    if corpus.numel() <= length:
        raise ValueError(f"corpus has {corpus.numel()} tokens, need more than length={length}")
    starts = torch.randint(0, corpus.numel() - length, (num,), generator=generator)
    return corpus[starts.unsqueeze(1) + torch.arange(length)]


def _next_byte_step(model: LlamaForCausalLM, opt: torch.optim.Optimizer, batch: torch.Tensor) -> torch.Tensor:
    """One optimizer step of next-byte cross-entropy on ``batch int64 [N, S + 1]`` (bf16 autocast on the GPU,
    gradients clipped at 1); returns the loss."""
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=batch.device.type == "cuda"):
        logits, _ = model(batch[:, :-1], validate=False)  # bytes < 256 <= vocab_size, checked by the callers
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss


def train_tiny_target(
    config: Optional[ModelConfig] = None,
    steps: int = 200,
    device="cpu",
    seed: int = 0,
    *,
    batch_size: int = 16,
    seq_len: int = 128,
    lr: float = 3e-3,
    corpus: Optional[torch.Tensor] = None,
    losses: Optional[list] = None,
) -> LlamaForCausalLM:
    """Train a byte-level :class:`LlamaForCausalLM` on ``corpus`` (default: the base mix) and return it in eval mode (fp32).

    AdamW with linear warm-up and cosine decay, gradient clipping at 1. Deterministic for a given
    ``seed`` on the CPU. ``losses``, when given, receives the training loss of every step.
    Sizes: :meth:`ModelConfig.tiny` with ~100 steps takes seconds on a CPU;
    :meth:`ModelConfig.small` with ~2000 steps, ``batch_size=64, seq_len=256`` takes minutes on a GPU.
    """
    config = config or ModelConfig.tiny(VOCAB_SIZE)
    if config.vocab_size < VOCAB_SIZE:
        raise ValueError(f"config.vocab_size must be >= {VOCAB_SIZE} for byte tokens, got {config.vocab_size}")
    device = torch.device(device)
    corpus = load_corpus("base") if corpus is None else corpus
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.to(device).train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))
    warmup = max(1, steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return lr * (step + 1) / warmup
        return lr * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    for step in range(steps):
        batch = sample_windows(corpus, batch_size, seq_len + 1, gen).to(device)
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        loss = _next_byte_step(model, opt, batch)
        if losses is not None:
            losses.append(loss.item())
    return model.eval()


@contextlib.contextmanager
def deterministic_training(enabled: bool = True, seen: Optional[Set[str]] = None) -> Iterator[Set[str]]:
    """Run the block with ``torch.use_deterministic_algorithms(True, warn_only=True)``, so that training on a GPU
    repeats bit for bit run to run on the same card and software (atomics-based backward kernels, such as the
    embedding's, switch to deterministic ones). Yields ``seen`` (a new set when None), which receives on exit the
    first line of each warning of an op that has no deterministic kernel (such an op keeps running,
    nondeterministically); other warnings are passed on. Uninitialized memory is not filled inside the block
    (``torch.utils.deterministic.fill_uninitialized_memory``: a training loop never reads it), and every setting is
    restored on exit. For cuBLAS, ``CUBLAS_WORKSPACE_CONFIG`` is set to ``:4096:8`` when
    unset: it only takes effect if the process has not used cuBLAS yet. Attention
    (``F.scaled_dot_product_attention``) runs on its math backend inside the block: the fused backends' backward
    passes (cuDNN, flash, memory-efficient) stay nondeterministic under ``warn_only`` (they only warn; a GPU run
    can pick cuDNN's), while the math one is matmuls and a softmax. ``enabled=False``: a no-op."""
    seen = set() if seen is None else seen
    if not enabled:
        yield seen
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.utils.deterministic.fill_uninitialized_memory)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    try:
        with warnings.catch_warnings(record=True) as caught, sdpa_kernel(SDPBackend.MATH):
            warnings.simplefilter("always")
            yield seen
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.utils.deterministic.fill_uninitialized_memory = before[2]
    for w in caught:
        if "deterministic" in str(w.message):
            seen.add(str(w.message).splitlines()[0][:200])
        else:  # not ours to swallow
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)


def finetune_target(model: LlamaForCausalLM, corpus: torch.Tensor, steps: int, generator: torch.Generator, *,
                    lr: float = 1e-3, batch_size: int = 32, seq_len: int = 256) -> float:
    """Continue training ``model`` in place on ``corpus`` for ``steps`` AdamW steps (constant ``lr``, gradient clipping
    at 1, bf16 autocast on the GPU): the benchmarks' stand-in for one RL update of the policy (pass the shifted mix).
    Parameters are updated in place, so CUDA graphs captured over them replay the new weights. Returns the last
    step's loss; leaves the model in eval mode."""
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    if model.config.vocab_size < VOCAB_SIZE:
        raise ValueError(f"model.config.vocab_size must be >= {VOCAB_SIZE} for byte tokens, got {model.config.vocab_size}")
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95))
    loss = torch.zeros(())
    for _ in range(steps):
        loss = _next_byte_step(model, opt, sample_windows(corpus, batch_size, seq_len + 1, generator).to(model.device))
    model.eval()
    return float(loss.detach())


@torch.no_grad()
def eval_loss(model: LlamaForCausalLM, corpus: torch.Tensor, *, num: int = 16, seq_len: int = 128, seed: int = 1) -> float:
    """Mean next-byte cross-entropy (nats) of ``model`` on ``num`` random windows of ``corpus``."""
    batch = sample_windows(corpus, num, seq_len + 1, torch.Generator().manual_seed(seed)).to(model.device)
    logits, _ = model(batch[:, :-1])
    return float(F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)))
