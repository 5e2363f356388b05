"""Routed experts on the client: the caller's routes onto the wire, and the answer's back to numpy.

A row's routes are `[positions, moe_layers, top_k]` expert ids (docs/api.md, 'Routing replay'). The
caller may give, per row, a numpy array or torch tensor, nested lists, SGLang's
`meta_info.routed_experts` string (base64 of little-endian int32) or None; or one `[B, P, layers,
top_k]` array for all rows. Arrays go out as SGLang's base64 strings (JSON-able, 4 bytes an id; a
compact frame then carries them as one byte an id when they fit), lists and strings as they are.

A compact frame carries each row flat (`frame_rows`), in the narrowest of u1, u2, i4, i8 that holds
every id: arrays, base64 strings and nested lists are each read by numpy once, never as Python ints.

Answers carry `routed_experts` as nested lists, base64 strings, or (frames) flat rows, with `moe`
(`layers`, `experts`, `top_k`) to reshape them; `decode` gives int64 arrays whatever the form.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from service.wire.frame import ArraySpec

Routes = npt.NDArray[np.int64]  # [positions, moe_layers, top_k]
ROUTE_FIELDS = ("routed_experts", "prompt_routed_experts")


def encode_row(row: Any) -> Any:
    """One row's routes as the wire takes them: a base64 int32 string, nested lists, or None."""
    if row is None or isinstance(row, str):
        return row
    if hasattr(row, "tolist"):  # a numpy array or torch tensor
        array = np.asarray(row if isinstance(row, np.ndarray) else row.tolist())
        if array.ndim != 3:
            raise ValueError(
                f"a row's routes are [positions, moe_layers, top_k], got shape {list(array.shape)}"
            )
        if array.size and (array.min() < np.iinfo(np.int32).min or array.max() > np.iinfo(np.int32).max):
            raise ValueError("expert ids must fit in int32")
        return base64.b64encode(np.ascontiguousarray(array, dtype="<i4").tobytes()).decode("ascii")
    return [[list(layer) for layer in position] for position in row]


def encode(value: Any) -> list[Any]:
    """Per-row routes (a list, or one [B, P, layers, top_k] array) as the wire's list of rows."""
    if hasattr(value, "tolist"):  # one array for every row
        array = np.asarray(value if isinstance(value, np.ndarray) else value.tolist())
        if array.ndim != 4:
            raise ValueError(
                f"routes for every row are [B, positions, moe_layers, top_k], got shape {list(array.shape)}"
            )
        return [encode_row(row) for row in array]
    return [encode_row(row) for row in value]


def decode(rows: Sequence[Any], moe: Mapping[str, Any]) -> list[Routes]:
    """An answer's `routed_experts` rows as int64 arrays [positions, layers, top_k]."""
    shape = (int(moe["layers"]), int(moe["top_k"]))
    out: list[Routes] = []
    for row in rows:
        if isinstance(row, str):
            flat = np.frombuffer(base64.b64decode(row), dtype="<i4")
        else:
            flat = np.asarray(row, dtype=np.int64).ravel()
        out.append(flat.astype(np.int64).reshape(-1, *shape))
    return out


_FRAME_DTYPES = ("u1", "u2", "i4", "i8")


def frame_rows(name: str, rows: Any) -> tuple[ArraySpec, bytes] | None:
    """Per-row routes (numpy arrays or tensors, base64 int32 strings, nested lists, None) as one flat
    frame array in the narrowest dtype that holds every id; None when a row is none of these or not
    integer ids [positions, layers, top_k] (JSON goes, and the server names the fault)."""
    if not isinstance(rows, list | tuple):
        return None
    flat: list[np.ndarray] = []
    for row in rows:
        values = _flat_row(row)
        if values is None:
            return None
        flat.append(values)
    joined = np.concatenate(flat) if flat else np.empty(0, dtype=np.uint8)
    low, high = (int(joined.min()), int(joined.max())) if joined.size else (0, 0)
    for code in _FRAME_DTYPES:
        info = np.iinfo(np.dtype(code))
        if info.min <= low and high <= info.max:
            dtype = np.dtype(code).newbyteorder("<")
            spec = ArraySpec(name, code, tuple(int(v.size) for v in flat))
            return spec, joined.astype(dtype, copy=False).tobytes()
    return None


def _flat_row(row: Any) -> np.ndarray | None:
    """One row's ids, flat, in an integer dtype; None: not routes."""
    if row is None:
        return np.empty(0, dtype=np.uint8)
    if isinstance(row, str):
        return _int32s(row)
    if not isinstance(row, np.ndarray):
        if hasattr(row, "numpy"):  # a torch tensor
            row = row.detach().cpu().numpy()
        elif not isinstance(row, list | tuple):
            return None
    try:
        array = np.asarray(row)
    except (ValueError, OverflowError):  # ragged nesting
        return None
    if array.size == 0:
        return np.empty(0, dtype=np.uint8)
    if array.ndim != 3 or array.dtype.kind not in "iu":
        return None
    return array.ravel()


def _int32s(text: str) -> np.ndarray | None:
    """A base64 string of little-endian int32 as ids; None: not valid base64. Decoded without
    validate (twice as fast): a character it skipped, or data after padding, shortens the bytes
    below what the text's length gives, and that is refused."""
    if len(text) % 4 or not text.isascii():
        return None
    try:
        raw = binascii.a2b_base64(text)
    except binascii.Error:
        return None
    if len(raw) != len(text) // 4 * 3 - (len(text) - len(text.rstrip("="))) or len(raw) % 4:
        return None
    return np.frombuffer(raw, dtype="<i4")
