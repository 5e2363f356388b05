"""What a scoring request needs from the connection: a bounded body, an answer that gives up when
the deadline passes or the client goes away (dropping the work that has not started), and a big
answer handed to the server in slices.

A big answer (routes as base64 or lists: ~14 MB a request) handed to uvicorn whole is copied on the
event loop: asyncio's socket transport sends what the socket takes and copies the rest twice into
its buffer (`data[n:]`, then `bytearray.extend`), ~30 ms a 14 MB answer in fresh memory.
SlicedResponse sends the same bytes as memoryview slices of SLICE_BYTES: the server's flow control
waits for each to drain before the next, so nothing past a slice is copied or buffered. It takes the
answer in parts (the JSON around the big arrays, and each array's text as written), so the parts are
never joined either.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from typing import TypeVar

from fastapi import Request
from fastapi.responses import Response
from starlette.types import Receive, Scope, Send

from service.core.errors import ClientDisconnected, DeadlineExceeded, PayloadTooLarge

T = TypeVar("T")

SLICE_BYTES = 1 << 20  # an answer goes to the server in slices of this many bytes


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


class SlicedResponse(Response):
    """A Response whose body, one or more parts (Content-Length their total), is sent as memoryview
    slices of at most `slice_bytes` of each part in turn, each a `more_body` message but the last;
    never copied or joined here."""

    def __init__(self, parts: Sequence[bytes], media_type: str, slice_bytes: int = SLICE_BYTES) -> None:
        self.parts = parts
        size = sum(len(part) for part in parts)
        super().__init__(None, media_type=media_type, headers={"content-length": str(size)})
        self.slice_bytes = slice_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        step = self.slice_bytes
        views = [memoryview(part) for part in self.parts]
        slices = [view[at : at + step] for view in views for at in range(0, len(view), step)]
        slices = slices or [memoryview(b"")]
        for i, piece in enumerate(slices):
            await send({"type": "http.response.body", "body": piece, "more_body": i < len(slices) - 1})
