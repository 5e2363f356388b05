"""The batcher's side of the prefix cache (core/prefix_cache.py): each queued sequence's lookup within
one take, the cached keys a micro-batch may gather, the plan made with each micro-batch, and its
settling once the launch is queued or failed. Synchronous; `policy.py` calls it while it holds the
index's lock, so no weights are dropped and no flush comes between a lookup and the plan made of it.

A micro-batch that ran out of memory is retried in parts that read what it read (their blocks stay
as they were: nothing is planned between) and write nothing.
"""

from __future__ import annotations

from typing import Any, Generic

from service.batcher.queue import Batch, F, Pending
from service.core.cache_plan import CachePlan, Reuse
from service.core.prefix_cache import MISS, ChunkStep, Hit, PrefixIndex

READS_PER_TOKEN = 16  # cached keys a micro-batch gathers, per token of the budget (beside its first sequence)


class Lookups:
    """Each queued sequence's lookup in the prefix cache, made once within one take (MISS: no cache)."""

    def __init__(self, cache: PrefixIndex | None) -> None:
        self._cache = cache
        self._hits: dict[int, Hit] = {}

    def __call__(self, p: Pending[Any]) -> Hit:
        if self._cache is None:
            return MISS
        found = self._hits.get(id(p))
        if found is None:
            found = self._hits[id(p)] = self._cache.lookup(p.job)
        return found


class Caching(Generic[F]):
    def __init__(self, cache: PrefixIndex | None, share_min: int | None, budget: int) -> None:
        self.cache = cache
        self.share_min = share_min
        self.budget = budget

    def reads_fit(self, reads: int, h: Hit) -> bool:
        """Whether a micro-batch that gathers `reads` cached keys may gather h's too."""
        return reads + h.cached <= READS_PER_TOKEN * self.budget

    def planned(self, batch: Batch[F], step: ChunkStep | None) -> Batch[F]:
        """`batch` with its plan of the prefix cache (its reads pinned until `settle`); no plan where
        it neither reads nor writes."""
        if self.cache is None or batch.hits is None:
            return batch
        lease = self.cache.plan(list(zip(batch.jobs, batch.hits, strict=True)), step)
        batch.lease = lease
        plan = lease.plan
        if any(r.read or r.write for r in (*plan.jobs, *([plan.chunk] if plan.chunk else []))):
            batch.plan = plan
        if step is not None and batch.chunked is not None:
            batch.chunked.tail = lease.tail
        return batch

    def settle(self, batch: Batch[F], queued: bool) -> None:
        """After `batch`'s launch: queued (what it pinned may go) or failed (what it was to write is
        not held; a chunked sequence writes no more)."""
        if self.cache is None or batch.lease is None:
            return
        if queued:
            self.cache.release(batch.lease)
            return
        self.cache.abandon(batch.lease)
        if batch.chunked is not None:
            batch.chunked.tail = None

    def part(self, batch: Batch[F], lo: int, hi: int, chunk: bool) -> Batch[F]:
        """Sequences lo .. hi - 1 of `batch` (or its chunk alone), reading what they read, writing nothing."""
        hits = None if batch.hits is None else batch.hits[lo:hi]
        part = (
            Batch([], batch.chunk, batch.chunked)
            if chunk
            else Batch.of(batch.pending[lo:hi], self.share_min, hits=hits)
        )
        if batch.plan is not None:
            reads = tuple(Reuse(read=r.read) for r in batch.plan.jobs[lo:hi])
            own = batch.plan.chunk if chunk else None
            part.plan = CachePlan(reads, None if own is None else Reuse(read=own.read))
        return part
