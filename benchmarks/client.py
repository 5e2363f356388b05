"""HTTP load for the benchmark, outside the server's process (as trainers are): N concurrent POST /logprobs.

    python -m benchmarks.client URL BODIES_FILE REPS [--mode asyncio|processes]
        -> prints a JSON list of wall seconds per rep

BODIES_FILE holds one JSON request body per line; every round sends all of them at once and ends
when the last answer is read and parsed. One warm-up round (and the connections) comes first.

- `asyncio` (default): one process sends every body over its own connection from one asyncio loop,
  so the client's own per-request work (httpx in Python, about 1 ms a request) is serialised.
- `processes`: one client process per body, as N trainer ranks are, each with its own httpx.Client
  and keep-alive connection; a round starts at one instant of the shared monotonic clock
  (time.perf_counter is CLOCK_MONOTONIC on Linux) and lasts until the last process has its answer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path

import httpx
import orjson

HEADERS = {"content-type": "application/json"}
START_DELAY_S = 0.05  # from the parent's "go" to the round's start: every process is waiting by then


def _post(client: httpx.Client, body: bytes) -> None:
    r = client.post("/logprobs", content=body, headers=HEADERS)
    r.raise_for_status()
    orjson.loads(r.content)


def _rank(url: str, body: bytes, conn: Connection) -> None:
    """One client process: for each start instant received, wait for it, send, report the end."""
    with httpx.Client(base_url=url, timeout=600) as client:
        while (start := conn.recv()) is not None:
            while (left := start - time.perf_counter()) > 0:
                if left > 0.002:
                    time.sleep(left - 0.002)
            _post(client, body)
            conn.send(time.perf_counter())


def in_processes(url: str, bodies: list[bytes], reps: int) -> list[float]:
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe() for _ in bodies]
    ranks = [
        ctx.Process(target=_rank, args=(url, body, child), daemon=True)
        for body, (_, child) in zip(bodies, pipes, strict=True)
    ]
    for p in ranks:
        p.start()
    try:
        seconds = []
        for _ in range(reps + 1):  # the first round warms up
            start = time.perf_counter() + START_DELAY_S
            for parent, _ in pipes:
                parent.send(start)
            ends = [parent.recv() for parent, _ in pipes]
            seconds.append(max(ends) - start)
        return seconds[1:]
    finally:
        for parent, _ in pipes:
            parent.send(None)
        for p in ranks:
            p.join(timeout=10)


async def _round(client: httpx.AsyncClient, bodies: list[bytes]) -> float:
    async def one(body: bytes) -> None:
        r = await client.post("/logprobs", content=body, headers=HEADERS)
        r.raise_for_status()
        orjson.loads(r.content)

    start = time.perf_counter()
    await asyncio.gather(*(one(b) for b in bodies))
    return time.perf_counter() - start


async def _in_asyncio(url: str, bodies: list[bytes], reps: int) -> list[float]:
    limits = httpx.Limits(max_connections=len(bodies))
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        await _round(client, bodies)  # warm-up (and connections)
        return [await _round(client, bodies) for _ in range(reps)]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.client")
    parser.add_argument("url")
    parser.add_argument("bodies", type=Path)
    parser.add_argument("reps", type=int)
    parser.add_argument("--mode", choices=["asyncio", "processes"], default="asyncio")
    args = parser.parse_args(argv)
    bodies = [line.encode() for line in args.bodies.read_text().splitlines() if line]
    if args.mode == "processes":
        seconds = in_processes(args.url, bodies, args.reps)
    else:
        seconds = asyncio.run(_in_asyncio(args.url, bodies, args.reps))
    print(json.dumps(seconds))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
