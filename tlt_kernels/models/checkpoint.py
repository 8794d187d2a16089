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
            out.update(load_file(str(f), device="cpu"))
        return out
    bin_files = sorted(path.glob("pytorch_model*.bin"))
    if not bin_files:
        raise FileNotFoundError(f"no *.safetensors or pytorch_model*.bin files in {path}")
    out = {}
    for f in bin_files:
        out.update(torch.load(f, map_location="cpu", weights_only=True))
    return out


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
    config = ModelConfig.from_hf(json.loads(cfg_file.read_text()))
    return LlamaForCausalLM.from_hf(config, load_state_dict(path), device=device, dtype=dtype)
