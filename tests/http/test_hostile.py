"""Hostile bodies the bad-input table does not cover: deep nesting, enormous arrays, unicode junk,
huge numbers, binary. Every one is a 4xx, and a good request right after is still exact."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tests.support.device import settings_for
from tests.support.servers import running

GOOD = {"input_ids": [[5, 9, 11, 3, 7]], "num_actions": 3, "return_entropy": True}

HOSTILE: dict[str, bytes] = {
    "deep_nesting": b"[" * 100_000 + b"]" * 100_000,
    "deep_nesting_in_field": b'{"input_ids": '
    + b"[" * 50_000
    + b"1"
    + b"]" * 50_000
    + b', "num_actions": 1}',
    "enormous_row": json.dumps({"input_ids": [[1] * 300_000], "num_actions": 1}).encode(),
    "enormous_batch": json.dumps({"input_ids": [[1, 2]] * 20_000, "num_actions": 1}).encode(),
    "unicode_junk_field": '{"inpüt_ids\u202e": [[1, 2]], "num_actions": 1}'.encode(),
    "unicode_junk_value": '{"input_ids": [["\U0001f4a9", "\u0000"]], "num_actions": 1}'.encode(),
    "lone_surrogate": b'{"input_ids": [[1, 2]], "num_actions": 1, "kl_estimator": "\\ud800"}',
    "invalid_utf8": b'{"input_ids": [[1, 2]], "num_actions": 1, "kl_estimator": "\xff\xfe"}',
    "huge_integer": b'{"input_ids": [[1, ' + b"9" * 5000 + b']], "num_actions": 1}',
    "huge_exponent": b'{"input_ids": [[1, 2]], "num_actions": 1, "temperature": 1e308000}',
    "binary": bytes(range(256)) * 16,
    "empty_body": b"",
    "just_null": b"null",
    "duplicate_keys": b'{"input_ids": [[1, 2]], "input_ids": [[1]], "num_actions": 1}',
    "mismatched_shapes": json.dumps(
        {"input_ids": [[1, 2, 3], [4, 5, 6]], "attention_mask": [[1, 1], [1, 1, 1]], "response_length": 1}
    ).encode(),
}


@pytest.fixture(scope="module")
def client(model_dirs: dict[str, Path]) -> Iterator[TestClient]:
    settings = settings_for(model_dirs["qwen2"], max_request_tokens=100_000, max_request_sequences=4096)
    with running(settings) as c:
        yield c


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_body_is_a_4xx_and_the_server_stays_exact(client: TestClient, name: str) -> None:
    before = client.post("/logprobs", json=GOOD).json()
    response = client.post("/logprobs", content=HOSTILE[name], headers={"content-type": "application/json"})
    if name == "duplicate_keys":  # JSON allows it; the last value wins, as in every parser
        assert response.status_code in (200, 422)
    else:
        assert 400 <= response.status_code < 500, (response.status_code, response.text[:300])
        assert response.json()["error"]["message"]
    after = client.post("/logprobs", json=GOOD).json()
    assert after == before
