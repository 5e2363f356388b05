"""CPU smoke test of the dense projections' GEMM probe, and the projections it reads off a shape."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.probes.dense_gemms import Projection, main, projections


def test_projections_follow_the_shapes() -> None:
    assert projections("qwen2.5-7b") == [
        Projection("qkv", 3584, (28 + 8) * 128, accumulate=False, bias=True),
        Projection("o", 3584, 3584, accumulate=True),
        Projection("down", 18944, 3584, accumulate=True),
    ]
    # an MoE shape: its head_dim (not hidden / heads), no bias, no dense down projection
    assert projections("qwen3-30b-a3b") == [
        Projection("qkv", 2048, (32 + 8) * 128, accumulate=False, bias=False),
        Projection("o", 32 * 128, 2048, accumulate=True),
    ]
    assert Projection("o", 3584, 3584, accumulate=True).flops(4096) == 2.0 * 4096 * 3584 * 3584


def test_probe_runs_cublas_on_cpu_and_skips_quack(tmp_path: Path) -> None:
    out = tmp_path / "dense.json"
    argv = ["--models", "tiny", "--device", "cpu", "--dtype", "float32", "--tokens", "32", "--reps", "1"]
    assert main([*argv, "--output", str(out)]) == 0
    rows = json.loads(out.read_text())["models"]["tiny"]["32"]
    assert list(rows) == ["qkv", "o", "down"]
    for row in rows.values():
        assert row["cublas"]["ms"] > 0
        assert row["cublas"]["rel_diff"] < 1e-5  # float32 against the float32 product
        assert "skipped" in row["quack"]
