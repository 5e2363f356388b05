"""The asyncio side of the batcher: moves micro-batches that `Policy` forms between the queue, the
engine thread and the requests' futures, and waits. No scheduling decision is made here.

- One worker task takes micro-batches and launches them on a single engine thread (`launch`); a
  results thread waits for their scores (`result`), so at most `IN_FLIGHT` are launched and not
  yet collected and the accelerator does not idle while the host packs and answers.
- A request that queues a full budget on an idle accelerator launches it from its own call, and a
  launch on an idle accelerator holds the event loop (GIL released) for at most `hold_s`.
- With the engine idle and less than a budget queued, the worker collates for at most `wait_s`.
- Staged weights are applied on the engine thread at the barrier `Policy.open` defines, after every
  launched micro-batch is collected (the engine drops the model's prefix-cache entries).
- With nothing queued or launched, the worker has the engine thread capture the CUDA graphs the
  engine keeps for its idle time (`ScoringEngine.tend`, one a call; how many are left goes to the
  metrics) until none is left; a request that comes meanwhile waits for one capture at most.
- A micro-batch's prefix-cache plan is settled once its launch is queued or failed
  (`Policy.settle`); the cache's counts go to the metrics after each micro-batch is taken.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections import deque
from collections.abc import Coroutine, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from service.batcher.policy import Policy, sharing
from service.batcher.queue import Batch, Request
from service.core.errors import EngineFailure, SequenceTooLarge
from service.core.jobs import SequenceJob, SequenceScores
from service.engine.contract import Launched, OutOfMemory, ScoringEngine, StagedWeights, WeightsState
from service.metrics import Metrics
from service.settings import Settings

log = logging.getLogger(__name__)

IN_FLIGHT = 2  # one micro-batch on the accelerator, the next queued behind it
LAUNCH_HOLD_S = 0.025  # the longest the event loop waits for a launch on an idle accelerator

Future = asyncio.Future[SequenceScores]


@dataclass(frozen=True, slots=True)
class Scored:
    """A request's scores, in order, and the weights version of every model it ran on."""

    scores: list[SequenceScores]
    versions: Mapping[str, str]
    computed_tokens: int = 0  # run through the decoder for it: a shared prefix split among its sequences
    cached_tokens: int = 0  # served by the prefix cache


@dataclass(frozen=True, slots=True)
class Applied:
    """New weights in service: how long they waited for the barrier and how long scoring paused."""

    state: WeightsState
    wait_seconds: float
    pause_seconds: float


@dataclass(slots=True, eq=False)
class _Flight:
    """A micro-batch launched on the engine whose scores are not collected yet."""

    batch: Batch[Future]
    tokens: int
    launched: float
    collected: asyncio.Task[None] | None = None


@dataclass(slots=True, eq=False)
class _Handed:
    """A micro-batch a request handed to the engine thread; the worker takes it over as its own."""

    batch: Batch[Future]
    handle: asyncio.Future[Launched]
    launched: float


@dataclass(slots=True, eq=False)
class _Swap:
    staged: StagedWeights
    future: asyncio.Future[Applied]
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
        hold_s: float = LAUNCH_HOLD_S,
        share_min_tokens: int | None = None,
        prefix_cache: bool = True,
    ) -> None:
        """share_min_tokens: compute prefixes of at least this many tokens that sequences share once
        (None: never); prefix_cache: plan micro-batches with the engine's prefix cache (where it has one)."""
        self._engine = engine
        self._cache = engine.prefix_cache if prefix_cache else None
        self._cache_seen = self._cache.stats() if self._cache is not None else None  # as last observed
        self._policy: Policy[Future] = Policy(
            max_batch_tokens,
            _serving_versions(engine),
            max_queued_tokens=max_queued_tokens,
            share_min_tokens=share_min_tokens,
            cache=self._cache,
        )
        self._tokens_per_s = 0.0  # moving average of the engine's speed, for Retry-After
        self._wait_s = wait_s  # collation window when the engine is idle and the queue under budget
        self._hold_s = hold_s
        self._metrics = metrics
        self._swaps: deque[_Swap] = deque()
        self._last_batch_done = 0.0
        self._wake = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="logprobd-engine")
        self._collector = ThreadPoolExecutor(max_workers=1, thread_name_prefix="logprobd-results")
        self._flights: deque[_Flight] = deque()  # launched, in launch order
        self._worker: asyncio.Task[None] | None = None
        self._waiting = False  # the worker waits for work or collates, launching nothing
        self._handed: _Handed | None = None
        self._tending = True  # the engine may have work for its idle time (again after each launch)

    @classmethod
    def from_settings(cls, engine: ScoringEngine, settings: Settings, metrics: Metrics) -> Batcher:
        """The server's batcher: budget, collation window, launch hold and queue cap from `settings` (the
        budget, where unset there, the engine's: EngineInfo.max_batch_tokens)."""
        budget = settings.max_batch_tokens
        return cls(
            engine,
            budget if budget is not None else engine.info.max_batch_tokens,
            metrics,
            wait_s=settings.batch_wait_ms / 1e3,
            hold_s=settings.launch_hold_ms / 1e3,
            max_queued_tokens=settings.max_queued_tokens,
            share_min_tokens=sharing(settings),
            prefix_cache=settings.prefix_cache,
        )

    def flush_cache(self) -> None:
        """Drop every entry of the engine's prefix cache (POST /flush_cache)."""
        self._engine.flush_cache()
        self._observe_cache()

    def start(self) -> None:
        self._worker = asyncio.create_task(self._run(), name="logprobd-batcher")

    async def stop(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)
        collecting = [f.collected for f in self._flights if f.collected is not None]
        for task in collecting:
            task.cancel()
        await asyncio.gather(*collecting, return_exceptions=True)
        if self._handed is not None:  # the worker stopped before taking it over
            await asyncio.gather(self._handed.handle, return_exceptions=True)
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._collector.shutdown(wait=True, cancel_futures=True)

    async def score(self, jobs: Sequence[SequenceJob], pins: Mapping[str, str] | None = None) -> Scored:
        """Scores of `jobs`, in order, all from one set of weights: `submit`, then its answer."""
        return await self.submit(jobs, pins)

    def submit(
        self, jobs: Sequence[SequenceJob], pins: Mapping[str, str] | None = None
    ) -> Coroutine[Any, Any, Scored]:
        """Queue `jobs` now, in the caller's turn of the event loop (a full budget starts at once),
        and return the coroutine that waits for their scores. Raises Overloaded (nothing queued)
        past `max_queued_tokens`, VersionMismatch when `pins` (model -> version) are not what runs;
        cancelling the coroutine drops its sequences that have not reached the engine."""
        return self._answer(self._queue(jobs, pins))

    def submit_each(
        self,
        jobs: Sequence[SequenceJob],
        pins: Mapping[str, str] | None = None,
        *,
        batch_tokens: int | None = None,
    ) -> list[Future]:
        """Queue `jobs` as `submit` does and return each one's future, in order, set as soon as its
        micro-batch is collected: the first can be answered while later ones compute. Cancelling a
        future drops its sequence if it has not reached the engine; the caller retrieves every
        failure (or cancels). All come from one set of weights, as `submit`'s do. `batch_tokens`
        caps the micro-batches holding them below the budget, so that the first come back sooner."""
        return self.queue_each(jobs, pins, batch_tokens=batch_tokens).futures

    def queue_each(
        self,
        jobs: Sequence[SequenceJob],
        pins: Mapping[str, str] | None = None,
        *,
        batch_tokens: int | None = None,
    ) -> Request[Future]:
        """`submit_each`'s request: its futures, and the tokens computed and cached for them so far."""
        return self._queue(jobs, pins, batch_tokens)

    def _queue(
        self, jobs: Sequence[SequenceJob], pins: Mapping[str, str] | None, batch_tokens: int | None = None
    ) -> Request[Future]:
        request: Request[Future] = Request(pins or {}, batch_tokens=batch_tokens)
        self._policy.admit(request.pins, sum(job.num_tokens for job in jobs), self._tokens_per_s)
        loop = asyncio.get_running_loop()
        request.futures = [loop.create_future() for _ in jobs]
        self._policy.enqueue(request, jobs)
        self._gauge()
        self._hand_over_a_full_budget()
        self._wake.set()
        return request

    @staticmethod
    async def _answer(request: Request[Future]) -> Scored:
        try:
            scores = list(await asyncio.gather(*request.futures))
        finally:
            for f in request.futures:  # drop what has not reached the engine; retrieve every failure
                if not f.cancel() and not f.cancelled():
                    f.exception()
        assert request.versions is not None
        return Scored(scores, request.versions, round(request.computed), request.cached)

    async def apply(self, staged: StagedWeights) -> Applied:
        """Put staged weights in service at the next barrier: requests that started finish on the
        weights they began on; those still queued start on the new ones."""
        swap = _Swap(staged, asyncio.get_running_loop().create_future())
        self._swaps.append(swap)
        self._wake.set()
        return await swap.future

    async def _run(self) -> None:
        while True:
            self._waiting = True
            while self._policy.idle and not self._swaps and self._handed is None:
                if self._tending and not self._flights:
                    await self._tend()
                    continue
                self._wake.clear()
                await self._wake.wait()
            if self._handed is None and not self._swaps:
                await self._collate()
            self._waiting = False
            if self._handed is not None:
                handed, self._handed = self._handed, None
                await self._launch(handed.batch, handed)
            elif self._swaps and not self._policy.open():
                await self._drain()  # every started request completes on the weights it began on
                await self._apply(self._swaps.popleft())
                continue
            else:
                batch = self._take(only_started=bool(self._swaps))
                if not batch:
                    continue
                self._observe_queue(batch, time.perf_counter())
                await self._launch(batch)
            while len(self._flights) >= IN_FLIGHT:
                await self._oldest_collected()

    async def _tend(self) -> None:
        """One capture of the engine's idle time, on the engine thread; a failure ends them (logged)."""
        try:
            loop = asyncio.get_running_loop()
            left = await loop.run_in_executor(self._executor, self._engine.tend)
        except Exception:  # the graphs are an optimisation: serving goes on without them
            log.exception("the engine's idle-time capture failed; it stops until the next launch")
            self._tending = False
            return
        self._tending = left > 0
        self._metrics.graphs_pending.set(left)

    def _take(self, only_started: bool) -> Batch[Future]:
        """The policy's next micro-batch; fails the requests it refused, drops abandoned stores."""
        taken = self._policy.take(only_started)
        if taken.release is not None:
            self._executor.submit(self._engine.release, taken.release)
        for request in taken.refused:
            assert request.refused is not None
            self._fail_futures(request.futures, request.refused)
        self._gauge()
        self._observe_cache()
        return taken.batch

    def _hand_over_a_full_budget(self) -> None:
        """Start a micro-batch from here, the request's own call, when the worker would start it
        as soon as it ran (the accelerator idle, a full budget queued, no swap waiting): the event
        loop would wake the worker only behind every request of a burst. The worker takes the
        launch over (`_Handed`)."""
        if (
            not self._waiting
            or self._handed is not None
            or self._flights
            or self._swaps
            or not self._policy.full
        ):
            return
        batch = self._take(only_started=False)
        if batch:
            launched = time.perf_counter()
            self._handed = _Handed(batch, self._send(batch), launched)
            self._observe_queue(batch, launched)

    def _send(self, batch: Batch[Future]) -> asyncio.Future[Launched]:
        """`engine.launch` of the batch on the engine thread; on an idle accelerator, the event loop
        waits for it (GIL released), at most `hold_s`, so the launch does not take turns for the GIL
        with requests parsed on the loop meanwhile (they would queue behind it anyway)."""
        future = self._executor.submit(self._engine.launch, batch.jobs, batch.chunk, batch.forest, batch.plan)
        if not self._flights:
            concurrent.futures.wait([future], timeout=self._hold_s)
        return asyncio.wrap_future(future)

    def _observe_queue(self, batch: Batch[Future], started: float) -> None:
        for p in batch.started():
            self._metrics.queue_seconds.observe(started - p.enqueued)

    async def _oldest_collected(self) -> None:
        task = self._flights[0].collected
        assert task is not None
        await asyncio.shield(task)  # cancelling the worker must not cancel the collection

    async def _drain(self) -> None:
        while self._flights:
            await self._oldest_collected()

    async def _launch(self, batch: Batch[Future], handed: _Handed | None = None) -> None:
        """Queue one micro-batch on the engine (or finish `handed`, already on its way there); on
        out-of-memory, launch the parts the policy splits it into."""
        tokens = batch.tokens
        launched = time.perf_counter() if handed is None else handed.launched
        try:
            handle = await (self._send(batch) if handed is None else handed.handle)
        except OutOfMemory as exc:
            self._policy.settle(batch, queued=False)
            await self._out_of_memory(batch, exc)
            return
        except Exception as exc:  # a failed forward fails its requests, never the server
            log.exception("micro-batch of %d sequences failed", len(batch))
            self._fail(batch, EngineFailure(f"scoring failed: {type(exc).__name__}: {exc}"))
            return
        self._policy.settle(batch, queued=True)
        self._tending = True  # a routed shape met first leaves its graph for the idle time
        flight = _Flight(batch, tokens, launched)
        flight.collected = asyncio.create_task(self._collect(flight, handle), name="logprobd-collect")
        self._flights.append(flight)

    async def _out_of_memory(self, batch: Batch[Future], exc: OutOfMemory) -> None:
        parts = self._policy.split(batch)
        if not parts:  # one sequence or one chunk that does not fit alone
            tokens = batch.chunk.job.num_tokens if batch.chunk is not None else batch.tokens
            self._fail(
                batch, SequenceTooLarge(f"a sequence of {tokens} tokens does not fit in accelerator memory")
            )
            return
        apart = parts[-1].chunk is not None
        log.warning(
            "%s; %s",
            exc,
            "retrying the chunk and the whole sequences apart" if apart else "retrying as two halves",
        )
        for part in parts:
            await self._launch(part)

    async def _collect(self, flight: _Flight, handle: Launched) -> None:
        """Wait (on the results thread) for a launched micro-batch's scores and answer its sequences."""
        batch = flight.batch
        try:
            results = await asyncio.get_running_loop().run_in_executor(self._collector, handle.result)
        except Exception as exc:  # an error the device reported late fails this micro-batch only
            log.exception("micro-batch of %d sequences failed", len(batch))
            self._fail(batch, EngineFailure(f"scoring failed: {type(exc).__name__}: {exc}"))
            return
        finally:
            self._flights.remove(flight)
        done = time.perf_counter()
        # the accelerator's time on it: from its launch, or from the end of the one queued before it
        seconds = done - max(flight.launched, self._last_batch_done)
        self._last_batch_done = done
        self._tokens_per_s = (
            0.8 * self._tokens_per_s + 0.2 * flight.tokens / seconds
            if self._tokens_per_s
            else flight.tokens / seconds
        )
        self._metrics.forward_seconds.observe(seconds)
        self._metrics.batch_tokens.observe(flight.tokens)
        self._metrics.computed_tokens.inc(flight.tokens)
        self._metrics.batch_sequences.observe(len(batch))
        self._metrics.observe_expert_load(handle.expert_load())
        self._metrics.sequences.inc(len(batch.pending))
        for p, result, computed, reuse in zip(
            batch.pending, results, batch.shares(), batch.reuses(), strict=False
        ):
            p.request.computed += computed
            p.request.cached += reuse.cached
            if not p.future.done():
                p.future.set_result(result)
        if batch.chunked is not None and batch.chunk is not None:
            chunked = batch.chunked
            chunked.pending.request.computed += batch.chunk.num_tokens
            if batch.chunk.start == batch.chunk.cached:
                chunked.pending.request.cached += batch.chunk.cached
            chunked.parts.append(results[-1])
            if batch.chunk.last and not chunked.pending.future.done():
                self._metrics.sequences.inc()
                chunked.pending.future.set_result(SequenceScores.join(chunked.parts))
        self._wake.set()  # a collation waiting on a busy accelerator stops waiting once it is idle

    def _fail(self, batch: Batch[Future], error: Exception) -> None:
        self._policy.settle(batch, queued=False)
        self._fail_futures(batch.futures, error)
        release = self._policy.abandon(batch)
        self._gauge()
        if release is not None:
            self._executor.submit(self._engine.release, release)

    @staticmethod
    def _fail_futures(futures: list[Future], error: Exception) -> None:
        for future in futures:
            if not future.done():
                future.set_exception(error)

    async def _collate(self) -> None:
        """Let requests sent together share a micro-batch: wait, at most `wait_s` after the oldest
        queued sequence arrived, until the queue holds a full budget. While a micro-batch is in
        flight the wait costs nothing (the next one would queue behind it); once none is, work that
        was waiting when the last one finished goes at once."""
        oldest = self._policy.collating_since()
        if oldest is None:
            return
        deadline = oldest + self._wait_s
        while not self._policy.full and self._handed is None:
            if not self._flights and oldest < self._last_batch_done:
                return
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                return
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), remaining)
            except TimeoutError:
                return

    def _gauge(self) -> None:
        self._metrics.queue_tokens.set(self._policy.queued_tokens)

    def _observe_cache(self) -> None:
        if self._cache is not None and self._cache_seen is not None:
            stats = self._cache.stats()
            self._metrics.observe_prefix_cache(stats, self._cache_seen, self._engine.info.prefix_cache_bytes)
            self._cache_seen = stats

    async def _apply(self, swap: _Swap) -> None:
        if swap.future.done():  # its caller is gone
            return
        started = time.perf_counter()
        try:
            state = await asyncio.get_running_loop().run_in_executor(
                self._executor, self._engine.apply, swap.staged
            )
        except Exception as exc:
            log.critical("applying weights failed; the served weights may be partly replaced", exc_info=exc)
            swap.future.set_exception(EngineFailure(f"applying weights failed: {type(exc).__name__}: {exc}"))
            return
        self._policy.versions = _serving_versions(self._engine)
        self._tending = True  # weights rebound: the engine queues its idle-time graphs again
        done = time.perf_counter()
        if not swap.future.done():
            swap.future.set_result(Applied(state, started - swap.enqueued, done - started))


def _serving_versions(engine: ScoringEngine) -> Mapping[str, str]:
    """model -> the version it serves: what a request starting now runs on."""
    return {target: w.version for target, w in engine.weights.items()}
