"""The HTTP routes; each handler is a few lines over the layers below it.

A large body is parsed (JSON) and normalised, and a JSON answer with routes or a distribution
written, on a worker thread: their big members are read and written natively with the GIL released
(wire/jsonrows.py, wire/jsonarrays.py), so requests that arrive or finish together are parsed and
written in parallel while the event loop goes on feeding the batcher. A big answer goes to the server
in slices (bodies.SlicedResponse).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from service.answer.diagnostics import rollout_statistics
from service.answer.layout import answer, json_parts, route_agreement
from service.batcher import sharing
from service.core.errors import NotReady
from service.core.jobs import SequenceScores
from service.http.admin import build_admin_router
from service.http.auth import ApiKeys
from service.http.bodies import SLICE_BYTES, SlicedResponse, answer_or_give_up, read_body
from service.http.completions.endpoints import build_completions_router
from service.http.state import ServiceState
from service.http.weight_sync import build_weight_sync_router
from service.metrics import CONTENT_TYPE, Metrics
from service.normalise import ModelLimits, ScoringPlan, normalise
from service.wire.arrays import parse_frame, to_frame
from service.wire.frame import MEDIA_TYPE
from service.wire.jsonrows import parse_json
from service.wire.schemas import (
    ErrorBody,
    Health,
    Info,
    LogprobsRequest,
    LogprobsResponse,
    ModelSummary,
    RolloutMismatch,
    RouteAgreementSummary,
)

ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorBody, "description": text}
    for status, text in [
        (401, "No valid API key (when the server has keys)"),
        (409, "The request pins weights this replica does not serve; the body names both versions"),
        (
            413,
            "Over a size limit of the server (body, rows or tokens per request, or a sequence that "
            "does not fit in accelerator memory); the message names it",
        ),
        (422, "Invalid request; `field` and `row` name the culprit"),
        (429, "The queue is full; retry after the `Retry-After` header's seconds"),
        (500, "Scoring failed"),
        (503, "Model not loaded, warming up, or draining"),
        (504, "The request's deadline passed; its unscored work was dropped"),
    ]
}


BINARY = {"type": "string", "format": "binary"}
THREAD_BYTES = 1 << 20  # bodies from this size are parsed (JSON) and normalised on a worker thread
FRAME_DOC = (
    "The same request as a compact frame: the JSON fields, with input_ids, prompt_ids, attention_mask, "
    "action_mask, rollout_logprobs, routed_experts and prompt_routed_experts as little-endian arrays "
    "(docs/api.md, 'Compact frames'). Send "
    f"`Accept: {MEDIA_TYPE}` to get the answer in the same form."
)


def _media_type(header: str | None) -> str:
    return (header or "").split(";", 1)[0].strip().lower()


async def _parsed(raw: bytes, framed: bool) -> LogprobsRequest:
    """The request of a body: a frame's views at once; JSON on a worker thread from THREAD_BYTES."""
    if framed:
        return parse_frame(raw)
    return await asyncio.to_thread(parse_json, raw) if len(raw) >= THREAD_BYTES else parse_json(raw)


async def _planned(request: LogprobsRequest, limits: ModelLimits, size: int) -> ScoringPlan:
    """The request's plan; on a worker thread from THREAD_BYTES (its routes' checks, numpy, take
    ~2 ms a 14 MB body: off the event loop, and in parallel for requests that arrive together)."""
    if size >= THREAD_BYTES:
        return await asyncio.to_thread(normalise, request, limits)
    return normalise(request, limits)


async def _json(answered: dict[str, Any], plan: ScoringPlan) -> list[bytes]:
    """The JSON answer in the request's forms, in parts (layout.json_parts); on a worker thread where
    it carries routes or a distribution's blocks."""
    write = functools.partial(
        json_parts, answered, routes=plan.route_format, distribution=plan.distribution_format
    )
    job = plan.jobs[0]
    big = job.return_routes or job.top_logprobs or any(j.candidate_ids is not None for j in plan.jobs)
    return await asyncio.to_thread(write) if big else write()


def _statistics(
    plan: ScoringPlan, scores: list[SequenceScores], metrics: Metrics
) -> tuple[RolloutMismatch | None, RouteAgreementSummary | None]:
    """The answer's rollout statistics and route agreement, observed in the metrics."""
    processed = [p for s in scores if (p := s.processed_logprobs) is not None]
    sampled = plan.jobs[0].sampling is not None
    rollout = rollout_statistics([s.logprobs for s in scores], plan.rollout, processed if sampled else None)
    if rollout is not None:
        metrics.observe_rollout(rollout)
    agreement = route_agreement(scores)
    metrics.observe_route_agreement(agreement)
    return rollout, agreement


def build_router(state: ServiceState) -> APIRouter:
    metrics, settings = state.metrics, state.settings
    keys = ApiKeys.from_settings(settings)
    bearer = HTTPBearer(auto_error=False, description="An API key, when the server is configured with some.")

    async def authorized(
        http: Request,
        _: HTTPAuthorizationCredentials | None = Depends(bearer),  # noqa: B008 (documents the scheme)
    ) -> None:
        keys.check(http.headers.get("authorization"))

    guarded = [Depends(authorized)] if keys.enabled else []
    router = APIRouter(dependencies=guarded if settings.auth_all_routes else [])

    # the body is parsed from raw bytes (jsonrows.parse_json: its rows of integers straight into numpy,
    # the rest by the same pydantic fields), so it is declared here
    body_schema = {
        "application/json": {"schema": LogprobsRequest.model_json_schema()},
        MEDIA_TYPE: {"schema": {**BINARY, "description": FRAME_DOC}},
    }

    @router.post(
        "/logprobs",
        response_model=LogprobsResponse,
        responses={
            200: {"content": {MEDIA_TYPE: {"schema": BINARY}}},
            **ERRORS,
        },
        openapi_extra={"requestBody": {"required": True, "content": body_schema}},
        dependencies=guarded,
    )
    async def logprobs(http: Request) -> Response:
        """Per-token log-probs (and entropy) of the action tokens of each row."""
        started = time.perf_counter()
        raw = await read_body(http, settings.max_body_bytes)
        framed = _media_type(http.headers.get("content-type")) == MEDIA_TYPE
        request = await _parsed(raw, framed)
        serving = state.require_serving()
        plan = await _planned(request, serving.limits, len(raw))
        metrics.queue_requests.inc()
        try:
            timeout = request.timeout_s or settings.request_timeout_s
            scored = await answer_or_give_up(http, serving.batcher.submit(plan.jobs, plan.pins), timeout)
        finally:
            metrics.queue_requests.dec()
        scores = scored.scores
        rollout, agreement = _statistics(plan, scores, metrics)
        answered = answer(
            plan,
            scores,
            serving.info,
            scored.versions,
            rollout,
            computed_tokens=scored.computed_tokens,
            cached_tokens=scored.cached_tokens,
            agreement=agreement,
        )
        media_type = MEDIA_TYPE if MEDIA_TYPE in http.headers.get("accept", "") else "application/json"
        parts = [to_frame(answered)] if media_type == MEDIA_TYPE else await _json(answered, plan)
        metrics.requests.labels("ok").inc()
        metrics.input_tokens.inc(plan.input_tokens)
        metrics.scored_tokens.inc(plan.scored_tokens)
        metrics.request_seconds.observe(time.perf_counter() - started)
        if sum(len(part) for part in parts) > SLICE_BYTES:
            return SlicedResponse(parts, media_type)
        return Response(b"".join(parts), media_type=media_type)

    @router.get("/health/live", response_model=Health)
    async def live() -> Health:
        """200 while the process is up."""
        return Health(status="alive")

    @router.get("/health/ready", response_model=Health, responses={503: {"model": Health}})
    @router.get("/health", response_model=Health, responses={503: {"model": Health}})  # vLLM's path (TRL)
    async def ready() -> Response:
        """200 once the model is loaded and a warm-up forward has run; 503 before and while draining.
        Also at /health, vLLM's path, which TRL's VLLMClient polls."""
        phase = state.phase
        return JSONResponse({"status": phase}, status_code=200 if phase == "ready" else 503)

    @router.get("/info", response_model=Info, responses={503: {"model": ErrorBody}})
    async def info() -> Info:
        """The model being served and how."""
        if state.serving is None:
            raise NotReady(f"no model loaded yet (state: {state.phase})")
        i = state.serving.info
        return Info(
            model=i.model,
            demo=i.demo,
            architecture=i.architecture,
            dtype=i.dtype,
            device=i.device,
            attention_backend=i.attention_backend,
            decoder=i.decoder,
            kernels=i.kernels,
            moe_kernel=i.moe_kernel,
            head_kernel=i.head_kernel,
            vocab_size=i.vocab_size,
            max_positions=i.max_positions,
            max_sequence_tokens=i.max_sequence_tokens or i.max_positions,
            max_sequence_limit=i.max_sequence_limit,
            max_batch_tokens=i.max_batch_tokens,
            batch_invariant=i.batch_invariant,
            gemm=i.gemm,
            share_prefixes=sharing(state.settings) is not None,
            share_min_tokens=state.settings.share_min_tokens,
            prefix_cache_tokens=i.prefix_cache_tokens if state.settings.prefix_cache else 0,
            tensor_parallel_size=i.tensor_parallel_size,
            versions=i.versions,
            models=[ModelSummary(**dataclasses.asdict(m)) for m in i.models],
            weights_version=state.serving.reloader.weights["policy"].version,
            weights=state.serving.reloader.serving(),
        )

    @router.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE: {}}}})
    async def prometheus() -> Response:
        """Prometheus metrics."""
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    router.include_router(build_admin_router(state, bearer))
    router.include_router(build_weight_sync_router(state, bearer))
    router.include_router(build_completions_router(state, guarded, ERRORS))
    return router
