"""Ragged `input_ids` (a list of unpadded rows) -> one Row each.

Two layouts (docs/semantics.md, 'Layouts'), for row i of L_i tokens:

- `num_actions` (an int, or one per row): actions are the last n_i tokens; window = those n_i
  tokens (slot k is token L_i - n_i + k);
- `action_mask` (one 0/1 per token): actions are the marked tokens; window = tokens 1..L_i-1
  (token t fills slot t - 1).

Position 0 is never an action. The caller has checked that exactly one of the two is given.
"""

from __future__ import annotations

import numpy as np

from service.core.errors import InvalidRequest
from service.normalise.rows import Row, int64, mask_row, per_row
from service.wire.schemas import LogprobsRequest


def ragged_rows(request: LogprobsRequest) -> list[Row]:
    if request.response_length is not None:
        raise InvalidRequest(
            "response_length needs padded input_ids with an attention_mask; "
            "for ragged rows use num_actions or action_mask",
            field="response_length",
        )
    batch = len(request.input_ids)
    rows: list[Row] = []
    for i, ids in enumerate(request.input_ids):
        tokens = int64(ids, "input_ids", i)
        length = len(ids)
        if length == 0:
            raise InvalidRequest(f"input_ids row {i} is empty", field="input_ids", row=i)
        if request.num_actions is not None:
            n = per_row(request.num_actions, batch, "num_actions")[i]
            if n >= length:
                raise InvalidRequest(
                    f"num_actions[{i}] = {n} must be smaller than the row length {length} "
                    "(position 0 is never an action)",
                    field="num_actions",
                    row=i,
                )
            actions = np.arange(length - n, length, dtype=np.int64)
            rows.append(Row(tokens, actions, np.arange(n, dtype=np.int64), n))
        else:
            assert request.action_mask is not None
            mask = mask_row(
                request.action_mask, "action_mask", batch=batch, i=i, length=length, what="one 0/1 per token"
            )
            if mask[0]:
                raise InvalidRequest(
                    f"action_mask[{i}][0] marks position 0, which is never an action",
                    field="action_mask",
                    row=i,
                )
            actions = np.flatnonzero(mask).astype(np.int64)
            rows.append(Row(tokens, actions, actions - 1, length - 1))
    return rows
