"""Bounded FIFO of sequences, merged into packed micro-batches under a token budget.

One worker task pulls as many queued sequences as fit in `max_batch_tokens` and hands them to the
engine on a single dedicated thread, so the event loop keeps serving while the forward runs.
Requests larger than the budget are split across micro-batches; a request is answered when all its
sequences are scored. Sequences whose request was cancelled are skipped before they reach the engine.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from service.engine.base import ScoringEngine
from service.errors import EngineFailure
from service.jobs import SequenceJob, SequenceScores
from service.metrics import Metrics

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class _Pending:
    job: SequenceJob
    future: asyncio.Future[SequenceScores]
    enqueued: float = field(default_factory=time.perf_counter)


class Batcher:
    def __init__(
        self, engine: ScoringEngine, max_batch_tokens: int, metrics: Metrics, *, wait_s: float = 0.0
    ) -> None:
        self._engine = engine
        self._budget = max_batch_tokens
        self._wait_s = wait_s  # collation window when the engine is idle and the queue under budget
        self._metrics = metrics
        self._queue: deque[_Pending] = deque()
        self._queued_tokens = 0
        self._last_batch_done = 0.0
        self._wake = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="logprobd-engine")
        self._worker: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._worker = asyncio.create_task(self._run(), name="logprobd-batcher")

    async def stop(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)
        self._executor.shutdown(wait=True, cancel_futures=True)

    async def score(self, jobs: Sequence[SequenceJob]) -> list[SequenceScores]:
        loop = asyncio.get_running_loop()
        pending = [_Pending(job, loop.create_future()) for job in jobs]
        self._queue.extend(pending)
        self._queued(sum(job.num_tokens for job in jobs))
        self._wake.set()
        try:
            return list(await asyncio.gather(*(p.future for p in pending)))
        finally:
            for p in pending:
                p.future.cancel()  # no-op once done; drops what has not reached the engine

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not self._queue:
                self._wake.clear()
                await self._wake.wait()
            await self._collate()
            batch = self._take()
            if not batch:
                continue
            jobs = [p.job for p in batch]
            started = time.perf_counter()
            for p in batch:
                self._metrics.queue_seconds.observe(started - p.enqueued)
            try:
                results = await loop.run_in_executor(self._executor, self._engine.score, jobs)
            except Exception as exc:  # a failed forward fails its requests, never the server
                self._last_batch_done = time.perf_counter()
                log.exception("micro-batch of %d sequences failed", len(jobs))
                failure = EngineFailure(f"scoring failed: {type(exc).__name__}: {exc}")
                for p in batch:
                    if not p.future.done():
                        p.future.set_exception(failure)
                continue
            self._last_batch_done = time.perf_counter()
            self._metrics.forward_seconds.observe(self._last_batch_done - started)
            self._metrics.batch_tokens.observe(sum(job.num_tokens for job in jobs))
            self._metrics.batch_sequences.observe(len(jobs))
            self._metrics.sequences.inc(len(jobs))
            for p, result in zip(batch, results, strict=True):
                if not p.future.done():
                    p.future.set_result(result)

    async def _collate(self) -> None:
        """Let requests sent together share a micro-batch: wait, at most `wait_s` after the oldest
        queued sequence arrived, until the queue holds a full budget. Work left over from an earlier
        micro-batch (queued while the engine was busy) goes at once."""
        oldest = self._queue[0].enqueued
        if oldest < self._last_batch_done:
            return
        deadline = oldest + self._wait_s
        while self._queued_tokens < self._budget:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                return
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), remaining)
            except TimeoutError:
                return

    def _queued(self, tokens: int) -> None:
        self._queued_tokens += tokens
        self._metrics.queue_tokens.set(self._queued_tokens)

    def _take(self) -> list[_Pending]:
        """Pop queued sequences in order while they fit the token budget (at least one)."""
        batch: list[_Pending] = []
        tokens = 0
        while self._queue:
            head = self._queue[0]
            if head.future.done():  # cancelled: its client is gone
                self._queue.popleft()
                self._queued(-head.job.num_tokens)
                continue
            if batch and tokens + head.job.num_tokens > self._budget:
                break
            self._queue.popleft()
            self._queued(-head.job.num_tokens)
            batch.append(head)
            tokens += head.job.num_tokens
        return batch
