"""wire/base64rows.json_strings: the JSON array of each block's base64 string, as the standard library
writes it (little-endian int32 or float32, padded, every length mod 3), whether the native writer
encoded the blocks where they lie (widening u1 and u2 ids to int32) or binascii did."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from service.wire import jsonrows
from service.wire.base64rows import json_strings
from tests.conftest import native_or_skip


@pytest.fixture(autouse=True, params=["native", "binascii"])
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
    text = json_strings(blocks, "<i4")
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
    text = json_strings(blocks, "<f4")
    assert json.loads(text) == _want(blocks, "<f4")
    got = np.frombuffer(base64.b64decode(json.loads(text)[0]), "<f4").reshape(9, 7)
    assert got.tobytes() == values.tobytes()


def test_no_blocks_is_an_empty_array() -> None:
    assert json_strings([], "<i4") == b"[]"
