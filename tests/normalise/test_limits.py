"""The model's limits on each sequence (limits.py): its length counts real tokens, its ids stay inside
the vocabulary. The server's request-size and model checks are exercised over HTTP
(tests/http/test_bad_input.py, tests/http/test_guards.py) and in the grouped form (test_grouped.py)."""

from __future__ import annotations

from typing import Any

import pytest

from service.core.errors import InvalidRequest, PayloadTooLarge, SequenceTooLarge
from service.normalise import ModelLimits
from tests.support.plans import LIMITS, plan_of

# ---------------------------------------------------------------- each sequence


def test_sequence_length_limit_counts_real_tokens() -> None:
    limits = ModelLimits(vocab_size=50, max_sequence_tokens=4)
    plan = plan_of(limits, input_ids=[[1, 2, 3, 4]], num_actions=1)
    assert plan.input_tokens == 4
    # 6 columns but only 4 real tokens: fits
    plan = plan_of(
        limits, input_ids=[[0, 0, 1, 2, 3, 4]], attention_mask=[[0, 0, 1, 1, 1, 1]], response_length=1
    )
    assert plan.input_tokens == 4
    with pytest.raises(InvalidRequest) as raised:
        plan_of(limits, input_ids=[[1, 2], [1, 2, 3, 4, 5]], num_actions=1)
    assert (raised.value.field, raised.value.row) == ("input_ids", 1)
    assert "input_ids" in raised.value.message


def test_vocabulary_limit() -> None:
    plan = plan_of(input_ids=[[0, 49]], num_actions=1)
    assert plan.jobs[0].tokens.tolist() == [0, 49]
    with pytest.raises(InvalidRequest) as raised:
        plan_of(input_ids=[[0, 49], [3, 50]], num_actions=1)
    assert (raised.value.field, raised.value.row) == ("input_ids", 1)
    assert "50" in raised.value.message


# ---------------------------------------------------------------- models held, request size


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"return_values": True}, "return_values"),
        ({"return_ref_logprobs": True}, "return_ref_logprobs"),
        ({"critic_weights_version": "c1"}, "critic_weights_version"),
        ({"ref_weights_version": "r1"}, "ref_weights_version"),
    ],
)
def test_a_model_the_server_does_not_hold_is_a_422_naming_the_field(
    fields: dict[str, Any], field: str
) -> None:
    body = {"input_ids": [[1, 2, 3]], "num_actions": 1, **fields}
    with pytest.raises(InvalidRequest) as raised:
        plan_of(LIMITS, **body)
    assert (raised.value.field, raised.value.row) == (field, None)
    assert field in raised.value.message
    held = ModelLimits(vocab_size=50, max_sequence_tokens=12, has_critic=True, has_reference=True)
    plan = plan_of(held, **body)
    assert plan.scored_tokens == 1
    assert plan.pins == {
        target: version
        for target, key in (("critic", "critic_weights_version"), ("reference", "ref_weights_version"))
        if (version := fields.get(key)) is not None
    }


def test_request_size_counts_rows_and_real_tokens() -> None:
    # 3 ragged rows of 2 + 3 + 4 = 9 tokens; padded, the same rows in [3, 6] hold 9 real tokens too
    ragged = {"input_ids": [[1, 2], [1, 2, 3], [1, 2, 3, 4]], "num_actions": 1}
    padded = {
        "input_ids": [[0, 0, 0, 0, 1, 2], [0, 0, 0, 1, 2, 3], [0, 0, 1, 2, 3, 4]],
        "attention_mask": [[0, 0, 0, 0, 1, 1], [0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 1, 1]],
        "response_length": 1,
    }
    for body in (ragged, padded):
        fits = ModelLimits(
            vocab_size=50, max_sequence_tokens=12, max_request_tokens=9, max_request_sequences=3
        )
        assert plan_of(fits, **body).input_tokens == 9
        with pytest.raises(PayloadTooLarge, match=r"9 tokens.*\(max_request_tokens\)") as raised:
            plan_of(ModelLimits(vocab_size=50, max_sequence_tokens=12, max_request_tokens=8), **body)
        assert raised.value.field == "input_ids"
        with pytest.raises(PayloadTooLarge, match=r"3 rows.*\(max_request_sequences\)"):
            plan_of(ModelLimits(vocab_size=50, max_sequence_tokens=12, max_request_sequences=2), **body)


def test_a_deadline_over_the_cap_is_a_422() -> None:
    capped = ModelLimits(vocab_size=50, max_sequence_tokens=12, max_timeout_s=30.0)
    assert plan_of(capped, input_ids=[[1, 2]], num_actions=1, timeout_s=30.0).scored_tokens == 1
    with pytest.raises(InvalidRequest) as raised:
        plan_of(capped, input_ids=[[1, 2]], num_actions=1, timeout_s=30.5)
    assert (raised.value.field, raised.value.row) == ("timeout_s", None)


def test_positions_are_a_422_and_the_servers_longest_a_413() -> None:
    # 6 tokens: over max_sequence_tokens 5 (413, naming what sets it) but inside positions 8
    limits = ModelLimits(vocab_size=50, max_sequence_tokens=5, max_positions=8, max_sequence_limit="setting")
    with pytest.raises(SequenceTooLarge, match=r"6 tokens.*5 \(set by setting\)") as raised:
        plan_of(limits, input_ids=[[1, 2], [1, 2, 3, 4, 5, 6]], num_actions=1)
    assert (raised.value.field, raised.value.row) == ("input_ids", 1)
    # 9 tokens: over the model's positions: a 422, not a 413
    with pytest.raises(InvalidRequest, match="positions cover 8") as positions:
        plan_of(limits, input_ids=[[1] * 9], num_actions=1)
    assert (positions.value.field, positions.value.row) == ("input_ids", 0)
