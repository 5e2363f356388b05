"""A push's buckets on the wire, in the group rank 0 made: for each bucket, `POST
/update_weights_from_distributed` to every replica in flight (each answers once the bucket arrived
and was staged) while rank 0 broadcasts it, then the answers. While one bucket is under way the next
is gathered and packed, and no more: the source is read one bucket ahead of the wire.

A replica that refuses a bucket after receiving it (metadata that does not fit its model) answers
once the broadcasts are done, so the wait ends normally and the refusal is raised. One that refuses
before receiving (it has no such group, a conflict) leaves the broadcasts waiting for it: the wait
ends REFUSAL_GRACE_S after its answer, raising it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from service.client._buckets import Packed, buckets
from service.client._fleet import Fleet, Reply, failure
from service.client._rank0 import Rank0, uses_cuda
from service.client.errors import LogprobdError

if TYPE_CHECKING:
    import torch

REFUSAL_GRACE_S = 2.0  # a refusal before the broadcasts completed: how long they may still complete
_POLL_S = (1e-4, 0.01)  # first and longest pause between looks at a bucket's broadcasts


@dataclass(frozen=True, slots=True)
class Sent:
    buckets: int
    tensors: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class Push:
    """What every bucket of one push carries besides its tensors, and how they are laid out."""

    fields: dict[str, Any]  # group_name, weight_version, target, load_format, ...
    bucket_bytes: int
    flattened: bool
    dtype: torch.dtype | None
    timeout_s: float
    what: str  # "the policy's version 'step-3'", for errors


@dataclass(slots=True)
class _Flight:
    """A bucket under way: its broadcasts' works and the replicas' answers to come."""

    index: int
    packed: Packed  # keeps the broadcast tensors alive until they are sent
    replies: list[Future[Reply]]
    works: list[Any]


def send(fleet: Fleet, rank0: Rank0, pairs: Iterator[tuple[str, torch.Tensor]], push: Push) -> Sent:
    """Every bucket of `pairs`; raises naming each replica that failed one (the caller tears down)."""
    import torch

    device = torch.device("cuda", torch.cuda.current_device()) if uses_cuda(rank0.backend) else None
    flight: _Flight | None = None
    count = tensors = nbytes = 0
    for bucket in buckets(pairs, push.bucket_bytes, device or torch.device("cpu"), push.dtype):
        packed = bucket.packed(push.flattened)
        del bucket
        if flight is not None:
            _land(fleet, flight, push)
        bodies = [{**packed.metadata, **push.fields}] * len(fleet.urls)
        replies = fleet.send("POST", "/update_weights_from_distributed", bodies, timeout=push.timeout_s + 60)
        works = [rank0.broadcast(t) for t in packed.broadcasts]
        flight = _Flight(count, packed, replies, works)
        count, tensors, nbytes = count + 1, tensors + packed.count, nbytes + packed.nbytes
    if flight is not None:
        _land(fleet, flight, push)
    return Sent(count, tensors, nbytes)


def _land(fleet: Fleet, flight: _Flight, push: Push) -> None:
    """Wait for a bucket's broadcasts and every replica's answer; raise naming each that failed."""
    what = f"bucket {flight.index} of {push.what}"
    deadline = time.monotonic() + push.timeout_s + 60
    refused_at: float | None = None
    pause = _POLL_S[0]
    while True:
        sent = all(work.is_completed() for work in flight.works)
        answered = [f.result() for f in flight.replies if f.done()]
        if sent and len(answered) == len(flight.replies):
            break
        now = time.monotonic()
        refused = [reply for reply in answered if not reply.ok]
        if refused and not sent and refused_at is None:
            refused_at = now
        if refused_at is not None and now - refused_at > REFUSAL_GRACE_S:
            raise _named(failure(refused, f"{what} (refused before its broadcasts were received)"))
        if now > deadline:
            waiting = [url for url, f in zip(fleet.urls, flight.replies, strict=True) if not f.done()]
            raise LogprobdError(
                f"{what}: no end within {push.timeout_s:g} s (broadcasts "
                f"{'sent' if sent else 'under way'}; no answer from {', '.join(waiting) or 'none'})",
                error_type="timeout",
            )
        time.sleep(pause)
        pause = min(pause * 2, _POLL_S[1])
    error = failure(answered, what)
    try:
        for work in flight.works:
            work.wait()
    except Exception as exc:
        broken = f"{what}: broadcasting failed: {exc}"
        if error is None:
            raise LogprobdError(broken, error_type="broadcast_failed") from exc
        error.message = f"{error.message}; {broken}"
        error.args = (error.message,)
    if error is not None:
        raise error


def _named(error: LogprobdError | None) -> LogprobdError:
    assert error is not None  # called with at least one refusal
    return error
