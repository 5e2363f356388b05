"""The admin routes: hot weight reload (POST /admin/weights) and its report. Admin keys only."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPBearer

from service.core.errors import EngineFailure, WeightsRefused
from service.http.auth import admin_only
from service.http.bodies import read_body
from service.http.state import ServiceState
from service.wire.schemas import ErrorBody, ReloadStatus, WeightsReport, WeightsUpdate, parse_body

MAX_BODY_BYTES = 64 << 10
ADMIN_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorBody, "description": text}
    for status, text in [
        (401, "No valid admin key"),
        (403, "Weight reload is off: the server has no admin key"),
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
    admin = admin_only(state.settings, bearer, "weight reload")
    router = APIRouter(prefix="/admin", dependencies=[Depends(admin)])

    body_schema = {"application/json": {"schema": WeightsUpdate.model_json_schema()}}

    @router.post(
        "/weights",
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

    @router.get("/weights", response_model=WeightsReport, responses=ADMIN_ERRORS)
    async def weights_report() -> WeightsReport:
        """What every model serves, and the latest reload of each."""
        reloader = state.require_serving().reloader
        return WeightsReport(weights=reloader.serving(), reloads=reloader.reloads)

    return router
