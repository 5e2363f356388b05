"""SlicedResponse: a big answer goes to the server as memoryview slices of one body, never copied;
BodyTurns: big bodies are read one after another in arrival order, none held back past its wait."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from starlette.types import Message

from service.core.errors import PayloadTooLarge
from service.http.bodies import BodyTurns, SlicedResponse


def _sent(body: bytes, slice_bytes: int) -> list[Message]:
    messages: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        messages.append(message)

    response = SlicedResponse(body, "application/json", slice_bytes=slice_bytes)
    asyncio.run(response(_SCOPE, receive, send))
    return messages


_SCOPE: dict[str, Any] = {"type": "http", "method": "POST", "path": "/"}


@pytest.mark.parametrize(("size", "slices"), [(10, 1), (1000, 4), (1024, 4), (1025, 5), (0, 1)])
def test_slices_are_views_of_the_body_in_order(size: int, slices: int) -> None:
    body = bytes(range(256)) * 5
    body = body[:size]
    start, *parts = _sent(body, 256)
    assert start["type"] == "http.response.start"
    assert dict(start["headers"])[b"content-length"] == str(size).encode()
    assert len(parts) == slices
    assert [p["more_body"] for p in parts] == [True] * (slices - 1) + [False]
    assert all(isinstance(p["body"], memoryview) and p["body"].obj is body for p in parts)
    assert all(len(p["body"]) <= 256 for p in parts)
    assert b"".join(bytes(p["body"]) for p in parts) == body


def test_a_client_reads_the_whole_body() -> None:
    body = bytes(range(256)) * 4099  # not a multiple of the slice
    app = FastAPI()

    @app.get("/big")
    async def big() -> SlicedResponse:
        return SlicedResponse(body, "application/octet-stream", slice_bytes=1000)

    with TestClient(app) as client:
        got = client.get("/big")
    assert got.status_code == 200
    assert got.headers["content-length"] == str(len(body))
    assert got.content == body


class _Upload:
    """A request whose body arrives in `parts` chunks, each only once the test releases it; it
    records when its body is first read (`reads`)."""

    def __init__(self, name: str, size: int, reads: list[str], parts: int = 2) -> None:
        self.name, self.reads, self.parts = name, reads, parts
        self.headers = {"content-length": str(size)}
        self.chunk = b"x" * (size // parts)
        self.released = asyncio.Event()

    async def stream(self) -> AsyncIterator[bytes]:
        self.reads.append(self.name)
        for _ in range(self.parts):
            await self.released.wait()
            yield self.chunk


async def _settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


def _read(turns: BodyTurns, upload: _Upload, limit: int = 1 << 30) -> asyncio.Task[bytes]:
    return asyncio.ensure_future(turns.read(upload, limit))  # type: ignore[arg-type]


def test_big_bodies_are_read_one_after_another_in_arrival_order() -> None:
    async def run() -> list[str]:
        reads: list[str] = []
        turns = BodyTurns(min_bytes=1000, wait_s=60.0)
        uploads = [_Upload(name, 2000, reads) for name in "abc"]
        tasks = [_read(turns, u) for u in uploads]
        await _settle()
        assert reads == ["a"]  # b and c wait for a's turn to end
        uploads[2].released.set()  # c's bytes are there first: it still waits for b
        await _settle()
        assert reads == ["a"]
        uploads[0].released.set()
        assert len(await tasks[0]) == 2000
        await _settle()
        assert reads == ["a", "b"]
        uploads[1].released.set()
        assert [len(await t) for t in tasks[1:]] == [2000, 2000]
        return reads

    assert asyncio.run(run()) == ["a", "b", "c"]


def test_small_chunked_and_over_limit_bodies_and_a_zero_size_do_not_wait() -> None:
    async def run() -> None:
        reads: list[str] = []
        turns = BodyTurns(min_bytes=1000, wait_s=60.0)
        big = _Upload("big", 2000, reads)
        small = _Upload("small", 999, reads)
        chunked = _Upload("chunked", 2000, reads)
        del chunked.headers["content-length"]
        over = _Upload("over", 5000, reads)
        first = _read(turns, big)
        others = [_read(turns, small), _read(turns, chunked)]
        with pytest.raises(PayloadTooLarge):
            await turns.read(over, 4000)  # type: ignore[arg-type]
        await _settle()
        assert reads == ["big", "small", "chunked"]
        for upload in (big, small, chunked):
            upload.released.set()
        await asyncio.gather(first, *others)
        unordered = BodyTurns(min_bytes=0, wait_s=60.0)
        reads.clear()
        waiting = [_read(unordered, _Upload(name, 2000, reads)) for name in "xy"]
        await _settle()
        assert reads == ["x", "y"]
        for task in waiting:
            task.cancel()

    asyncio.run(run())


def test_a_stalled_body_holds_the_next_back_for_the_wait_only() -> None:
    async def run() -> float:
        reads: list[str] = []
        turns = BodyTurns(min_bytes=1000, wait_s=0.2)
        stalled, next_one = _Upload("stalled", 2000, reads), _Upload("next", 2000, reads)
        holding = _read(turns, stalled)
        await _settle()
        began = time.perf_counter()
        next_one.released.set()
        assert len(await _read(turns, next_one)) == 2000
        waited = time.perf_counter() - began
        assert reads == ["stalled", "next"]
        assert not holding.done()
        holding.cancel()
        return waited

    assert 0.15 <= asyncio.run(run()) < 2.0


def test_a_body_that_fails_or_is_cancelled_ends_its_turn_at_once() -> None:
    async def run() -> None:
        reads: list[str] = []
        turns = BodyTurns(min_bytes=1000, wait_s=60.0)
        lying = _Upload("lying", 2000, reads, parts=1)
        lying.chunk = b"x" * 5000  # more than it declared, and over the limit
        gone = _Upload("gone", 2000, reads)
        after = _Upload("after", 2000, reads)
        tasks = [_read(turns, lying, limit=4000), _read(turns, gone), _read(turns, after)]
        await _settle()
        lying.released.set()
        with pytest.raises(PayloadTooLarge):
            await tasks[0]
        await _settle()
        assert reads == ["lying", "gone"]
        tasks[1].cancel()  # the client went away mid-body
        await _settle()
        assert reads == ["lying", "gone", "after"]
        after.released.set()
        assert len(await tasks[2]) == 2000
        assert turns._last is None  # nothing is left waiting

    asyncio.run(run())
