"""/metrics carries only the series an operator reads: no prometheus_client `_created` timestamps
(vLLM's /metrics has none either), from a real app's /metrics."""

from __future__ import annotations

import re

from fastapi.testclient import TestClient

from service.http.app import create_app
from service.settings import Settings
from tests.support.fakes import FakeEngine
from tests.support.servers import wait_ready


def test_metrics_have_no_created_series() -> None:
    with TestClient(create_app(Settings(), engine_factory=lambda _: FakeEngine())) as client:
        wait_ready(client)
        assert client.post("/logprobs", json={"input_ids": [[1, 2, 3]], "num_actions": 1}).status_code == 200
        text = client.get("/metrics").text
    samples = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert any(line.startswith("logprobd_requests_total{") for line in samples)
    assert any(line.startswith("logprobd_request_duration_seconds_bucket{") for line in samples)
    assert [line for line in samples if re.match(r"^\w+_created[{ ]", line)] == []
    assert "_created" not in text
