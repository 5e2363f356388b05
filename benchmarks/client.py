"""HTTP load for the benchmark, in its own process (as trainers are): N concurrent POST /logprobs.

    python -m benchmarks.client URL BODIES_FILE REPS   -> prints a JSON list of wall seconds per rep

BODIES_FILE holds one JSON request body per line; all are sent at once, each on its own connection.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import httpx
import orjson


async def _round(client: httpx.AsyncClient, bodies: list[bytes]) -> float:
    async def one(body: bytes) -> None:
        r = await client.post("/logprobs", content=body, headers={"content-type": "application/json"})
        r.raise_for_status()
        orjson.loads(r.content)

    start = time.perf_counter()
    await asyncio.gather(*(one(b) for b in bodies))
    return time.perf_counter() - start


async def _main(url: str, bodies: list[bytes], reps: int) -> list[float]:
    limits = httpx.Limits(max_connections=len(bodies))
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        await _round(client, bodies)  # warm-up (and connections)
        return [await _round(client, bodies) for _ in range(reps)]


def main(argv: list[str]) -> int:
    url, path, reps = argv[0], Path(argv[1]), int(argv[2])
    bodies = [line.encode() for line in path.read_text().splitlines() if line]
    print(json.dumps(asyncio.run(_main(url, bodies, reps))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
