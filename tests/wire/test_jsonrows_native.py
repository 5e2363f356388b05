"""service/wire/_jsonrows.c, the native reader of a JSON body's rows of token ids, against orjson's path:
the same rows, or the same refusal, on random matrices in random whitespace and on each perturbed."""

from __future__ import annotations

from typing import Any

import numpy as np

from service.wire.jsonrows import _int_rows, _orjson_rows
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
