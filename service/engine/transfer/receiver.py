"""The engine's side of weight pushes: the trainer groups this process joined, and per served model
the values pending under the version being pushed (pending.py).

A bucket (contract.Bucket) is received whole before anything of it is judged: every broadcast the
trainer makes is met (receive.py), then the bucket is refused (PushRefused, nothing of it kept) if
a name, shape or dtype does not fit the model or a value is not finite, else each tensor is kept as
its version's mode stages it. A group whose collective fails or stalls is torn down (PushBroken),
and every version it sent to dropped.

A version may come over several groups at once (a trainer's pipeline stages, each with a group of
its own): their buckets arrive side by side, each on its group's thread, and are kept one at a time.

Threads: `receive` runs on the thread the caller gives the group, the others on any thread; the
caller handles one group's calls one at a time, in the trainer's order (service/weights/push.py).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from service.engine.contract import (
    Bucket,
    PushBroken,
    PushRefused,
    Received,
    Target,
    WeightGroup,
    WeightsRejected,
    WeightsState,
)
from service.engine.loading import staging
from service.engine.loading.names import Names, Piece
from service.engine.transfer import group as groups
from service.engine.transfer.pending import Pending
from service.engine.transfer.receive import Misaligned, Undrainable, entries, receive

log = logging.getLogger(__name__)

# past a group's timeout, how long a bucket's receive waits more for the backend's own timeout to end
# its broadcasts before the group is aborted from here
GRACE_S = 5.0
# names a critic's push may carry that its decoder does not run (a TRL value-head model's LM head)
_CRITIC_IGNORES = ("lm_head.",)


def indexed(device: torch.device, current: Callable[[], int] = torch.cuda.current_device) -> torch.device:
    """`device` with its index: a bare "cuda" (as --device cuda gives) is the current GPU."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", current())
    return device


class PushReceiver:
    """One rank's groups and pending pushes. `modules(target)`: the module a target's weights are
    (None: not served); `names(target)`: the checkpoint names it takes (loading/names.py); `weights`:
    what each model serves now; `rank`: this process's rank within its replica (tensor parallel),
    which joins a group as rank_offset + rank."""

    def __init__(
        self,
        modules: Callable[[Target], Any],
        names: Callable[[Target], Names],
        device: torch.device,
        weights: Callable[[], Mapping[str, WeightsState]],
        rank: int = 0,
    ) -> None:
        self._modules = modules
        self._names = names
        self._device = indexed(device)  # torch.cuda.set_device takes no bare "cuda"
        self._weights = weights
        self._rank = rank
        self._groups: dict[str, groups.Joined] = {}
        self._pending: dict[Target, Pending] = {}
        self._lock = threading.Lock()
        self._side = torch.cuda.Stream(device) if device.type == "cuda" else None  # type: ignore[no-untyped-call]

    def join_group(self, spec: WeightGroup) -> None:
        with self._lock:
            if spec.name in self._groups:
                raise ValueError("The specified group name has already been used.")
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)
        joined = groups.join(spec, spec.rank_offset + self._rank, self._device)
        with self._lock:
            self._groups[spec.name] = joined
        log.info("joined weight-update group %r as rank %d of %d", spec.name, joined.rank, spec.world_size)

    def leave_group(self, name: str) -> None:
        with self._lock:
            joined = self._groups.pop(name, None)
            self._drop_from(name)
        if joined is None:
            raise KeyError(name)
        groups.leave(joined)
        log.info("left weight-update group %r", name)

    def receive(self, bucket: Bucket) -> Received:
        with self._lock:
            joined = self._groups.get(bucket.group)
            known = list(self._groups)
            pending = self._pending.get(bucket.target)
            if joined is not None:
                if pending is None:
                    pending = self._pending[bucket.target] = self._start(bucket, joined)
                if pending.version == bucket.version:
                    pending.groups.add(bucket.group)
                    pending.receiving += 1
        if joined is None:
            raise PushRefused(
                f"Group {bucket.group} not in {known}. Please call `init_weights_update_group` first."
            )
        assert pending is not None
        if pending.version != bucket.version:
            raise ValueError(f"version {pending.version!r} is pending; stage or drop it first")
        ok = False
        try:
            received = self._receive(bucket, joined, pending)
            ok = True
            return received
        finally:
            with self._lock:
                pending.receiving -= 1
                alone = not pending.receiving and not pending.values
                if not ok and alone and self._pending.get(bucket.target) is pending:
                    del self._pending[bucket.target]  # a first bucket refused: nothing is pending

    def _receive(self, bucket: Bucket, joined: groups.Joined, pending: Pending) -> Received:
        """The bucket's broadcasts met (on this group's thread; another group's may arrive meanwhile),
        then its tensors checked and kept, one bucket at a time."""
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)
        with torch.cuda.stream(self._side) if self._side is not None else contextlib.nullcontext():
            tensors = self._arrive(bucket, joined, pending)
            with self._lock:
                kept = self._checked(bucket, pending, tensors)
                for name, piece, value in kept:
                    pending.put(name, piece, value, self._side)
                if self._side is not None:
                    self._side.synchronize()
                missing = pending.missing
        return Received(
            target=bucket.target,
            version=bucket.version,
            mode=pending.mode,
            tensors=len(tensors),
            nbytes=sum(t.numel() * t.element_size() for t in tensors),
            complete=missing == 0,
            missing=missing,
        )

    def drain(self, bucket: Bucket) -> None:
        with self._lock:
            joined = self._groups.get(bucket.group)
        if joined is None:
            return
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)
        with contextlib.suppress(PushRefused):  # misaligned offsets: the bytes arrived all the same
            self._arrive(bucket, joined, None)

    def stage_received(self, target: Target, version: str) -> staging.Staged:
        with self._lock:
            pending = self._pending.pop(target, None)
        if pending is not None:
            return pending.staged(version)
        served = self._weights()[target]
        return staging.Staged(target, version, served.source, served.mode, [], 0)

    def drop_received(self, target: Target) -> None:
        with self._lock:
            self._pending.pop(target, None)

    def abort_group(self, name: str) -> None:
        """Tear the group down without the trainer (another rank of the replica lost it)."""
        with self._lock:
            joined = self._groups.get(name)
        if joined is not None:
            self._break(joined)

    def _start(self, bucket: Bucket, joined: groups.Joined) -> Pending:
        """A new pending version for the bucket's target, staged by the bucket's mode."""
        module = self._modules(bucket.target)
        if module is None:
            raise PushRefused(f"this server has no {bucket.target} model")
        spec = joined.spec  # the version's first group names its source
        source = f"push:{spec.name}@{groups.tcp_url(spec.master_address, spec.master_port)}"
        mode = staging.choose_mode(bucket.mode, staging.module_bytes(module), self._device)
        ignores = _CRITIC_IGNORES if bucket.target == "critic" else ()
        names = self._names(bucket.target)
        return Pending(bucket.target, bucket.version, {bucket.group}, source, mode, names, ignores)

    def _arrive(self, bucket: Bucket, joined: groups.Joined, pending: Pending | None) -> list[torch.Tensor]:
        """Every broadcast of the bucket, met; PushRefused (after them) when its metadata does not fit
        `pending`'s model (None: not looked at)."""
        try:
            wanted = entries(bucket)
        except Undrainable as exc:
            self._break(joined)
            raise PushBroken(
                f"{exc}: the trainer's broadcasts cannot be met; the group is torn down"
            ) from exc
        problems = pending.problems(wanted) if pending is not None else []
        deadline = time.monotonic() + joined.spec.timeout_s + GRACE_S
        try:
            tensors = receive(joined.pg, bucket, joined.device, deadline)
        except Misaligned as exc:
            raise PushRefused(str(exc)) from exc
        except Exception as exc:  # the trainer died or stalls: the group cannot go on
            self._break(joined)
            raise PushBroken(
                f"receiving failed ({type(exc).__name__}: {exc}); the group is torn down"
            ) from exc
        if problems:
            more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
            raise PushRefused("; ".join(problems[:3]) + more)
        return tensors

    @staticmethod
    def _checked(
        bucket: Bucket, pending: Pending, tensors: list[torch.Tensor]
    ) -> list[tuple[str, Piece, torch.Tensor]]:
        """Each tensor as its piece takes it; PushRefused if one does not fit or tied ones differ."""
        kept = []
        try:
            for name, tensor in zip(bucket.names, tensors, strict=False):
                checked = pending.checked(name, tensor)
                if checked is not None:
                    kept.append((name, *checked))
        except WeightsRejected as exc:
            raise PushRefused(str(exc)) from exc
        ties = pending.tie_problems(kept)
        if ties:
            raise PushRefused("; ".join(ties[:3]))
        return kept

    def _break(self, joined: groups.Joined) -> None:
        with self._lock:
            self._groups.pop(joined.spec.name, None)
            self._drop_from(joined.spec.name)
        groups.abort(joined)
        log.warning("weight-update group %r torn down", joined.spec.name)

    def _drop_from(self, name: str) -> None:
        """Drop the versions group `name` sent to (a version some of whose tensors are lost never serves)."""
        for target in [t for t, p in self._pending.items() if name in p.groups]:
            del self._pending[target]
