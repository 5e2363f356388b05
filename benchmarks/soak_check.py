"""What the push soak (benchmarks/push_soak.py) checks and measures of the answers it got, apart from
how it got them: no torch, no HTTP.

`Checker`: with the server in batch-invariant mode a sequence's scores do not depend on what it was
batched with, so every answer that names weights version v must equal, row by row and bit for bit,
the canonical scores of its probe request on v (taken once, pinned to v, right after v served), and
no two versions may score a probe alike (else a wrong version's answer would pass). Each row is kept
as a digest of its float32 bytes. An answer whose version has no canonical scores yet
waits until they are known; one still waiting at the end, one naming a version never pushed, one
whose rows differ and any non-200 fail the soak.

`timeline`: the scoring seen from the clients while pushes ran against between them: answers and
tokens per second, answer latency, and the longest stretch without an answer.
"""

from __future__ import annotations

import itertools
import statistics
import threading
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

Rows = tuple[bytes, ...]  # one digest per row of an answer's log-probs (float32 bytes)


@dataclass(frozen=True, slots=True)
class Answer:
    """One scorer's request and what came back; times are time.perf_counter()."""

    probe: int  # which probe request was sent
    sent: float
    answered: float
    status: int  # HTTP status; 0: no answer (the connection failed or timed out)
    version: str | None  # the answer's weights_version
    rows: Rows
    tokens: int  # the request's input tokens
    error: str | None = None


@dataclass(frozen=True, slots=True)
class PushWindow:
    """One push, from the trainer's call until it returned (the version serving), and the scoring
    pause the server reported for it (its applies: one per push)."""

    version: str
    started: float
    ended: float
    seconds: float  # the pusher's own count: first bucket to serving
    pause_s: float
    applies: int
    error: str | None = None


@dataclass(slots=True)
class Verdict:
    checked: dict[str, int] = field(default_factory=dict)  # version -> answers equal to canonical
    mismatched: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # non-200 answers, failed pushes, canonical misses
    unknown: list[str] = field(default_factory=list)  # answers naming a version never pushed
    unchecked: dict[str, int] = field(default_factory=dict)  # version -> answers never checked

    @property
    def ok(self) -> bool:
        return not (self.mismatched or self.errors or self.unknown or self.unchecked)


class Checker:
    """Answers checked against canonical scores per version as both arrive (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._canonical: dict[str, Sequence[Rows]] = {}
        self._waiting: dict[str, list[Answer]] = defaultdict(list)
        self._pushed: set[str] = set()
        self.verdict = Verdict()

    def pushed(self, version: str) -> None:
        """`version` is served or being pushed: answers may name it."""
        with self._lock:
            self._pushed.add(version)

    def know(self, version: str, canonical: Sequence[Rows]) -> None:
        """The canonical rows of every probe request on `version`; checks the answers waiting for them.
        A probe scored alike on two versions fails: an answer on the wrong one would pass."""
        with self._lock:
            for other, rows in self._canonical.items():
                alike = [i for i, (a, b) in enumerate(zip(rows, canonical, strict=True)) if a == b]
                if alike:
                    self.verdict.errors.append(f"probes {alike} score alike on {other!r} and {version!r}")
            self._canonical[version] = canonical
            for answer in self._waiting.pop(version, []):
                self._check(answer, canonical)

    def fail(self, why: str) -> None:
        with self._lock:
            self.verdict.errors.append(why)

    def add(self, answer: Answer) -> None:
        with self._lock:
            if answer.status != 200 or answer.version is None:
                self.verdict.errors.append(f"probe {answer.probe}: {answer.status} {answer.error}")
            elif answer.version not in self._pushed:
                self.verdict.unknown.append(f"probe {answer.probe} answered on {answer.version!r}")
            elif answer.version in self._canonical:
                self._check(answer, self._canonical[answer.version])
            else:
                self._waiting[answer.version].append(answer)

    def finish(self) -> Verdict:
        """The verdict; answers still waiting for their version's canonical scores count unchecked."""
        with self._lock:
            for version, answers in self._waiting.items():
                self.verdict.unchecked[version] = len(answers)
            self._waiting.clear()
            return self.verdict

    def _check(self, answer: Answer, canonical: Sequence[Rows]) -> None:
        assert answer.version is not None
        want = canonical[answer.probe]
        if answer.rows == want:
            self.verdict.checked[answer.version] = self.verdict.checked.get(answer.version, 0) + 1
            return
        differ = [i for i, (got, ref) in enumerate(zip(answer.rows, want, strict=False)) if got != ref]
        self.verdict.mismatched.append(
            f"probe {answer.probe} on {answer.version!r}: rows {differ or 'count'} differ from its canonical "
            f"scores ({len(answer.rows)} rows, {len(want)} canonical)"
        )


def timeline(
    answers: Sequence[Answer], pushes: Sequence[PushWindow], began: float, ended: float
) -> dict[str, Any]:
    """The clients' view during pushes (an answer's flight overlaps a push's window) and between them:
    answers and input tokens per second (by when answered), answer latency in ms, and the longest gap
    between consecutive answers (a gap overlapping a push counts as during)."""
    windows = [(p.started, p.ended) for p in pushes]

    def overlaps(start: float, end: float) -> bool:
        return any(start < w_end and end > w_start for w_start, w_end in windows)

    def inside(t: float) -> bool:
        return any(w_start <= t <= w_end for w_start, w_end in windows)

    during_s = sum(min(e, ended) - max(s, began) for s, e in windows if e > began and s < ended)
    spans = {"during_pushes": max(during_s, 0.0), "between_pushes": max(ended - began - during_s, 0.0)}
    counted = [a for a in answers if a.status == 200 and began <= a.answered <= ended]
    done = sorted(a.answered for a in counted)
    gaps: dict[str, float] = {"during_pushes": 0.0, "between_pushes": 0.0}
    for before, after in itertools.pairwise(done):
        key = "during_pushes" if overlaps(before, after) else "between_pushes"
        gaps[key] = max(gaps[key], (after - before) * 1e3)
    out: dict[str, Any] = {}
    for key, seconds in spans.items():
        during = key == "during_pushes"
        finished = [a for a in counted if inside(a.answered) == during]
        latencies = sorted(
            (a.answered - a.sent) * 1e3 for a in counted if overlaps(a.sent, a.answered) == during
        )
        out[key] = {
            "seconds": seconds,
            "answers": len(finished),
            "answers_per_s": len(finished) / seconds if seconds else None,
            "tokens_per_s": sum(a.tokens for a in finished) / seconds if seconds else None,
            "latency_ms_p50": statistics.median(latencies) if latencies else None,
            "latency_ms_max": latencies[-1] if latencies else None,
            "latencies": len(latencies),
            "longest_gap_ms": gaps[key],
        }
    return out


def pause_summary(pushes: Sequence[PushWindow], target_ms: float) -> dict[str, Any]:
    """The server's scoring pause per push (ms): max, p50 and whether every one is within target."""
    done = [p.pause_s * 1e3 for p in pushes if p.error is None]
    return {
        "max_ms": max(done) if done else None,
        "p50_ms": statistics.median(done) if done else None,
        "target_ms": target_ms,
        "within_target": bool(done) and max(done) <= target_ms,
    }


def summary(
    verdict: Verdict,
    windows: Sequence[PushWindow],
    scoring: dict[str, Any],
    seconds: float,
    pause_target_ms: float,
) -> dict[str, Any]:
    """The soak's result (beside its provenance and settings): ok, the pushes, the pauses, the
    answers checked and the failures, the scoring (`timeline`) over `seconds`."""
    done = [w for w in windows if w.error is None]
    failures = verdict.mismatched + verdict.errors + verdict.unknown
    return {
        "ok": verdict.ok and len(done) == len(windows) > 0,
        "soak_s": seconds,
        "pushes": {
            "done": len(done),
            "failed": len(windows) - len(done),
            "push_s_p50": statistics.median(w.seconds for w in done) if done else None,
            "push_s_max": max(w.seconds for w in done) if done else None,
            "each": [
                {
                    "version": w.version,
                    "push_s": w.seconds,
                    "call_s": w.ended - w.started,
                    "pause_ms": w.pause_s * 1e3,
                    "applies": w.applies,
                    "answers_checked": verdict.checked.get(w.version, 0),
                    "error": w.error,
                }
                for w in windows
            ],
        },
        "pause": pause_summary(windows, pause_target_ms),
        "answers": {
            "checked": sum(verdict.checked.values()),
            "per_version": verdict.checked,
            "mismatched": len(verdict.mismatched),
            "errors": len(verdict.errors),
            "unknown_version": len(verdict.unknown),
            "unchecked": sum(verdict.unchecked.values()),
        },
        "failures": failures[:20],
        "scoring": scoring,
    }
