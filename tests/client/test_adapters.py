"""Each adapter's tensor equals its framework's in-process computation on the same model (float32),
for left-, right- and split-padded batches, through a real server."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from service.client import Client
from service.client.adapters import openrlhf_log_probs, trl_log_probs, verl_log_probs
from tests.client import frameworks
from tests.client.frameworks import LAYOUTS, make_batch
from tests.conftest import TOLERANCE

MODELS = ("qwen2", "gemma2")


def check(got: torch.Tensor, want: torch.Tensor, mask: torch.Tensor) -> None:
    """Equal within the tolerance where `mask`, exactly 0.0 elsewhere; float32, same shape."""
    assert got.dtype == torch.float32
    assert got.shape == want.shape == mask.shape
    torch.testing.assert_close(got[mask], want[mask].float(), atol=TOLERANCE, rtol=0)
    assert torch.equal(got[~mask], torch.zeros_like(got[~mask]))
    assert mask.any()


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_openrlhf(servers: dict[str, str], reference_models: dict[str, Any], model: str, layout: str) -> None:
    batch = make_batch(layout, seed=LAYOUTS.index(layout))
    with Client(servers[model]) as client:
        got = openrlhf_log_probs(
            client,
            batch.input_ids,
            batch.attention_mask,
            batch.action_mask,
            temperature=0.7,
            return_entropy=True,
        )
    want = frameworks.openrlhf(reference_models[model], batch, batch.action_mask, temperature=0.7)
    check(got.log_probs, want, batch.action_mask)
    assert torch.equal(got.action_mask, batch.action_mask)
    assert got.entropy is not None
    entropy = frameworks.openrlhf_entropy(reference_models[model], batch)
    check(got.entropy, entropy * batch.action_mask, batch.action_mask)


def test_openrlhf_action_mask_of_the_last_columns(
    servers: dict[str, str], reference_models: dict[str, Any]
) -> None:
    """Older OpenRLHF passes action_mask [B, A] about the last A columns; the output is [B, A]."""
    batch = make_batch("split", seed=11)
    short = batch.action_mask[:, -batch.window :]
    with Client(servers["qwen2"]) as client:
        got = openrlhf_log_probs(client, batch.input_ids, batch.attention_mask, short, return_entropy=True)
        plain = openrlhf_log_probs(client, batch.input_ids, batch.attention_mask, short)
    check(got.log_probs, frameworks.openrlhf(reference_models["qwen2"], batch, short, temperature=1.0), short)
    assert got.entropy is not None
    entropy = frameworks.openrlhf_entropy(reference_models["qwen2"], batch)[:, -batch.window :]
    check(got.entropy, entropy * short, short)
    assert plain.entropy is None


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_verl(servers: dict[str, str], reference_models: dict[str, Any], model: str, layout: str) -> None:
    batch = make_batch(layout, seed=10 + LAYOUTS.index(layout))
    responses = batch.input_ids[:, -batch.window :]
    with Client(servers[model]) as client:
        got = verl_log_probs(
            client, batch.input_ids, batch.attention_mask, responses, temperature=0.6, calculate_entropy=True
        )
    log_probs, entropy = frameworks.verl(reference_models[model], batch, responses, temperature=0.6)
    response_mask = batch.attention_mask[:, -batch.window :].bool()
    check(got.log_probs, log_probs, response_mask)
    assert got.entropy is not None
    check(got.entropy, entropy, response_mask)
    assert torch.equal(got.action_mask, response_mask)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_trl(servers: dict[str, str], reference_models: dict[str, Any], model: str, layout: str) -> None:
    batch = make_batch(layout, seed=20 + LAYOUTS.index(layout))
    with Client(servers[model]) as client:
        got = trl_log_probs(
            client, batch.input_ids, batch.attention_mask, batch.window, temperature=1.3, compute_entropy=True
        )
    log_probs, entropy = frameworks.trl(reference_models[model], batch, batch.window, temperature=1.3)
    completion_mask = batch.attention_mask[:, -batch.window :].bool()
    check(got.log_probs, log_probs, completion_mask)
    assert got.entropy is not None
    check(got.entropy, entropy, completion_mask)


def test_adapters_refuse_misaligned_tensors(servers: dict[str, str]) -> None:
    batch = make_batch("split", seed=3)
    with Client(servers["qwen2"]) as client:
        with pytest.raises(ValueError, match="last R columns"):
            verl_log_probs(
                client, batch.input_ids, batch.attention_mask, batch.input_ids[:, :2], temperature=1.0
            )
        with pytest.raises(ValueError, match="A <= L-1"):
            openrlhf_log_probs(client, batch.input_ids, batch.attention_mask, batch.attention_mask)
        with pytest.raises(ValueError, match="logits_to_keep"):
            trl_log_probs(
                client, batch.input_ids, batch.attention_mask, logits_to_keep=batch.input_ids.shape[1]
            )
