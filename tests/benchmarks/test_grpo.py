"""CPU smoke test of the GRPO benchmark, and its workloads' token counts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.grpo import computed_tokens, main
from benchmarks.page.tables import CLIENT
from benchmarks.shapes import SHAPES
from benchmarks.workload import (
    Sample,
    floor_flops,
    grpo_long,
    grpo_short,
    multi_turn,
    one_level_tokens,
    unique_floor_flops,
    unique_tokens,
)
from tests.benchmarks.page_rows import page_rows


@pytest.mark.slow
def test_grpo_benchmark_runs_end_to_end_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "grpo.json"
    argv = ["--models", "tiny", "--device", "cpu", "--dtype", "float32", "--scale", "0.05"]
    assert main([*argv, "--share-min-tokens", "4", "--reps", "1", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert {"device", "date", "versions", "matmul_tflops", "settings"} <= set(result)
    tiny = result["models"]["tiny"]
    assert tiny["client"] == "frames"
    assert set(tiny["workloads"]) == {"grpo-short", "grpo-long", "multi-turn"}
    for w in tiny["workloads"].values():
        assert w["unique_tokens"] <= w["one_level_tokens"] <= w["tokens"]
        assert w["unique_floor_ms"] < w["floor_ms"]
        assert isinstance(w["speedup_sharing"], float)
        assert isinstance(w["speedup_vs_naive"], float)
        assert set(w["variants"]) == {"naive", "sharing_off", "sharing_on", "sharing_on_grouped"}
        for v in w["variants"].values():
            for key in ("ms", "tokens_per_s", "floor_fraction", "unique_floor_fraction", "peak_memory_gib"):
                assert isinstance(v[key], float)
            if "wire_bytes" not in v:  # the grouped variant: timing and bytes only
                assert v["max_abs_diff_vs_float32"] < 1e-4  # float32 here: equal to the reference
        wire = w["wire_bytes"]
        assert wire["json_grouped"] < wire["json"]
        assert wire["frames_grouped"] < wire["frames"]
        assert w["variants"]["sharing_on_grouped"]["wire_bytes"] == wire["frames_grouped"]
        assert w["variants"]["naive"]["rows"] == 8
        for served in (w["variants"]["sharing_off"], w["variants"]["sharing_on"]):
            assert len(served["rounds_ms"]) == 1
            assert "computed_tokens" in served  # null until the server reports it
            computed = served["computed_tokens"]
            # each request's part is rounded to a whole token
            assert computed is None or w["unique_tokens"] - 8 <= computed <= w["tokens"]
            # the server's micro-batches per round (the warm-up round too) and their tokens
            assert served["micro_batches_per_round"] >= 1
            assert 0 < served["micro_batch_tokens"] <= w["tokens"]
    multi = tiny["workloads"]["multi-turn"]
    assert multi["unique_tokens"] < multi["one_level_tokens"]  # the second level shares more
    rows = page_rows("grpo", out)  # the results page reads what the suite wrote
    assert [(r[1], r[2]) for r in rows] == [("tiny", w) for w in tiny["workloads"]]
    assert [r[7] for r in rows] == [
        f"{w['variants']['sharing_on']['ms']:,.1f}" for w in tiny["workloads"].values()
    ]


@pytest.mark.slow
@pytest.mark.parametrize("client", ["plain", "plain-processes"])
def test_grpo_benchmark_runs_with_the_plain_json_client(
    client: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "grpo.json"
    argv = ["--models", "tiny", "--device", "cpu", "--dtype", "float32", "--scale", "0.05", "--reps", "1"]
    assert main([*argv, "--share-min-tokens", "4", "--workloads", "grpo-short", "--client", client,
                 "--variants", "sharing_on", "--output", str(out)]) == 0  # fmt: skip
    tiny = json.loads(out.read_text())["models"]["tiny"]
    assert tiny["client"] == client
    w = tiny["workloads"]["grpo-short"]
    assert set(w["variants"]) == {"sharing_on", "sharing_on_grouped"}  # --variants: no peer, no unshared run
    assert "speedup_sharing" not in w
    assert "speedup_vs_naive" not in w
    # the grouped variant sent JSON: its bytes are the JSON bodies'
    assert w["variants"]["sharing_on_grouped"]["wire_bytes"] == w["wire_bytes"]["json_grouped"]
    served = w["variants"]["sharing_on"]
    assert served["max_abs_diff_vs_float32"] < 1e-4
    assert served["computed_tokens"] is None or served["computed_tokens"] <= w["tokens"]
    assert "| tiny | grpo-short | n/a | n/a |" in capsys.readouterr().out  # the speed-ups' table
    ((_, model, workload, by, *_),) = page_rows("plain", out)
    assert (model, workload, by) == ("tiny", "grpo-short", CLIENT[client])


def test_grpo_workloads_follow_the_issue() -> None:
    for make, prompts, (low, high) in ((grpo_short, 8, (256, 1024)), (grpo_long, 8, (2048, 4096))):
        samples = make(1000)
        assert samples == make(1000)  # fixed seed
        assert len(samples) == prompts * 8
        for g in range(prompts):
            group = samples[8 * g : 8 * g + 8]
            assert all(s.prompt == group[0].prompt for s in group)
            assert low <= len(group[0].prompt) <= high
        assert all(16 <= len(s.response) <= 1024 for s in samples)
        assert len({tuple(s.prompt) for s in samples}) == prompts


def test_multi_turn_shares_at_two_levels() -> None:
    samples = multi_turn(1000)
    assert len(samples) == 32
    for c in range(8):
        a, b, c2, d = samples[4 * c : 4 * c + 4]
        assert a.prompt == b.prompt  # first assistant turn + second user turn: per pair
        assert c2.prompt == d.prompt
        assert a.prompt != c2.prompt
        shared = next(i for i, (x, y) in enumerate(zip(a.prompt, c2.prompt, strict=False)) if x != y)
        assert 256 + 64 <= shared <= 512 + 256  # system prompt + first user turn: per conversation


def test_unique_and_one_level_tokens_count_a_trie() -> None:
    root, left, right = list(range(100)), [500 + i for i in range(10)], [700 + i for i in range(20)]
    tree = [
        Sample(root + left, [1, 2, 3]),
        Sample(root + left, [4, 5]),
        Sample(root + right, [6]),
        Sample(list(range(900, 950)), [7, 8]),  # alone
    ]
    assert unique_tokens(tree) == 100 + 10 + 3 + 2 + 20 + 1 + 52
    # one level: the root once, then each sequence's remainder (the pair's `left` twice)
    assert one_level_tokens(tree, min_shared=64) == 100 + (13 + 12 + 21) + 52
    # a shorter shared prefix than min_shared is not shared at all
    assert one_level_tokens(tree, min_shared=200) == sum(len(s.tokens) for s in tree)
    assert one_level_tokens([tree[0]], min_shared=1) == len(tree[0].tokens)


def test_unique_floor_counts_the_trie() -> None:
    shape = SHAPES["tiny"]
    hidden, layers, vocab = 64, 2, 512
    alone = [Sample(list(range(30)), list(range(30, 40)))]
    length = 40
    attention = 4.0 * layers * hidden * length * (length + 1) / 2
    assert unique_floor_flops(shape, 1000, alone) == 2.0 * 1000 * 40 + 2.0 * vocab * hidden * 10 + attention
    assert unique_floor_flops(shape, 1000, alone) == pytest.approx(floor_flops(shape, 1000, alone), rel=0.03)
    # a second response to the same prompt adds its own tokens and their attention only
    pair = [*alone, Sample(list(range(30)), list(range(100, 110)))]
    extra = 2.0 * 1000 * 10 + 2.0 * vocab * hidden * 10 + 4.0 * layers * hidden * sum(range(31, 41))
    assert unique_floor_flops(shape, 1000, pair) == unique_floor_flops(shape, 1000, alone) + extra


def test_computed_tokens_sums_usage_or_is_none() -> None:
    assert computed_tokens([{"usage": {"computed_tokens": 5}}, {"usage": {"computed_tokens": 7}}]) == 12
    assert computed_tokens([{"usage": {"input_tokens": 5}}, {"usage": {"computed_tokens": 7}}]) is None
