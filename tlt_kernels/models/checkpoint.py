"""Load a local Llama/Qwen2 checkpoint directory (``config.json`` + safetensors or ``.bin`` shards).

Reads files only; nothing is downloaded. ``safetensors`` is used when installed (it is not a
dependency of tlt-kernels); ``.bin`` shards are read with ``torch.load(weights_only=True)``.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Optional, Union

import torch

from .config import ModelConfig
from .llama import LlamaForCausalLM


def load_state_dict(path: Union[str, Path]) -> Dict[str, torch.Tensor]:
    """All tensors of the ``*.safetensors`` (preferred) or ``pytorch_model*.bin`` files in ``path``, on the CPU."""
    path = Path(path)
    st_files = sorted(path.glob("*.safetensors"))
    if st_files:
        try:
            from safetensors.torch import load_file
        except ImportError as exc:
            raise ImportError(f"{path} holds .safetensors shards; install the 'safetensors' package to read them") from exc
        out: Dict[str, torch.Tensor] = {}
        for f in st_files:
            out.update(_read_shard(f, lambda f=f: load_file(str(f), device="cpu")))
        return out
    bin_files = sorted(path.glob("pytorch_model*.bin"))
    if not bin_files:
        raise FileNotFoundError(f"no *.safetensors or pytorch_model*.bin files in {path}")
    out = {}
    for f in bin_files:
        out.update(_read_shard(f, lambda f=f: torch.load(f, map_location="cpu", weights_only=True)))
    return out


def _read_shard(f: Path, read) -> Dict[str, torch.Tensor]:
    """``read()``'s tensors, or a ValueError naming the shard: a truncated or foreign file raises errors of many
    types (pickle, zip, EOF, safetensors' own), none of which says which file it was."""
    try:
        shard = read()
    except (FileNotFoundError, PermissionError, MemoryError):
        raise
    except Exception as exc:
        raise ValueError(f"{f} is not a readable weight shard: {type(exc).__name__}: {exc}") from exc
    if not isinstance(shard, dict) or not all(isinstance(v, torch.Tensor) for v in shard.values()):
        raise ValueError(f"{f} does not hold a state dict of tensors (got {type(shard).__name__})")
    return shard


def read_config(cfg_file: Union[str, Path]) -> dict:
    """The JSON object of a checkpoint's ``config.json``; invalid JSON or another JSON value raises ValueError naming
    the file (json's own error names only a line and column)."""
    cfg_file = Path(cfg_file)
    try:
        d = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{cfg_file} is not valid JSON: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise ValueError(f"{cfg_file} is not UTF-8 text (a JSON file is): {exc}") from exc
    if not isinstance(d, dict):
        raise ValueError(f"{cfg_file} must hold a JSON object (a transformers config), got a {type(d).__name__}")
    return d


def load_checkpoint(path: Union[str, Path], device="cpu", dtype: Optional[torch.dtype] = None) -> LlamaForCausalLM:
    """Build a :class:`LlamaForCausalLM` from a local transformers-format directory.

    Args:
        path: directory with ``config.json`` (``model_type`` llama or qwen2) and the weight shards.
        device, dtype: where and in which dtype to put the weights (default: the checkpoint's dtype).
    """
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{cfg_file} not found: expected a transformers checkpoint directory")
    try:
        config = ModelConfig.from_hf(read_config(cfg_file))
    except ValueError as exc:
        if str(cfg_file) in str(exc):
            raise
        raise ValueError(f"{cfg_file}: {exc}") from exc
    return LlamaForCausalLM.from_hf(config, load_state_dict(path), device=device, dtype=dtype)
