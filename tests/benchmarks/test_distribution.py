"""CPU smoke test of the distribution benchmark: the tiny model, the GRPO variants and both teacher
calls (from a client process), each answered in full."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import distribution


def test_distribution_benchmark_runs_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "distribution.json"
    argv = ["--models", "tiny", "--device", "cpu", "--dtype", "float32", "--scale", "0.05"]
    assert distribution.main([*argv, "--teacher-tokens", "64", "--reps", "1", "--output", str(out)]) == 0
    model = json.loads(out.read_text())["models"]["tiny"]
    assert set(model["grpo-short"]["variants"]) == {
        "plain",
        "top_logprobs_100",
        "top_logprobs_1000",
        "processed",
    }
    teacher = model["teacher"]
    assert (
        teacher["entries"] >= 8 * 63 * 100
    )  # every scored position's top 100 (and the token, where not among them)
    assert teacher["ms"] > 0
    assert teacher["drawing"]["ms"] > 0
