"""Run the app under uvicorn; exit non-zero if the model failed to load."""

from __future__ import annotations

import logging

import uvicorn

from service.app import create_app
from service.settings import Settings


def serve(settings: Settings) -> int:
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    failed = False

    def on_fatal() -> None:
        nonlocal failed
        failed = True
        server.should_exit = True

    app = create_app(settings, on_fatal=on_fatal)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        timeout_graceful_shutdown=30,
    )
    server = uvicorn.Server(config)
    server.run()
    return 1 if failed else 0
