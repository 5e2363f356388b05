"""Rows -> jobs and windows (plan.py): the options each job carries and the EOS policy, by hand."""

from __future__ import annotations

import numpy as np

from tests.support.plans import PADDED_IDS, PADDED_MASK, plan_of, rows_of


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
