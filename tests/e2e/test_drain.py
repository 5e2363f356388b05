"""SIGTERM drains: readiness and new requests answer 503 `draining` while in-flight requests finish
with 200, then the process exits 0. Through a real `python -m service serve` on loopback."""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import uvicorn

from service.http.app import create_app
from service.http.server import DrainingServer
from service.http.state import ServiceState
from service.metrics import Metrics
from service.settings import Settings
from tests.support.fakes import FakeEngine

DRAIN_S = 3.0


@pytest.fixture
def serving_process() -> Iterator[tuple[subprocess.Popen[str], str]]:
    """The demo model on cpu; port 0, so the URL is read from the start-up log's `listening on` line."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "service", "serve", "--port", "0", "--device", "cpu",
         "--max-batch-tokens", "2048", "--batch-wait-ms", "0", "--drain-seconds", str(DRAIN_S)],
        stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    assert proc.stderr is not None
    url: list[str] = []
    found = threading.Event()

    def read() -> None:  # keeps the pipe drained for the whole run
        for line in proc.stderr or ():
            if match := re.search(r"listening on (http://\S+)", line):
                url.append(match.group(1))
                found.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert found.wait(120), "the server did not start"
        base = url[0]
        deadline = time.monotonic() + 120
        while httpx.get(f"{base}/health/ready").status_code != 200:
            assert time.monotonic() < deadline, "the server did not become ready"
            time.sleep(0.05)
        yield proc, base
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)
        reader.join(10)
        proc.stderr.close()


def test_sigterm_drains_in_flight_requests_then_exits_zero(
    serving_process: tuple[subprocess.Popen[str], str],
) -> None:
    proc, base = serving_process
    rng = random.Random(5)
    # each request: 16 sequences of 1000 tokens, about 0.7 s of cpu forward; 4 of them queue up
    body = {"input_ids": [[rng.randrange(1024) for _ in range(1000)] for _ in range(16)], "num_actions": 8}

    def score() -> tuple[int, float]:
        r = httpx.post(f"{base}/logprobs", json=body, timeout=120)
        return r.status_code, time.monotonic()

    with ThreadPoolExecutor(max_workers=4) as pool:
        in_flight = [pool.submit(score) for _ in range(4)]
        deadline = time.monotonic() + 30
        while "logprobd_queue_requests 4.0" not in httpx.get(f"{base}/metrics").text:
            assert time.monotonic() < deadline, "the requests never reached the queue"
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        terminated = time.monotonic()

        # the port stays open during the drain; the signal handler runs at once, but in the server's
        # main thread, so allow it a moment
        ready = httpx.get(f"{base}/health/ready")
        while ready.status_code == 200 and time.monotonic() - terminated < 1:
            ready = httpx.get(f"{base}/health/ready")
        assert ready.status_code == 503
        assert ready.json() == {"status": "draining"}
        late = httpx.post(f"{base}/logprobs", json={"input_ids": [[1, 2, 3]], "num_actions": 1})
        assert late.status_code == 503
        assert late.json()["error"]["type"] == "not_ready"
        assert httpx.get(f"{base}/health/live").status_code == 200
        results = [f.result(timeout=120) for f in in_flight]

    assert [status for status, _ in results] == [200] * 4
    assert max(done for _, done in results) > terminated  # some were still running at SIGTERM
    assert proc.wait(timeout=60) == 0
    assert time.monotonic() - terminated >= DRAIN_S - 0.5  # it waited out the drain


def test_sigterm_before_ready_exits_without_draining() -> None:
    state = ServiceState(settings=Settings(), metrics=Metrics())
    server = DrainingServer(uvicorn.Config(create_app(Settings(), state=state)), state, drain_seconds=60)
    server.handle_exit(signal.SIGTERM, None)
    assert server.should_exit
    assert not state.draining


def test_a_second_sigterm_ends_the_drain() -> None:
    state = ServiceState(settings=Settings(), metrics=Metrics())
    app = create_app(Settings(), engine_factory=lambda _: FakeEngine(), state=state)
    server = DrainingServer(uvicorn.Config(app), state, drain_seconds=60)

    async def scenario() -> None:
        async with app.router.lifespan_context(app):
            while state.serving is None:
                await asyncio.sleep(0.01)
            server.handle_exit(signal.SIGTERM, None)
            assert state.draining
            assert state.phase == "draining"
            assert not await server.on_tick(1)  # still draining: 60 s to go
            server.handle_exit(signal.SIGTERM, None)
            assert await server.on_tick(2)

    asyncio.run(scenario())
