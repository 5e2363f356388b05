"""Padded `input_ids` [B, L] + `attention_mask` [B, L] -> one Row each.

A row's real tokens are the columns where `attention_mask` is 1, in order, whatever the padding
side; their position ids are `cumsum(attention_mask) - 1`, and a padding column is never read nor
an action. Two layouts (docs/semantics.md, 'Layouts'):

- `response_length` R: window = the last R columns (verl, TRL); actions = its real columns;
- `action_mask` [B, L-1] (`action_mask[j]` is about column j+1): window = columns 1..L-1
  (OpenRLHF); actions = the marked columns, which must be real.

The first real token (position 0) is never an action. The caller has checked that exactly one of
`num_actions`, `action_mask`, `response_length` is given.
"""

from __future__ import annotations

import numpy as np

from service.core.errors import InvalidRequest
from service.normalise.rows import Row, check_widths, mask_row, real_tokens
from service.wire.schemas import LogprobsRequest


def padded_rows(request: LogprobsRequest) -> list[Row]:
    assert request.attention_mask is not None
    if request.num_actions is not None:
        raise InvalidRequest(
            "num_actions is for ragged input_ids (no attention_mask); "
            "padded input takes response_length or action_mask",
            field="num_actions",
        )
    batch, width = len(request.input_ids), check_widths(request.input_ids)
    if width == 0:
        raise InvalidRequest("input_ids rows are empty", field="input_ids", row=0)
    rows: list[Row] = []
    for i in range(batch):
        real = mask_row(
            request.attention_mask, "attention_mask", batch=batch, i=i, length=width, what="one per column"
        )
        columns = np.flatnonzero(real)  # [L_i] columns of the real tokens, in order
        if columns.size == 0:
            raise InvalidRequest(f"attention_mask row {i} has no real token", field="attention_mask", row=i)
        position = np.cumsum(real) - 1  # [L] position id of each real column
        if request.response_length is not None:
            r = request.response_length
            if r >= width:
                raise InvalidRequest(
                    f"response_length {r} must be smaller than the padded row length {width}",
                    field="response_length",
                )
            start = width - r
            action_columns = columns[columns >= start]
            field = "response_length"
        else:
            assert request.action_mask is not None
            marks = mask_row(
                request.action_mask,
                "action_mask",
                batch=batch,
                i=i,
                length=width - 1,
                what="one per column 1..L-1",
            )
            action_columns = np.flatnonzero(marks) + 1
            start, field = 1, "action_mask"
            padding = action_columns[real[action_columns] == 0]
            if padding.size:
                raise InvalidRequest(
                    f"action_mask[{i}][{padding[0] - 1}] marks column {padding[0]}, which is padding "
                    "(attention_mask 0)",
                    field="action_mask",
                    row=i,
                )
        if action_columns.size and action_columns[0] == columns[0]:
            raise InvalidRequest(
                f"{field} row {i}: column {columns[0]} is the first real token (position 0) and cannot be an "
                "action; the prompt must hold at least one real token",
                field=field,
                row=i,
            )
        rows.append(
            Row(
                tokens=real_tokens(request.input_ids[i], columns, i),
                actions=position[action_columns].astype(np.int64),
                slots=(action_columns - start).astype(np.int64),
                width=width - start,
                columns=columns.astype(np.int64),
            )
        )
    return rows
