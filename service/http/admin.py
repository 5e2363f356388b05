"""The admin routes: hot weight reload (POST /admin/weights) and its report, and SGLang's GET or POST
/flush_cache (the prefix cache emptied). Admin keys only."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from service.core.errors import EngineFailure, Forbidden, WeightsRefused
from service.http.auth import ApiKeys
from service.http.bodies import read_body
from service.http.state import ServiceState
from service.wire.schemas import ErrorBody, ReloadStatus, WeightsReport, WeightsUpdate, parse_body

MAX_BODY_BYTES = 64 << 10
# SGLang's answer to /flush_cache, word for word (its clients check it)
FLUSHED = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)
ADMIN_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorBody, "description": text}
    for status, text in [
        (401, "No valid admin key"),
        (403, "The admin routes (weight reload, flush_cache) are off: the server has no admin key"),
        (409, "Another reload is under way"),
        (413, "Body over 64 KiB"),
        (
            422,
            "Invalid request, or the checkpoint was refused (another architecture or shape, unreadable, "
            "non-finite); the old weights keep serving",
        ),
        (500, "The weights could not be applied"),
        (503, "Model not loaded yet, or draining"),
    ]
}


def build_admin_router(state: ServiceState, bearer: HTTPBearer) -> APIRouter:
    keys = ApiKeys.admin(state.settings)

    async def admin(
        http: Request,
        _: HTTPAuthorizationCredentials | None = Depends(bearer),  # noqa: B008 (documents the scheme)
    ) -> None:
        if not keys.enabled:
            raise Forbidden(
                "the admin routes (weight reload, flush_cache) are off: start the server with an admin key "
                "(LOGPROBD_ADMIN_API_KEYS or "
                "--admin-api-keys-file)"
            )
        keys.check(http.headers.get("authorization"))

    router = APIRouter(dependencies=[Depends(admin)])

    body_schema = {"application/json": {"schema": WeightsUpdate.model_json_schema()}}

    @router.post(
        "/admin/weights",
        response_model=ReloadStatus,
        responses={
            202: {"model": ReloadStatus, "description": "Reload started (wait=false)"},
            **ADMIN_ERRORS,
        },
        openapi_extra={"requestBody": {"required": True, "content": body_schema}},
    )
    async def reload_weights(http: Request) -> Response:
        """Serve new weights without a restart: read and check them in the background, then swap
        between micro-batches. Requests in flight finish on the weights they started on."""
        update = parse_body(WeightsUpdate, await read_body(http, MAX_BODY_BYTES))
        reloader = state.require_serving().reloader
        reload = reloader.begin(update)
        if not update.wait:
            return JSONResponse(reloader.reloads[update.target].model_dump(), status_code=202)
        status = await asyncio.shield(reload)  # a client that hangs up does not stop the reload
        if status.state == "rejected":
            raise WeightsRefused(
                f"checkpoint refused, the old weights still serve: {status.error}", field="path"
            )
        if status.state == "failed":
            raise EngineFailure(f"reload failed: {status.error}")
        return JSONResponse(status.model_dump())

    @router.get("/admin/weights", response_model=WeightsReport, responses=ADMIN_ERRORS)
    async def weights_report() -> WeightsReport:
        """What every model serves, and the latest reload of each."""
        reloader = state.require_serving().reloader
        return WeightsReport(weights=reloader.serving(), reloads=reloader.reloads)

    text = {"text/plain": {"schema": {"type": "string", "example": FLUSHED}}}
    flushed = {200: {"content": text, "description": "The cache is empty (SGLang's answer)"}, **ADMIN_ERRORS}

    @router.post("/flush_cache", response_class=Response, responses=flushed)
    async def flush_cache() -> PlainTextResponse:
        """Empty the prefix cache of every model (SGLang's route and answer; also GET). Micro-batches
        already planned finish on what they read; every later one reads only what is computed from
        now on."""
        state.require_serving().batcher.flush_cache()
        return PlainTextResponse(FLUSHED)

    router.add_api_route(
        "/flush_cache",
        flush_cache,
        methods=["GET"],
        response_class=Response,
        responses=flushed,
        operation_id="flush_cache_get",
        summary="Flush Cache (GET)",
    )

    return router
