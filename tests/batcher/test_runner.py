"""The batcher's asyncio runner over a fake engine: packing, splitting, ordering, failures, the loop.

Tests wait for what the fake engine signals (`launched`: a micro-batch entered `launch`); a sleep
left here is the scenario under test (a request arriving so long after another), not a guess at
when something has happened."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest

from service.batcher import IN_FLIGHT, LAUNCH_HOLD_S, Applied, Batcher, Scored
from service.core.errors import EngineFailure, Overloaded, SequenceTooLarge, VersionMismatch
from service.core.jobs import Chunk, SequenceJob, SequenceScores
from service.core.prefixes import Forest
from service.engine.contract import Launched, ReloadOrder, WeightsState
from service.metrics import Metrics
from tests.support.fakes import FakeEngine, expected_scores


def job(length: int, first: int = 0, temperature: float = 1.0) -> SequenceJob:
    tokens = np.arange(first, first + length, dtype=np.int64)
    return SequenceJob(tokens, np.arange(1, length, dtype=np.int64), temperature, False)


async def scores(batcher: Batcher, jobs: list[SequenceJob]) -> list[SequenceScores]:
    return (await batcher.score(jobs)).scores


async def launched(engine: FakeEngine, count: int) -> None:
    """Until `count` micro-batches have entered the engine (waited for off the event loop)."""
    await asyncio.to_thread(engine.wait_launched, count)


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


T = TypeVar("T")


def run(
    loop: asyncio.AbstractEventLoop, engine: FakeEngine, budget: int, body: Callable[[Batcher], Awaitable[T]]
) -> T:
    return run_with_wait(loop, engine, budget, 0.0, body)


def run_with_wait(
    loop: asyncio.AbstractEventLoop,
    engine: FakeEngine,
    budget: int,
    wait_s: float,
    body: Callable[[Batcher], Awaitable[T]],
    *,
    hold_s: float = LAUNCH_HOLD_S,
    share_min_tokens: int | None = None,
) -> T:
    async def main() -> T:
        batcher = Batcher(
            engine, budget, Metrics(), wait_s=wait_s, hold_s=hold_s, share_min_tokens=share_min_tokens
        )
        batcher.start()
        try:
            return await body(batcher)
        finally:
            await batcher.stop()

    return loop.run_until_complete(main())


def test_request_larger_than_budget_is_split_and_answered_whole(loop: asyncio.AbstractEventLoop) -> None:
    engine = FakeEngine()
    jobs = [job(n, first=10 * i) for i, n in enumerate([30, 20, 25, 10, 40])]
    results = run(loop, engine, 50, lambda b: scores(b, jobs))
    assert len(results) == len(jobs)
    for j, r in zip(jobs, results, strict=True):
        np.testing.assert_array_equal(r.logprobs, expected_scores(j).logprobs)
    assert all(sum(batch) <= 50 for batch in engine.batches)
    assert len(engine.batches) >= 3


def test_submit_each_sets_the_first_future_while_a_later_micro_batch_computes(
    loop: asyncio.AbstractEventLoop,
) -> None:
    """Four jobs of 10 tokens, a budget of 16: four micro-batches, each 50 ms on the device. Job 0's
    scores come while micro-batch 2 is launched and not yet collected; every job's are its own."""
    engine = FakeEngine(delay=0.05)
    jobs = [job(10, first=i) for i in range(4)]

    async def body(batcher: Batcher) -> tuple[list[SequenceScores], list[bool], list[tuple[str, int]]]:
        futures = batcher.submit_each(jobs)
        first = await futures[0]
        done_then, events_then = [f.done() for f in futures], list(engine.events)
        return [first, *[await f for f in futures[1:]]], done_then, events_then

    results, done_then, events_then = run(loop, engine, 16, body)
    for got, j in zip(results, jobs, strict=True):
        np.testing.assert_array_equal(got.logprobs, expected_scores(j).logprobs)
    assert done_then == [True, False, False, False]
    assert ("launch", 2) in events_then
    assert ("collected", 2) not in events_then
    assert engine.batches == [[10]] * 4


def test_submit_each_cancelled_futures_never_reach_the_engine(loop: asyncio.AbstractEventLoop) -> None:
    """Cancelled after job 0's scores (jobs 0 and 1 launched by then): jobs 2 and 3 never launch."""
    engine = FakeEngine(delay=0.05)
    jobs = [job(10, first=i) for i in range(4)]

    async def body(batcher: Batcher) -> SequenceScores:
        futures = batcher.submit_each(jobs)
        await futures[0]
        for f in futures[2:]:
            f.cancel()
        second = await futures[1]
        await scores(batcher, [job(5, first=100)])  # queued after them: launched only once they are gone
        return second

    second = run(loop, engine, 16, body)
    np.testing.assert_array_equal(second.logprobs, expected_scores(jobs[1]).logprobs)
    assert engine.batches == [[10], [10], [5]]


def test_submit_each_failures_are_each_jobs_own(loop: asyncio.AbstractEventLoop) -> None:
    """Job 1's micro-batch fails on the device: its future holds the failure, the others' scores."""
    engine = FakeEngine(delay=0.01)
    engine.fail_late_on_token = 500
    jobs = [job(10), job(10, first=495), job(10, first=20)]

    async def body(batcher: Batcher) -> list[SequenceScores | BaseException]:
        futures = batcher.submit_each(jobs)
        return await asyncio.gather(*futures, return_exceptions=True)

    got = run(loop, engine, 16, body)
    assert isinstance(got[1], EngineFailure)
    assert "injected device error" in str(got[1])
    for i in (0, 2):
        result = got[i]
        assert isinstance(result, SequenceScores)
        np.testing.assert_array_equal(result.logprobs, expected_scores(jobs[i]).logprobs)


def test_concurrent_requests_are_merged_and_each_gets_its_own_answers(
    loop: asyncio.AbstractEventLoop,
) -> None:
    engine = FakeEngine(delay=0.02)
    requests = [[job(5 + i % 7, first=100 * i + k, temperature=0.5 + i) for k in range(3)] for i in range(12)]

    async def body(batcher: Batcher) -> list[list[SequenceScores]]:
        return await asyncio.gather(*(scores(batcher, r) for r in requests))

    answers = run(loop, engine, 64, body)
    for request, answer in zip(requests, answers, strict=True):
        for j, r in zip(request, answer, strict=True):
            np.testing.assert_array_equal(r.logprobs, expected_scores(j).logprobs)
    assert max(len(batch) for batch in engine.batches) > 3  # requests were merged
    assert all(sum(batch) <= 64 for batch in engine.batches)
    assert engine.threads == {"logprobd-engine_0"}  # one worker thread


def test_next_micro_batch_is_launched_before_the_last_is_collected(loop: asyncio.AbstractEventLoop) -> None:
    engine = FakeEngine(delay=0.05)
    jobs = [job(10, first=i) for i in range(5)]  # budget 16: five micro-batches
    results = run(loop, engine, 16, lambda b: scores(b, jobs))
    for got, j in zip(results, jobs, strict=True):
        np.testing.assert_array_equal(got.logprobs, expected_scores(j).logprobs)
    assert engine.events == [
        ("launch", 1),
        ("launch", 2),  # queued behind the first while the device (the delay) works on it
        ("collected", 1),
        ("launch", 3),
        ("collected", 2),
        ("launch", 4),
        ("collected", 3),
        ("launch", 5),
        ("collected", 4),
        ("collected", 5),
    ]
    assert IN_FLIGHT == 2
    assert engine.threads == {"logprobd-engine_0"}  # launched on the engine thread
    assert engine.collected_on == {"logprobd-results_0"}  # waited for on another


def test_with_a_micro_batch_in_flight_the_next_waits_for_a_fuller_budget(
    loop: asyncio.AbstractEventLoop,
) -> None:
    engine = FakeEngine(delay=0.3)

    async def body(batcher: Batcher) -> None:
        first = asyncio.create_task(scores(batcher, [job(20)]))  # a full budget: launched at once
        await launched(engine, 1)
        second = asyncio.create_task(scores(batcher, [job(5, first=1)]))  # waits, the device is busy
        await asyncio.sleep(0.05)  # the third arrives 50 ms later, within the 100 ms window
        await asyncio.gather(first, second, scores(batcher, [job(6, first=2)]))

    run_with_wait(loop, engine, 20, 0.1, body)
    assert engine.batches == [[20], [5, 6]]


def test_collation_stops_waiting_when_the_device_goes_idle(loop: asyncio.AbstractEventLoop) -> None:
    engine = FakeEngine(delay=0.05)

    async def body(batcher: Batcher) -> float:
        start = time.perf_counter()
        first = asyncio.create_task(scores(batcher, [job(20)]))
        await launched(engine, 1)
        await asyncio.gather(first, scores(batcher, [job(5, first=1)]))  # would wait 2 s for company
        return time.perf_counter() - start

    assert run_with_wait(loop, engine, 20, 2.0, body) < 1.0
    assert engine.batches == [[20], [5]]


def test_late_device_error_fails_its_micro_batch_only(loop: asyncio.AbstractEventLoop) -> None:
    engine = FakeEngine(delay=0.02)
    engine.fail_late_on_token = 500

    async def body(batcher: Batcher) -> list[SequenceScores]:
        doomed = asyncio.create_task(scores(batcher, [job(10, first=500)]))
        await launched(engine, 1)
        fine = asyncio.create_task(scores(batcher, [job(10, first=3)]))  # launched behind it
        with pytest.raises(EngineFailure, match="injected device error"):
            await doomed
        return await fine

    (good,) = run(loop, engine, 16, body)
    np.testing.assert_array_equal(good.logprobs, expected_scores(job(10, first=3)).logprobs)
    assert ("collected", 2) in engine.events


def test_sequence_longer_than_budget_is_scored_in_chunks_in_order(loop: asyncio.AbstractEventLoop) -> None:
    engine = FakeEngine()
    jobs = [job(4), job(40, first=7), job(4, first=3), job(37, first=50)]
    results = run(loop, engine, 16, lambda b: scores(b, jobs))
    for got, want in zip(results, jobs, strict=True):
        np.testing.assert_array_equal(got.logprobs, expected_scores(want).logprobs)
        assert got.entropy is not None
        np.testing.assert_array_equal(got.entropy, want.actions.astype(np.float32))
    assert all(sum(batch) <= 16 for batch in engine.batches)
    by_sequence: dict[int, list[tuple[int, int]]] = {}
    for chunk in engine.chunks:
        by_sequence.setdefault(chunk.sequence, []).append((chunk.start, chunk.end))
    spans = sorted(by_sequence.values(), key=lambda s: -s[-1][1])
    assert [s[-1][1] for s in spans] == [40, 37]  # every chunk, in order (FakeEngine checks the order)
    first = {s: next(i for i, c in enumerate(engine.chunks) if c.sequence == s) for s in by_sequence}
    last = {s: max(i for i, c in enumerate(engine.chunks) if c.sequence == s) for s in by_sequence}
    (a, b) = sorted(first, key=first.__getitem__)
    assert last[a] < first[b]  # one long sequence at a time: its keys and values are what memory holds
    assert engine.chunked == {}  # each last chunk dropped its sequence's stores
    assert engine.released == []


def test_short_requests_behind_a_long_sequence_wait_for_one_micro_batch(
    loop: asyncio.AbstractEventLoop,
) -> None:
    engine = FakeEngine(delay=0.02)

    async def body(batcher: Batcher) -> tuple[float, float]:
        started = time.perf_counter()
        long = asyncio.create_task(scores(batcher, [job(400)]))  # 25+ micro-batches of 16
        await launched(engine, 1)
        await scores(batcher, [job(5, first=1)])
        short_done = time.perf_counter() - started
        await long
        return short_done, time.perf_counter() - started

    short_done, long_done = run(loop, engine, 16, body)
    assert short_done < 0.05 + 5 * 0.02 + 0.1 < long_done
    mixed = [batch for batch in engine.batches if len(batch) > 1]
    assert mixed == [[5, 11]]  # the short sequence rode with a chunk, which took the rest of the budget


def test_a_cancelled_long_request_stops_its_chunks_and_frees_them(loop: asyncio.AbstractEventLoop) -> None:
    engine = FakeEngine(delay=0.02)

    async def body(batcher: Batcher) -> list[SequenceScores]:
        long = asyncio.create_task(scores(batcher, [job(400)]))
        await launched(engine, 3)
        long.cancel()
        await asyncio.gather(long, return_exceptions=True)  # its answers are cancelled
        return await scores(batcher, [job(5)])

    (good,) = run(loop, engine, 16, body)
    np.testing.assert_array_equal(good.logprobs, expected_scores(job(5)).logprobs)
    assert 3 <= len(engine.chunks) < 25
    assert engine.released == [engine.chunks[0].sequence]
    assert engine.chunked == {}


def test_a_failed_chunk_fails_its_sequence_and_the_next_long_one_starts(
    loop: asyncio.AbstractEventLoop,
) -> None:
    engine = FakeEngine(fail_on_token=999)

    async def body(batcher: Batcher) -> list[SequenceScores]:
        with pytest.raises(EngineFailure, match="injected failure"):
            await scores(batcher, [job(60, first=960)])  # token 999 in its third chunk
        return await scores(batcher, [job(50)])

    (good,) = run(loop, engine, 16, body)
    np.testing.assert_array_equal(good.logprobs, expected_scores(job(50)).logprobs)
    failed = engine.chunks[0].sequence
    assert engine.released == [failed]
    assert [c.start for c in engine.chunks if c.sequence == failed] == [0, 16, 32]


def test_a_weights_swap_waits_for_the_last_chunk(loop: asyncio.AbstractEventLoop) -> None:
    engine = FakeEngine(delay=0.01)

    async def body(batcher: Batcher) -> tuple[Scored, Applied]:
        long = asyncio.create_task(batcher.score([job(100)]))
        await launched(engine, 1)
        staged = await asyncio.to_thread(engine.stage, _order(5, "v5"))
        return await long, await batcher.apply(staged)

    result, _ = run(loop, engine, 16, body)
    _assert_scored_on(result, [job(100)], 0.0, "initial")
    assert engine.applied_between == [len(engine.batches)]


def test_engine_failure_fails_its_requests_only(loop: asyncio.AbstractEventLoop) -> None:
    engine = FakeEngine(fail_on_token=999)

    async def body(batcher: Batcher) -> list[SequenceScores]:
        with pytest.raises(EngineFailure, match="injected failure"):
            await scores(batcher, [job(5, first=995)])
        return await scores(batcher, [job(5)])

    (good,) = run(loop, engine, 64, body)
    np.testing.assert_array_equal(good.logprobs, expected_scores(job(5)).logprobs)


def test_cancelled_request_never_reaches_the_engine(loop: asyncio.AbstractEventLoop) -> None:
    engine = FakeEngine(delay=0.1)

    async def body(batcher: Batcher) -> list[SequenceScores]:
        first = asyncio.create_task(scores(batcher, [job(8, first=1)]))
        await launched(engine, 1)
        doomed = asyncio.create_task(scores(batcher, [job(9, first=500)]))
        await asyncio.sleep(0)  # one turn of the loop: it queues its sequence
        doomed.cancel()
        last = await scores(batcher, [job(7, first=2)])
        await first
        return last

    run(loop, engine, 64, body)
    assert all(9 not in b for b in engine.batches)


class Ticker:
    """While entered, a task on the event loop that wakes every `period` s and counts its wake-ups."""

    def __init__(self, period: float) -> None:
        self.period = period
        self.count = 0
        self.ticked = asyncio.Event()  # set at its first wake-up
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Ticker:
        self._task = asyncio.create_task(self._tick())
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self._task is not None
        self._task.cancel()

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.period)
            self.count += 1
            self.ticked.set()


def test_event_loop_keeps_running_during_the_forward(loop: asyncio.AbstractEventLoop) -> None:
    engine = FakeEngine(delay=0.3)

    async def body(batcher: Batcher) -> int:
        async with Ticker(0.01) as ticker:
            await scores(batcher, [job(5)])
            return ticker.count

    assert run(loop, engine, 64, body) >= 10


@pytest.mark.parametrize(("wait_s", "merged"), [(0.0, False), (0.2, True)])
def test_requests_sent_together_share_a_micro_batch_within_the_wait(
    loop: asyncio.AbstractEventLoop, wait_s: float, merged: bool
) -> None:
    engine = FakeEngine()

    async def body(batcher: Batcher) -> None:
        first = asyncio.create_task(scores(batcher, [job(5)]))
        await asyncio.sleep(0.02)  # the scenario: the second request arrives 20 ms after the first
        await asyncio.gather(first, scores(batcher, [job(6)]))

    run_with_wait(loop, engine, 64, wait_s, body)
    assert engine.batches == ([[5, 6]] if merged else [[5], [6]])


def test_collation_stops_waiting_once_the_budget_is_full(loop: asyncio.AbstractEventLoop) -> None:
    engine = FakeEngine()

    async def body(batcher: Batcher) -> float:
        start = time.perf_counter()
        await asyncio.gather(scores(batcher, [job(30)]), scores(batcher, [job(40)]))
        return time.perf_counter() - start

    elapsed = run_with_wait(loop, engine, 64, 5.0, body)
    assert elapsed < 1.0  # not the 5 s window: 70 queued tokens already exceed the budget of 64
    assert engine.batches == [[30], [40]]


def test_a_full_budget_starts_while_later_requests_of_a_burst_are_still_parsed(
    loop: asyncio.AbstractEventLoop,
) -> None:
    """Three requests ready at once, as a burst is on the event loop; the third spends 0.1 s being
    parsed. The first two fill the budget: they reach the engine during that parse, not after it."""
    engine = FakeEngine(delay=0.2)
    third_parsed = threading.Event()
    launched_after_the_parse: list[bool] = []
    launch = engine.launch

    def recording(
        jobs: Sequence[SequenceJob],
        chunk: Chunk | None = None,
        forest: Forest | None = None,
        cache: Any = None,
    ) -> Launched:
        launched_after_the_parse.append(third_parsed.is_set())
        return launch(jobs, chunk, forest, cache)

    engine.launch = recording  # type: ignore[method-assign,assignment]

    async def body(batcher: Batcher) -> list[list[SequenceScores]]:
        async def request(length: int, first: int, parse_s: float = 0.0) -> list[SequenceScores]:
            if parse_s:
                time.sleep(parse_s)  # parsing holds the event loop
                third_parsed.set()
            return await scores(batcher, [job(length, first=first)])

        return list(await asyncio.gather(request(30, 1), request(40, 100), request(10, 200, parse_s=0.1)))

    results = run_with_wait(loop, engine, 70, 5.0, body)
    assert engine.batches == [[30, 40], [10]]
    assert launched_after_the_parse == [False, True]
    for (got,), (length, first) in zip(results, [(30, 1), (40, 100), (10, 200)], strict=True):
        np.testing.assert_array_equal(got.logprobs, expected_scores(job(length, first=first)).logprobs)


@pytest.mark.parametrize(
    ("hold_s", "loop_ran"),
    [(0.5, [False, True]), (0.005, [True, True]), (0.0, [True, True])],
    ids=["held", "hold-bounded", "no-hold"],
)
def test_a_launch_on_an_idle_accelerator_holds_the_event_loop_until_it_is_queued(
    loop: asyncio.AbstractEventLoop, hold_s: float, loop_ran: list[bool]
) -> None:
    """Each launch takes 20 ms of the engine thread (the default hold, LAUNCH_HOLD_S, is 25 ms; 0.5 s
    here, so a slow machine cannot make the launch outlast it). The first, on an idle accelerator,
    holds the loop (a ticker on it does not tick meanwhile); the second, queued behind the first while
    that one is in flight, runs beside the loop. A hold shorter than the launch lets the loop go on."""
    engine = FakeEngine(delay=0.1)
    ticker = Ticker(0.001)
    ticked: list[bool] = []
    launch = engine.launch

    def slow(
        jobs: Sequence[SequenceJob],
        chunk: Chunk | None = None,
        forest: Forest | None = None,
        cache: Any = None,
    ) -> Launched:
        before = ticker.count
        time.sleep(0.02)
        ticked.append(ticker.count != before)
        return launch(jobs, chunk, forest, cache)

    engine.launch = slow  # type: ignore[method-assign,assignment]

    async def body(batcher: Batcher) -> list[SequenceScores]:
        async with ticker:
            await ticker.ticked.wait()
            return await scores(batcher, [job(30, first=1), job(30, first=100)])  # two micro-batches

    results = run_with_wait(loop, engine, 32, 0.0, body, hold_s=hold_s)
    assert engine.batches == [[30], [30]]
    assert ticked == loop_ran
    for got, first in zip(results, [1, 100], strict=True):
        np.testing.assert_array_equal(got.logprobs, expected_scores(job(30, first=first)).logprobs)


def test_a_handed_over_micro_batch_that_runs_out_of_memory_is_split(loop: asyncio.AbstractEventLoop) -> None:
    engine = FakeEngine(oom_over_tokens=50)

    async def body(batcher: Batcher) -> list[list[SequenceScores]]:
        return list(await asyncio.gather(scores(batcher, [job(30, first=1)]), scores(batcher, [job(40)])))

    results = run_with_wait(loop, engine, 70, 5.0, body)
    assert engine.batches == [[30, 40], [30], [40]]
    np.testing.assert_array_equal(results[1][0].logprobs, expected_scores(job(40)).logprobs)


def test_out_of_memory_splits_the_micro_batch_until_it_fits(loop: asyncio.AbstractEventLoop) -> None:
    engine = FakeEngine(oom_over_tokens=50)
    jobs = [job(30, first=1), job(30, first=100), job(30, first=200)]
    results = run(loop, engine, 100, lambda b: scores(b, jobs))
    for j, r in zip(jobs, results, strict=True):
        np.testing.assert_array_equal(r.logprobs, expected_scores(j).logprobs)
    assert engine.batches == [[30, 30, 30], [30], [30, 30], [30], [30]]


def test_only_a_sequence_that_cannot_fit_alone_fails(loop: asyncio.AbstractEventLoop) -> None:
    engine = FakeEngine(oom_over_tokens=50)

    async def body(batcher: Batcher) -> list[SequenceScores]:
        big = asyncio.create_task(scores(batcher, [job(60)]))
        small = asyncio.create_task(scores(batcher, [job(20, first=7)]))
        with pytest.raises(SequenceTooLarge, match="60 tokens"):
            await big
        return await small

    (small,) = run(loop, engine, 100, body)
    np.testing.assert_array_equal(small.logprobs, expected_scores(job(20, first=7)).logprobs)


def test_queue_over_its_token_cap_answers_overloaded_with_retry_after(
    loop: asyncio.AbstractEventLoop,
) -> None:
    engine = FakeEngine(delay=0.2)

    async def main() -> tuple[int, list[list[int]]]:
        batcher = Batcher(engine, 64, Metrics(), max_queued_tokens=50)
        batcher.start()
        try:
            first = asyncio.create_task(scores(batcher, [job(40)]))
            await launched(engine, 1)  # first is in the engine; the queue is empty
            second = asyncio.create_task(scores(batcher, [job(40, first=1)]))
            await asyncio.sleep(0)  # one turn of the loop: it queues its sequence
            with pytest.raises(Overloaded, match="max_queued_tokens") as raised:
                await scores(batcher, [job(40, first=2)])
            await asyncio.gather(first, second)
            return raised.value.retry_after, engine.batches
        finally:
            await batcher.stop()

    retry_after, batches = loop.run_until_complete(main())
    assert retry_after >= 1
    assert batches == [[40], [40]]  # the refused request never queued


def _order(shift: int, version: str) -> ReloadOrder:
    return ReloadOrder("policy", Path(f"/weights/{shift}"), version)


def _assert_scored_on(result: Scored, jobs: list[SequenceJob], shift: float, version: str) -> None:
    assert result.versions == {"policy": version}
    for got, j in zip(result.scores, jobs, strict=True):
        np.testing.assert_array_equal(got.logprobs, expected_scores(j, shift).logprobs)


def test_weights_swap_waits_for_started_requests_and_queued_ones_start_on_the_new(
    loop: asyncio.AbstractEventLoop,
) -> None:
    engine = FakeEngine(delay=0.03)
    split = [job(10, first=i) for i in range(4)]  # budget 16: four micro-batches
    later = [job(10, first=50 + i) for i in range(2)]

    async def body(batcher: Batcher) -> tuple[Scored, Scored, Applied]:
        first = asyncio.create_task(batcher.score(split))
        await launched(engine, 1)  # its first micro-batch is in the engine
        second = asyncio.create_task(batcher.score(later))  # queued, not started
        await asyncio.sleep(0)  # one turn of the loop: it queues its sequences
        applied = await batcher.apply(engine.stage(_order(5, "v5")))
        return await first, await second, applied

    first, second, applied = run(loop, engine, 16, body)
    _assert_scored_on(first, split, 0.0, "initial")
    _assert_scored_on(second, later, 5.0, "v5")
    assert engine.applied_between == [4]  # after all of the started request, before the queued one
    at = engine.events.index(("apply", 4))  # every launched micro-batch was collected before it
    assert engine.events[at - 2 : at + 2] == [("collected", 3), ("collected", 4), ("apply", 4), ("launch", 5)]
    assert applied.state.version == "v5"
    assert applied.wait_seconds > 0.05  # it waited for three more micro-batches
    assert engine.threads == {"logprobd-engine_0"}  # applied on the engine thread


def test_swap_with_nothing_in_flight_applies_at_once(loop: asyncio.AbstractEventLoop) -> None:
    engine = FakeEngine()

    async def body(batcher: Batcher) -> tuple[Applied, Scored]:
        applied = await batcher.apply(engine.stage(_order(2, "v2")))
        return applied, await batcher.score([job(6)])

    applied, result = run(loop, engine, 16, body)
    assert applied.state.version == "v2"
    _assert_scored_on(result, [job(6)], 2.0, "v2")


def test_pins_get_409_never_a_mixed_answer(loop: asyncio.AbstractEventLoop) -> None:
    engine = FakeEngine(delay=0.03)
    split = [job(10, first=i) for i in range(3)]

    async def body(batcher: Batcher) -> tuple[Scored, BaseException | Scored, Scored]:
        running = asyncio.create_task(batcher.score(split, {"policy": "initial"}))
        await launched(engine, 1)
        # queued pinned to the old weights: by the time it would start, they are gone
        stale = asyncio.create_task(batcher.score([job(8)], {"policy": "initial"}))
        await asyncio.sleep(0)  # one turn of the loop: it queues its sequence
        await batcher.apply(engine.stage(_order(7, "v7")))
        with pytest.raises(VersionMismatch) as at_admission:
            await batcher.score([job(8)], {"policy": "initial"})
        assert at_admission.value.serving == "v7"
        fresh = await batcher.score([job(8)], {"policy": "v7"})
        (stale_result,) = await asyncio.gather(stale, return_exceptions=True)
        return await running, stale_result, fresh

    first, stale, fresh = run(loop, engine, 16, body)
    _assert_scored_on(first, split, 0.0, "initial")
    assert isinstance(stale, VersionMismatch)
    assert (stale.target, stale.requested, stale.serving) == ("policy", "initial", "v7")
    assert stale.body()["error"]["serving_version"] == "v7"
    _assert_scored_on(fresh, [job(8)], 7.0, "v7")
    assert engine.batches == [[10], [10], [10], [8]]  # the stale request never reached the engine


def test_a_failed_apply_fails_the_reload_not_the_server(loop: asyncio.AbstractEventLoop) -> None:
    engine = FakeEngine()

    def broken(staged: object) -> WeightsState:
        raise RuntimeError("device fell off")

    engine.apply = broken  # type: ignore[method-assign]

    async def body(batcher: Batcher) -> Scored:
        with pytest.raises(EngineFailure, match="device fell off"):
            await batcher.apply(engine.stage(_order(1, "v1")))
        return await batcher.score([job(5)])

    _assert_scored_on(run(loop, engine, 16, body), [job(5)], 0.0, "initial")


# --- shared prefixes: the budget counts computed tokens ---


def grouped(prompt: int, response: int, first: int) -> SequenceJob:
    """A sequence of a shared 100-token prompt (tokens 0..`prompt`-1) and its own response."""
    tokens = np.concatenate([np.arange(prompt), np.arange(first, first + response)]).astype(np.int64)
    return SequenceJob(tokens, np.arange(prompt, prompt + response, dtype=np.int64), 1.0, False)


def run_sharing(
    loop: asyncio.AbstractEventLoop, engine: FakeEngine, budget: int, body: Callable[[Batcher], Awaitable[T]]
) -> T:
    return run_with_wait(loop, engine, budget, 0.05, body, share_min_tokens=16)


def test_a_group_fits_the_budget_by_the_tokens_it_computes(loop: asyncio.AbstractEventLoop) -> None:
    """8 x (100 + 20) = 960 tokens sent, 100 + 8 x 20 = 260 computed: one micro-batch of 300."""
    engine = FakeEngine()
    jobs = [grouped(100, 20, 1000 + 100 * i) for i in range(8)]
    result = run_sharing(loop, engine, 300, lambda b: b.score(jobs))
    assert engine.batches == [[120] * 8]
    (forest,) = engine.forests
    assert forest is not None
    assert forest.computed_tokens == result.computed_tokens == 260
    for got, j in zip(result.scores, jobs, strict=True):
        np.testing.assert_array_equal(got.logprobs, expected_scores(j).logprobs)


def test_sharers_behind_a_sequence_that_does_not_fit_join_the_micro_batch(
    loop: asyncio.AbstractEventLoop,
) -> None:
    """Queue: a group member, a stranger too long for what is left, more members: the members ride
    together; the stranger goes next, its request answered as well."""
    engine = FakeEngine()

    async def body(batcher: Batcher) -> list[Scored]:
        first = batcher.submit([grouped(100, 20, 1000)])
        stranger = batcher.submit([job(250, first=5000)])
        rest = batcher.submit([grouped(100, 20, 2000 + 100 * i) for i in range(4)])
        return list(await asyncio.gather(first, stranger, rest))

    replies = run_sharing(loop, engine, 300, body)
    assert engine.batches == [[120] * 5, [250]]
    assert [r.computed_tokens for r in replies] == [round(100 / 5 + 20), 250, round(4 * (100 / 5 + 20))]


def test_without_sharing_nothing_is_shared(loop: asyncio.AbstractEventLoop) -> None:
    engine = FakeEngine()
    jobs = [grouped(100, 20, 1000 + 100 * i) for i in range(3)]
    result = run(loop, engine, 300, lambda b: b.score(jobs))
    assert engine.batches == [[120, 120], [120]]
    assert engine.forests == [None, None]
    assert result.computed_tokens == 360


def test_the_engine_does_its_idle_work_between_bursts_on_its_thread(loop: asyncio.AbstractEventLoop) -> None:
    """Three pieces of idle-time work (CUDA graphs to capture): done one call each before the first
    request; after each burst, the engine is asked again (a shape met first may have left one)."""
    engine = FakeEngine()
    engine.idle_work, engine.tend_delay = 3, 0.1
    metrics = Metrics()
    left: list[float | None] = []

    def pending() -> float | None:
        return metrics.registry.get_sample_value("logprobd_cuda_graphs_pending")

    async def main() -> list[SequenceScores]:
        batcher = Batcher(engine, 64, metrics)
        batcher.start()
        try:
            await asyncio.to_thread(engine.wait_tended, 1)
            for _ in range(50):  # the worker sets the gauge once the call's answer is back
                if pending() != 0.0:
                    break
                await asyncio.sleep(0.001)
            left.append(pending())  # the second capture takes 0.1 s: still 2 left
            await asyncio.to_thread(engine.wait_tended, 3)
            first = await scores(batcher, [job(10)])
            await asyncio.to_thread(engine.wait_tended, 4)
            return first + await scores(batcher, [job(12)])
        finally:
            await batcher.stop()

    results = loop.run_until_complete(main())
    np.testing.assert_array_equal(results[1].logprobs, expected_scores(job(12)).logprobs)
    assert engine.tended[:4] == [0, 0, 0, 1]  # nothing left after the third: asked again after a launch
    assert engine.threads == {name for name in engine.threads if name.startswith("logprobd-engine")}
    assert left == [2.0]
    assert pending() == 0.0


def test_a_request_waits_for_one_piece_of_idle_work_at_most(loop: asyncio.AbstractEventLoop) -> None:
    engine = FakeEngine()
    engine.idle_work, engine.tend_delay = 20, 0.05

    async def body(batcher: Batcher) -> tuple[int, float]:
        await asyncio.to_thread(engine.wait_tended, 2)
        started = time.perf_counter()
        await scores(batcher, [job(10)])
        return len(engine.tended), time.perf_counter() - started

    tends, seconds = run(loop, engine, 64, body)
    assert tends <= 4  # the two waited for, the one under way when the request came, perhaps one more
    assert seconds < 0.5  # not the 20 pieces' second


def test_the_engine_idles_again_after_new_weights(loop: asyncio.AbstractEventLoop) -> None:
    """Weights rebound drop the graphs, which the engine queues again: it is asked without a launch."""
    engine = FakeEngine()

    async def body(batcher: Batcher) -> Applied:
        await asyncio.to_thread(engine.wait_tended, 1)  # nothing queued at start
        engine.idle_work = 2  # what the rebind queues
        applied = await batcher.apply(engine.stage(_order(2, "v2")))
        await asyncio.to_thread(engine.wait_tended, 3)
        return applied

    assert run(loop, engine, 16, body).state.version == "v2"
    assert engine.tended == [0, 0, 0]
    assert engine.idle_work == 0
