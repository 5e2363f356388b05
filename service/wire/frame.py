"""The compact body of `POST /logprobs`: a JSON object plus little-endian arrays, one frame.

Media type `application/vnd.logprobd.arrays`, for requests (Content-Type) and answers (Accept).
JSON spends most of a large request's time writing and reading decimal numbers; here every
[rows, ragged length] field travels as one flat array with its row lengths, so neither side parses
a number. Layout (all integers little-endian):

    b"LPDA" | version: u8 = 1 | 3 zero bytes | fields length: u32 | specs length: u32
    | fields: a JSON object, every field of the JSON body except the arrays
    | specs: a JSON list of {"name", "dtype", "lengths"}, the arrays in payload order
    | zero bytes up to a multiple of 8 | each array (its rows concatenated), padded to 8 bytes

dtype is one of i2, i4, i8 (signed), u1, u2 (unsigned), f4, f8 (IEEE float). Routed experts
(`routed_experts`, [positions, moe_layers, top_k] per row) travel flattened, in u1 when every id is
below 256 (one byte per position, layer and slot), else u2 or i4; an answer's [window, K] fields
(`top_ids`, `top_logprobs`, `candidate_logprobs`) likewise, with each field's K in the JSON part's
`columns` (service/wire/arrays.py writes them, service/client/wire.py reads them). Standard library only:
the client (no numpy) and the server share it.
"""

from __future__ import annotations

import json
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass

MEDIA_TYPE = "application/vnd.logprobd.arrays"
MAGIC = b"LPDA"
VERSION = 1
ITEMSIZE = {"i2": 2, "i4": 4, "i8": 8, "u1": 1, "u2": 2, "f4": 4, "f8": 8}
TYPECODE = {
    "i2": "h",
    "i4": "i",
    "i8": "q",
    "u1": "B",
    "u2": "H",
    "f4": "f",
    "f8": "d",
}  # the `array` module's codes
_HEAD = struct.Struct("<4sB3xII")
ALIGN = 8


class FrameError(ValueError):
    """A body that is not a well-formed frame; `field` names the array at fault, if one is."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True, slots=True)
class ArraySpec:
    name: str
    dtype: str
    lengths: tuple[int, ...]

    @property
    def count(self) -> int:
        return sum(self.lengths)

    @property
    def nbytes(self) -> int:
        return self.count * ITEMSIZE[self.dtype]


@dataclass(frozen=True, slots=True)
class Frame:
    fields: bytes  # the JSON object, not yet parsed
    arrays: dict[str, tuple[ArraySpec, memoryview]]  # name -> (spec, its bytes)


def _pad(size: int) -> int:
    return -size % ALIGN


Buffer = bytes | bytearray | memoryview


def pack(fields: bytes, arrays: Sequence[tuple[ArraySpec, Buffer | Sequence[Buffer]]]) -> bytes:
    """One frame from a JSON object's bytes and (spec, little-endian bytes) per array. An array's
    bytes may come as one buffer or as its pieces in order (e.g. one per row, views of the arrays
    that hold them): each is copied once, straight into the frame (one join, no joined array first)."""
    specs = json.dumps(
        [{"name": s.name, "dtype": s.dtype, "lengths": list(s.lengths)} for s, _ in arrays],
        separators=(",", ":"),
    ).encode()
    parts: list[Buffer] = [_HEAD.pack(MAGIC, VERSION, len(fields), len(specs)), fields, specs]
    parts.append(bytes(_pad(_HEAD.size + len(fields) + len(specs))))
    for spec, data in arrays:
        pieces = [data] if isinstance(data, bytes | bytearray | memoryview) else list(data)
        size = sum(memoryview(p).nbytes for p in pieces)
        if size != spec.nbytes:
            raise ValueError(f"{spec.name}: {size} bytes for {spec.count} values of {spec.dtype}")
        parts += [*pieces, bytes(_pad(size))]
    return b"".join(parts)


def unpack(raw: bytes) -> Frame:
    """The frame's parts; FrameError names what is wrong. Array bytes are views, not copies."""
    if len(raw) < _HEAD.size:
        raise FrameError(f"a {MEDIA_TYPE} body starts with a {_HEAD.size}-byte header; got {len(raw)} bytes")
    magic, version, fields_len, specs_len = _HEAD.unpack_from(raw)
    if magic != MAGIC:
        raise FrameError(f"a {MEDIA_TYPE} body starts with {MAGIC!r}, not {bytes(magic)!r}")
    if version != VERSION:
        raise FrameError(f"frame version {version}; this server reads version {VERSION}")
    start = _HEAD.size + fields_len + specs_len
    if start > len(raw):
        raise FrameError(f"the header announces {fields_len + specs_len} bytes of JSON; the body is shorter")
    view = memoryview(raw)
    fields = bytes(view[_HEAD.size : _HEAD.size + fields_len])
    specs = _specs(bytes(view[_HEAD.size + fields_len : start]))
    offset = start + _pad(start)
    arrays: dict[str, tuple[ArraySpec, memoryview]] = {}
    for spec in specs:
        end = offset + spec.nbytes
        if end > len(raw):
            raise FrameError(
                f"{spec.name}: {spec.count} values of {spec.dtype} need {spec.nbytes} bytes; "
                f"the body ends {end - len(raw)} bytes short",
                field=spec.name,
            )
        arrays[spec.name] = (spec, view[offset:end])
        offset = end + _pad(spec.nbytes)
    if offset < len(raw):
        raise FrameError(f"{len(raw) - offset} bytes after the last array")
    return Frame(fields=fields, arrays=arrays)


def _specs(raw: bytes) -> list[ArraySpec]:
    try:
        listed = json.loads(raw)
    except ValueError:
        raise FrameError("the array specs are not valid JSON") from None
    if not isinstance(listed, list):
        raise FrameError("the array specs are a JSON list of {name, dtype, lengths}")
    specs: list[ArraySpec] = []
    for item in listed:
        if not isinstance(item, dict) or set(item) != {"name", "dtype", "lengths"}:
            raise FrameError("each array spec is an object with exactly name, dtype and lengths")
        name, dtype, lengths = item["name"], item["dtype"], item["lengths"]
        if not isinstance(name, str) or any(s.name == name for s in specs):
            raise FrameError(f"array name {name!r} is not a string, or repeats")
        if dtype not in ITEMSIZE:
            raise FrameError(f"{name}: dtype {dtype!r}; one of {', '.join(ITEMSIZE)}", field=name)
        if not isinstance(lengths, list) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in lengths
        ):
            raise FrameError(f"{name}: lengths must be a list of non-negative integers", field=name)
        specs.append(ArraySpec(name, dtype, tuple(lengths)))
    return specs


def encode_rows(
    name: str, rows: Sequence[Sequence[int]] | Sequence[Sequence[float]], dtype: str
) -> tuple[ArraySpec, bytes]:
    """Python rows as one array of the frame (the client's side: no numpy)."""
    from array import array

    values = array(TYPECODE[dtype])
    for row in rows:
        values.extend(row)  # type: ignore[arg-type]  # ints into i/q/B, floats into f/d
    if sys.byteorder != "little":
        values.byteswap()
    return ArraySpec(name, dtype, tuple(len(row) for row in rows)), values.tobytes()


def decode_rows(spec: ArraySpec, data: memoryview) -> list[list[int]] | list[list[float]]:
    """An array of the frame as Python rows (the client's side: no numpy)."""
    from array import array

    values = array(TYPECODE[spec.dtype])
    values.frombytes(data)
    if sys.byteorder != "little":
        values.byteswap()
    flat = values.tolist()
    rows, start = [], 0
    for n in spec.lengths:
        rows.append(flat[start : start + n])
        start += n
    return rows
