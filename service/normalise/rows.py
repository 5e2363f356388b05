"""The bottom of normalisation: one request row read into a `Row`, and the readers every layout shares.

A `Row` is a row's real tokens [L], its action positions [A] and the window slot [A] each action's
score goes to, in a window of `width` entries (padded layouts: also each real token's column [L]).
The helpers read 0/1 mask rows, per-row counts, token ids and padded rows, raising InvalidRequest
that names the field and the row at fault. This module knows no layout and imports nothing from
the package.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from service.core.errors import InvalidRequest
from service.core.jobs import IntArray


@dataclass(frozen=True, slots=True)
class Row:
    tokens: IntArray  # [L] real tokens
    actions: IntArray  # [A] positions in tokens
    slots: IntArray  # [A] window index of each action
    width: int
    prompt: int | None = None  # grouped form: tokens start with prompt_ids[prompt]...
    prompt_length: int = 0  # ...of this many tokens; the rest is the row's response
    columns: IntArray | None = None  # padded layouts: [L] the request column of each real token


def per_row(value: int | list[int], batch: int, field: str) -> list[int]:
    if isinstance(value, int):
        return [value] * batch
    if len(value) != batch:
        raise InvalidRequest(f"{field} has {len(value)} entries for {batch} rows", field=field)
    return value


def mask_row(
    mask: Sequence[Sequence[int]], field: str, *, batch: int, i: int, length: int, what: str
) -> IntArray:
    if len(mask) != batch:
        raise InvalidRequest(f"{field} has {len(mask)} rows, input_ids has {batch}", field=field)
    row = int64(mask[i], field, i)
    if row.shape[0] != length:
        raise InvalidRequest(
            f"{field} row {i} has length {row.shape[0]}, expected {length} ({what})", field=field, row=i
        )
    bad = np.flatnonzero((row != 0) & (row != 1))
    if bad.size:
        raise InvalidRequest(
            f"{field}[{i}][{bad[0]}] is {row[bad[0]]}; only 0 and 1 are allowed", field=field, row=i
        )
    return row


def int64(values: Sequence[int], field: str, i: int | None, name: str | None = None) -> IntArray:
    """`values` as int64; `name` is how the message calls the row (default: "{field} row {i}")."""
    try:
        return np.asarray(values, dtype=np.int64)
    except OverflowError:  # JSON ints are unbounded, numpy's are not
        raise InvalidRequest(
            f"{name or f'{field} row {i}'} holds a value outside the 64-bit integer range", field=field, row=i
        ) from None


def real_tokens(padded: Sequence[int], columns: IntArray, i: int) -> IntArray:
    """The ids at `columns` of a padded row (its padding may hold any int)."""
    if isinstance(padded, np.ndarray):  # a compact frame's row (wire/arrays.py)
        return padded[columns].astype(np.int64)
    return int64([padded[c] for c in columns.tolist()], "input_ids", i)


def check_widths(rows: Sequence[Sequence[int]]) -> int:
    """The common length of padded rows; 422 naming the first row that differs."""
    width = len(rows[0])
    for i, row in enumerate(rows):
        if len(row) != width:
            raise InvalidRequest(
                f"input_ids row {i} has length {len(row)} but row 0 has {width}: "
                "padded input_ids need rows of equal length",
                field="input_ids",
                row=i,
            )
    return width
