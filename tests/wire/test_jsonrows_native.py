"""service/wire/_jsonrows.c, the native reader of a JSON body's rows of token ids, against orjson's path:
the same rows, or the same refusal, on random matrices in random whitespace and on each perturbed."""

from __future__ import annotations

import base64
import json
import re
from typing import Any

import numpy as np
import orjson

from service.wire.jsonrows import _int_rows, _members, _numpy_members, _orjson_rows, _route_rows
from service.wire.schemas import Base64Ids
from tests.support.needs import native_or_skip


def _rows_or_none(rows: list[Any] | None) -> list[list[int]] | None:
    return None if rows is None else [row.tolist() for row in rows]


def test_the_native_reader_and_orjsons_read_and_refuse_alike() -> None:
    """Random matrices in random whitespace, then each perturbed at a random place (a byte removed,
    doubled, or replaced by a digit, a bracket, a comma, whitespace, a sign or a letter): the native
    reader gives what orjson's gives, rows or None, read from the middle of a larger buffer."""
    native_or_skip()
    rng = np.random.default_rng(7)
    space = [b"", b" ", b"\n", b"\t ", b"\r\n  "]
    swaps = [b"0", b"7", b"[", b"]", b",", b" ", b"-", b"e", b".", b"x", b"00"]
    accepted = refused = 0
    for _ in range(400):

        def ws() -> bytes:
            return space[int(rng.integers(len(space)))] if rng.random() < 0.3 else b""

        rows = [
            [
                int(rng.choice([0, 1, 9, 10, 151935, 10**17, 10**18 - 1, int(rng.integers(0, 10**6))]))
                for _ in range(int(rng.integers(1, 6)))
            ]
            for _ in range(int(rng.integers(1, 5)))
        ]
        text = (
            ws()
            + b"["
            + b",".join(
                ws() + b"[" + b",".join(ws() + str(v).encode() + ws() for v in row) + b"]" + ws()
                for row in rows
            )
            + b"]"
            + ws()
        )
        texts = [text]
        for _ in range(3):
            at = int(rng.integers(len(text)))
            swap = swaps[int(rng.integers(len(swaps)))]
            texts += [text[:at] + text[at + 1 :], text[:at] + swap + text[at:]]
            texts.append(text[:at] + swap + text[at + 1 :])
        for t in texts:
            raw = b'{"input_ids": ' + t + b', "x": 1}'
            start = len(b'{"input_ids": ')
            want = _rows_or_none(_orjson_rows(t.rstrip(b" \t\n\r")))
            got = _rows_or_none(_int_rows(raw, start, start + len(t)))
            assert got == want, t
            accepted += want is not None
            refused += want is None
    assert accepted > 400  # both sides of the grammar were exercised
    assert refused > 1000
    assert _int_rows(b"[[1]]", 0, 6) is None  # past the buffer: None, not a read out of bounds


_ALPHABET = re.compile(rb"[A-Za-z0-9+/]*={0,2}")


def _reference_routes(text: bytes) -> list[Any] | None:
    """What route_rows gives for `text`, by orjson and numpy: per row None, the ids of canonical
    base64 of whole int32 (a multiple of 4 characters, `=` only at the end), the str of any other
    plain string, or [positions, layers, top_k] ids of regular nested lists of int32 (no empty list
    inside); None where the field holds anything else (or a string with an escape)."""
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(value, list) or b"\\" in text:
        return None
    out: list[Any] = []
    for row in value:
        if row is None:
            out.append(None)
        elif isinstance(row, str):
            raw = row.encode()
            canonical = len(raw) % 4 == 0 and _ALPHABET.fullmatch(raw) is not None
            decoded = base64.b64decode(raw) if canonical else b"?"
            if len(decoded) % 4:
                out.append(row)
            else:
                out.append(np.frombuffer(decoded, "<i4").astype(np.int64))
        elif isinstance(row, list):
            if not row:
                out.append(np.zeros(0, np.int64))
                continue
            try:
                ids = np.array(row, dtype=object)
            except ValueError:  # ragged
                return None
            if ids.ndim != 3 or 0 in ids.shape or any(type(x) is not int for x in ids.ravel()):
                return None
            if any(x < -(2**31) or x >= 2**31 for x in ids.ravel()):
                return None
            out.append(ids.astype(np.int64))
        else:
            return None
    return out


def _native_routes(raw: bytes, start: int, end: int) -> list[Any] | None:
    rows = _route_rows(raw, start, end)
    if rows is None:
        return None
    return [r.ids.astype(np.int64) if isinstance(r, Base64Ids) else r for r in rows]


def _same_rows(got: list[Any] | None, want: list[Any] | None) -> bool:
    if got is None or want is None:
        return got is want
    if len(got) != len(want):
        return False
    for a, b in zip(got, want, strict=True):
        if isinstance(b, np.ndarray):
            if not (isinstance(a, np.ndarray) and a.shape == b.shape and np.array_equal(a, b)):
                return False
        elif a != b:
            return False
    return True


def test_the_native_route_reader_reads_and_refuses_as_orjson_and_numpy_do() -> None:
    """Random route fields (null rows, SGLang's base64, nested lists, ids past 255 in some) in random
    whitespace, then each perturbed at a random place: the native reader's rows (the field's ids u1
    where every one fits a byte, else int32) are the reference's, or both refuse."""
    native_or_skip()
    rng = np.random.default_rng(11)
    space = [b"", b" ", b"\n", b"\t ", b"\r\n  "]
    swaps = [b"0", b"7", b"[", b"]", b",", b" ", b"-", b"e", b".", b"=", b"A", b'"', b"null", b"@", b"00"]
    accepted = refused = strings = widened = 0
    for _ in range(300):

        def ws() -> bytes:
            return space[int(rng.integers(len(space)))] if rng.random() < 0.3 else b""

        wide = rng.random() < 0.3
        rows: list[bytes] = []
        for _ in range(int(rng.integers(1, 5))):
            kind = rng.random()
            shape = (int(rng.integers(0, 4)), int(rng.integers(1, 3)), int(rng.integers(1, 4)))
            ids = rng.integers(-3 if wide else 0, 70000 if wide else 256, size=shape)
            if kind < 0.2:
                rows.append(b"null")
            elif kind < 0.6:
                rows.append(b'"' + base64.b64encode(ids.astype("<i4").tobytes()) + b'"')
            else:
                rows.append(
                    b"["
                    + b",".join(
                        ws()
                        + b"["
                        + b",".join(ws() + orjson.dumps(layer.tolist()) + ws() for layer in p)
                        + b"]"
                        for p in ids
                    )
                    + ws()
                    + b"]"
                )
        text = ws() + b"[" + b",".join(ws() + r + ws() for r in rows) + b"]" + ws()
        texts = [text]
        for _ in range(3):
            at = int(rng.integers(len(text)))
            swap = swaps[int(rng.integers(len(swaps)))]
            texts += [
                text[:at] + text[at + 1 :],
                text[:at] + swap + text[at:],
                text[:at] + swap + text[at + 1 :],
            ]
        for t in texts:
            raw = b'{"routed_experts": ' + t + b', "x": 1}'
            start = len(b'{"routed_experts": ')
            want = _reference_routes(t)
            got = _native_routes(raw, start, start + len(t))
            assert _same_rows(got, want), t
            accepted += want is not None
            refused += want is None
            strings += want is not None and any(isinstance(r, str) for r in want)
            if got is not None:
                narrow = all(0 <= v < 256 for r in want or [] if isinstance(r, np.ndarray) for v in r.ravel())
                dtypes = {
                    r.dtype
                    for r in _route_rows(raw, start, start + len(t)) or []
                    if isinstance(r, np.ndarray)
                }
                assert dtypes <= ({np.dtype(np.uint8)} if narrow else {np.dtype("<i4")}), t
                widened += not narrow
    assert accepted > 300
    assert widened > 50
    assert refused > 300
    assert strings > 20  # strings left for normalise to judge were made too
    assert _route_rows(b'["AAAA"]', 0, 9) is None  # past the buffer: None, not a read out of bounds


def test_the_native_member_finder_agrees_with_numpys() -> None:
    """Random bodies (plain top-level keys; strings holding brackets, commas, colons, escaped quotes
    and backslashes; nested arrays and objects; random whitespace), then each perturbed: where both
    find members they find the same, and on the unperturbed bodies, which are JSON, both find them."""
    native_or_skip()
    rng = np.random.default_rng(3)
    pieces = ["a", "[", "]", "{", "}", ",", ":", '"', "\\", " ", "é", "0"]

    def text() -> str:
        return "".join(pieces[int(i)] for i in rng.integers(len(pieces), size=int(rng.integers(0, 8))))

    def value(depth: int = 0) -> Any:
        kind = int(rng.integers(6 if depth < 3 else 4))
        if kind == 0:
            return text()
        if kind == 1:
            return int(rng.integers(-5, 10**6))
        if kind == 2:
            return [None, True, 1.5][int(rng.integers(3))]
        if kind == 3:
            return []
        if kind == 4:
            return [value(depth + 1) for _ in range(int(rng.integers(1, 4)))]
        return {text(): value(depth + 1) for _ in range(int(rng.integers(1, 3)))}

    agreed = 0
    for _ in range(400):
        body = {f"k{i}": value() for i in range(int(rng.integers(1, 5)))}  # top-level keys plain
        raw = json.dumps(
            body, indent=int(rng.integers(2)) or None, ensure_ascii=bool(rng.integers(2))
        ).encode()
        texts = [raw]
        for _ in range(3):
            at = int(rng.integers(len(raw)))
            texts.append(raw[:at] + raw[at + 1 :])
            texts.append(raw[:at] + b'"' + raw[at:])
        for i, t in enumerate(texts):
            got, want = _members(t), _numpy_members(t)
            if i == 0:
                assert got is not None, t
                assert want is not None, t
            if got is not None and want is not None:
                assert got == want, t
                agreed += 1
    assert agreed > 600
