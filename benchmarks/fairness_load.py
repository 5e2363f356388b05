"""The fairness load of benchmarks.long, in a process of its own (it imports httpx, not torch):
closed-loop short requests, one client task per short body, for SECONDS after a warm-up, optionally
beside a stream of long sequences; prints the shorts' latencies and the long sequences done (JSON).

    python -m benchmarks.fairness_load URL SHORT_BODIES SECONDS [--long LONG_BODIES]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.client import FRAME_HEADERS, read_bodies


async def load(url: str, shorts: list[bytes], longs: list[bytes], seconds: float) -> dict[str, Any]:
    latencies: list[float] = []
    long_done = 0
    end = 0.0  # `seconds` from the end of the warm-up

    async def short(client: httpx.AsyncClient, body: bytes) -> None:
        while True:  # at least one request each
            start = time.perf_counter()
            reply = await client.post("/logprobs", content=body, headers=FRAME_HEADERS)
            reply.raise_for_status()
            latencies.append(time.perf_counter() - start)
            if start > end:
                return

    async def stream(client: httpx.AsyncClient) -> None:
        nonlocal long_done
        i = 0
        while time.perf_counter() < end:
            reply = await client.post("/logprobs", content=longs[i % len(longs)], headers=FRAME_HEADERS)
            reply.raise_for_status()
            long_done += 1
            i += 1

    limits = httpx.Limits(max_connections=len(shorts) + 1)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        for body in shorts:  # warm-up: connections, and every short shape once
            (await client.post("/logprobs", content=body, headers=FRAME_HEADERS)).raise_for_status()
        end = time.perf_counter() + seconds
        tasks = [short(client, body) for body in shorts] + ([stream(client)] if longs else [])
        await asyncio.gather(*tasks)
    return {"short_latencies_s": latencies, "long_done": long_done}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fairness_load", description=__doc__)
    parser.add_argument("url")
    parser.add_argument("short_bodies", type=Path)
    parser.add_argument("seconds", type=float)
    parser.add_argument("--long", type=Path, help="long sequences' bodies, posted one after another")
    args = parser.parse_args(argv)
    longs = read_bodies(args.long) if args.long else []
    print(json.dumps(asyncio.run(load(args.url, read_bodies(args.short_bodies), longs, args.seconds))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
