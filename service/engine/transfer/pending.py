"""The values a trainer pushed for one served model under one version, not served yet.

Each received tensor is checked against the piece of the model its name maps to (loading/names.py:
shape, a dtype it converts to, finite once converted), cut to this rank's slice, and kept where the
version's mode stages it: on the device beside the served weights (swap), or in pinned host memory
(copy: the device holds one bucket at most beyond the served weights, while it arrives; one per
group when several push at once). A tensor of parts (a fused expert tensor, sent expert by expert)
starts as a copy of its served value, so parts that never come keep theirs. `staged` hands the lot
to the reload's apply (loading/staging.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from service.engine.contract import Target, WeightsRejected
from service.engine.loading import staging
from service.engine.loading.names import WHOLE, Names, Piece
from service.engine.transfer.receive import Entry


@dataclass(slots=True)
class Pending:
    """What arrived for `target` under `version`, from the trainer groups in `groups` (several: a
    trainer's pipeline stages, each pushing its layers over a group of its own)."""

    target: Target
    version: str
    groups: set[str]
    source: str
    mode: str  # swap | copy
    names: Names
    ignores: tuple[str, ...] = ()  # name prefixes taken and dropped (a critic's LM head)
    receiving: int = 0  # buckets of it being received now
    values: dict[int, torch.Tensor] = field(default_factory=dict)  # key -> its new value, staged
    parts: dict[int, set[int]] = field(default_factory=dict)  # key -> the parts received
    whole_from: dict[int, str] = field(default_factory=dict)  # key -> the name its whole value came by

    def problems(self, entries: list[Entry]) -> list[str]:
        """Why these entries do not fit the model, from their metadata alone (before they arrive)."""
        found = []
        for e in entries:
            piece = self.names.find(e.name)
            if piece is None and e.name.startswith(self.ignores):
                continue
            if piece is None:
                found.append(f"{e.name}: the served {self.target} has no such tensor")
            elif e.shape != piece.whole:
                found.append(
                    f"{e.name}: shape {list(e.shape)}, the served {self.target} takes {list(piece.whole)}"
                )
            else:
                served = self.names.tensors[piece.key]
                if served.dtype.is_floating_point != e.dtype.is_floating_point or e.dtype.is_complex:
                    found.append(f"{e.name}: dtype {e.dtype} for a tensor served in {served.dtype}")
        return found

    def checked(self, name: str, whole: torch.Tensor) -> tuple[Piece, torch.Tensor] | None:
        """The piece `name` fills and this rank's part of `whole`, in the served dtype (None: a name
        dropped); WeightsRejected when it does not fit (problems() first) or holds non-finite values."""
        piece = self.names.find(name)
        if piece is None and name.startswith(self.ignores):
            return None
        if piece is None:
            raise WeightsRejected(f"{name}: the served {self.target} has no such tensor")
        served = self.names.tensors[piece.key]
        if tuple(whole.shape) != piece.whole:
            raise WeightsRejected(
                f"{name}: shape {list(whole.shape)}, the served {self.target} takes {list(piece.whole)}"
            )
        return piece, staging.checked("", name, piece.keep(whole), piece.shape, served.dtype)

    def tie_problems(self, kept: list[tuple[str, Piece, torch.Tensor]]) -> list[str]:
        """Tied names (one served tensor) whose values differ, in these or against those pending."""
        first: dict[int, tuple[str, torch.Tensor]] = {}
        for key, name in self.whole_from.items():
            first[key] = (name, self.values[key])
        found = []
        for name, piece, value in kept:
            if piece.part != WHOLE:
                continue
            earlier = first.setdefault(piece.key, (name, value))
            if earlier[0] != name and not torch.equal(earlier[1].to(value.device), value):
                found.append(f"{earlier[0]} and {name} differ; the served {self.target} ties them")
        return found

    def put(self, name: str, piece: Piece, value: torch.Tensor, side: torch.cuda.Stream | None) -> None:
        """Keep `value` (checked, ties too) as `piece`'s new values."""
        served = self.names.tensors[piece.key]
        if piece.part == WHOLE:
            earlier = self.whole_from.get(piece.key)
            if earlier is not None and earlier != name:
                return  # a tied name, equal to what came before
            self.values[piece.key] = staging.place(_owned(value), served, self.mode, side)
            self.whole_from[piece.key] = name
            self.parts[piece.key] = {WHOLE}
            return
        if piece.key not in self.values:  # the parts that never come keep their served values
            initial = served.detach()
            if self.mode == "swap" or served.device.type != "cuda":  # else place copies it to the host
                initial = initial.clone()
            self.values[piece.key] = staging.place(initial, served, self.mode, side)
        self.values[piece.key][piece.index].copy_(value)
        self.parts.setdefault(piece.key, set()).add(piece.part)

    @property
    def missing(self) -> int:
        return len(self.names.missing(self.parts))

    @property
    def nbytes(self) -> int:
        return sum(v.numel() * v.element_size() for v in self.values.values())

    def staged(self, version: str) -> staging.Staged:
        """Every value pending, to apply as `version` (what never arrived keeps its served value)."""
        slots = [staging.Slot(self.names.tensors[key], value) for key, value in self.values.items()]
        return staging.Staged(self.target, version, self.source, self.mode, slots, self.nbytes)


def _owned(value: torch.Tensor) -> torch.Tensor:
    """`value` in storage of its own: a view into a flattened bucket, or a rank's slice of a whole
    tensor, would keep the rest of it alive."""
    whole = value.untyped_storage().nbytes()
    if value.is_contiguous() and whole == value.numel() * value.element_size():
        return value
    return value.clone(memory_format=torch.contiguous_format)
