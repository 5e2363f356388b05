"""wire/jsonarrays: base64_rows, the JSON array of each block's base64 string as the standard library
writes it (little-endian int32 or float32, padded, every length mod 3), whether the native writer
encoded the blocks where they lie (widening u1 and u2 ids to int32) or binascii did; int_lists, the
blocks as nested lists, the bytes orjson writes, natively or by orjson."""

from __future__ import annotations

import base64
import json

import numpy as np
import orjson
import pytest

from service.wire import jsonrows
from service.wire.jsonarrays import base64_rows, int_lists
from tests.support.needs import native_or_skip

NUMPY = orjson.OPT_SERIALIZE_NUMPY


@pytest.fixture(autouse=True, params=["native", "python"])
def writer(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "native":
        native_or_skip()
    else:
        monkeypatch.setattr(jsonrows, "native", lambda: None)
    return str(request.param)


def _want(blocks: list[np.ndarray], dtype: str) -> list[str]:
    return [base64.b64encode(np.asarray(b).astype(dtype).tobytes()).decode() for b in blocks]


@pytest.mark.parametrize("source", ["u1", "u2", "<i4", "i8"])
def test_ids_of_any_narrow_dtype_go_out_as_int32(source: str) -> None:
    rng = np.random.default_rng(0)
    top = {"u1": 256, "u2": 65536, "<i4": 2**31 - 1, "i8": 2**31 - 1}[source]
    blocks = [rng.integers(0, top, size=(n, 3, 2)).astype(source) for n in (0, 1, 2, 3, 5, 700)]
    blocks.append(blocks[-1][:, 1:, :])  # not contiguous
    text = base64_rows(blocks, "<i4")
    assert json.loads(text) == _want(blocks, "<i4")
    for row, block in zip(json.loads(text), blocks, strict=True):  # decoded as docs/api.md shows
        np.testing.assert_array_equal(
            np.frombuffer(base64.b64decode(row), "<i4").reshape(-1, *block.shape[1:]), block
        )


def test_float32_blocks_keep_every_bit() -> None:
    rng = np.random.default_rng(1)
    values = rng.standard_normal((9, 7)).astype(np.float32)
    values[0, :3] = [-np.inf, np.nan, -0.0]
    blocks = [values, values[:4], values[:0], values[:, :5]]
    text = base64_rows(blocks, "<f4")
    assert json.loads(text) == _want(blocks, "<f4")
    got = np.frombuffer(base64.b64decode(json.loads(text)[0]), "<f4").reshape(9, 7)
    assert got.tobytes() == values.tobytes()


def test_no_blocks_is_an_empty_array() -> None:
    assert base64_rows([], "<i4") == b"[]"


@pytest.mark.parametrize("dtype", ["u1", "u2", "u4", "u8", "i1", "i2", "i4", "i8", ">i4"])
def test_int_lists_are_orjsons_bytes(dtype: str) -> None:
    """Every width and sign, the extremes and each count of digits, 1 to 4 dimensions, an empty
    first dimension, a block not contiguous: the bytes orjson writes for the arrays."""
    rng = np.random.default_rng(2)
    info = np.iinfo(np.dtype(dtype))
    shapes = [(3, 2, 2), (0, 2, 2), (1, 1, 1), (5,), (2, 3), (4, 1, 2, 3), (2, 3, 4, 5)]
    native = np.dtype(dtype).newbyteorder("=")
    blocks = [
        rng.integers(info.min, info.max, size=s, endpoint=True, dtype=native).astype(dtype) for s in shapes
    ]
    edges = [
        v for v in (info.min, -1, 0, 9, 10, 99, 100, 101, 999, 1000, info.max) if info.min <= v <= info.max
    ]
    blocks += [np.array(edges, dtype=dtype), blocks[-1][:, ::2]]
    want = orjson.dumps([np.ascontiguousarray(b, native) for b in blocks], option=NUMPY)
    assert int_lists(blocks) == want
    routes = [rng.integers(0, 128, size=(n, 48, 8)).astype(np.uint8) for n in (700, 1, 0)]
    assert int_lists(routes) == orjson.dumps(routes, option=NUMPY)


@pytest.mark.parametrize("width", [1, 2, 3, 8])
def test_u1_rows_every_id_in_every_place(width: int) -> None:
    """u1 rows are written 4 bytes an id: every id (1, 2 and 3 digits) first, inside and last in a row,
    and last in the whole answer (nothing written past its end), as orjson writes them."""
    ids = np.arange(256, dtype=np.uint8)
    rng = np.random.default_rng(width)
    rows = np.concatenate([np.roll(ids, s) for s in range(width)]).reshape(-1, width)  # [256 (...), width]
    for last in (0, 7, 42, 255):
        blocks = [rng.permutation(rows).reshape(-1, 1, width), np.array([[last]], dtype=np.uint8)]
        assert int_lists(blocks) == orjson.dumps(blocks, option=NUMPY)
        assert int_lists([np.full((1, 1, width), last, np.uint8)]) == orjson.dumps(
            [np.full((1, 1, width), last, np.uint8)], option=NUMPY
        )
