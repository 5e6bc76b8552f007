"""Local Hugging Face checkpoint directories: `config.json`, `*.safetensors`, tokenizer files.

Weights are read only from safetensors (one file or shards, with or without
`model.safetensors.index.json`); pickled `*.bin` weights are refused, never unpickled.
Floating tensors are converted to float32; non-floating buffers (e.g. old causal masks)
are not parameters and are skipped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import torch
from safetensors import SafetensorError, safe_open

from llmrt.errors import CheckpointError
from llmrt.weights.tokenizer import Tokenizer
from llmrt.weights.tokenizer_files import read_json, read_tokenizer_dir

INDEX_FILE = "model.safetensors.index.json"
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")


@attrs.frozen(kw_only=True)
class DirectoryContents:
    """A checkpoint directory read into memory: config dict, float32 tensors, tokenizer."""

    hf_config: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    tokenizer: Tokenizer | None


def read_safetensors_dir(path: Path) -> DirectoryContents:
    """Read the Hugging Face checkpoint directory at `path`."""
    if not path.is_dir():
        raise CheckpointError(str(path), "checkpoint directory not found")
    hf_config = read_json(path / "config.json", required=True)
    if not isinstance(hf_config.get("model_type"), str):
        raise CheckpointError(f"{path / 'config.json'}: model_type", "missing field")
    tensors: dict[str, torch.Tensor] = {}
    stored: dict[str, Path] = {}
    files, index = _weight_files(path)
    for file in files:
        for name, tensor in _read_weights(file, stored=stored).items():
            tensors[name] = tensor
    for name, file_name in index.items():
        if stored.get(name, path / file_name) != path / file_name:
            raise CheckpointError(name, f"{INDEX_FILE} puts it in {file_name}, found elsewhere")
        if name not in stored:
            raise CheckpointError(name, f"listed in {INDEX_FILE} but missing from {file_name}")
    tokenizer = read_tokenizer_dir(path, hf_config=hf_config)
    return DirectoryContents(hf_config=hf_config, tensors=tensors, tokenizer=tokenizer)


def _weight_files(path: Path) -> tuple[list[Path], dict[str, str]]:
    """The weight files to read, and the index's tensor -> file map ({} without an index)."""
    index_path = path / INDEX_FILE
    if index_path.is_file():
        weight_map = read_json(index_path, required=True).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index_path}: weight_map", "missing or empty")
        files = [path / str(name) for name in dict.fromkeys(weight_map.values())]
        for file in files:
            if not file.is_file():
                raise CheckpointError(str(file), f"listed in {INDEX_FILE} but not found")
        return files, {str(k): str(v) for k, v in weight_map.items()}
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files, {}
    pickled = sorted(p.name for p in path.iterdir() if p.suffix in _PICKLE_SUFFIXES)
    if pickled:
        raise CheckpointError(
            str(path),
            f"only pickled PyTorch weights ({', '.join(pickled)}); llmrt never unpickles "
            "checkpoints - convert them to safetensors (e.g. save_pretrained(..., "
            "safe_serialization=True))",
        )
    raise CheckpointError(str(path), "no *.safetensors weight files")


def _read_weights(file: Path, *, stored: dict[str, Path]) -> dict[str, torch.Tensor]:
    """Float tensors of `file` as float32; records every name (floating or not) in `stored`."""
    tensors = {}
    try:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a dict
                if name in stored:
                    raise CheckpointError(name, f"stored in {stored[name].name} and {file.name}")
                stored[name] = file
                tensor = handle.get_tensor(name)
                if tensor.is_floating_point():
                    tensors[name] = tensor.to(torch.float32)
    except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
        raise CheckpointError(str(file), f"corrupt or unreadable safetensors file: {exc}") from exc
    return tensors
