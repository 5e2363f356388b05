"""Weight pushes in SGLang's protocol: a trainer's group, the versions it pushes, and when they serve.

A trainer joins this server to its group (init_group, blocking until its rendezvous), then pushes
buckets of tensors (update), each a call answered once its broadcasts arrived and were staged. A
version's tensors stay pending, never served, until:

- every tensor the target model holds has arrived under it: the call that completes it also applies
  it (between micro-batches, through the batcher's barrier, as a checkpoint reload applies) before
  it answers;
- or the trainer ends it (commit_all: /continue_generation, /end_weight_update; or the first bucket
  of another version): what arrived applies, the rest keeps its values;
- or nothing more comes for weight_push_partial_timeout_s: it is dropped; what served goes on.

A bucket with no weight_version belongs to the version pending for its target, or starts a new one
named after the version served: "v7" -> "v7+1" -> "v7+2" (next_version). Several groups may send to
one version (a trainer's pipeline stages, each over a group of its own, as slime pushes): their
buckets are received side by side, each group's calls one at a time in arrival order (groups.py);
a version begins, serves or is dropped under its target's transition lock, once the buckets in
flight for it have arrived. A bucket of another version ends the pending one only if its group
sent to it (else 409). A push and a checkpoint reload exclude each other (gate.py). A group that
fails mid-push is torn down, with every version it sent to; the next init is accepted.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass, field

from service.batcher import Batcher
from service.core.errors import WeightPushConflict, WeightPushFailed
from service.engine.contract import (
    Bucket,
    PushBroken,
    PushRefused,
    Received,
    ScoringEngine,
    StagedWeights,
    Target,
    WeightReceiver,
)
from service.metrics import Metrics
from service.settings import Settings
from service.weights.gate import UpdateGate
from service.weights.groups import Group, Groups
from service.wire.weight_sync import InitGroup, UpdateWeights

log = logging.getLogger(__name__)

VERSION = re.compile(r"^[A-Za-z0-9._:+/@-]{1,128}$")  # settings.Version's pattern
UPDATED = "Succeeded to update parameter online."
PARTIAL = "The full weights of the ModelRunner are partially updated. Please discard the whole weights."


def next_version(served: str) -> str:
    """The name of a pushed version that came without one: the served version, plus one push."""
    match = re.fullmatch(r"(.*)\+(\d+)", served)
    return f"{match.group(1)}+{int(match.group(2)) + 1}" if match else f"{served}+1"


SERVED = "served"


@dataclass(slots=True)
class _Version:
    """A version pending for one target, and the groups that sent to it."""

    target: Target
    version: str
    groups: set[str]  # the names of the groups that sent buckets of it
    started: float  # perf_counter of its first bucket
    named: bool  # the trainer named it
    buckets: int = 0  # received
    inflight: int = 0  # buckets of it being received now
    idle: asyncio.Event = field(default_factory=asyncio.Event)  # set: none in flight
    outcome: str | None = None  # SERVED, or why it was dropped
    expiry: asyncio.Task[None] | None = None

    def __post_init__(self) -> None:
        self.idle.set()

    def enter(self, group: Group) -> None:
        self.groups.add(group.spec.name)
        self.inflight += 1
        self.idle.clear()

    def leave(self) -> None:
        self.inflight -= 1
        if not self.inflight:
            self.idle.set()


async def _arrival(arriving: asyncio.Future[Received], pending: _Version) -> Received:
    """A bucket's receive, awaited; the bucket leaves `pending`'s in flight once it has arrived or
    failed, also when its call is given up meanwhile (it arrives all the same)."""
    try:
        received = await asyncio.shield(arriving)
    except asyncio.CancelledError:
        arriving.add_done_callback(lambda done: _arrived_unheard(done, pending))
        raise
    except BaseException:
        pending.leave()
        raise
    pending.leave()
    return received


def _arrived_unheard(done: asyncio.Future[Received], pending: _Version) -> None:
    """A bucket whose call was given up has arrived (or failed): it is no longer in flight."""
    pending.leave()
    if not done.cancelled() and done.exception() is not None:
        log.warning("a bucket of %r whose call was given up failed: %s", pending.version, done.exception())


class Pusher:
    def __init__(
        self, engine: ScoringEngine, batcher: Batcher, metrics: Metrics, settings: Settings, gate: UpdateGate
    ) -> None:
        self._engine = engine
        self._batcher = batcher
        self._metrics = metrics
        self._gate = gate
        self._partial_s = settings.weight_push_partial_timeout_s
        self._mode = settings.reload_mode
        self._groups = Groups(settings, engine.info.tensor_parallel_size, metrics.weights_push_groups.set)
        self._pending: dict[Target, _Version] = {}
        # held while a target's pending version begins, serves or is dropped (never while receiving)
        self._transitions: dict[Target, asyncio.Lock] = {}
        for target in engine.weights:
            metrics.observe_push_targets(target)

    def version(self, target: Target = "policy") -> str:
        return self._engine.weights[target].version

    async def init_group(self, order: InitGroup) -> str:
        """Join the trainer's group; returns once the rendezvous is done."""
        await self._groups.join(order, self._receiver("Failed to initialize custom process group"))
        return "Succeeded to initialize custom process group."

    async def update(self, order: UpdateWeights) -> str:
        """Receive one bucket; answers once it is staged (and applied, when it completes a version).
        A bucket refused before it is received is drained all the same (the trainer is broadcasting)."""
        receiver = self._receiver("Failed to update parameter online")
        group = self._groups.joined(order.group_name)
        if group is None:
            raise WeightPushFailed(
                f"Group {order.group_name} not in {self._groups.names()}. Please call "
                "`init_weights_update_group` first."
            )
        async with group.lock:
            if group.gone:
                raise WeightPushFailed(
                    f"Failed to update parameter online: group {group.spec.name!r} is gone."
                )
            try:
                async with self._transition(order.target):
                    pending = await self._begin(group, order)
                    pending.enter(group)
            except WeightPushFailed:
                await self._drain(receiver, group, order)
                raise
            return await self._receive(receiver, group, order, pending)

    async def _begin(self, group: Group, order: UpdateWeights) -> _Version:
        """The version the bucket belongs to, pending (the one before it served if it differs and
        this group sent to it). The caller holds the target's transition lock."""
        target = order.target
        if target not in self._engine.weights:
            raise WeightPushFailed(f"Failed to update parameter online: this server has no {target} model.")
        pending = self._pending.get(target)
        version = order.weight_version or (pending.version if pending else next_version(self.version(target)))
        if not VERSION.fullmatch(version):
            raise WeightPushFailed(
                f"Failed to update parameter online: weight_version {version!r} is not a version "
                "(1-128 of A-Z a-z 0-9 . _ : + / @ -)."
            )
        if pending is not None and pending.version == version:
            return pending
        if pending is not None and group.spec.name not in pending.groups:
            raise WeightPushConflict(
                f"Failed to update parameter online: the {target}'s version {pending.version!r} is pending "
                f"from group(s) {', '.join(repr(g) for g in sorted(pending.groups))}."
            )
        if pending is not None:
            await self._commit(pending, f"a bucket of version {version!r} began")
        busy = self._gate.begin_push(target, f"a push of the {target} to {version!r}")
        if busy is not None:
            raise WeightPushConflict(f"Failed to update parameter online: {busy}.")
        pending = _Version(target, version, set(), time.perf_counter(), order.weight_version is not None)
        self._pending[target] = pending
        return pending

    async def _receive(
        self, receiver: WeightReceiver, group: Group, order: UpdateWeights, pending: _Version
    ) -> str:
        target, version = pending.target, pending.version
        arriving = asyncio.get_running_loop().run_in_executor(
            group.executor, receiver.receive, self._bucket(group, order, version)
        )
        try:
            received = await _arrival(arriving, pending)
        except PushRefused as exc:
            self._metrics.weights_push_buckets.labels(target, "refused").inc()
            if self._pending.get(target) is pending:
                if pending.buckets or pending.inflight:
                    self._arm(pending)
                else:
                    self._end(pending)
            raise WeightPushFailed(f"Failed to update parameter online: {exc}. {PARTIAL}") from exc
        except PushBroken as exc:
            self._metrics.weights_push_buckets.labels(target, "failed").inc()
            self._lost(group, str(exc))
            raise WeightPushFailed(f"Failed to update parameter online: {exc}. {PARTIAL}") from exc
        self._metrics.weights_push_buckets.labels(target, "received").inc()
        self._metrics.weights_push_bytes.labels(target).inc(received.nbytes)
        pending.buckets += 1
        if received.complete:
            async with self._transition(target):
                if self._pending.get(target) is pending:
                    await self._commit(pending, None)
        if pending.outcome == SERVED:
            named = f" Weight version updated to {version}." if pending.named else ""
            return f"{UPDATED}{named}"
        if pending.outcome is not None:
            raise WeightPushFailed(
                f"Failed to update parameter online: version {version!r} was dropped: {pending.outcome}. "
                f"{PARTIAL}"
            )
        self._arm(pending)
        return (
            f"{UPDATED} Weight version {version} is staged: it serves once complete ({received.missing} "
            "tensors to come) or committed (/continue_generation, /end_weight_update)."
        )

    async def _drain(self, receiver: WeightReceiver, group: Group, order: UpdateWeights) -> None:
        """Meet a refused bucket's broadcasts and drop them, so that the trainer does not hang."""
        self._metrics.weights_push_buckets.labels(order.target, "refused").inc()
        try:
            await asyncio.get_running_loop().run_in_executor(
                group.executor, receiver.drain, self._bucket(group, order, "drained")
            )
        except PushBroken as exc:
            self._lost(group, str(exc))

    def _bucket(self, group: Group, order: UpdateWeights, version: str) -> Bucket:
        return Bucket(
            group.spec.name,
            order.target,
            version,
            tuple(order.names),
            tuple(order.dtypes),
            tuple(tuple(shape) for shape in order.shapes),
            flattened=order.load_format == "flattened_bucket",
            mode=order.mode or self._mode,
        )

    async def commit_all(self, why: str) -> list[str]:
        """Serve every pending version as it stands (the trainer ended its push), once the calls of
        every group that came before are answered; their names."""
        served = []
        async with self._groups.quiet():
            for pending in list(self._pending.values()):
                async with self._transition(pending.target):
                    if self._pending.get(pending.target) is pending:
                        await self._commit(pending, why)
                if pending.outcome == SERVED:
                    served.append(pending.version)
        return served

    async def relabel(self, target: Target, version: str) -> str:
        """POST /update_weight_version: the pending push of `target` (else what it serves) is `version`."""
        receiver = self._receiver("Failed to update weight version")
        if not VERSION.fullmatch(version):
            raise WeightPushFailed(f"Failed to update weight version: {version!r} is not a version.")
        if target not in self._engine.weights:
            raise WeightPushFailed(f"Failed to update weight version: this server has no {target} model.")
        async with self._groups.quiet(), self._transition(target):
            pending = self._pending.get(target)
            if pending is not None:
                pending.version = version
                await self._commit(pending, "update_weight_version")
                if pending.outcome != SERVED:
                    raise WeightPushFailed(f"Failed to update weight version: {pending.outcome}.")
                return version
            busy = self._gate.begin_push(target, f"a relabelling of the {target} to {version!r}")
            if busy is not None:
                raise WeightPushConflict(f"Failed to update weight version: {busy}.")
            try:
                staged = await asyncio.to_thread(receiver.stage_received, target, version)
                await self._apply(target, staged)
            finally:
                self._gate.end_push(target)
        return version

    async def destroy_group(self, name: str) -> str:
        group = self._groups.joined(name)
        if group is None:
            raise WeightPushFailed("The group to be destroyed does not exist.")
        receiver = self._receiver("Failed to destroy custom process group")
        async with group.lock:
            for pending in [p for p in self._pending.values() if name in p.groups]:
                async with self._transition(pending.target):
                    if self._pending.get(pending.target) is pending:
                        self._drop(pending, f"group {name!r} was destroyed")
            await self._groups.leave(group, receiver)
        return "Succeeded to destroy custom process group."

    async def stop(self) -> None:
        """Drop what is pending and leave every group (the server stops)."""
        for pending in list(self._pending.values()):
            self._drop(pending, "the server stops")
        receiver = self._engine if isinstance(self._engine, WeightReceiver) else None
        await self._groups.stop(receiver)

    # ---- internals --------------------------------------------------------------------------------

    def _receiver(self, failure: str) -> WeightReceiver:
        if not isinstance(self._engine, WeightReceiver):
            raise WeightPushFailed(f"{failure}: this engine does not take pushed weights.")
        return self._engine

    def _transition(self, target: Target) -> asyncio.Lock:
        return self._transitions.setdefault(target, asyncio.Lock())

    async def _commit(self, pending: _Version, why: str | None) -> None:
        """Serve what is pending, once the buckets in flight for it have arrived (the caller holds
        its target's transition lock, so no other begins); pending.outcome says how it ended."""
        await pending.idle.wait()
        if self._pending.get(pending.target) is not pending:  # dropped meanwhile (its outcome says why)
            return
        if pending.expiry is not None:
            pending.expiry.cancel()
        self._pending.pop(pending.target, None)
        receiver = self._receiver("Failed to update parameter online")
        try:
            staged = await asyncio.to_thread(receiver.stage_received, pending.target, pending.version)
            await self._apply(pending.target, staged)
        except Exception as exc:
            pending.outcome = f"applying it failed: {exc}"
            self._metrics.weights_pushes.labels(pending.target, "failed").inc()
            log.exception("applying the pushed %s %r failed", pending.target, pending.version)
            raise WeightPushFailed(f"Failed to update parameter online: {exc}. {PARTIAL}") from exc
        finally:
            self._gate.end_push(pending.target)
        pending.outcome = SERVED
        self._metrics.weights_pushes.labels(pending.target, "applied" if why is None else "committed").inc()
        self._metrics.weights_push_seconds.labels(pending.target).observe(
            time.perf_counter() - pending.started
        )
        if why is not None:
            log.info("pushed %s %r committed as it stands (%s)", pending.target, pending.version, why)

    async def _apply(self, target: Target, staged: StagedWeights) -> None:
        old = self.version(target)
        applied = await self._batcher.apply(staged)
        self._metrics.weights_version.remove(target, old)
        self._metrics.weights_version.labels(target, self.version(target)).set(1)
        self._metrics.weights_pause_seconds.observe(applied.pause_seconds)
        log.info(
            "%s weights %r serving (pushed; paused scoring %.1f ms)",
            target,
            self.version(target),
            applied.pause_seconds * 1e3,
        )

    def _arm(self, pending: _Version) -> None:
        """(Re)start the clock after which a version nothing completes or commits is dropped."""
        if pending.expiry is not None:
            pending.expiry.cancel()
        pending.expiry = asyncio.create_task(self._expire(pending), name="logprobd-push-expiry")

    async def _expire(self, pending: _Version) -> None:
        await asyncio.sleep(self._partial_s)
        async with self._transition(pending.target):
            if self._pending.get(pending.target) is pending and not pending.inflight:
                self._drop(pending, f"neither complete nor committed within {self._partial_s:g} s")

    def _drop(self, pending: _Version, why: str) -> None:
        if pending.expiry is not None and pending.expiry is not asyncio.current_task():
            pending.expiry.cancel()
        pending.outcome = why
        self._end(pending)
        if isinstance(self._engine, WeightReceiver):
            self._engine.drop_received(pending.target)
        self._metrics.weights_pushes.labels(pending.target, "dropped").inc()
        log.warning("pushed %s %r dropped: %s", pending.target, pending.version, why)

    def _end(self, pending: _Version) -> None:
        if self._pending.get(pending.target) is pending:
            del self._pending[pending.target]
        self._gate.end_push(pending.target)

    def _lost(self, group: Group, why: str) -> None:
        """The group broke (the engine tore it down, and dropped what it sent to): forget it and the
        versions it sent to."""
        for pending in [p for p in self._pending.values() if group.spec.name in p.groups]:
            if pending.expiry is not None:
                pending.expiry.cancel()
            pending.outcome = f"group {group.spec.name!r} broke"
            self._end(pending)
            self._metrics.weights_pushes.labels(pending.target, "dropped").inc()
            log.warning("pushed %s %r dropped: %s", pending.target, pending.version, why)
        self._groups.forget(group)
