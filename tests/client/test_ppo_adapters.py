"""Critic values, reference log-probs, KL and rollout mismatch through each adapter, on a real server
started with `--critic` and `--ref-model`, against the per-sequence reference of docs/semantics.md
(`frameworks.by_column`: each unpadded sequence scored alone, every score at the column of the token
it scores). Each framework's output is the columns it keeps: OpenRLHF columns 1..L-1 (the last A of
them), verl and TRL the last R columns; 0.0 off the mask.
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import httpx
import pytest
import torch

from service.client import AsyncClient, Client, LogprobdError
from service.client import adapters as ad
from service.client._plans import Asked, openrlhf_plan
from service.client.adapters import TensorScores
from tests.support.device import TOLERANCE
from tests.support.faults import sent_body
from tests.support.frameworks import LAYOUTS, Batch, by_column, kl, make_batch
from tests.support.servers import PpoServer, with_critics

CRITICS = ("openrlhf", "token_classification")
ADAPTERS = ("openrlhf", "verl", "trl")
ESTIMATORS = ("k1", "k2", "k3")
TEMPERATURES = (0.7, 1.0, 1.3)


def window(adapter: str, batch: Batch, full: torch.Tensor) -> torch.Tensor:
    """The framework's columns of a `[B, L]` by-column tensor."""
    if adapter == "openrlhf":
        return full[:, 1:][:, -batch.action_mask.shape[1] :]  # action_mask[:, j] is about column j+1
    return full[:, -batch.window :]  # verl responses / TRL logits_to_keep: the last R columns


def framework_mask(adapter: str, batch: Batch) -> torch.Tensor:
    if adapter == "openrlhf":
        return batch.action_mask
    return batch.attention_mask[:, -batch.window :].bool()  # verl response_mask, TRL completion_mask


def score(adapter: str, client: Client, batch: Batch, **kwargs: Any) -> TensorScores:
    if adapter == "openrlhf":
        return ad.openrlhf_log_probs(
            client, batch.input_ids, batch.attention_mask, batch.action_mask, **kwargs
        )
    if adapter == "verl":
        responses = batch.input_ids[:, -batch.window :]
        return ad.verl_log_probs(client, batch.input_ids, batch.attention_mask, responses, **kwargs)
    return ad.trl_log_probs(client, batch.input_ids, batch.attention_mask, batch.window, **kwargs)


def check(got: torch.Tensor | None, want: torch.Tensor, mask: torch.Tensor, tol: float = TOLERANCE) -> None:
    """float32 of the framework's shape; within `tol` on the mask, exactly 0.0 off it."""
    assert got is not None
    assert got.dtype == torch.float32
    assert got.shape == want.shape == mask.shape
    torch.testing.assert_close(got[mask].double(), want[mask], atol=tol, rtol=0)
    assert torch.equal(got[~mask], torch.zeros_like(got[~mask]))
    assert mask.any()


def kl_tolerance(log_probs: torch.Tensor, ref: torch.Tensor, estimator: str, mask: torch.Tensor) -> float:
    """A KL estimate moves by |dk/dr| times an error in r = lp - ref: 1 (k1), |r| (k2), |1 - exp(-r)|
    (k3); at |r| = 13 a k2 of 85 is only as exact as float32 makes r times 13."""
    r = (log_probs - ref)[mask]
    slope = {"k1": torch.ones_like(r), "k2": r.abs(), "k3": torch.expm1(-r).abs()}[estimator]
    return TOLERANCE * max(1.0, float(slope.max()))


def noisy_rollout(log_probs: torch.Tensor, mask: torch.Tensor, seed: int) -> torch.Tensor:
    """What an inference engine might report: the true log-probs plus noise, NaN off the mask."""
    noise = torch.randn(log_probs.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return torch.where(mask, log_probs + 0.5 * noise, torch.full_like(log_probs, math.nan)).float()


@with_critics(*CRITICS)
@pytest.mark.parametrize("prompts", [None, 3], ids=["own_prompts", "grouped"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("adapter", ADAPTERS)
def test_values_ref_log_probs_and_kl_equal_the_reference(  # noqa: PLR0917 (pytest's parameters)
    ppo_server: PpoServer,
    reference_models: dict[str, Any],
    ref_model: Any,
    adapter: str,
    layout: str,
    prompts: int | None,
) -> None:
    """`grouped`: 7 rows of 3 prompts, which the adapter sends grouped."""
    a, k = ADAPTERS.index(adapter), LAYOUTS.index(layout)
    batch = make_batch(layout, seed=40 + 3 * a + k, rows=7 if prompts else 5, prompts=prompts)
    estimator, temperature = ESTIMATORS[(a + k) % 3], TEMPERATURES[k]
    want = by_column(batch, reference_models["qwen2"], ref_model, ppo_server.critic_dir, temperature)
    mask = framework_mask(adapter, batch)
    log_probs, ref_log_probs = (
        window(adapter, batch, want.log_probs),
        window(adapter, batch, want.ref_log_probs),
    )
    rollout = noisy_rollout(log_probs, mask, seed=k)
    # split-padded batches go out in chunks of two rows: values, ref, KL and rollout merge across them
    with Client(ppo_server.url, max_chunk_rows=2 if layout == "split" else 512) as client:
        got = score(
            adapter,
            client,
            batch,
            temperature=temperature,
            return_values=True,
            return_ref_log_probs=True,
            kl_estimator=estimator,
            rollout_log_probs=rollout,
        )

    assert torch.equal(got.action_mask, mask)
    check(got.log_probs, log_probs, mask)
    check(got.values, window(adapter, batch, want.values), mask)
    check(got.ref_log_probs, ref_log_probs, mask)
    check(
        got.kl,
        kl(log_probs, ref_log_probs, estimator),
        mask,
        kl_tolerance(log_probs, ref_log_probs, estimator, mask),
    )
    assert got.entropy is None

    d = (log_probs - rollout.double())[mask]
    assert got.rollout is not None
    assert got.rollout.tokens == int(mask.sum())
    assert got.rollout.mean_abs_diff == pytest.approx(float(d.abs().mean()), abs=1e-4)
    assert got.rollout.max_abs_diff == pytest.approx(float(d.abs().max()), abs=1e-4)
    assert got.rollout.mean_kl_k3 == pytest.approx(float((torch.expm1(d) - d).mean()), abs=1e-3)
    outside = float((d.abs() > math.log(2)).double().mean())
    assert got.rollout.ratio_outside_fraction == pytest.approx(outside, abs=1e-9)


@with_critics("openrlhf")
def test_openrlhf_action_mask_of_the_last_columns(
    ppo_server: PpoServer, reference_models: dict[str, Any], ref_model: Any
) -> None:
    """Older OpenRLHF's action_mask [B, A] about the last A columns: every tensor is [B, A], and so is
    the rollout it takes; with the raw-logit entropy of OpenRLHF <= 0.11.0 at T != 1 (a second
    request at T = 1)."""
    full = make_batch("split", seed=50)
    short = full.action_mask[:, -full.window :]
    batch = Batch(full.input_ids, full.attention_mask, short, full.window)
    want = by_column(batch, reference_models["qwen2"], ref_model, ppo_server.critic_dir, 0.8)
    log_probs = window("openrlhf", batch, want.log_probs)
    rollout = noisy_rollout(log_probs, short, seed=5)
    with Client(ppo_server.url) as client:
        got = score(
            "openrlhf",
            client,
            batch,
            temperature=0.8,
            return_entropy=True,
            return_values=True,
            return_ref_log_probs=True,
            kl_estimator="k3",
            rollout_log_probs=rollout,
            tempered_entropy=False,
        )
    ref_log_probs = window("openrlhf", batch, want.ref_log_probs)
    check(got.log_probs, log_probs, short)
    check(got.values, window("openrlhf", batch, want.values), short)
    check(got.ref_log_probs, ref_log_probs, short)
    check(got.kl, kl(log_probs, ref_log_probs, "k3"), short)
    assert got.entropy is not None
    assert got.entropy.shape == short.shape
    assert got.rollout is not None
    assert got.rollout.tokens == int(short.sum())


@with_critics("openrlhf")
def test_async_twins_return_the_same_tensors(ppo_server: PpoServer) -> None:
    batch = make_batch("left", seed=60)
    ids, mask, window_r = batch.input_ids, batch.attention_mask, batch.window
    responses = ids[:, -window_r:]
    asked: dict[str, Any] = {"return_values": True, "return_ref_log_probs": True, "kl_estimator": "k2"}
    with Client(ppo_server.url) as client:
        sync = [
            ad.openrlhf_log_probs(
                client, ids, mask, batch.action_mask, temperature=0.9, return_entropy=True, **asked
            ),
            ad.verl_log_probs(client, ids, mask, responses, temperature=0.9, **asked),
            ad.trl_log_probs(client, ids, mask, window_r, **asked),
        ]

    async def run() -> list[TensorScores]:
        async with AsyncClient(ppo_server.url) as client:
            return [
                await ad.openrlhf_log_probs_async(
                    client, ids, mask, batch.action_mask, temperature=0.9, return_entropy=True, **asked
                ),
                await ad.verl_log_probs_async(client, ids, mask, responses, temperature=0.9, **asked),
                await ad.trl_log_probs_async(client, ids, mask, window_r, **asked),
            ]

    for s, a in zip(sync, asyncio.run(run()), strict=True):
        for name in ("log_probs", "values", "ref_log_probs", "kl"):
            torch.testing.assert_close(getattr(a, name), getattr(s, name), atol=1e-5, rtol=0)
        assert torch.equal(a.action_mask, s.action_mask)
        assert a.rollout is None
        assert s.rollout is None
    assert sync[0].entropy is not None
    assert sync[1].entropy is None


@with_critics("openrlhf")
def test_nothing_extra_unless_asked(ppo_server: PpoServer) -> None:
    batch = make_batch("right", seed=61)
    with Client(ppo_server.url) as client:
        for adapter in ADAPTERS:
            got = score(adapter, client, batch, temperature=1.0)
            assert (got.values, got.ref_log_probs, got.kl, got.rollout) == (None, None, None, None)


def test_the_openrlhf_entropy_request_asks_for_nothing_else() -> None:
    """At T != 1 the raw-logit entropy (OpenRLHF <= 0.11.0) needs a second request at T = 1: values,
    ref and rollout are only in the first; the rollout is laid out in the server's [B, L-1] window,
    0.0 off the mask. The tempered entropy (>= 0.11.1) is asked in the one request."""
    batch = make_batch("split", seed=62)
    short = batch.action_mask[:, -batch.window :]
    rollout = noisy_rollout(torch.zeros(short.shape, dtype=torch.float64), short, seed=1)
    asked = Asked(entropy=True, values=True, ref_log_probs=True, kl_estimator="k3", rollout_log_probs=rollout)
    tempered = openrlhf_plan(
        batch.input_ids, batch.attention_mask, short, temperature=0.5, asked=asked, options={}
    )
    assert tempered.entropy_body is None
    assert tempered.body["return_entropy"] is True
    assert tempered.body["temperature"] == 0.5
    plan = openrlhf_plan(
        batch.input_ids,
        batch.attention_mask,
        short,
        temperature=0.5,
        asked=asked,
        options={"timeout_s": 9.0},
        tempered_entropy=False,
    )
    assert plan.entropy_body is not None
    for key in ("return_values", "return_ref_logprobs", "kl_estimator", "rollout_logprobs"):
        assert key not in plan.entropy_body
    assert plan.entropy_body["temperature"] == 1.0
    assert plan.entropy_body["return_entropy"] is True
    assert plan.entropy_body["timeout_s"] == plan.body["timeout_s"] == 9.0
    assert "return_entropy" not in plan.body
    assert plan.body["return_values"] is True
    assert (plan.body["return_ref_logprobs"], plan.body["kl_estimator"]) == (True, "k3")
    sent = torch.tensor(plan.body["rollout_logprobs"])
    assert sent.shape == (batch.input_ids.shape[0], batch.input_ids.shape[1] - 1)
    placed = torch.zeros(sent.shape, dtype=torch.bool)
    placed[:, -batch.window :] = short
    assert torch.equal(sent[placed], rollout[short])
    assert torch.equal(sent[~placed], torch.zeros_like(sent[~placed]))
    assert json.loads(json.dumps(plan.body, allow_nan=False))  # no NaN goes out


def test_adapter_arguments_are_checked(dead_url: str) -> None:
    """Refused before anything is sent (nothing listens at `dead_url`)."""
    batch = make_batch("left", seed=63)
    wrong = torch.zeros(batch.input_ids.shape[0], batch.window + 1)
    with Client(dead_url) as client:
        with pytest.raises(ValueError, match="low_var_kl is k3"):
            score(
                "verl", client, batch, temperature=1.0, return_ref_log_probs=True, kl_estimator="low_var_kl"
            )
        for adapter in ADAPTERS:
            with pytest.raises(ValueError, match="rollout_log_probs must be shaped like the output"):
                score(adapter, client, batch, temperature=1.0, rollout_log_probs=wrong)
        with pytest.raises(TypeError, match="return_ref_log_probs=True"):
            score("trl", client, batch, return_ref_logprobs=True)
        with pytest.raises(TypeError, match="rollout_log_probs="):
            score("openrlhf", client, batch, rollout_logprobs=[[0.0]])


def test_a_response_without_what_was_asked_is_an_error() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        rows = sent_body(request.content, request.headers["content-type"])["input_ids"]
        width = len(rows[0]) - 1
        reply = {
            "model": "m",
            "logprobs": [[-1.0] * width for _ in rows],
            "action_mask": [[1] * width for _ in rows],
            "values": None,
            "usage": {"input_tokens": 0, "scored_tokens": 0},
        }
        return httpx.Response(200, json=reply)

    batch = make_batch("right", seed=64, rows=2)
    transport = httpx.MockTransport(handler)
    with (
        Client("http://logprobd.invalid", transport=transport) as client,
        pytest.raises(LogprobdError, match="asked for `values`") as caught,
    ):
        score("openrlhf", client, batch, return_values=True)
    assert caught.value.type == "bad_response"


@with_critics("openrlhf")
def test_the_reference_notices_a_shift_by_one_column(
    ppo_server: PpoServer, reference_models: dict[str, Any], ref_model: Any
) -> None:
    """The checks above are sharp enough to tell head(h_{t-1}) from its neighbours (head(h_t),
    head(h_{t-2})): the alignment that every framework's critic slicing relies on."""
    batch = make_batch("left", seed=65)
    want = by_column(batch, reference_models["qwen2"], ref_model, ppo_server.critic_dir, 1.0)
    with Client(ppo_server.url) as client:
        got = score("verl", client, batch, temperature=1.0, return_values=True)
    mask = framework_mask("verl", batch)
    check(got.values, window("verl", batch, want.values), mask)
    for shift in (1, -1):
        shifted = torch.roll(want.values, shifts=shift, dims=1)
        with pytest.raises(AssertionError):
            check(got.values, window("verl", batch, shifted), mask)
