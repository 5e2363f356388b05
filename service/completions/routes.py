"""The completions routes: POST /v1/completions, GET /v1/models (vLLM's paths; GET /health is api.py's
readiness route at vLLM's path).

A completion goes the way a /logprobs request does: body limit, parse, the plan's checks, the same
batcher (its micro-batches, prefix sharing, queue limits and deadline), the same outcome metrics.
With max_tokens 1 the token after each prompt is the head's most likely one (temperature 0) or its
seeded draw; where the answer shows that token's log-prob and the draw fell outside the top K
scored, one more job scores it (prompt + the drawn token, one action). The answer (up to hundreds
of MB for a distillation teacher's prompt_logprobs) is written on a worker thread, whole before its
first byte is sent, then sent chunk by chunk with its Content-Length, each chunk let go once sent.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from service.completions.pieces import PiecesCache
from service.completions.plan import CompletionPlan, plan_completion
from service.completions.response import Drawn, completion_chunks, last_position
from service.completions.schemas import CompletionRequest, CompletionResponse, ModelList
from service.http_io import answer_or_give_up, read_body
from service.jobs import SequenceJob, SequenceScores
from service.schemas import ErrorBody, parse_body
from service.state import ServiceState, Serving

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
        plan = plan_completion(request, serving.limits, serving.info.model, serving.limits.max_top_logprobs)
        metrics.queue_requests.inc()
        try:
            scores, drawn = await answer_or_give_up(http, _score(serving, plan), settings.request_timeout_s)
        finally:
            metrics.queue_requests.dec()

        def render() -> list[bytes]:
            return completion_chunks(
                plan,
                scores,
                drawn,
                model=serving.info.model,
                token_text=serving.token_text,
                pieces=vocabulary.get(serving.token_text, serving.info.vocab_size),
                request_id=f"cmpl-{uuid.uuid4().hex}",
                created=int(time.time()),
            )

        chunks = await asyncio.to_thread(render)
        metrics.requests.labels("ok").inc()
        metrics.input_tokens.inc(plan.input_tokens)
        metrics.scored_tokens.inc(plan.scored_tokens)
        metrics.request_seconds.observe(time.perf_counter() - began)
        size = sum(map(len, chunks))
        return StreamingResponse(
            _sent(deque(chunks)), media_type="application/json", headers={"content-length": str(size)}
        )

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


async def _sent(chunks: deque[bytes]) -> AsyncIterator[bytes]:
    """The chunks in order, each let go once handed to the server."""
    while chunks:
        yield chunks.popleft()


async def _score(serving: Serving, plan: CompletionPlan) -> tuple[list[SequenceScores], list[Drawn | None]]:
    """The plan's scores, and the token drawn after each prompt (max_tokens 1)."""
    scored = await serving.batcher.submit(plan.jobs)
    scores = scored.scores
    if not plan.draw:
        return scores, [None] * len(scores)
    drawn: list[Drawn | None] = []
    missing: list[int] = []
    for i, s in enumerate(scores):
        last = last_position(s)
        token = last.token if plan.greedy else _drawn(s)
        if token in last.top_ids:
            j = last.top_ids.index(token)
            drawn.append(Drawn(token, last.top_logprobs[j], j + 1))
        else:
            drawn.append(Drawn(token, float("nan"), 0))
            missing.append(i)
    if missing and plan.logprobs_k is not None:  # the answer shows the drawn token's log-prob
        jobs = [_rescore(plan.jobs[i], drawn[i]) for i in missing]
        again = await serving.batcher.submit(jobs)
        for i, s in zip(missing, again.scores, strict=True):
            d = drawn[i]
            assert d is not None
            assert s.ranks is not None
            drawn[i] = Drawn(d.token, float(s.logprobs[0]), int(s.ranks[0]))
    return scores, drawn


def _drawn(scores: SequenceScores) -> int:
    assert scores.drawn is not None, "the engine drew no token"
    return int(scores.drawn[-1])


def _rescore(job: SequenceJob, drawn: Drawn | None) -> SequenceJob:
    """The drawn token in place of the placeholder, as the job's only action (its log-prob and rank)."""
    assert drawn is not None
    tokens = job.tokens.copy()
    tokens[-1] = drawn.token
    return SequenceJob(
        tokens=tokens,
        actions=np.asarray([tokens.shape[0] - 1], dtype=np.int64),
        temperature=job.temperature,
        return_entropy=False,
        top_logprobs=1,
    )
