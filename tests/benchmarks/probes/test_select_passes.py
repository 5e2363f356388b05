"""CPU smoke test of the select's per-pass timing: a tiny shape, the kernels in Triton's interpreter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.engine.interpreter import interpreted


def test_select_passes_runs_on_cpu_and_reports_every_pass(tmp_path: Path) -> None:
    pytest.importorskip("triton", reason="the kernels run in Triton's interpreter on CPU")
    out = tmp_path / "passes.json"
    shape = "--device cpu --rows 3 --vocab 1500 --k 7 --reps 1"
    result = interpreted(["-m", "benchmarks.probes.select_passes", *shape.split(), "--output", str(out)])
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    runs = json.loads(out.read_text())["runs"]
    timed = {r["case"] for r in runs if "ms" in r}
    assert timed == {
        "logprob", "logprob+entropy", "first pass", "first pass + window", "exact select",
        "gathered select", "mass",
    }  # fmt: skip
    (candidates,) = [r for r in runs if r["case"] == "candidates"]
    assert candidates["overflowed_rows"] == 0  # random rows: a K of 7 from 1,500 fits in 71 slots
    assert 7 <= candidates["largest_count"] <= 71
