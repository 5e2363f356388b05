"""A large multi-prompt completions answer sent a choice at a time (stream.py), over a real uvicorn
on loopback and TopEngine (tests/support/fakes.py: FakeEngine's scores with the head's extras), one prompt a
micro-batch: the status arrives while later prompts compute; the bytes are those of the whole
answer (completion_chunks) for the same scores; choice 0's failure is a plain error status; a later
choice's failure or the deadline cuts the chunked body; a client that leaves drops the queued work;
a small answer is still sent whole with its Content-Length."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
import requests

from service.core.cache_plan import CachePlan
from service.core.jobs import Chunk, SequenceJob
from service.core.prefixes import Forest
from service.http.app import create_app
from service.http.completions import stream
from service.http.completions.plan import plan_completion
from service.http.completions.schemas import CompletionRequest
from service.normalise import ModelLimits
from service.settings import Settings
from tests.support.completions import LENGTH, MARKER, K, body, expected, prompts
from tests.support.fakes import FakeLaunched, TopEngine
from tests.support.servers import loopback


class DrawsOutside(TopEngine):
    """TopEngine whose draw after a prompt is 3 past its top id: outside the K it scored (ids 7
    apart), so an answer showing the draw's log-prob scores it again."""

    def launch(
        self,
        jobs: Sequence[SequenceJob],
        chunk: Chunk | None = None,
        forest: Forest | None = None,
        cache: CachePlan | None = None,
    ) -> FakeLaunched:
        launched = super().launch(jobs, chunk, forest, cache)
        for s in launched.scores:
            if s.drawn is not None:
                assert s.top_ids is not None
                s.drawn[:] = (s.top_ids[:, 0] + 3) % self.info.vocab_size
        return launched


class BadTopFor(TopEngine):
    """TopEngine whose scores of `prompt` hold a top id past the vocabulary (an engine's bug)."""

    def __init__(self, prompt: list[int]) -> None:
        super().__init__()
        self.prompt = prompt

    def launch(
        self,
        jobs: Sequence[SequenceJob],
        chunk: Chunk | None = None,
        forest: Forest | None = None,
        cache: CachePlan | None = None,
    ) -> FakeLaunched:
        launched = super().launch(jobs, chunk, forest, cache)
        for job, s in zip(jobs, launched.scores, strict=True):
            if job.tokens[: len(self.prompt)].tolist() == self.prompt:
                assert s.top_ids is not None
                s.top_ids[-1, -1] = self.info.vocab_size
        return launched


@contextmanager
def served(
    engine: TopEngine | None = None, *, delay: float = 0.0, timeout_s: float = 600.0
) -> Iterator[tuple[str, TopEngine]]:
    """One prompt a micro-batch (a budget of 48 tokens), each `delay` s on the device."""
    engine = engine or TopEngine()
    engine.delay = delay
    engine.fail_late_on_token = MARKER
    settings = Settings(device="cpu", max_top_logprobs=K, max_batch_tokens=48, request_timeout_s=timeout_s)
    with loopback(create_app(settings, engine_factory=lambda _: engine)) as url:
        yield url, engine


@pytest.fixture
def per_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every answer of more than one prompt goes a choice at a time, however small."""
    monkeypatch.setattr(stream, "STREAM_CHUNKS", 0)


def outcomes(url: str) -> dict[str, float]:
    """logprobd_requests_total by outcome, from /metrics."""
    out: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("logprobd_requests_total{"):
            label, value = line.split("} ")
            out[label.split('"')[1]] = float(value)
    return out


def read_into(received: bytearray, reply: httpx.Response) -> None:
    for piece in reply.iter_raw():
        received.extend(piece)


def cut(url: str, payload: dict[str, Any]) -> bytes:
    """The bytes of a 200 answer whose chunked body httpx finds cut; fails if it is not cut."""
    received = bytearray()
    with (
        httpx.Client(timeout=60) as client,
        client.stream("POST", f"{url}/v1/completions", json=payload) as reply,
    ):
        assert reply.status_code == 200
        assert reply.headers["transfer-encoding"] == "chunked"
        with pytest.raises(httpx.RemoteProtocolError, match="incomplete chunked read"):
            read_into(received, reply)
    with pytest.raises(orjson.JSONDecodeError):
        orjson.loads(bytes(received))
    return bytes(received)


@pytest.mark.usefixtures("per_choice")
def test_the_status_comes_with_choice_0_and_the_bytes_are_the_whole_answers() -> None:
    """Three prompts, 0.3 s each on the device: the status line arrives before prompt 2's
    micro-batch is collected, and the body is completion_chunks' for the same scores."""
    rows = prompts()
    with served(delay=0.3) as (url, engine), httpx.Client(timeout=60) as client:
        started = time.perf_counter()
        with client.stream("POST", f"{url}/v1/completions", json=body(rows)) as reply:
            headers_s = time.perf_counter() - started
            events = list(engine.events)
            content = reply.read()
        assert reply.status_code == 200
        assert reply.headers["transfer-encoding"] == "chunked"
        assert ("collected", 1) in events
        assert ("collected", 3) not in events
        assert headers_s < 0.9
        assert content == expected(content, rows, engine)
        assert outcomes(url)["ok"] == 1


def test_a_drawn_token_rescored_per_choice_gives_the_whole_answers_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """OpenAI's echo + logprobs with max_tokens 1 shows the draw's log-prob; every draw falls
    outside the top K, so each choice's draw is scored again by one more job: the bytes sent a
    choice at a time equal those sent whole (the id and created aside)."""
    payload = {"prompt": prompts(), "max_tokens": 1, "temperature": 1.0, "logprobs": K, "echo": True}
    answers = []
    with served(DrawsOutside()) as (url, engine):
        for chunks in (10**9, 0):  # whole, then a choice at a time
            monkeypatch.setattr(stream, "STREAM_CHUNKS", chunks)
            reply = httpx.post(f"{url}/v1/completions", json=payload, timeout=60)
            assert reply.status_code == 200, reply.text
            assert ("content-length" in reply.headers) == (chunks > 0)
            answers.append(reply.json())
        assert len(engine.batches) == 2 * (3 + 3)  # 3 prompts and 3 draws scored again, twice
    whole, streamed = answers
    for name in ("id", "created"):
        streamed[name] = whole[name]
    assert orjson.dumps(streamed) == orjson.dumps(whole)
    for choice in whole["choices"]:
        last = choice["logprobs"]["token_logprobs"][-1]
        assert np.isfinite(last)  # the rescored draw's log-prob, not the NaN of one outside the K


@pytest.mark.usefixtures("per_choice")
def test_the_engine_failing_for_choice_0_is_an_error_status() -> None:
    with served() as (url, _):
        reply = httpx.post(f"{url}/v1/completions", json=body(prompts(fail_at=0)), timeout=60)
        assert reply.status_code == 500, reply.text
        assert reply.json()["error"]["type"] == "engine_failure"
        assert outcomes(url)["engine_failure"] == 1


@pytest.mark.usefixtures("per_choice")
def test_bad_scores_for_choice_0_are_an_error_status_and_for_choice_2_cut_the_body() -> None:
    with served(BadTopFor(prompts()[0])) as (url, _):
        reply = httpx.post(f"{url}/v1/completions", json=body(prompts()), timeout=60)
        assert reply.status_code == 500, reply.text
        assert "prompt 0 hold a top id outside" in reply.json()["error"]["message"]
    with served(BadTopFor(prompts()[2])) as (url, _):
        received = cut(url, body(prompts()))
        assert b'"index":1' in received
        assert b'"index":2' not in received
        assert outcomes(url)["engine_failure"] == 1


@pytest.mark.usefixtures("per_choice")
def test_the_deadline_before_choice_0_is_an_error_status() -> None:
    """A deadline of 0.2 s, 0.4 s a micro-batch: a 504, and the prompts not launched (all but the
    first two) are dropped: kept, the fourth would launch at 0.8 s."""
    with served(delay=0.4, timeout_s=0.2) as (url, engine):
        reply = httpx.post(f"{url}/v1/completions", json=body(eight_prompts()), timeout=60)
        assert reply.status_code == 504, reply.text
        assert reply.json()["error"]["type"] == "deadline_exceeded"
        time.sleep(1.2)
        assert len(engine.batches) <= 2


@pytest.mark.usefixtures("per_choice")
def test_the_engine_failing_for_choice_2_of_3_cuts_the_body() -> None:
    """Choices 0 and 1 sent, then prompt 2's micro-batch fails: an incomplete body to httpx and to
    requests (TRL's client), counted as an engine failure."""
    with served() as (url, _):
        received = cut(url, body(prompts(fail_at=2)))
        assert b'"index":1' in received
        assert b'"index":2' not in received
        with pytest.raises(requests.exceptions.ChunkedEncodingError):
            requests.post(f"{url}/v1/completions", json=body(prompts(fail_at=2)), timeout=60)
        assert outcomes(url)["engine_failure"] == 2


@pytest.mark.usefixtures("per_choice")
def test_the_deadline_passing_between_choices_cuts_the_body() -> None:
    """A deadline of 1 s, 0.6 s a micro-batch: choice 0 is in at 0.6 s, choice 1 would be at 1.2 s."""
    with served(delay=0.6, timeout_s=1.0) as (url, _):
        received = cut(url, body(prompts()))
        assert b'"index":0' in received
        assert b'"index":1' not in received
        assert outcomes(url)["deadline_exceeded"] == 1


def wait_for(condition: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("the condition did not come true")
        time.sleep(0.02)


def eight_prompts() -> list[list[int]]:
    return [((np.arange(LENGTH) * (3 + i)) % 500 + 1).tolist() for i in range(8)]


@pytest.mark.usefixtures("per_choice")
def test_a_client_gone_after_the_first_byte_drops_the_queued_prompts() -> None:
    """Eight prompts, 0.2 s each: the client leaves once the status is in (choice 0 written); the
    prompts not yet launched never reach the engine."""
    with served(delay=0.2) as (url, engine):
        with (
            httpx.Client(timeout=60) as client,
            client.stream("POST", f"{url}/v1/completions", json=body(eight_prompts())) as reply,
        ):
            assert reply.status_code == 200
        wait_for(lambda: outcomes(url).get("client_disconnected") == 1)
        time.sleep(8 * 0.2)  # what would have launched every prompt by now
        assert len(engine.batches) <= 4
        assert outcomes(url).get("ok", 0) == 0


@pytest.mark.usefixtures("per_choice")
def test_a_client_gone_before_the_first_byte_drops_the_queued_prompts() -> None:
    with served(delay=0.3) as (url, engine):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                f"{url}/v1/completions", json=body(eight_prompts()), timeout=httpx.Timeout(60, read=0.1)
            )
        wait_for(lambda: outcomes(url).get("client_disconnected") == 1)
        time.sleep(8 * 0.3)
        assert len(engine.batches) <= 3


def test_a_small_answer_is_sent_whole_with_its_length() -> None:
    """Three prompts of 40 tokens at K = 8: about 20 kB, under STREAM_CHUNKS chunks."""
    with served() as (url, _):
        reply = httpx.post(f"{url}/v1/completions", json=body(prompts()), timeout=60)
        assert reply.status_code == 200, reply.text
        assert int(reply.headers["content-length"]) == len(reply.content)
        assert "transfer-encoding" not in reply.headers


def plan_of(rows: list[list[int]], k: int) -> Any:
    limits = ModelLimits(vocab_size=152_064, max_sequence_tokens=8192, max_top_logprobs=1000)
    request = CompletionRequest.model_validate({"prompt": rows, "max_tokens": 1, "prompt_logprobs": k})
    return plan_completion(request, limits, "m", 1000, shows_text=False)  # as TRL's teacher: no tokenizer


def test_which_answers_go_a_choice_at_a_time() -> None:
    """TRL's teacher call (8 x 4,096 tokens, K = 100: 232 MB) does; one prompt never does; three
    prompts of 40 tokens at K = 8 do not; 8 x 512 at K = 100 (over 8 MB) does."""
    teacher = plan_of([[1] * 4096] * 8, 100)
    assert stream.estimated_bytes(teacher) == 8 * 4095 * 101 * stream.ENTRY_BYTES  # no draw shown
    assert stream.streams(teacher)
    assert not stream.streams(plan_of([[1] * 4096], 100))
    assert not stream.streams(plan_of(prompts(), 8))
    assert stream.streams(plan_of([[1] * 512] * 8, 100))
    assert not stream.streams(plan_of([[1] * 512] * 8, 20))  # 1.7 MB


@pytest.mark.usefixtures("per_choice")
@pytest.mark.parametrize(("stream_batch_tokens", "batches"), [(48, [[LENGTH]] * 3), (4096, [[LENGTH] * 3])])
def test_a_streamed_answers_prompts_go_in_micro_batches_of_stream_batch_tokens(
    stream_batch_tokens: int, batches: list[list[int]]
) -> None:
    """Under a budget of 4,096 tokens a streamed answer's three prompts of 40 go one a micro-batch
    at stream_batch_tokens 48 (choice 0 is sent while prompts 1 and 2 compute), all in one at 4,096;
    the answer is the same."""
    engine = TopEngine()
    settings = Settings(
        device="cpu", max_top_logprobs=K, max_batch_tokens=4096, stream_batch_tokens=stream_batch_tokens
    )
    rows = prompts()
    with loopback(create_app(settings, engine_factory=lambda _: engine)) as url:
        reply = httpx.post(f"{url}/v1/completions", json=body(rows), timeout=60)
    assert reply.status_code == 200
    assert reply.headers["transfer-encoding"] == "chunked"
    assert engine.batches[-len(batches) :] == batches
    assert reply.content == expected(reply.content, rows, engine)
