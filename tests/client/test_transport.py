"""StreamTransport against scripted HTTP/1.1 servers: keep-alive, stale connections, failures as
httpx's exceptions, limits, and what it hands to httpx's default transport. (Against a real
logprobd it runs in every AsyncClient test: it is AsyncClient's default.)"""

from __future__ import annotations

import asyncio
import gzip
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import httpx
import pytest

from service.client import AsyncClient
from service.client.transport import StreamTransport


@dataclass
class Exchange:
    """What the server saw: the connection it came on (0, 1, ...), method, target, body."""

    connection: int
    method: str
    target: str
    body: bytes


Reply = Callable[[Exchange], Awaitable[bytes | None]]  # raw answer bytes; None: close, no answer


@dataclass
class Server:
    url: str
    seen: list[Exchange] = field(default_factory=list)
    open_now: int = 0
    most_open: int = 0
    writers: list[asyncio.StreamWriter] = field(default_factory=list)


def answer(body: bytes = b"ok", *headers: str, status: str = "200 OK") -> bytes:
    head = [f"HTTP/1.1 {status}", f"content-length: {len(body)}", *headers]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


async def echo(exchange: Exchange) -> bytes:
    return answer(f"{exchange.connection}:{exchange.method}:{exchange.target}:".encode() + exchange.body)


def echo_after(seconds: float) -> Reply:
    """`echo`, each answer `seconds` late."""

    async def slow(exchange: Exchange) -> bytes:
        await asyncio.sleep(seconds)
        return await echo(exchange)

    return slow


@asynccontextmanager
async def scripted(reply: Reply = echo) -> AsyncIterator[Server]:
    """A loopback HTTP/1.1 server that answers each request with `reply`, keeping connections."""
    state = Server(url="")
    connections = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        number, connections = connections, connections + 1
        state.writers.append(writer)
        state.open_now += 1
        state.most_open = max(state.most_open, state.open_now)
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    return
                lines = head.decode().split("\r\n")
                method, target, _ = lines[0].split(" ")
                size = next(
                    (int(h.split(":")[1]) for h in lines if h.lower().startswith("content-length")), 0
                )
                exchange = Exchange(number, method, target, await reader.readexactly(size))
                state.seen.append(exchange)
                raw = await reply(exchange)
                if raw is None:
                    return
                writer.write(raw)
                await writer.drain()
        finally:
            state.open_now -= 1
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    state.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        yield state
    finally:
        for writer in state.writers:
            writer.close()
        server.close()


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(test())  # type: ignore[arg-type]


def test_requests_share_one_kept_alive_connection() -> None:
    async def test() -> None:
        async with scripted() as server, httpx.AsyncClient(transport=StreamTransport()) as client:
            first = await client.post(f"{server.url}/logprobs?x=1", content=b"abc")
            second = await client.get(f"{server.url}/info")
        assert first.status_code == 200
        assert first.text == "0:POST:/logprobs?x=1:abc"
        assert first.http_version == "HTTP/1.1"
        assert second.text == "0:GET:/info:"

    run(test)


def test_concurrent_requests_open_connections_up_to_the_limit() -> None:
    async def test() -> None:
        async with (
            scripted(echo_after(0.02)) as server,
            httpx.AsyncClient(transport=StreamTransport(max_connections=3)) as client,
        ):
            replies = await asyncio.gather(*(client.post(server.url, content=b"%d" % i) for i in range(8)))
        assert [r.text.split(":")[-1] for r in replies] == [str(i) for i in range(8)]
        assert server.most_open == 3

    run(test)


def test_waiting_for_a_connection_slot_past_the_pool_timeout_is_httpx_pool_timeout() -> None:
    async def test() -> None:
        timeout = httpx.Timeout(5.0, pool=0.05)
        async with (
            scripted(echo_after(0.3)) as server,
            httpx.AsyncClient(transport=StreamTransport(max_connections=1), timeout=timeout) as client,
        ):
            busy = asyncio.create_task(client.get(server.url))
            await asyncio.sleep(0.05)
            with pytest.raises(httpx.PoolTimeout):
                await client.get(server.url)
            assert (await busy).status_code == 200

    run(test)


def test_a_kept_alive_connection_the_server_closed_is_replaced_and_the_request_sent_again() -> None:
    async def test() -> None:
        async with scripted() as server, httpx.AsyncClient(transport=StreamTransport()) as client:
            assert (await client.get(server.url)).text.startswith("0:")
            server.writers[0].close()  # as a server's keep-alive timeout does
            await asyncio.sleep(0.05)
            assert (await client.post(server.url, content=b"again")).text == "1:POST:/:again"
            server.writers[1].transport.abort()  # a reset while idle, noticed only on reuse
            assert (await client.post(server.url, content=b"once more")).text == "2:POST:/:once more"
        assert [e.body for e in server.seen] == [b"", b"again", b"once more"]

    run(test)


def test_a_fresh_connection_closed_without_an_answer_is_httpx_remote_protocol_error() -> None:
    async def hang_up(exchange: Exchange) -> None:
        return None

    async def test() -> None:
        async with scripted(hang_up) as server, httpx.AsyncClient(transport=StreamTransport()) as client:
            with pytest.raises(httpx.RemoteProtocolError, match="without sending a response"):
                await client.post(server.url, content=b"x")
        assert len(server.seen) == 1  # a fresh connection's failure is not retried

    run(test)


def test_an_answer_cut_short_is_an_httpx_error_and_its_connection_is_not_kept() -> None:
    async def truncated(exchange: Exchange) -> bytes | None:
        if exchange.body == b"cut":
            return answer(b"0123456789")[:-4]  # the head promises 10 bytes; 6 come, then close
        return await echo(exchange)

    async def test() -> None:
        async with scripted(truncated) as server, httpx.AsyncClient(transport=StreamTransport()) as client:
            task = asyncio.create_task(client.post(server.url, content=b"cut"))
            await asyncio.sleep(0.05)
            server.writers[0].close()
            with pytest.raises(httpx.RemoteProtocolError):
                await task
            assert (await client.post(server.url, content=b"next")).text == "1:POST:/:next"

    run(test)


def test_a_slow_answer_is_httpx_read_timeout_and_a_refused_connection_httpx_connect_error() -> None:
    async def never(exchange: Exchange) -> bytes:
        await asyncio.sleep(10)
        return b""

    async def test() -> None:
        async with (
            scripted(never) as server,
            httpx.AsyncClient(transport=StreamTransport(), timeout=0.1) as client,
        ):
            with pytest.raises(httpx.ReadTimeout):
                await client.get(server.url)
            closed = server.url
        async with httpx.AsyncClient(transport=StreamTransport()) as client:
            with pytest.raises(httpx.ConnectError):
                await client.get(closed)

    run(test)


def test_chunked_and_gzip_answers_are_decoded_and_connection_close_is_honoured() -> None:
    async def varied(exchange: Exchange) -> bytes:
        if exchange.target == "/chunked":
            return b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
        if exchange.target == "/gzip":
            return answer(gzip.compress(b"unzipped"), "content-encoding: gzip")
        if exchange.target == "/close":
            return answer(b"bye", "connection: close")
        return await echo(exchange)

    async def test() -> None:
        async with scripted(varied) as server, httpx.AsyncClient(transport=StreamTransport()) as client:
            assert (await client.get(f"{server.url}/chunked")).content == b"abcde"
            assert (await client.get(f"{server.url}/gzip")).content == b"unzipped"
            assert (await client.get(f"{server.url}/close")).content == b"bye"
            assert (await client.get(f"{server.url}/after")).text == "1:GET:/after:"  # a new connection
        assert [e.connection for e in server.seen] == [0, 0, 0, 1]

    run(test)


def test_a_cancelled_request_does_not_leave_its_connection_to_the_next() -> None:
    async def slow_first(exchange: Exchange) -> bytes:
        if exchange.body == b"slow":
            await asyncio.sleep(0.2)
        return await echo(exchange)

    async def test() -> None:
        async with scripted(slow_first) as server, httpx.AsyncClient(transport=StreamTransport()) as client:
            task = asyncio.create_task(client.post(server.url, content=b"slow"))
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            # the late answer to "slow" must not be read as the answer to this one
            assert (await client.post(server.url, content=b"fast")).text == "1:POST:/:fast"

    run(test)


class Recording(httpx.AsyncBaseTransport):
    def __init__(self) -> None:
        self.urls: list[str] = []
        self.closed = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.urls.append(str(request.url))
        return httpx.Response(200)

    async def aclose(self) -> None:
        self.closed = True


def test_https_goes_to_the_fallback_transport_and_closing_closes_it() -> None:
    async def test() -> None:
        fallback = Recording()
        async with httpx.AsyncClient(transport=StreamTransport(fallback=fallback)) as client:
            assert (await client.get("https://example.invalid/info")).status_code == 200
        assert fallback.urls == ["https://example.invalid/info"]
        assert fallback.closed

    run(test)


def test_async_client_uses_it_unless_given_a_transport() -> None:
    async def test() -> None:
        async with scripted() as server, AsyncClient(server.url) as client:
            await client.wait_ready(timeout=1)
            await client.wait_ready(timeout=1)
        assert [e.connection for e in server.seen] == [0, 0]  # kept alive: StreamTransport
        async with scripted() as server, AsyncClient(server.url, transport=Recording()) as client:
            await client.wait_ready(timeout=1)
        assert server.seen == []

    run(test)
