"""jsonrows.parse_json: the same request as schemas.parse_request, its rows of integers as int64 arrays
read without pydantic, and every refusal parse_request's own (the fast path only accepts; anything it
does not read goes to parse_request). Every test runs with each row reader: the native one
(service/wire/_jsonrows.c; its absence skips, or fails with LOGPROBD_REQUIRE_NATIVE=1 as in CI) and orjson's
(test_jsonrows_native.py compares the two on perturbed texts)."""

from __future__ import annotations

import base64
import functools
import json
from typing import Any

import numpy as np
import pytest

from service.core.errors import ServiceError
from service.engine.contract import MoeShape
from service.normalise import ModelLimits, normalise
from service.wire import jsonrows
from service.wire.jsonrows import _fast, parse_json
from service.wire.schemas import MATRIX_FIELDS, Base64Ids, LogprobsRequest, parse_request
from tests.support.needs import native_or_skip

RAGGED = {"input_ids": [[5, 17, 0, 151935], [3, 4, 5]], "num_actions": [2, 1]}
PADDED = {
    "input_ids": [[0, 0, 7, 8, 9], [1, 2, 3, 4, 5]],
    "attention_mask": [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]],
    "action_mask": [[0, 0, 0, 1], [0, 1, 1, 1]],
}
GROUPED = {"prompt_ids": [[7, 8, 9], [10, 11]], "prompt_index": [0, 1, 0], "input_ids": [[1], [2, 3], [4]]}
OPTIONS = {
    "temperature": 0.7,
    "eos_token_id": [2, 3],
    "return_entropy": True,
    "sampling": {"top_k": 5, "top_p": 0.9},
    "rollout_logprobs": [[-0.5, -1.25], [-2.0]],
    "weights_version": "step-12",
    "top_logprobs": 3,
}


@pytest.fixture(autouse=True, params=["native", "orjson"])
def reader(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test once with the native row reader and once with orjson's."""
    if request.param == "native":
        native_or_skip()
    else:
        monkeypatch.setattr(jsonrows, "native", lambda: None)
    return str(request.param)


def _same(got: LogprobsRequest, want: LogprobsRequest) -> None:
    assert got.model_fields_set == want.model_fields_set
    for name in LogprobsRequest.model_fields:
        a, b = getattr(got, name), getattr(want, name)
        if name in MATRIX_FIELDS and b is not None:
            assert all(isinstance(row, np.ndarray) and row.dtype == np.int64 for row in a)
            assert [row.tolist() for row in a] == b
        else:
            assert a == b, name


@pytest.mark.parametrize(
    "body",
    [RAGGED, PADDED, GROUPED, {**RAGGED, **OPTIONS}, {**GROUPED, "temperature": 2.0}],
    ids=["ragged", "padded", "grouped", "options", "grouped-options"],
)
@pytest.mark.parametrize("separators", [(",", ":"), (", ", ": ")], ids=["compact", "spaced"])
def test_reads_the_rows_into_int64_arrays_and_the_rest_as_pydantic_does(
    body: dict[str, Any], separators: tuple[str, str]
) -> None:
    raw = json.dumps(body, separators=separators).encode()
    fast = _fast(raw)
    assert fast is not None  # the plain form takes the fast path
    _same(fast, parse_request(raw))
    _same(parse_json(raw, min_bytes=0), parse_request(raw))


def test_strings_holding_brackets_commas_and_escaped_quotes_do_not_confuse_the_members() -> None:
    raw = b'\n {"model_hint_is_not_a_field": 1, "input_ids" :\t[ [1 , 2] ,\r\n[3,4]], "num_actions": 1}'
    with pytest.raises(ServiceError) as want:
        parse_request(raw)
    with pytest.raises(ServiceError) as got:
        parse_json(raw, min_bytes=0)
    assert (got.value.message, got.value.field) == (want.value.message, want.value.field)
    valid = b'{"weights_version": "a", "input_ids": [[1,2],[3,4]], "num_actions": 1, "kl_estimator": "k3"}'
    _same(parse_json(valid, min_bytes=0), parse_request(valid))
    tricky = b'{"input_ids": [[1,2]], "num_actions": 1, "weights_version": "x\\"],[9]\\\\"}'
    with pytest.raises(ServiceError) as want:
        parse_request(tricky)  # the pattern refuses it; what matters is that both say the same
    with pytest.raises(ServiceError) as got:
        parse_json(tricky, min_bytes=0)
    assert (got.value.message, got.value.field) == (want.value.message, want.value.field)


REFUSED_OR_UNUSUAL = [
    b'{"input_ids": [[1, -2]], "num_actions": 1}',  # a negative id
    b'{"input_ids": [[1, 2.0]], "num_actions": 1}',  # a float
    b'{"input_ids": [[1, 2e3]], "num_actions": 1}',
    b'{"input_ids": [[1, true]], "num_actions": 1}',  # a bool
    b'{"input_ids": [[1, 02]], "num_actions": 1}',  # a leading zero: not JSON
    b'{"input_ids": [[1, 0]], "num_actions": 1}',  # 0 is fine
    b'{"input_ids": [[1, 99999999999999999999]], "num_actions": 1}',  # past int64: normalise's 422
    b'{"input_ids": [[1, 999999999999999999]], "num_actions": 1}',  # 10^18 - 1: parse_request's
    b'{"input_ids": [[1, 2,]], "num_actions": 1}',  # trailing comma
    b'{"input_ids": [[1,, 2]], "num_actions": 1}',
    b'{"input_ids": [[1 2]], "num_actions": 1}',  # whitespace inside what would be one number
    b'{"input_ids": [[1, 2], []], "num_actions": 1}',  # an empty row
    b'{"input_ids": [], "num_actions": 1}',
    b'{"input_ids": [[1, 2]]], "num_actions": 1}',
    b'{"input_ids": [[1, [2]]], "num_actions": 1}',
    b'{"input_ids": [1, 2], "num_actions": 1}',
    b'{"input_ids": null, "num_actions": 1}',
    b'{"input_ids": [[1, 2]], "input_ids": [[3, 4]], "num_actions": 1}',  # a duplicate key
    b'{"input\\u005fids": [[1, 2]], "num_actions": 1}',  # an escaped key
    b'{"input_ids": [[1, 2]], "num_actions": 1, "temperature": "hot"}',  # the rest refused
    b'{"input_ids": [[1, 2]], "num_actions": 1, "colour": 1}',  # an unknown field
    b'{"input_ids": [[1, 2]], "num_actions": 1',  # truncated
    b'{"input_ids": [[1, 2]], "num_actions": 1}}',
    b'[{"input_ids": [[1, 2]]}]',
    b'{"num_actions": 1}',
    b"{}",
    b"",
    b'{"input_ids": [[1, 2]], "attention_mask": [[1, 2]], "response_length": 1}',
    b'{"input_ids": [[1, 2]], "attention_mask": [[1, -1]], "response_length": 1}',
    b'{"input_ids": [[1, 2]],, "num_actions": 1}',
    b'{"input_ids": [[1, 2]] "num_actions": 1}',
    b'{"input_ids" [[1, 2]], "num_actions": 1}',
    b'{"input_ids": [[1, 2]], "num_actions": 1, "weights_version": "a,\\"b"}',
]


@pytest.mark.parametrize("raw", REFUSED_OR_UNUSUAL)
def test_whatever_parse_request_refuses_is_refused_alike(raw: bytes) -> None:
    refused: ServiceError | None = None
    try:
        want = parse_request(raw)
    except ServiceError as exc:
        refused = exc
    if refused is None:
        _same_or_lists(parse_json(raw, min_bytes=0), want)
        return
    with pytest.raises(type(refused)) as got:
        parse_json(raw, min_bytes=0)
    assert (got.value.message, got.value.field, got.value.row) == (
        refused.message,
        refused.field,
        refused.row,
    )
    assert _fast(raw) is None


def _same_or_lists(got: LogprobsRequest, want: LogprobsRequest) -> None:
    for name in LogprobsRequest.model_fields:
        a, b = getattr(got, name), getattr(want, name)
        if name in MATRIX_FIELDS and b is not None:
            assert [list(map(int, row)) for row in a] == b
        else:
            assert a == b


def test_small_bodies_go_to_parse_request() -> None:
    raw = json.dumps(RAGGED).encode()
    assert isinstance(parse_json(raw).input_ids[0], list)
    assert isinstance(parse_json(raw, min_bytes=0).input_ids[0], np.ndarray)


def test_a_large_body_takes_the_fast_path_and_normalises_alike() -> None:
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, 151936, size=int(n)).tolist() for n in rng.integers(300, 900, size=8)]
    raw = json.dumps({"input_ids": rows, "num_actions": [100] * 8}).encode()
    limits = ModelLimits(vocab_size=151936, max_sequence_tokens=4096)
    fast, slow = normalise(parse_json(raw), limits), normalise(parse_request(raw), limits)
    assert isinstance(parse_json(raw).input_ids[0], np.ndarray)
    for a, b in zip(fast.jobs, slow.jobs, strict=True):
        assert np.array_equal(a.tokens, b.tokens)
        assert np.array_equal(a.actions, b.actions)


# routes: 3 sparse layers, top-2; ids past 255 with 300 experts (the field then reads as int32)
def _routes(rng: np.random.Generator, positions: int, experts: int) -> np.ndarray:
    keys = rng.random((positions, 3, experts))
    return np.argpartition(keys, 2, axis=-1)[..., :2]


def _b64(routes: np.ndarray) -> str:
    return base64.b64encode(routes.astype("<i4").tobytes()).decode()


def _routed_body(experts: int) -> dict[str, Any]:
    rng = np.random.default_rng(experts)
    rows = [rng.integers(3, 500, size=n).tolist() for n in (9, 6, 12)]
    given = [_routes(rng, n, experts) for n in (9, 5, 12)]
    return {
        "input_ids": rows,
        "num_actions": [3, 2, 4],
        "routed_experts": [_b64(given[0]), given[1].tolist(), None],
        "routed_experts_start": [0, 1, 0],
        "return_routed_experts": True,
    }


def _grouped_routed_body() -> dict[str, Any]:
    rng = np.random.default_rng(5)
    return {
        "prompt_ids": [[7, 8, 9, 10], [11, 12]],
        "prompt_index": [0, 1, 0],
        "input_ids": [[1, 2], [3], [4, 5, 6]],
        "prompt_routed_experts": [_b64(_routes(rng, 4, 8)), _routes(rng, 2, 8).tolist()],
        "routed_experts": [_routes(rng, 2, 8).tolist(), _b64(_routes(rng, 1, 8)), None],
    }


def _limits(experts: int) -> ModelLimits:
    return ModelLimits(vocab_size=600, max_sequence_tokens=64, moe=MoeShape(3, experts, 2))


@pytest.mark.parametrize(
    ("body", "experts"),
    [(_routed_body(8), 8), (_routed_body(300), 300), (_grouped_routed_body(), 8)],
    ids=["u1", "int32", "grouped"],
)
@pytest.mark.parametrize("separators", [(",", ":"), (", ", ": ")], ids=["compact", "spaced"])
def test_routes_in_base64_and_lists_normalise_as_parse_request_reads_them(
    reader: str, body: dict[str, Any], experts: int, separators: tuple[str, str]
) -> None:
    """Each row's GivenRoutes (start, ids, narrow dtype) and the answer's route format are those of
    the pydantic path, whether the native reader decoded the routes or pydantic read them."""
    raw = json.dumps(body, separators=separators).encode()
    request = parse_json(raw, min_bytes=0)
    fast, slow = normalise(request, _limits(experts)), normalise(parse_request(raw), _limits(experts))
    assert fast.route_format == slow.route_format == "base64"
    for a, b in zip(fast.jobs, slow.jobs, strict=True):
        assert (a.routes is None) == (b.routes is None)
        if a.routes is not None and b.routes is not None:
            assert a.routes.start == b.routes.start
            assert a.routes.experts.dtype == b.routes.experts.dtype
            np.testing.assert_array_equal(a.routes.experts, b.routes.experts)
    if reader == "native":  # decoded straight from the body into one array of the field's ids
        rows = request.prompt_routed_experts if "prompt_ids" in body else request.routed_experts
        assert rows is not None
        assert isinstance(rows[0], Base64Ids)
        assert isinstance(rows[1], np.ndarray)
        assert rows[0].ids.dtype == (np.uint8 if experts <= 256 else np.dtype("<i4"))
        assert rows[0].ids.base is rows[1].base  # views of the field's one array
        if "prompt_ids" not in body and experts <= 256:  # ragged u1 rows: the routes are those views
            assert np.shares_memory(fast.jobs[0].routes.experts, rows[0].ids)
            assert np.shares_memory(fast.jobs[1].routes.experts, rows[1])


@pytest.mark.parametrize(
    ("routes", "row"),
    [
        (["@@@=", None], 0),  # not base64
        ([None, "QUJD"], 1),  # 3 bytes: not whole int32
        ([None, base64.b64encode(b"\0" * 20).decode()], 1),  # 5 ids: not whole [layers, top_k]
        ([None, [[[1, 2], [3, 9], [4, 5]]]], 1),  # an id past the experts
        ([[[[1, 2], [3, -1], [4, 5]]], None], 0),  # a negative id
        ([None, [[[1, 1], [3, 2], [4, 5]]]], 1),  # an expert twice
        ([None, [[[1, 2], [3, 4]]]], 1),  # 2 layers for 3
        ([None, [[[1, 2], [3, 4], [5, 6]], [[1, 2]]]], 1),  # ragged nesting
        ([None, [[[1, 2.0], [3, 4], [5, 6]]]], None),  # not an integer: pydantic's 422
    ],
)
def test_bad_routes_are_refused_with_parse_requests_error(
    reader: str, routes: list[Any], row: int | None
) -> None:
    """Malformed base64, a wrong length, an id out of range, a repeat, a wrong shape: the same 422,
    naming the field and the row, whichever reader read the body."""
    raw = json.dumps({"input_ids": [[3, 4, 5], [6, 7]], "num_actions": 1, "routed_experts": routes}).encode()
    errors = []
    for parse in (functools.partial(parse_json, min_bytes=0), parse_request):
        with pytest.raises(ServiceError) as caught:
            normalise(parse(raw), _limits(8))
        errors.append((caught.value.message, caught.value.field, caught.value.row))
    assert errors[0] == errors[1]
    assert errors[0][1:] == ("routed_experts", row)
