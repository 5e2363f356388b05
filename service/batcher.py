"""Bounded FIFO of sequences, merged into packed micro-batches under a token budget.

One worker task pulls as many queued sequences as fit in `max_batch_tokens` and hands them to the
engine on a single dedicated thread, so the event loop keeps serving while the forward runs.
Requests larger than the budget are split across micro-batches; a request is answered when all its
sequences are scored. Sequences whose request was cancelled are skipped before they reach the engine.

Sequences that share a prefix of at least `share_min_tokens` tokens (a GRPO group's prompt, earlier
turns of a conversation), wherever they meet in the queue, compute it once per micro-batch
(prefixes.py): the budget counts the tokens a micro-batch computes, not the tokens sent. Once the
next sequence in line does not fit, the batcher still takes, from the few hundred behind it, those
that share a prefix with the micro-batch and fit in what is left, so a group stays in one
micro-batch where it can; a group larger than the budget computes its prefix once per micro-batch.

A sequence longer than the budget is scored in chunks, one sequence at a time, in order: each
micro-batch ends with its next chunk, which takes what the queued shorter sequences leave of the
budget, and at least half of it while they wait. So short requests arriving behind a long sequence
wait for one micro-batch, not for the whole sequence, and the accelerator stays full. A chunked
sequence belongs to a started request: a weights swap waits for its last chunk.

Micro-batches are pipelined: the engine thread queues a micro-batch's work on the accelerator and
returns (`launch`); a second thread waits for its scores (`result`) while the engine thread queues the
next one behind it, so the accelerator does not sit idle while the host packs, collects and answers.
At most `IN_FLIGHT` micro-batches are launched and not yet collected.

A full budget starts at once on an idle accelerator: the request whose sequences fill it hands the
micro-batch to the engine thread itself. The worker would start it only when next run, and the
event loop wakes it behind every request ready before it, so a burst of requests (each parsed and
normalised on the loop, one after another) would all be parsed first while the accelerator waits.

A launch on an idle accelerator holds the event loop until it is queued (at most `LAUNCH_HOLD_S`):
the loop waits with the GIL released, so the engine thread packs and launches alone. Otherwise the
rest of a burst, parsed on the loop meanwhile, takes the GIL in turns with the launch and the
accelerator idles for the difference; nothing the loop would do then is more urgent, since every
request it could parse queues behind this micro-batch anyway.

New weights are applied between micro-batches, at a barrier: once a swap is waiting, only requests
that have started (some of their sequences scored) get more micro-batches; when none is left open,
the engine applies the weights, and the requests still queued start on them. So every request runs
on one set of weights, which it reports; a request pinned to another version fails with 409 before
any of its sequences runs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import math
import time
from collections import deque
from collections.abc import Coroutine, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from service.engine.contract import (
    GEMM_ROWS,
    SHAPE_STEP,
    Launched,
    OutOfMemory,
    ScoringEngine,
    StagedWeights,
    WeightsState,
)
from service.errors import EngineFailure, Overloaded, SequenceTooLarge, VersionMismatch
from service.jobs import Chunk, SequenceJob, SequenceScores
from service.metrics import Metrics
from service.prefixes import Forest, Grouper, share
from service.settings import Settings

log = logging.getLogger(__name__)

IN_FLIGHT = 2  # one micro-batch on the accelerator, the next queued behind it
LOOKAHEAD = 256  # queued sequences looked at, behind the first that does not fit, for prefix sharers
LAUNCH_HOLD_S = 0.025  # the longest the event loop waits for a launch on an idle accelerator


@dataclass(frozen=True, slots=True)
class Scored:
    """A request's scores, in order, and the weights version of every model it ran on."""

    scores: list[SequenceScores]
    versions: Mapping[str, str]
    computed_tokens: int = 0  # run through the decoder for it: a shared prefix split among its sequences


@dataclass(frozen=True, slots=True)
class Applied:
    """New weights in service: how long they waited for the barrier and how long scoring paused."""

    state: WeightsState
    wait_seconds: float
    pause_seconds: float


@dataclass(slots=True, eq=False)
class _Request:
    pins: Mapping[str, str]
    futures: list[asyncio.Future[SequenceScores]] = field(default_factory=list)
    versions: Mapping[str, str] | None = None  # set when its first sequence goes to the engine
    computed: float = 0.0  # tokens computed for its sequences scored so far (Forest.shares)


@dataclass(slots=True, eq=False)
class _Pending:
    job: SequenceJob
    future: asyncio.Future[SequenceScores]
    request: _Request
    enqueued: float = field(default_factory=time.perf_counter)


@dataclass(slots=True, eq=False)
class _Chunked:
    """A sequence longer than the budget, being scored chunk by chunk."""

    pending: _Pending
    sequence: int  # its id at the engine
    next_start: int = 0
    parts: list[SequenceScores] = field(default_factory=list)


@dataclass(slots=True, eq=False)
class _Batch:
    """One micro-batch: whole sequences (their shared prefixes once, per `forest`; None: nothing
    shared), then at most one chunk of a long one."""

    pending: list[_Pending]
    chunk: Chunk | None = None
    chunked: _Chunked | None = None  # whose chunk it is
    forest: Forest | None = None

    @classmethod
    def of(
        cls,
        pending: list[_Pending],
        share_min_tokens: int | None,
        chunk: Chunk | None = None,
        chunked: _Chunked | None = None,
    ) -> _Batch:
        """The micro-batch of `pending` (and the chunk), with the prefixes they share found."""
        forest = None
        if share_min_tokens is not None and len(pending) > 1:
            forest = share([p.job.tokens for p in pending], share_min_tokens)
            forest = forest if forest.shared else None
        return cls(pending, chunk, chunked, forest)

    @property
    def jobs(self) -> list[SequenceJob]:
        return [p.job for p in self.pending]

    @property
    def tokens(self) -> int:
        """Tokens it computes."""
        whole = self.forest.computed_tokens if self.forest else sum(p.job.num_tokens for p in self.pending)
        return whole + (self.chunk.num_tokens if self.chunk else 0)

    def shares(self) -> list[float]:
        """Tokens computed for each whole sequence (a shared prefix's split among its sequences)."""
        if self.forest is None:
            return [float(p.job.num_tokens) for p in self.pending]
        return self.forest.shares()

    @property
    def futures(self) -> list[asyncio.Future[SequenceScores]]:
        whole = [p.future for p in self.pending]
        return whole + ([self.chunked.pending.future] if self.chunked is not None else [])

    def __len__(self) -> int:
        return len(self.pending) + (self.chunk is not None)


@dataclass(slots=True, eq=False)
class _Flight:
    """A micro-batch launched on the engine whose scores are not collected yet."""

    batch: _Batch
    tokens: int
    launched: float
    collected: asyncio.Task[None] | None = None


@dataclass(slots=True, eq=False)
class _Handed:
    """A micro-batch a request handed to the engine thread; the worker takes it over as its own."""

    batch: _Batch
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
        chunk_tokens: int | None = None,
        share_min_tokens: int | None = None,
    ) -> None:
        """chunk_tokens: cut long sequences into chunks of exactly this many tokens (the last one
        less), whatever else is queued (batch invariance); None: each chunk takes the budget left.
        share_min_tokens: compute prefixes of at least this many tokens that sequences share once
        (None: never)."""
        self._engine = engine
        self._budget = max_batch_tokens
        self._max_queued = max_queued_tokens
        self._tokens_per_s = 0.0  # moving average of the engine's speed, for Retry-After
        self._wait_s = wait_s  # collation window when the engine is idle and the queue under budget
        self._hold_s = hold_s
        self._chunk_tokens = chunk_tokens
        self._share_min = share_min_tokens
        self._metrics = metrics
        self._queue: deque[_Pending] = deque()
        self._swaps: deque[_Swap] = deque()
        self._versions = _serving_versions(engine)
        self._queued_tokens = 0
        self._last_batch_done = 0.0
        self._wake = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="logprobd-engine")
        self._collector = ThreadPoolExecutor(max_workers=1, thread_name_prefix="logprobd-results")
        self._flights: deque[_Flight] = deque()  # launched, in launch order
        self._worker: asyncio.Task[None] | None = None
        self._waiting = False  # the worker waits for work or collates, launching nothing
        self._handed: _Handed | None = None
        self._chunked: _Chunked | None = None  # the long sequence being scored
        self._sequence_ids = itertools.count()

    @classmethod
    def from_settings(cls, engine: ScoringEngine, settings: Settings, metrics: Metrics) -> Batcher:
        """The server's batcher: budget, collation window, launch hold and queue cap from `settings`."""
        return cls(
            engine,
            settings.max_batch_tokens,
            metrics,
            wait_s=settings.batch_wait_ms / 1e3,
            hold_s=settings.launch_hold_ms / 1e3,
            max_queued_tokens=settings.max_queued_tokens,
            chunk_tokens=invariant_chunk(settings.max_batch_tokens) if settings.batch_invariant else None,
            share_min_tokens=sharing(settings),
        )

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
        request = _Request(pins or {})
        _check_pins(request.pins, self._versions)
        tokens = sum(job.num_tokens for job in jobs)
        if self._max_queued is not None and self._queue and self._queued_tokens + tokens > self._max_queued:
            speed = self._tokens_per_s or float(self._budget)
            raise Overloaded(
                f"{self._queued_tokens} tokens are queued; this server accepts at most {self._max_queued} "
                f"(max_queued_tokens)",
                retry_after=max(1, min(60, math.ceil(self._queued_tokens / speed))),
            )
        loop = asyncio.get_running_loop()
        request.futures = [loop.create_future() for _ in jobs]
        self._queue.extend(_Pending(job, f, request) for job, f in zip(jobs, request.futures, strict=True))
        self._queued(tokens)
        self._hand_over_a_full_budget()
        self._wake.set()
        return self._answer(request)

    @staticmethod
    async def _answer(request: _Request) -> Scored:
        try:
            scores = list(await asyncio.gather(*request.futures))
        finally:
            for f in request.futures:  # drop what has not reached the engine; retrieve every failure
                if not f.cancel() and not f.cancelled():
                    f.exception()
        assert request.versions is not None
        return Scored(scores, request.versions, round(request.computed))

    async def apply(self, staged: StagedWeights) -> Applied:
        """Put staged weights in service at the next barrier (see the module docstring)."""
        swap = _Swap(staged, asyncio.get_running_loop().create_future())
        self._swaps.append(swap)
        self._wake.set()
        return await swap.future

    async def _run(self) -> None:
        while True:
            self._waiting = True
            while not self._queue and not self._swaps and self._handed is None and self._chunked is None:
                self._wake.clear()
                await self._wake.wait()
            if self._handed is None and not self._swaps:
                await self._collate()
            self._waiting = False
            if self._handed is not None:
                handed, self._handed = self._handed, None
                await self._launch(handed.batch, handed)
            elif self._swaps and not self._open():
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

    def _hand_over_a_full_budget(self) -> None:
        """Start a micro-batch from here, the request's own call, when the worker would start it
        as soon as it ran (the accelerator idle, a full budget queued, no swap waiting): see the
        module docstring. The worker takes the launch over (`_Handed`)."""
        if (
            not self._waiting
            or self._handed is not None
            or self._flights
            or self._swaps
            or self._queued_tokens < self._budget
        ):
            return
        batch = self._take(only_started=False)
        if batch:
            launched = time.perf_counter()
            self._handed = _Handed(batch, self._send(batch), launched)
            self._observe_queue(batch, launched)

    def _send(self, batch: _Batch) -> asyncio.Future[Launched]:
        """`engine.launch` of the batch on the engine thread; on an idle accelerator, the event loop
        waits for it (GIL released), at most `hold_s`: see the module docstring."""
        future = self._executor.submit(self._engine.launch, batch.jobs, batch.chunk, batch.forest)
        if not self._flights:
            concurrent.futures.wait([future], timeout=self._hold_s)
        return asyncio.wrap_future(future)

    def _observe_queue(self, batch: _Batch, started: float) -> None:
        started_now = list(batch.pending)
        if batch.chunked is not None and batch.chunk is not None and batch.chunk.start == 0:
            started_now.append(batch.chunked.pending)
        for p in started_now:
            self._metrics.queue_seconds.observe(started - p.enqueued)

    async def _oldest_collected(self) -> None:
        task = self._flights[0].collected
        assert task is not None
        await asyncio.shield(task)  # cancelling the worker must not cancel the collection

    async def _drain(self) -> None:
        while self._flights:
            await self._oldest_collected()

    async def _launch(self, batch: _Batch, handed: _Handed | None = None) -> None:
        """Queue one micro-batch on the engine (or finish `handed`, already on its way there); on
        out-of-memory, split it and launch the parts."""
        tokens = batch.tokens
        launched = time.perf_counter() if handed is None else handed.launched
        try:
            handle = await (self._send(batch) if handed is None else handed.handle)
        except OutOfMemory as exc:
            await self._out_of_memory(batch, exc)
            return
        except Exception as exc:  # a failed forward fails its requests, never the server
            log.exception("micro-batch of %d sequences failed", len(batch))
            self._fail(batch, EngineFailure(f"scoring failed: {type(exc).__name__}: {exc}"))
            return
        flight = _Flight(batch, tokens, launched)
        flight.collected = asyncio.create_task(self._collect(flight, handle), name="logprobd-collect")
        self._flights.append(flight)

    async def _out_of_memory(self, batch: _Batch, exc: OutOfMemory) -> None:
        """Launch a micro-batch that ran out of memory as parts: its whole sequences apart from its
        chunk, then in halves; a part of one sequence that still does not fit fails."""
        if batch.chunk is not None and batch.pending:
            log.warning("%s; retrying the chunk and the whole sequences apart", exc)
            await self._launch(_Batch.of(batch.pending, self._share_min))
            await self._launch(_Batch([], batch.chunk, batch.chunked))
            return
        if len(batch.pending) > 1:
            log.warning("%s; retrying as two halves", exc)
            half = len(batch.pending) // 2
            await self._launch(_Batch.of(batch.pending[:half], self._share_min))
            await self._launch(_Batch.of(batch.pending[half:], self._share_min))
            return
        tokens = batch.chunk.job.num_tokens if batch.chunk is not None else batch.tokens
        self._fail(
            batch, SequenceTooLarge(f"a sequence of {tokens} tokens does not fit in accelerator memory")
        )

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
        for p, result, computed in zip(batch.pending, results, batch.shares(), strict=False):
            p.request.computed += computed
            if not p.future.done():
                p.future.set_result(result)
        if batch.chunked is not None and batch.chunk is not None:
            chunked = batch.chunked
            chunked.pending.request.computed += batch.chunk.num_tokens
            chunked.parts.append(results[-1])
            if batch.chunk.last and not chunked.pending.future.done():
                self._metrics.sequences.inc()
                chunked.pending.future.set_result(SequenceScores.join(chunked.parts))
        self._wake.set()  # a collation waiting on a busy accelerator stops waiting once it is idle

    def _fail(self, batch: _Batch, error: Exception) -> None:
        self._fail_futures(batch.futures, error)
        if batch.chunked is not None and batch.chunked is self._chunked:
            self._end_chunked()
        elif batch.chunk is not None:  # its last chunk: the engine may still hold its stores
            self._executor.submit(self._engine.release, batch.chunk.sequence)

    def _end_chunked(self) -> None:
        """Stop scoring the chunked sequence (done, failed or cancelled); the engine drops its stores."""
        chunked = self._chunked
        assert chunked is not None
        self._chunked = None
        self._queued(-(chunked.pending.job.num_tokens - chunked.next_start))
        self._executor.submit(self._engine.release, chunked.sequence)  # its last chunk never came

    @staticmethod
    def _fail_futures(futures: list[asyncio.Future[SequenceScores]], error: Exception) -> None:
        for future in futures:
            if not future.done():
                future.set_exception(error)

    async def _collate(self) -> None:
        """Let requests sent together share a micro-batch: wait, at most `wait_s` after the oldest
        queued sequence arrived, until the queue holds a full budget. While a micro-batch is in
        flight the wait costs nothing (the next one would queue behind it); once none is, work that
        was waiting when the last one finished goes at once."""
        if self._chunked is not None or not self._queue:  # a long sequence keeps the accelerator busy
            return
        oldest = self._queue[0].enqueued
        deadline = oldest + self._wait_s
        while self._queued_tokens < self._budget and self._handed is None:
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

    def _queued(self, tokens: int) -> None:
        self._queued_tokens += tokens
        self._metrics.queue_tokens.set(self._queued_tokens)

    def _open(self) -> bool:
        """Whether a started request still has queued sequences, or a sequence in chunks (the barrier
        is not reached)."""
        if self._chunked is not None and not self._chunked.pending.future.done():
            return True
        return any(p.request.versions is not None and not p.future.done() for p in self._queue)

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
        self._versions = _serving_versions(self._engine)
        done = time.perf_counter()
        if not swap.future.done():
            swap.future.set_result(Applied(state, started - swap.enqueued, done - started))

    def _take(self, only_started: bool) -> _Batch:  # noqa: PLR0915 (one pass over the queue)
        """Pop queued sequences in order while what they compute fits the token budget (at least
        one), then sharers from behind the first that does not (see the module docstring), then
        the next chunk of the long sequence being scored. A request starts, on the current weights,
        when its first sequence is taken; with `only_started` (a swap is waiting) only sequences of
        started requests are taken."""
        if self._chunked is not None and self._chunked.pending.future.done():  # its request is gone
            self._end_chunked()
        batch: list[_Pending] = []
        skipped: list[_Pending] = []  # passed over: unstarted while a swap waits, or long behind another
        tokens = 0  # computed
        shared = self._budget - self._budget // 2  # whole sequences' part beside a chunk
        room = self._budget if self._chunked is None else shared
        grouper = Grouper(self._share_min) if self._share_min is not None else None
        looked: int | None = None  # behind the first that did not fit: how many looked at
        while self._queue:
            p = self._queue.popleft()
            cost: int | None = None  # what it computes beside the micro-batch, once known
            if looked is not None:
                assert grouper is not None
                if looked == LOOKAHEAD:
                    self._queue.appendleft(p)
                    break
                looked += 1
                cost = grouper.cost(p.job.tokens)
                if cost == p.job.num_tokens or tokens + cost > room or p.future.done():
                    skipped.append(p)  # shares nothing with the micro-batch, or does not fit
                    continue
            if not p.future.done() and p.request.versions is None and not only_started:
                self._start(p.request)
            if p.future.done():  # cancelled (its client is gone) or refused (pinned to other weights)
                self._queued(-p.job.num_tokens)
                continue
            if only_started and p.request.versions is None:
                skipped.append(p)
                continue
            if p.job.num_tokens > self._budget:
                if self._chunked is None:
                    self._chunked = _Chunked(p, next(self._sequence_ids))
                    room = shared
                else:
                    skipped.append(p)
                continue
            if cost is None:
                cost = grouper.cost(p.job.tokens) if grouper is not None else p.job.num_tokens
            if batch and tokens + cost > room:
                if grouper is None:
                    self._queue.appendleft(p)
                    break
                skipped.append(p)
                looked = 0
                continue
            self._queued(-p.job.num_tokens)
            batch.append(p)
            tokens += cost
            if grouper is not None:
                grouper.add(p.job.tokens)
        self._queue.extendleft(reversed(skipped))
        return self._with_chunk(batch, tokens)

    def _with_chunk(self, batch: list[_Pending], tokens: int) -> _Batch:
        """`batch`, ended by the next chunk of the chunked sequence, in the budget left."""
        chunked = self._chunked
        least = self._chunk_tokens or min(SHAPE_STEP, max(1, self._budget // 8))
        if chunked is None or (batch and self._budget - tokens < least):  # no room: the next one
            return _Batch.of(batch, self._share_min)
        job = chunked.pending.job
        start = chunked.next_start
        end = min(job.num_tokens, start + (self._chunk_tokens or self._budget - tokens))
        chunked.next_start = end
        self._queued(-(end - start))
        if end == job.num_tokens:
            self._chunked = None  # the last chunk: the engine drops the stores after it
        return _Batch.of(batch, self._share_min, Chunk(job, chunked.sequence, start, end), chunked)

    def _start(self, request: _Request) -> None:
        try:
            _check_pins(request.pins, self._versions)
        except VersionMismatch as exc:
            self._fail_futures(request.futures, exc)
            return
        request.versions = self._versions


def invariant_chunk(budget: int) -> int:
    """The fixed chunk of batch-invariant mode: half the budget, a multiple of GEMM_ROWS where it can
    be (the engine's GEMM calls), so whole sequences share its micro-batch."""
    half = budget // 2
    return half // GEMM_ROWS * GEMM_ROWS or max(1, half)


def sharing(settings: Settings) -> int | None:
    """The shortest prefix sequences share (None: sharing off; always off in batch-invariant mode,
    where a sequence's scores must not depend on what else is batched)."""
    if not settings.share_prefixes or settings.batch_invariant:
        return None
    return settings.share_min_tokens


def _serving_versions(engine: ScoringEngine) -> Mapping[str, str]:
    """model -> the version it serves: what a request starting now runs on."""
    return {target: w.version for target, w in engine.weights.items()}


def _check_pins(pins: Mapping[str, str], versions: Mapping[str, str]) -> None:
    for target, wanted in pins.items():
        serving = versions.get(target)
        if serving != wanted:
            raise VersionMismatch(target=target, requested=wanted, serving=serving)
