"""SGLang's weight-push routes, so that a trainer that pushes weights to SGLang servers (slime, AReaL,
miles) pushes them to logprobd as they are: the group (init, destroy), the buckets, the versions, and
the routes such trainers call around a push (pause/continue, flush_cache, server_info). Admin keys
only: a trainer sends `Authorization: Bearer <admin key>`. Answers are SGLang's: 200 with
{"success": true, "message"}, 400 (409: a conflict) with {"success": false, "message"}.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import PlainTextResponse
from fastapi.security import HTTPBearer
from pydantic import BaseModel

from service.http.auth import admin_only
from service.http.bodies import read_body
from service.http.state import ServiceState
from service.weights.push import Pusher
from service.wire.schemas import ErrorBody
from service.wire.weight_sync import (
    ContinueGeneration,
    DestroyGroup,
    GenerationAnswer,
    InitGroup,
    PauseGeneration,
    UpdateWeights,
    UpdateWeightVersion,
    VersionAnswer,
    WeightSyncAnswer,
    WeightVersion,
    parse,
)

MAX_BODY_BYTES = 32 << 20  # a bucket's metadata: names, dtypes and shapes of thousands of tensors
# SGLang's answer to /flush_cache, word for word (its clients check it)
FLUSHED = (
    "Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting "
    "requests, the operation will not be performed.)\n"
)
ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": WeightSyncAnswer, "description": "Failed: SGLang's answer (or its error object)"},
    401: {"model": ErrorBody, "description": "No valid admin key"},
    403: {"model": ErrorBody, "description": "Weight push is off: the server has no admin key"},
    409: {
        "model": WeightSyncAnswer,
        "description": "weight_push_max_groups groups are open, another group's version is pending, or a "
        "checkpoint reload runs (a push waits for it)",
    },
    413: {"model": ErrorBody, "description": "Body over 32 MiB"},
    503: {"model": ErrorBody, "description": "Model not loaded yet, or draining"},
}


def _body(model: type[BaseModel], required: bool = True) -> dict[str, Any]:
    content = {"application/json": {"schema": model.model_json_schema()}}
    return {"requestBody": {"required": required, "content": content}}


def build_weight_sync_router(state: ServiceState, bearer: HTTPBearer) -> APIRouter:
    admin = admin_only(state.settings, bearer, "weight push")
    router = APIRouter(dependencies=[Depends(admin)], tags=["weight push (SGLang's protocol)"])

    def pusher() -> Pusher:
        serving = state.require_serving()
        assert serving.pusher is not None
        return serving.pusher

    async def body(http: Request) -> bytes:
        return await read_body(http, MAX_BODY_BYTES)

    @router.post(
        "/init_weights_update_group",
        response_model=WeightSyncAnswer,
        responses=ERRORS,
        openapi_extra=_body(InitGroup),
    )
    async def init_group(http: Request) -> WeightSyncAnswer:
        """Join the trainer's weight-update group: answers once the rendezvous is done (the trainer,
        rank 0, hosts its store at master_address:master_port; this server is rank_offset)."""
        order = parse(InitGroup, await body(http))
        return WeightSyncAnswer(success=True, message=await pusher().init_group(order))

    @router.post(
        "/update_weights_from_distributed",
        response_model=WeightSyncAnswer,
        responses=ERRORS,
        openapi_extra=_body(UpdateWeights),
    )
    async def update(http: Request) -> WeightSyncAnswer:
        """Receive one bucket the trainer broadcasts: answers once it arrived and is staged, and, when
        it completes its version, once that version serves."""
        order = parse(UpdateWeights, await body(http))
        return WeightSyncAnswer(success=True, message=await pusher().update(order))

    @router.post(
        "/destroy_weights_update_group",
        response_model=WeightSyncAnswer,
        responses=ERRORS,
        openapi_extra=_body(DestroyGroup, required=False),
    )
    async def destroy(http: Request) -> WeightSyncAnswer:
        """Leave the group; a version it left pending is dropped."""
        order = parse(DestroyGroup, await body(http))
        return WeightSyncAnswer(success=True, message=await pusher().destroy_group(order.group_name))

    @router.get("/get_weight_version", response_model=WeightVersion, responses=ERRORS)
    @router.get("/weight_version", response_model=WeightVersion, responses=ERRORS)
    async def weight_version() -> WeightVersion:
        """The policy weights' version."""
        return WeightVersion(weight_version=pusher().version())

    @router.post(
        "/update_weight_version",
        response_model=VersionAnswer,
        responses=ERRORS,
        openapi_extra=_body(UpdateWeightVersion),
    )
    async def update_weight_version(http: Request) -> VersionAnswer:
        """Name the weights `new_version`: a pending push (which then serves), else those served."""
        order = parse(UpdateWeightVersion, await body(http))
        version = await pusher().relabel(order.target, order.new_version)
        return VersionAnswer(
            success=True, message=f"Weight version updated to {version}", new_version=version
        )

    text: dict[int | str, dict[str, Any]] = {
        200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "SGLang's text"}
    }

    @router.get("/flush_cache", responses={**text, **ERRORS})
    @router.post("/flush_cache", responses={**text, **ERRORS})
    async def flush_cache() -> PlainTextResponse:
        """Empty the prefix cache of every model (SGLang's answer). Micro-batches already planned
        finish on what they read; every later one reads only what is computed from now on."""
        state.require_serving().batcher.flush_cache()
        return PlainTextResponse(FLUSHED)

    @router.post(
        "/pause_generation",
        response_model=GenerationAnswer,
        responses=ERRORS,
        openapi_extra=_body(PauseGeneration, required=False),
    )
    async def pause(http: Request) -> GenerationAnswer:
        """Accepted: scoring goes on; requests finish on the weights they started on."""
        parse(PauseGeneration, await body(http))
        pusher()
        return GenerationAnswer(message="Generation paused successfully.", status="ok")

    @router.post(
        "/continue_generation",
        response_model=GenerationAnswer,
        responses=ERRORS,
        openapi_extra=_body(ContinueGeneration, required=False),
    )
    async def resume(http: Request) -> GenerationAnswer:
        """The trainer's push is over: a version still pending serves as it stands."""
        parse(ContinueGeneration, await body(http))
        await pusher().commit_all("continue_generation")
        return GenerationAnswer(message="Generation continued successfully.", status="ok")

    @router.post("/begin_weight_update", response_model=WeightSyncAnswer, responses=ERRORS)
    async def begin_update(http: Request) -> WeightSyncAnswer:
        """Accepted (SGLang 0.5.23's session); never required."""
        await body(http)
        pusher()
        return WeightSyncAnswer(success=True, message="Weight update began.")

    @router.post("/end_weight_update", response_model=WeightSyncAnswer, responses=ERRORS)
    async def end_update(http: Request) -> WeightSyncAnswer:
        """The trainer's push is over: a version still pending serves as it stands."""
        await body(http)
        served = await pusher().commit_all("end_weight_update")
        return WeightSyncAnswer(
            success=True, message=f"Weight update ended; serving {served or 'as before'}."
        )

    @router.get("/server_info", responses=ERRORS)
    @router.get("/get_server_info", responses=ERRORS)
    async def server_info() -> dict[str, Any]:
        """What SGLang's clients read of a server: its parallel sizes (this replica's tensor-parallel
        size; no pipeline, data or expert parallel), its dtype and weights version."""
        info = state.require_serving().info
        tp = info.tensor_parallel_size
        return {
            "tp_size": tp,
            "pp_size": 1,
            "dp_size": 1,
            "ep_size": 1,
            "moe_dp_size": 1,
            "num_gpus": tp,
            "enable_memory_saver": False,
            "disaggregation_mode": "null",
            "encoder_only": False,
            "enable_return_routed_experts": info.moe is not None,
            "dtype": info.dtype,
            "model_path": _model_path(state),
            "served_model_name": info.model,
            "weight_version": pusher().version(),
        }

    @router.get("/model_info", responses=ERRORS)
    @router.get("/get_model_info", responses=ERRORS)
    async def model_info() -> dict[str, Any]:
        info = state.require_serving().info
        return {
            "model_path": _model_path(state),
            "tokenizer_path": _model_path(state),
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": pusher().version(),
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "architectures": [info.architecture],
        }

    return router


def _model_path(state: ServiceState) -> str:
    return (
        str(state.settings.model) if state.settings.model is not None else state.require_serving().info.model
    )
