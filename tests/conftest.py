"""Fixtures: tiny checkpoints of every architecture on disk, the reference models, running apps.

LOGPROBD_TEST_DEVICE / LOGPROBD_TEST_DTYPE / LOGPROBD_TEST_ATTENTION pick what the service side
runs on (default cpu / float32 / auto); the reference is always float32 eager on the same device.
LOGPROBD_TEST_TP_COLLECTIVES picks the tensor-parallel suites' collectives (default gloo, whose
ranks may share one GPU; nccl on a host with a GPU per rank).
"""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.testclient import TestClient

from service.http.app import create_app
from service.settings import Settings
from service.wire import jsonrows
from tests import models

ROOT = Path(__file__).resolve().parents[1]  # the repository: a server process's working directory

DEVICE = os.environ.get("LOGPROBD_TEST_DEVICE", "cpu")
DTYPE = os.environ.get("LOGPROBD_TEST_DTYPE", "float32")
ATTENTION = os.environ.get("LOGPROBD_TEST_ATTENTION", "auto")
TP_COLLECTIVES = os.environ.get("LOGPROBD_TEST_TP_COLLECTIVES", "gloo")
# float32 promises 1e-4 (docs/semantics.md); half precisions are checked against bf16/fp16 noise
TOLERANCE = {"float32": 1e-4, "bfloat16": 0.25, "float16": 0.05}[DTYPE]
# critic values grow with their head (a random one reaches |v| ~ 10 where log-probs stay near 5): in a
# half precision their rounding grows with them, so they are also allowed 2 % of the row's largest |v|
# (float32: none)
VALUE_RTOL = 0.0 if DTYPE == "float32" else 0.02


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {name: models.save(name, root / name) for name in models.EVERY}


def eager(path: Path) -> Any:
    """The checkpoint as the per-sequence reference runs it: eager attention, float32."""
    import torch
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32)
    return model.to(DEVICE).eval()


@pytest.fixture(scope="session")
def reference_models(model_dirs: dict[str, Path]) -> dict[str, Any]:
    return {name: eager(path) for name, path in model_dirs.items()}


class Reply(Protocol):
    """A TestClient response: httpx's or httpx2's, whichever starlette uses in this environment."""

    @property
    def status_code(self) -> int: ...

    @property
    def text(self) -> str: ...

    def json(self) -> Any: ...


REF_SEED = 7  # the reference policy: the qwen2 architecture, other weights than the policy's


@pytest.fixture(scope="session")
def ref_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return models.save("qwen2", tmp_path_factory.mktemp("ref") / "qwen2-ref", seed=REF_SEED)


@pytest.fixture(scope="session")
def ref_model(ref_dir: Path) -> Any:
    return eager(ref_dir)


VERSION_SEEDS = {"v10": 10, "v11": 11, "v12": 12}  # policy weights a trainer might push, in turn


@pytest.fixture(scope="session")
def weight_versions(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Checkpoints of the same qwen2 model with other weights, by version label."""
    root = tmp_path_factory.mktemp("versions")
    return {
        version: models.save("qwen2", root / version, seed=seed) for version, seed in VERSION_SEEDS.items()
    }


@pytest.fixture(scope="session")
def version_models(weight_versions: dict[str, Path]) -> dict[str, Any]:
    return {version: eager(path) for version, path in weight_versions.items()}


def native_or_skip() -> None:
    """Skip unless the native JSON row reader (service/wire/_jsonrows.c) was built; with
    LOGPROBD_REQUIRE_NATIVE=1 (CI) its absence fails instead."""
    if jsonrows.native() is None:
        if os.environ.get("LOGPROBD_REQUIRE_NATIVE") == "1":
            pytest.fail(
                "service.wire._jsonrows is not built (pip install -e . compiles it; needs a C compiler)"
            )
        pytest.skip("service.wire._jsonrows is not built")


def settings_for(path: Path | None, **overrides: Any) -> Settings:
    values: dict[str, Any] = {"model": path, "device": DEVICE, "dtype": DTYPE, "attention": ATTENTION}
    values.update(overrides)
    return Settings(**values)


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
    """`command` (a server listening on loopback `port`) as a process, its output in `log`; yields its
    base URL once ready (wait_served), and stops it (terminate, then kill) on the way out."""
    with log.open("wb") as sink:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_served(url, process, log, timeout, what)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


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


@contextmanager
def running(settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings)) as client:
        wait_ready(client)
        yield client
