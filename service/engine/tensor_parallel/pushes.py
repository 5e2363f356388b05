"""Weight pushes under tensor parallel: every rank of the replica joins the trainer's group (as
rank_offset + its rank), receives each bucket whole and keeps its own slice (transfer/).

Rank 0 sends each push call down the followers' pipes, ("push", (op, argument)), makes the same call
on its own scorer meanwhile (a group's rendezvous and broadcasts need every rank at once), then
gathers the followers' answers, ("pushed", error kind, message); one call at a time across the
replica, so several groups' buckets (a trainer's pipeline stages) arrive one after another. A
follower makes push calls on a thread of its own, one at a time in the order sent, beside its
scoring loop; a version it stages is kept for the "apply" that reaches it in the scoring stream, as
a reload's is.

The ranks see the same broadcasts and check the same metadata, so they agree; if they do not, or a
group broke on one rank, the replica tears the group down on every rank (PushBroken), or drops the
version pending on every rank (PushRefused), rather than serve ranks at different weights.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from service.engine.contract import (
    Bucket,
    PushBroken,
    PushRefused,
    Received,
    StagedWeights,
    Target,
    WeightGroup,
)
from service.engine.scorer.engine import PackedScorer

_KINDS: dict[str, type[Exception]] = {"PushRefused": PushRefused, "PushBroken": PushBroken}


class Follower(Protocol):
    rank: int

    def send(self, message: tuple[str, Any]) -> None: ...

    def reply(self, kind: str) -> tuple[Any, ...]: ...


class Pushes:
    """Rank 0's side: each push call made on every rank, the answers joined."""

    def __init__(self, scorer: PackedScorer, followers: Sequence[Follower]) -> None:
        self._scorer = scorer
        self._followers = followers
        self._lock = threading.Lock()  # one call's answers at a time

    def join_group(self, group: WeightGroup) -> None:
        errors = self._across("join_group", group, lambda: self._scorer.join_group(group))
        if errors:
            self._across("abort_group", group.name, lambda: self._scorer.receiver.abort_group(group.name))
            raise _joined(errors)

    def leave_group(self, name: str) -> None:
        errors = self._across("leave_group", name, lambda: self._scorer.leave_group(name))
        if errors:
            raise _joined(errors)

    def receive(self, bucket: Bucket) -> Received:
        box: list[Received] = []
        errors = self._across("receive", bucket, lambda: box.append(self._scorer.receive(bucket)))
        if not errors:
            return box[0]
        if any(isinstance(e, PushBroken) for _, e in errors):
            self._across("abort_group", bucket.group, lambda: self._scorer.receiver.abort_group(bucket.group))
            raise PushBroken(_message(errors))
        if len(errors) <= len(self._followers):  # some ranks kept the bucket: none keeps the version
            self.drop_received(bucket.target)
            raise PushRefused(f"{_message(errors)}; the ranks disagreed: the pending version was dropped")
        raise _joined(errors)

    def drain(self, bucket: Bucket) -> None:
        errors = self._across("drain", bucket, lambda: self._scorer.drain(bucket))
        if any(isinstance(e, PushBroken) for _, e in errors):
            self._across("abort_group", bucket.group, lambda: self._scorer.receiver.abort_group(bucket.group))
        if errors:
            raise _joined(errors)

    def stage_received(self, target: Target, version: str) -> StagedWeights:
        box: list[StagedWeights] = []
        errors = self._across(
            "stage_received",
            (target, version),
            lambda: box.append(self._scorer.stage_received(target, version)),
        )
        if errors:
            self.drop_received(target)
            raise _joined(errors)
        return box[0]

    def drop_received(self, target: Target) -> None:
        errors = self._across("drop_received", target, lambda: self._scorer.drop_received(target))
        if errors:
            raise _joined(errors)

    def _across(self, op: str, argument: Any, local: Callable[[], Any]) -> list[tuple[str, Exception]]:
        """`op` on every rank at once; the (rank, error) of those where it failed."""
        with self._lock:
            for follower in self._followers:
                follower.send(("push", (op, argument)))
            errors: list[tuple[str, Exception]] = []
            try:
                local()
            except Exception as exc:  # the followers' answers are read all the same
                errors.append(("rank 0", exc))
            for follower in self._followers:
                _, kind, message = follower.reply("pushed")
                if kind is not None:
                    errors.append((f"rank {follower.rank}", _KINDS.get(kind, RuntimeError)(message)))
            return errors


def serve(
    scorer: PackedScorer, send: Callable[[tuple[Any, ...]], None], call: Any, staged: dict[str, Any]
) -> None:
    """A follower's side of one push call (on its push thread); a version it stages goes to `staged`,
    for the scoring loop's "apply"."""
    op, argument = call
    try:
        if op == "join_group":
            scorer.join_group(argument)
        elif op == "leave_group":
            scorer.leave_group(argument)
        elif op == "abort_group":
            scorer.receiver.abort_group(argument)
        elif op == "receive":
            scorer.receive(argument)
        elif op == "drain":
            scorer.drain(argument)
        elif op == "stage_received":
            staged["weights"] = scorer.stage_received(*argument)
        elif op == "drop_received":
            scorer.drop_received(argument)
        else:
            raise ValueError(f"unknown push call {op!r}")
    except Exception as exc:  # answered to rank 0, which decides for the replica
        send(("pushed", type(exc).__name__, str(exc)))
        return
    send(("pushed", None, None))


def _message(errors: list[tuple[str, Exception]]) -> str:
    return "; ".join(f"{where}: {error}" for where, error in errors)


def _joined(errors: list[tuple[str, Exception]]) -> Exception:
    """One exception for the ranks' errors: the first's, alone when every rank says the same (the
    ranks check the same metadata), else of its type with every rank's message."""
    first = errors[0][1]
    if all(str(error) == str(first) for _, error in errors):
        return first
    kind = type(first) if type(first) in _KINDS.values() else RuntimeError
    return kind(_message(errors))
