"""Reading safetensors checkpoints: a model directory (one file or shards with an index) or one file."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open


def tensor_files(path: Path) -> dict[str, Path]:
    """Every tensor name in the checkpoint and the safetensors file that holds it."""
    if path.is_file():
        files = [path]
    else:
        index = path / "model.safetensors.index.json"
        if index.is_file():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            return {name: path / file for name, file in weight_map.items()}
        files = sorted(path.glob("*.safetensors"))
    names: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            names.update(dict.fromkeys(f.keys(), file))
    return names


def read_tensor(files: dict[str, Path], name: str) -> torch.Tensor:
    with safe_open(str(files[name]), framework="pt") as f:
        tensor: torch.Tensor = f.get_tensor(name)
    return tensor


def read_all(
    files: dict[str, Path], names: set[str], read: Callable[[Any, str], torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """The named tensors, on the host, opening each file once; `read(opened file, name)` reads one
    (default: whole; parallel/sharding.py reads a rank's slice)."""
    by_file: dict[Path, list[str]] = {}
    for name in sorted(names):
        by_file.setdefault(files[name], []).append(name)
    tensors: dict[str, torch.Tensor] = {}
    for file, wanted in by_file.items():
        with safe_open(str(file), framework="pt") as f:
            for name in wanted:
                tensors[name] = f.get_tensor(name) if read is None else read(f, name)
    return tensors
