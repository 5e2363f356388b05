"""benchmarks.harness: where a result came from, the clock, and the models, on the CPU."""

from __future__ import annotations

import os
import time

import pytest
import torch

from benchmarks import harness
from benchmarks.shapes import MOE_SHAPES, SHAPES, floor_shape, shape_of


def test_the_command_is_the_suites_without_its_output() -> None:
    argv = ["--models", "tiny", "--output", "/tmp/x.json", "--reps", "2", "--output=/tmp/y.json"]
    assert harness.command("run", argv) == "python -m benchmarks.run --models tiny --reps 2"
    assert harness.command("tp", ["--checkpoints", "a b"]) == "python -m benchmarks.tp --checkpoints 'a b'"


def test_the_commit_is_the_one_given_where_there_is_no_history(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOGPROBD_COMMIT", "1234abc")
    assert harness.commit() == "1234abc"
    monkeypatch.delenv("LOGPROBD_COMMIT")
    assert harness.commit().split("+")[0].isalnum()  # git's short HEAD here, or `unknown`


def test_provenance_says_where_a_result_came_from(monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in [v for v in os.environ if v.startswith("LOGPROBD_")]:
        monkeypatch.delenv(variable)
    monkeypatch.setenv("LOGPROBD_MAX_BATCH_TOKENS", "8192")
    monkeypatch.setenv("LOGPROBD_COMMIT", "1234abc")
    monkeypatch.setenv("LOGPROBD_REQUIRE_NATIVE", "1")  # the tests' switch, not a setting
    found = harness.provenance("run", torch.device("cpu"), ["--reps", "1"])
    assert list(found) == ["suite", "device", "gpus", "date", "commit", "command", "environment", "versions"]
    assert found["environment"] == {"LOGPROBD_MAX_BATCH_TOKENS": "8192"}  # not the commit, not a switch
    assert (found["suite"], found["gpus"], found["command"]) == (
        "run",
        0,
        "python -m benchmarks.run --reps 1",
    )
    assert found["versions"]["torch"] == torch.__version__
    assert "transformers" in found["versions"]


def test_median_ms_times_each_call_after_the_warm_ups() -> None:
    calls: list[float] = []

    def sleep() -> None:
        calls.append(time.perf_counter())
        time.sleep(0.01)

    ms = harness.median_ms(sleep, torch.device("cpu"), reps=3, warmup=2)
    assert len(calls) == 5
    assert 9 < ms < 100


def test_sustained_rate_runs_for_its_interval_and_counts_flops_as_the_burst_rate_does() -> None:
    """One thread, so that another process on the host (`make pytest`'s other worker) slows the two
    measurements alike rather than oversubscribing the cores during one of them; the bounds still
    catch a miscount, which is off by its factor (the 10 calls between synchronisations, or n)."""
    cpu = torch.device("cpu")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        start = time.perf_counter()
        sustained = harness.sustained_matmul_rate(cpu, torch.float32, seconds=0.2)
        assert time.perf_counter() - start >= 0.2
        burst = harness.matmul_rate(cpu, torch.float32)
    finally:
        torch.set_num_threads(threads)
    assert 1 / 8 < sustained / burst < 8


def test_a_dense_model_has_its_shape_and_no_idle_experts() -> None:
    model = harness.build_model(shape_of("tiny"), torch.float32, torch.device("cpu"), "eager")
    assert model.config.hidden_size == SHAPES["tiny"]["hidden_size"]
    every = sum(p.numel() for p in model.parameters())
    assert harness.active_params(model) == every - 512 * 64  # the tied embedding alone left out
    assert floor_shape(shape_of("tiny")) == {"hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 512}
    assert floor_shape(MOE_SHAPES["tiny-moe"])["attention_width"] == 4 * 16
