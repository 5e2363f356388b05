"""The committed openapi.yaml is exactly what the app generates (regenerate: make openapi)."""

from __future__ import annotations

from service.http.openapi import render_openapi
from tests.support import ROOT

COMMITTED = ROOT / "openapi.yaml"


def test_openapi_yaml_has_not_drifted() -> None:
    assert COMMITTED.read_text() == render_openapi(), "openapi.yaml is stale: run `make openapi`"


def test_openapi_documents_every_route() -> None:
    text = render_openapi()
    for route in ("/logprobs:", "/health/live:", "/health/ready:", "/info:", "/metrics:"):
        assert route in text
