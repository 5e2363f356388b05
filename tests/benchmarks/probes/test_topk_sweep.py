"""CPU smoke test of the radix select's launch sweep: a tiny shape, the kernels in Triton's interpreter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.engine.interpreter import interpreted


def test_topk_sweep_runs_on_cpu_and_every_configuration_selects_alike(tmp_path: Path) -> None:
    pytest.importorskip("triton", reason="the kernels run in Triton's interpreter on CPU")
    out = tmp_path / "sweep.json"
    argv = ["--device", "cpu", "--rows", "2", "--vocab", "1500", "--k", "7", "--reps", "1"]
    argv += ["--blocks", "512", "1024", "--warps", "4", "--digits", "4", "8", "--output", str(out)]
    result = interpreted(["-m", "benchmarks.probes.topk_sweep", *argv])
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    runs = json.loads(out.read_text())["results"]
    assert {(r["block"], r["digit"]) for r in runs} == {(512, 4), (512, 8), (1024, 4), (1024, 8)}
    assert all(r["same"] and r["ms"] > 0 for r in runs)


def test_topk_sweep_of_the_serving_path_finds_the_same_top_lists(tmp_path: Path) -> None:
    """--gathered: `launch` with Candidates, as a chunk of top_logprobs rows runs while serving; every
    block size gives each row's K largest, shift and rank as `select` does."""
    pytest.importorskip("triton", reason="the kernels run in Triton's interpreter on CPU")
    out = tmp_path / "sweep.json"
    argv = ["--device", "cpu", "--rows", "3", "--vocab", "1500", "--k", "7", "--reps", "1", "--gathered"]
    argv += ["--blocks", "256", "1024", "--warps", "4", "--output", str(out)]
    result = interpreted(["-m", "benchmarks.probes.topk_sweep", *argv])
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    runs = json.loads(out.read_text())["results"]
    assert sorted(r["block"] for r in runs) == [256, 1024]  # one digit: the gather path never histograms
    assert all(r["same"] and r["ms"] > 0 for r in runs)
