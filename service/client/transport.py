"""`StreamTransport`: AsyncClient's HTTP/1.1, on asyncio streams with kept-alive connections.

httpx's default async transport (httpcore's pool on anyio) spends about a millisecond of the
event loop per request once a few requests share the pool: each request that ends re-examines
every queued request against every connection. A trainer sending one batch as 8 concurrent
chunks pays that 8 times over, serially, in its own process. This transport does the same
HTTP/1.1 with h11 (the parser httpx itself depends on) and no pool machinery: one exchange per
connection at a time; idle connections are kept per origin and the newest is reused first.

- `https://` URLs go to httpx's default transport (TLS, certificates and proxies stay httpx's).
- Timeouts are httpx's (`connect`, `write`, `read`, `pool`), raised as httpx's exceptions, as
  are connection and protocol failures, so retries and errors behave as with the default.
- A kept-alive connection the server has closed meanwhile fails before any byte of an answer
  arrives; the request is then sent once more on a new connection (httpcore does the same).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict, deque
from collections.abc import Iterator, Mapping

import h11
import httpx

READ_BYTES = 256 * 1024
Origin = tuple[str, int]


class _Stale(Exception):
    """A reused connection was closed by the server before it answered (nothing was received)."""


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.http = h11.Connection(h11.CLIENT)

    def open(self) -> bool:
        return not self.reader.at_eof() and not self.writer.is_closing()

    def close(self) -> None:
        self.writer.close()


class StreamTransport(httpx.AsyncBaseTransport):
    """Plain-HTTP/1.1 transport for httpx.AsyncClient; see the module docstring.

    At most `max_connections` exchanges run at once (more wait, up to the `pool` timeout); at
    most `max_idle` idle connections are kept per origin.
    """

    def __init__(
        self,
        *,
        max_connections: int = 100,
        max_idle: int = 32,
        fallback: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._slots = asyncio.Semaphore(max_connections)
        self._max_idle = max_idle
        self._idle: defaultdict[Origin, deque[_Connection]] = defaultdict(deque)
        self._fallback = fallback if fallback is not None else httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.scheme != "http":
            return await self._fallback.handle_async_request(request)
        timeouts: Mapping[str, float | None] = request.extensions.get("timeout", {})
        body = b"".join([part async for part in request.stream])  # type: ignore[union-attr]
        origin = (request.url.host, request.url.port or 80)
        with _mapped(httpx.PoolTimeout, httpx.ConnectError, request):
            async with asyncio.timeout(timeouts.get("pool")):
                await self._slots.acquire()
        try:
            connection = self._reuse(origin)
            if connection is not None:
                try:
                    return await self._exchange(connection, origin, request, body, timeouts, reused=True)
                except _Stale:
                    self._drop_idle(origin)  # the server closed them all, most likely (a restart)
            with _mapped(httpx.ConnectTimeout, httpx.ConnectError, request):
                async with asyncio.timeout(timeouts.get("connect")):
                    reader, writer = await asyncio.open_connection(*origin, limit=READ_BYTES)
            return await self._exchange(
                _Connection(reader, writer), origin, request, body, timeouts, reused=False
            )
        finally:
            self._slots.release()

    async def aclose(self) -> None:
        for origin in list(self._idle):
            self._drop_idle(origin)
        await self._fallback.aclose()

    def _reuse(self, origin: Origin) -> _Connection | None:
        idle = self._idle[origin]
        while idle:
            connection = idle.pop()
            if connection.open():
                return connection
            connection.close()
        return None

    def _drop_idle(self, origin: Origin) -> None:
        for connection in self._idle.pop(origin, ()):
            connection.close()

    async def _exchange(
        self,
        connection: _Connection,
        origin: Origin,
        request: httpx.Request,
        body: bytes,
        timeouts: Mapping[str, float | None],
        *,
        reused: bool,
    ) -> httpx.Response:
        """One request and its whole answer on `connection`, which goes back to the idle ones if
        both sides may go on with it, and is closed otherwise (failures and cancellation included)."""
        http = connection.http
        received = False
        try:
            with _mapped(httpx.WriteTimeout, httpx.WriteError, request, stale=reused):
                head = h11.Request(
                    method=request.method, target=request.url.raw_path, headers=request.headers.raw
                )
                connection.writer.write(
                    http.send(head)
                    + (http.send(h11.Data(data=body)) if body else b"")
                    + http.send(h11.EndOfMessage())
                )
                async with asyncio.timeout(timeouts.get("write")):
                    await connection.writer.drain()
            answer: h11.Response | None = None
            chunks: list[bytes] = []
            while True:
                with _mapped(httpx.ReadTimeout, httpx.ReadError, request, stale=reused and not received):
                    event = http.next_event()
                    if event is h11.NEED_DATA:
                        async with asyncio.timeout(timeouts.get("read")):
                            data = await connection.reader.read(READ_BYTES)
                        if not data and not received:  # closed before a byte of the answer came
                            if reused:
                                raise _Stale
                            raise httpx.RemoteProtocolError(
                                "Server disconnected without sending a response.", request=request
                            )
                        received = True
                        http.receive_data(data)  # b"": closed mid-answer; h11 raises next
                        continue
                if isinstance(event, h11.Response):
                    answer = event
                elif isinstance(event, h11.Data):
                    chunks.append(bytes(event.data))
                elif isinstance(event, h11.EndOfMessage):
                    break
        except BaseException:
            connection.close()
            raise
        assert answer is not None  # h11 gives a Response before any Data or EndOfMessage
        self._keep_or_close(connection, origin)
        return httpx.Response(
            answer.status_code,
            headers=answer.headers.raw_items(),
            stream=httpx.ByteStream(b"".join(chunks)),
            extensions={"http_version": b"HTTP/1.1", "reason_phrase": bytes(answer.reason)},
        )

    def _keep_or_close(self, connection: _Connection, origin: Origin) -> None:
        http = connection.http
        idle = self._idle[origin]
        if http.our_state is h11.DONE and http.their_state is h11.DONE and len(idle) < self._max_idle:
            http.start_next_cycle()
            idle.append(connection)
        else:
            connection.close()


@contextlib.contextmanager
def _mapped(
    timeout: type[httpx.TimeoutException],
    failure: type[httpx.TransportError],
    request: httpx.Request,
    *,
    stale: bool = False,
) -> Iterator[None]:
    """Timeouts as `timeout`, connection and protocol failures as `failure` (httpx's exceptions);
    with `stale` (a reused connection, nothing received yet) a lost connection is `_Stale`."""
    try:
        yield
    except TimeoutError as exc:
        raise timeout(str(exc) or timeout.__name__, request=request) from exc
    except (OSError, h11.ProtocolError) as exc:
        lost = isinstance(exc, OSError | h11.RemoteProtocolError)
        if stale and lost:
            raise _Stale from exc
        kind: type[httpx.TransportError] = failure
        if isinstance(exc, h11.ProtocolError):
            local = isinstance(exc, h11.LocalProtocolError)
            kind = httpx.LocalProtocolError if local else httpx.RemoteProtocolError
        raise kind(str(exc) or type(exc).__name__, request=request) from exc
