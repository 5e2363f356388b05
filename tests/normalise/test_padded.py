"""Padded input_ids + attention_mask (padded.py) by hand: left, right, split and holed padding.

Pad id is 0 unless a test says otherwise.
"""

from __future__ import annotations

from tests.support.plans import PADDED_IDS, PADDED_MASK, PADDED_TOKENS, plan_of, rows_of

# ---------------------------------------------------------------- padded + response_length


def test_padded_response_length_left_right_split_and_holes() -> None:
    plan = plan_of(input_ids=PADDED_IDS, attention_mask=PADDED_MASK, response_length=3)
    # window = columns 4, 5, 6; position ids count real columns only
    assert rows_of(plan) == [
        (PADDED_TOKENS[0], [2, 3, 4], 3, [0, 1, 2]),  # cols 4,5,6 are positions 2,3,4
        (PADDED_TOKENS[1], [4], 3, [0]),  # col 4 is position 4; cols 5,6 are padding
        (PADDED_TOKENS[2], [2, 3], 3, [0, 1]),  # cols 4,5 are positions 2,3; col 6 padding
        (PADDED_TOKENS[3], [3, 4], 3, [1, 2]),  # col 4 is a hole; cols 5,6 are positions 3,4
    ]
    assert plan.input_tokens == 5 + 5 + 4 + 5
    assert plan.scored_tokens == 3 + 1 + 2 + 2


def test_padded_response_length_zero() -> None:
    plan = plan_of(input_ids=PADDED_IDS, attention_mask=PADDED_MASK, response_length=0)
    assert [(width, slots) for _, _, width, slots in rows_of(plan)] == [(0, [])] * 4
    assert [tokens for tokens, _, _, _ in rows_of(plan)] == PADDED_TOKENS
    assert (plan.input_tokens, plan.scored_tokens) == (19, 0)


def test_padded_padding_values_are_never_read() -> None:
    """A padding column's id does not matter, even outside the vocabulary."""
    ids = [[99, 99, 11, 12, 13], [21, 22, 23, 1234, 0]]
    mask = [[0, 0, 1, 1, 1], [1, 1, 1, 0, 0]]
    plan = plan_of(input_ids=ids, attention_mask=mask, response_length=2)
    assert rows_of(plan) == [([11, 12, 13], [1, 2], 2, [0, 1]), ([21, 22, 23], [], 2, [])]


# ---------------------------------------------------------------- padded + action_mask [B, L-1]


def test_padded_action_mask_left_right_split_and_holes() -> None:
    action_mask = [
        [0, 0, 1, 0, 1, 1],  # cols 3, 5, 6  -> positions 1, 3, 4
        [1, 1, 0, 1, 0, 0],  # cols 1, 2, 4  -> positions 1, 2, 4
        [0, 0, 0, 1, 1, 0],  # cols 4, 5     -> positions 2, 3
        [0, 1, 0, 0, 1, 0],  # cols 2, 5     -> positions 1, 3 (cols 1, 4 are holes)
    ]
    plan = plan_of(input_ids=PADDED_IDS, attention_mask=PADDED_MASK, action_mask=action_mask)
    assert rows_of(plan) == [
        (PADDED_TOKENS[0], [1, 3, 4], 6, [2, 4, 5]),  # window is columns 1..6: column c fills slot c-1
        (PADDED_TOKENS[1], [1, 2, 4], 6, [0, 1, 3]),
        (PADDED_TOKENS[2], [2, 3], 6, [3, 4]),
        (PADDED_TOKENS[3], [1, 3], 6, [1, 4]),
    ]
    assert (plan.input_tokens, plan.scored_tokens) == (19, 10)
