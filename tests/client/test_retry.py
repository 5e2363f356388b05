"""Retries: 429 (with Retry-After) and 503 then success, connection errors, and what is never retried."""

from __future__ import annotations

import random
import time
from typing import Any

import httpx
import pytest

from service.client import Client, LogprobdConnectionError, LogprobdError, RetryPolicy
from service.client.retry import parse_retry_after
from tests.support.faults import FAST, Flaky, error_reply, sent_body
from tests.support.reference import assert_scores
from tests.support.requests import ragged


def test_429_with_retry_after_then_503_then_success(
    qwen2_replicas: tuple[str, str], reference_models: dict[str, Any]
) -> None:
    flaky = Flaky([error_reply(429, "overloaded", retry_after="1"), error_reply(503, "not_ready")])
    request = ragged(seed=1, rows=3)
    with Client(qwen2_replicas[0], transport=flaky, retry=FAST) as client:
        started = time.monotonic()
        scores = client.score(**request)
        elapsed = time.monotonic() - started
    assert len(flaky.script.bodies) == 3
    assert len(set(flaky.script.bodies)) == 1  # every attempt sent the same body
    assert elapsed >= 1.0  # the Retry-After of the 429 was waited out; 503's backoff is ~0.02 s
    assert_scores(reference_models["qwen2"], request, scores.logprobs)


def test_connection_errors_are_retried(
    qwen2_replicas: tuple[str, str], reference_models: dict[str, Any]
) -> None:
    flaky = Flaky([httpx.ConnectError, httpx.ReadTimeout, httpx.RemoteProtocolError])
    request = ragged(seed=2, rows=2)
    with Client(qwen2_replicas[0], transport=flaky, retry=FAST) as client:
        scores = client.score(**request)
    assert len(flaky.script.bodies) == 4
    assert_scores(reference_models["qwen2"], request, scores.logprobs)


def test_a_dead_replica_is_routed_around(
    qwen2_replicas: tuple[str, str], dead_url: str, reference_models: dict[str, Any]
) -> None:
    request = ragged(seed=3, rows=8)
    with Client([dead_url, qwen2_replicas[0]], max_chunk_tokens=20, retry=FAST) as client:
        scores = client.score(**request)
    assert_scores(reference_models["qwen2"], request, scores.logprobs)


def test_unreachable_gives_up_after_max_attempts(dead_url: str) -> None:
    policy = RetryPolicy(max_attempts=3, backoff=0.01)
    with Client(dead_url, retry=policy) as client, pytest.raises(LogprobdConnectionError) as caught:
        client.score([[1, 2, 3]], num_actions=1)
    assert caught.value.attempts == 3
    assert caught.value.status is None
    assert caught.value.type == "connection_error"
    assert isinstance(caught.value.__cause__, httpx.ConnectError)


def test_422_is_typed_names_the_batch_row_and_is_not_retried(qwen2_replicas: tuple[str, str]) -> None:
    request = ragged(seed=4, rows=8)
    request["input_ids"][5][2] = 5000  # outside the vocabulary of 96
    flaky = Flaky([])
    client = Client(qwen2_replicas[0], transport=flaky, max_chunk_tokens=25, max_concurrency=1, retry=FAST)
    with client, pytest.raises(LogprobdError) as caught:
        client.score(**request)
    error = caught.value
    assert (error.status, error.type, error.field, error.row) == (422, "invalid_request", "input_ids", 5)
    assert "5000" in error.message
    assert error.attempts == 1
    assert error.chunk_start > 0  # it was a later chunk: the row was shifted from the chunk's numbering
    sent = [sent_body(body)["input_ids"] for body in flaky.script.bodies]
    assert sum(any(5000 in row for row in rows) for rows in sent) == 1
    assert "row 5" in str(error)


def test_500_is_not_retried_by_default(qwen2_replicas: tuple[str, str]) -> None:
    flaky = Flaky([error_reply(500, "engine_failure")])
    with (
        Client(qwen2_replicas[0], transport=flaky, retry=FAST) as client,
        pytest.raises(LogprobdError) as caught,
    ):
        client.score([[1, 2, 3]], num_actions=1)
    assert (caught.value.status, caught.value.type, caught.value.message) == (
        500,
        "engine_failure",
        "scripted 500",
    )
    assert len(flaky.script.bodies) == 1


def test_a_body_that_is_not_logprobds_is_an_http_error(qwen2_replicas: tuple[str, str]) -> None:
    flaky = Flaky([httpx.Response(403, text="<html>forbidden by the gateway</html>")])
    with Client(qwen2_replicas[0], transport=flaky) as client, pytest.raises(LogprobdError) as caught:
        client.score([[1, 2, 3]], num_actions=1)
    assert (caught.value.status, caught.value.type) == (403, "http_error")
    assert "forbidden by the gateway" in caught.value.message


def test_backoff_grows_with_jitter_and_retry_after_is_a_capped_floor() -> None:
    policy = RetryPolicy(backoff=0.5, max_backoff=4.0, max_retry_after=30.0)
    rng = random.Random(0)
    for attempt, ceiling in [(0, 0.5), (1, 1.0), (2, 2.0), (3, 4.0), (6, 4.0)]:
        draws = [policy.delay(attempt, None, rng) for _ in range(200)]
        assert ceiling / 2 <= min(draws)
        assert max(draws) <= ceiling
        assert max(draws) - min(draws) > ceiling / 4  # jittered, not fixed
    assert policy.delay(0, 7.0, rng) == 7.0
    assert policy.delay(0, 600.0, rng) == 30.0
    assert policy.delay(2, 0.1, rng) >= 1.0  # a short Retry-After does not cut the backoff


def test_parse_retry_after() -> None:
    now = 1_700_000_000.0  # 2023-11-14 22:13:20 GMT
    assert parse_retry_after("3") == 3.0
    assert parse_retry_after(" 0 ") == 0.0
    assert parse_retry_after("Tue, 14 Nov 2023 22:13:50 GMT", now=now) == 30.0
    assert parse_retry_after("Tue, 14 Nov 2023 22:13:00 GMT", now=now) == 0.0  # in the past: now
    assert parse_retry_after("soon") is None
    assert parse_retry_after(None) is None
    assert parse_retry_after("nan") is None


def test_the_api_key_opens_a_server_that_wants_one(
    keyed_server: str, reference_models: dict[str, Any]
) -> None:
    request = ragged(seed=13, rows=2)
    flaky = Flaky([])
    with Client(keyed_server, transport=flaky, retry=FAST) as client, pytest.raises(LogprobdError) as caught:
        client.score(**request)
    assert (caught.value.status, caught.value.type) == (401, "unauthorized")
    assert len(flaky.script.bodies) == 1  # not retried
    with Client(keyed_server, api_key="sk-client-test") as client:
        assert_scores(reference_models["qwen2"], request, client.score(**request).logprobs)


def test_the_api_key_is_sent_as_a_bearer_token() -> None:
    seen: list[str | None] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("authorization"))
        return httpx.Response(
            200,
            json={"model": "m", "logprobs": [[-1.0]], "entropy": None, "action_mask": [[1]],
                  "usage": {"input_tokens": 2, "scored_tokens": 1}},
        )  # fmt: skip

    with Client(
        "http://logprobd.invalid", api_key="sk-test", transport=httpx.MockTransport(handler)
    ) as client:
        scores = client.score([[1, 2]], num_actions=1)
    assert seen == ["Bearer sk-test"]
    assert scores.logprobs == [[-1.0]]
    assert scores.usage.scored_tokens == 1
