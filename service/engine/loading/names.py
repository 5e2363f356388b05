"""Checkpoint names -> the tensors a served module holds: the one mapping that a checkpoint reload
(loading/staging.py) and a weight push (transfer/) both use.

A Hugging Face checkpoint names a model's tensors as its release's model classes saved them; the
module that serves them may hold them otherwise:

- its own names, and every name of a tied tensor (lm_head.weight is model.embed_tokens.weight):
  one served tensor;
- a critic's backbone, saved under its base_model_prefix ("model.") or without it;
- experts: transformers 5 holds each sparse block's experts fused, gate_up_proj [E, 2I, H] (each
  expert's gate rows, then its up rows) and down_proj [E, H, I]; checkpoints and trainers name them
  per expert: `mlp.experts.{e}.gate_proj.weight` [I, H] is gate_up_proj[e, :I], `up_proj.weight`
  gate_up_proj[e, I:], `down_proj.weight` [H, I] down_proj[e] (Qwen3-MoE, Qwen2-MoE); Mixtral's
  `block_sparse_moe.experts.{e}.w1 / w3 / w2.weight` likewise, and its `block_sparse_moe.*` is `mlp.*`;
- tensor parallel: a rank holds a slice of some tensors (parallel/sharding.py's Layout.part).

A Piece says where one checkpoint tensor's values go: which served tensor, which region of it, and,
under tensor parallel, which slice of the whole checkpoint tensor this rank keeps. A served tensor is
covered by one whole piece, or by all of its parts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

WHOLE = -1  # Piece.part of a checkpoint tensor that is a whole served tensor
Index = tuple[int | slice, ...]
# a checkpoint name -> (dim, start, end) of the slice of it this rank keeps; None: all of it
Slicer = Callable[[str], tuple[int, int, int] | None]
# (served name, how the checkpoint names its per-expert gate, up and down projections)
_EXPERTS = {"mixtral": ("block_sparse_moe", "w1", "w3", "w2")}
_EXPERTS_DEFAULT = ("mlp", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True, slots=True)
class Piece:
    """Where one checkpoint tensor's values go."""

    key: int  # the served tensor: Names.tensors[key]
    part: int  # which of the served tensor's Names.parts[key] regions it fills; WHOLE: all of it
    index: Index  # that region of the served tensor; (): the whole tensor
    shape: tuple[int, ...]  # the values this rank keeps (the region's shape)
    whole: tuple[int, ...]  # the checkpoint tensor's shape (a trainer sends it whole)
    shard: tuple[int, int, int] | None = None  # (dim, start, end): the slice of it this rank keeps

    def keep(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the whole checkpoint tensor (a view)."""
        if self.shard is None:
            return whole
        dim, start, end = self.shard
        return whole.narrow(dim, start, end - start)


@dataclass(frozen=True, slots=True)
class Names:
    """Every checkpoint name a served module takes, and what it must be given to be complete."""

    tensors: dict[int, torch.Tensor]  # key -> the served tensor
    labels: dict[int, str]  # key -> the checkpoint name that says which tensor it is
    parts: dict[int, int]  # key -> how many parts cover it (a tensor of parts); absent: whole only
    required: frozenset[int]  # the keys a complete set of weights gives (parameters, value heads)
    pieces: dict[str, Piece]

    def find(self, name: str) -> Piece | None:
        return self.pieces.get(name)

    def covered(self, key: int, parts: Iterable[int]) -> bool:
        """Whether pieces of these parts give every value of the served tensor `key`."""
        seen = set(parts)
        return WHOLE in seen or (key in self.parts and len(seen) == self.parts[key])

    def missing(self, received: Mapping[int, Iterable[int]]) -> list[str]:
        """The labels of the required tensors that `received` (key -> parts) does not cover."""
        return [self.labels[key] for key in self.required if not self.covered(key, received.get(key, ()))]


def of(
    module: torch.nn.Module,
    *,
    prefix: str = "",
    extra: Mapping[str, torch.Tensor] | None = None,
    slicer: Slicer | None = None,
    whole: Callable[[str, tuple[int, ...]], tuple[int, ...]] | None = None,
) -> Names:
    """The names of `module`'s parameters and persistent buffers, as checkpoints and trainers give
    them: its own, or `prefix` + its own (a critic's backbone under "model."), experts per expert;
    `extra`: more named tensors to take (a critic's value head). `slicer` and `whole`: a
    tensor-parallel rank's slice of a checkpoint name, and the whole tensor's shape from its slice's."""
    builder = _Builder(prefix, slicer, whole)
    config = getattr(module, "config", None)
    model_type = str(getattr(config, "model_type", "") or "")
    persistent = set(module.state_dict().keys())
    named: list[tuple[str, torch.Tensor]] = list(module.named_parameters(remove_duplicate=False))
    named += [(n, b) for n, b in module.named_buffers(remove_duplicate=False) if n in persistent]
    for name, tensor in named:
        builder.tensor(name, tensor, required=isinstance(tensor, torch.nn.Parameter))
        for alias in _renamed(name, model_type):
            builder.whole(alias, tensor)
        _experts(builder, module, name, tensor, model_type)
    for name, tensor in (extra or {}).items():
        builder.tensor(name, tensor, required=True, prefixed=False)
    return builder.build()


def _renamed(name: str, model_type: str) -> list[str]:
    """Other names a checkpoint gives the served tensor `name` (Mixtral's sparse block)."""
    if model_type == "mixtral" and ".mlp." in name:
        return [name.replace(".mlp.", ".block_sparse_moe.")]
    return []


def _experts(builder: _Builder, module: Any, name: str, tensor: torch.Tensor, model_type: str) -> None:
    """The per-expert names of a sparse block's fused expert tensor (transformers 5's layout)."""
    block, _, attribute = name.rpartition(".experts.")
    if attribute not in ("gate_up_proj", "down_proj") or tensor.dim() != 3:
        return
    experts = module.get_submodule(f"{block}.experts")
    if getattr(experts, "is_transposed", False) or not getattr(experts, "is_concatenated", True):
        return
    served_block, gate, up, down = _EXPERTS.get(model_type, _EXPERTS_DEFAULT)
    layer = block.rpartition(".")[0]
    base = f"{block}.experts" if served_block == "mlp" else f"{layer}.{served_block}.experts"
    count, rows, _ = tensor.shape
    if attribute == "down_proj":
        for e in range(count):
            builder.part(f"{base}.{e}.{down}.weight", tensor, e, (e,), count)
        return
    if rows % 2:
        return
    half = rows // 2
    for e in range(count):
        builder.part(f"{base}.{e}.{gate}.weight", tensor, 2 * e, (e, slice(0, half)), 2 * count)
        builder.part(f"{base}.{e}.{up}.weight", tensor, 2 * e + 1, (e, slice(half, rows)), 2 * count)


class _Builder:
    def __init__(
        self,
        prefix: str,
        slicer: Slicer | None,
        whole: Callable[[str, tuple[int, ...]], tuple[int, ...]] | None,
    ) -> None:
        self.prefix = prefix
        self.slicer = slicer
        self.whole_shape = whole
        self.tensors: dict[int, torch.Tensor] = {}
        self.labels: dict[int, str] = {}
        self.parts: dict[int, int] = {}
        self.required: set[int] = set()
        self.pieces: dict[str, Piece] = {}

    def tensor(self, name: str, tensor: torch.Tensor, *, required: bool, prefixed: bool = True) -> None:
        key = id(tensor)
        self.tensors[key] = tensor
        self.labels.setdefault(key, (self.prefix if prefixed else "") + name)
        if required:
            self.required.add(key)
        if prefixed:
            self.whole(name, tensor)
        else:
            self._add(name, tensor, WHOLE, ())

    def whole(self, name: str, tensor: torch.Tensor) -> None:
        self._add(name, tensor, WHOLE, ())
        if self.prefix:
            self._add(self.prefix + name, tensor, WHOLE, ())

    def part(self, name: str, tensor: torch.Tensor, part: int, index: Index, parts: int) -> None:
        self.parts[id(tensor)] = parts
        self._add(name, tensor, part, index)
        if self.prefix:
            self._add(self.prefix + name, tensor, part, index)

    def _add(self, name: str, tensor: torch.Tensor, part: int, index: Index) -> None:
        shape = tuple(tensor[index].shape) if index else tuple(tensor.shape)
        shard = self.slicer(name) if self.slicer is not None else None
        whole = self.whole_shape(name, shape) if self.whole_shape is not None and shard else shape
        self.pieces[name] = Piece(id(tensor), part, index, shape, whole, shard)

    def build(self) -> Names:
        return Names(self.tensors, self.labels, self.parts, frozenset(self.required), self.pieces)
