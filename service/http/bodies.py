"""What a scoring request needs from the connection: a bounded body, and an answer that gives up
when the deadline passes or the client goes away (dropping the work that has not started)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request

from service.core.errors import ClientDisconnected, DeadlineExceeded, PayloadTooLarge

T = TypeVar("T")


async def read_body(http: Request, limit: int) -> bytes:
    """The request body; 413 as soon as it is known to exceed `limit` bytes."""
    declared = http.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"body of {declared} bytes; this server takes at most {limit} (max_body_bytes)")
    chunks, size = [], 0
    async for chunk in http.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"body over {limit} bytes (max_body_bytes)")
        chunks.append(chunk)
    return b"".join(chunks)


async def _disconnected(http: Request) -> None:
    """Return once the client has disconnected (the body has been read: the next message says so)."""
    while True:
        message = await http.receive()
        if message["type"] == "http.disconnect":
            return


async def answer_or_give_up(http: Request, work: Awaitable[T], timeout_s: float) -> T:
    """`work`'s result; cancels it (so its queued sequences are dropped) on deadline or disconnect."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(http))
    try:
        done, _ = await asyncio.wait({task, watcher}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    if watcher in done:
        raise ClientDisconnected("the client disconnected before its answer")
    raise DeadlineExceeded(f"no answer within the deadline of {timeout_s:g} s; its unscored work was dropped")
