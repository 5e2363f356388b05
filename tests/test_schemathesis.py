"""Property-based tests of the committed openapi.yaml against a real server on loopback:
whatever schemathesis generates, no 5xx and every response conforms to the document."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
import uvicorn
from hypothesis import HealthCheck, settings
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from service.app import create_app
from tests.conftest import settings_for

SCHEMA = schemathesis.openapi.from_path(Path(__file__).resolve().parents[1] / "openapi.yaml")


def not_a_server_error(
    ctx: object, response: schemathesis.Response, case: schemathesis.Case[Any]
) -> bool | None:
    assert response.status_code < 500, f"{response.status_code}: {response.text[:500]}"
    return None


@pytest.fixture(scope="module")
def base_url(model_dirs: dict[str, Path]) -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = create_app(settings_for(model_dirs["qwen2"], max_request_tokens=4096, max_body_bytes=1 << 20))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{url}/health/ready").status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    yield url
    server.should_exit = True
    thread.join(timeout=30)


@SCHEMA.parametrize()
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
def test_api_conforms(case: schemathesis.Case[Any], base_url: str) -> None:
    case.call_and_validate(
        base_url=base_url,
        checks=[
            not_a_server_error,
            status_code_conformance,
            content_type_conformance,
            response_schema_conformance,
        ],
    )
