"""SlicedResponse: a big answer goes to the server as memoryview slices of one body, never copied."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from starlette.types import Message

from service.http.bodies import SlicedResponse


def _sent(parts: list[bytes], slice_bytes: int) -> list[Message]:
    messages: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        messages.append(message)

    response = SlicedResponse(parts, "application/json", slice_bytes=slice_bytes)
    asyncio.run(response(_SCOPE, receive, send))
    return messages


_SCOPE: dict[str, Any] = {"type": "http", "method": "POST", "path": "/"}


@pytest.mark.parametrize(("size", "slices"), [(10, 1), (1000, 4), (1024, 4), (1025, 5), (0, 1)])
def test_slices_are_views_of_the_body_in_order(size: int, slices: int) -> None:
    body = bytes(range(256)) * 5
    body = body[:size]
    start, *parts = _sent([body], 256)
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
        return SlicedResponse([body], "application/octet-stream", slice_bytes=1000)

    with TestClient(app) as client:
        got = client.get("/big")
    assert got.status_code == 200
    assert got.headers["content-length"] == str(len(body))
    assert got.content == body


def test_parts_go_out_as_slices_of_each_in_turn_never_joined() -> None:
    parts = [b"head", b"", bytes(range(256)) * 3, b"}"]
    start, *sent = _sent(parts, 256)
    assert dict(start["headers"])[b"content-length"] == str(sum(map(len, parts))).encode()
    assert [(p["body"].obj, len(p["body"])) for p in sent] == [
        (parts[0], 4),
        (parts[2], 256),
        (parts[2], 256),
        (parts[2], 256),
        (parts[3], 1),
    ]
    assert [p["more_body"] for p in sent] == [True] * 4 + [False]
    assert b"".join(bytes(p["body"]) for p in sent) == b"".join(parts)
    _, *empty = _sent([b"", b""], 256)
    assert [(bytes(p["body"]), p["more_body"]) for p in empty] == [(b"", False)]
