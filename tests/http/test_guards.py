"""Limits, backpressure, deadlines, disconnects and out-of-memory, through the HTTP app."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from service.http.app import create_app
from service.settings import Settings
from tests.support.fakes import FakeEngine
from tests.support.servers import Reply, loopback, wait_ready


def _client(engine: FakeEngine, **settings: Any) -> TestClient:
    return TestClient(create_app(Settings(**settings), engine_factory=lambda _: engine))


@pytest.fixture
def slow() -> FakeEngine:
    return FakeEngine(delay=0.4)


def _occupy(client: TestClient, pool: ThreadPoolExecutor) -> list[Future[Any]]:
    """Two slow requests, sent one after the other: both micro-batches are in flight (the engine's
    limit, batcher.IN_FLIGHT), so what is sent next waits in the queue."""
    busy = []
    for i in range(2):
        busy.append(pool.submit(client.post, "/logprobs", json=_row(10, first=20 * i + 1)))
        time.sleep(0.1)
    return busy


def _row(n: int, first: int = 1) -> dict[str, Any]:
    return {"input_ids": [list(range(first, first + n))], "num_actions": 1}


def _error(reply: Reply, status: int, kind: str) -> dict[str, Any]:
    assert reply.status_code == status, reply.text
    error: dict[str, Any] = reply.json()["error"]
    assert error["type"] == kind
    return error


def test_size_limits_are_413_naming_the_limit() -> None:
    settings = {"max_body_bytes": 2048, "max_request_sequences": 3, "max_request_tokens": 20}
    with _client(FakeEngine(), **settings) as client:
        wait_ready(client)
        big = client.post(
            "/logprobs", content=b"{" + b" " * 4096 + b"}", headers={"content-type": "application/json"}
        )
        assert "max_body_bytes" in _error(big, 413, "payload_too_large")["message"]
        rows = client.post("/logprobs", json={"input_ids": [[1, 2]] * 4, "num_actions": 1})
        assert "max_request_sequences" in _error(rows, 413, "payload_too_large")["message"]
        tokens = client.post("/logprobs", json={"input_ids": [list(range(1, 12))] * 2, "num_actions": 1})
        assert "max_request_tokens" in _error(tokens, 413, "payload_too_large")["message"]
        padded = {
            "input_ids": [[0] * 30] * 2,
            "attention_mask": [[0] * 25 + [1] * 5] * 2,
            "response_length": 2,
        }
        assert client.post("/logprobs", json=padded).status_code == 200  # padding does not count
        over_cap = client.post("/logprobs", json={**_row(3), "timeout_s": 1e9})
        assert _error(over_cap, 422, "invalid_request")["field"] == "timeout_s"
        assert client.post("/logprobs", json=_row(3)).json()["logprobs"] == [[-5.0]]  # -(x_2 + 2)


def test_full_queue_answers_429_with_retry_after(slow: FakeEngine) -> None:
    with _client(slow, max_queued_tokens=12, batch_wait_ms=0) as client:
        wait_ready(client)
        with ThreadPoolExecutor(3) as pool:
            busy = _occupy(client, pool)  # two micro-batches in flight: the engine takes no more
            queued = pool.submit(client.post, "/logprobs", json=_row(10, first=50))  # waits in the queue
            time.sleep(0.1)
            third = client.post("/logprobs", json=_row(10, first=90))
            assert all(reply.result().status_code == 200 for reply in [*busy, queued])
        _error(third, 429, "overloaded")
        assert int(third.headers["retry-after"]) >= 1
        assert slow.batches == [[10], [10], [10]]  # the refused request never reached the engine
        assert 'outcome="overloaded"} 1.0' in client.get("/metrics").text


def test_a_request_over_the_queue_cap_is_admitted_when_nothing_is_queued() -> None:
    """As the setting says (and docs/configuration.md, docs/api.md): otherwise it could never run."""
    described = Settings.model_fields["max_queued_tokens"].description or ""
    assert "admitted whatever its size when nothing is queued" in described
    with _client(FakeEngine(), max_queued_tokens=12, batch_wait_ms=0) as client:
        wait_ready(client)
        big = client.post("/logprobs", json={"input_ids": [list(range(1, 21))], "num_actions": 1})
        assert big.status_code == 200, big.text
        assert big.json()["logprobs"] == [[-39.0]]  # FakeEngine: -(x_19 + 19), 20 tokens past a cap of 12


def test_deadline_drops_the_work_and_answers_504(slow: FakeEngine) -> None:
    with _client(slow, batch_wait_ms=0) as client:
        wait_ready(client)
        with ThreadPoolExecutor(2) as pool:
            busy = _occupy(client, pool)
            late = client.post("/logprobs", json={**_row(7, first=60), "timeout_s": 0.1})
            assert all(reply.result().status_code == 200 for reply in busy)
        assert "deadline" in _error(late, 504, "deadline_exceeded")["message"]
        time.sleep(0.5)
        assert [7] not in slow.batches  # dropped before it reached the engine


def test_out_of_memory_fails_only_the_sequence_that_cannot_fit() -> None:
    engine = FakeEngine(oom_over_tokens=40)
    with _client(engine, batch_wait_ms=50) as client:
        wait_ready(client)
        with ThreadPoolExecutor(3) as pool:
            replies = list(
                pool.map(
                    lambda body: client.post("/logprobs", json=body), [_row(30), _row(50, 100), _row(20, 200)]
                )
            )
        assert replies[0].json()["logprobs"] == [[-(30 + 29)]]
        assert "50 tokens" in _error(replies[1], 413, "sequence_too_large")["message"]
        assert replies[2].json()["logprobs"] == [[-(219 + 19)]]
        assert client.get("/health/ready").status_code == 200


@pytest.fixture
def live_server(slow: FakeEngine) -> Iterator[str]:
    with loopback(create_app(Settings(batch_wait_ms=0), engine_factory=lambda _: slow)) as url:
        yield url


def test_client_that_disconnects_has_its_queued_work_dropped(live_server: str, slow: FakeEngine) -> None:
    with ThreadPoolExecutor(2) as pool:
        busy = []
        for i in range(2):  # two micro-batches in flight
            body = _row(10, first=20 * i + 1)
            busy.append(pool.submit(httpx.post, f"{live_server}/logprobs", json=body, timeout=10))
            time.sleep(0.1)
        with pytest.raises(httpx.ReadTimeout):  # gives up while its request waits in the queue
            httpx.post(f"{live_server}/logprobs", json=_row(9, first=70), timeout=0.1)
        assert all(reply.result().status_code == 200 for reply in busy)
    time.sleep(0.6)
    assert [9] not in slow.batches
    metrics = httpx.get(f"{live_server}/metrics").text
    assert 'logprobd_requests_total{outcome="client_disconnected"} 1.0' in metrics
    assert httpx.post(f"{live_server}/logprobs", json=_row(4), timeout=10).json()["logprobs"] == [[-7.0]]
