"""CPU smoke test of the prefix cache's benchmark: every scenario with the cache on and off, and what
the cache does to the tokens computed (the targets themselves are the GPU run's)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from benchmarks.prefix_cache import SCENARIOS, main, split_grpo, teacher, trajectories
from benchmarks.workload import unique_tokens
from tests.benchmarks.page_rows import page_rows


def test_the_scenarios_hold_what_the_issue_names() -> None:
    grpo = split_grpo(512, 1.0)
    assert len(grpo.ranks) == 8
    assert all(len(calls) == 1 and len(calls[0][1]["input_ids"]) == 8 for calls in grpo.ranks)
    assert all(2048 <= len(s.prompt) <= 4096 for s in grpo.samples)
    steps = trajectories(512, 1.0)
    assert [len(calls) for calls in steps.ranks] == [6] * 8
    first = steps.ranks[0]
    assert len(first[0][1]["input_ids"][0]) >= 8192 + 500
    for (_, a), (_, b) in itertools.pairwise(first):
        before, after = a["input_ids"][0], b["input_ids"][0]
        assert after[: len(before)] == before
        assert 500 <= len(after) - len(before) <= 2000
    calls = teacher(512, 1.0)
    prompts = [body["prompt"][0] for rank in calls.ranks for _, body in rank]
    assert len(prompts) == 64
    assert {len(p) for p in prompts} == {4096}
    assert unique_tokens(calls.samples) == 3072 + 64 * 1024


@pytest.mark.slow
def test_the_benchmark_runs_end_to_end_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "cache.json"
    argv = ["--models", "tiny", "--device", "cpu", "--dtype", "float32", "--scale", "0.02", "--reps", "1"]
    assert main([*argv, "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert (result["suite"], result["gpus"]) == ("prefix_cache", 0)
    assert result["command"] == "python -m benchmarks.prefix_cache " + " ".join(argv)
    scenarios = result["models"]["tiny"]["scenarios"]
    assert set(scenarios) == set(SCENARIOS)
    for name, r in scenarios.items():
        on, off = r["variants"]["cache_on"], r["variants"]["cache_off"]
        assert off["cached_tokens"] == 0
        assert off["computed_per_unique"] >= on["computed_per_unique"] * 0.99
        assert on["unique_floor_fraction"] > 0
        if name in {"split-grpo", "trajectories", "teacher"}:
            assert on["cached_tokens"] > 0, name
            assert on["computed_per_unique"] < off["computed_per_unique"], name
    rows = page_rows("prefix_cache", out)  # the results page reads what the suite wrote
    assert [row[2] for row in rows] == list(SCENARIOS)
    for (_, model, _, unique, on_ms, *_), r in zip(rows, scenarios.values(), strict=True):
        assert (model, unique) == ("tiny", f"{r['unique_tokens']:,}")
        assert on_ms.startswith(f"{r['variants']['cache_on']['ms']:,.1f} (")
