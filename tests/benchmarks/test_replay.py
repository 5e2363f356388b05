"""CPU smoke test of the routing-replay benchmark on the tiny MoE: frames and both JSON forms from a
plain client, each replay checked against the live scores (agreement 1.0) before it is timed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.replay import main
from tests.benchmarks.page_rows import page_rows


@pytest.mark.slow
def test_replay_benchmark_runs_every_form_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "replay.json"
    argv = ["--models", "tiny-moe", "--device", "cpu", "--dtype", "float32", "--sequences", "8"]
    argv += ["--reps", "1", "--json-forms", "base64", "lists", "--output", str(out)]
    argv += ["--json-client", "plain"]  # one client process (test_grpo runs the process per request)
    argv += ["--timeline", str(tmp_path / "timeline.json")]
    assert main(argv) == 0
    tiny = json.loads(out.read_text())["models"]["tiny-moe"]
    assert list(tiny["variants"]) == [
        "live",
        "record",
        "replay",
        "live_json",
        "record_base64",
        "replay_base64",
        "record_lists",
        "replay_lists",
    ]
    assert tiny["variants"]["live"]["cost_over_live"] == 0
    assert tiny["variants"]["live_json"]["cost_over_live"] == 0.0
    assert tiny["replay_vs_live_max_abs_diff"] < 1e-4  # float32: the recorded routes are the live ones
    assert tiny["replay_exact_agreement_min"] == 1.0
    assert 1 <= tiny["route_bytes_per_entry"] < 1.1  # one byte an entry (u1), and the rows' lengths
    base64_bytes = tiny["variants"]["replay_base64"]["request_bytes"]
    assert base64_bytes > tiny["variants"]["replay"]["request_bytes"]  # 4/3 x 4 bytes an id, not 1
    timelines = json.loads((tmp_path / "timeline.json").read_text())
    assert list(timelines) == list(tiny["variants"])
    for events in timelines.values():  # the last round: its 8 requests, each parsed, scored, answered
        whats = [e[0] for e in events]
        assert [whats.count(w) for w in ("headers", "body", "parse", "normalise", "render")] == [8] * 5
        assert whats.count("launch") >= 1
        assert whats.count("collected") == whats.count("launch")
        assert events[0][:2] == ["headers", 0.0]
        assert all(0 <= start <= end for _, start, end in events)
    for name, variant in tiny["variants"].items():  # a JSON round: the server's span, then the clients'
        if name.endswith(("_json", "_base64", "_lists")):
            sent = max(e[2] for e in timelines[name] if e[0] == "sent")
            assert variant["server_span_ms"] == sent
            assert variant["server_span_ms"] + variant["outside_server_ms"] == pytest.approx(
                variant["rounds_ms"][-1], abs=0.1
            )
            # the clients' part by their own times: before the first arrival, then the request that
            # ended the round read and parsed
            parts = ("to_first_arrival_ms", "last_read_after_sent_ms", "last_parse_ms")
            assert variant["to_first_arrival_ms"] > 0
            assert variant["last_parse_ms"] > 0
            # the last answer read once the server began handing answers over: its own record of the send
            # ends when its loop comes back, which on a busy machine can be after the client read it
            handed = min(e[1] for e in timelines[name] if e[0] == "sent")
            assert variant["server_span_ms"] + variant["last_read_after_sent_ms"] >= handed
            assert sum(variant[p] for p in parts) <= variant["outside_server_ms"] + 0.1
    (row,) = page_rows("replay", out)  # the results page reads what the suite wrote
    assert row[1] == "tiny-moe"
    _, split = page_rows("replay_json", out)  # the JSON forms, and their last rounds split
    replay_b64 = tiny["variants"]["replay_base64"]
    assert split[1:2] + split[4:5] == [
        "tiny-moe, last round: server / clients, ms",
        f"{replay_b64['server_span_ms']:,.1f} / {replay_b64['outside_server_ms']:,.1f} "
        f"(parse {replay_b64['last_parse_ms']:,.1f})",  # the plain client: one process, no encoding timed
    ]
    assert row[2].startswith(f"{tiny['variants']['live']['ms']:,.1f} (")


def test_a_json_replay_is_held_to_the_frame_replay_of_the_same_routes() -> None:
    from benchmarks.replay import RouteCheck

    exact = RouteCheck(agreement=1.0, max_abs_diff=0.0)
    assert exact.holds(RouteCheck(1.0, 5e-4))
    assert not exact.holds(RouteCheck(0.98, 0.0))  # float32: a route lost in the JSON form shows
    bf16 = RouteCheck(agreement=0.975, max_abs_diff=0.03)  # other micro-batches, near-ties flip
    assert bf16.holds(RouteCheck(0.977, 0.0285))
    assert not bf16.holds(RouteCheck(0.5, 0.03))  # routes read misaligned
    assert not bf16.holds(RouteCheck(0.975, 0.5))
