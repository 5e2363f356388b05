"""Request bodies from lists, numpy arrays or tensors; errors that survive pickling."""

from __future__ import annotations

import json
import pickle
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch

from service.client import Client, LogprobdConnectionError, LogprobdError
from service.client.wire import IntRows, ToList, build_body, group_prompts

IDS = [[0, 7, 8, 9, 2, 0], [5, 6, 7, 8, 9, 10]]
MASK = [[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]]


def test_arrays_and_tensors_become_the_same_body_as_lists() -> None:
    def body(ids: IntRows, mask: IntRows, eos: int | Sequence[int] | ToList) -> dict[str, Any]:
        return build_body(
            ids,
            attention_mask=mask,
            num_actions=None,
            action_mask=None,
            response_length=3,
            temperature=0.5,
            eos_token_id=eos,
            return_entropy=False,
            options={"return_values": True},
        )

    want = body(IDS, MASK, [2])
    assert want == {
        "input_ids": IDS,
        "attention_mask": MASK,
        "response_length": 3,
        "temperature": 0.5,
        "eos_token_id": [2],
        "return_values": True,
    }
    assert body(np.array(IDS), torch.tensor(MASK), np.array([2])) == want
    assert body(torch.tensor(IDS), np.array(MASK), torch.tensor([2])) == want
    assert body(IDS, MASK, np.int64(2))["eos_token_id"] == 2
    assert json.dumps(body(np.array(IDS), np.array(MASK), np.int64(2)))  # plain Python all through


def test_scores_from_arrays_equal_scores_from_lists(qwen2_replicas: tuple[str, str]) -> None:
    with Client(qwen2_replicas[0]) as client:
        from_lists = client.score(IDS, attention_mask=MASK, response_length=3, eos_token_id=2)
        from_arrays = client.score(
            np.array(IDS), attention_mask=torch.tensor(MASK), response_length=3, eos_token_id=2
        )
    assert from_arrays == from_lists
    assert from_lists.action_mask == [
        [1, 1, 0],
        [1, 1, 1],
    ]  # row 0: the EOS (2) ends it, padding is no action


@pytest.mark.parametrize("cls", [LogprobdError, LogprobdConnectionError])
def test_errors_survive_pickling(cls: type[LogprobdError]) -> None:
    error = cls("bad row", status=422, error_type="invalid_request", field="input_ids", row=3, attempts=2)
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is cls
    assert (copy.message, copy.status, copy.type, copy.field, copy.row, copy.attempts) == (
        "bad row", 422, "invalid_request", "input_ids", 3, 2,
    )  # fmt: skip
    assert (
        str(copy) == str(error) == "422 invalid_request: bad row (field input_ids; row 3; after 2 attempts)"
    )


def test_group_prompts_compares_token_ids_and_keeps_first_appearance_order() -> None:
    prompts = [[1, 2], [3], [1, 2], [1, 2, 0], [3], [2, 1]]
    unique, index = group_prompts(prompts)
    assert unique == [[1, 2], [3], [1, 2, 0], [2, 1]]
    assert index == [0, 1, 0, 2, 1, 3]
    assert [unique[p] for p in index] == prompts
    assert group_prompts(np.array([[4, 5], [4, 5]])) == ([[4, 5]], [0, 0])
    # -1 and -2 hash alike in CPython: equal hashes never merge two prompts
    assert hash((-1,)) == hash((-2,))
    assert group_prompts([[-1], [-2]]) == ([[-1], [-2]], [0, 1])


def test_a_grouped_body_from_tensors() -> None:
    body = build_body(
        torch.tensor([[7, 8], [9, 0]]),
        attention_mask=np.array([[1, 1], [1, 0]]),
        num_actions=None,
        action_mask=None,
        response_length=None,
        temperature=1.0,
        eos_token_id=None,
        return_entropy=False,
        options={},
        prompt_ids=[[1, 2, 3]],
        prompt_index=torch.tensor([0, 0]),
    )
    assert body == {
        "input_ids": [[7, 8], [9, 0]],
        "attention_mask": [[1, 1], [1, 0]],
        "prompt_ids": [[1, 2, 3]],
        "prompt_index": [0, 0],
        "temperature": 1.0,
    }
