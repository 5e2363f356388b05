"""Routing replay's routes (expert_routes.py): every accepted form gives the same GivenRoutes, on the right
positions of every layout, and every bad input is a 422 naming the field and the row.

The reference is by hand: each test builds routes indexed by the token they belong to, and checks
that the job's routes at position t are those of token t of the sequence.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np
import pytest

from service.client.wire import to_frame
from service.core.errors import InvalidRequest
from service.core.jobs import GivenRoutes
from service.engine.contract import MoeShape
from service.normalise import ModelLimits, ScoringPlan, normalise
from service.wire.arrays import parse_frame
from service.wire.frame import encode_rows, pack
from service.wire.schemas import parse_request

MOE = MoeShape(layers=3, experts=8, top_k=2)
LIMITS = ModelLimits(vocab_size=100, max_sequence_tokens=512, moe=MOE)


def plan(limits: ModelLimits = LIMITS, **body: Any) -> ScoringPlan:
    return normalise(parse_request(json.dumps(body).encode()), limits)


def routes_of(n: int, seed: int) -> np.ndarray:
    """[n, layers, top_k] distinct ids per (position, layer)."""
    rng = np.random.default_rng(seed)
    return np.stack(
        [[rng.choice(MOE.experts, MOE.top_k, replace=False) for _ in range(MOE.layers)] for _ in range(n)]
    )


def b64(experts: np.ndarray) -> str:
    return base64.b64encode(experts.astype("<i4").tobytes()).decode()


def given(p: ScoringPlan) -> list[tuple[int, list[Any]] | None]:
    return [None if j.routes is None else (j.routes.start, j.routes.experts.tolist()) for j in p.jobs]


def test_lists_base64_and_frames_give_identical_jobs() -> None:
    ids = [[5, 6, 7, 8, 9], [1, 2, 3]]
    r0, r1 = routes_of(4, 0), routes_of(2, 1)
    base: dict[str, Any] = {"input_ids": ids, "num_actions": [2, 1], "routed_experts_start": [0, 1]}
    lists = plan(**base, routed_experts=[r0.tolist(), r1.tolist()])
    strings = plan(**base, routed_experts=[b64(r0), b64(r1)])
    framed = to_frame({**base, "routed_experts": [r0.tolist(), b64(r1)]})
    assert framed is not None
    frames = normalise(parse_frame(framed), LIMITS)
    want = [(0, r0.tolist()), (1, r1.tolist())]
    assert given(lists) == given(strings) == given(frames) == want
    for p in (lists, strings, frames):  # every form narrowed to one byte an id (8 experts)
        assert all(j.routes is not None and j.routes.experts.dtype == np.uint8 for j in p.jobs)
    assert (lists.route_format, strings.route_format, frames.route_format) == ("lists", "base64", "lists")


def test_frames_carry_routes_in_one_byte_each() -> None:
    r = routes_of(4, 2)
    framed = to_frame({"input_ids": [[1, 2, 3, 4, 5]], "num_actions": 1, "routed_experts": [r.tolist()]})
    assert framed is not None
    request = parse_frame(framed)
    (row,) = request.routed_experts or []
    assert isinstance(row, np.ndarray)
    assert row.dtype == np.uint8
    assert row.nbytes == 4 * MOE.layers * MOE.top_k


def test_padded_layouts_map_columns_to_positions_on_either_side() -> None:
    # row 0 left-padded (2 pad columns), row 1 right-padded, row 2 split (prompt left, response right)
    ids = [[0, 0, 11, 12, 13, 14], [21, 22, 23, 24, 0, 0], [0, 31, 32, 33, 0, 0]]
    mask = [[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 0, 0]]
    per_column = [routes_of(6, 10 + i) for i in range(3)]  # verl: one entry per column
    for i, m in enumerate(mask):  # padding columns hold zeros, as verl fills them
        per_column[i][np.asarray(m) == 0] = 0
    p = plan(
        input_ids=ids,
        attention_mask=mask,
        response_length=2,
        routed_experts=[r.tolist() for r in per_column],
    )
    for i, m in enumerate(mask):
        real = np.flatnonzero(m)
        assert given(p)[i] == (0, per_column[i][real].tolist())
    # a start past the left padding: columns 3.. of row 0 are positions 1..
    p = plan(
        input_ids=ids[:1],
        attention_mask=mask[:1],
        response_length=2,
        routed_experts=[per_column[0][3:5].tolist()],
        routed_experts_start=3,
    )
    assert given(p) == [(1, per_column[0][3:5].tolist())]
    # a range that holds only padding replays nothing
    p = plan(
        input_ids=ids[:1], attention_mask=mask[:1], response_length=2, routed_experts=[[[[0, 0]] * 3] * 2]
    )
    assert given(p) == [None]


def test_padded_routes_stay_views_where_the_real_columns_run_together() -> None:
    """A padded row's routes are its frame row's bytes themselves where its real columns are one run
    (padding on either side): no copy after the wire; a row with a hole is gathered, position by
    position as before."""
    ids = [[0, 0, 11, 12, 13, 14], [21, 0, 23, 24, 0, 0]]
    mask = [[0, 0, 1, 1, 1, 1], [1, 0, 1, 1, 0, 0]]
    per_column = [routes_of(6, 20 + i) for i in range(2)]
    body = {"input_ids": ids, "attention_mask": mask, "response_length": 2}
    framed = to_frame({**body, "routed_experts": [r.tolist() for r in per_column]})
    assert framed is not None
    request = parse_frame(framed)
    p = normalise(request, LIMITS)
    rows = request.routed_experts or []
    for i, m in enumerate(mask):
        assert given(p)[i] == (0, per_column[i][np.flatnonzero(m)].tolist())
    first, second = (j.routes for j in p.jobs)
    assert first is not None
    assert second is not None
    assert np.shares_memory(first.experts, rows[0])  # one run: a view
    assert not np.shares_memory(second.experts, rows[1])  # a hole: gathered


def test_grouped_equals_flat() -> None:
    prompt, responses = [4, 5, 6], [[7, 8], [9]]
    seqs = [prompt + r for r in responses]
    full = [routes_of(len(s) - 1, 20 + i) for i, s in enumerate(seqs)]  # SGLang: L-1 positions
    full[1][: len(prompt)] = full[0][: len(prompt)]  # the same prompt routes, as grouped sends once
    flat = plan(input_ids=seqs, num_actions=[2, 1], routed_experts=[f.tolist() for f in full])
    grouped_whole = plan(
        input_ids=responses,
        prompt_ids=[prompt],
        prompt_index=[0, 0],
        routed_experts=[f.tolist() for f in full],
    )
    grouped_once = plan(
        input_ids=responses,
        prompt_ids=[prompt],
        prompt_index=[0, 0],
        prompt_routed_experts=[b64(full[0][: len(prompt)])],
        routed_experts=[b64(f[len(prompt) :]) for f in full],
    )
    assert given(flat) == given(grouped_whole) == given(grouped_once)
    assert given(flat)[1] == (0, full[1].tolist())
    # a prompt's routes alone, and padded responses
    only_prompt = plan(
        input_ids=[[7, 8, 0], [9, 0, 0]],
        attention_mask=[[1, 1, 0], [1, 0, 0]],
        prompt_ids=[prompt],
        prompt_index=[0, 0],
        prompt_routed_experts=[full[0][:2].tolist()],
    )
    assert given(only_prompt) == [(0, full[0][:2].tolist())] * 2


def test_rows_without_routes_and_no_routes_at_all() -> None:
    r = routes_of(2, 3)
    p = plan(input_ids=[[1, 2, 3], [4, 5, 6]], num_actions=1, routed_experts=[None, r.tolist()])
    assert given(p) == [None, (0, r.tolist())]
    assert plan(input_ids=[[1, 2, 3]], num_actions=1).jobs[0].routes is None
    dense = ModelLimits(vocab_size=100, max_sequence_tokens=512)
    assert plan(dense, input_ids=[[1, 2, 3]], num_actions=1).jobs[0].routes is None


def test_return_routed_experts_reaches_the_job() -> None:
    p = plan(input_ids=[[1, 2, 3]], num_actions=1, return_routed_experts=True, routed_experts_format="base64")
    assert p.jobs[0].return_routes
    assert p.route_format == "base64"
    padded = plan(
        input_ids=[[0, 1, 2]], attention_mask=[[0, 1, 1]], response_length=1, return_routed_experts=True
    )
    assert padded.padded_width == 3
    assert padded.route_columns is not None
    assert [c.tolist() for c in padded.route_columns if c is not None] == [[1, 2]]


GOOD = routes_of(3, 4)


def bad(good: np.ndarray, p: int, layer: int, slot: int, value: int) -> list[Any]:
    out = good.copy()
    out[p, layer, slot] = value
    listed: list[Any] = out.tolist()
    return listed


@pytest.mark.parametrize(
    ("body", "limits", "field", "row", "words"),
    [
        ({"routed_experts": [None, GOOD.tolist()]}, ModelLimits(100, 512), "routed_experts", None, "dense"),
        ({"return_routed_experts": True}, ModelLimits(100, 512), "return_routed_experts", None, "dense"),
        ({"routed_experts": [None, GOOD[:, :2].tolist()]}, LIMITS, "routed_experts", 1, "[positions, 3, 2]"),
        ({"routed_experts": [None, GOOD[:, :, :1].tolist()]}, LIMITS, "routed_experts", 1, "top_k 2"),
        ({"routed_experts": [None, [[[1, 2]], [[3]]]]}, LIMITS, "routed_experts", 1, "ragged"),
        ({"routed_experts": [None, bad(GOOD, 2, 1, 0, 8)]}, LIMITS, "routed_experts", 1, "[2][1][0] is 8"),
        ({"routed_experts": [None, bad(GOOD, 0, 0, 1, -1)]}, LIMITS, "routed_experts", 1, "is -1"),
        (
            {"routed_experts": [None, GOOD.tolist()], "routed_experts_start": 2},
            LIMITS,
            "routed_experts",
            1,
            "3 tokens",
        ),
        ({"routed_experts": [None, "not*base64"]}, LIMITS, "routed_experts", 1, "not valid base64"),
        ({"routed_experts": [None, b64(GOOD)[:-4]]}, LIMITS, "routed_experts", 1, "multiple of 24"),
        ({"routed_experts": [GOOD.tolist()]}, LIMITS, "routed_experts", None, "1 rows, input_ids has 2"),
        (
            {"routed_experts": [None, None], "routed_experts_start": [0]},
            LIMITS,
            "routed_experts_start",
            None,
            "1 entries",
        ),
        (
            {"routed_experts": [None, "x"], "routed_experts_format": "csv"},
            LIMITS,
            "routed_experts_format",
            None,
            "",
        ),
    ],
)
def test_bad_routes_are_a_422_naming_field_and_row(
    body: dict[str, Any], limits: ModelLimits, field: str, row: int | None, words: str
) -> None:
    with pytest.raises(InvalidRequest) as caught:
        plan(limits, input_ids=[[1, 2, 3, 4], [5, 6, 7]], num_actions=1, **body)
    assert (caught.value.field, caught.value.row) == (field, row), caught.value.message
    assert words in caught.value.message


def test_a_duplicate_expert_is_named_with_its_position_and_layer() -> None:
    twice = GOOD.copy()
    twice[1, 2] = [5, 5]
    with pytest.raises(InvalidRequest) as caught:
        plan(input_ids=[[1, 2, 3, 4]], num_actions=1, routed_experts=[b64(twice)])
    assert (caught.value.field, caught.value.row) == ("routed_experts", 0)
    assert "routed_experts[0][1][2] names an expert twice ([5, 5])" in caught.value.message


def test_padding_entries_are_not_checked_but_real_ones_are() -> None:
    ids, mask = [[0, 0, 1, 2, 3]], [[0, 0, 1, 1, 1]]
    routes = np.zeros((5, 3, 2), dtype=np.int64)  # zeros at padding: duplicates, ignored
    routes[2:] = GOOD
    p = plan(input_ids=ids, attention_mask=mask, response_length=1, routed_experts=[routes.tolist()])
    assert given(p) == [(0, GOOD.tolist())]
    routes[3, 0] = [9, 1]
    with pytest.raises(InvalidRequest) as caught:
        plan(input_ids=ids, attention_mask=mask, response_length=1, routed_experts=[routes.tolist()])
    assert (caught.value.field, caught.value.row) == ("routed_experts", 0)
    assert "routed_experts[0][3][0][0] is 9" in caught.value.message
    with pytest.raises(InvalidRequest, match=r"covers columns 0 \.\. 5; the padded row has 5 columns"):
        plan(input_ids=ids, attention_mask=mask, response_length=1, routed_experts=[routes_of(6, 0).tolist()])


def test_grouped_faults() -> None:
    base: dict[str, Any] = {"input_ids": [[7, 8], [9]], "prompt_ids": [[4, 5, 6]], "prompt_index": [0, 0]}
    with pytest.raises(InvalidRequest) as caught:
        plan(**base, prompt_routed_experts=[routes_of(4, 0).tolist()])
    assert (caught.value.field, caught.value.row) == ("prompt_routed_experts", 0)
    assert "the prompt has 3 tokens" in caught.value.message
    with pytest.raises(InvalidRequest) as caught:  # a gap between the prompt's routes and the row's
        plan(
            **base,
            prompt_routed_experts=[GOOD.tolist()],
            routed_experts=[None, GOOD[:1].tolist()],
            routed_experts_start=[0, 2],
        )
    assert caught.value.field == "routed_experts_start"
    assert caught.value.row == 1
    with pytest.raises(InvalidRequest) as caught:
        plan(input_ids=[[1, 2]], num_actions=1, prompt_routed_experts=[GOOD.tolist()])
    assert caught.value.field == "prompt_routed_experts"
    with pytest.raises(InvalidRequest) as caught:
        plan(**base, prompt_routed_experts=[])
    assert caught.value.field == "prompt_routed_experts"


def test_frame_rows_not_a_multiple_of_layers_times_k() -> None:
    fields = json.dumps({"num_actions": 1}).encode()
    framed = pack(
        fields,
        [encode_rows("input_ids", [[1, 2, 3]], "i4"), encode_rows("routed_experts", [[1, 2, 3, 4, 5]], "u1")],
    )
    with pytest.raises(InvalidRequest) as caught:
        normalise(parse_frame(framed), LIMITS)
    assert (caught.value.field, caught.value.row) == ("routed_experts", 0)
    assert "5 ids, not a multiple of 6" in caught.value.message


def test_given_routes_type() -> None:
    p = plan(input_ids=[[1, 2, 3]], num_actions=1, routed_experts=[GOOD[:2].tolist()], routed_experts_start=1)
    routes = p.jobs[0].routes
    assert isinstance(routes, GivenRoutes)
    assert (routes.start, routes.end) == (1, 3)


def framed_routes(dtype: str, flat: list[int], limits: ModelLimits = LIMITS) -> ScoringPlan:
    """One row of 4 tokens whose routes travel in a frame of `dtype`."""
    fields = json.dumps({"num_actions": 1}).encode()
    framed = pack(
        fields,
        [encode_rows("input_ids", [[1, 2, 3, 4]], "i4"), encode_rows("routed_experts", [flat], dtype)],
    )
    return normalise(parse_frame(framed), limits)


@pytest.mark.parametrize("dtype", ["u1", "u2", "i2", "i4", "i8"])
def test_frame_rows_of_any_dtype_are_checked_and_narrowed(dtype: str) -> None:
    p = framed_routes(dtype, GOOD.ravel().tolist())
    routes = p.jobs[0].routes
    assert routes is not None
    assert routes.experts.dtype == np.uint8
    assert routes.experts.tolist() == GOOD.tolist()
    too_big = bad(GOOD, 2, 0, 1, 8)
    with pytest.raises(InvalidRequest) as caught:
        framed_routes(dtype, np.asarray(too_big).ravel().tolist())
    assert (caught.value.field, caught.value.row) == ("routed_experts", 0)
    assert "routed_experts[0][2][0][1] is 8; expert ids are 0 .. 7" in caught.value.message
    twice = GOOD.copy()
    twice[1, 1] = [3, 3]
    with pytest.raises(InvalidRequest) as caught:
        framed_routes(dtype, twice.ravel().tolist())
    assert (caught.value.field, caught.value.row) == ("routed_experts", 0)
    assert "routed_experts[0][1][1] names an expert twice ([3, 3])" in caught.value.message


def test_a_negative_id_in_a_signed_frame_is_named() -> None:
    with pytest.raises(InvalidRequest) as caught:
        framed_routes("i2", np.asarray(bad(GOOD, 1, 2, 0, -3)).ravel().tolist())
    assert (caught.value.field, caught.value.row) == ("routed_experts", 0)
    assert "routed_experts[0][1][2][0] is -3" in caught.value.message


def test_more_than_256_experts_travel_in_two_bytes() -> None:
    """300 experts: lists, base64 and a u2 frame give int16 ids (route_dtype), and ids past a byte
    are kept, checked and named."""
    moe = MoeShape(layers=2, experts=300, top_k=4)
    limits = ModelLimits(vocab_size=100, max_sequence_tokens=512, moe=moe)
    rng = np.random.default_rng(7)
    r = np.stack([[rng.choice(300, 4, replace=False) for _ in range(2)] for _ in range(3)])
    r[0, 0] = [299, 256, 0, 255]
    base: dict[str, Any] = {"input_ids": [[1, 2, 3]], "num_actions": 1}
    framed = to_frame({**base, "routed_experts": [r.tolist()]})
    assert framed is not None
    request = parse_frame(framed)
    (row,) = request.routed_experts or []
    assert isinstance(row, np.ndarray)
    assert row.dtype == np.uint16
    forms = [
        normalise(request, limits),
        plan(limits, **base, routed_experts=[r.tolist()]),
        plan(limits, **base, routed_experts=[b64(r)]),
    ]
    for p in forms:
        routes = p.jobs[0].routes
        assert routes is not None
        assert routes.experts.dtype == np.int16
        assert routes.experts.tolist() == r.tolist()
    r[2, 1, 3] = 300
    with pytest.raises(InvalidRequest) as caught:
        plan(limits, **base, routed_experts=[b64(r)])
    assert (caught.value.field, caught.value.row) == ("routed_experts", 0)
    assert "routed_experts[0][2][1][3] is 300; expert ids are 0 .. 299" in caught.value.message
    r[2, 1, 3] = 0
    r[1, 0, 1:3] = 298
    with pytest.raises(InvalidRequest) as caught:
        plan(limits, **base, routed_experts=[r.tolist()])
    assert "routed_experts[0][1][0] names an expert twice" in caught.value.message


@pytest.mark.parametrize("seed", range(4))
def test_the_first_repeat_is_found_as_a_sort_finds_it(seed: int) -> None:
    """top_k 8 of 128 experts, uint8: repeats planted at random (position, layer, slot pairs); the
    one named is the first, in row-major order, that a sort along k finds."""
    moe = MoeShape(layers=5, experts=128, top_k=8)
    limits = ModelLimits(vocab_size=100, max_sequence_tokens=512, moe=moe)
    rng = np.random.default_rng(seed)
    keys = rng.random((40, 5, 128))
    r = np.argpartition(keys, 8, axis=-1)[..., :8]
    for _ in range(3):
        p, layer = int(rng.integers(10, 40)), int(rng.integers(5))
        a, b = rng.choice(8, 2, replace=False)
        r[p, layer, b] = r[p, layer, a]
    ordered = np.sort(r, axis=-1)
    p, layer = np.argwhere((ordered[..., 1:] == ordered[..., :-1]).any(axis=-1))[0]
    body: dict[str, Any] = {"input_ids": [list(range(40))], "num_actions": 1}
    framed = to_frame({**body, "routed_experts": [b64(r)]})
    assert framed is not None
    for request in (
        parse_frame(framed),
        parse_request(json.dumps({**body, "routed_experts": [b64(r)]}).encode()),
    ):
        with pytest.raises(InvalidRequest) as caught:
            normalise(request, limits)
        assert f"routed_experts[0][{p}][{layer}] names an expert twice" in caught.value.message
    assert normalise(
        parse_request(json.dumps({**body, "routed_experts": [b64(ordered[:10])]}).encode()), limits
    )


def _planted(rng: np.random.Generator, moe: MoeShape, positions: int, dtype: str) -> np.ndarray:
    """[positions, layers, k] distinct ids of `dtype`, with a few out-of-range ids and repeats planted."""
    keys = rng.random((positions, moe.layers, moe.experts))
    r = np.argsort(keys, axis=-1)[..., : moe.top_k].astype(np.int64)
    for _ in range(int(rng.integers(0, 3))):
        p, layer = int(rng.integers(positions)), int(rng.integers(moe.layers))
        a, b = rng.choice(moe.top_k, 2, replace=False)
        r[p, layer, b] = r[p, layer, a]
    if rng.random() < 0.5:
        wrong = moe.experts + int(rng.integers(0, 3)) if dtype[0] == "u" or rng.random() < 0.5 else -1
        r[int(rng.integers(positions)), int(rng.integers(moe.layers)), int(rng.integers(moe.top_k))] = wrong
    return r.astype(dtype)


@pytest.mark.parametrize("top_k", [2, 8])
@pytest.mark.parametrize("experts", [8, 60, 128, 200, 256, 300])
@pytest.mark.parametrize("dtype", ["u1", "<u2", "<i4", "<i8"])
def test_the_native_checks_find_the_first_fault_numpy_finds(dtype: str, experts: int, top_k: int) -> None:
    """route_faults (the native reader's one pass; u1 with top_k 8 its word-wide path) against the
    numpy checks: the same first fault, or none, on routes with out-of-range ids and repeats planted,
    every position judged or some."""
    from service.normalise import expert_routes
    from service.wire.jsonrows import native

    if native() is None:
        pytest.skip("the native reader is not built")
    if dtype == "u1" and experts > 256:
        experts = 256  # ids past a byte do not travel in u1
    moe = MoeShape(layers=3, experts=experts, top_k=top_k)
    rng = np.random.default_rng(experts + top_k)
    found = 0
    for _ in range(60):
        r = _planted(rng, moe, int(rng.integers(1, 30)), dtype)
        keep = rng.random(r.shape[0]) < 0.7 if rng.random() < 0.5 else None
        numpy_fault = expert_routes._numpy_fault(r, moe, keep)
        assert expert_routes._fault(r, moe, keep) == numpy_fault
        found += numpy_fault is not None
    assert 10 < found < 60  # faults of both kinds, and clean routes, were met


def test_the_checks_hold_without_the_native_reader(monkeypatch: pytest.MonkeyPatch) -> None:
    from service.normalise import expert_routes

    monkeypatch.setattr(expert_routes, "native", lambda: None)
    with pytest.raises(InvalidRequest) as caught:
        framed_routes("u1", np.asarray(bad(GOOD, 2, 0, 1, 8)).ravel().tolist())
    assert "routed_experts[0][2][0][1] is 8; expert ids are 0 .. 7" in caught.value.message
    twice = GOOD.copy()
    twice[1, 1] = [3, 3]
    with pytest.raises(InvalidRequest) as caught:
        framed_routes("i4", twice.ravel().tolist())
    assert "routed_experts[0][1][1] names an expert twice ([3, 3])" in caught.value.message
    assert framed_routes("u1", GOOD.ravel().tolist()).jobs[0].routes is not None
