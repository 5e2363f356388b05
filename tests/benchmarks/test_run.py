"""CPU smoke test of the GPU benchmark: the same code end to end on a tiny model, float32."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.run import main
from benchmarks.shapes import SHAPES
from benchmarks.workload import floor_flops, workload
from tests.benchmarks.page_rows import page_rows


def test_benchmark_runs_end_to_end_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "latest.json"
    argv = ["--models", "tiny", "--device", "cpu", "--dtype", "float32", "--sequences", "8", "--reps", "1"]
    argv += ["--load-seconds", "2", "--load-tasks", "4", "--load-bodies", "2", "--load-processes", "2"]
    assert main([*argv, "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert {"device", "date", "versions", "matmul_tflops", "matmul_tflops_sustained"} <= set(result)
    assert result["matmul_tflops_sustained"] > 0
    assert result["suite"] == "run"
    assert result["command"] == f"python -m benchmarks.run {' '.join(argv)}"  # --output left out
    tiny = result["models"]["tiny"]
    assert set(tiny["variants"]) == {
        "naive",
        "trl",
        "engine",
        "http",
        "http_json",
        "http_httpcore",
        "http_8proc",
        "http_plain",
        "http_plain_8proc",
    }
    for key in (
        "floor_fraction_http",
        "floor_fraction_engine",
        "speedup_vs_naive",
        "http_overhead",
        "http_overhead_json",
        "http_overhead_httpcore",
        "http_overhead_8proc_clients",
        "http_overhead_plain",
        "http_overhead_plain_8proc",
    ):
        assert isinstance(tiny[key], float)
    load = tiny["load"]
    assert load["requests"] >= 1
    assert load["tasks"] == 4
    assert load["processes"] == 2
    for key in ("offered_requests_per_s", "requests_per_s", "tokens_per_s", "p50_ms", "p99_ms"):
        assert load[key] > 0
    assert load["p50_ms"] <= load["p99_ms"]
    # the offered rate follows the `http` variant's throughput (--load-fraction 0.8)
    assert load["offered_tokens_per_s"] == pytest.approx(0.8 * tiny["variants"]["http"]["tokens_per_s"])
    assert tiny["floor_fraction_engine"] > 0
    assert tiny["max_abs_diff_bf16"] < 1e-4  # float32 here: the service equals the reference
    assert tiny["max_abs_diff_bf16_naive_peer"] < 1e-4
    (row,) = page_rows("run", out)  # the results page reads what the suite wrote
    engine, http = tiny["variants"]["engine"]["ms"], tiny["variants"]["http"]["ms"]
    assert row[1:5] == ["tiny", f"{tiny['floor_ms']:,.1f}", f"{engine:,.1f}", f"{http:,.1f}"]
    assert row[-1] == "[latest.json](benchmarks/results/latest.json)"
    (loaded,) = page_rows("run_load", out)
    assert loaded[1:3] == ["tiny", f"{load['offered_requests_per_s']:.1f}"]


def test_workload_follows_the_issue() -> None:
    samples = workload(1000, sequences=64)
    assert len(samples) == 64
    assert all(256 <= len(s.prompt) <= 1024 for s in samples)
    assert all(16 <= len(s.response) <= 1024 for s in samples)
    assert samples == workload(1000, sequences=64)  # fixed seed
    mean = sum(len(s.response) for s in samples) / 64
    assert 150 < mean < 350


def test_floor_counts_each_term() -> None:
    samples = workload(512, sequences=2)
    shape = SHAPES["tiny"]
    tokens = sum(len(s.tokens) for s in samples)
    actions = sum(len(s.response) for s in samples)
    attention = sum(2.0 * 2 * 64 * len(s.tokens) ** 2 for s in samples)
    assert floor_flops(shape, 1000, samples) == 2.0 * 1000 * tokens + 2.0 * 512 * 64 * actions + attention
