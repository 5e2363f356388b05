"""Run the app under uvicorn on the socket service/http/listen.py bound; drain on SIGTERM; exit non-zero
if the model failed to load.

One log format for every line, uvicorn's and logprobd's (LOG_FORMAT). The start is two lines apart:
`listening on <url>` as soon as the port is served (requests answer 503 `not_ready` meanwhile), and
`ready: ...` once the model is loaded and warmed up, naming the URL to send requests to.

Draining, for rolling updates behind a load balancer: on SIGTERM the service reports `draining`
(`/health/ready` and new scoring requests answer 503) for `drain_seconds` while the port stays open
and in-flight requests go on, so load balancers and the Kubernetes endpoints controller stop routing
here; then uvicorn's graceful shutdown closes the port, waits up to GRACEFUL_SHUTDOWN_S for what
is still in flight, and the process exits 0.
"""

from __future__ import annotations

import logging
import signal
import socket
import time
from types import FrameType

import uvicorn

from service.core import heap
from service.http.app import create_app
from service.http.listen import Listener
from service.http.state import ServiceState
from service.metrics import Metrics
from service.settings import Settings

log = logging.getLogger(__name__)

# after the drain: how long uvicorn waits for in-flight requests before cancelling them
GRACEFUL_SHUTDOWN_S = 30
# how long an idle kept-alive connection stays open (uvicorn's default); the weight push's client drops
# its idle ones sooner (service/client/_fleet.py: KEEPALIVE_EXPIRY_S), so that it never reuses one the
# server is closing (the scoring transport sends again when a reused one turns out closed)
KEEP_ALIVE_S = 5
# every line, uvicorn's (start, access, shutdown) and the service's: time, level, logger, message
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose SIGTERM starts a drain instead of an immediate shutdown.

    SIGTERM is handled here, not re-raised after shutdown as uvicorn does, so a drained process
    exits 0. A second SIGTERM ends the drain at once. SIGINT (Ctrl-C) shuts down at once, without a
    drain, and exits 0 (uvicorn's re-raised SIGINT ended in a KeyboardInterrupt traceback); a second
    one cancels what is still in flight.
    """

    def __init__(self, config: uvicorn.Config, state: ServiceState, drain_seconds: float) -> None:
        super().__init__(config)
        self._state = state
        self._drain_seconds = drain_seconds
        self._drain_until: float | None = None
        self._drain_logged = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGINT:
            self.force_exit = self.should_exit
            self.should_exit = True
        elif sig != signal.SIGTERM:
            super().handle_exit(sig, frame)
        elif self._drain_until is not None or self._state.serving is None:
            self.should_exit = True  # second SIGTERM, or never ready: nothing to drain
        else:
            self._state.draining = True  # readiness and new scoring requests: 503 from now on
            self._drain_until = time.monotonic() + self._drain_seconds

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:  # in place of uvicorn's `Uvicorn running on`: the port is served, not the model
            log.info(
                "listening on %s (loading the model: requests answer 503 not_ready until the ready line)",
                self._state.url,
            )

    async def on_tick(self, counter: int) -> bool:
        # runs every 0.1 s on the event loop; logging here, not in the signal handler
        if self._drain_until is not None:
            if not self._drain_logged:
                self._drain_logged = True
                log.info("SIGTERM: draining for %.1f s, then shutting down", self._drain_seconds)
            if time.monotonic() >= self._drain_until:
                self.should_exit = True
        return await super().on_tick(counter)


def serve(settings: Settings, listener: Listener) -> int:
    """Serve on `listener` until shut down; the exit status: 1 if the model failed to load, else 0."""
    logging.basicConfig(level=settings.log_level.upper(), format=LOG_FORMAT)
    failed = False

    def on_fatal() -> None:
        nonlocal failed
        failed = True
        server.should_exit = True

    state = ServiceState(settings=settings, metrics=Metrics(), url=listener.url)
    app = create_app(settings, on_fatal=on_fatal, state=state)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,  # uvicorn's loggers go to the root logger: LOG_FORMAT
        log_level=settings.log_level,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        timeout_keep_alive=KEEP_ALIVE_S,
    )
    server = DrainingServer(config, state, settings.drain_seconds)
    server.run(sockets=[listener.socket])
    heap.exiting()
    return 1 if failed else 0
