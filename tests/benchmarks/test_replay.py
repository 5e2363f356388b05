"""CPU smoke test of the routing-replay benchmark on the tiny MoE: frames and both JSON forms from a
plain client, each replay checked against the live scores (agreement 1.0) before it is timed."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import replay


def test_replay_benchmark_runs_every_form_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "replay.json"
    argv = ["--models", "tiny-moe", "--device", "cpu", "--dtype", "float32", "--sequences", "8"]
    argv += ["--reps", "1", "--json-forms", "base64", "lists", "--output", str(out)]
    assert replay.main(argv) == 0
    model = json.loads(out.read_text())["models"]["tiny-moe"]
    assert list(model["variants"]) == [
        "live",
        "record",
        "replay",
        "live_json",
        "record_base64",
        "replay_base64",
        "record_lists",
        "replay_lists",
    ]
    assert model["replay_exact_agreement_min"] == 1.0
    assert model["variants"]["live_json"]["cost_over_live"] == 0.0
    base64_bytes = model["variants"]["replay_base64"]["request_bytes"]
    assert base64_bytes > model["variants"]["replay"]["request_bytes"]  # 4/3 x 4 bytes an id, not 1
