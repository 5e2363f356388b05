"""CPU smoke test of the batch-invariance benchmark, and its workloads' shapes and request cuts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.invariance import WORKLOADS, main, requests
from benchmarks.server import http_bodies
from benchmarks.workload import jobs
from tests.benchmarks.page_rows import page_rows


@pytest.mark.slow
def test_invariance_benchmark_runs_end_to_end_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "invariance.json"
    argv = ["--models", "tiny", "--device", "cpu", "--dtype", "float32", "--sequences", "8"]
    argv += ["--scale", "0.02", "--max-batch-tokens", "256", "--reps", "1", "--output", str(out)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert (result["suite"], result["gpus"]) == ("invariance", 0)
    tiny = result["models"]["tiny"]
    assert tiny["engine"]["on"]["attention"] == "blocked"  # the mode's CPU kernel
    assert tiny["engine"]["off"]["attention"] == "sdpa"
    assert set(tiny["workloads"]) == set(WORKLOADS)
    assert tiny["workloads"]["long"]["longest"] > 256  # chunked under this budget
    for w in tiny["workloads"].values():
        for mode in ("off", "on"):
            assert w[f"ms_{mode}"] > 0
            assert len(w[f"rounds_ms_{mode}"]) == 1
        assert w["cost"] == pytest.approx(w["ms_on"] / w["ms_off"] - 1)
        assert w["bitwise_on"] is True
        assert all(w["cases_on"].values())
    assert set(tiny["workloads"]["standard"]["cases_on"]) == {
        "in_8_concurrent_requests",
        "first_in_a_request",
        "split_from_its_request",
        "last_of_each_concurrent_request",
    }
    rows = page_rows("invariance", out)  # the results page reads what the suite wrote
    assert [(r[2], r[6]) for r in rows] == [(w, "yes") for w in tiny["workloads"]]


def test_workloads_follow_the_issue_and_requests_are_cut_as_the_clients_send_them() -> None:
    made = {w: make(1000, 1.0, 64) for w, make in WORKLOADS.items()}
    assert [len(s) for s in made.values()] == [64, 64, 64, 8]
    long = made["long"]
    assert all(len(s.prompt) == 1024 and 8192 <= len(s.response) <= 24576 for s in long)
    for w in ("grpo-short", "grpo-long"):
        cut = requests(jobs(made[w]))
        assert len(cut) == 8
        for group in cut:  # one request per GRPO group: one prompt each
            assert len({j.tokens[: int(j.actions[0])].tobytes() for j in group}) == 1
    for w, samples in made.items():
        assert [len(r) for r in requests(jobs(samples))] == [len(samples) // 8] * 8
        assert len(http_bodies(samples)) == 8, w
