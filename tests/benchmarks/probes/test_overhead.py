"""CPU smoke test of the server-side timeline benchmark: a GRPO round in-process and over HTTP from
the plain JSON client, each request's parse, the engine's launches and collections in the JSON."""

from __future__ import annotations

import gc
import itertools
import json
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from benchmarks.probes.overhead import client_split, main, recording_server, recording_stalls
from service.engine.decoder.graphs import GraphedDecoder
from service.http.completions import response as completions_response


@pytest.mark.slow
def test_a_grpo_round_in_process_and_over_plain_json(tmp_path: Path) -> None:
    out = tmp_path / "overhead.json"
    argv = ["--model", "tiny", "--device", "cpu", "--workload", "grpo-short", "--scale", "0.05"]
    assert main([*argv, "--clients", "plain", "--reps", "1", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    inside = result["in_process"]
    assert inside["micro_batches"] >= 1
    assert inside["host_ms"] == 0  # no HTTP: nothing parsed, normalised or rendered
    over = result["http"]["launch_hold_ms=25"]["plain"]
    assert over["host_ms"] > 0  # the 8 requests' parse, normalise and render were timed
    assert 0 < over["span_ms"] <= over["client_round_ms"]
    assert sum(over["micro_batch_tokens"]) == sum(inside["micro_batch_tokens"])  # the round's tokens
    # the plain client's timeline: its bodies reach the server after the round starts, and the round
    # ends after the last answer is rendered, read and parsed
    assert over["to_first_parse_ms"] > 0
    assert over["posting_ms"] >= 0
    assert over["after_last_render_ms"] >= over["last_read_after_render_ms"] > 0
    # when each of the 8 requests got to each step (k-th earliest, from the round's start): posted by
    # its client task, sent to its transport, handed to the app, its body read, parsed, normalised;
    # and the first launch
    steps = ["posted_ms", "sent_ms", "headers_ms", "body_ms", "parse_start_ms", "normalised_ms"]
    assert all(len(over[step]) == 8 for step in steps)
    for before, after in itertools.pairwise(steps[2:]):
        assert all(a <= b for a, b in zip(over[before], over[after], strict=True)), (before, after)
    assert over["posted_ms"][0] < over["sent_ms"][0] < over["headers_ms"][0]
    assert len(over["launch_ms"]) == over["micro_batches"]
    assert over["launch_ms"][0] >= over["normalised_ms"][0]


@pytest.mark.slow
def test_budgets_run_in_process_and_over_http_each(tmp_path: Path) -> None:
    out = tmp_path / "overhead.json"
    argv = ["--model", "tiny", "--device", "cpu", "--workload", "grpo-short", "--scale", "0.05"]
    budgets = ["--max-batch-tokens", "4096", "64"]
    assert main([*argv, *budgets, "--clients", "plain", "--reps", "1", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    large, small = (result["in_process"][f"max_batch_tokens={b}"] for b in (4096, 64))
    assert large["micro_batches"] == 1  # the whole round fits 4096 tokens
    assert small["micro_batches"] > 1
    assert max(small["micro_batch_tokens"]) <= 64
    # a group split over micro-batches computes its prompt in each
    assert sum(small["micro_batch_tokens"]) >= sum(large["micro_batch_tokens"])
    over = {b: result["http"][f"launch_hold_ms=25,max_batch_tokens={b}"]["plain"] for b in (4096, 64)}
    assert sum(over[4096]["micro_batch_tokens"]) == sum(large["micro_batch_tokens"])
    assert over[64]["micro_batches"] > 1
    assert max(over[64]["micro_batch_tokens"]) <= 64


def test_stalls_record_collections_and_captures_and_restore_the_originals() -> None:
    events: list[tuple[str, float, float]] = []
    saved = (GraphedDecoder._record, GraphedDecoder._record_checked, list(gc.callbacks), warnings.showwarning)
    with recording_stalls(events):
        gc.collect(1)
        gc.collect()
        decoder = GraphedDecoder.__new__(GraphedDecoder)  # a capture as met, its work stood in
        with pytest.raises(AttributeError):
            decoder._record(None)  # type: ignore[arg-type]
    kept = [what for what, _, _ in events if what != "gc0"]  # the interpreter's own collections aside
    assert kept == ["gc1", "gc2", "capture"]
    assert all(start <= end for _, start, end in events)
    after = (GraphedDecoder._record, GraphedDecoder._record_checked, list(gc.callbacks), warnings.showwarning)
    assert after == saved


def test_the_server_records_a_streamed_answers_choices_chunks_and_sends() -> None:
    """recording_server on the real app: a teacher call streamed a choice at a time shows each
    choice's submission, its chunks and the parts handed to uvicorn, and the bytes are the same."""
    events: list[tuple[str, float, float]] = []
    saved = completions_response.choice_stream
    plan = object()

    def choices(_plan: object, i: int, *_: object, **__: object) -> Iterator[bytes]:
        return iter([b"a%d" % i, b"b%d" % i])

    completions_response.choice_stream = choices  # type: ignore[assignment]
    try:
        with recording_server(events):
            recorded: Callable[..., Iterator[bytes]] = completions_response.choice_stream
            stream = recorded(plan, 3)
            assert list(stream) == [b"a3", b"b3"]
    finally:
        completions_response.choice_stream = saved
    assert [what for what, _, _ in events] == ["choice 3", "chunk 3", "chunk 3"]
    assert all(start <= end for _, start, end in events)


def test_the_clients_part_of_a_round_is_split_by_their_own_times() -> None:
    # three requests [posted, read, parsed], their bodies encoded at `encoded`; the server's last part
    # handed over at 10.0 s: the one parsed last ended the round
    client = {
        "start": 0.99,
        "requests": [[1.0, 10.002, 10.010], [1.0, 10.001, 10.030], [1.2, 10.004, 10.005]],
        "encoded": [1.005, 1.040, 1.210],
    }
    split = client_split(client, begin=1.05, span_s=8.95)  # the first headers at 1.05 s
    assert split["to_first_arrival_ms"] == pytest.approx(60.0)
    assert split["last_read_after_sent_ms"] == pytest.approx(1.0)
    assert split["last_parse_ms"] == pytest.approx(29.0)
    assert split["encode_ms_max"] == pytest.approx(40.0)
    # the three add up to the round (its start to the last parse) less the server's span
    assert sum(split[k] for k in ("to_first_arrival_ms", "last_read_after_sent_ms", "last_parse_ms")) == (
        pytest.approx((10.030 - 0.99 - 8.95) * 1e3)
    )
    untimed = {"start": 0.99, "requests": client["requests"]}  # the plain mode does not time encoding
    assert "encode_ms_max" not in client_split(untimed, begin=1.05, span_s=8.95)
