"""The completions routes: POST /v1/completions, GET /v1/models (vLLM's paths; GET /health is router.py's
readiness route at vLLM's path).

A completion goes the way a /logprobs request does: body limit, parse, the plan's checks, the same
batcher (its micro-batches, prefix sharing, queue limits and deadline), the same outcome metrics.
With max_tokens 1 the token after each prompt is the head's most likely one (temperature 0) or its
seeded draw; where the answer shows that token's log-prob and the draw fell outside the top K
scored, one more job scores it (prompt + the drawn token, one action).

The answer (up to hundreds of MB for a distillation teacher's prompt_logprobs) is sent while it is
written. A large answer of several prompts (stream.streams) goes a choice at a time as each prompt's
micro-batch is collected, its status settled by choice 0 (stream.py says what a later failure
does). Any other: every prompt's scores, the checks of their content and the answer's small parts
come before the first byte, so any failure of the request, the engine or the deadline is a plain
error response; then its blocks, written on a pool, are sent in order as each is done (chunked
transfer: its length is known only at the end), each let go once sent. An answer of one chunk
(under response.CHUNK_BYTES) is sent whole with its Content-Length. A failure after the first byte
(a bug, memory) cuts the connection before the chunked body's end, which HTTP clients report as an
incomplete body, never as a shorter valid document; it is logged and counted.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Executor
from functools import partial
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from service.core.jobs import SequenceJob, SequenceScores
from service.http.bodies import answer_or_give_up, read_body
from service.http.completions.pieces import PiecesCache
from service.http.completions.plan import CompletionPlan, plan_completion
from service.http.completions.response import Drawn, Shared, completion_stream, last_position, render_pool
from service.http.completions.schemas import CompletionRequest, CompletionResponse, ModelList
from service.http.completions.stream import StreamedAnswer, streams
from service.http.state import ServiceState, Serving
from service.metrics import Metrics
from service.wire.schemas import ErrorBody, parse_body

log = logging.getLogger(__name__)

OWNER = "logprobd"


def build_completions_router(
    state: ServiceState, guarded: list[Any], errors: dict[int | str, dict[str, Any]]
) -> APIRouter:
    """The routes; `guarded` are the dependencies of a scoring route (the API key check)."""
    metrics, settings = state.metrics, state.settings
    router = APIRouter()
    started_at = int(time.time())
    vocabulary = PiecesCache()

    @router.post(
        "/v1/completions",
        response_model=CompletionResponse,
        responses=errors,
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": CompletionRequest.model_json_schema()}},
            }
        },
        dependencies=guarded,
    )
    async def completions(http: Request) -> Response:
        """Scores of token-id prompts in the OpenAI / vLLM completions form (docs/api.md, 'Completions')."""
        began = time.perf_counter()
        request = parse_body(CompletionRequest, await read_body(http, settings.max_body_bytes))
        serving = state.require_serving()
        plan = plan_completion(
            request,
            serving.limits,
            serving.info.model,
            serving.limits.max_top_logprobs,
            shows_text=serving.token_text is not None,
        )

        def shared() -> Shared:
            return Shared(
                model=serving.info.model,
                token_text=serving.token_text,
                pieces=vocabulary.get(serving.token_text, serving.info.vocab_size),
                request_id=f"cmpl-{uuid.uuid4().hex}",
                created=int(time.time()),
            )

        if streams(plan):
            return await _streamed(
                http,
                serving,
                plan,
                shared=shared,
                metrics=metrics,
                began=began,
                timeout_s=settings.request_timeout_s,
                batch_tokens=settings.stream_batch_tokens,
            )
        metrics.queue_requests.inc()
        try:
            scores, drawn, cached = await answer_or_give_up(
                http, _score(serving, plan), settings.request_timeout_s
            )
        finally:
            metrics.queue_requests.dec()

        pool = render_pool()

        def start() -> Iterator[bytes]:
            return completion_stream(plan, scores, drawn, shared(), pool, cached)

        try:
            chunks = await asyncio.to_thread(start)
            first = await asyncio.to_thread(next, chunks, b"")
            second = await asyncio.to_thread(next, chunks, None)
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        metrics.input_tokens.inc(plan.input_tokens)
        metrics.scored_tokens.inc(plan.scored_tokens)
        if second is None:  # one chunk (under CHUNK_BYTES): the whole answer, with its length
            pool.shutdown(wait=False)
            metrics.requests.labels("ok").inc()
            metrics.request_seconds.observe(time.perf_counter() - began)
            return Response(first, media_type="application/json")
        sent = _sent(itertools.chain((first, second), chunks), pool, metrics, began)
        return StreamingResponse(sent, media_type="application/json")

    @router.get("/v1/models", response_model=ModelList, responses={503: {"model": ErrorBody}})
    async def models() -> ModelList:
        """The served model, as vLLM lists it; `id` is the name /info reports."""
        serving = state.require_serving()
        name = serving.info.model
        return ModelList.model_validate(
            {
                "object": "list",
                "data": [
                    {
                        "id": name,
                        "object": "model",
                        "created": started_at,
                        "owned_by": OWNER,
                        "root": name,
                        "parent": None,
                        "max_model_len": serving.limits.max_sequence_tokens,
                    }
                ],
            }
        )

    return router


async def _sent(
    chunks: Iterator[bytes], pool: Executor, metrics: Metrics, began: float
) -> AsyncIterator[bytes]:
    """The chunks in order, each as soon as it is written and let go once handed to the server; the
    outcome counted at the end. A failure is raised on (the server then cuts the connection); a
    client gone (the stream cancelled or closed) stops the writing."""
    outcome = "internal_error"
    try:
        while (chunk := await asyncio.to_thread(next, chunks, None)) is not None:
            yield chunk
            del chunk
        outcome = "ok"
        metrics.request_seconds.observe(time.perf_counter() - began)
    except (asyncio.CancelledError, GeneratorExit):
        outcome = "client_disconnected"
        raise
    except Exception:
        log.exception("completions: the answer failed after its first byte; the connection is cut")
        raise
    finally:
        metrics.requests.labels(outcome).inc()
        pool.shutdown(wait=False, cancel_futures=True)


async def _streamed(
    http: Request,
    serving: Serving,
    plan: CompletionPlan,
    *,
    shared: Callable[[], Shared],
    metrics: Metrics,
    began: float,
    timeout_s: float,
    batch_tokens: int,
) -> StreamingResponse:
    """The answer a choice at a time (stream.py): the status once choice 0 is written, then the rest;
    the prompts in micro-batches of at most `batch_tokens`, so that choice 0 comes back early."""
    request = serving.batcher.queue_each(plan.jobs, batch_tokens=batch_tokens)
    answer = StreamedAnswer(
        plan, request.futures, partial(_drawn_after, serving, plan), lambda: request.cached
    )
    deadline = time.perf_counter() + timeout_s
    metrics.queue_requests.inc()
    try:
        first = await answer_or_give_up(http, answer.first(shared), timeout_s)
    except BaseException:
        answer.drop()
        metrics.queue_requests.dec()
        raise

    def done(outcome: str) -> None:
        metrics.queue_requests.dec()
        metrics.requests.labels(outcome).inc()
        if outcome == "ok":
            metrics.input_tokens.inc(plan.input_tokens)
            metrics.scored_tokens.inc(plan.scored_tokens)
            metrics.request_seconds.observe(time.perf_counter() - began)

    return StreamingResponse(answer.rest(http, first, deadline, done), media_type="application/json")


async def _drawn_after(
    serving: Serving, plan: CompletionPlan, i: int, scores: SequenceScores
) -> Drawn | None:
    """The token drawn after prompt i where the answer shows it (max_tokens 1), as `_score` draws
    it: one more job scores it where the answer shows its log-prob and it fell outside the top K."""
    if not plan.scores_draw:
        return None
    drawn = _drawn_from(plan, scores)
    if drawn.rank or plan.logprobs_k is None:
        return drawn
    again = await serving.batcher.submit([_rescore(plan.jobs[i], drawn)])
    return _rescored(drawn, again.scores[0])


def _drawn_from(plan: CompletionPlan, scores: SequenceScores) -> Drawn:
    """The drawn token with its log-prob and rank where among the top K scored, else rank 0, NaN."""
    last = last_position(scores)
    token = last.token if plan.greedy else _drawn(scores)
    if token in last.top_ids:
        j = last.top_ids.index(token)
        return Drawn(token, last.top_logprobs[j], j + 1)
    return Drawn(token, float("nan"), 0)


async def _score(
    serving: Serving, plan: CompletionPlan
) -> tuple[list[SequenceScores], list[Drawn | None], int]:
    """The plan's scores, the token drawn after each prompt (max_tokens 1, where it is shown) and the
    prompt tokens the prefix cache served."""
    scored = await serving.batcher.submit(plan.jobs)
    scores = scored.scores
    if not plan.scores_draw:
        return scores, [None] * len(scores), scored.cached_tokens
    drawn: list[Drawn | None] = [_drawn_from(plan, s) for s in scores]
    missing = [i for i, d in enumerate(drawn) if d is not None and not d.rank]
    if missing and plan.logprobs_k is not None:  # the answer shows the drawn token's log-prob
        jobs = [_rescore(plan.jobs[i], drawn[i]) for i in missing]
        again = await serving.batcher.submit(jobs)
        for i, s in zip(missing, again.scores, strict=True):
            d = drawn[i]
            assert d is not None
            drawn[i] = _rescored(d, s)
    return scores, drawn, scored.cached_tokens


def _rescored(drawn: Drawn, scores: SequenceScores) -> Drawn:
    """The drawn token with the log-prob and rank its rescoring job (`_rescore`) found."""
    assert scores.ranks is not None
    return Drawn(drawn.token, float(scores.logprobs[0]), int(scores.ranks[0]))


def _drawn(scores: SequenceScores) -> int:
    assert scores.drawn is not None, "the engine drew no token"
    return int(scores.drawn[-1])


def _rescore(job: SequenceJob, drawn: Drawn | None) -> SequenceJob:
    """The prompt and the drawn token after it, which is the job's only action (its log-prob and rank)."""
    assert drawn is not None
    tokens = np.append(job.tokens, drawn.token)
    return SequenceJob(
        tokens=tokens,
        actions=np.asarray([tokens.shape[0] - 1], dtype=np.int64),
        temperature=job.temperature,
        return_entropy=False,
        top_logprobs=1,
    )
