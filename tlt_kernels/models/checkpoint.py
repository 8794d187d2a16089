"""Load a local Llama/Qwen2/Qwen3 checkpoint directory (``config.json`` + safetensors or ``.bin`` shards).

Reads files only; nothing is downloaded. ``safetensors`` is used when installed (it is not a
dependency of tlt-kernels); ``.bin`` shards are read with ``torch.load(weights_only=True)``. A shard
index (``model.safetensors.index.json`` or ``pytorch_model.bin.index.json``) decides which shards are read.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Optional, Union

import torch

from .config import ModelConfig
from .llama import LlamaForCausalLM

# transformers' names for the JSON that maps each tensor to its shard, safetensors first (what it writes).
SHARD_INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def load_state_dict(path: Union[str, Path]) -> Dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory, on the CPU: the shards its index names when it has one
    (:data:`SHARD_INDEX_FILES`), else every ``*.safetensors`` (preferred) or ``pytorch_model*.bin`` file."""
    path = Path(path)
    for name in SHARD_INDEX_FILES:
        if (path / name).is_file():
            return load_indexed_state_dict(path / name)
    st_files = sorted(path.glob("*.safetensors"))
    if st_files:
        out: Dict[str, torch.Tensor] = {}
        for f in st_files:
            out.update(_read_weight_file(f))
        return out
    bin_files = sorted(path.glob("pytorch_model*.bin"))
    if not bin_files:
        raise FileNotFoundError(f"no *.safetensors or pytorch_model*.bin files in {path}")
    out = {}
    for f in bin_files:
        out.update(_read_weight_file(f))
    return out


def load_indexed_state_dict(index_file: Union[str, Path]) -> Dict[str, torch.Tensor]:
    """The tensors of the shards a transformers shard index (``{"weight_map": {tensor name: shard file}}``) names.

    Only the listed shards are read (a directory may hold stray or older ones). A listed shard that is not there
    raises FileNotFoundError naming it and the index; a tensor its shard lacks raises ValueError naming both.
    """
    index_file = Path(index_file)
    weight_map = _read_json_object(index_file, "a transformers shard index").get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{index_file} must hold a non-empty 'weight_map' of tensor name -> shard file name")
    shards = sorted(set(weight_map.values()))
    absent = [name for name in shards if not (index_file.parent / name).is_file()]
    if absent:
        raise FileNotFoundError(f"shard {absent[0]!r} listed in {index_file} is missing from {index_file.parent}"
                                + (f" (also missing: {absent[1:]})" if len(absent) > 1 else ""))
    out: Dict[str, torch.Tensor] = {}
    for name in shards:
        out.update(_read_weight_file(index_file.parent / name))
    lacking = [(key, shard) for key, shard in weight_map.items() if key not in out]
    if lacking:
        key, shard = lacking[0]
        raise ValueError(f"{index_file} maps {key!r} to {shard!r}, which does not hold it "
                         f"({len(lacking)} listed tensor(s) absent in all)")
    return out


def _read_weight_file(f: Path) -> Dict[str, torch.Tensor]:
    """The tensors of one ``.safetensors`` or ``.bin`` shard on the CPU, chosen by the file name."""
    if f.suffix == ".safetensors":
        try:
            from safetensors.torch import load_file
        except ImportError as exc:
            raise ImportError(f"{f} is a .safetensors shard; install the 'safetensors' package to read it") from exc
        return _read_shard(f, lambda: load_file(str(f), device="cpu"))
    return _read_shard(f, lambda: torch.load(f, map_location="cpu", weights_only=True))


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
    return _read_json_object(Path(cfg_file), "a transformers config")


def _read_json_object(json_file: Path, what: str) -> dict:
    """The JSON object in ``json_file``; ValueError naming the file when it is not UTF-8 JSON holding an object
    (``what`` says what the object should be)."""
    try:
        d = json.loads(json_file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{json_file} is not valid JSON: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise ValueError(f"{json_file} is not UTF-8 text (a JSON file is): {exc}") from exc
    if not isinstance(d, dict):
        raise ValueError(f"{json_file} must hold a JSON object ({what}), got a {type(d).__name__}")
    return d


def load_checkpoint(path: Union[str, Path], device="cpu", dtype: Optional[torch.dtype] = None) -> LlamaForCausalLM:
    """Build a :class:`LlamaForCausalLM` from a local transformers-format directory.

    Args:
        path: directory with ``config.json`` (``model_type`` llama, mistral, qwen2 or qwen3) and the weight
            shards (those its shard index names, when it has one).
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
