"""A real `python -m service serve --tensor-parallel-size 2` on loopback (CPU, gloo): it serves the
reference's scores; a rank killed takes the replica down (exit status non-zero, in bounded time);
SIGTERM drains and stops every rank (exit status 0)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.engine.tensor_parallel.ranks import EXIT_GRACE_S
from tests.support.reference import check_reply

pytestmark = pytest.mark.slow
BODY = {"input_ids": [[5, 6, 7, 8, 9, 40, 41], [10, 11, 12]], "num_actions": [5, 2], "return_entropy": True}
DIES_WITHIN_S = 30.0


@contextmanager
def serving(model: Path) -> Iterator[tuple[subprocess.Popen[str], str, int]]:
    """The server, once ready: its process, URL and rank 1's pid (from its start-up log)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "service", "serve", "--port", "0", "--device", "cpu", "--model", str(model),
         "--tensor-parallel-size", "2", "--batch-wait-ms", "0", "--drain-seconds", "0.5"],
        stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    found: dict[str, str] = {}
    started = threading.Event()

    def read() -> None:  # keeps the pipe drained for the whole run
        for line in proc.stderr or ():
            if match := re.search(r"started rank 1 of 2 \(pid (\d+)\)", line):
                found["rank1"] = match.group(1)
            if match := re.search(r"listening on (http://\S+)", line):
                found["url"] = match.group(1)
                started.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert started.wait(120), "the server did not start"
        deadline = time.monotonic() + 120
        while httpx.get(f"{found['url']}/health/ready").status_code != 200:
            assert proc.poll() is None, "the server exited"
            assert time.monotonic() < deadline, "the server did not become ready"
            time.sleep(0.1)
        yield proc, found["url"], int(found["rank1"])
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        reader.join(10)
        assert proc.stderr is not None
        proc.stderr.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/status").read_text().find("State:\tZ") == -1  # a zombie is gone


def test_serves_then_a_killed_rank_takes_the_replica_down(
    model_dirs: dict[str, Path], reference_models: dict[str, Any]
) -> None:
    with serving(model_dirs["qwen2"]) as (proc, url, rank1):
        check_reply(httpx.post(f"{url}/logprobs", json=BODY, timeout=60), BODY, reference_models["qwen2"])
        assert httpx.get(f"{url}/info").json()["tensor_parallel_size"] == 2
        os.kill(rank1, signal.SIGKILL)
        killed = time.monotonic()
        try:  # readiness fails while the server shuts down (or the port has closed already)
            deadline = killed + 5
            while (ready := httpx.get(f"{url}/health/ready", timeout=2)).status_code == 200:
                assert time.monotonic() < deadline, "still ready after a rank died"
                time.sleep(0.05)
            assert ready.json()["status"] == "failed"
        except httpx.TransportError:
            pass
        status = proc.wait(timeout=DIES_WITHIN_S)
        assert status != 0
        assert time.monotonic() - killed < DIES_WITHIN_S
    assert EXIT_GRACE_S < DIES_WITHIN_S


def test_sigterm_drains_and_stops_every_rank(model_dirs: dict[str, Path]) -> None:
    with serving(model_dirs["qwen2"]) as (proc, url, rank1):
        assert httpx.post(f"{url}/logprobs", json=BODY, timeout=60).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        deadline = time.monotonic() + 10
        while _alive(rank1):
            assert time.monotonic() < deadline, "rank 1 outlived the server"
            time.sleep(0.05)
