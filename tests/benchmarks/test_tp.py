"""CPU smoke test of the tensor-parallel benchmark: a tiny shape over 2 ranks (gloo), end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks import tp
from benchmarks.harness import active_params, build_model
from benchmarks.shapes import SHAPES
from tests.benchmarks.page_rows import page_rows


@pytest.mark.slow
def test_tp_benchmark_runs_end_to_end_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "tp.json"
    argv = ["--models", "tiny", "--tp", "2", "--device", "cpu", "--dtype", "float32", "--sequences", "8"]
    argv += ["--reps", "1", "--checkpoints", str(tmp_path / "ckpt"), "--output", str(out)]
    assert tp.main(argv) == 0
    (run,) = json.loads(out.read_text())["runs"]
    assert (run["model"], run["tensor_parallel_size"], run["sequences"]) == ("tiny", 2, 8)
    assert run["decoder"] == "fused"
    assert run["ms"] > 0
    assert 0 < run["floor_fraction"] < 1
    (row,) = page_rows("tp", out)  # the results page reads what the suite wrote
    assert row[1:5] == ["tiny", "standard", "2", f"{run['ms']:,.1f}"]


def test_the_floor_counts_the_parameters_a_model_has() -> None:
    model = build_model(dict(SHAPES["tiny"]), torch.float32, torch.device("cpu"), "eager")
    assert tp.non_embedding_params(tp.ALL_SHAPES["tiny"]) == active_params(model)


def test_checkpoints_have_the_shapes_of_the_config(tmp_path: Path) -> None:
    from transformers import AutoConfig

    path = tp.write_checkpoint("tiny", tmp_path, torch.float32)
    config = AutoConfig.from_pretrained(path)
    assert config.hidden_size == tp.ALL_SHAPES["tiny"]["hidden_size"]
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.1.mlp.down_proj.weight" in index
    assert tp.write_checkpoint("tiny", tmp_path, torch.float32) == path  # reused
