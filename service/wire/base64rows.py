"""An answer's big arrays as JSON arrays of base64 strings, one string a row (routes, distributions).

`json_strings(blocks, dtype)` writes `["<base64>", ...]`: each block's values as little-endian
`dtype` (int32 or float32), base64 in the standard alphabet with padding, as SGLang writes
`meta_info.routed_experts`. The native writer (service.wire._jsonrows.b64_strings, the GIL released)
encodes the blocks where they lie, widening u1 and u2 ids to int32 on the way; without it, binascii
encodes each block's bytes. answer/layout.py puts the result into the answer as an orjson Fragment:
no str is made of it, and orjson copies it once.
"""

from __future__ import annotations

import binascii
from collections.abc import Sequence

import numpy as np

from service.wire.jsonrows import native

_WIDENED = {np.dtype(np.uint8): 1, np.dtype(np.uint16): 2}


def json_strings(blocks: Sequence[np.ndarray], dtype: str) -> bytes:
    """The JSON array of each block's base64 string, its values as little-endian `dtype` ("<i4" or
    "<f4"); blocks of u1 or u2 ids go to "<i4" without a wide copy where the native writer is built."""
    wire = np.dtype(dtype)
    reader = native()
    if reader is None:
        parts = [binascii.b2a_base64(np.ascontiguousarray(b, wire).tobytes(), newline=False) for b in blocks]
        return b'["' + b'","'.join(parts) + b'"]' if parts else b"[]"
    if wire == np.dtype("<i4") and blocks and all(b.dtype in _WIDENED for b in blocks):
        kinds = {b.dtype for b in blocks}
        if len(kinds) == 1:
            return reader.b64_strings([np.ascontiguousarray(b) for b in blocks], _WIDENED[kinds.pop()])
    return reader.b64_strings([np.ascontiguousarray(b, wire) for b in blocks], 4)
