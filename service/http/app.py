"""create_app(settings): the FastAPI app. Its lifespan loads the model in the background, warms it
up, then starts the batcher; until then /health/ready says 503 and /health/live says 200."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

import service
from service.batcher import Batcher
from service.core import heap
from service.core.errors import ServiceError, from_pydantic, from_routing, status_for
from service.engine import EngineInfo, ScoringEngine, Supervised, load_engine
from service.engine.config import EngineConfig
from service.engine.tokenizer import load_token_text
from service.http.router import build_router
from service.http.state import ServiceState, Serving
from service.metrics import Metrics
from service.normalise import ModelLimits
from service.settings import Settings
from service.weights.follow import follow_version_file
from service.weights.gate import UpdateGate
from service.weights.push import Pusher
from service.weights.updates import Reloader
from service.wire import jsonrows

log = logging.getLogger(__name__)

EngineFactory = Callable[[EngineConfig], ScoringEngine]

# what a 413 `sequence_too_large` names as setting the longest sequence (the engine's
# max_sequence_limit: positions | memory | setting)
LIMITED_BY = {
    "positions": "the model's positions",
    "memory": "the accelerator's memory for its keys and values",
    "setting": "--max-sequence-tokens",
}


def create_app(
    settings: Settings,
    *,
    engine_factory: EngineFactory = load_engine,
    on_fatal: Callable[[], None] | None = None,
    state: ServiceState | None = None,
) -> FastAPI:
    """Build the app; nothing is loaded until it starts. `on_fatal` runs if the model fails to load.
    `state` is what the routes share (a fresh one by default); the server passes its own to drain."""
    if state is None:
        state = ServiceState(settings=settings, metrics=Metrics())

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        starting = asyncio.create_task(_start(state, engine_factory, on_fatal))
        try:
            yield
        finally:
            state.draining = True
            starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
            if state.serving is not None:
                if state.serving.follower is not None:
                    state.serving.follower.cancel()
                    await asyncio.gather(state.serving.follower, return_exceptions=True)
                await state.serving.reloader.stop()
                if state.serving.pusher is not None:
                    await state.serving.pusher.stop()
                await state.serving.batcher.stop()
                if state.serving.supervised is not None:
                    await asyncio.to_thread(state.serving.supervised.close)
                heap.thaw()

    app = FastAPI(
        title="logprobd",
        version=service.__version__,
        description="Per-token log-probs of action tokens for RL trainers, from one packed forward.",
        lifespan=lifespan,
        docs_url="/docs" if settings.docs_ui else None,  # both fetch their assets from CDNs
        redoc_url="/redoc" if settings.docs_ui else None,
    )
    app.include_router(build_router(state))
    _install_error_handlers(app, state)
    return app


async def _start(
    state: ServiceState, engine_factory: EngineFactory, on_fatal: Callable[[], None] | None
) -> None:
    settings = state.settings
    supervised: Supervised | None = None
    try:
        engine = await asyncio.to_thread(engine_factory, settings.engine_config())
        if isinstance(engine, Supervised):  # its processes fail together, from now on
            supervised = engine
            loop = asyncio.get_running_loop()

            def failed(reason: str) -> None:  # called on the engine's watchdog thread
                loop.call_soon_threadsafe(_engine_failed, state, reason, on_fatal)

            engine.supervise(failed)
        await asyncio.to_thread(engine.warm_up)
        token_text = await asyncio.to_thread(load_token_text, settings.model, engine.info.vocab_size)
    except Exception as exc:  # reported and fatal: the process must not serve half-ready
        if supervised is not None:
            await asyncio.to_thread(supervised.close)
        state.failure = f"{type(exc).__name__}: {exc}"
        log.critical("model failed to load: %s", state.failure, exc_info=exc)
        if on_fatal is not None:
            on_fatal()
        return
    info = engine.info
    batcher = Batcher.from_settings(engine, settings, state.metrics)
    batcher.start()
    limits = ModelLimits(
        vocab_size=info.vocab_size,
        max_sequence_tokens=info.max_sequence_tokens or info.max_positions,
        max_positions=info.max_positions,
        max_sequence_limit=LIMITED_BY.get(info.max_sequence_limit, info.max_sequence_limit),
        has_critic="critic" in info.roles,
        has_reference="reference" in info.roles,
        max_request_sequences=settings.max_request_sequences,
        max_request_tokens=settings.max_request_tokens,
        max_top_logprobs=settings.max_top_logprobs,
        max_timeout_s=settings.max_request_timeout_s,
        moe=info.moe,
    )
    gate = UpdateGate()  # a reload and a push exclude each other
    reloader = Reloader(engine, batcher, state.metrics, settings, gate)
    pusher = Pusher(engine, batcher, state.metrics, settings, gate)
    follower = None
    if settings.weights_follow is not None:
        follow = follow_version_file(reloader, settings.weights_follow, settings.weights_follow_interval_s)
        follower = asyncio.create_task(follow, name="logprobd-follow")
    state.serving = Serving(
        info=info,
        limits=limits,
        batcher=batcher,
        reloader=reloader,
        follower=follower,
        supervised=supervised,
        token_text=token_text,
        pusher=pusher,
    )
    frozen = heap.freeze()  # what lives until exit stays out of the full collections while serving
    log.debug("%d objects kept out of the full collections (%.2f s)", frozen.objects, frozen.seconds)
    jsonrows.native()  # where the native reader was not built, its warning comes now, not on a request
    state.metrics.ready.set(1)
    state.metrics.model_info.info(
        {"model": info.model, "architecture": info.architecture, "dtype": info.dtype, "demo": str(info.demo)}
    )
    log.info("%s", ready_line(info, state.url))


def ready_line(info: EngineInfo, url: str | None) -> str:
    """The start-up log's last line: what serves, and where to send requests (when known)."""
    demo = " [DEMO: random weights]" if info.demo else ""
    line = (
        f"ready: {info.model}{demo} ({info.architecture}) on {info.device}, {info.dtype}, "
        f"attention={info.attention_backend}"
    )
    return line if url is None else f"{line}; send requests to {url} (POST /logprobs, docs/api.md)"


def _engine_failed(state: ServiceState, reason: str, on_fatal: Callable[[], None] | None) -> None:
    """A process of the engine died (tensor parallel): fail readiness and stop the server (exit 1)."""
    state.failure = f"engine failed: {reason}"
    state.metrics.ready.set(0)
    log.critical("%s", state.failure)
    if on_fatal is not None:
        on_fatal()


def _install_error_handlers(app: FastAPI, state: ServiceState) -> None:
    def reply(error: ServiceError) -> JSONResponse:
        state.metrics.requests.labels(error.kind).inc()
        return JSONResponse(error.body(), status_code=status_for(error), headers=error.headers())

    async def on_service_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ServiceError)
        return reply(exc)

    async def on_validation_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return reply(from_pydantic(exc.errors()))

    async def on_http_error(request: Request, exc: Exception) -> Response:
        """The router's 404 and 405 in the error shape (not counted: no scoring request was made)."""
        assert isinstance(exc, HTTPException)
        allow = (exc.headers or {}).get("Allow") or (exc.headers or {}).get("allow")
        error = from_routing(exc.status_code, request.method, request.url.path, allow)
        if error is None:
            return await http_exception_handler(request, exc)
        return JSONResponse(error.body(), status_code=status_for(error), headers=error.headers())

    app.add_exception_handler(ServiceError, on_service_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(HTTPException, on_http_error)
