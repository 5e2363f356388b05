"""CPU smoke test of the routing-replay benchmark: a tiny Qwen3-MoE, its routes recorded and sent
back, the replayed scores those of live routing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.replay import main
from tests.benchmarks.page_rows import page_rows


@pytest.mark.slow
def test_replay_benchmark_runs_end_to_end_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "replay.json"
    argv = ["--models", "tiny-moe", "--device", "cpu", "--dtype", "float32", "--sequences", "8"]
    assert main([*argv, "--reps", "1", "--output", str(out)]) == 0
    tiny = json.loads(out.read_text())["models"]["tiny-moe"]
    assert set(tiny["variants"]) == {"live", "record", "replay"}
    assert tiny["variants"]["live"]["cost_over_live"] == 0
    assert tiny["replay_vs_live_max_abs_diff"] < 1e-4  # float32: the recorded routes are the live ones
    assert tiny["replay_exact_agreement_min"] == 1.0
    assert 1 <= tiny["route_bytes_per_entry"] < 1.1  # one byte an entry (u1), and the rows' lengths
    (row,) = page_rows("replay", out)  # the results page reads what the suite wrote
    assert row[1] == "tiny-moe"
    assert row[2].startswith(f"{tiny['variants']['live']['ms']:,.1f} (")
