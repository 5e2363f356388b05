"""What the normalisation tests share: a server's limits, normalise() on keyword fields, and a plan
read back as plain lists, plus a padded [4, 7] batch that both padded layouts read.

Every expected value in tests/normalise/ is derived from docs/semantics.md's layout table (and
docs/api.md's 'Grouped requests') by reading the request, not from the implementation.
"""

from __future__ import annotations

from typing import Any

from service.normalise import ModelLimits, ScoringPlan, normalise
from service.wire.schemas import LogprobsRequest

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
