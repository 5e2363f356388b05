"""CPU smoke test of the replay profile: the same code end to end on a tiny Qwen3-MoE, float32."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.replay_profile import Interval, busy_and_gaps, main, micro_batches, top_kernels
from benchmarks.workload import jobs, workload


def test_the_profile_runs_live_record_and_replay_on_the_same_micro_batches(tmp_path: Path) -> None:
    argv = ["--model", "tiny-moe", "--device", "cpu", "--dtype", "float32", "--sequences", "3"]
    assert (
        main([*argv, "--reps", "1", "--max-batch-tokens", "1024", "--top", "4", "--out", str(tmp_path)]) == 0
    )
    out = json.loads((tmp_path / "summary.json").read_text())
    assert set(out["variants"]) == {"live", "record", "replay"}
    want = [
        sum(j.num_tokens for j in batch) for batch in micro_batches(jobs(workload(512, sequences=3)), 1024)
    ]
    assert out["micro_batches"] == want
    assert out["replay_exact_agreement_min"] == 1.0  # float32: the live router takes the recorded routes
    for name, variant in out["variants"].items():
        assert (tmp_path / f"{name}.json").exists()
        assert 0 < variant["launch_host_ms"] <= variant["wall_ms"]
        assert variant["device_busy_ms"] > 0
        assert 0 < len(variant["top_kernels"]) <= 4
        assert len(variant["largest_gaps"]) <= 4


def test_busy_time_is_the_union_and_gaps_name_their_neighbours() -> None:
    spans = [Interval("a", 0, 10), Interval("b", 5, 12), Interval("c", 20, 25), Interval("d", 40, 41)]
    busy, gaps = busy_and_gaps(spans, 5)
    assert busy == (12 + 5 + 1) / 1e3
    assert gaps == [
        {"ms": 15 / 1e3, "after": "c", "before": "d"},
        {"ms": 8 / 1e3, "after": "b", "before": "c"},
    ]
    assert top_kernels([*spans, Interval("a", 50, 53)], 2) == [
        {"name": "a", "ms": 13 / 1e3, "calls": 2},
        {"name": "b", "ms": 7 / 1e3, "calls": 1},
    ]


def test_micro_batches_hold_whole_sequences_within_the_budget() -> None:
    the_jobs = jobs(workload(512, sequences=10))
    batches = micro_batches(the_jobs, 2048)
    assert [j for batch in batches for j in batch] == the_jobs
    assert all(sum(j.num_tokens for j in batch) <= 2048 or len(batch) == 1 for batch in batches)
