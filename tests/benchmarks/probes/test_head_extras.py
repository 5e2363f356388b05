"""CPU smoke test of the head-extras benchmark: a tiny shape, its kernels in Triton's interpreter."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.engine.interpreter import interpreted


def test_head_extras_benchmark_runs_on_cpu(tmp_path: Path) -> None:
    pytest.importorskip("triton", reason="the kernels run in Triton's interpreter on CPU")
    out = tmp_path / "extras.json"
    argv = [
        "--device",
        "cpu",
        "--rows",
        "3",
        "--vocab",
        "1500",
        "--chunk",
        "2",
        "--reps",
        "1",
        "--warmup",
        "0",
    ]
    result = interpreted(["-m", "benchmarks.probes.head_extras", *argv, "--output", str(out)])
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    runs = json.loads(out.read_text())["runs"]
    cases = {run["case"] for run in runs}
    assert cases == {
        "plain",
        "top100 old",
        "top100 new",
        "top1000 old",
        "top1000 new",
        "processed old",
        "processed new",
    }
    assert all(run["rows"] == 3 and run["ms"] > 0 for run in runs)
    assert "top1000 new" in result.stdout


def test_head_extras_benchmark_refuses_cpu_without_the_interpreter() -> None:
    from benchmarks.probes import head_extras

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter is on")
    with pytest.raises(SystemExit):
        head_extras.main(["--device", "cpu", "--rows", "2", "--vocab", "64"])
