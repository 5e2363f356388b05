"""The batcher's work items: requests, their queued sequences, the long sequence scored in chunks,
and a micro-batch. Plain objects, no event loop and no engine calls.

`F` is what answers one sequence (an asyncio future in the server, any object with `done()` in
tests); these objects only ask it whether it is done (answered, failed or cancelled).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from service.core.cache_plan import NOTHING, CachePlan, Reuse
from service.core.errors import VersionMismatch
from service.core.jobs import Chunk, SequenceJob, SequenceScores
from service.core.prefix_cache import Block, Hit, Lease
from service.core.prefixes import Forest, alone, share


class Answer(Protocol):
    def done(self) -> bool: ...


F = TypeVar("F", bound=Answer)


@dataclass(slots=True, eq=False)
class Request(Generic[F]):
    """One call of `Batcher.submit`: its sequences' answers, in order, and the weights it runs on."""

    pins: Mapping[str, str]  # model -> the version the caller requires
    futures: list[F] = field(default_factory=list)
    versions: Mapping[str, str] | None = None  # set when its first sequence is taken
    refused: VersionMismatch | None = None  # its pins named weights no longer served when it started
    computed: float = 0.0  # tokens computed for its sequences scored so far (Forest.shares)
    cached: int = 0  # tokens of its sequences scored so far that the prefix cache served
    batch_tokens: int | None = None  # the most a micro-batch holding its sequences computes (None: any)


@dataclass(slots=True, eq=False)
class Pending(Generic[F]):
    """A queued sequence."""

    job: SequenceJob
    future: F
    request: Request[F]
    enqueued: float = field(default_factory=time.perf_counter)

    @property
    def gone(self) -> bool:
        """Cancelled (its client is gone) or refused (its request is pinned to other weights)."""
        return self.future.done() or self.request.refused is not None


@dataclass(slots=True, eq=False)
class Chunked(Generic[F]):
    """A sequence longer than the budget, being scored chunk by chunk."""

    pending: Pending[F]
    sequence: int  # its id at the engine
    next_start: int = 0
    parts: list[SequenceScores] = field(default_factory=list)
    hit: Hit | None = None  # what the prefix cache serves it: its first chunk starts at hit.cached
    tail: Block | None = None  # the last block its chunks wrote to the prefix cache

    @property
    def cached(self) -> int:
        return self.hit.cached if self.hit is not None else 0


@dataclass(slots=True, eq=False)
class Batch(Generic[F]):
    """One micro-batch: whole sequences (their shared prefixes once, per `forest`; None: nothing
    shared), then at most one chunk of a long one."""

    pending: list[Pending[F]]
    chunk: Chunk | None = None
    chunked: Chunked[F] | None = None  # whose chunk it is
    forest: Forest | None = None
    hits: list[Hit] | None = None  # each sequence's lookup in the prefix cache (None: no cache)
    plan: CachePlan | None = None  # what it reads from and writes to the prefix cache
    lease: Lease | None = None

    @classmethod
    def of(
        cls,
        pending: list[Pending[F]],
        share_min_tokens: int | None,
        chunk: Chunk | None = None,
        chunked: Chunked[F] | None = None,
        hits: list[Hit] | None = None,
    ) -> Batch[F]:
        """The micro-batch of `pending` (and the chunk), with the prefixes they share found; `hits`:
        what the prefix cache serves each (their computing starts there)."""
        floors = None if hits is None else [h.cached for h in hits]
        forest = None
        if share_min_tokens is not None and (len(pending) > 1 or any(floors or ())):
            roots = None if hits is None else [h.root for h in hits]
            tokens, routes = [p.job.tokens for p in pending], [p.job.routes for p in pending]
            forest = share(tokens, share_min_tokens, routes, floors, roots)
        elif floors is not None and any(floors):
            forest = alone([p.job.num_tokens for p in pending], floors)
        if forest is not None and not (forest.shared or forest.cached):
            forest = None
        return cls(pending, chunk, chunked, forest, hits)

    @property
    def jobs(self) -> list[SequenceJob]:
        return [p.job for p in self.pending]

    @property
    def tokens(self) -> int:
        """Tokens it computes."""
        whole = self.forest.computed_tokens if self.forest else sum(p.job.num_tokens for p in self.pending)
        return whole + (self.chunk.num_tokens if self.chunk else 0)

    def reuses(self) -> list[Reuse]:
        """What the prefix cache served each whole sequence."""
        return list(self.plan.jobs) if self.plan is not None else [NOTHING] * len(self.pending)

    def shares(self) -> list[float]:
        """Tokens computed for each whole sequence (a shared prefix's split among its sequences)."""
        if self.forest is None:
            return [float(p.job.num_tokens) for p in self.pending]
        return self.forest.shares()

    def started(self) -> list[Pending[F]]:
        """The sequences whose first tokens it computes: they leave the queue with it."""
        first_chunk = self.chunked is not None and self.chunk is not None and self.chunk.start == 0
        return self.pending + ([self.chunked.pending] if first_chunk and self.chunked is not None else [])

    @property
    def futures(self) -> list[F]:
        whole = [p.future for p in self.pending]
        return whole + ([self.chunked.pending.future] if self.chunked is not None else [])

    def __len__(self) -> int:
        return len(self.pending) + (self.chunk is not None)
