"""Real checkpoints: a transformers directory or a GGUF file -> :class:`LlamaForCausalLM`, and their tokenizers.

* :func:`load_pretrained` -- a local transformers directory (``config.json`` + safetensors / ``.bin`` shards,
  honouring the shard index) or a GGUF file (dequantized through transformers' GGUF reader);
* :func:`load_transformers_model` -- transformers' own model of the same checkpoint (for a peer, or a state dict);
* :func:`load_tokenizer` -- ``transformers.AutoTokenizer`` for the same path (never a hand-written tokenizer);
* :func:`chat_prompt_ids` -- a conversation through the tokenizer's chat template, ready for generation.

Local files only: every transformers call passes ``local_files_only=True``, so nothing reaches the Hugging Face
hub. ``transformers`` (and ``gguf`` + ``accelerate`` for GGUF files, which transformers needs for them) are imported
when first needed; none is a dependency of tlt-kernels.
"""
from __future__ import annotations

import gc
import importlib.util
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import List, Optional, Tuple, Union

import torch

from .checkpoint import load_checkpoint
from .llama import LlamaForCausalLM

PathLike = Union[str, Path]


def load_pretrained(path: PathLike, *, gguf_file: Optional[str] = None, device="cpu",
                    dtype: Optional[torch.dtype] = None) -> LlamaForCausalLM:
    """Build our model from a local checkpoint.

    Args:
        path: a transformers checkpoint directory (``config.json`` + shards), a ``.gguf`` file, or the directory
            holding ``gguf_file``.
        gguf_file: the GGUF file's name inside the directory ``path``.
        device: where the weights go.
        dtype: the weights' dtype. Default: the shards' own dtype for a directory; ``torch.float32`` for a GGUF
            file, whose quantized blocks are dequantized to fp32.
    Returns:
        :class:`LlamaForCausalLM` in eval mode. For a GGUF file transformers' model is built on the CPU in fp32,
        copied from, and freed before this returns.
    """
    directory, gguf_name = _resolve(path, gguf_file)
    if gguf_name is None:
        return load_checkpoint(directory, device=device, dtype=dtype)
    hf = load_transformers_model(directory, gguf_file=gguf_name)
    try:
        return LlamaForCausalLM.from_hf(hf.config, hf.state_dict(), device=device, dtype=dtype or torch.float32)
    finally:
        # Our model holds copies; drop transformers' fp32 weights now rather than at the caller's next collection.
        del hf
        gc.collect()


def load_transformers_model(path: PathLike, *, gguf_file: Optional[str] = None, dtype: Optional[torch.dtype] = None):
    """transformers' ``AutoModelForCausalLM`` of the checkpoint at ``path`` (same arguments as :func:`load_pretrained`),
    on the CPU, local files only: for a peer that runs transformers itself, or to build ours from its state dict.
    ``dtype``: default fp32 for a GGUF file (its blocks are dequantized to fp32), transformers' own for a directory."""
    directory, gguf_name = _resolve(path, gguf_file)
    transformers = _import_transformers(for_gguf=gguf_name is not None)
    if gguf_name is None:
        extra = {} if dtype is None else {"dtype": dtype}
        return transformers.AutoModelForCausalLM.from_pretrained(str(directory), local_files_only=True, **extra)
    if importlib.util.find_spec("accelerate") is None:
        # transformers refuses GGUF model loading without it (a ValueError from deep inside from_pretrained).
        raise ImportError("loading a GGUF model through transformers needs the 'accelerate' package: pip install accelerate")
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(directory), gguf_file=gguf_name, dtype=dtype or torch.float32, local_files_only=True)


def load_tokenizer(path: PathLike, *, gguf_file: Optional[str] = None):
    """``transformers.AutoTokenizer`` of the checkpoint at ``path`` (same arguments as :func:`load_pretrained`);
    for a GGUF file the vocabulary, merges and chat template are read from the file's metadata."""
    directory, gguf_name = _resolve(path, gguf_file)
    transformers = _import_transformers(for_gguf=gguf_name is not None)
    extra = {} if gguf_name is None else {"gguf_file": gguf_name}
    return transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True, **extra)


def chat_prompt_ids(tokenizer, messages: Sequence[Mapping]) -> List[int]:
    """Token ids of ``messages`` (``[{"role": "user", "content": "..."}, ...]``) through ``tokenizer``'s chat
    template with ``add_generation_prompt=True``: the prompt ends where the assistant's reply begins.

    Returns a flat ``list[int]`` whether transformers returns a list (4.x), a ``BatchEncoding`` (5.x) or a tensor.
    """
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence) or not messages:
        raise ValueError(f"messages must be a non-empty list of {{'role': ..., 'content': ...}} dicts, got {messages!r}")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {message!r}")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"tokenizer {type(tokenizer).__name__} has no chat template (tokenizer.chat_template is empty); "
                         "encode a plain prompt with tokenizer.encode instead")
    encoded = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
    return _flat_token_ids(encoded)


def _flat_token_ids(encoded) -> List[int]:
    """``list[int]`` from what ``apply_chat_template(tokenize=True)`` returns: a dict-like with ``input_ids``,
    a tensor, a list of ints, or a batch of one such list."""
    if isinstance(encoded, Mapping) or hasattr(encoded, "keys"):
        encoded = encoded["input_ids"]
    if isinstance(encoded, torch.Tensor):
        encoded = encoded.tolist()
    if isinstance(encoded, Sequence) and len(encoded) == 1 and isinstance(encoded[0], (Sequence, torch.Tensor)):
        encoded = encoded[0]  # a batch of one conversation
        encoded = encoded.tolist() if isinstance(encoded, torch.Tensor) else encoded
    if not isinstance(encoded, Sequence) or not all(isinstance(t, int) and not isinstance(t, bool) for t in encoded):
        raise TypeError(f"apply_chat_template returned {type(encoded).__name__}, not token ids")
    return list(encoded)


def _resolve(path: PathLike, gguf_file: Optional[str]) -> Tuple[Path, Optional[str]]:
    """``(directory, GGUF file name or None)`` for ``path`` / ``gguf_file``; FileNotFoundError naming what is missing."""
    path = Path(path).expanduser()
    if gguf_file is not None:
        if not path.is_dir():
            raise FileNotFoundError(f"gguf_file={gguf_file!r} is looked up in path={str(path)!r}, which is not a directory")
        if not (path / gguf_file).is_file():
            raise FileNotFoundError(f"gguf_file {str(path / gguf_file)!r} not found")
        return path, gguf_file
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {str(path)!r} not found")
        return path.parent, path.name
    if path.is_dir() and not (path / "config.json").is_file():
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        if ggufs:
            raise FileNotFoundError(f"{path} has no config.json but holds GGUF files {ggufs}: pass gguf_file= (one of "
                                    "them) or the .gguf path itself")
    return path, None


def _import_transformers(for_gguf: bool):
    """The ``transformers`` module; ImportError saying what to install (also ``gguf`` when reading a GGUF file)."""
    try:
        import transformers
    except ImportError as exc:
        raise ImportError("loading pretrained checkpoints needs the 'transformers' package: pip install transformers") from exc
    if for_gguf and importlib.util.find_spec("gguf") is None:
        # transformers' own message comes later and deeper (while parsing the file); say it up front.
        raise ImportError("reading a GGUF file needs the 'gguf' package (transformers dequantizes through it): pip install gguf")
    return transformers
