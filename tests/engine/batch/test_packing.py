"""Packing: one row, positions restarting at 0, boundaries, and the rows that predict actions."""

from __future__ import annotations

import numpy as np
import torch

from service.core.jobs import AFTER_LAST, Chunk, SequenceJob
from service.core.prefixes import share
from service.engine.batch.packing import pack


def test_pack_three_sequences() -> None:
    jobs = [
        SequenceJob(np.array([5, 6, 7]), np.array([1, 2]), 1.0, False),
        SequenceJob(np.array([9, 8]), np.array([], dtype=np.int64), 0.5, True),
        SequenceJob(np.array([1, 2, 3, 4]), np.array([3]), 2.0, False),
    ]
    batch = pack(jobs, torch.device("cpu"), step=1)
    assert batch.input_ids.tolist() == [[5, 6, 7, 9, 8, 1, 2, 3, 4]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    assert batch.cu_seqlens.tolist() == [0, 3, 5, 9]
    assert batch.cu_seqlens.dtype == torch.int32
    assert batch.max_len == 4
    assert batch.hidden_index.tolist() == [0, 1, 7]  # t-1 of actions 1, 2 (seq 0) and 3 (seq 2)
    assert batch.targets.tolist() == [6, 7, 4]
    assert batch.inv_temperature is not None
    assert batch.inv_temperature.tolist() == [1.0, 1.0, 0.5]
    assert batch.actions_per_sequence == [2, 0, 1]
    assert batch.want_entropy


def test_an_action_one_past_the_last_token_reads_the_last_position() -> None:
    """The distribution after a sequence (the completions API's draw) costs no token: its row is the
    last position's, its target AFTER_LAST; whole, in a shared prefix's node, and in a chunk."""
    jobs = [
        SequenceJob(np.array([5, 6, 7, 8]), np.array([2, 4]), 1.0, False),
        SequenceJob(np.array([5, 6, 7, 8, 9]), np.array([5]), 1.0, False),
    ]
    batch = pack(jobs, torch.device("cpu"), step=4)
    assert batch.num_tokens == 12  # 9 tokens and the filler: no token for either action past the end
    assert batch.hidden_index.tolist()[:3] == [1, 3, 8]
    assert batch.targets.tolist()[:3] == [7, AFTER_LAST, AFTER_LAST]
    shared = pack(jobs, torch.device("cpu"), step=1, forest=share([j.tokens for j in jobs], 2))
    assert shared.num_tokens == 5  # [5 6 7 8] shared, then [9]
    assert shared.hidden_index.tolist() == [1, 3, 4]  # the first job's last position is in the shared node
    assert shared.targets.tolist() == [7, AFTER_LAST, AFTER_LAST]
    long = SequenceJob(np.arange(3, 13), np.array([4, 10]), 1.0, False)
    chunk = pack([], torch.device("cpu"), step=1, chunk=Chunk(long, 0, 6, 10))
    assert chunk.hidden_index.tolist() == [3]  # position 9, the chunk's 4th row
    assert chunk.targets.tolist() == [AFTER_LAST]


def test_token_and_action_counts_are_padded_to_the_step() -> None:
    jobs = [
        SequenceJob(np.array([5, 6, 7]), np.array([1, 2]), 0.5, False),
        SequenceJob(np.array([1, 2, 3, 4]), np.array([3]), 1.0, False),
    ]
    batch = pack(jobs, torch.device("cpu"), step=4)
    assert batch.num_tokens == 8  # 7 tokens and a filler sequence of one
    assert batch.input_ids.tolist() == [[5, 6, 7, 1, 2, 3, 4, 0]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3, 0]]  # the filler starts at 0 too
    assert batch.cu_seqlens.tolist() == [0, 3, 7, 8]
    assert batch.max_len == 4
    assert batch.hidden_index.tolist() == [0, 1, 5, 0]  # three actions and one filler (row 0)
    assert batch.targets.tolist() == [6, 7, 4, 0]
    assert batch.inv_temperature is not None
    assert batch.inv_temperature.tolist() == [2.0, 2.0, 1.0, 1.0]
    assert batch.actions_per_sequence == [2, 1]
    assert batch.num_actions == 3
    exact = pack(jobs[1:], torch.device("cpu"), step=4)  # 4 tokens: no filler sequence
    assert exact.cu_seqlens.tolist() == [0, 4]
    assert exact.hidden_index.tolist() == [2, 0, 0, 0]


def test_unit_temperature_needs_no_scaling() -> None:
    jobs = [SequenceJob(np.array([5, 6, 7]), np.array([1, 2]), 1.0, False)] * 2
    assert pack(jobs, torch.device("cpu")).inv_temperature is None
