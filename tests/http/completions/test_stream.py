"""The completions answer sent while it is written, over a real uvicorn on loopback: the bytes are
response.completion_chunks' (what was served whole before); a failure before the first byte (the
engine failing for choice 2 of 3) is a plain error response; one after it (the writer failing on
choice 2's block) cuts the connection, which httpx and requests report as an incomplete body, never
as a shorter document that parses."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
import requests

from service.core.jobs import SequenceJob, SequenceScores
from service.http.app import create_app
from service.http.completions import jsonwriter, response
from service.http.completions.pieces import TokenPieces
from service.settings import Settings
from tests.support import fakes
from tests.support.completions import LENGTH, MARKER, K, body, expected, prompts
from tests.support.fakes import TopEngine
from tests.support.servers import loopback


@pytest.fixture
def served() -> Iterator[tuple[str, TopEngine]]:
    """One prompt a micro-batch (a budget of 48 tokens), so prompt 2's failure comes after choice 0."""
    engine = TopEngine()
    engine.fail_late_on_token = MARKER
    settings = Settings(device="cpu", max_top_logprobs=K, max_batch_tokens=48)
    with loopback(create_app(settings, engine_factory=lambda _: engine)) as url:
        yield url, engine


def test_the_streamed_answer_is_the_written_one(
    served: tuple[str, TopEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sent a piece at a time (every piece its own chunk), the bytes are completion_chunks' with the
    token drawn: without a tokenizer no answer shows it, so the server draws none."""
    url, engine = served
    monkeypatch.setattr(response, "CHUNK_BYTES", 1)
    rows = prompts()
    reply = httpx.post(f"{url}/v1/completions", json=body(rows), timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.headers["transfer-encoding"] == "chunked"
    assert engine.seeds == [None] * 3
    assert reply.content == expected(reply.content, rows, engine)
    choices = reply.json()["choices"]
    assert [len(c["prompt_logprobs"]) for c in choices] == [LENGTH] * 3


def test_the_engine_failing_for_choice_2_is_an_error_response(served: tuple[str, TopEngine]) -> None:
    """Choices 0 and 1 are scored before prompt 2's micro-batch fails: the status is still 500."""
    url, engine = served
    reply = httpx.post(f"{url}/v1/completions", json=body(prompts(fail_at=2)), timeout=60)
    assert reply.status_code == 500, reply.text
    assert reply.json()["error"]["type"] == "engine_failure"
    assert len(engine.batches) == 3  # each prompt its own micro-batch: 0 and 1 were scored


@pytest.fixture
def fails_on_choice_2(monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer fails on prompt_logprobs' block of choice 2 (its first token is prompt 2's); every
    piece is its own chunk, so choices 0 and 1 are sent before."""
    block = jsonwriter._prompt_bytes
    marker = prompts()[2][1]

    def failing(pieces: TokenPieces, positions: jsonwriter.Positions, k: int) -> Any:
        if int(positions.token[0]) == marker:
            raise MemoryError("injected: the writer failed on choice 2")
        return block(pieces, positions, k)

    monkeypatch.setattr(jsonwriter, "_prompt_bytes", failing)
    monkeypatch.setattr(response, "CHUNK_BYTES", 1)


@pytest.mark.usefixtures("fails_on_choice_2")
def test_a_failure_after_the_first_byte_is_an_incomplete_body_to_httpx(served: tuple[str, TopEngine]) -> None:
    url, _ = served
    received = bytearray()

    def read() -> None:
        for piece in reply.iter_raw():
            received.extend(piece)

    with (
        httpx.Client(timeout=60) as client,
        client.stream("POST", f"{url}/v1/completions", json=body(prompts())) as reply,
    ):
        assert reply.status_code == 200
        with pytest.raises(httpx.RemoteProtocolError, match="incomplete chunked read"):
            read()
    assert b'"index":1' in received  # choices 0 and 1 came before the cut
    with pytest.raises(orjson.JSONDecodeError):
        orjson.loads(bytes(received))
    metrics = httpx.get(f"{url}/metrics").text
    assert 'logprobd_requests_total{outcome="internal_error"} 1.0' in metrics


@pytest.mark.usefixtures("fails_on_choice_2")
def test_a_failure_after_the_first_byte_is_an_error_to_requests(served: tuple[str, TopEngine]) -> None:
    """TRL's client: requests.post, then raise_for_status and .json(); the read itself raises."""
    url, _ = served
    with pytest.raises(requests.exceptions.ChunkedEncodingError):
        requests.post(f"{url}/v1/completions", json=body(prompts()), timeout=60)


def test_an_id_outside_the_vocabulary_is_an_error_before_the_first_byte(
    served: tuple[str, TopEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Scores the writer has no piece for (an engine's bug) are refused whole, with a 500, before any
    of the answer is sent."""
    url, engine = served
    vocab = engine.info.vocab_size
    top = fakes.with_top

    def past_the_vocabulary(job: SequenceJob, scores: SequenceScores, _: int) -> SequenceScores:
        s = top(job, scores, vocab)
        assert s.top_ids is not None
        s.top_ids[-1, -1] = vocab  # the last position's K-th id
        return s

    monkeypatch.setattr(fakes, "with_top", past_the_vocabulary)
    reply = httpx.post(f"{url}/v1/completions", json=body(prompts()), timeout=60)
    assert reply.status_code == 500
    error = reply.json()["error"]
    assert error["type"] == "engine_failure"
    assert "prompt 0 hold a top id outside" in error["message"]
