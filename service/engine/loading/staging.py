"""Hot weight reload for one served module: read a checkpoint, check it, stage it, apply it.

A checkpoint is accepted only if it is the same model with other values: the same structural
config, every parameter present with its shape (tied parameters equal), no unknown tensor, every
value finite in the serving dtype. Two ways to apply it, per reload:

- swap: the new tensors are staged on the device beside the served ones (on a side stream, while
  scoring goes on); applying rebinds each parameter to its new tensor, a pause of microseconds
  between micro-batches. Needs room for a second copy.
- copy: the new tensors are staged in (pinned) host memory; applying copies them into the served
  parameters in place between micro-batches: a pause of bytes / host-to-device bandwidth, and no
  second copy on the device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from service.engine.contract import ReloadMode, ReloadOrder, Target, WeightsRejected
from service.engine.loading.checkpoint import Read, read_all, tensor_files
from service.engine.loading.names import WHOLE, Names, Piece
from service.engine.loading.names import of as names_of
from service.engine.loading.pretrained import text_config

# config fields that change what a forward computes; any difference is another model
STRUCTURAL = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "partial_rotary_factor",
    "sliding_window",
    "use_sliding_window",
    "max_window_layers",
    "layer_types",
    "attention_bias",
    "tie_word_embeddings",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "query_pre_attn_scalar",
    "logit_scale",
    "logits_scaling",
)
_GIB = 1 << 30


@dataclass(slots=True)
class Slot:
    """One served tensor and its new value (on the host for copy, on the device for swap)."""

    served: torch.Tensor
    new: torch.Tensor


@dataclass(slots=True)
class Staged:
    """New values for parameters of one module, checked and placed; `extra` is the caller's."""

    target: Target
    version: str
    source: str  # the checkpoint's path, or the push group that sent them
    mode: str  # "copy" or "swap", never "auto"
    slots: list[Slot]
    nbytes: int
    extra: Any = None


def check_config(path: Path, served: Any) -> None:
    """Refuse a checkpoint directory whose config describes another model (a file has no config)."""
    if not (path / "config.json").is_file():
        if path.is_dir():
            raise WeightsRejected(f"{path}: no config.json (a model directory needs one)")
        return
    try:
        new = text_config(path).to_dict()
    except Exception as exc:
        raise WeightsRejected(f"{path}/config.json: unreadable ({exc})") from exc
    old = served.to_dict()
    differs = [k for k in STRUCTURAL if k in old and k in new and old[k] != new[k]]
    if differs:
        detail = ", ".join(f"{k}: {new[k]!r} (serving {old[k]!r})" for k in differs[:4])
        raise WeightsRejected(f"{path}: another model than the one served: {detail}")


def stage(
    order: ReloadOrder,
    module: torch.nn.Module,
    *,
    prefix: str = "",
    allow_extra: Callable[[str], bool] = lambda name: False,
    extra: Any = None,
    read: Read = read_all,
) -> Staged:
    """Read `order.path` into new values for every parameter of `module` and place them for
    `order.mode` ("copy" or "swap"; choose with `choose_mode` first). Checkpoint names are mapped
    onto the module's tensors by loading/names.py (`prefix`: a critic's backbone saved under
    "model."). `read`: the tensors' values as the module holds them (checkpoint.sliced: a
    tensor-parallel rank's slices)."""
    if not order.path.exists():
        raise WeightsRejected(f"{order.path}: no such file or directory")
    try:
        files = tensor_files(order.path)
    except Exception as exc:
        raise WeightsRejected(f"{order.path}: not a readable safetensors checkpoint ({exc})") from exc
    if not files:
        raise WeightsRejected(f"{order.path}: no safetensors tensors found")
    names = names_of(module, prefix=prefix)
    chosen = _match(order.path, files, names, allow_extra)
    try:
        host = read(files, {name for found in chosen.values() for name, _ in found})
    except Exception as exc:
        raise WeightsRejected(f"{order.path}: unreadable ({type(exc).__name__}: {exc})") from exc
    device = next(iter(names.tensors.values())).device
    side = None
    if device.type == "cuda" and order.mode == "swap":
        side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    slots, nbytes = [], 0
    for key, found in chosen.items():
        served = names.tensors[key]
        new = _assemble(f"{order.path}: ", host, found, served)
        try:
            new = place(new, served, order.mode, side)
        except torch.OutOfMemoryError as exc:
            raise WeightsRejected(
                f"no device memory for a second copy of the weights ({nbytes / _GIB:.1f} GiB staged so "
                'far); reload with mode "copy"'
            ) from exc
        slots.append(Slot(served, new))
        nbytes += new.numel() * new.element_size()
    if side is not None:
        side.synchronize()
    return Staged(order.target, order.version, str(order.path), order.mode, slots, nbytes, extra)


def load(
    path: Path,
    module: torch.nn.Module,
    *,
    prefix: str = "",
    allow_extra: Callable[[str], bool] = lambda name: False,
    read: Read = read_all,
) -> None:
    """Read `path` into the parameters of `module`, built without its weights, in place: checked as
    `stage` checks, one served tensor at a time, so the host holds one tensor's values (or slice) at
    most."""
    files = tensor_files(path)
    names = names_of(module, prefix=prefix)
    chosen = _match(path, files, names, allow_extra)
    with torch.no_grad():
        for key, found in chosen.items():
            served = names.tensors[key]
            host = read(files, {name for name, _ in found})
            served.copy_(_assemble(f"{path}: ", host, found, served))


def apply(staged: Staged) -> None:
    """Make the staged values the served ones. Call between micro-batches, on the engine thread."""
    with torch.no_grad():
        if staged.slots and staged.slots[0].served.device.type == "cuda":
            torch.cuda.current_stream().synchronize()  # nothing still reads the old values
        for slot in staged.slots:
            if staged.mode == "swap":
                slot.served.data = slot.new
            else:
                slot.served.copy_(slot.new, non_blocking=True)
        if staged.slots and staged.slots[0].served.device.type == "cuda":
            torch.cuda.current_stream().synchronize()
    staged.slots.clear()  # the host copies (copy) or the old references (swap) go now


def choose_mode(requested: ReloadMode, module_bytes: int, device: torch.device) -> ReloadMode:
    """auto: swap when the device has room for a second copy beside its working memory, else copy.
    On the CPU the staged host tensors simply become the parameters (swap)."""
    if requested != "auto":
        return requested
    if device.type != "cuda":
        return "swap"
    free, _ = torch.cuda.mem_get_info(device)
    allocated = torch.cuda.memory_allocated(device)
    cached = torch.cuda.memory_reserved(device) - allocated
    working = max(torch.cuda.max_memory_allocated(device) - allocated, _GIB)
    return "swap" if module_bytes + working <= free + cached else "copy"


def module_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _match(
    path: Path, files: dict[str, Path], names: Names, allow_extra: Callable[[str], bool]
) -> dict[int, list[tuple[str, Piece]]]:
    """For each served tensor, the checkpoint names holding its new values; refuse gaps and strangers."""
    chosen: dict[int, list[tuple[str, Piece]]] = {}
    unknown: list[str] = []
    for name in sorted(files):
        piece = names.find(name)
        if piece is not None:
            chosen.setdefault(piece.key, []).append((name, piece))
        elif not allow_extra(name):
            unknown.append(name)
    missing = names.missing({key: [piece.part for _, piece in found] for key, found in chosen.items()})
    if missing:
        raise WeightsRejected(
            f"{path}: {len(missing)} parameters of the served model are missing, e.g. {sorted(missing)[:3]}"
        )
    if unknown:
        raise WeightsRejected(
            f"{path}: {len(unknown)} tensors the served model does not have, e.g. {unknown[:3]}"
        )
    return chosen


def _assemble(
    where: str, host: dict[str, torch.Tensor], found: list[tuple[str, Piece]], served: torch.Tensor
) -> torch.Tensor:
    """The new value of `served` from the checkpoint tensors `found` (its whole or its parts), on the
    host, in the served dtype."""
    wholes = [name for name, piece in found if piece.part == WHOLE]
    if wholes and len(wholes) != len(found):
        raise WeightsRejected(f"{where}{wholes[0]} is given both whole and by its parts")
    if wholes:
        first = checked(where, wholes[0], host[wholes[0]], tuple(served.shape), served.dtype)
        for name in wholes[1:]:
            tied = checked(where, name, host[name], tuple(served.shape), served.dtype)
            if not torch.equal(tied, first):
                raise WeightsRejected(f"{where}{wholes[0]} and {name} differ; the served model ties them")
        return first
    new = torch.empty(served.shape, dtype=served.dtype)
    for name, piece in found:
        new[piece.index] = checked(where, name, host[name], piece.shape, served.dtype)
    return new


def checked(
    where: str, name: str, value: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """`value` in `dtype`, once it has the served `shape`, a dtype that converts to it (a floating
    point value for a floating point tensor) and, converted, finite values; WeightsRejected else."""
    if tuple(value.shape) != shape:
        raise WeightsRejected(f"{where}{name} has shape {tuple(value.shape)}, the served model {shape}")
    if dtype.is_floating_point != value.dtype.is_floating_point or value.dtype.is_complex:
        raise WeightsRejected(f"{where}{name} is {value.dtype}; the served model holds it in {dtype}")
    new = value.to(dtype)
    if new.is_floating_point() and not bool(torch.isfinite(new).all()):
        bad = int((~torch.isfinite(new)).sum())
        raise WeightsRejected(f"{where}{name} has {bad} non-finite values in {dtype}")
    return new


def place(new: torch.Tensor, served: torch.Tensor, mode: str, side: torch.cuda.Stream | None) -> torch.Tensor:
    """`new` where `mode` stages it: pinned host memory (copy) or the served tensor's device (swap,
    copied on the `side` stream)."""
    if served.device.type != "cuda":
        return new.contiguous()
    if mode == "copy":  # host-to-device at full speed when applied
        if new.device.type == "cuda":  # a pushed bucket, received on the device
            return torch.empty(new.shape, dtype=new.dtype, pin_memory=True).copy_(new)
        return new.contiguous().pin_memory()
    if new.device == served.device:
        return new.contiguous()
    assert side is not None
    with torch.cuda.stream(side):
        placed = new.to(served.device, non_blocking=False)
    return placed
