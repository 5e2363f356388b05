"""normalise() on small hand-written requests: tokens, actions, windows and usage worked out by hand.

Every expected value below is derived from SEMANTICS.md's layout table by reading the request, not
from the implementation. Pad id is 0 unless a test says otherwise.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from service.errors import InvalidRequest
from service.normalise import ModelLimits, ScoringPlan, normalise
from service.schemas import LogprobsRequest

LIMITS = ModelLimits(vocab_size=50, max_sequence_tokens=12)

# A padded [4, 7] batch used by both padded layouts; real tokens are the attention_mask == 1 columns.
#   row 0: left-padded              cols 2..6 real
#   row 1: right-padded             cols 0..4 real
#   row 2: split (verl): left-padded prompt [31, 32], right-padded response [33, 34]  cols 2..5 real
#   row 3: holes in the mask        cols 0, 2, 3, 5, 6 real
PADDED_IDS = [
    [0, 0, 11, 12, 13, 14, 15],
    [21, 22, 23, 24, 25, 0, 0],
    [0, 0, 31, 32, 33, 34, 0],
    [41, 0, 42, 43, 0, 44, 45],
]
PADDED_MASK = [
    [0, 0, 1, 1, 1, 1, 1],
    [1, 1, 1, 1, 1, 0, 0],
    [0, 0, 1, 1, 1, 1, 0],
    [1, 0, 1, 1, 0, 1, 1],
]
PADDED_TOKENS = [[11, 12, 13, 14, 15], [21, 22, 23, 24, 25], [31, 32, 33, 34], [41, 42, 43, 44, 45]]


def plan_of(limits: ModelLimits = LIMITS, **fields: Any) -> ScoringPlan:
    return normalise(LogprobsRequest(**fields), limits)


def rows_of(plan: ScoringPlan) -> list[tuple[list[int], list[int], int, list[int]]]:
    """(tokens, actions, window width, window slots) of each row, as plain lists."""
    return [
        (job.tokens.tolist(), job.actions.tolist(), window.width, window.slots.tolist())
        for job, window in zip(plan.jobs, plan.windows, strict=True)
    ]


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


def test_job_carries_temperature_entropy_flag_and_int64() -> None:
    plan = plan_of(
        input_ids=PADDED_IDS[:1],
        attention_mask=PADDED_MASK[:1],
        response_length=2,
        temperature=0.7,
        return_entropy=True,
    )
    job = plan.jobs[0]
    assert (job.temperature, job.return_entropy) == (0.7, True)
    assert job.tokens.dtype == np.int64
    assert job.actions.dtype == np.int64
    assert plan.windows[0].slots.dtype == np.int64


# ---------------------------------------------------------------- EOS policy


def test_eos_int_keeps_first_eos_action_and_drops_later_ones() -> None:
    # row 0: actions are positions 1..4 = tokens [6, 2, 7, 2]; the first EOS action is position 2
    plan = plan_of(input_ids=[[5, 6, 2, 7, 2], [5, 6, 7, 8]], num_actions=[4, 3], eos_token_id=2)
    assert rows_of(plan) == [
        ([5, 6, 2, 7, 2], [1, 2], 4, [0, 1]),  # window width is unchanged; slots 2, 3 are masked
        ([5, 6, 7, 8], [1, 2, 3], 3, [0, 1, 2]),
    ]
    assert (plan.input_tokens, plan.scored_tokens) == (9, 5)


def test_eos_list_cuts_at_first_action_in_the_list() -> None:
    # actions are tokens [6, 2, 7, 8]; of eos {9, 7, 8} the first one met is 7 at position 3
    plan = plan_of(input_ids=[[5, 6, 2, 7, 8]], num_actions=4, eos_token_id=[9, 8, 7])
    assert rows_of(plan) == [([5, 6, 2, 7, 8], [1, 2, 3], 4, [0, 1, 2])]
    assert plan.scored_tokens == 3


def test_eos_rows_are_cut_independently() -> None:
    plan = plan_of(input_ids=[[5, 2, 6, 7], [5, 6, 7, 8], [1, 7, 2]], num_actions=[3, 3, 2], eos_token_id=2)
    assert rows_of(plan) == [
        ([5, 2, 6, 7], [1], 3, [0]),  # EOS is the first action: only it stays
        ([5, 6, 7, 8], [1, 2, 3], 3, [0, 1, 2]),  # no EOS: nothing cut
        ([1, 7, 2], [1, 2], 2, [0, 1]),  # EOS is the last action: nothing after it to drop
    ]
    assert (plan.input_tokens, plan.scored_tokens) == (11, 6)


def test_eos_that_is_not_an_action_cuts_nothing() -> None:
    # token 2 at position 1 is not an action, so actions 2 and 3 after it stay
    plan = plan_of(input_ids=[[5, 2, 6, 7]], action_mask=[[0, 0, 1, 1]], eos_token_id=2)
    assert rows_of(plan) == [([5, 2, 6, 7], [2, 3], 3, [1, 2])]


def test_eos_in_prompt_is_ignored() -> None:
    plan = plan_of(input_ids=[[2, 2, 5, 6, 7]], num_actions=2, eos_token_id=[2])
    assert rows_of(plan) == [([2, 2, 5, 6, 7], [3, 4], 2, [0, 1])]


def test_eos_equal_to_pad_id_does_not_cut_at_padding() -> None:
    # pad id 0 is also the EOS id: padding columns are not actions, so they cut nothing
    ids = [[0, 11, 12, 13, 14], [21, 22, 23, 0, 0], [31, 0, 32, 0, 33]]
    mask = [[0, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 0, 1]]
    plan = plan_of(input_ids=ids, attention_mask=mask, response_length=3, eos_token_id=0)
    assert rows_of(plan) == [
        ([11, 12, 13, 14], [1, 2, 3], 3, [0, 1, 2]),
        ([21, 22, 23], [2], 3, [0]),
        # row 2: col 1 is a real token 0 (an EOS) in the prompt; col 2 (window slot 0) is position 2,
        # col 4 is position 3; col 3 is padding
        ([31, 0, 32, 33], [2, 3], 3, [0, 2]),
    ]


def test_eos_padded_response_is_cut_after_eos() -> None:
    # left-padded: real cols 1..4 = positions 0..3; window cols 2,3,4 = tokens [12, 2, 13]
    plan = plan_of(
        input_ids=[[0, 11, 12, 2, 13]], attention_mask=[[0, 1, 1, 1, 1]], response_length=3, eos_token_id=2
    )
    assert rows_of(plan) == [([11, 12, 2, 13], [1, 2], 3, [0, 1])]
    assert (plan.input_tokens, plan.scored_tokens) == (4, 2)


def test_eos_padded_action_mask_cut_skips_unmarked_columns() -> None:
    # real cols 0..5; marked cols 2, 3, 5 = tokens [7, 2, 8]; col 4 (token 2) is not marked
    plan = plan_of(
        input_ids=[[5, 6, 7, 2, 2, 8]],
        attention_mask=[[1, 1, 1, 1, 1, 1]],
        action_mask=[[0, 1, 1, 0, 1]],
        eos_token_id=2,
    )
    assert rows_of(plan) == [([5, 6, 7, 2, 2, 8], [2, 3], 5, [1, 2])]


def test_eos_empty_list_cuts_nothing() -> None:
    plan = plan_of(input_ids=[[5, 2, 2]], num_actions=2, eos_token_id=[])
    assert rows_of(plan) == [([5, 2, 2], [1, 2], 2, [0, 1])]


def test_eos_id_beyond_int64_matches_nothing() -> None:
    plan = plan_of(input_ids=[[5, 2, 7]], num_actions=2, eos_token_id=[2**70, 7])
    assert rows_of(plan) == [([5, 2, 7], [1, 2], 2, [0, 1])]


# ---------------------------------------------------------------- limits


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
