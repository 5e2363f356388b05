"""CPU smoke test of the start-up benchmark: one start of a tiny MoE in a child process, its phases
and its compiles reported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.startup import main
from tests.benchmarks.page_rows import page_rows


@pytest.mark.slow
def test_startup_benchmark_runs_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "startup.json"
    argv = ["--model", "tiny-moe", "--device", "cpu", "--dtype", "float32", "--runs", "1"]
    assert main([*argv, "--cache-dir", str(tmp_path / "caches"), "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert (result["suite"], result["gpus"], result["model"]) == ("startup", 0, "tiny-moe")
    (start,) = result["starts"]
    assert start["ready_s"] > 0
    assert start["phases_s"]["build decoders"] > 0
    assert set(start["compiles"]) == {"triton", "cute"}
    assert set(start["phase_calls"]) == set(start["phase_longest_s"]) == set(start["phases_s"])
    assert set(start["compile_s_by_phase"]) <= {*start["phases_s"], "outside the phases"}
    for phase, total in start["phases_s"].items():
        assert 0 < start["phase_longest_s"][phase] <= total
    (row,) = page_rows("startup", out)  # the results page reads what the suite wrote
    assert row[1:4] == ["tiny-moe", "as given", f"{start['ready_s']:.1f}"]  # --cache-dir: not known cold
