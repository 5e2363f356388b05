"""CPU smoke test of the distribution benchmark: the tiny model, the GRPO variants and both teacher
calls (from a client process), each answered in full, the call under a second budget and to a
server with a tokenizer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks import distribution
from benchmarks.workload import jobs, teacher, teacher_prompts
from tests.benchmarks.page_rows import page_rows


def test_distribution_benchmark_runs_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "distribution.json"
    argv = ["--models", "tiny", "--device", "cpu", "--dtype", "float32", "--scale", "0.05"]
    argv += ["--teacher-tokens", "64", "--reps", "1", "--output", str(out)]
    argv += ["--teacher-budgets", "16384", "256", "--json-forms", "lists", "base64"]
    argv += ["--json-client", "plain"]  # one client process (test_grpo runs the process per request)
    argv += ["--timeline", str(tmp_path / "timeline.json")]
    assert distribution.main(argv) == 0
    model = json.loads(out.read_text())["models"]["tiny"]
    assert set(model["grpo-short"]["variants"]) == {
        "plain",
        "top_logprobs_100",
        "top_logprobs_1000",
        "processed",
    }
    assert set(model["grpo-short"]["json"]) == {  # from a plain JSON client, the blocks in both forms
        "plain_json",
        "top_logprobs_100_json",
        "top_logprobs_100_base64",
        "top_logprobs_1000_json",
        "top_logprobs_1000_base64",
        "processed_json",
    }
    timelines = json.loads((tmp_path / "timeline.json").read_text())
    assert list(timelines) == [*model["grpo-short"]["json"], "teacher", "helper"]
    helper_events = [e[0] for e in timelines.pop("helper")]  # the helper's last call: 8 x 64 tokens,
    assert [helper_events.count(w) for w in ("headers", "body", "render")] == [1, 1, 1]  # one request
    teacher_events = [e[0] for e in timelines.pop("teacher")]  # the last timed call: one request
    assert [teacher_events.count(w) for w in ("headers", "body")] == [1, 1]
    assert teacher_events.count("collected") == teacher_events.count("launch") >= 1
    assert teacher_events.count("sent") >= 1  # the answer handed to uvicorn
    for events in timelines.values():  # the last round: its 8 requests (a GRPO group each), scored, answered
        whats = [e[0] for e in events]
        assert [whats.count(w) for w in ("headers", "body", "parse", "normalise", "render")] == [8] * 5
        assert whats.count("collected") == whats.count("launch") >= 1
    for name, variant in model["grpo-short"]["json"].items():  # the last round: the server's span, the rest
        assert variant["server_span_ms"] == max(e[2] for e in timelines[name] if e[0] == "sent")
        assert 0 < variant["server_span_ms"] <= variant["rounds_ms"][-1] + 0.1
        # the rest by the client's own times: before the first arrival, then the round's last answer
        # read after the server's last part and parsed (the plain mode's round ends a little after,
        # as its gather returns)
        parts = ("to_first_arrival_ms", "last_read_after_sent_ms", "last_parse_ms")
        assert variant["to_first_arrival_ms"] > 0
        assert variant["last_parse_ms"] > 0
        # the last answer read once the server began handing answers over: its own record of the send
        # ends when its loop comes back, which on a busy machine can be after the client read it
        handed = min(e[1] for e in timelines[name] if e[0] == "sent")
        assert variant["server_span_ms"] + variant["last_read_after_sent_ms"] >= handed
        assert sum(variant[p] for p in parts) <= variant["outside_server_ms"] + 0.1
    lists = [e[0] for e in timelines["top_logprobs_100_json"] if e[0].startswith("lists")]
    assert sorted(lists) == ["lists top_ids"] * 8 + ["lists top_logprobs"] * 8  # within each render
    teacher = model["teacher"]
    split = [teacher[k] for k in ("client_before_ms", "server_ms", "client_after_ms")]
    assert split[0] > 0  # the last call: the client's encoding, the server, its reading
    assert split[1] > 0
    assert split[1] + teacher["client_read_ms"] > 0  # (read a little before the server's record of its send)
    assert sum(split) <= max(teacher["calls_ms"]) + 1.0
    # after the server's last part: the client reading what was left, then joining the pieces
    assert teacher["client_read_ms"] + teacher["client_join_ms"] == pytest.approx(teacher["client_after_ms"])
    assert teacher["client_join_ms"] > 0
    assert teacher["join_ms"] > 0
    assert (
        teacher["entries"] >= 8 * 63 * 100
    )  # every scored position's top 100 (and the token, where not among them)
    assert teacher["ms"] > 0
    # the same distribution through logprobd's helper, to TRL's dict: every scored position's K
    assert teacher["helper"]["ms"] > 0
    assert teacher["helper"]["entries"] == 8 * 63 * 100
    assert teacher["drawing"]["ms"] > 0
    # the call again under a budget of 256 tokens: 8 prompts of 64 in two micro-batches
    assert [b["max_batch_tokens"] for b in teacher["budgets"]] == [16384, 256]
    assert all(b["ms"] > 0 for b in teacher["budgets"])
    # TRL's call again with a tokenizer beside the checkpoint: every entry's decoded_token a word
    assert teacher["tokenizer"]["ms"] > 0
    # "t<id>" rather than null: a byte more an entry at least
    assert teacher["tokenizer"]["answer_bytes"] >= teacher["answer_bytes"] + teacher["entries"]
    results_page_reads_it(out, model)


def results_page_reads_it(out: Path, model: dict[str, Any]) -> None:
    """The results page's rows from what the suite wrote: the teacher's last call split (its join,
    the in-process scoring and logprobd's helper beside it), and the JSON forms' last rounds."""
    teacher = model["teacher"]
    row, split_row = page_rows("distribution", out)
    assert row[1:3] == ["tiny", f"{model['grpo-short']['variants']['plain']['ms']:,.1f}"]
    rest = teacher["client_before_ms"] + teacher["client_after_ms"]
    helper = teacher["helper"]
    assert split_row[1:2] + split_row[6:8] == [
        "tiny, last round: server / clients, ms",
        f"{teacher['server_ms']:,.1f} / {rest:,.1f} (join {teacher['client_join_ms']:,.1f})",
        f"in-process {teacher['in_process_ms']:,.1f}; helper {helper['ms']:,.1f} "
        f"({helper['floor_fraction'] * 100:.1f} %)",
    ]
    forms, forms_split = page_rows("distribution_json", out)  # its JSON forms, each over plain JSON
    lists = model["grpo-short"]["json"]["top_logprobs_100_json"]
    server, clients, parse = (lists[k] for k in ("server_span_ms", "outside_server_ms", "last_parse_ms"))
    assert forms_split[4] == f"{server:,.1f} / {clients:,.1f} (parse {parse:,.1f})"
    plain = model["grpo-short"]["json"]["plain_json"]
    assert forms[1:4] == [
        "tiny",
        "one process",
        f"{plain['ms']:,.1f} ({plain['unique_floor_fraction'] * 100:.1f} %)",
    ]
    assert all(cell.endswith(" %)") for cell in forms[4:9])  # lists and base64 of top-100 and 1000, processed


def test_teacher_workload_scores_every_position_of_the_calls_prompts_after_the_first() -> None:
    prompts = teacher_prompts(1000, 4096)
    assert len(prompts) == 8
    assert all(len(p) == 4096 and min(p) >= 0 and max(p) < 1000 for p in prompts)
    samples = teacher(1000)
    assert [s.tokens for s in samples] == prompts  # the call's own prompts (seed 13)
    for job in jobs(samples):
        assert job.actions.tolist() == list(range(1, 4096))  # prompt_logprobs: position 0 has none
    assert [len(s.tokens) for s in teacher(1000, 0.01)] == [41] * 8
