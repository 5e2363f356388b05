"""Receive one bucket's broadcasts from the trainer (rank 0), as SGLang's servers receive them: one
broadcast per tensor in `names` order, or (flattened) one uint8 broadcast of the tensors' bytes back
to back in that order, without padding (SGLang's FlattenedTensorBucket): entry i is bytes
[start_i, start_i + numel_i * itemsize_i), viewed as its dtype and shape.

The metadata's entries pair up as SGLang's zip does (the shortest list counts). Whatever the
receiver will make of them, the trainer's broadcasts are all met first, so that it never hangs on a
bucket the server refuses; metadata that gives no byte count (a dtype torch does not know, a negative
dimension) cannot be met, and says so (Undrainable).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from service.engine.contract import Bucket

_POLL_S = (1e-5, 0.01)  # the first and the longest pause between looks at a broadcast still running


class Undrainable(ValueError):
    """Metadata that does not say how many bytes the trainer sends: its broadcasts cannot be met."""


class Misaligned(ValueError):
    """A flattened entry whose offset is not a multiple of its dtype's size (received and dropped)."""


class Stalled(TimeoutError):
    """A broadcast did not finish by the deadline (the trainer died or stalls)."""


@dataclass(frozen=True, slots=True)
class Entry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def dtype_of(name: str) -> torch.dtype | None:
    """torch's dtype of `name` ("bfloat16", "torch.bfloat16", aliases such as "half"); None: none."""
    value = getattr(torch, name.removeprefix("torch."), None)
    return value if isinstance(value, torch.dtype) else None


def entries(bucket: Bucket) -> list[Entry]:
    """The bucket's tensors, paired up as SGLang pairs them; Undrainable where one has no size."""
    out = []
    for name, dtype_name, shape in zip(bucket.names, bucket.dtypes, bucket.shapes, strict=False):
        dtype = dtype_of(dtype_name)
        if dtype is None:
            raise Undrainable(f"{name}: dtype {dtype_name!r} is not a torch dtype")
        if any(size < 0 for size in shape):
            raise Undrainable(f"{name}: shape {list(shape)} has a negative dimension")
        out.append(Entry(name, dtype, tuple(shape)))
    return out


def receive(pg: Any, bucket: Bucket, device: torch.device, deadline: float) -> list[torch.Tensor]:
    """The bucket's tensors on `device`, in order, once every broadcast arrived. Raises Undrainable
    before any broadcast; Misaligned after the bytes arrived; Stalled past `deadline` (monotonic);
    what the backend raises when the trainer goes away."""
    wanted = entries(bucket)
    if not bucket.flattened:
        tensors = [torch.empty(e.shape, dtype=e.dtype, device=device) for e in wanted]
        _wait([dist.broadcast(t, src=0, group=pg, async_op=True) for t in tensors], deadline)
        return tensors
    flat = torch.empty(sum(e.nbytes for e in wanted), dtype=torch.uint8, device=device)
    _wait([dist.broadcast(flat, src=0, group=pg, async_op=True)], deadline)
    tensors, start, misaligned = [], 0, []
    for e in wanted:
        if start % e.dtype.itemsize:
            misaligned.append(f"{e.name} ({e.dtype}) at byte {start}")
        else:
            tensors.append(flat[start : start + e.nbytes].view(e.dtype).reshape(e.shape))
        start += e.nbytes
    if misaligned:
        raise Misaligned(
            f"flattened bucket: {len(misaligned)} entries do not start at a multiple of their dtype's "
            f"size, e.g. {misaligned[0]}"
        )
    return tensors


def _wait(works: Sequence[Any], deadline: float) -> None:
    """Wait for every work, in order; Stalled past `deadline`; the work's error if it failed."""
    for work in works:
        pause = _POLL_S[0]
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise Stalled("the trainer's broadcast did not arrive in time")
            time.sleep(pause)
            pause = min(pause * 2, _POLL_S[1])
        work.wait()
