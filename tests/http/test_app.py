"""App lifecycle and the operational routes: health, info, metrics, failures."""

from __future__ import annotations

import dataclasses
import gc
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from service.engine import ScoringEngine
from service.engine.config import MOE_BATCH_TOKENS, EngineConfig, batch_budget
from service.http.app import create_app
from service.settings import Settings
from service.wire import jsonrows
from tests.support.device import settings_for
from tests.support.fakes import FakeEngine
from tests.support.servers import running, wait_ready


def test_demo_model_serves_and_says_it_is_a_demo() -> None:
    with running(settings_for(None)) as client:
        info = client.get("/info").json()
        assert info["demo"] is True
        assert info["model"] == "logprobd-demo-qwen2"
        assert info["architecture"] == "Qwen2ForCausalLM"
        assert info["attention_backend"] == "sdpa"
        assert set(info["versions"]) >= {"service", "torch", "transformers"}
        r = client.post("/logprobs", json={"input_ids": [[1, 2, 3, 4]], "num_actions": 2})
        assert r.status_code == 200
        body = r.json()
        assert body["model"] == "logprobd-demo-qwen2"
        assert len(body["logprobs"][0]) == 2
        assert all(v < 0 for v in body["logprobs"][0])
        assert body["usage"] == {
            "input_tokens": 4,
            "scored_tokens": 2,
            "computed_tokens": 4,
            "cached_tokens": 0,
        }


def test_ready_only_after_load_and_warm_up() -> None:
    started = []

    class SlowEngine(FakeEngine):
        def warm_up(self) -> None:
            time.sleep(0.5)
            started.append(True)

    app = create_app(Settings(), engine_factory=lambda _: SlowEngine())
    with TestClient(app) as client:
        assert client.get("/health/live").status_code == 200
        first = client.get("/health/ready")
        assert first.status_code == 503
        assert first.json() == {"status": "loading"}
        assert client.get("/info").status_code == 503
        scored = client.post("/logprobs", json={"input_ids": [[1, 2]], "num_actions": 1})
        assert scored.status_code == 503
        assert scored.json()["error"]["type"] == "not_ready"
        wait_ready(client)
        assert started == [True]
        assert client.get("/metrics").text.count("logprobd_ready 1.0") == 1


def test_failed_load_is_reported_and_fatal() -> None:
    fatal = []

    def broken(_: EngineConfig) -> ScoringEngine:
        raise FileNotFoundError("no config.json")

    app = create_app(Settings(), engine_factory=broken, on_fatal=lambda: fatal.append(True))
    with TestClient(app) as client:
        deadline = time.monotonic() + 10
        while not fatal and time.monotonic() < deadline:
            time.sleep(0.01)
        assert fatal == [True]
        ready = client.get("/health/ready")
        assert ready.status_code == 503
        assert ready.json() == {"status": "failed"}


def test_missing_model_directory_fails_the_start(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="failed to start"), running(settings_for(tmp_path / "nowhere")):
        pass


def test_engine_failure_is_a_500_and_the_server_keeps_serving() -> None:
    app = create_app(Settings(), engine_factory=lambda _: FakeEngine(fail_on_token=7))
    with TestClient(app) as client:
        wait_ready(client)
        bad = client.post("/logprobs", json={"input_ids": [[1, 7, 3]], "num_actions": 2})
        assert bad.status_code == 500
        assert bad.json()["error"]["type"] == "engine_failure"
        good = client.post("/logprobs", json={"input_ids": [[1, 5, 3]], "num_actions": 2})
        assert good.status_code == 200
        assert good.json()["logprobs"] == [[-6.0, -5.0]]  # FakeEngine: -(x_t + t)
        metrics = client.get("/metrics").text
        assert 'logprobd_requests_total{outcome="engine_failure"} 1.0' in metrics
        assert 'logprobd_requests_total{outcome="ok"} 1.0' in metrics


def test_info_gives_the_budget_the_engine_runs_unless_it_is_set() -> None:
    def engine(config: EngineConfig) -> FakeEngine:  # resolving its budget as an MoE policy on a GPU
        fake = FakeEngine()
        budget = batch_budget(config.max_batch_tokens, moe_on_gpu=True)
        fake.info = dataclasses.replace(fake.info, max_batch_tokens=budget)
        return fake

    for settings, want in ((Settings(), MOE_BATCH_TOKENS), (Settings(max_batch_tokens=2048), 2048)):
        with TestClient(create_app(settings, engine_factory=engine)) as client:
            wait_ready(client)
            assert client.get("/info").json()["max_batch_tokens"] == want


def test_metrics_count_tokens_and_latencies() -> None:
    app = create_app(Settings(), engine_factory=lambda _: FakeEngine())
    with TestClient(app) as client:
        wait_ready(client)
        for _ in range(3):
            r = client.post("/logprobs", json={"input_ids": [[1, 2, 3, 4], [5, 6]], "num_actions": [2, 1]})
            assert r.status_code == 200
        text = client.get("/metrics").text
        assert "logprobd_input_tokens_total 18.0" in text
        assert "logprobd_scored_tokens_total 9.0" in text
        assert "logprobd_request_duration_seconds_count 3.0" in text
        assert "logprobd_forward_duration_seconds_count" in text
        assert "logprobd_queue_duration_seconds_count 6.0" in text
        assert "logprobd_batch_tokens_bucket" in text
        assert "logprobd_queue_requests 0.0" in text
        assert "logprobd_queue_tokens 0.0" in text


def test_what_lives_from_ready_is_kept_out_of_the_full_collections() -> None:
    engines: list[FakeEngine] = []

    def factory(_: EngineConfig) -> FakeEngine:
        engines.append(FakeEngine())
        return engines[-1]

    with TestClient(create_app(Settings(), engine_factory=factory)) as client:
        wait_ready(client)
        assert gc.get_freeze_count() > 0
        assert not any(o is engines[0] for o in gc.get_objects())  # a full collection skips it
        r = client.post("/logprobs", json={"input_ids": [[1, 2, 3]], "num_actions": 1})
        assert r.status_code == 200
    assert gc.get_freeze_count() == 0  # handed back at shutdown
    assert any(o is engines[0] for o in gc.get_objects())


def test_the_ready_line_says_what_serves_and_the_row_reader_is_looked_for_at_start(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the native JSON row reader was not built, its warning is in the start-up log, not the
    first request's; the ready line says what serves (under `serve`, also where: test_serve_start)."""
    looked: list[bool] = []
    monkeypatch.setattr(jsonrows, "native", lambda: looked.append(True))
    app = create_app(Settings(), engine_factory=lambda _: FakeEngine())
    with caplog.at_level("INFO", logger="service.http.app"), TestClient(app) as client:
        wait_ready(client)
        assert looked == [True]
    info = FakeEngine().info
    (ready,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("ready: ")]
    assert ready == (
        f"ready: {info.model} ({info.architecture}) on {info.device}, {info.dtype}, "
        f"attention={info.attention_backend}"
    )


@pytest.mark.parametrize("docs_ui", [False, True])
def test_the_docs_ui_is_off_unless_asked_for_and_the_openapi_document_always_served(docs_ui: bool) -> None:
    """Swagger UI and ReDoc load from CDNs (nothing an offline cluster reaches): off by default."""
    client = TestClient(create_app(Settings(docs_ui=docs_ui), engine_factory=lambda s: FakeEngine()))
    assert client.get("/openapi.json").json()["info"]["title"] == "logprobd"
    for path, asset in (("/docs", "swagger-ui-bundle.js"), ("/redoc", "redoc.standalone.js")):
        page = client.get(path)
        assert page.status_code == (200 if docs_ui else 404)
        assert (asset in page.text) is docs_ui


def test_unknown_routes_and_methods_answer_in_the_error_shape() -> None:
    app = create_app(Settings(), engine_factory=lambda _: FakeEngine())
    with TestClient(app) as client:
        wait_ready(client)
        for path in ("/", "/healthz", "/logprobs/x"):
            missing = client.get(path)
            assert missing.status_code == 404
            assert missing.json() == {
                "error": {
                    "type": "not_found",
                    "message": f"GET {path}: no such route (the routes are listed at /openapi.json)",
                }
            }
        wrong = client.get("/logprobs")
        assert wrong.status_code == 405
        assert wrong.headers["allow"] == "POST"
        assert wrong.json() == {
            "error": {
                "type": "method_not_allowed",
                "message": "GET /logprobs: method not allowed; /logprobs takes POST",
            }
        }
        wrong = client.post("/health/live")
        assert wrong.status_code == 405
        assert (
            wrong.json()["error"]["message"]
            == "POST /health/live: method not allowed; /health/live takes GET"
        )
        metrics = client.get("/metrics").text
        assert "not_found" not in metrics  # not scoring requests: the outcomes stay those of scoring
        assert "method_not_allowed" not in metrics
