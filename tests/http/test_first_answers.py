"""The answers a newcomer's first mistakes get, through the real app: `GET /docs` says how to turn the
interactive docs on; a flat `input_ids` (or any field of rows) says it wants a list of rows, in the
JSON path of small and large bodies alike; without a tokenizer, /v1/completions' `text_offset` indexes
the (empty) text it returns, not its `token_id:<id>` placeholders."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from service.http.app import create_app
from service.settings import Settings
from service.wire.jsonrows import FAST_MIN_BYTES
from tests.support.fakes import FakeEngine
from tests.support.servers import wait_ready


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with TestClient(create_app(Settings(), engine_factory=lambda _: FakeEngine())) as test_client:
        wait_ready(test_client)
        yield test_client


@pytest.mark.parametrize("path", ["/docs", "/redoc", "/docs/"])
def test_the_docs_pages_404_says_how_to_turn_them_on(client: TestClient, path: str) -> None:
    answer = client.get(path)
    assert answer.status_code == 404
    message = answer.json()["error"]["message"]
    assert "start the server with --docs-ui" in message
    assert "/openapi.json" in message
    other = client.get("/nowhere").json()["error"]["message"]
    assert other == "GET /nowhere: no such route (the routes are listed at /openapi.json)"


FLAT = "a list of rows, one list per sequence ([[1, 2, 3]] for one sequence), not one flat list of numbers"


@pytest.mark.parametrize("size", ["small", "large"])
@pytest.mark.parametrize(
    "body",
    [
        {"input_ids": [1, 2, 3], "num_actions": 1},
        {"input_ids": [[1, 2, 3]], "attention_mask": [1, 1, 1], "response_length": 1},
        {"input_ids": [[1, 2, 3]], "action_mask": [0, 1, 1]},
        {"input_ids": [[4, 5]], "prompt_ids": [1, 2, 3], "prompt_index": [0]},
        {"input_ids": [[1, 2, 3]], "num_actions": 1, "rollout_logprobs": [-0.5]},
    ],
)
def test_a_flat_row_list_is_named_as_such(client: TestClient, body: dict[str, object], size: str) -> None:
    field = next(
        name for name, value in body.items() if isinstance(value, list) and not isinstance(value[0], list)
    )
    if size == "large":  # past the fast JSON path's threshold: its fallback says the same
        body = {**body, "timeout_s": 60.0, "eos_token_id": list(range(FAST_MIN_BYTES // 4))}
    answer = client.post("/logprobs", json=body)
    assert answer.status_code == 422
    assert answer.json()["error"] == {
        "type": "invalid_request",
        "message": f"{field}: {FLAT}",
        "field": field,
    }


def test_a_non_number_in_a_row_keeps_its_row(client: TestClient) -> None:
    answer = client.post("/logprobs", json={"input_ids": [[1, 2], [3, "a"]], "num_actions": 1})
    assert answer.json()["error"]["message"] == "input_ids[1][1]: Input should be a valid integer"


def test_without_a_tokenizer_text_offset_indexes_the_empty_text() -> None:
    """The demo model (random weights, no tokenizer), as `make serve` serves it."""
    prompt = [1, 17, 23, 5]
    with TestClient(create_app(Settings(device="cpu"))) as client:
        wait_ready(client)
        answer = client.post(
            "/v1/completions",
            json={
                "model": "logprobd-demo-qwen2",
                "prompt": [prompt],
                "max_tokens": 1,
                "logprobs": 1,
                "echo": True,
            },
        )
    assert answer.status_code == 200, answer.text
    (choice,) = answer.json()["choices"]
    assert choice["text"] == ""
    assert choice["logprobs"]["tokens"][: len(prompt)] == [f"token_id:{t}" for t in prompt]
    assert choice["logprobs"]["text_offset"] == [0] * (len(prompt) + 1)
