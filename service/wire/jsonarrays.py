"""An answer's big arrays as JSON text written natively: base64 strings a row, or nested lists.

- `base64_rows(blocks, dtype)`: `["<base64>", ...]`, each block's values as little-endian `dtype`
  (int32 or float32), base64 in the standard alphabet with padding, as SGLang writes
  `meta_info.routed_experts`; u1 and u2 ids are widened to int32 on the way, no wide copy made.
- `int_lists(blocks)`: `[<block>, ...]`, each block of integer ids (recorded routes [P, layers, k],
  top_ids [window, K]) as nested lists, the bytes orjson writes for it.
- `float_lists(blocks)`: the same for float32 blocks (top_logprobs, candidate_logprobs [window, K]):
  each value the shortest decimal that reads back as the same float32, NaN and infinities null, the
  bytes orjson writes.

- `pieces(write, blocks, run)`: the same bytes as `write(blocks)` in parts of about PIECE_VALUES
  values, written by `run` (an Executor's map writes them at once, on its threads): small blocks
  together, a bigger one cut along its first axis (never a base64 string).

The native writers (service.wire._jsonrows: b64_strings, int_lists, float_lists) write where the blocks lie,
the GIL released; without them, binascii and orjson do. answer/layout.py puts the text into the
answer between orjson's JSON around it: no str is made of it, and it is never joined.
"""

from __future__ import annotations

import binascii
import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from service.wire.jsonrows import native

Writer = Callable[[Sequence[np.ndarray]], bytes]  # base64_rows (of one dtype), int_lists, float_lists
Run = Callable[[Callable[[Any], bytes], Iterable[Any]], Iterator[bytes]]  # map, or an Executor's map
PIECE_VALUES = 1 << 16  # values a piece holds: a few hundred KB of text, ~1 ms to write

_WIDENED = {np.dtype(np.uint8): 1, np.dtype(np.uint16): 2}


def base64_rows(blocks: Sequence[np.ndarray], dtype: str) -> bytes:
    """The JSON array of each block's base64 string, its values as little-endian `dtype` ("<i4" or
    "<f4"); blocks of u1 or u2 ids go to "<i4" without a wide copy where the native writer is built."""
    wire = np.dtype(dtype)
    writer = native()
    if writer is None:
        parts = [binascii.b2a_base64(np.ascontiguousarray(b, wire).tobytes(), newline=False) for b in blocks]
        return b'["' + b'","'.join(parts) + b'"]' if parts else b"[]"
    kinds = {b.dtype for b in blocks}
    if wire == np.dtype("<i4") and len(kinds) == 1 and (kind := kinds.pop()) in _WIDENED:
        return writer.b64_strings([np.ascontiguousarray(b) for b in blocks], _WIDENED[kind])
    return writer.b64_strings([np.ascontiguousarray(b, wire) for b in blocks], 4)


def _nested(rows: Sequence[np.ndarray]) -> bool:
    """Every block has a dimension and none empty but the first: the native writers' blocks."""
    return all(b.ndim and (b.size or not b.shape[0]) for b in rows)


def int_lists(blocks: Sequence[np.ndarray]) -> bytes:
    """The JSON array of the blocks (integer arrays of one dtype) as nested lists."""
    rows = [np.ascontiguousarray(b, b.dtype.newbyteorder("=")) for b in blocks]  # as orjson takes them
    writer = native()
    kinds = {b.dtype for b in rows}
    if writer is None or len(kinds) != 1 or not _nested(rows):
        return orjson.dumps(rows, option=orjson.OPT_SERIALIZE_NUMPY)
    kind = kinds.pop()
    return writer.int_lists(rows, kind.itemsize, kind.kind == "i")


def float_lists(blocks: Sequence[np.ndarray]) -> bytes:
    """The JSON array of the blocks, each as float32, as nested lists."""
    rows = [np.ascontiguousarray(b, np.float32) for b in blocks]
    writer = native()
    if writer is None or not _nested(rows):
        return orjson.dumps(rows, option=orjson.OPT_SERIALIZE_NUMPY)
    return writer.float_lists(rows)


@dataclass(frozen=True, slots=True)
class _Piece:
    """A part of a big array's text: what the writer writes of `blocks`, less `depth` brackets each
    side, between `opens` and `closes`."""

    blocks: Sequence[np.ndarray]
    depth: int
    opens: bytes
    closes: bytes


def pieces(
    write: Writer,
    blocks: Sequence[np.ndarray],
    run: Run = map,
    *,
    within_rows: bool = True,
    most: int | None = None,
) -> Iterator[bytes]:
    """`write(blocks)` as parts in order, each written by `run` (an Executor's map submits them all
    at once): consecutive blocks together up to `most` values (default PIECE_VALUES), and
    (`within_rows`: nested lists, whose rows may be cut) a block over `most` in pieces of its first
    axis."""
    cut = list(_cuts(blocks, most or PIECE_VALUES, within_rows))
    if len(cut) <= 1:
        cut = [_Piece(blocks, 0, b"", b"")]  # the writer's text as it is
    return run(functools.partial(_written, write), cut)


def _written(write: Writer, piece: _Piece) -> bytes:
    text = write(piece.blocks)
    if not piece.depth:
        return text
    return b"".join((piece.opens, memoryview(text)[piece.depth : len(text) - piece.depth], piece.closes))


def _cuts(blocks: Sequence[np.ndarray], most: int, within_rows: bool) -> Iterator[_Piece]:
    """The pieces of `[<row 0>,<row 1>,...]`: whole rows a..b written together are `<row a>,...`
    (depth 1); entries s..e of row i alone are `<entry s>,...` (depth 2), the row's brackets around."""
    n = len(blocks)

    def rows(a: int, b: int) -> _Piece:
        return _Piece(blocks[a:b], 1, b"[" if a == 0 else b",", b"]" if b == n else b"")

    start, held = 0, 0  # the rows gathered for the next piece, and their values
    for i, block in enumerate(blocks):
        if within_rows and block.size > most and block.shape[0] > 1:
            if start < i:
                yield rows(start, i)
            length = block.shape[0]
            step = max(1, most * length // block.size)
            for s in range(0, length, step):
                e = min(s + step, length)
                opens = (b"[[" if i == 0 else b",[") if s == 0 else b","
                closes = (b"]]" if i == n - 1 else b"]") if e == length else b""
                yield _Piece([block[s:e]], 2, opens, closes)
            start, held = i + 1, 0
            continue
        if start < i and held + block.size > most:
            yield rows(start, i)
            start, held = i, 0
        held += block.size
    if start < n:
        yield rows(start, n)
