"""CPU smoke test of the MoE benchmark: the same code end to end on a tiny Qwen3-MoE, float32."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.harness import active_params, build_model
from benchmarks.moe import main
from benchmarks.shapes import MOE_SHAPES
from benchmarks.workload import floor_flops, workload
from tests.benchmarks.page_rows import page_rows


def test_moe_benchmark_runs_end_to_end_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "moe.json"
    argv = ["--models", "tiny-moe", "--device", "cpu", "--dtype", "float32", "--sequences", "4"]
    assert main([*argv, "--reps", "2", "--max-batch-tokens", "1024", "--output", str(out)]) == 0
    tiny = json.loads(out.read_text())["models"]["tiny-moe"]
    assert set(tiny["variants"]) == {"http", "fused", "transformers_eager", "transformers_grouped_mm"}
    for variant in tiny["variants"].values():
        assert len(variant["rounds_ms"]) == 2
        assert variant["floor_fraction"] > 0
        assert variant["slowest_over_median"] >= 0
    assert tiny["moe_kernel"] == "loop"  # cpu: the twin
    assert tiny["default_experts_implementation"] in {"eager", "grouped_mm"}
    assert tiny["ready_s"] > 0
    load = tiny["expert_load"]  # one counted layer of 8 experts, per micro-batch of the HTTP rounds
    assert load["observations"] > 0
    assert load["observations"] % 8 == 0
    assert abs(load["mean_share"] - 1) < 1e-9
    assert 0 <= load["idle"] <= 1
    assert tiny["max_abs_diff_vs_transformers"] < 1e-4  # float32: the same scores
    assert set(tiny["max_abs_diff_vs_float32"]) == {"fused", "eager", "grouped_mm"}
    for diffs in tiny["max_abs_diff_vs_float32"].values():
        assert diffs["mean"] <= diffs["max"] < 1e-4
    (row,) = page_rows("moe", out)  # the results page reads what the suite wrote
    assert row[1:3] == ["tiny-moe", f"{tiny['variants']['http']['ms']:,.1f}"]
    (peers,) = page_rows("moe_peers", out)
    assert peers[3] == f"{tiny['variants']['transformers_grouped_mm']['ms']:,.1f}"


def test_the_floor_counts_active_experts_only() -> None:
    import torch

    shape = MOE_SHAPES["tiny-moe"]
    model = build_model(shape, torch.float32, torch.device("cpu"), "sdpa")
    per_expert = 3 * 64 * 32
    every = sum(p.numel() for p in model.parameters()) - 512 * 64  # tied embedding
    assert active_params(model) == every - 2 * (8 - 2) * per_expert  # 2 sparse layers, 6 idle experts
    samples = workload(512, sequences=2)
    width = {"hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 512}
    wider = {**width, "attention_width": 128}
    attention = sum(2.0 * 2 * 64 * len(s.tokens) ** 2 for s in samples)
    assert floor_flops(wider, 10, samples) - floor_flops(width, 10, samples) == attention
