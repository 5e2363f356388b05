"""Bearer API keys: 401 without a valid key on scoring routes; operational routes open unless asked."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from service.http.app import create_app
from service.http.auth import ApiKeys
from service.settings import Settings
from tests.support.fakes import FakeEngine
from tests.support.servers import wait_ready

BODY = {"input_ids": [[1, 2, 3]], "num_actions": 1}
SECRET = "k-3f9a-very-secret"


def _app(**settings: object) -> TestClient:
    return TestClient(create_app(Settings(**settings), engine_factory=lambda _: FakeEngine()))  # type: ignore[arg-type]


def test_scoring_needs_a_valid_key(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    keys = tmp_path / "keys"
    keys.write_text(f"{SECRET}\n\nother-key\n")
    caplog.set_level(logging.DEBUG)
    with _app(api_keys_file=keys) as client:
        wait_ready(client)
        missing = client.post("/logprobs", json=BODY)
        assert missing.status_code == 401
        assert missing.headers["www-authenticate"] == "Bearer"
        assert missing.json()["error"]["type"] == "unauthorized"
        wrong = client.post("/logprobs", json=BODY, headers={"Authorization": f"Bearer {SECRET}x"})
        assert wrong.status_code == 401
        basic = client.post("/logprobs", json=BODY, headers={"Authorization": f"Basic {SECRET}"})
        assert basic.status_code == 401
        for key in (SECRET, "other-key"):
            ok = client.post("/logprobs", json=BODY, headers={"Authorization": f"Bearer {key}"})
            assert ok.status_code == 200
            assert ok.json()["logprobs"] == [[-5.0]]
        for route in ("/health/live", "/health/ready", "/info", "/metrics"):
            assert client.get(route).status_code == 200
        assert 'outcome="unauthorized"} 3.0' in client.get("/metrics").text
    assert SECRET not in caplog.text


def test_all_routes_can_be_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOGPROBD_API_KEYS", f"{SECRET}, second")
    with _app(auth_all_routes=True) as client:
        assert client.get("/metrics").status_code == 401
        assert client.get("/health/ready", headers={"Authorization": "Bearer second"}).status_code in (
            200,
            503,
        )


def test_keys_never_show_in_settings() -> None:
    settings = Settings(api_keys=SECRET)
    assert SECRET not in repr(settings)
    assert SECRET not in str(settings.model_dump())
    assert ApiKeys.from_settings(settings).enabled
    assert not ApiKeys.from_settings(Settings()).enabled


def test_openapi_documents_the_bearer_scheme() -> None:
    document = create_app(Settings(api_keys=SECRET)).openapi()
    assert document["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
