"""A micro-batch's asks beyond the log-prob (engine/batch/asks.py): which rows ask, and which draw."""

from __future__ import annotations

import numpy as np
import torch

from service.core.jobs import SequenceJob
from service.engine.batch.asks import Part, extras


def _job(actions: int, *, top: int = 0, seed: int | None = None) -> SequenceJob:
    tokens = np.arange(actions + 4, dtype=np.int64)
    return SequenceJob(
        tokens, np.arange(4, actions + 4, dtype=np.int64), 1.0, False, top_logprobs=top, draw_seed=seed
    )


def test_a_job_draws_at_its_last_action_only_in_the_part_that_holds_it() -> None:
    drawing_long, plain, drawing_short, quiet = _job(10, seed=5), _job(3, top=2), _job(4, seed=6), _job(6)
    parts = [
        Part(drawing_long, 0, 6, first=0),  # a chunk of the long job: its last action comes later
        Part(plain, 0, 3, first=6),
        Part(quiet, 0, 6, first=9),  # asks nothing
        Part(drawing_short, 0, 4, first=15),
        Part(drawing_long, 6, 10, first=19),  # the long job's last chunk
    ]
    asks = extras(parts, torch.from_numpy)
    assert asks is not None
    assert asks.rows.tolist() == [*range(0, 9), *range(15, 23)]
    assert asks.drawing is not None
    # asking rows 0-5 (long, first part), 6-8 (plain), 9-12 (short), 13-16 (long, last part)
    assert asks.drawing.tolist() == [12, 16]
    assert asks.seeds is not None
    assert asks.seeds[asks.drawing].tolist() == [6, 5]
    assert asks.positions is not None
    assert asks.positions[asks.drawing].tolist() == [7, 13]  # each job's last action position
    later, earlier = asks.part(9, 17).drawing, asks.part(0, 9).drawing
    assert later is not None
    assert earlier is not None
    assert (later.tolist(), earlier.tolist()) == ([3, 7], [])


def test_no_draw_no_drawing_rows() -> None:
    asks = extras([Part(_job(3, top=1), 0, 3, first=0)], torch.from_numpy)
    assert asks is not None
    assert (asks.seeds, asks.drawing) == (None, None)
