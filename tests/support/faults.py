"""Transports that answer from a script of failures first, then forward to a real server.

Each request's body is recorded, so a test can count attempts and see what each one carried.
"""

from __future__ import annotations

import json
from typing import Any

import httpx

from service.client import RetryPolicy
from service.client.wire import from_frame
from service.wire.frame import MEDIA_TYPE

Step = httpx.Response | type[httpx.TransportError]
FAST = RetryPolicy(backoff=0.02, max_backoff=0.05)  # retries without the waits a real server needs


class _Script:
    def __init__(self, steps: list[Step]) -> None:
        self.steps = list(steps)
        self.bodies: list[bytes] = []

    def next_fault(self, request: httpx.Request) -> httpx.Response | None:
        """The scripted answer to this request, or None once the script is spent (forward it)."""
        self.bodies.append(request.content)
        if not self.steps:
            return None
        step = self.steps.pop(0)
        if isinstance(step, httpx.Response):
            return step
        raise step("scripted fault", request=request)


class Flaky(httpx.BaseTransport):
    def __init__(self, steps: list[Step]) -> None:
        self.script = _Script(steps)
        self._real = httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        request.read()
        fault = self.script.next_fault(request)
        return fault if fault is not None else self._real.handle_request(request)

    def close(self) -> None:
        self._real.close()


class AsyncFlaky(httpx.AsyncBaseTransport):
    def __init__(self, steps: list[Step]) -> None:
        self.script = _Script(steps)
        self._real = httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        await request.aread()
        fault = self.script.next_fault(request)
        return fault if fault is not None else await self._real.handle_async_request(request)

    async def aclose(self) -> None:
        await self._real.aclose()


def error_reply(status: int, error_type: str, *, retry_after: str | None = None) -> httpx.Response:
    headers = {"retry-after": retry_after} if retry_after is not None else {}
    body = {"error": {"type": error_type, "message": f"scripted {status}"}}
    return httpx.Response(status, json=body, headers=headers)


def sent_body(content: bytes, content_type: str = MEDIA_TYPE) -> dict[str, Any]:
    """A request body the client sent, as a dict, in either encoding."""
    if content_type.startswith(MEDIA_TYPE):
        return from_frame(content)
    body: dict[str, Any] = json.loads(content)
    return body
