"""An answer's big arrays as JSON text written natively: base64 strings a row, or nested lists.

- `base64_rows(blocks, dtype)`: `["<base64>", ...]`, each block's values as little-endian `dtype`
  (int32 or float32), base64 in the standard alphabet with padding, as SGLang writes
  `meta_info.routed_experts`; u1 and u2 ids are widened to int32 on the way, no wide copy made.
- `int_lists(blocks)`: `[<block>, ...]`, each block of integer ids (recorded routes [P, layers, k],
  top_ids [window, K]) as nested lists, the bytes orjson writes for it.
- `float_lists(blocks)`: the same for float32 blocks (top_logprobs, candidate_logprobs [window, K]):
  each value the shortest decimal that reads back as the same float32, NaN and infinities null, the
  bytes orjson writes.

The native writers (service.wire._jsonrows: b64_strings, int_lists, float_lists) write where the blocks lie,
the GIL released; without them, binascii and orjson do. answer/layout.py puts the text into the
answer as an orjson Fragment: no str is made of it, and orjson copies it once.
"""

from __future__ import annotations

import binascii
from collections.abc import Sequence

import numpy as np
import orjson

from service.wire.jsonrows import native

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
