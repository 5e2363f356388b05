"""The completions answer sent while it is written, over a real uvicorn on loopback: the bytes are
response.completion_chunks' (what was served whole before); a failure before the first byte (the
engine failing for choice 2 of 3) is a plain error response; one after it (the writer failing on
choice 2's block) cuts the connection, which httpx and requests report as an incomplete body, never
as a shorter document that parses."""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
import requests

from service.core.cache_plan import CachePlan
from service.core.jobs import Chunk, SequenceJob, SequenceScores
from service.core.prefixes import Forest
from service.http.app import create_app
from service.http.completions import jsonwriter, response
from service.http.completions.pieces import TokenPieces
from service.http.completions.plan import plan_completion
from service.http.completions.response import Shared, completion_chunks
from service.http.completions.schemas import CompletionRequest
from service.normalise import ModelLimits
from service.settings import Settings
from tests.conftest import loopback
from tests.fakes import FakeEngine, FakeLaunched

K = 8
LENGTH = 40
MARKER = 999  # a prompt holding it fails late, as a device error reported at collection does


def with_top(job: SequenceJob, scores: SequenceScores, vocab: int) -> SequenceScores:
    """FakeEngine's scores with the head's extras: K distinct ids per action, the action's token
    first (rank 1) where its position is even, else absent (rank K + position); log-probs sorted."""
    k = job.top_logprobs
    actions = job.actions
    token = job.targets
    among = actions % 2 == 0
    first = np.where(among, token, (token + 1) % vocab)
    ids = (first[:, None] + np.arange(k) * 7) % vocab
    top = scores.logprobs[:, None] - np.arange(k, dtype=np.float32) / 4
    return SequenceScores(
        logprobs=np.where(among, top[:, 0], top[:, -1] - 1).astype(np.float32),
        entropy=None,
        top_ids=ids.astype(np.int32),
        top_logprobs=top.astype(np.float32),
        ranks=np.where(among, 1, k + actions).astype(np.int64),
        drawn=ids[:, 0].astype(np.int64) if job.draw_seed is not None else None,
    )


class TopEngine(FakeEngine):
    """FakeEngine with the head's extras (with_top); `seeds` the draw seeds of every job launched."""

    def __init__(self) -> None:
        super().__init__()
        self.seeds: list[int | None] = []

    def launch(
        self,
        jobs: Sequence[SequenceJob],
        chunk: Chunk | None = None,
        forest: Forest | None = None,
        cache: CachePlan | None = None,
    ) -> FakeLaunched:
        assert chunk is None
        self.seeds += [job.draw_seed for job in jobs]
        launched = super().launch(jobs, chunk, forest, cache)
        launched.scores = [
            with_top(job, s, self.info.vocab_size) for job, s in zip(jobs, launched.scores, strict=True)
        ]
        return launched


def prompts(fail_at: int | None = None) -> list[list[int]]:
    rows = [((np.arange(LENGTH) * (3 + i)) % 500 + 1).tolist() for i in range(3)]
    if fail_at is not None:
        rows[fail_at][5] = MARKER
    return rows


def body(rows: list[list[int]]) -> dict[str, Any]:
    return {"prompt": rows, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": K}


@pytest.fixture
def served() -> Iterator[tuple[str, TopEngine]]:
    """One prompt a micro-batch (a budget of 48 tokens), so prompt 2's failure comes after choice 0."""
    engine = TopEngine()
    engine.fail_late_on_token = MARKER
    settings = Settings(device="cpu", max_top_logprobs=K, max_batch_tokens=48)
    with loopback(create_app(settings, engine_factory=lambda _: engine)) as url:
        yield url, engine


def expected(reply: bytes, rows: list[list[int]], engine: TopEngine) -> bytes:
    """completion_chunks' bytes for these prompts, with the reply's id and created."""
    head = orjson.loads(reply)
    limits = ModelLimits(vocab_size=engine.info.vocab_size, max_sequence_tokens=4096, max_top_logprobs=K)
    plan = plan_completion(CompletionRequest.model_validate(body(rows)), limits, engine.info.model, K)
    scores = engine.score(plan.jobs)  # the extras with them
    drawn: list[response.Drawn | None] = []
    for s in scores:  # the draw is the top id after the prompt (TopEngine's), rank 1
        assert s.top_ids is not None
        assert s.top_logprobs is not None
        drawn.append(response.Drawn(int(s.top_ids[-1, 0]), float(s.top_logprobs[-1, 0]), 1))
    pieces = TokenPieces.build(None, engine.info.vocab_size)
    h = Shared(engine.info.model, None, pieces, head["id"], head["created"])
    return b"".join(
        completion_chunks(
            plan,
            scores,
            drawn,
            model=h.model,
            token_text=None,
            pieces=pieces,
            request_id=h.request_id,
            created=h.created,
        )
    )


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
    block = jsonwriter._prompt_block
    marker = prompts()[2][1]

    def failing(pieces: TokenPieces, positions: jsonwriter.Positions, k: int) -> Any:
        if int(positions.token[0]) == marker:
            raise MemoryError("injected: the writer failed on choice 2")
        return block(pieces, positions, k)

    monkeypatch.setattr(jsonwriter, "_prompt_block", failing)
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
    top = with_top

    def past_the_vocabulary(job: SequenceJob, scores: SequenceScores, _: int) -> SequenceScores:
        s = top(job, scores, vocab)
        assert s.top_ids is not None
        s.top_ids[-1, -1] = vocab  # the last position's K-th id
        return s

    monkeypatch.setattr(sys.modules[__name__], "with_top", past_the_vocabulary)
    reply = httpx.post(f"{url}/v1/completions", json=body(prompts()), timeout=60)
    assert reply.status_code == 500
    error = reply.json()["error"]
    assert error["type"] == "engine_failure"
    assert "prompt 0 hold a top id outside" in error["message"]
