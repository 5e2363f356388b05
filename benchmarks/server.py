"""The real app on loopback and the rounds sent to it: what the suites that measure over HTTP share.

`HttpServer` serves an engine (already built, or built by a factory as the app starts) under uvicorn
in this process (`serve_process`: a `python -m service serve` process of its own); `http_bodies`
cuts a workload into the 8 clients' request bodies (compact frames, as logprobd's client sends them,
or JSON); `http_rounds` sends them all at once from client processes
(benchmarks/client.py) and returns each round's wall seconds; the server's /metrics histograms say
what it did meanwhile (`batch_counts`); `free_port` picks the loopback ports they listen on.
"""

from __future__ import annotations

import gc
import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson
import uvicorn

from benchmarks.client import write_bodies
from benchmarks.workload import Sample
from service.client.wire import group_prompts, to_frame
from service.engine.config import EngineConfig
from service.engine.scorer.engine import PackedScorer
from service.http.app import create_app
from service.settings import Settings

CLIENTS = 8


_HANDED: set[int] = set()
_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_port() -> int:
    """A loopback port no socket holds, below the kernel's ephemeral range, never handed out before
    by this process (the suites' servers and trainers' stores; the tests' too). Below that range
    because clients connect to it before anything listens there (a readiness poll; a replica's
    TCPStore client, told the port before its trainer's store is up): a connect that draws the
    destination port as its own source port connects to itself (TCP simultaneous open) and holds
    the port the listener is about to take."""
    low = int(_RANGE.read_text().split()[0]) if _RANGE.exists() else 32768
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(min(10_000, low - 1_000), low)
        if port in _HANDED:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED.add(port)
        return port
    raise RuntimeError(f"no free loopback port below {low}")


def freeze_client_data() -> None:
    """Move every object alive (the benchmark's own: bodies, routes as nested lists, millions of
    containers) to the interpreter's permanent generation. The server shares this process; its
    collections would otherwise walk them, where a server whose clients are other processes never
    does (the server freezes its own start-up objects at ready: service/core/heap.py)."""
    gc.collect()
    gc.freeze()


class HttpServer:
    """The real app under uvicorn on loopback, in this process, serving an already-built engine (or
    the one a factory builds as the app starts); the context's value is its URL, once ready and once
    the engine has captured the CUDA graphs it keeps for its idle time (an MoE policy's routed ones,
    which a server captures after ready: measured rounds are those of a server past them)."""

    def __init__(
        self, engine: PackedScorer | Callable[[EngineConfig], PackedScorer], settings: Settings
    ) -> None:
        self.port = free_port()
        self.engine: PackedScorer | None = None if callable(engine) else engine
        build = engine if callable(engine) else lambda _: engine

        def factory(config: EngineConfig) -> PackedScorer:
            self.engine = build(config)
            return self.engine

        app = create_app(settings, engine_factory=factory)
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.ready_at = self.settled_at = 0.0  # time.perf_counter() at ready, and once settled

    def __enter__(self) -> str:
        self.thread.start()
        url = f"http://127.0.0.1:{self.port}"
        for _ in range(6000):
            try:
                if httpx.get(f"{url}/health/ready").status_code == 200:
                    self.ready_at = time.perf_counter()
                    self._settle()
                    self.settled_at = time.perf_counter()
                    return url
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise TimeoutError("server not ready")

    def _settle(self, timeout: float = 600.0) -> None:
        """Wait for the engine's idle-time graphs (its batcher captures them while nothing runs)."""
        started = time.perf_counter()
        while (pending := getattr(self.engine, "pending_graphs", 0)) > 0:  # a stand-in engine: none
            if time.perf_counter() - started > timeout:
                raise TimeoutError(f"{pending} CUDA graphs still queued after {timeout:.0f} s")
            time.sleep(0.05)
        if (seconds := time.perf_counter() - started) > 0.1:
            print(f"  idle-time CUDA graphs captured {seconds:.1f} s after ready", file=sys.stderr)

    def __exit__(self, *_: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)


@contextmanager
def serve_process(
    argv: list[str], *, start_timeout: float, env: dict[str, str] | None = None, verbose: bool = False
) -> Iterator[str]:
    """`python -m service serve --port 0 <argv>` on loopback (`env` added to this one's), once ready:
    its URL; its log goes to stderr with `verbose`."""
    cmd = [sys.executable, "-m", "service", "serve", "--port", "0", *argv]
    environment = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=environment)
    found: list[str] = []
    started = threading.Event()

    def read() -> None:
        for line in proc.stderr or ():
            if match := re.search(r"listening on (http://\S+)", line):
                found.append(match.group(1))
                started.set()
            if verbose:
                sys.stderr.write(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        if not started.wait(start_timeout):
            raise TimeoutError("the server did not start")
        deadline = time.monotonic() + start_timeout
        while httpx.get(f"{found[0]}/health/ready").status_code != 200:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not become ready (exit status {proc.poll()})")
            time.sleep(0.2)
        yield found[0]
    finally:
        proc.terminate()
        proc.wait(timeout=120)
        reader.join(10)
        if proc.stderr is not None:
            proc.stderr.close()


def http_bodies(
    samples: list[Sample], frames: bool = True, per: int | None = None, grouped: bool = False
) -> list[bytes]:
    """The 8 clients' bodies (or bodies of `per` sequences): compact frames (what logprobd's client
    sends) or JSON; `grouped`: each distinct prompt of a body once (prompt_ids + prompt_index), the
    rows its responses (every response token an action, as num_actions says otherwise)."""
    per = per or len(samples) // CLIENTS or 1
    groups = [samples[i : i + per] for i in range(0, len(samples), per)]
    bodies: list[dict[str, Any]] = []
    for g in groups:
        if grouped:
            prompt_ids, prompt_index = group_prompts([s.prompt for s in g])
            bodies.append(
                {"prompt_ids": prompt_ids, "prompt_index": prompt_index, "input_ids": [s.response for s in g]}
            )
        else:
            bodies.append({"input_ids": [s.tokens for s in g], "num_actions": [len(s.response) for s in g]})
    if not frames:
        return [orjson.dumps(body) for body in bodies]
    framed = [to_frame(body) for body in bodies]
    assert all(f is not None for f in framed)
    return [f for f in framed if f is not None]


def http_rounds(
    url: str,
    bodies: list[bytes],
    reps: int,
    mode: str = "asyncio",
    frames: bool = True,
    *,
    timeline: Path | None = None,
    client_rounds: list[dict[str, Any]] | None = None,
) -> list[float]:
    """Wall seconds of each round of all bodies sent at once by a client in another process
    (client.py's `mode`), after a warm-up round; with `timeline` (the plain and process modes), its
    requests' times written there (client.py's --timeline); with `client_rounds`, those times
    appended to it, a round each."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bodies.bin"
        write_bodies(path, bodies)
        cmd = [sys.executable, "-m", "benchmarks.client", url, str(path), str(reps), "--mode", mode]
        if client_rounds is not None and timeline is None:
            timeline = Path(tmp) / "client.json"
        if timeline is not None:
            cmd += ["--timeline", str(timeline)]
        out = subprocess.run(
            [*cmd, "--frames"] if frames else cmd, capture_output=True, text=True, check=True
        )
        if client_rounds is not None and timeline is not None:
            client_rounds.extend(json.loads(timeline.read_text()))
    seconds: list[float] = json.loads(out.stdout)
    return seconds


def http_seconds(
    url: str, bodies: list[bytes], reps: int, mode: str = "asyncio", frames: bool = True
) -> float:
    """The median of http_rounds."""
    return statistics.median(http_rounds(url, bodies, reps, mode, frames))


def histogram_totals(url: str, name: str) -> tuple[float, float]:
    """(count, sum) of the server's histogram `name` so far, from its /metrics."""
    count = total = 0.0
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(f"{name}_count"):
            count = float(line.split()[-1])
        elif line.startswith(f"{name}_sum"):
            total = float(line.split()[-1])
    return count, total


def batch_counts(url: str) -> tuple[float, float]:
    """(micro-batches, their computed tokens) the server has collected so far."""
    return histogram_totals(url, "logprobd_batch_tokens")
