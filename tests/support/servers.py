"""The app as the tests run it: in-process behind a TestClient (`running`), under a real uvicorn on a
loopback port in a thread (`loopback`, `serving`), or as a server process (`server_process`); and
what the client tests' servers (tests/client/conftest.py) answer."""

from __future__ import annotations

import re
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.testclient import TestClient

from benchmarks import server as suites
from service.http.app import create_app
from service.settings import Settings
from tests.support import ROOT
from tests.support.device import settings_for


class Reply(Protocol):
    """A TestClient response: httpx's or httpx2's, whichever starlette uses in this environment."""

    @property
    def status_code(self) -> int: ...

    @property
    def text(self) -> str: ...

    def json(self) -> Any: ...


def wait_ready(client: TestClient, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = client.get("/health/ready")
        if status.status_code == 200:
            return
        if status.json()["status"] == "failed":
            raise RuntimeError("the app failed to start")
        time.sleep(0.05)
    raise TimeoutError("the app did not become ready")


@contextmanager
def running(settings: Settings) -> Iterator[TestClient]:
    """The app on `settings` in this process, once ready."""
    with TestClient(create_app(settings)) as client:
        wait_ready(client)
        yield client


def free_port() -> int:
    """A loopback port as the benchmark suites pick theirs (benchmarks.server.free_port: below the
    ephemeral range, never the same twice in this process)."""
    return suites.free_port()


@contextmanager
def loopback(app: FastAPI, timeout: float = 60.0, log_level: str = "warning") -> Iterator[str]:
    """`app` under a real uvicorn on a free loopback port, once ready; yields its base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level=log_level))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                ready = httpx.get(f"{url}/health/ready")
            except httpx.TransportError:
                pass
            else:
                if ready.status_code == 200:
                    break
                if ready.json().get("status") == "failed":
                    raise RuntimeError("the server failed to start (see the captured log)")
            if time.monotonic() > deadline:
                raise TimeoutError("server did not become ready")
            time.sleep(0.05)
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def wait_served(url: str, process: subprocess.Popen[bytes], log: Path, timeout: float, what: str) -> None:
    """Poll `url`'s /health/ready until 200; fail with the server's log if `process` exits first, or
    once `timeout` seconds have passed."""
    deadline = time.monotonic() + timeout
    while True:
        assert process.poll() is None, log.read_text()
        try:
            if httpx.get(f"{url}/health/ready").status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"{what} did not become ready\n" + log.read_text()
        time.sleep(0.1)


@contextmanager
def server_process(
    command: list[str], port: int, *, env: dict[str, str], log: Path, timeout: float, what: str
) -> Iterator[str]:
    """`command` (a server listening on loopback `port`) as a process in the repository, its output in
    `log`; yields its base URL once ready (wait_served), and stops it (terminate, then kill) on the
    way out."""
    with log.open("wb") as sink:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_served(url, process, log, timeout, what)
        yield url
    finally:
        stop(process)


def stop(process: subprocess.Popen[bytes]) -> None:
    """Terminate `process`; kill it if it has not exited 30 s later."""
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@contextmanager
def serving(model: Path, **settings: Any) -> Iterator[str]:
    """A real logprobd on a free loopback port, ready; yields its base URL."""
    with loopback(create_app(settings_for(model, **settings))) as url:
        yield url


@dataclass(frozen=True)
class PpoServer:
    """A qwen2 policy server with a critic and a reference model."""

    url: str
    critic_format: str  # one of tests.support.critics.FORMATS
    critic_dir: Path


def with_critics(*formats: str) -> pytest.MarkDecorator:
    """Run a test against `ppo_server` once per critic format (tests.support.critics.FORMATS)."""
    return pytest.mark.parametrize("ppo_server", formats, indirect=True)


def requests_ok(url: str) -> float:
    """The server's `logprobd_requests_total{outcome="ok"}`."""
    text = httpx.get(f"{url}/metrics").text
    found = re.search(r'^logprobd_requests_total\{outcome="ok"\} (\S+)$', text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0
