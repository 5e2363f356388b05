"""Reading safetensors checkpoints: a model directory (one file or shards with an index) or one file;
whole tensors, or the slices a tensor-parallel rank holds (`sliced`)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

# tensor files (tensor_files) and the names wanted -> those tensors, on the host
Read = Callable[[dict[str, Path], set[str]], dict[str, torch.Tensor]]
# a tensor's name -> (dim, start, end): the slice [start, end) along dim 0 or 1 to read; None: whole
Part = Callable[[str], tuple[int, int, int] | None]


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
    (default: whole; `sliced` reads a rank's slice)."""
    by_file: dict[Path, list[str]] = {}
    for name in sorted(names):
        by_file.setdefault(files[name], []).append(name)
    tensors: dict[str, torch.Tensor] = {}
    for file, wanted in by_file.items():
        with safe_open(str(file), framework="pt") as f:
            for name in wanted:
                tensors[name] = f.get_tensor(name) if read is None else read(f, name)
    return tensors


def sliced(part: Part) -> Read:
    """A Read of the slice `part` names of each tensor (a tensor-parallel rank's:
    parallel/sharding.py's Layout.part), or of the whole tensor where it names none; only the slices'
    bytes are read (`safe_open(...).get_slice`)."""

    def one(opened: Any, name: str) -> torch.Tensor:
        where = part(name)
        if where is None:
            whole: torch.Tensor = opened.get_tensor(name)
            return whole
        dim, start, end = where
        view = opened.get_slice(name)
        piece: torch.Tensor = view[start:end] if dim == 0 else view[:, start:end]
        return piece

    def read(files: dict[str, Path], names: set[str]) -> dict[str, torch.Tensor]:
        return read_all(files, names, one)

    return read
