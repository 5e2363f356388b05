"""Shared prefixes computed once, through the whole service, score equal to the per-sequence float32
reference.

Requests whose rows share prompts as GRPO groups do (all of a prompt, part of it, a prefix that ends
inside the action window, identical whole rows, a two-level conversation tree, strangers), in every
layout, for every architecture (sliding windows, soft-capping, both decoders), with a critic and a
reference model, across concurrent requests, beside a chunk of a long sequence, and in groups larger
than the budget. Each test also checks that the engine was given the shared prefixes (the sharing
really happened) and that usage.computed_tokens says what ran.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from service.core.prefixes import share
from tests.support import critics, models
from tests.support.device import TOLERANCE, VALUE_RTOL, eager, settings_for
from tests.support.launches import Served, serve
from tests.support.reference import (
    assert_values_close,
    check_reply,
    expected,
    max_diff,
    row_tokens_and_window,
)
from tests.support.requests import LAYOUTS, lay_out
from tests.support.servers import Reply

MIN_TOKENS = 8


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, models.VOCAB) for _ in range(n)]


def grpo_rows(rng: random.Random) -> list[tuple[list[int], list[int]]]:
    """(prompt, response) rows: a group sharing a whole prompt; two prompts sharing their first part;
    two rows sharing the prompt and the first response tokens (a prefix ending inside the action
    window); identical rows; a two-level conversation; a stranger; in a random order."""
    rows: list[tuple[list[int], list[int]]] = []
    prompt = _tokens(rng, rng.randint(10, 16))
    rows += [(prompt, _tokens(rng, rng.randint(1, 8))) for _ in range(4)]
    head = _tokens(rng, 9)
    for _ in range(2):
        other = head + _tokens(rng, rng.randint(1, 5))
        rows += [(other, _tokens(rng, rng.randint(1, 6))) for _ in range(2)]
    start = _tokens(rng, 3)
    prompt = _tokens(rng, 12)
    rows += [(prompt, start + _tokens(rng, rng.randint(1, 5))) for _ in range(2)]
    twin = (_tokens(rng, 11), _tokens(rng, 4))
    rows += [twin, twin]
    turn1 = _tokens(rng, 10)
    turn2 = turn1 + _tokens(rng, 6)
    rows += [(turn1, _tokens(rng, 3)), (turn2, _tokens(rng, 4)), (turn2, _tokens(rng, 2))]
    rows.append((_tokens(rng, 7), _tokens(rng, 5)))
    rng.shuffle(rows)
    return rows


def grpo_request(layout: str, rng: random.Random) -> dict[str, Any]:
    request = lay_out(layout, rng, grpo_rows(rng))
    request["temperature"] = rng.choice([1.0, 0.7, 1.6])
    request["return_entropy"] = rng.random() < 0.5
    if rng.random() < 0.5:
        request["eos_token_id"] = rng.randrange(3, models.VOCAB)
    return request


def unique_tokens(request: dict[str, Any]) -> int:
    """What the request's rows compute, their shared prefixes once (prefixes.share, which
    tests/core/test_prefixes.py checks against a brute-force count)."""
    rows = [np.asarray(row_tokens_and_window(request, i)[0]) for i in range(len(request["input_ids"]))]
    return share(rows, MIN_TOKENS).computed_tokens


@pytest.fixture(scope="module", params=models.ARCHITECTURES)
def served(request: pytest.FixtureRequest, model_dirs: dict[str, Path]) -> Iterator[tuple[str, Served]]:
    with serve(settings_for(model_dirs[request.param], share_min_tokens=MIN_TOKENS)) as s:
        yield request.param, s


@pytest.mark.parametrize("layout", LAYOUTS)
def test_shared_prefixes_equal_reference(
    served: tuple[str, Served], layout: str, reference_models: dict[str, Any]
) -> None:
    name, s = served
    rng = random.Random(f"sharing-{name}-{layout}")
    request = grpo_request(layout, rng)
    before = len(s.launches)
    reply = s.client.post("/logprobs", json=request)
    check_reply(reply, request, reference_models[name])
    usage = reply.json()["usage"]
    forests = s.forests(before)
    assert len(forests) == 1  # one micro-batch, the prefixes shared
    assert usage["computed_tokens"] == forests[0].computed_tokens == unique_tokens(request)
    assert usage["computed_tokens"] < usage["input_tokens"] - 40
    assert max(len(path) for path in forests[0].paths) >= 3  # the conversation's two levels


def test_transformers_decoder_shares_exactly(
    model_dirs: dict[str, Path], reference_models: dict[str, Any]
) -> None:
    settings = settings_for(model_dirs["qwen2"], share_min_tokens=MIN_TOKENS, decoder="transformers")
    with serve(settings) as s:
        assert s.client.get("/info").json()["decoder"] == "transformers"
        for layout in LAYOUTS:
            request = grpo_request(layout, random.Random(f"sharing-transformers-{layout}"))
            check_reply(s.client.post("/logprobs", json=request), request, reference_models["qwen2"])
        assert len(s.forests()) == len(LAYOUTS)


@pytest.mark.parametrize("fmt", critics.FORMATS)
def test_values_and_ref_logprobs_with_shared_prefixes(  # noqa: PLR0917 (fixtures)
    fmt: str,
    model_dirs: dict[str, Path],
    ref_dir: Path,
    ref_model: Any,
    reference_models: dict[str, Any],
    tmp_path: Path,
) -> None:
    critic_dir = critics.save(fmt, tmp_path / fmt)
    settings = settings_for(
        model_dirs["qwen2"], critic=critic_dir, ref_model=ref_dir, share_min_tokens=MIN_TOKENS
    )
    with serve(settings) as s:
        request = grpo_request("ragged_num_actions", random.Random(f"sharing-ppo-{fmt}"))
        request.update(return_values=True, return_ref_logprobs=True)
        reply = s.client.post("/logprobs", json=request)
        check_reply(reply, request, reference_models["qwen2"])
        body = reply.json()
        assert max_diff(body["ref_logprobs"], expected(ref_model, request).logprobs) <= TOLERANCE
        values = []
        for i, row_mask in enumerate(body["action_mask"]):
            tokens, window = row_tokens_and_window(request, i)
            per_position = critics.expected_values(critic_dir, tokens)
            values.append(
                [
                    per_position[p - 1] if m and p is not None else 0.0
                    for p, m in zip(window, row_mask, strict=True)
                ]
            )
        assert_values_close(body["values"], values, TOLERANCE, VALUE_RTOL)
        assert len(s.forests()) == 1


def test_concurrent_requests_share_and_split_the_computed_tokens(
    model_dirs: dict[str, Path], reference_models: dict[str, Any]
) -> None:
    """Two requests of the same prompts (two trainer ranks' halves of the same GRPO groups), sent
    together: one micro-batch computes each prompt once; each request's computed_tokens is its
    part, and the two parts sum to what ran."""
    rng = random.Random("sharing-concurrent")
    prompts = [_tokens(rng, 20) for _ in range(3)]
    halves = [
        {"input_ids": [p + _tokens(rng, 4) for p in prompts for _ in range(2)], "num_actions": 4}
        for _ in range(2)
    ]
    settings = settings_for(model_dirs["llama"], share_min_tokens=MIN_TOKENS, batch_wait_ms=300)
    with serve(settings) as s:
        with ThreadPoolExecutor(max_workers=2) as pool:
            replies = list(pool.map(lambda r: s.client.post("/logprobs", json=r), halves))
        for request, reply in zip(halves, replies, strict=True):
            check_reply(reply, request, reference_models["llama"])
        (forest,) = s.forests()
        assert forest.computed_tokens == 3 * 20 + 12 * 4
        computed = [r.json()["usage"]["computed_tokens"] for r in replies]
        assert sum(computed) == pytest.approx(forest.computed_tokens, abs=1)
        assert all(c < r.json()["usage"]["input_tokens"] for c, r in zip(computed, replies, strict=True))
        metrics = s.client.get("/metrics").text
        assert f"logprobd_computed_tokens_total {float(forest.computed_tokens)}" in metrics


@pytest.mark.parametrize("cache", [False, True], ids=["cache-off", "cache-on"])
def test_a_group_larger_than_the_budget_computes_its_prefix_once_per_micro_batch(
    model_dirs: dict[str, Path], reference_models: dict[str, Any], cache: bool
) -> None:
    """Without the prefix cache the second micro-batch computes the prompt again; with it, it reads the
    prompt's two whole blocks (32 tokens) the first one wrote and computes its last 8."""
    rng = random.Random("sharing-split")
    prompt = _tokens(rng, 40)
    request = {"input_ids": [prompt + _tokens(rng, 20) for _ in range(8)], "num_actions": 20}
    settings = settings_for(
        model_dirs["qwen3"], share_min_tokens=MIN_TOKENS, max_batch_tokens=128, prefix_cache=cache
    )
    with serve(settings) as s:
        reply = s.client.post("/logprobs", json=request)
        check_reply(reply, request, reference_models["qwen3"])
        # 40 + 8 x 20 = 200 tokens: two micro-batches of the prompt and 4 responses each
        second = 40 - 32 if cache else 40
        assert [f.computed_tokens for f in s.forests()] == [40 + 4 * 20, second + 4 * 20]
        assert len(s.launches) == 2
        usage = reply.json()["usage"]
        assert usage["computed_tokens"] == 40 + second + 8 * 20
        assert usage["cached_tokens"] == (4 * 32 if cache else 0)


def test_shared_prefixes_beside_a_chunk(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """A budget of 64: a long row goes in chunks, and each micro-batch also holds GRPO rows whose
    prefixes are shared; the chunk attends to its cached keys, the rows to their prefixes'."""
    directory = models.save("mistral", tmp_path / "mistral", max_position_embeddings=512)
    reference = eager(directory)
    rng = random.Random("sharing-chunk")
    prompt = _tokens(rng, 12)
    long = {"input_ids": [_tokens(rng, 400)], "num_actions": 300}
    groups = [{"input_ids": [prompt + _tokens(rng, 3) for _ in range(4)], "num_actions": 3} for _ in range(4)]
    settings = settings_for(directory, share_min_tokens=MIN_TOKENS, max_batch_tokens=64)
    with serve(settings, delay_s=0.01) as s:

        def post(request: dict[str, Any], pause: float) -> Reply:
            time.sleep(pause)
            reply: Reply = s.client.post("/logprobs", json=request)
            return reply

        with ThreadPoolExecutor(max_workers=5) as pool:
            futures = [pool.submit(post, long, 0.0)]
            futures += [pool.submit(post, g, 0.02 * (k + 1)) for k, g in enumerate(groups)]
            replies = [f.result() for f in futures]
        for request, reply in zip([long, *groups], replies, strict=True):
            check_reply(reply, request, reference)
        assert any(launch.forest and launch.chunk for launch in s.launches), "no shared rows beside a chunk"


def test_sharing_off(model_dirs: dict[str, Path], reference_models: dict[str, Any]) -> None:
    settings = settings_for(model_dirs["gemma2"], share_prefixes=False)
    with serve(settings) as s:
        assert s.client.get("/info").json()["share_prefixes"] is False
        request = grpo_request("padded_action_mask", random.Random("sharing-off"))
        reply = s.client.post("/logprobs", json=request)
        check_reply(reply, request, reference_models["gemma2"])
        assert s.forests() == []
        assert reply.json()["usage"]["computed_tokens"] == reply.json()["usage"]["input_tokens"]
