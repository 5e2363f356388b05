"""AsyncClient gives what Client gives: scores, adapter tensors, retries and typed errors."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from service.client import AsyncClient, Client, LogprobdError, RetryPolicy, Scores
from service.client import adapters as ad
from tests.support.faults import FAST, AsyncFlaky, error_reply
from tests.support.frameworks import make_batch
from tests.support.reference import assert_scores
from tests.support.requests import ragged


def test_async_scores_equal_sync_scores(qwen2_replicas: tuple[str, str]) -> None:
    requests = [
        ragged(seed=6, rows=10),
        ragged(seed=7, rows=3) | {"return_entropy": True, "temperature": 0.8},
    ]

    async def run() -> list[Scores]:
        async with AsyncClient(list(qwen2_replicas), max_chunk_tokens=30) as client:
            await client.wait_ready(timeout=5)
            return list(await asyncio.gather(*(client.score(**r) for r in requests)))

    got = asyncio.run(run())
    with Client(list(qwen2_replicas), max_chunk_tokens=30) as client:
        want = [client.score(**r) for r in requests]
    for g, w in zip(got, want, strict=True):
        assert g.model == w.model
        assert g.action_mask == w.action_mask
        assert (g.usage.input_tokens, g.usage.scored_tokens) == (w.usage.input_tokens, w.usage.scored_tokens)
        np.testing.assert_allclose(np.concatenate(g.logprobs), np.concatenate(w.logprobs), atol=1e-5, rtol=0)
    assert got[1].entropy is not None
    assert want[1].entropy is not None
    np.testing.assert_allclose(
        np.concatenate(got[1].entropy), np.concatenate(want[1].entropy), atol=1e-5, rtol=0
    )
    assert got[0].entropy is None


def test_async_adapters_equal_sync_adapters(qwen2_replicas: tuple[str, str]) -> None:
    batch = make_batch("split", seed=8, rows=6)
    responses = batch.input_ids[:, -batch.window :]
    ids, mask = batch.input_ids, batch.attention_mask

    async def run() -> list[ad.TensorScores]:
        async with AsyncClient(list(qwen2_replicas), max_chunk_rows=2) as client:
            return [
                await ad.openrlhf_log_probs_async(
                    client, ids, mask, batch.action_mask, temperature=0.9, return_entropy=True
                ),
                await ad.verl_log_probs_async(
                    client, ids, mask, responses, temperature=0.9, calculate_entropy=True
                ),
                await ad.trl_log_probs_async(client, ids, mask, batch.window, compute_entropy=True),
            ]

    got = asyncio.run(run())
    with Client(list(qwen2_replicas), max_chunk_rows=2) as client:
        want = [
            ad.openrlhf_log_probs(client, ids, mask, batch.action_mask, temperature=0.9, return_entropy=True),
            ad.verl_log_probs(client, ids, mask, responses, temperature=0.9, calculate_entropy=True),
            ad.trl_log_probs(client, ids, mask, batch.window, compute_entropy=True),
        ]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.log_probs, w.log_probs, atol=1e-5, rtol=0)
        assert torch.equal(g.action_mask, w.action_mask)
        assert g.entropy is not None
        assert w.entropy is not None
        torch.testing.assert_close(g.entropy, w.entropy, atol=1e-5, rtol=0)
    assert want[1].log_probs.shape == (6, batch.window)


def test_async_retries_then_scores(qwen2_replicas: tuple[str, str], reference_models: dict[str, Any]) -> None:
    flaky = AsyncFlaky(
        [error_reply(429, "overloaded", retry_after="0.5"), httpx.ConnectError, error_reply(503, "x")]
    )
    request = ragged(seed=9, rows=4)

    async def run() -> tuple[Scores, float]:
        async with AsyncClient(qwen2_replicas[0], transport=flaky, retry=FAST) as client:
            started = time.monotonic()
            return await client.score(**request), time.monotonic() - started

    scores, elapsed = asyncio.run(run())
    assert len(flaky.script.bodies) == 4
    assert elapsed >= 0.5
    assert_scores(reference_models["qwen2"], request, scores.logprobs)


def test_async_422_is_typed_and_not_retried(qwen2_replicas: tuple[str, str]) -> None:
    flaky = AsyncFlaky([])

    async def run() -> None:
        async with AsyncClient(qwen2_replicas[0], transport=flaky, retry=RetryPolicy(backoff=0.01)) as client:
            await client.score([[1, 2, 3], [4, 5, 6]], num_actions=[1, 3])

    with pytest.raises(LogprobdError) as caught:
        asyncio.run(run())
    assert (caught.value.status, caught.value.field, caught.value.row) == (422, "num_actions", 1)
    assert len(flaky.script.bodies) == 1
