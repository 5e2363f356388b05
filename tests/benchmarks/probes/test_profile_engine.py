"""CPU smoke test of the engine profile (CPU operators stand in for kernels), and its arithmetic."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from benchmarks.probes.profile_engine import Interval, grown, idle_gaps, main, top_rows

CPU = ["--device", "cpu", "--dtype", "float32", "--scale", "0.05", "--share-min-tokens", "4"]


def check_variant(v: dict[str, object], top: int) -> None:
    assert isinstance(v["wall_ms"], float)
    assert v["wall_ms"] > 0
    assert isinstance(v["kernel_ms"], float)
    assert v["kernel_ms"] > 0
    assert v["idle_gap_ms"] is None  # no device: no gaps
    rows = v["top"]
    assert isinstance(rows, list)
    assert 0 < len(rows) <= top
    assert all(a["total_ms"] >= b["total_ms"] for a, b in itertools.pairwise(rows))
    assert sum(r["share"] for r in rows) <= 1 + 1e-9
    assert sum(r["total_ms"] for r in rows) <= v["kernel_ms"] + 1e-9


@pytest.mark.slow
def test_profile_runs_dense_variants_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    argv = ["--model", "tiny", "--workload", "grpo-short", "--variants", "plain", "invariant", "top100"]
    assert main([*argv, *CPU, "--top", "6", "--trace", str(tmp_path / "traces"), "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["device"] == "cpu"
    assert result["sequences"] == 64
    assert list(result["variants"]) == ["plain", "invariant", "top100"]
    for v in result["variants"].values():
        check_variant(v, 6)
    assert result["variants"]["invariant"]["engine"]["attention"] == "blocked"  # its own engine
    assert result["variants"]["plain"]["engine"]["attention"] == "sdpa"
    assert set(result["grown"]) == {"invariant", "top100"}
    # top_logprobs' selection runs only in the top100 round: it grows most there
    top100 = {r["name"]: r for r in result["grown"]["top100"]}
    assert "aten::topk" in top100
    assert top100["aten::topk"]["delta_ms"] > 0
    assert sorted(p.name for p in (tmp_path / "traces").iterdir()) == [
        "invariant.json",
        "plain.json",
        "top100.json",
    ]


@pytest.mark.slow
def test_profile_runs_record_and_replay_on_a_tiny_moe(tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    argv = ["--model", "tiny-moe", "--workload", "standard", "--sequences", "8"]
    assert main([*argv, *CPU, "--variants", "plain", "record", "replay", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert list(result["variants"]) == ["plain", "record", "replay"]
    for v in result["variants"].values():
        check_variant(v, 15)
    assert result["variants"]["replay"]["route_exact_fraction"] == 1.0  # the recorded routes, replayed


def test_record_and_replay_need_an_moe_model(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="need an MoE model"):
        main(["--model", "tiny", *CPU, "--variants", "plain", "replay", "--output", str(tmp_path / "x.json")])


def test_idle_gaps_count_time_no_stream_runs_past_the_threshold() -> None:
    intervals = [
        Interval(0, 10),
        Interval(5, 40),  # overlaps the first (another stream): no gap
        Interval(50, 60),  # 10 us after 40: under 20, not counted
        Interval(100, 110),  # 40 us idle
        Interval(200, 210),
        Interval(195, 198),  # listed late, starts earlier: 85 us idle after 110, then 2 us
    ]
    assert idle_gaps(intervals) == (40.0 + 85.0, 2)
    assert idle_gaps(intervals, threshold_us=5) == (10.0 + 40.0 + 85.0, 3)
    assert idle_gaps([]) == (0.0, 0)


def test_tables_rank_by_total_time_and_diffs_by_growth() -> None:
    base = {"gemm": {"calls": 4.0, "us": 3000.0}, "softmax": {"calls": 2.0, "us": 1000.0}}
    other = {"gemm": {"calls": 4.0, "us": 3500.0}, "topk": {"calls": 1.0, "us": 2000.0}}
    rows = top_rows(base, 1)
    assert rows == [{"name": "gemm", "calls": 4, "total_ms": 3.0, "share": 0.75}]
    diff = grown(base, other, 3)
    assert [r["name"] for r in diff] == ["topk", "gemm", "softmax"]
    assert [r["delta_ms"] for r in diff] == [2.0, 0.5, -1.0]
    assert diff[0]["base_calls"] == 0
    assert diff[0]["calls"] == 1
    assert diff[2]["calls"] == 0
    long = "k" * 200
    assert top_rows({long: {"calls": 1.0, "us": 1.0}}, 5)[0]["name"] == "k" * 70
