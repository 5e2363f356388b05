"""Soak: many concurrent clients against a real uvicorn on loopback for a bounded time, with good,
bad, cancelled and oversized requests mixed. Asserts no lost or wrong good answer, no 5xx, bounded
memory growth; prints requests sent, 5xx count, p50/p99 latency and RSS growth.

Short in CI; longer on demand:
    LOGPROBD_SOAK_SECONDS=600 LOGPROBD_SOAK_CLIENTS=64 pytest tests/e2e/test_soak.py -s
(LOGPROBD_SOAK_REPORT=path writes the figures as JSON).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import resource
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from service.http.app import create_app
from tests.support import models
from tests.support.device import TOLERANCE, settings_for
from tests.support.reference import expected
from tests.support.requests import LAYOUTS, make
from tests.support.servers import loopback

SECONDS = float(os.environ.get("LOGPROBD_SOAK_SECONDS", "8"))
CLIENTS = int(os.environ.get("LOGPROBD_SOAK_CLIENTS", "16"))
MAX_BODY = 64 * 1024


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * resource.getpagesize() / 2**20


@pytest.fixture(scope="module")
def server(model_dirs: dict[str, Path]) -> Iterator[str]:
    settings = settings_for(model_dirs["qwen2"], max_body_bytes=MAX_BODY, max_batch_tokens=256)
    with loopback(create_app(settings), log_level="error") as url:
        yield url


@dataclass
class Tally:
    sent: Counter[str] = field(default_factory=Counter)
    statuses: Counter[tuple[str, int]] = field(default_factory=Counter)  # (kind, status); 0: gave up
    wrong: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)


BAD = [
    b'{"input_ids": [[1, 2, 3]]',  # truncated
    b'{"input_ids": [[1, 2, 3]], "num_actions": 5}',
    b'{"input_ids": [[1, 2, 999999]], "num_actions": 1}',
    b'{"input_ids": "nope", "num_actions": 1}',
    b'{"input_ids": [[1, 2]], "num_actions": 1, "temperature": 0}',
]


OVERSIZED = json.dumps({"input_ids": [[1] * 40_000], "num_actions": 1}).encode()  # > MAX_BODY


async def _client(server: str, seed: int, pool: list[tuple[dict[str, Any], Any]], tally: Tally) -> None:
    r = random.Random(seed)
    deadline = time.monotonic() + SECONDS
    async with httpx.AsyncClient(base_url=server, timeout=60) as http:
        while time.monotonic() < deadline:
            kind = r.choices(["good", "bad", "cancel", "oversized"], weights=[70, 15, 10, 5])[0]
            tally.sent[kind] += 1
            request, want = r.choice(pool)
            if kind == "cancel":  # give up almost at once: the server must drop the work, not the others
                try:
                    await http.post("/logprobs", json=request, timeout=0.002)
                    tally.statuses[kind, 200] += 1
                except httpx.TimeoutException:
                    tally.statuses[kind, 0] += 1
                continue
            started = time.perf_counter()
            content = {"bad": r.choice(BAD), "oversized": OVERSIZED}.get(kind)
            reply = await (
                http.post("/logprobs", json=request)
                if content is None
                else http.post("/logprobs", content=content)
            )
            tally.statuses[kind, reply.status_code] += 1
            if kind != "good":
                continue
            tally.latencies.append(time.perf_counter() - started)
            body = reply.json() if reply.status_code == 200 else None
            if (
                body is None
                or body["action_mask"] != want.action_mask
                or any(
                    len(g) != len(w) or (g and np.max(np.abs(np.subtract(g, w))) > TOLERANCE)
                    for g, w in zip(body["logprobs"], want.logprobs, strict=True)
                )
            ):
                tally.wrong.append(f"{reply.status_code}: {reply.text[:200]}")


def test_soak(server: str, reference_models: dict[str, Any]) -> None:
    rng = random.Random(11)
    pool = []  # good requests with their expected answers
    for i in range(24):
        request = make(LAYOUTS[i % len(LAYOUTS)], rng, models.VOCAB, rows=rng.randint(1, 6))
        pool.append((request, expected(reference_models["qwen2"], request)))
    tally = Tally()
    rss_before = _rss_mib()

    async def main() -> None:
        await asyncio.gather(*(_client(server, seed, pool, tally) for seed in range(CLIENTS)))

    asyncio.run(main())
    rss_growth = _rss_mib() - rss_before
    latency = np.asarray(tally.latencies)
    figures = {
        "seconds": SECONDS,
        "clients": CLIENTS,
        "requests": sum(tally.sent.values()),
        "by_kind": dict(tally.sent),
        "statuses": {f"{kind} {status}": v for (kind, status), v in sorted(tally.statuses.items())},
        "server_errors": sum(v for (_, status), v in tally.statuses.items() if status >= 500),
        "lost_or_wrong": len(tally.wrong),
        "good_p50_ms": float(np.percentile(latency, 50) * 1e3),
        "good_p99_ms": float(np.percentile(latency, 99) * 1e3),
        "rss_growth_mib": rss_growth,
    }
    print("\nsoak:", json.dumps(figures))
    if os.environ.get("LOGPROBD_SOAK_REPORT"):
        Path(os.environ["LOGPROBD_SOAK_REPORT"]).write_text(json.dumps(figures, indent=2))
    assert tally.sent["good"] > 0
    assert figures["server_errors"] == 0
    assert tally.wrong == []
    assert {status for (kind, status) in tally.statuses if kind == "bad"} == {422}
    assert {status for (kind, status) in tally.statuses if kind == "oversized"} <= {413}
    assert rss_growth < 256, f"RSS grew by {rss_growth:.0f} MiB"
    metrics = httpx.get(f"{server}/metrics").text
    assert "logprobd_queue_requests 0.0" in metrics
    assert "logprobd_queue_tokens 0.0" in metrics
