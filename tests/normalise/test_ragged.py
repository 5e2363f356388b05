"""Ragged input_ids (ragged.py) by hand: tokens, actions, windows and usage from docs/semantics.md."""

from __future__ import annotations

import pytest

from service.core.errors import InvalidRequest
from tests.support.plans import plan_of, rows_of

# ---------------------------------------------------------------- ragged input_ids + num_actions


def test_ragged_num_actions_per_row() -> None:
    plan = plan_of(input_ids=[[5, 6, 7, 8], [9, 10], [1, 2, 3]], num_actions=[2, 1, 0])
    assert rows_of(plan) == [
        ([5, 6, 7, 8], [2, 3], 2, [0, 1]),  # last 2 of 4 tokens: positions 2, 3
        ([9, 10], [1], 1, [0]),
        ([1, 2, 3], [], 0, []),  # num_actions 0: an empty window
    ]
    assert plan.input_tokens == 9
    assert plan.scored_tokens == 3


def test_ragged_num_actions_int_applies_to_every_row() -> None:
    plan = plan_of(input_ids=[[5, 6, 7, 8], [9, 10]], num_actions=1)
    assert rows_of(plan) == [([5, 6, 7, 8], [3], 1, [0]), ([9, 10], [1], 1, [0])]
    assert (plan.input_tokens, plan.scored_tokens) == (6, 2)


def test_ragged_num_actions_zero_scores_nothing() -> None:
    plan = plan_of(input_ids=[[5], [6, 7]], num_actions=0)
    assert rows_of(plan) == [([5], [], 0, []), ([6, 7], [], 0, [])]
    assert (plan.input_tokens, plan.scored_tokens) == (3, 0)


def test_ragged_num_actions_longest_allowed_is_length_minus_one() -> None:
    plan = plan_of(input_ids=[[5, 6, 7]], num_actions=2)
    assert rows_of(plan) == [([5, 6, 7], [1, 2], 2, [0, 1])]
    with pytest.raises(InvalidRequest) as raised:
        plan_of(input_ids=[[5, 6, 7], [1, 2]], num_actions=[1, 2])
    assert (raised.value.field, raised.value.row) == ("num_actions", 1)


# ---------------------------------------------------------------- ragged input_ids + action_mask


def test_ragged_action_mask() -> None:
    plan = plan_of(
        input_ids=[[5, 6, 7, 8, 9], [9, 10], [3, 4, 5]],
        action_mask=[[0, 1, 0, 1, 1], [0, 0], [0, 0, 1]],
    )
    assert rows_of(plan) == [
        ([5, 6, 7, 8, 9], [1, 3, 4], 4, [0, 2, 3]),  # window is tokens 1..4: token t fills slot t-1
        ([9, 10], [], 1, []),  # no action: the window still has L-1 entries
        ([3, 4, 5], [2], 2, [1]),
    ]
    assert (plan.input_tokens, plan.scored_tokens) == (10, 4)


def test_ragged_action_mask_single_token_row_has_empty_window() -> None:
    plan = plan_of(input_ids=[[7]], action_mask=[[0]])
    assert rows_of(plan) == [([7], [], 0, [])]
