"""Bounded FIFO of sequences, merged into packed micro-batches under a token budget.

One worker task pulls as many queued sequences as fit in `max_batch_tokens` and hands them to the
engine on a single dedicated thread, so the event loop keeps serving while the forward runs.
Requests larger than the budget are split across micro-batches; a request is answered when all its
sequences are scored. Sequences whose request was cancelled are skipped before they reach the engine.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from service.engine.base import OutOfMemory, ScoringEngine
from service.errors import EngineFailure, Overloaded, SequenceTooLarge
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
        self,
        engine: ScoringEngine,
        max_batch_tokens: int,
        metrics: Metrics,
        *,
        wait_s: float = 0.0,
        max_queued_tokens: int | None = None,
    ) -> None:
        self._engine = engine
        self._budget = max_batch_tokens
        self._max_queued = max_queued_tokens
        self._tokens_per_s = 0.0  # moving average of the engine's speed, for Retry-After
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
        """Scores of `jobs`, in order. Raises Overloaded (nothing queued) past `max_queued_tokens`;
        cancelling the call drops its sequences that have not reached the engine."""
        tokens = sum(job.num_tokens for job in jobs)
        if self._max_queued is not None and self._queue and self._queued_tokens + tokens > self._max_queued:
            speed = self._tokens_per_s or float(self._budget)
            raise Overloaded(
                f"{self._queued_tokens} tokens are queued; this server accepts at most {self._max_queued} "
                f"(max_queued_tokens)",
                retry_after=max(1, min(60, math.ceil(self._queued_tokens / speed))),
            )
        loop = asyncio.get_running_loop()
        pending = [_Pending(job, loop.create_future()) for job in jobs]
        self._queue.extend(pending)
        self._queued(tokens)
        self._wake.set()
        try:
            return list(await asyncio.gather(*(p.future for p in pending)))
        finally:
            for p in pending:
                p.future.cancel()  # no-op once done; drops what has not reached the engine

    async def _run(self) -> None:
        while True:
            while not self._queue:
                self._wake.clear()
                await self._wake.wait()
            await self._collate()
            batch = self._take()
            if not batch:
                continue
            started = time.perf_counter()
            for p in batch:
                self._metrics.queue_seconds.observe(started - p.enqueued)
            await self._forward(batch)
            self._last_batch_done = time.perf_counter()

    async def _forward(self, batch: list[_Pending]) -> None:
        """Score one micro-batch; on out-of-memory, split it and retry the halves."""
        jobs = [p.job for p in batch]
        tokens = sum(job.num_tokens for job in jobs)
        started = time.perf_counter()
        try:
            results = await asyncio.get_running_loop().run_in_executor(
                self._executor, self._engine.score, jobs
            )
        except OutOfMemory as exc:
            if len(batch) > 1:
                log.warning("%s; retrying as two halves", exc)
                half = len(batch) // 2
                await self._forward(batch[:half])
                await self._forward(batch[half:])
                return
            self._fail(
                batch, SequenceTooLarge(f"a sequence of {tokens} tokens does not fit in accelerator memory")
            )
            return
        except Exception as exc:  # a failed forward fails its requests, never the server
            log.exception("micro-batch of %d sequences failed", len(jobs))
            self._fail(batch, EngineFailure(f"scoring failed: {type(exc).__name__}: {exc}"))
            return
        seconds = time.perf_counter() - started
        self._tokens_per_s = (
            0.8 * self._tokens_per_s + 0.2 * tokens / seconds if self._tokens_per_s else tokens / seconds
        )
        self._metrics.forward_seconds.observe(seconds)
        self._metrics.batch_tokens.observe(tokens)
        self._metrics.batch_sequences.observe(len(jobs))
        self._metrics.sequences.inc(len(jobs))
        for p, result in zip(batch, results, strict=True):
            if not p.future.done():
                p.future.set_result(result)

    @staticmethod
    def _fail(batch: list[_Pending], error: Exception) -> None:
        for p in batch:
            if not p.future.done():
                p.future.set_exception(error)

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
