"""The HTTP protocol the service serves with reads a connection's socket wide: a big body reaches the
app in reads of up to READ_BYTES, past asyncio's 256 KiB."""

from __future__ import annotations

import asyncio
import socket

import httpx
from fastapi import FastAPI, Request

from service.http.protocol import READ_BYTES, widen
from tests.support.servers import loopback

ASYNCIO_READ = 256 * 1024  # asyncio's socket transport's own max_size
BODY = 16 << 20


def _app(chunks: list[int]) -> FastAPI:
    app = FastAPI()

    @app.get("/health/ready")
    def ready() -> dict[str, str]:
        return {"status": "ready"}

    @app.post("/body")
    async def body(request: Request) -> dict[str, int]:
        await asyncio.sleep(0.3)  # the client fills the socket's buffer meanwhile
        async for chunk in request.stream():
            chunks.append(len(chunk))
        return {"bytes": sum(chunks)}

    return app


def test_a_big_body_arrives_in_reads_past_asyncios() -> None:
    chunks: list[int] = []
    with loopback(_app(chunks)) as url:
        reply = httpx.post(f"{url}/body", content=b"x" * BODY, timeout=60)
    assert reply.json() == {"bytes": BODY}
    # uvicorn stops reading once it holds 64 KiB the app has not taken: with asyncio's reads no
    # message of the body passes 256 + 64 KiB
    assert max(chunks) > 2 * ASYNCIO_READ
    assert max(chunks) <= READ_BYTES + 64 * 1024
    assert len(chunks) < BODY // ASYNCIO_READ // 2


def test_widen_takes_asyncios_socket_transport_only() -> None:
    async def main() -> tuple[bool, int, bool]:
        loop = asyncio.get_running_loop()
        left, right = socket.socketpair()
        transport, _ = await loop.connect_accepted_socket(asyncio.Protocol, left)
        try:
            widened = widen(transport, 1 << 20)
            size = transport.max_size  # type: ignore[attr-defined]
        finally:
            transport.close()
            right.close()
        return widened, size, widen(asyncio.BaseTransport())

    widened, size, other = asyncio.run(main())
    assert (widened, size, other) == (True, 1 << 20, False)
