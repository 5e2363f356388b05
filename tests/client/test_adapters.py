"""Each adapter's tensor equals its framework's in-process computation on the same model (float32),
for left-, right- and split-padded batches, through a real server; rows that share a prompt go out
grouped and score the same."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from service.client import Client
from service.client.adapters import openrlhf_log_probs, trl_log_probs, verl_log_probs
from tests.support import frameworks
from tests.support.faults import Flaky, sent_body
from tests.support.frameworks import LAYOUTS, check, make_batch

MODELS = ("qwen2", "gemma2")


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
    entropy = frameworks.openrlhf_entropy(reference_models[model], batch, temperature=0.7)
    check(got.entropy, entropy * batch.action_mask, batch.action_mask)


@pytest.mark.parametrize("model", MODELS)
def test_openrlhf_entropy_of_the_raw_logits_as_before_0_11_1(
    servers: dict[str, str], reference_models: dict[str, Any], model: str
) -> None:
    """`tempered_entropy=False`: OpenRLHF <= 0.11.0's entropy of the raw logits, from a second request
    at T = 1; the log-probs stay at T. It differs from the tempered entropy by far more than tolerance."""
    batch = make_batch("split", seed=4)
    sent = Flaky([])
    with Client(servers[model], transport=sent) as client:
        got = openrlhf_log_probs(
            client,
            batch.input_ids,
            batch.attention_mask,
            batch.action_mask,
            temperature=0.5,
            return_entropy=True,
            tempered_entropy=False,
        )
    assert sorted(sent_body(raw)["temperature"] for raw in sent.script.bodies) == [0.5, 1.0]
    want = frameworks.openrlhf(reference_models[model], batch, batch.action_mask, temperature=0.5)
    check(got.log_probs, want, batch.action_mask)
    assert got.entropy is not None
    raw = frameworks.openrlhf_entropy(reference_models[model], batch, temperature=1.0) * batch.action_mask
    check(got.entropy, raw, batch.action_mask)
    tempered = frameworks.openrlhf_entropy(reference_models[model], batch, temperature=0.5)
    assert float((raw - tempered)[batch.action_mask].abs().max()) > 0.1


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
    entropy = frameworks.openrlhf_entropy(reference_models["qwen2"], batch, 1.0)[:, -batch.window :]
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


def real_rows(ids: list[list[int]], mask: list[list[int]]) -> list[list[int]]:
    return [[t for t, m in zip(row, marks, strict=True) if m] for row, marks in zip(ids, mask, strict=True)]


def sequences_sent(body: dict[str, Any]) -> list[list[int]]:
    """The full sequences a body stands for, grouped or not."""
    rows = real_rows(body["input_ids"], body["attention_mask"])
    if "prompt_ids" not in body:
        return rows
    return [body["prompt_ids"][p] + row for p, row in zip(body["prompt_index"], rows, strict=True)]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_rows_that_share_a_prompt_go_out_grouped_and_score_the_same(
    servers: dict[str, str], reference_models: dict[str, Any], layout: str
) -> None:
    """9 rows, 5 prompts: prompts 0-3 twice, prompt 4 once, groups interleaved."""
    batch = make_batch(layout, seed=30 + LAYOUTS.index(layout), rows=9, prompts=5)
    ids, mask, window = batch.input_ids, batch.attention_mask, batch.window
    model = reference_models["qwen2"]
    response_mask = mask[:, -window:].bool()
    verl_lp, verl_entropy = frameworks.verl(model, batch, ids[:, -window:], temperature=0.6)
    trl_lp, trl_entropy = frameworks.trl(model, batch, window, temperature=1.3)
    cases: dict[str, tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]] = {
        "openrlhf": (
            lambda c, **kw: openrlhf_log_probs(
                c, ids, mask, batch.action_mask, temperature=0.7, return_entropy=True, **kw
            ),
            frameworks.openrlhf(model, batch, batch.action_mask, temperature=0.7),
            frameworks.openrlhf_entropy(model, batch, temperature=0.7) * batch.action_mask,
            batch.action_mask,
        ),
        "verl": (
            lambda c, **kw: verl_log_probs(
                c, ids, mask, ids[:, -window:], temperature=0.6, calculate_entropy=True, **kw
            ),
            verl_lp,
            verl_entropy,
            response_mask,
        ),
        "trl": (
            lambda c, **kw: trl_log_probs(c, ids, mask, window, temperature=1.3, compute_entropy=True, **kw),
            trl_lp,
            trl_entropy,
            response_mask,
        ),
    }
    full_rows = real_rows(ids.tolist(), mask.tolist())
    for name, (call, want, want_entropy, action_mask) in cases.items():
        grouped_sent, full_sent = Flaky([]), Flaky([])
        with Client(servers["qwen2"], transport=grouped_sent) as client:
            got = call(client)
        with Client(servers["qwen2"], transport=full_sent) as client:
            full = call(client, grouped=False)
        bodies = [sent_body(raw) for raw in grouped_sent.script.bodies]
        assert len(bodies) == 1
        for body in bodies:
            assert len(body["prompt_ids"]) < 9, name
            assert sequences_sent(body) == full_rows, name
        if layout == "split":  # every prompt is whole before the responses: exactly the 5
            assert len(bodies[0]["prompt_ids"]) == 5
            assert bodies[0]["prompt_index"] == [i % 5 for i in range(9)]
        assert "prompt_ids" not in sent_body(full_sent.script.bodies[0])
        assert len(grouped_sent.script.bodies[0]) < len(full_sent.script.bodies[0])
        check(got.log_probs, want, action_mask)
        assert got.entropy is not None
        assert full.entropy is not None
        check(got.entropy, want_entropy, action_mask)
        assert torch.equal(got.action_mask, full.action_mask)
        torch.testing.assert_close(got.log_probs, full.log_probs, atol=1e-5, rtol=0)
        torch.testing.assert_close(got.entropy, full.entropy, atol=1e-5, rtol=0)


def test_grouping_and_rollout_log_probs_line_up(servers: dict[str, str]) -> None:
    """rollout_log_probs shaped like the output reach the same action tokens grouped or not."""
    batch = make_batch("split", seed=41, rows=8, prompts=2)
    ids, mask = batch.input_ids, batch.attention_mask
    with Client(servers["qwen2"]) as client:
        plain = openrlhf_log_probs(client, ids, mask, batch.action_mask, grouped=False)
        rollout = plain.log_probs + 0.25 * batch.action_mask  # off by 0.25 on every action
        got = openrlhf_log_probs(client, ids, mask, batch.action_mask, rollout_log_probs=rollout)
        window = ids[:, -batch.window :]
        verl_plain = verl_log_probs(client, ids, mask, window, temperature=1.0, grouped=False)
        verl_got = verl_log_probs(
            client, ids, mask, window, temperature=1.0, rollout_log_probs=verl_plain.log_probs - 0.5
        )
    assert got.rollout is not None
    assert got.rollout.tokens == int(batch.action_mask.sum())
    assert got.rollout.mean_abs_diff == pytest.approx(0.25, abs=1e-4)
    assert verl_got.rollout is not None
    assert verl_got.rollout.max_abs_diff == pytest.approx(0.5, abs=1e-4)
