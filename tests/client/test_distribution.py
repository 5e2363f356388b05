"""Client and AsyncClient: top_logprobs, candidate_ids and sampling reach a real app (its JSON and
frame forms), and Scores carries the distribution fields, -inf where the JSON form wrote null."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import httpx
import numpy as np
import pytest

from service.client import AsyncClient, Client
from tests.client.conftest import serving

IDS = [[5, 9, 13, 40, 41, 77, 2, 8], [3, 3, 60, 61, 62]]


@pytest.mark.parametrize("frames", [False, True])
def test_client_asks_and_reads_the_distribution(model_dirs: dict[str, Path], frames: bool) -> None:
    with serving(model_dirs["qwen2"]) as url:
        client = Client(url, frames=frames)
        scores = client.score(
            IDS,
            num_actions=[4, 3],
            temperature=0.7,
            top_logprobs=3,
            candidate_ids=np.asarray([1, 2]),
            sampling={"top_k": 2, "top_p": 0.5},
        )
        plain = httpx.post(
            f"{url}/logprobs",
            json={"input_ids": IDS, "num_actions": [4, 3], "temperature": 0.7, "top_logprobs": 3},
        ).json()
        client.close()
    assert scores.top_ids == plain["top_ids"]
    assert scores.ranks == plain["ranks"]
    assert scores.candidate_logprobs is not None
    assert [len(row) for row in scores.candidate_logprobs] == [4, 3]
    assert scores.processed_logprobs is not None
    flat = [v for row in scores.processed_logprobs for v in row]
    assert all(isinstance(v, float) for v in flat)
    assert any(math.isinf(v) for v in flat) or all(v <= 0 for v in flat)
    rollout = scores.extra["rollout"]
    assert rollout["outside_kept_fraction"] == pytest.approx(sum(math.isinf(v) for v in flat) / len(flat))


def test_async_client_sends_the_same_fields(model_dirs: dict[str, Path]) -> None:
    sent: list[bytes] = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(request.content)
        body = {
            "model": "m",
            "logprobs": [[-1.0]],
            "action_mask": [[1]],
            "usage": {"input_tokens": 2, "scored_tokens": 1},
            "processed_logprobs": [[None]],
            "top_ids": [[[4]]],
        }
        return httpx.Response(200, json=body)

    async def run() -> None:
        client = AsyncClient("http://x", transport=httpx.MockTransport(answer), frames=False)
        scores = await client.score([[1, 4]], num_actions=1, top_logprobs=1, sampling={"min_p": 0.2})
        assert scores.processed_logprobs == [[-math.inf]]
        assert scores.top_ids == [[[4]]]
        await client.aclose()

    asyncio.run(run())
    assert b'"top_logprobs":1' in sent[0].replace(b" ", b"")
    assert b'"sampling":{"min_p":0.2}' in sent[0].replace(b" ", b"")
