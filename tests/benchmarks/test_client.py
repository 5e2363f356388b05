"""benchmarks.client's process ranks against a loopback stub: what each rank posts, and a failing
rank ending the round with an error instead of leaving the parent waiting."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from benchmarks.client import in_processes


@contextmanager
def stub(status: int) -> Iterator[tuple[str, list[tuple[str, bytes]]]]:
    """An HTTP server answering every POST with `status` and `{}`; yields its URL and what it got
    (content type, body)."""
    got: list[tuple[str, bytes]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["content-length"]))
            got.append((self.headers["content-type"], body))
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", got
    finally:
        server.shutdown()
        server.server_close()


def test_plain_ranks_post_their_own_body_as_json_each_round() -> None:
    bodies = [json.dumps({"sequences": [{"input_ids": [i, i + 1]}]}, indent=2).encode() for i in range(2)]
    with stub(200) as (url, got):
        seconds = in_processes(url, bodies, reps=2, wire="plain")
    assert len(seconds) == 2
    assert all(s > 0 for s in seconds)
    assert len(got) == 2 * 3  # two ranks, a warm-up round and two more
    assert {t for t, _ in got} == {"application/json"}
    # json= encodes the trainer's dict again: the same object, not the file's indented bytes
    assert sorted(json.dumps(json.loads(b), sort_keys=True) for _, b in got) == sorted(
        3 * [json.dumps(json.loads(b), sort_keys=True) for b in bodies]
    )
    assert not set(bodies) & {b for _, b in got}


def test_ranks_report_when_each_request_was_posted_encoded_read_and_parsed() -> None:
    bodies = [json.dumps({"sequences": [{"input_ids": [i] * 1000}]}).encode() for i in range(3)]
    timeline: list[dict[str, Any]] = []
    with stub(200) as (url, _):
        seconds = in_processes(url, bodies, reps=2, wire="plain", timeline=timeline)
    assert len(timeline) == 2  # the timed rounds, not the warm-up
    for r, s in zip(timeline, seconds, strict=True):
        assert r["end"] - r["start"] == pytest.approx(s)
        assert len(r["requests"]) == len(r["encoded"]) == 3
        for (posted, read, parsed), encoded in zip(r["requests"], r["encoded"], strict=True):
            assert r["start"] <= posted < encoded < read <= parsed <= r["end"]
        assert max(q[2] for q in r["requests"]) == r["end"]


def test_a_rank_whose_request_fails_ends_the_round_with_an_error() -> None:
    with stub(400) as (url, _), pytest.raises(EOFError):
        in_processes(url, [b'{"sequences": []}'], reps=1, wire="plain")
