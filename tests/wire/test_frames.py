"""The compact frame (application/vnd.logprobd.arrays): the codec, and the API answering a framed
request exactly as it answers the same request in JSON, errors included."""

from __future__ import annotations

import json
import math
import random
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient

from service.client import Client
from service.client.wire import Scores, from_frame, to_frame
from service.normalise import ModelLimits, normalise
from service.wire.arrays import parse_frame
from service.wire.arrays import to_frame as server_frame
from service.wire.frame import MEDIA_TYPE, ArraySpec, FrameError, decode_rows, encode_rows, pack, unpack
from service.wire.schemas import LogprobsRequest
from tests.support.device import settings_for
from tests.support.faults import Flaky
from tests.support.requests import GROUPED_LAYOUTS, LAYOUTS, make, make_grouped
from tests.support.servers import loopback, running

FRAMED = {"content-type": MEDIA_TYPE, "accept": MEDIA_TYPE}
ROW_FIELDS = ("logprobs", "entropy", "ref_logprobs", "kl", "action_mask")


@pytest.fixture(scope="module")
def server(model_dirs: dict[str, Path], ref_dir: Path) -> Iterator[TestClient]:
    # each body is sent twice (framed, and JSON): no prefix cache, so the answers are equal to the usage
    with running(settings_for(model_dirs["qwen2"], ref_model=ref_dir, prefix_cache=False)) as client:
        yield client


def frame_header(fields: bytes, specs: bytes, version: int = 1, magic: bytes = b"LPDA") -> bytes:
    head = struct.pack("<4sB3xII", magic, version, len(fields), len(specs)) + fields + specs
    return head + bytes(-len(head) % 8)


# --- the codec ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["i2", "i4", "i8", "u1", "u2", "f4", "f8"])
def test_rows_round_trip_through_a_frame(dtype: str) -> None:
    rng = random.Random(dtype)
    make_value = (lambda: rng.random() * 100 - 50) if dtype.startswith("f") else (lambda: rng.randrange(200))
    rows = [[make_value() for _ in range(n)] for n in (3, 0, 7, 1)]
    spec, data = encode_rows("x", rows, dtype)
    assert spec.lengths == (3, 0, 7, 1)
    other = encode_rows("y", [[1, 2]], "u1")
    frame = unpack(pack(b'{"a":1}', [(spec, data), other]))
    assert json.loads(frame.fields) == {"a": 1}
    got = decode_rows(*frame.arrays["x"])
    want = [[float(np.float32(v)) for v in row] for row in rows] if dtype == "f4" else rows
    assert got == want
    assert decode_rows(*frame.arrays["y"]) == [[1, 2]]


def test_arrays_start_on_8_byte_boundaries_and_nothing_follows() -> None:
    spec, data = encode_rows("x", [[1, 2, 3]], "u1")
    raw = pack(b"{}", [(spec, data), encode_rows("y", [[1.5]], "f8")])
    assert len(raw) % 8 == 0
    frame = unpack(raw)
    view = frame.arrays["y"][1]
    assert (raw.index(struct.pack("<d", 1.5))) % 8 == 0
    assert bytes(view) == struct.pack("<d", 1.5)


@pytest.mark.parametrize(
    ("raw", "message", "field"),
    [
        (b"LPDA", "16-byte header", None),
        (frame_header(b"{}", b"[]", magic=b"JSON"), "starts with", None),
        (frame_header(b"{}", b"[]", version=2), "version 2", None),
        (struct.pack("<4sB3xII", b"LPDA", 1, 1000, 0), "shorter", None),
        (frame_header(b"{}", b"{"), "not valid JSON", None),
        (frame_header(b"{}", b"{}"), "JSON list", None),
        (frame_header(b"{}", b'[{"name":"x","dtype":"i3","lengths":[1]}]'), "dtype 'i3'", "x"),
        (frame_header(b"{}", b'[{"name":"x","dtype":"i4","lengths":[-1]}]'), "non-negative", "x"),
        (frame_header(b"{}", b'[{"name":"x","dtype":"i4","lengths":[true]}]'), "non-negative", "x"),
        (frame_header(b"{}", b'[{"name":"x","dtype":"i4"}]'), "exactly name", None),
        (frame_header(b"{}", b'[{"name":"x","dtype":"i4","lengths":[2]}]') + bytes(4), "4 bytes short", "x"),
        (frame_header(b"{}", b"[]") + bytes(8), "8 bytes after", None),
        (
            frame_header(
                b"{}", b'[{"name":"x","dtype":"u1","lengths":[]},{"name":"x","dtype":"u1","lengths":[]}]'
            ),
            "repeats",
            None,
        ),
    ],
)
def test_a_malformed_frame_says_what_is_wrong(raw: bytes, message: str, field: str | None) -> None:
    with pytest.raises(FrameError, match=message) as caught:
        unpack(raw)
    assert caught.value.field == field


def test_pack_refuses_bytes_that_do_not_match_the_spec() -> None:
    with pytest.raises(ValueError, match="3 bytes for 1 values"):
        pack(b"{}", [(ArraySpec("x", "i4", (1,)), b"abc")])


def test_the_client_frames_what_fits_and_falls_back_to_json_otherwise() -> None:
    body = {"input_ids": [[1, 2**40]], "attention_mask": [[1, 1]], "response_length": 1}
    frame = unpack(to_frame(body) or b"")
    assert frame.arrays["input_ids"][0].dtype == "i8"  # 2**40 does not fit i4
    assert frame.arrays["attention_mask"][0].dtype == "u1"
    assert json.loads(frame.fields) == {"response_length": 1}
    assert to_frame({"input_ids": [[1, 2**70]], "num_actions": 1}) is None  # no dtype takes it: JSON
    assert to_frame({"input_ids": [[1, "a"]], "num_actions": 1}) is None


# --- the API --------------------------------------------------------------------------------------


def framed_answer(server: TestClient, body: dict[str, Any]) -> dict[str, Any]:
    framed = to_frame(body)
    assert framed is not None
    r = server.post("/logprobs", content=framed, headers=FRAMED)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == MEDIA_TYPE
    return from_frame(r.content)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_framed_request_gets_the_json_answer_exactly(server: TestClient, layout: str) -> None:
    rng = random.Random(layout)
    for _ in range(3):
        body = make(layout, rng, vocab=96)
        body["return_ref_logprobs"] = True
        body["kl_estimator"] = rng.choice(["k1", "k2", "k3"])
        want = server.post("/logprobs", json=body).json()
        got = framed_answer(server, body)
        assert set(got) == set(want)
        for name in ROW_FIELDS:
            if want[name] is None:
                assert got[name] is None
                continue
            assert len(got[name]) == len(want[name])
            for g, w in zip(got[name], want[name], strict=True):
                # JSON writes each float32 in its shortest form: back in float32 it is the same value
                np.testing.assert_array_equal(np.float32(g), np.float32(w))
        assert {k: v for k, v in got.items() if k not in ROW_FIELDS} == {
            k: v for k, v in want.items() if k not in ROW_FIELDS
        }


@pytest.mark.parametrize("layout", GROUPED_LAYOUTS)
def test_a_grouped_request_reads_the_same_from_a_frame(layout: str) -> None:
    """prompt_ids travel as an array, prompt_index in the JSON part; the jobs are JSON's."""
    rng = random.Random(f"frame-{layout}")
    limits = ModelLimits(vocab_size=96, max_sequence_tokens=64)
    for _ in range(5):
        body, _ = make_grouped(layout, rng, vocab=96)
        framed = to_frame(body)
        assert framed is not None
        frame = unpack(framed)
        assert "prompt_ids" in frame.arrays
        assert json.loads(frame.fields)["prompt_index"] == body["prompt_index"]
        got, want = normalise(parse_frame(framed), limits), normalise(LogprobsRequest(**body), limits)
        for g, w, gw, ww in zip(got.jobs, want.jobs, got.windows, want.windows, strict=True):
            assert (g.tokens.tolist(), g.actions.tolist()) == (w.tokens.tolist(), w.actions.tolist())
            assert (gw.width, gw.slots.tolist()) == (ww.width, ww.slots.tolist())


def test_rollout_logprobs_travel_as_an_array(server: TestClient) -> None:
    body = {"input_ids": [[3, 4, 5, 6], [7, 8, 9]], "num_actions": [2, 1]}
    scored = server.post("/logprobs", json=body).json()["logprobs"]
    body["rollout_logprobs"] = [[v + 0.1 for v in row] for row in scored]
    want = server.post("/logprobs", json=body).json()["rollout"]
    got = framed_answer(server, body)["rollout"]
    assert got["tokens"] == want["tokens"] == 3
    for key in ("mean_abs_diff", "max_abs_diff", "mean_kl_k3", "ratio_outside_fraction"):
        assert got[key] == pytest.approx(want[key], abs=1e-6)
    assert got["mean_abs_diff"] == pytest.approx(0.1, abs=1e-5)


def test_either_side_may_be_json(server: TestClient) -> None:
    body = {"input_ids": [[1, 2, 3, 4]], "num_actions": 2}
    framed = to_frame(body)
    assert framed is not None
    json_answer = server.post("/logprobs", content=framed, headers={"content-type": MEDIA_TYPE})
    assert json_answer.headers["content-type"] == "application/json"
    frame_answer = server.post("/logprobs", json=body, headers={"accept": MEDIA_TYPE})
    assert frame_answer.headers["content-type"] == MEDIA_TYPE
    assert from_frame(frame_answer.content)["logprobs"][0] == pytest.approx(json_answer.json()["logprobs"][0])


def raw_frame(fields: dict[str, Any], arrays: dict[str, tuple[str, list[list[Any]]]]) -> bytes:
    return pack(
        json.dumps(fields).encode(), [encode_rows(n, rows, dtype) for n, (dtype, rows) in arrays.items()]
    )


@pytest.mark.parametrize(
    ("fields", "arrays", "expected"),
    [
        ({"num_actions": 1}, {"input_ids": ("i4", [[1, 2], [3, -4]])}, ("input_ids", 1, "is -4")),
        (
            {"num_actions": 1},
            {"input_ids": ("i4", [[1, 2], [3, 400]])},
            ("input_ids", 1, "outside the vocabulary"),
        ),
        ({"num_actions": 1}, {"input_ids": ("f4", [[1, 2]])}, ("input_ids", None, "dtype f4")),
        ({"num_actions": 1}, {}, ("input_ids", None, "at least one row")),
        ({"num_actions": 1}, {"input_ids": ("i4", [])}, ("input_ids", None, "at least one row")),
        (
            {"num_actions": 1},
            {"input_ids": ("i4", [[1, 2]]), "tokens": ("i4", [[1]])},
            ("tokens", None, "not a field"),
        ),
        (
            {"num_actions": 1, "temperature": -1.0},
            {"input_ids": ("i4", [[1, 2]])},
            ("temperature", None, "greater than 0"),
        ),
        ({"num_actions": 1, "input_ids": [[1, 2]]}, {}, ("input_ids", None, "Extra inputs")),
        (
            {"num_actions": 1},
            {"input_ids": ("i4", [[1, 2], [3, 4]]), "rollout_logprobs": ("f4", [[0.0], [float("nan")]])},
            ("rollout_logprobs", 1, "finite"),
        ),
        (
            {"response_length": 1},
            {"input_ids": ("i4", [[1, 2]]), "attention_mask": ("u1", [[1, 2]])},
            ("attention_mask", 0, "only 0 and 1"),
        ),
        (
            {"prompt_index": [0, 0]},
            {"input_ids": ("i4", [[1], [2]]), "prompt_ids": ("i4", [[3, -4]])},
            ("prompt_ids", None, "is -4"),
        ),
        (
            {"prompt_index": [0, 0]},
            {"input_ids": ("i4", [[1], [2]]), "prompt_ids": ("f8", [[3.0]])},
            ("prompt_ids", None, "dtype f8"),
        ),
        (
            {"prompt_index": [0, 1]},
            {"input_ids": ("i4", [[1], [2]]), "prompt_ids": ("i4", [[3], []])},
            ("prompt_ids", 1, "is empty"),
        ),
    ],
)
def test_a_bad_framed_request_gets_the_422_naming_field_and_row(
    server: TestClient,
    fields: dict[str, Any],
    arrays: dict[str, tuple[str, list[list[Any]]]],
    expected: tuple[str, int | None, str],
) -> None:
    field, row, message = expected
    r = server.post("/logprobs", content=raw_frame(fields, arrays), headers=FRAMED)
    assert r.status_code == 422, r.text
    assert r.headers["content-type"] == "application/json"  # errors are always JSON
    error = r.json()["error"]
    assert (error["field"], error.get("row")) == (field, row)
    assert message in error["message"]


def test_a_broken_frame_is_a_422_on_the_body(server: TestClient) -> None:
    r = server.post("/logprobs", content=b"LPDA\x01\x00\x00\x00" + b"\xff" * 8, headers=FRAMED)
    assert r.status_code == 422
    assert r.json()["error"]["field"] == "body"
    assert server.post("/logprobs", json={"input_ids": [[1, 2]], "num_actions": 1}).status_code == 200


def test_the_client_sends_frames_by_default_and_scores_the_same_as_json(model_dirs: dict[str, Path]) -> None:
    rng = random.Random(7)
    # each body scored twice, compared bitwise: no prefix cache (a hit reads keys the first computed in
    # another micro-batch, equal within float tolerance, not bitwise outside batch-invariant mode)
    with loopback_server(model_dirs["qwen2"], prefix_cache=False) as url:
        for layout in LAYOUTS:
            body = make(layout, rng, vocab=96, rows=6)
            sent = Flaky([])
            with Client(url, transport=sent) as framed, Client(url, frames=False) as plain:
                a, b = framed.score_request(body), plain.score_request(body)
            assert [raw[:4] for raw in sent.script.bodies] == [b"LPDA"]
            assert a.action_mask == b.action_mask
            assert (a.usage.input_tokens, a.usage.scored_tokens) == (
                b.usage.input_tokens,
                b.usage.scored_tokens,
            )
            for x, y in zip(a.logprobs, b.logprobs, strict=True):
                np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
            if b.entropy is not None:
                assert a.entropy is not None
                for x, y in zip(a.entropy, b.entropy, strict=True):
                    np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


def loopback_server(path: Path, **settings: Any) -> Any:
    from service.http.app import create_app

    return loopback(create_app(settings_for(path, **settings)))


# --- top-K, candidates and processed log-probs ---------------------------------------------------

WIDE = {"top_ids": np.int64, "top_logprobs": np.float32, "candidate_logprobs": np.float32}


def _same_wide(got: dict[str, Any], want: dict[str, Any], name: str, width: int) -> None:
    """A frame's [window, K] blocks equal the JSON answer's lists: ids exactly, log-probs as float32."""
    assert len(got[name]) == len(want[name])
    for g, w, mask in zip(got[name], want[name], want["action_mask"], strict=True):
        assert isinstance(g, np.ndarray)
        assert g.dtype == WIDE[name]
        assert g.shape == (len(mask), width)
        np.testing.assert_array_equal(g, np.asarray(w, dtype=WIDE[name]).reshape(len(mask), width))


@pytest.mark.parametrize("top", [1, 5, 96])
@pytest.mark.parametrize("candidates", ["shared", "per_position"])
def test_top_k_and_candidates_travel_as_arrays_with_the_json_values(
    server: TestClient, top: int, candidates: str
) -> None:
    rng = random.Random(f"{top}-{candidates}")
    lengths, actions = (6, 11, 9), (1, 7, 4)  # rows of different windows
    body: dict[str, Any] = {
        "input_ids": [[rng.randrange(3, 96) for _ in range(n)] for n in lengths],
        "num_actions": list(actions),
        "temperature": 0.9,
        "top_logprobs": top,
        "sampling": {"top_k": 2},  # most actions fall outside: -inf
    }
    if candidates == "shared":
        body["candidate_ids"] = [4, 0, 95]
    else:
        body["candidate_ids"] = [[[rng.randrange(96) for _ in range(2)] for _ in range(a)] for a in actions]
    width = 3 if candidates == "shared" else 2
    want = server.post("/logprobs", json=body).json()
    framed = to_frame(body)
    assert framed is not None
    r = server.post("/logprobs", content=framed, headers=FRAMED)
    assert r.status_code == 200, r.text
    frame = unpack(r.content)
    assert json.loads(frame.fields)["columns"] == {
        "top_ids": top,
        "top_logprobs": top,
        "candidate_logprobs": width,
    }
    assert {n: frame.arrays[n][0].dtype for n in WIDE} == {
        "top_ids": "u2",  # ids below 65536
        "top_logprobs": "f4",
        "candidate_logprobs": "f4",
    }
    assert frame.arrays["top_ids"][0].lengths == tuple(a * top for a in actions)
    got = from_frame(r.content)
    assert "columns" not in got
    assert set(got) == set(want)
    _same_wide(got, want, "top_ids", top)
    _same_wide(got, want, "top_logprobs", top)
    _same_wide(got, want, "candidate_logprobs", width)
    assert got["ranks"] == want["ranks"]
    # -inf outside the sampler's kept set: -inf in the frame, null in JSON, -inf in the client's Scores
    outside = [[v is None for v in row] for row in want["processed_logprobs"]]
    assert any(any(row) for row in outside)
    assert [[v == -math.inf for v in row] for row in got["processed_logprobs"]] == outside
    a, b = Scores.from_body(got), Scores.from_body(want)
    assert a.processed_logprobs is not None
    assert b.processed_logprobs is not None
    for x, y in zip(a.processed_logprobs, b.processed_logprobs, strict=True):
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))  # shortest form
    for name in WIDE:
        for x, y in zip(getattr(a, name), getattr(b, name), strict=True):
            assert (x.dtype, x.shape) == (y.dtype, y.shape)
            np.testing.assert_array_equal(x, y)


def test_wide_rows_go_in_the_narrowest_id_dtype_and_read_back() -> None:
    """Ids past 65536 travel as i4; a row without actions is [0, K]; log-probs keep -inf."""
    ids = [np.array([[70000, 3], [5, 151935]]), np.zeros((0, 2), np.int64), np.array([[1, 2]])]
    lps: list[np.ndarray] = [
        np.array([[-0.5, -np.inf], [-1.25, -2.0]], np.float32),
        np.zeros((0, 2), np.float32),
        np.zeros((1, 2)),
    ]
    body = {
        "model": "m",
        "logprobs": [np.zeros(2, np.float32), np.zeros(0, np.float32), np.zeros(1, np.float32)],
    }
    raw = server_frame(body | {"top_ids": ids, "top_logprobs": lps})
    frame = unpack(raw)
    assert frame.arrays["top_ids"][0].dtype == "i4"
    assert frame.arrays["top_ids"][0].lengths == (4, 0, 2)
    got = from_frame(raw)
    for g, w in zip(got["top_ids"], ids, strict=True):
        assert g.dtype == np.int64
        np.testing.assert_array_equal(g, w)
    for g, lp in zip(got["top_logprobs"], lps, strict=True):
        assert (g.dtype, g.shape) == (np.float32, lp.shape)
        np.testing.assert_array_equal(g, lp.astype(np.float32))
    got["top_ids"][0][0, 0] = 1  # writable: a copy, not a view of the response's bytes


def test_blocks_that_do_not_fit_their_k_are_refused() -> None:
    spec, data = encode_rows("top_ids", [[1, 2, 3]], "i4")
    raw = pack(json.dumps({"columns": {"top_ids": 2}}).encode(), [(spec, data)])
    with pytest.raises(FrameError, match="do not hold 2 columns") as caught:
        from_frame(raw)
    assert caught.value.field == "top_ids"
    with pytest.raises(ValueError, match="one K per field"):
        server_frame({"top_ids": [np.zeros((1, 2), np.int64), np.zeros((1, 3), np.int64)]})
