"""A /logprobs JSON body parsed fast: its integer rows and routes straight into numpy, the rest by pydantic.

The rows of integers (`input_ids`, `prompt_ids`, `attention_mask`, `action_mask`: MATRIX_FIELDS) are
nearly all of a plain body's bytes. `parse_json` finds the top-level members of the body (the native
reader's `members`: one pass, strings skipped by memchr; else numpy: its strings and brackets located
once, no per-token Python), reads each of those fields written in the plain form into int64 rows (one
array per field), and validates every other member with the same pydantic fields
(schemas.JsonOptions). The plain form: a non-empty list of non-empty lists of unsigned decimal
integers below 10^18, JSON whitespace anywhere between tokens. The rows are read by the native reader
`service.wire._jsonrows` (one pass in C, the GIL released) where the install built it, else by
orjson into Python ints and then numpy; both accept exactly the plain form. Bodies under
FAST_MIN_BYTES go to parse_request at once.

Routes (`routed_experts`, `prompt_routed_experts`: ROUTE_FIELDS) are most of a routed body's bytes:
where the native reader is built, it reads them in one pass, each row null, SGLang's base64 string
decoded straight from the body (a Base64Ids) or nested lists as one [positions, layers, top_k] array
(a view), the ids of the whole field in u1 when they fit, else int32; a string that is not canonical
base64 stays a str (normalise judges it, as it judges every row). Without the native reader, or for a
row in any other form, pydantic reads them like the other members.

Anything else goes to schemas.parse_request, as every body did before: a sign, an exponent, a
leading zero, a null, a duplicate or escaped key, invalid JSON, a member that fails validation. So
the fast path accepts exactly what parse_request accepts, and gives the same request with those rows
as int64 arrays (views of one array per field, as a compact frame's rows are; service/normalise/
reads both); every error is parse_request's own, naming the same field.
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import orjson
from pydantic import ValidationError

from service.core.jobs import IntArray
from service.wire.schemas import (
    MATRIX_FIELDS,
    ROUTE_FIELDS,
    Base64Ids,
    JsonOptions,
    LogprobsRequest,
    parse_request,
)

log = logging.getLogger(__name__)

_QUOTE, _BACKSLASH, _COMMA, _COLON = 34, 92, 44, 58
_OPEN_LIST, _CLOSE_LIST, _OPEN_OBJECT, _CLOSE_OBJECT = 91, 93, 123, 125
_WHITESPACE = b" \t\n\r"  # JSON's
# under this, the fixed cost of finding the members (~0.1 ms) outweighs what numpy saves (~25 ns a token)
FAST_MIN_BYTES = 16 * 1024
_ROW_BYTES = b"0123456789,[]" + _WHITESPACE  # every byte of a plain matrix of unsigned integers
_LIMIT = 10**18  # every smaller integer fits int64; larger ones go to parse_request (its 64-bit check)


def parse_json(raw: bytes, min_bytes: int = FAST_MIN_BYTES) -> LogprobsRequest:
    """The LogprobsRequest of a JSON body, as parse_request gives it (its errors too); bodies under
    `min_bytes` go to parse_request directly."""
    fast = _fast(raw) if len(raw) >= min_bytes else None
    return fast if fast is not None else parse_request(raw)


@dataclass(frozen=True, slots=True)
class _Member:
    """One top-level member of the body: its key and the byte ranges of the member and its value."""

    key: bytes
    start: int
    end: int
    value: int  # where the value starts (whitespace stripped)


def _fast(raw: bytes) -> LogprobsRequest | None:
    members = _members(raw)
    if members is None:
        return None
    rows: dict[str, list[Any]] = {}
    rest: list[bytes] = []
    reader = native()
    for m in members:
        name = m.key.decode("ascii", errors="replace")
        routes = name in ROUTE_FIELDS and reader is not None and raw[m.value] == _OPEN_LIST
        if name not in MATRIX_FIELDS and not routes:
            rest.append(raw[m.start : m.end])
            continue
        if name in rows:
            return None  # a duplicate: parse_request decides
        read = _int_rows(raw, m.value, m.end) if not routes else _route_rows(raw, m.value, m.end)
        if read is None:
            return None
        rows[name] = read
    if "input_ids" not in rows:
        return None
    try:
        options = JsonOptions.model_validate_json(b"{" + b",".join(rest) + b"}")
    except ValidationError:
        return None
    if any(name in options.model_fields_set for name in rows):
        return None  # a duplicate read by both: parse_request decides
    fields: dict[str, Any] = dict(options)
    fields.update(rows)
    return LogprobsRequest.model_construct(options.model_fields_set | set(rows), **fields)


def _unescaped(data: np.ndarray, quotes: IntArray) -> IntArray:
    """The quotes that delimit strings: those after an even number of backslashes."""
    at = np.arange(data.shape[0])
    last_other = np.maximum.accumulate(np.where(data == _BACKSLASH, -1, at))  # [n] last non-backslash
    before = quotes - 1
    run = np.where(before >= 0, before - last_other[np.maximum(before, 0)], 0)
    kept: IntArray = quotes[run % 2 == 0]
    return kept


def _members(raw: bytes) -> list[_Member] | None:
    """The members of the body's top-level object, or None where it is not plainly one: the native
    reader's, else found with numpy."""
    reader = native()
    if reader is None:
        return _numpy_members(raw)
    found = reader.members(raw)
    if found is None:
        return None
    return [
        _Member(raw[key:close], start, end, value)
        for start, key, close, value, end in np.frombuffer(found, dtype=np.int64).reshape(-1, 5).tolist()
    ]


def _numpy_members(raw: bytes) -> list[_Member] | None:
    """_members with numpy: strings and brackets located once, no per-token Python."""
    data = np.frombuffer(raw, dtype=np.uint8)
    quotes = np.flatnonzero(data == _QUOTE)
    if raw.find(b"\\") != -1:
        quotes = _unescaped(data, quotes)
    if quotes.size % 2:
        return None
    brackets = np.flatnonzero(
        (data == _OPEN_LIST) | (data == _CLOSE_LIST) | (data == _OPEN_OBJECT) | (data == _CLOSE_OBJECT)
    )
    brackets = brackets[np.searchsorted(quotes, brackets) % 2 == 0]  # outside strings
    if brackets.size < 2:
        return None
    kinds = data[brackets]
    depth = np.cumsum(np.where((kinds == _OPEN_LIST) | (kinds == _OPEN_OBJECT), 1, -1))  # after each
    body = raw.strip(_WHITESPACE)
    first, last = len(raw) - len(raw.lstrip(_WHITESPACE)), len(raw.rstrip(_WHITESPACE)) - 1
    if not body or brackets[0] != first or kinds[0] != _OPEN_OBJECT or brackets[-1] != last:
        return None
    if kinds[-1] != _CLOSE_OBJECT or depth.min() < 0 or np.count_nonzero(depth == 0) != 1:
        return None
    # the top level: the stretches after a bracket that leaves depth 1, up to the next bracket
    top = np.flatnonzero(depth[:-1] == 1)
    separators = [first]
    for a, b in zip(brackets[top].tolist(), brackets[top + 1].tolist(), strict=True):
        at = raw.find(b",", a + 1, b)
        while at != -1:
            if np.searchsorted(quotes, at) % 2 == 0:
                separators.append(at)
            at = raw.find(b",", at + 1, b)
    separators.append(last)
    members = []
    for start, end in itertools.pairwise(separators):
        member = _member(raw, quotes, start + 1, end)
        if member is None:
            return None
        members.append(member)
    return members


def _member(raw: bytes, quotes: IntArray, start: int, end: int) -> _Member | None:
    """`"key": value` in raw[start:end]; None unless its key is a plain string (no escapes)."""
    at = int(np.searchsorted(quotes, start))
    if at + 1 >= quotes.size:
        return None
    opening, closing = int(quotes[at]), int(quotes[at + 1])
    if closing >= end or raw[start:opening].strip(_WHITESPACE) or b"\\" in raw[opening:closing]:
        return None
    colon = raw.find(b":", closing, end)
    if colon == -1 or raw[closing + 1 : colon].strip(_WHITESPACE):
        return None
    value = colon + 1 + (len(raw[colon + 1 : end]) - len(raw[colon + 1 : end].lstrip(_WHITESPACE)))
    return _Member(raw[opening + 1 : closing], start, end, value)


class _Reader(Protocol):
    """service.wire._jsonrows (its stub: _jsonrows.pyi)."""

    def int_rows(self, buffer: bytes, start: int, end: int, /) -> tuple[bytearray, bytearray] | None: ...

    def members(self, buffer: bytes, /) -> bytes | None: ...

    def route_rows(self, buffer: bytes, start: int, end: int, /) -> tuple[bytearray, bytes, int] | None: ...

    def b64_strings(self, blocks: Sequence[Any], itemsize: int, /) -> bytes: ...

    def route_faults(  # noqa: PLR0917 (the C function's arguments)
        self, ids: Any, itemsize: int, signed: bool, layers: int, k: int, experts: int, keep: Any, /
    ) -> tuple[int, int]: ...

    def int_lists(self, blocks: Sequence[Any], itemsize: int, signed: bool, /) -> bytes: ...

    def float_lists(self, blocks: Sequence[Any], /) -> bytes: ...

    def prompt_entries(  # noqa: PLR0917 (the C function's arguments)
        self,
        numbers: bytes,
        ids: Any,
        first_rank: Any,
        keep: Any,
        slots: int,
        pool: Any,
        start: Any,
        length: Any,
        /,
    ) -> bytes: ...


@functools.cache
def native() -> _Reader | None:
    """The native row reader, or None where this install has none (it was not compiled: the orjson
    path reads the rows); one that is there but fails to load is logged as a warning, once."""
    try:
        from service.wire import _jsonrows  # loaded on first use, not at import
    except ModuleNotFoundError:
        return None
    except ImportError as exc:
        log.warning("the native JSON row reader does not load (%s); reading rows with orjson", exc)
        return None
    return _jsonrows


def _int_rows(raw: bytes, start: int, end: int) -> list[IntArray] | None:
    """`raw[start:end]`, `[[1,2],[3]]` (JSON whitespace between tokens), as int64 rows, views of one
    array; None unless in that form with at least one row, no row empty, every integer unsigned,
    without a leading zero, below 10^18."""
    reader = native()
    if reader is None:
        return _orjson_rows(raw[start:end].rstrip(_WHITESPACE))
    read = reader.int_rows(raw, start, end)
    if read is None:
        return None
    values = np.frombuffer(read[0], dtype=np.int64)
    counts = np.frombuffer(read[1], dtype=np.int64)
    return np.split(values, np.cumsum(counts[:-1]))


_NULL, _BASE64, _STRING = 0, 1, 2  # route_rows' kinds of row; 3: nested lists


def _route_rows(raw: bytes, start: int, end: int) -> list[Any] | None:
    """`raw[start:end]` as the rows of a route field (the native reader's route_rows): None, a
    Base64Ids, a str (not canonical base64: normalise says why) or a [positions, layers, top_k] array,
    each a view of one array; None unless in that form."""
    reader = native()
    assert reader is not None
    read = reader.route_rows(raw, start, end)
    if read is None:
        return None
    data, table, itemsize = read
    values = np.frombuffer(data, dtype=np.uint8 if itemsize == 1 else "<i4")
    out: list[Any] = []
    for kind, a, b, layers, k in np.frombuffer(table, dtype=np.int64).reshape(-1, 5).tolist():
        if kind == _NULL:
            out.append(None)
        elif kind == _BASE64:
            out.append(Base64Ids(values[a : a + b]))
        elif kind == _STRING:
            out.append(raw[a:b].decode("ascii"))
        else:
            out.append(values[a : a + b].reshape(-1, layers, k) if b else values[a:a])
    return out


def _orjson_rows(text: bytes) -> list[IntArray] | None:
    """_int_rows without the native reader. orjson parses the text (its JSON grammar rejects a
    leading zero, a stray comma or two numbers apart by whitespace alone); a byte other than digits,
    commas, brackets and whitespace (a sign, a fraction, an exponent, a literal, a string) gives None
    first."""
    if text.translate(None, _ROW_BYTES):
        return None
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(value, list) or not value:
        return None
    counts = [len(row) if isinstance(row, list) else 0 for row in value]
    if 0 in counts:
        return None  # a row that is empty, or not a list
    try:
        values = np.fromiter(itertools.chain.from_iterable(value), dtype=np.int64, count=sum(counts))
    except (TypeError, OverflowError):  # a nested list, or a number past int64
        return None
    if values.max() >= _LIMIT:
        return None
    return np.split(values, np.cumsum(counts[:-1]))
