"""HTTP load for the benchmark, outside the server's process (as trainers are): N concurrent POST /logprobs.

    python -m benchmarks.client URL BODIES_FILE REPS [--mode asyncio|httpcore|plain|processes|plain-processes]
        [--frames]
        -> prints a JSON list of wall seconds per rep
    python -m benchmarks.client URL BODIES_FILE 0 --mode load --frames --rate R --seconds S --tasks N
        -> prints "ready" once connected, reads the start instant (time.perf_counter) from stdin,
           then prints a JSON object (poisson_load)
    python -m benchmarks.client URL BODY.json REPS --mode teacher|helper
        -> prints a JSON object (teacher_calls, helper_calls)

BODIES_FILE holds the request bodies, each after its length (8 bytes, little-endian): JSON, or with
`--frames` compact frames (service/wire/frame.py), whose answers are asked for and read as frames too.
Every round sends all of them at once and ends when the last answer is read and parsed. One warm-up
round (and the connections) comes first.

- `asyncio` (default): one process sends every body over its own connection from one asyncio loop,
  through httpx on logprobd's StreamTransport, as logprobd's AsyncClient does; the client's own
  per-request work is serialised.
- `httpcore`: the same on httpx's default async transport (httpcore's pool on anyio), which costs
  about 1 ms of the client's loop per concurrent request (service/client/transport.py).
- `plain`: what a trainer that does not use logprobd's client writes: a default `httpx.AsyncClient()`
  (httpcore's pool), each body posted with `json=` (the standard library's json.dumps, inside the
  round) and each answer read with `response.json()` (json.loads; with `distribution_format:
  "base64"` its blocks then decoded as docs/api.md shows: plain_read); JSON bodies only. `--timeline
  PATH` (here and in the process modes) writes when each round's requests were posted, read and
  parsed (benchmarks.probes.overhead lays them beside the server's events).
- `load`: continuous load (`poisson_load`): N tasks on one asyncio loop (logprobd's StreamTransport,
  one connection each), each sending bodies at the instants of a Poisson process of rate R / N, so
  the arrivals of all tasks are a Poisson process of rate R; a task whose previous request is still
  out sends as soon as it returns. Latency counts from the scheduled instant.
- `processes`: one client process per body, as N trainer ranks are, each with its own httpx.Client
  and keep-alive connection; a round starts at one instant of the shared monotonic clock
  (time.perf_counter is CLOCK_MONOTONIC on Linux) and lasts until the last process has its answer.
- `teacher`: TRL's teacher call (VLLMClient.get_sequence_logprobs): the one JSON body in BODY.json
  posted to /v1/completions by a fresh `httpx.Client` with `json=`, the answer read whole
  (`reply.content`), one call after another: ms to the last byte and to the status line.
- `helper`: the same distribution through logprobd's helper, service.client.teacher's
  get_sequence_logprobs (POST /logprobs in compact frames), timed to TRL's dict in hand.
- `plain-processes`: `processes` with each rank a plain trainer: a default `httpx.Client()`, its body
  (a dict of lists, built before the rounds) posted with `json=` and the answer read as `plain`
  reads it. Each rank encodes only its own body, as 8 trainer ranks on their own hosts do;
  `plain` encodes all of them one after another in one thread before its first socket write.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import multiprocessing as mp
import random
import statistics
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Literal

import httpcore
import httpx
import numpy as np
import orjson

from service.client.teacher import get_sequence_logprobs
from service.client.transport import StreamTransport
from service.client.wire import Scores, from_frame
from service.wire.frame import MEDIA_TYPE

JSON_HEADERS = {"content-type": "application/json"}
FRAME_HEADERS = {"content-type": MEDIA_TYPE, "accept": MEDIA_TYPE}
START_DELAY_S = 0.05  # from the parent's "go" to the round's start: every process is waiting by then


def write_bodies(path: Path, bodies: list[bytes]) -> None:
    path.write_bytes(b"".join(len(b).to_bytes(8, "little") + b for b in bodies))


def read_bodies(path: Path) -> list[bytes]:
    raw, bodies, at = path.read_bytes(), [], 0
    while at < len(raw):
        n = int.from_bytes(raw[at : at + 8], "little")
        bodies.append(raw[at + 8 : at + 8 + n])
        at += 8 + n
    return bodies


def _parse(content: bytes, frames: bool) -> None:
    """Read the answer as a trainer would: a frame as logprobd's client reads it (its Scores: lists,
    and numpy [window, K] blocks for top_ids / top_logprobs / candidate_logprobs), JSON with orjson."""
    if frames:
        Scores.from_body(from_frame(content))
    else:
        orjson.loads(content)


def plain_read(response: httpx.Response) -> Any:
    """A plain client's read of an answer: `response.json()`, and with `distribution_format: "base64"`
    its blocks decoded as docs/api.md shows (base64, then numpy of little-endian int32 / float32)."""
    body = response.json()
    for name, k in (body.get("columns") or {}).items():
        wire = "<i4" if name == "top_ids" else "<f4"
        body[name] = [np.frombuffer(base64.b64decode(row), wire).reshape(-1, k) for row in body[name]]
    return body


Timeline = list[dict[str, Any]]  # per round: its start and end, per request [posted, answer read, parsed];
# `plain`: when each connection first wrote to its socket in the round ("sent"; _WriteTimes); the
# processes: when each request's body was encoded ("encoded", in the requests' order) (time.perf_counter,
# the server's clock too)
Wire = Literal["json", "frames", "plain"]  # a rank's bodies: JSON bytes, compact frames, or json= of a dict


def _post(client: httpx.Client, body: Any, wire: Wire) -> list[float]:
    """One request as the rank's wire makes it: when it was posted, its body encoded (json= of the
    plain trainer's dict; bytes as they are otherwise), its answer read whole, and the answer parsed
    (time.perf_counter)."""
    posted = time.perf_counter()
    if wire == "plain":
        request = client.build_request("POST", "/logprobs", json=body)
    else:
        headers = FRAME_HEADERS if wire == "frames" else JSON_HEADERS
        request = client.build_request("POST", "/logprobs", content=body, headers=headers)
    encoded = time.perf_counter()
    r = client.send(request)
    read = time.perf_counter()
    r.raise_for_status()
    if wire == "plain":
        plain_read(r)
    else:
        _parse(r.content, wire == "frames")
    return [posted, read, time.perf_counter(), encoded]


def _rank(url: str, body: bytes, wire: Wire, conn: Connection) -> None:
    """One client process: for each start instant received, wait for it, send, report its times
    (_post's: posted, read, parsed, encoded)."""
    trainer_body = json.loads(body) if wire == "plain" else body  # the plain trainer's dict, built before
    with httpx.Client(base_url=url, timeout=600) as client:
        while (start := conn.recv()) is not None:
            while (left := start - time.perf_counter()) > 0:
                if left > 0.002:
                    time.sleep(left - 0.002)
            conn.send(_post(client, trainer_body, wire))


def cached_tokens(answer: dict[str, Any]) -> int:
    """The tokens the prefix cache served an answer: /logprobs' usage.cached_tokens or
    /v1/completions' usage.prompt_tokens_details.cached_tokens."""
    usage = answer.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    return int(usage.get("cached_tokens", details.get("cached_tokens", 0)))


Calls = list[tuple[str, dict[str, Any]]]  # a rank's calls, in order: (route, JSON body)


class Ranks:
    """Trainer ranks posting calls one after another, each a process of its own with a plain
    httpx.Client (`json=`, `response.json()`), spawned once and reused for every scenario and server
    (benchmarks.prefix_cache): `load` hands each rank its calls, `round` starts them at one instant
    (each rank after its delay) and returns, per rank, when its last answer was read and the tokens
    the cache served it. The ranks' code lives here, not there, so that a rank imports httpx, not
    torch (a spawned process still imports the parent's __main__: once, at start)."""

    def __init__(self, count: int) -> None:
        ctx = mp.get_context("spawn")
        pipes = [ctx.Pipe() for _ in range(count)]
        self._pipes = [parent for parent, _ in pipes]
        self._procs = [ctx.Process(target=_calls_rank, args=(child,), daemon=True) for _, child in pipes]
        for p in self._procs:
            p.start()
        for _, child in pipes:  # only the rank holds its end now: a rank that fails ends a round (EOFError)
            child.close()
        self._loaded = 0

    def load(self, url: str, calls: list[Calls]) -> None:
        """Rank i posts calls[i] to `url` each round from now on (the ranks beyond len(calls): none)."""
        if len(calls) > len(self._pipes):
            raise ValueError(f"{len(calls)} ranks' calls for a pool of {len(self._pipes)}")
        for pipe, mine in zip(self._pipes, calls, strict=False):
            pipe.send(("load", url, mine))
        self._loaded = len(calls)

    def round(self, start: float, delays: list[float]) -> list[tuple[float, int]]:
        """One round of the loaded ranks from `start` (time.perf_counter), rank i `delays[i]` s later."""
        pipes = self._pipes[: self._loaded]
        for pipe, delay in zip(pipes, delays, strict=True):
            pipe.send(("go", start, delay))
        ends: list[tuple[float, int]] = [pipe.recv() for pipe in pipes]
        return ends

    def close(self) -> None:
        for pipe in self._pipes:
            with contextlib.suppress(OSError):  # a rank that failed has closed its end
                pipe.send(None)
        for p in self._procs:
            p.join(timeout=10)

    def __enter__(self) -> Ranks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _calls_rank(conn: Connection) -> None:
    """A rank of `Ranks`: ("load", url, calls) sets what it posts; ("go", start, delay) posts its calls
    from start + delay and answers (when the last answer was read, the tokens the cache served)."""
    url: str = ""
    calls: Calls = []
    with httpx.Client(timeout=3600) as client:  # its pool keeps each server's connections apart
        while (order := conn.recv()) is not None:
            if order[0] == "load":
                _, url, calls = order
                continue
            _, start, delay = order
            while (left := start + delay - time.perf_counter()) > 0:
                time.sleep(min(left, 0.002))
            cached = 0
            for route, body in calls:
                reply = client.post(f"{url}{route}", json=body)
                reply.raise_for_status()
                cached += cached_tokens(reply.json())
            conn.send((time.perf_counter(), cached))


def in_processes(
    url: str, bodies: list[bytes], reps: int, wire: Wire, timeline: Timeline | None = None
) -> list[float]:
    """Wall seconds of each round after a warm-up, every body sent by its own process; each of those
    rounds' request times (posted, read, parsed; and `encoded`, apart) appended to `timeline`."""
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe() for _ in bodies]
    ranks = [
        ctx.Process(target=_rank, args=(url, body, wire, child), daemon=True)
        for body, (_, child) in zip(bodies, pipes, strict=True)
    ]
    for p in ranks:
        p.start()
    for _, child in pipes:  # only the rank holds its end now: a rank that fails ends the round with EOFError
        child.close()
    try:
        seconds = []
        for _ in range(reps + 1):  # the first round warms up
            start = time.perf_counter() + START_DELAY_S
            for parent, _ in pipes:
                parent.send(start)
            times: list[list[float]] = [parent.recv() for parent, _ in pipes]
            end = max(t[2] for t in times)
            seconds.append(end - start)
            if timeline is not None and len(seconds) > 1:
                requests, encoded = [t[:3] for t in times], [t[3] for t in times]
                timeline.append({"start": start, "end": end, "requests": requests, "encoded": encoded})
        return seconds[1:]
    finally:
        for parent, _ in pipes:
            with contextlib.suppress(OSError):  # a rank that failed has closed its end
                parent.send(None)
        for p in ranks:
            p.join(timeout=10)


async def _round(client: httpx.AsyncClient, bodies: list[bytes], frames: bool) -> float:
    async def one(body: bytes) -> None:
        r = await client.post("/logprobs", content=body, headers=FRAME_HEADERS if frames else JSON_HEADERS)
        r.raise_for_status()
        _parse(r.content, frames)

    start = time.perf_counter()
    await asyncio.gather(*(one(b) for b in bodies))
    return time.perf_counter() - start


class _Written(httpcore.AsyncNetworkStream):
    """A connection's socket stream that notes (its id, the time) of every write."""

    def __init__(self, inner: httpcore.AsyncNetworkStream, writes: list[tuple[int, float]]) -> None:
        self.inner, self.writes = inner, writes

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return await self.inner.read(max_bytes, timeout)

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self.writes.append((id(self), time.perf_counter()))
        await self.inner.write(buffer, timeout)

    async def aclose(self) -> None:
        await self.inner.aclose()

    def get_extra_info(self, info: str) -> Any:
        return self.inner.get_extra_info(info)


class _WriteTimes(httpcore.AsyncNetworkBackend):
    """httpcore's network backend, its streams noting their writes (the plain client's own otherwise)."""

    def __init__(self, inner: httpcore.AsyncNetworkBackend, writes: list[tuple[int, float]]) -> None:
        self.inner, self.writes = inner, writes

    async def connect_tcp(self, *args: Any, **kwargs: Any) -> httpcore.AsyncNetworkStream:
        return _Written(await self.inner.connect_tcp(*args, **kwargs), self.writes)

    async def sleep(self, seconds: float) -> None:
        await self.inner.sleep(seconds)


def _first_writes(writes: list[tuple[int, float]]) -> list[float]:
    """Each connection's first write, in time order."""
    first: dict[int, float] = {}
    for stream, at in writes:
        first.setdefault(stream, at)
    return sorted(first.values())


async def _plain_round(
    client: httpx.AsyncClient, bodies: list[Any], timeline: Timeline, writes: list[tuple[int, float]]
) -> float:
    requests: list[tuple[float, float, float]] = []
    writes.clear()

    async def one(body: Any) -> None:
        posted = time.perf_counter()
        r = await client.post("/logprobs", json=body)
        read = time.perf_counter()
        r.raise_for_status()
        plain_read(r)
        requests.append((posted, read, time.perf_counter()))

    start = time.perf_counter()
    await asyncio.gather(*(one(b) for b in bodies))
    end = time.perf_counter()
    timeline.append({"start": start, "end": end, "requests": requests, "sent": _first_writes(writes)})
    return end - start


async def _in_plain(url: str, bodies: list[bytes], reps: int, timeline: Timeline) -> list[float]:
    objects = [json.loads(b) for b in bodies]  # the trainer's dicts of lists, built before the round
    writes: list[tuple[int, float]] = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:  # only the timeout is not default
        pool = getattr(client._transport, "_pool", None)  # httpcore's pool: its sockets note their writes
        if pool is not None and hasattr(pool, "_network_backend"):
            pool._network_backend = _WriteTimes(pool._network_backend, writes)
        await _plain_round(client, objects, [], writes)
        return [await _plain_round(client, objects, timeline, writes) for _ in range(reps)]


async def _in_asyncio(
    url: str, bodies: list[bytes], reps: int, frames: bool, transport: httpx.AsyncBaseTransport | None
) -> list[float]:
    limits = httpx.Limits(max_connections=len(bodies))  # for httpcore's pool
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits, transport=transport) as client:
        await _round(client, bodies, frames)  # warm-up (and connections)
        return [await _round(client, bodies, frames) for _ in range(reps)]


def arrivals(  # noqa: PLR0917
    bodies: int, rate: float, seconds: float, tasks: int, seed: int, start: float
) -> list[list[tuple[float, int]]]:
    """Per task, the (instant, body index) of its requests: Poisson at rate / tasks from `start`."""
    rng = random.Random(seed)
    schedules = []
    for _ in range(tasks):
        at, mine = start, []
        while (at := at + rng.expovariate(rate / tasks)) < start + seconds:
            mine.append((at, rng.randrange(bodies)))
        schedules.append(mine)
    return schedules


async def poisson_load(
    url: str, bodies: list[bytes], *, rate: float, seconds: float, tasks: int, seed: int
) -> dict[str, Any]:
    """Open-loop load for `seconds` from the instant (time.perf_counter) read from stdin once the
    connections are open: per request, the body's index, its scheduled instant, when it was sent and
    answered; `loop_lag_s`: how late an idle task sent (this loop's own delay: it keeps up while
    that stays small)."""
    done: list[tuple[int, float, float, float]] = []  # body, scheduled, sent, answered
    lags: list[float] = []

    async def task(client: httpx.AsyncClient, schedule: list[tuple[float, int]]) -> None:
        for at, body in schedule:
            if (wait := at - time.perf_counter()) > 0:
                await asyncio.sleep(wait)
                lags.append(time.perf_counter() - at)
            sent = time.perf_counter()
            r = await client.post("/logprobs", content=bodies[body], headers=FRAME_HEADERS)
            r.raise_for_status()
            from_frame(r.content)
            done.append((body, at, sent, time.perf_counter()))

    transport = StreamTransport(max_connections=tasks, max_idle=tasks)
    async with httpx.AsyncClient(base_url=url, timeout=600, transport=transport) as client:
        await asyncio.gather(*(client.get("/health/live") for _ in range(tasks)))  # the connections
        print("ready", flush=True)
        start = float(await asyncio.to_thread(sys.stdin.readline))
        schedules = arrivals(len(bodies), rate, seconds, tasks, seed, start)
        await asyncio.gather(*(task(client, s) for s in schedules))
    return {"requests": done, "loop_lag_s": lags}


def teacher_call(url: str, body: dict[str, Any]) -> dict[str, float]:
    """One teacher call as TRL makes it: ms to the answer read whole (and to the status line), its
    bytes, and when it started, its last byte came (`received`) and it ended, once the client had
    joined the answer's pieces into one (time.perf_counter: CLOCK_MONOTONIC, the server process's clock
    too). The read is httpx's own `Response.read()`: the pieces its stream yields, joined."""
    seen: list[float] = []
    hooks = {"response": [lambda _: seen.append(time.perf_counter())]}
    with httpx.Client(base_url=url, timeout=600, event_hooks=hooks) as client:
        started = time.perf_counter()
        with client.stream("POST", "/v1/completions", json=body) as reply:
            pieces = list(reply.iter_bytes())
            received = time.perf_counter()
            content = b"".join(pieces)
            ended = time.perf_counter()
    reply.raise_for_status()
    return {
        "ms": (ended - started) * 1e3,
        "headers_ms": (seen[0] - started) * 1e3,
        "join_ms": (ended - received) * 1e3,
        "bytes": len(content),
        "started": started,
        "received": received,
        "ended": ended,
    }


def helper_calls(url: str, body: dict[str, Any], reps: int) -> dict[str, Any]:
    """The same teacher's distribution through logprobd's helper (service.client.teacher:
    POST /logprobs in compact frames, the completion positions only): `reps` calls after a warm-up,
    each timed to TRL's dict in hand, its prompt length 1 (every position after the first, the
    positions the teacher call's prompt_logprobs cover); median ms, and the entries of one dict."""
    prompts = body["prompt"]
    times: list[float] = []
    got: dict[str, list[Any]] = {}
    for _ in range(reps + 1):
        got = {}  # the last call's dict (millions of objects) freed before the clock starts, not in it
        started = time.perf_counter()
        got = get_sequence_logprobs(
            url, prompts, [1] * len(prompts), body["prompt_logprobs"], body.get("temperature", 1.0)
        )
        times.append((time.perf_counter() - started) * 1e3)
    return {
        "ms": statistics.median(times[1:]),
        "calls_ms": [round(t, 1) for t in times[1:]],
        "entries": sum(len(row) for seq in got["logprobs"] for row in seq),
    }


def teacher_calls(url: str, body: dict[str, Any], reps: int) -> dict[str, Any]:
    """Medians over `reps` teacher calls after a warm-up one."""
    made = [teacher_call(url, body) for _ in range(reps + 1)][1:]
    return {
        "ms": statistics.median(c["ms"] for c in made),
        "min_ms": min(c["ms"] for c in made),
        "headers_ms": statistics.median(c["headers_ms"] for c in made),
        "join_ms": statistics.median(c["join_ms"] for c in made),
        "calls_ms": [round(c["ms"], 1) for c in made],
        "bytes": made[0]["bytes"],
        "last": {k: made[-1][k] for k in ("started", "received", "ended")},
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.client")
    parser.add_argument("url")
    parser.add_argument("bodies", type=Path)
    parser.add_argument("reps", type=int)
    modes = ["asyncio", "httpcore", "plain", "processes", "plain-processes", "load", "teacher", "helper"]
    parser.add_argument("--mode", choices=modes, default="asyncio")
    parser.add_argument("--frames", action="store_true", help="the bodies are compact frames")
    parser.add_argument("--rate", type=float, help="load: requests/s of this process")
    parser.add_argument("--seconds", type=float, help="load: how long arrivals go on")
    parser.add_argument("--tasks", type=int, help="load: client tasks (one connection each)")
    parser.add_argument("--seed", type=int, default=0, help="load: of the arrival times and bodies")
    parser.add_argument(
        "--timeline", type=Path, help="plain, processes, plain-processes: each round's request times, as JSON"
    )
    args = parser.parse_args(argv)
    if args.mode in {"teacher", "helper"}:
        calls = teacher_calls if args.mode == "teacher" else helper_calls
        print(json.dumps(calls(args.url, json.loads(args.bodies.read_bytes()), args.reps)))
        return 0
    bodies = read_bodies(args.bodies)
    timeline: Timeline = []
    if args.mode == "load":
        if not args.frames:
            parser.error("--mode load sends compact frames: give --frames")
        load = poisson_load(
            args.url, bodies, rate=args.rate, seconds=args.seconds, tasks=args.tasks, seed=args.seed
        )
        print(json.dumps(asyncio.run(load)))
        return 0
    if args.mode in {"processes", "plain-processes"}:
        if args.mode == "plain-processes" and args.frames:
            parser.error("--mode plain-processes posts JSON: no --frames")
        wire: Wire = "plain" if args.mode == "plain-processes" else "frames" if args.frames else "json"
        seconds = in_processes(args.url, bodies, args.reps, wire, timeline)
    elif args.mode == "plain":
        seconds = asyncio.run(_in_plain(args.url, bodies, args.reps, timeline))
    else:
        transport = StreamTransport(max_connections=len(bodies)) if args.mode == "asyncio" else None
        seconds = asyncio.run(_in_asyncio(args.url, bodies, args.reps, args.frames, transport))
    if args.timeline is not None and args.mode in {"plain", "processes", "plain-processes"}:
        args.timeline.write_text(json.dumps(timeline))
    print(json.dumps(seconds))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
