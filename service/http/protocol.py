"""The HTTP protocol uvicorn serves with: its own (httptools' where installed, else h11's), reading up
to READ_BYTES of a connection's socket at a time.

asyncio's socket transport reads at most 256 KiB a call, and uvicorn stops reading after each read
until the app has taken what it read, so a 14 MB body (a request's routes as base64) takes some 57
turns of the event loop. Each turn gives the GIL up (the loop's poll) and waits to take it back from
the threads holding it, the engine's launches among them; reading what the socket holds, up to
READ_BYTES, takes a few turns. Transports without asyncio's `max_size` (uvloop's, TLS') read as they do.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.auto import AutoHTTPProtocol

READ_BYTES = 4 << 20  # the most one read of a connection's socket takes


def widen(transport: asyncio.BaseTransport, size: int = READ_BYTES) -> bool:
    """Let `transport` read up to `size` bytes a call where it is asyncio's socket transport (its class
    has an int `max_size`); whether it did."""
    if not isinstance(getattr(type(transport), "max_size", None), int):
        return False
    transport.max_size = size  # type: ignore[attr-defined]
    return True


class WideReads(AutoHTTPProtocol):  # type: ignore[misc,valid-type]
    """uvicorn's HTTP protocol, its connection's transport widened (widen)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        widen(transport)
