"""Real logprobd servers on loopback (uvicorn in a thread) for the client tests, and scripted faults.

Servers are session-scoped: a qwen2 pair (two replicas of one checkpoint, for sharding), a gemma2
one (final-logit soft-capping) and a qwen2 one that wants an API key, all on the tiny checkpoints
of tests/models.py.
"""

from __future__ import annotations

import re
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from service.app import create_app
from tests.conftest import settings_for


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextmanager
def serving(model: Path, **settings: Any) -> Iterator[str]:
    """A real logprobd on a free loopback port, ready; yields its base URL."""
    port = free_port()
    app = create_app(settings_for(model, **settings))
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            ready = httpx.get(f"{url}/health/ready")
        except httpx.TransportError:
            pass
        else:
            if ready.status_code == 200:
                break
            if ready.json().get("status") == "failed":
                raise RuntimeError(f"the server of {model.name} failed to start (see the captured log)")
        if time.monotonic() > deadline:
            raise TimeoutError("server did not become ready")
        time.sleep(0.05)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@pytest.fixture(scope="session")
def qwen2_replicas(model_dirs: dict[str, Path]) -> Iterator[tuple[str, str]]:
    with serving(model_dirs["qwen2"]) as a, serving(model_dirs["qwen2"]) as b:
        yield a, b


@pytest.fixture(scope="session")
def gemma2_server(model_dirs: dict[str, Path]) -> Iterator[str]:
    with serving(model_dirs["gemma2"]) as url:
        yield url


@pytest.fixture(scope="session")
def servers(qwen2_replicas: tuple[str, str], gemma2_server: str) -> dict[str, str]:
    """Architecture -> the base URL of a server of it."""
    return {"qwen2": qwen2_replicas[0], "gemma2": gemma2_server}


@pytest.fixture(scope="session")
def keyed_server(model_dirs: dict[str, Path]) -> Iterator[str]:
    """A qwen2 server that wants `Authorization: Bearer sk-client-test` on its scoring route."""
    with serving(model_dirs["qwen2"], api_keys="sk-client-test") as url:
        yield url


@pytest.fixture
def dead_url() -> str:
    """A loopback URL where nothing listens: every connection is refused."""
    return f"http://127.0.0.1:{free_port()}"


def requests_ok(url: str) -> float:
    """The server's `logprobd_requests_total{outcome="ok"}`."""
    text = httpx.get(f"{url}/metrics").text
    found = re.search(r'^logprobd_requests_total\{outcome="ok"\} (\S+)$', text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0
