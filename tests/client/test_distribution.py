"""Client and AsyncClient: top_logprobs, candidate_ids and sampling reach a real app (its JSON and
frame forms, and JSON with `distribution_format: "base64"`), and Scores carries the distribution
fields (per row numpy [window, K] blocks from any form), -inf where the JSON form wrote null."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from service.client import AsyncClient, Client
from tests.support.servers import serving

IDS = [[5, 9, 13, 40, 41, 77, 2, 8], [3, 3, 60, 61, 62]]


@pytest.mark.parametrize("form", ["json", "base64", "frames"])
def test_client_asks_and_reads_the_distribution(model_dirs: dict[str, Path], form: str) -> None:
    with serving(model_dirs["qwen2"]) as url:
        client = Client(url, frames=form == "frames")
        options: dict[str, Any] = {"distribution_format": "base64"} if form == "base64" else {}
        scores = client.score(
            IDS,
            num_actions=[4, 3],
            temperature=0.7,
            top_logprobs=3,
            candidate_ids=np.asarray([1, 2]),
            sampling={"top_k": 2, "top_p": 0.5},
            **options,
        )
        plain = httpx.post(
            f"{url}/logprobs",
            json={
                "input_ids": IDS,
                "num_actions": [4, 3],
                "temperature": 0.7,
                "top_logprobs": 3,
                "candidate_ids": [1, 2],
            },
        ).json()
        client.close()
    assert scores.top_ids is not None
    assert scores.top_logprobs is not None
    for name, dtype, width in (
        ("top_ids", np.int64, 3),
        ("top_logprobs", np.float32, 3),
        ("candidate_logprobs", np.float32, 2),
    ):
        blocks = getattr(scores, name)
        assert blocks is not None
        assert [(b.dtype, b.shape) for b in blocks] == [(dtype, (4, width)), (dtype, (3, width))], name
        for got, want in zip(blocks, plain[name], strict=True):
            np.testing.assert_array_equal(got, np.asarray(want, dtype))  # float32 exactly, either form
    assert scores.ranks == plain["ranks"]
    assert "columns" not in scores.extra  # read, not passed on
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
            "top_logprobs": [[[None]]],  # JSON's -inf
        }
        return httpx.Response(200, json=body)

    async def run() -> None:
        client = AsyncClient("http://x", transport=httpx.MockTransport(answer), frames=False)
        scores = await client.score([[1, 4]], num_actions=1, top_logprobs=1, sampling={"min_p": 0.2})
        assert scores.processed_logprobs == [[-math.inf]]
        assert scores.top_logprobs is not None
        assert scores.top_logprobs[0].tolist() == [[-math.inf]]
        assert scores.top_ids is not None
        assert [b.tolist() for b in scores.top_ids] == [[[4]]]
        assert scores.top_ids[0].dtype == np.int64
        await client.aclose()

    asyncio.run(run())
    assert b'"top_logprobs":1' in sent[0].replace(b" ", b"")
    assert b'"sampling":{"min_p":0.2}' in sent[0].replace(b" ", b"")
