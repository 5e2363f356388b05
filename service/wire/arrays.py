"""The compact frame (frame.py) on the server's side: a request in, an answer out, with numpy.

A framed request becomes the same LogprobsRequest a JSON body does: its JSON part is validated by
the same model (ScoringOptions), and its arrays get the checks the JSON schema gives the list
fields (token ids >= 0, finite rollout log-probs); their rows are numpy views of the body, which
service/normalise/ reads like lists. Routes (`routed_experts`, `prompt_routed_experts`) travel as
each row's [positions, layers, top_k] ids flattened (normalise reshapes them by the policy's
shape); an answer's recorded routes go back the same way, in the narrowest dtype that holds the
policy's expert ids (u1 up to 256 experts), with `moe` in the JSON part to reshape them. The
answer's [rows][window][K] fields (`top_ids`, `top_logprobs`, `candidate_logprobs`) go back as each
row's [window, K] block flattened, ids in u2 when every id is below 65536 else i4, log-probs in f4,
with K per field in the JSON part's `columns` ({"top_ids": K, "top_logprobs": K,
"candidate_logprobs": C}) to reshape them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import orjson

from service.core.errors import InvalidRequest
from service.wire.frame import ArraySpec, Buffer, FrameError, pack, unpack
from service.wire.schemas import ARRAY_FIELDS, LogprobsRequest, ScoringOptions, parse_body

_INTEGER = ("i4", "i8", "u1")
_ROUTES = ("u1", "u2", "i2", "i4", "i8")
_DTYPES = {
    "input_ids": _INTEGER,
    "prompt_ids": _INTEGER,
    "attention_mask": _INTEGER,
    "action_mask": _INTEGER,
    "rollout_logprobs": ("f4", "f8"),
    "routed_experts": _ROUTES,
    "prompt_routed_experts": _ROUTES,
}
# the answer's [rows, window] fields and the dtype each travels in
RESPONSE_ARRAYS = {
    "logprobs": "f4",
    "entropy": "f4",
    "values": "f4",
    "ref_logprobs": "f4",
    "kl": "f4",
    "action_mask": "u1",
    "ranks": "i8",
    "processed_logprobs": "f4",  # -inf outside the sampler's kept set (JSON: null)
}
# the answer's [rows, window, K] fields, each row's block flattened; None: ids, u2 or i4 by their range
WIDE_ARRAYS: dict[str, str | None] = {"top_ids": None, "top_logprobs": "f4", "candidate_logprobs": "f4"}


def parse_frame(raw: bytes) -> LogprobsRequest:
    """A LogprobsRequest from a framed body; errors are InvalidRequest naming the field and row."""
    try:
        frame = unpack(raw)
    except FrameError as exc:
        raise InvalidRequest(str(exc), field=exc.field or "body") from None
    options = parse_body(ScoringOptions, frame.fields)
    arrays: dict[str, list[np.ndarray]] = {}
    for name, (spec, data) in frame.arrays.items():
        if name not in ARRAY_FIELDS:
            raise InvalidRequest(
                f"array {name!r} is not a field of this request; arrays: {', '.join(ARRAY_FIELDS)}",
                field=name,
            )
        if spec.dtype not in _DTYPES[name]:
            raise InvalidRequest(f"{name}: dtype {spec.dtype}; one of {', '.join(_DTYPES[name])}", field=name)
        arrays[name] = _rows(spec, data)
    if not arrays.get("input_ids"):
        raise InvalidRequest("input_ids: at least one row is required", field="input_ids")
    _check_ids(arrays["input_ids"], "input_ids")
    if "prompt_ids" in arrays:
        _check_ids(arrays["prompt_ids"], "prompt_ids")
    if "rollout_logprobs" in arrays:
        _check_finite(arrays["rollout_logprobs"])
    fields: dict[str, Any] = dict(options)
    fields.update(arrays)
    return LogprobsRequest.model_construct(options.model_fields_set | set(arrays), **fields)


def _rows(spec: ArraySpec, data: memoryview) -> list[np.ndarray]:
    flat = np.frombuffer(data, dtype=np.dtype(spec.dtype).newbyteorder("<"))
    return np.split(flat, np.cumsum(spec.lengths[:-1], dtype=np.int64)) if spec.lengths else []


def _check_ids(rows: list[np.ndarray], field: str) -> None:
    """Token ids >= 0; `row` names an input_ids row (a prompt's index is in the message, as in JSON)."""
    for i, row in enumerate(rows):
        bad = np.flatnonzero(row < 0)
        if bad.size:
            raise InvalidRequest(
                f"{field}[{i}][{bad[0]}] is {row[bad[0]]}; token ids are >= 0",
                field=field,
                row=i if field == "input_ids" else None,
            )


def _check_finite(rows: list[np.ndarray]) -> None:
    for i, row in enumerate(rows):
        bad = np.flatnonzero(~np.isfinite(row))
        if bad.size:
            raise InvalidRequest(
                f"rollout_logprobs[{i}][{bad[0]}] is {row[bad[0]]}; log-probs must be finite",
                field="rollout_logprobs",
                row=i,
            )


def to_frame(body: Mapping[str, Any]) -> bytes:
    """An answer (answer/layout.py's body: rows as numpy arrays) as one frame: each row's bytes are
    copied once, straight into the frame (converted first only where its dtype is not the wire's)."""
    fields = {
        k: v for k, v in body.items() if (k not in RESPONSE_ARRAYS and k not in WIDE_ARRAYS) or v is None
    }
    arrays: list[tuple[ArraySpec, Buffer | list[memoryview]]] = []
    routes = body.get("routed_experts")
    if routes is not None:
        fields.pop("routed_experts", None)
        arrays.append(_routes_array(routes, int(body["moe"]["experts"])))
    for name, dtype in RESPONSE_ARRAYS.items():
        rows = body.get(name)
        if rows is None:
            continue
        wire = np.dtype(dtype).newbyteorder("<")
        blocks = [np.ascontiguousarray(row, dtype=wire) for row in rows]
        arrays.append((ArraySpec(name, dtype, tuple(b.size for b in blocks)), _bytes_of(blocks)))
    columns: dict[str, int] = {}
    for name, wide_dtype in WIDE_ARRAYS.items():
        rows = body.get(name)
        if rows is None:
            continue
        spec, data, columns[name] = _wide_array(name, rows, wide_dtype)
        arrays.append((spec, data))
    if columns:
        fields["columns"] = columns
    return pack(orjson.dumps(fields, option=orjson.OPT_SERIALIZE_NUMPY), arrays)


def _bytes_of(blocks: list[np.ndarray]) -> list[memoryview]:
    """C-contiguous arrays' bytes, no copy: the frame's pieces."""
    return [b.reshape(-1).view(np.uint8).data for b in blocks if b.size]


def _wide_array(name: str, rows: list[Any], dtype: str | None) -> tuple[ArraySpec, list[memoryview], int]:
    """[window, K] blocks (one K for every row) as one array's pieces, and K. dtype None: token ids,
    u2 when every id is below 65536, else i4 (the first row with a larger id ends the search). A
    block already in the wire dtype and C-contiguous (the response's int32 ids and float32 log-probs)
    goes into the frame as it is."""
    blocks = [np.asarray(row) for row in rows]
    widths = {int(b.shape[1]) for b in blocks if b.ndim == 2 and b.shape[0]}
    if len(widths) > 1:
        raise ValueError(f"{name}: rows of {sorted(widths)} columns; a frame carries one K per field")
    width = widths.pop() if widths else 0
    if dtype is None:
        dtype = "i4" if any(int(b.max()) >= 65536 for b in blocks if b.size) else "u2"
    wire = np.dtype(dtype).newbyteorder("<")
    blocks = [np.ascontiguousarray(b, dtype=wire) for b in blocks]
    spec = ArraySpec(name, dtype, tuple(int(b.size) for b in blocks))
    return spec, _bytes_of(blocks), width


def _routes_array(rows: list[Any], experts: int) -> tuple[ArraySpec, list[memoryview]]:
    """Recorded routes (arrays) as one array's pieces: u1 when every id fits a byte (at most 256
    experts), else u2, else i4. The engine's rows are narrow already: converted only where their
    dtype is not the frame's."""
    dtype = np.dtype("u1" if experts <= 256 else "u2" if experts <= 65536 else "i4").newbyteorder("<")
    flat = [np.ascontiguousarray(np.ravel(r), dtype=dtype) for r in rows]
    spec = ArraySpec("routed_experts", dtype.str[1:], tuple(int(r.size) for r in flat))
    return spec, _bytes_of(flat)
