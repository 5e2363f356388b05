"""CPU smoke test of the long-sequence benchmark: the tiny model, sequences longer than the budget
(scored in chunks) against a budget that holds them whole, one long sequence, the fairness load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.long import main
from tests.benchmarks.page_rows import page_rows


@pytest.mark.slow
def test_long_benchmark_runs_end_to_end_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "long.json"
    argv = ["--models", "tiny", "--device", "cpu", "--dtype", "float32", "--long-scale", "0.01"]
    argv += ["--max-batch-tokens", "64", "--whole-budget", "512", "--reps", "1", "--single"]
    argv += ["--single-models", "tiny", "--fairness-seconds", "2", "--fairness-models", "tiny"]
    assert main([*argv, "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert (result["suite"], result["gpus"]) == ("long", 0)
    tiny = result["models"]["tiny"]
    assert max(tiny["long_tokens"]) > 64  # chunked under this budget, whole under the other
    for variant in ("chunked", "whole"):
        assert tiny[variant]["ms"] > 0
        assert tiny[variant]["max_abs_diff_vs_float32"] < 1e-4  # float32: the reference's scores
    assert tiny["chunked_vs_whole"] == pytest.approx(tiny["chunked"]["ms"] / tiny["whole"]["ms"])
    assert tiny["single"]["tokens"] == round(131072 * 0.01)
    fairness = tiny["fairness"]
    assert fairness["alone"]["short_requests"] >= 4  # a request of each short client at least
    assert fairness["with_long_stream"]["long_sequences_done"] >= 1
    (row,) = page_rows("long", out)  # the results page reads what the suite wrote
    assert row[1:3] == ["tiny", f"{sum(tiny['long_tokens']):,}"]
