"""Through a real uvicorn on loopback: the same sequence scores the same whatever its layout,
padding side, batch neighbours, and however many requests arrive at once."""

from __future__ import annotations

import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from service.http.app import create_app
from tests.support import models
from tests.support.device import TOLERANCE, settings_for
from tests.support.reference import expected
from tests.support.servers import loopback

PAD = 0


@pytest.fixture(scope="module")
def server(model_dirs: dict[str, Path]) -> Iterator[str]:
    with loopback(create_app(settings_for(model_dirs["gemma2"], max_batch_tokens=96))) as url:
        yield url


def _sequence(rng: random.Random) -> tuple[list[int], int]:
    tokens = [rng.randrange(models.VOCAB) for _ in range(rng.randint(3, 30))]
    return tokens, rng.randint(1, len(tokens) - 1)


def _embed(layout: str, target: tuple[list[int], int], rng: random.Random) -> tuple[dict[str, Any], int]:
    """A request holding `target` at a random row among random neighbours."""
    rows = [_sequence(rng) for _ in range(rng.randint(0, 5))]
    at = rng.randint(0, len(rows))
    rows.insert(at, target)
    if layout == "ragged":
        return {"input_ids": [t for t, _ in rows], "num_actions": [n for _, n in rows]}, at
    prompts = [t[: len(t) - n] for t, n in rows]
    responses = [t[len(t) - n :] for t, n in rows]
    p_width, r_width = max(map(len, prompts)), max(map(len, responses))
    ids, mask = [], []
    for prompt, response in zip(prompts, responses, strict=True):
        left, right = p_width - len(prompt), r_width - len(response)
        ids.append([PAD] * left + prompt + response + [PAD] * right)
        mask.append([0] * left + [1] * (len(prompt) + len(response)) + [0] * right)
    if layout == "padded_response":
        return {"input_ids": ids, "attention_mask": mask, "response_length": r_width}, at
    action_mask = [[int(p_width <= c < p_width + len(r)) for c in range(1, len(m))] for m, r in
                   zip(mask, responses, strict=True)]  # fmt: skip
    return {"input_ids": ids, "attention_mask": mask, "action_mask": action_mask}, at


def _actions(body: dict[str, Any], row: int) -> list[float]:
    return [v for v, m in zip(body["logprobs"][row], body["action_mask"][row], strict=True) if m]


def test_same_sequence_same_scores_under_concurrency(server: str, reference_models: dict[str, Any]) -> None:
    rng = random.Random(7)
    targets = [_sequence(rng) for _ in range(6)]
    with httpx.Client(base_url=server, timeout=60) as client:
        alone = []
        for tokens, n in targets:
            r = client.post("/logprobs", json={"input_ids": [tokens], "num_actions": n})
            assert r.status_code == 200, r.text
            alone.append(r.json()["logprobs"][0])
    for (tokens, n), scores in zip(targets, alone, strict=True):
        want = expected(reference_models["gemma2"], {"input_ids": [tokens], "num_actions": n})
        np.testing.assert_allclose(scores, want.logprobs[0], atol=TOLERANCE, rtol=0)

    jobs = []
    for i in range(48):
        k = i % len(targets)
        request, row = _embed(rng.choice(["ragged", "padded_response", "padded_mask"]), targets[k], rng)
        jobs.append((k, request, row))

    def send(job: tuple[int, dict[str, Any], int]) -> tuple[int, list[float]]:
        k, request, row = job
        with httpx.Client(base_url=server, timeout=120) as c:
            r = c.post("/logprobs", json=request)
        assert r.status_code == 200, r.text
        return k, _actions(r.json(), row)

    with ThreadPoolExecutor(max_workers=16) as pool:
        results = list(pool.map(send, jobs))
    for k, scores in results:
        np.testing.assert_allclose(scores, alone[k], atol=1e-5, rtol=0)
    metrics = httpx.get(f"{server}/metrics").text
    assert "logprobd_batch_sequences_bucket" in metrics
