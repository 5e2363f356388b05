"""A push's tensors in buckets, each one `POST /update_weights_from_distributed` and its broadcasts.

`named_tensors` reads a source: a torch module (its `named_parameters()`, the Hugging Face names of a
transformers model), a mapping (a state dict), or an iterable of (name, tensor) pairs, which is read
lazily: a sharded trainer gathers one tensor (or layer) at a time and nothing asks for the next before
the bucket before it is under way. `buckets` groups them, in order, up to `bucket_bytes` each (a
larger tensor is a bucket of its own), moved to the group's device and cast to `dtype` (floating-point
tensors only). `Bucket.packed` lays one out for the wire:

- per tensor: one broadcast per tensor, in `names` order;
- flattened (SGLang's `flattened_bucket`): one uint8 broadcast of every tensor's bytes back to back,
  no padding; entry i is bytes [start_i, start_i + nbytes_i), which the receiver views as its dtype,
  so each start must be a multiple of its dtype's size. The entries go in decreasing item size
  (stable): every size is a power of two, so each start is a multiple of every size that follows.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

FLATTENED = "flattened_bucket"


@dataclass(slots=True)
class Bucket:
    """Tensors of one bucket, in the order they came: [name], [tensor] on the group's device."""

    names: list[str] = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)
    nbytes: int = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.names.append(name)
        self.tensors.append(tensor)
        self.nbytes += tensor.numel() * tensor.element_size()

    def packed(self, flattened: bool) -> Packed:
        """The bucket laid out for the wire (flattened: reordered by item size, then packed)."""
        order = list(range(len(self.names)))
        if flattened:
            order.sort(key=lambda i: -self.tensors[i].element_size())
        tensors = [self.tensors[i].contiguous() for i in order]
        metadata: dict[str, list[Any]] = {
            "names": [self.names[i] for i in order],
            "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors],
            "shapes": [list(t.shape) for t in tensors],
        }
        if flattened:
            import torch

            flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors])
            return Packed(metadata, [flat], len(order), self.nbytes)
        return Packed(metadata, tensors, len(order), self.nbytes)


@dataclass(frozen=True, slots=True)
class Packed:
    """A bucket ready to go: its metadata (names, dtypes, shapes) and the tensors to broadcast."""

    metadata: dict[str, list[Any]]
    broadcasts: list[torch.Tensor]
    count: int
    nbytes: int


def named_tensors(source: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of a module, a mapping or an iterable of pairs, detached, read lazily."""
    import torch

    if isinstance(source, torch.nn.Module):
        pairs: Iterable[tuple[str, torch.Tensor]] = source.named_parameters()
    elif isinstance(source, Mapping):
        pairs = source.items()
    else:
        pairs = source
    for name, tensor in pairs:
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise TypeError(f"a source yields (name, tensor) pairs; got ({type(name)}, {type(tensor)})")
        yield name, tensor.detach()


def buckets(
    pairs: Iterable[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    device: torch.device,
    dtype: torch.dtype | None,
) -> Iterator[Bucket]:
    """`pairs` in buckets of at most `bucket_bytes` (a larger tensor alone), in order, on `device`."""
    bucket = Bucket()
    for name, given in pairs:
        cast = dtype if dtype is not None and given.is_floating_point() else None
        tensor = given.to(device=device, dtype=cast)
        size = tensor.numel() * tensor.element_size()
        if bucket.names and bucket.nbytes + size > bucket_bytes:
            yield bucket
            bucket = Bucket()
        bucket.add(name, tensor)
    if bucket.names:
        yield bucket
