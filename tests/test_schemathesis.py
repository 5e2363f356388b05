"""Property-based tests of the committed openapi.yaml against a real server on loopback:
whatever schemathesis generates, no 5xx and every response conforms to the document."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from service.app import create_app
from tests.conftest import loopback, settings_for

SCHEMA = schemathesis.openapi.from_path(Path(__file__).resolve().parents[1] / "openapi.yaml")


def not_a_server_error(
    ctx: object, response: schemathesis.Response, case: schemathesis.Case[Any]
) -> bool | None:
    assert response.status_code < 500, f"{response.status_code}: {response.text[:500]}"
    return None


@pytest.fixture(scope="module")
def base_url(model_dirs: dict[str, Path]) -> Iterator[str]:
    app = create_app(settings_for(model_dirs["qwen2"], max_request_tokens=4096, max_body_bytes=1 << 20))
    with loopback(app) as url:
        yield url


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
