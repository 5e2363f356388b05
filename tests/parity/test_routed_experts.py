"""Routing replay and recorded routes over HTTP, end to end on a tiny Qwen3-MoE (one dense layer,
one sparse layer of 8 experts, top-2): the routes a request records come back in its format (JSON
lists, base64 int32, a frame), replaying them in any form gives the same scores as not replaying
(agreement 1.0), random routes change the scores and lower the agreement, the metrics see it, and
bad routes are 422s naming the field and the row while the server keeps serving. Every test runs with
JSON bodies read by pydantic (small bodies) and by the fast reader (jsonrows.parse_json, its native
route reader decoding base64 and lists; LOGPROBD_REQUIRE_NATIVE=1 fails where it is not built).

The engine's replay against transformers' own forward is tested on the engine's side; here the
reference is the server's own live scores and the routes it recorded, and for routes that differ
from the live router's, in every form, that float64 forward with its routers forced
(tests/engine/moe/test_replay.py's reference).
"""

from __future__ import annotations

import base64
import functools
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
from fastapi.testclient import TestClient

from service.client.routed_experts import decode
from service.client.wire import from_frame, to_frame
from service.core.jobs import GivenRoutes, SequenceJob
from service.http import router
from service.wire.frame import MEDIA_TYPE, unpack
from service.wire.jsonrows import parse_json
from tests.engine.moe.test_replay import reference
from tests.support.device import settings_for
from tests.support.needs import native_or_skip
from tests.support.servers import running

FRAMED = {"content-type": MEDIA_TYPE, "accept": MEDIA_TYPE}
RAGGED = {"input_ids": [[3, 14, 15, 92, 65, 35, 89], [79, 32, 38, 46]], "num_actions": [3, 2]}
# the same sequences, padded on the left and on the right
PADDED = {
    "input_ids": [[0, 0, 3, 14, 15, 92, 65, 35, 89], [79, 32, 38, 46, 0, 0, 0, 0, 0]],
    "attention_mask": [[0, 0, 1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0, 0, 0, 0]],
    "action_mask": [[0, 0, 0, 0, 0, 1, 1, 1], [0, 1, 1, 0, 0, 0, 0, 0]],
}


@pytest.fixture(autouse=True, params=["pydantic", "native"])
def reader(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Small JSON bodies go to pydantic; "native": every body through the fast reader."""
    if request.param == "native":
        native_or_skip()
        monkeypatch.setattr(router, "parse_json", functools.partial(parse_json, min_bytes=0))
    return str(request.param)


@pytest.fixture(scope="module")
def server(model_dirs: dict[str, Path]) -> Iterator[TestClient]:
    with running(settings_for(model_dirs["qwen3_moe"])) as client:
        yield client


def post(client: TestClient, body: dict[str, Any], framed: bool = False) -> dict[str, Any]:
    if framed:
        raw = to_frame(body)
        assert raw is not None
        reply = client.post("/logprobs", content=raw, headers=FRAMED)
        assert reply.status_code == 200, reply.text
        return from_frame(reply.content)
    reply = client.post("/logprobs", json=body)
    assert reply.status_code == 200, reply.text
    answer: dict[str, Any] = reply.json()
    return answer


def b64(routes: np.ndarray) -> str:
    return base64.b64encode(routes.astype("<i4").tobytes()).decode()


def recorded(client: TestClient, body: dict[str, Any]) -> tuple[dict[str, Any], list[np.ndarray]]:
    answer = post(client, {**body, "return_routed_experts": True})
    return answer, decode(answer["routed_experts"], answer["moe"])


def test_recorded_routes_come_back_in_the_request_format(server: TestClient) -> None:
    lists, routes = recorded(server, RAGGED)
    assert lists["moe"] == {"layers": 1, "experts": 8, "top_k": 2}
    assert [r.shape for r in routes] == [(7, 1, 2), (4, 1, 2)]
    assert isinstance(lists["routed_experts"][0], list)
    assert all(
        len(set(pair)) == 2 and min(pair) >= 0 and max(pair) < 8 for r in routes for pair in r[:, 0].tolist()
    )
    strings = post(server, {**RAGGED, "return_routed_experts": True, "routed_experts_format": "base64"})
    assert strings["routed_experts"] == [b64(r) for r in routes]
    framed = post(server, {**RAGGED, "return_routed_experts": True}, framed=True)
    # the client reads a frame's routes as numpy rows of the wire's dtype, not Python ints
    assert all(isinstance(r, np.ndarray) and r.dtype == np.uint8 for r in framed["routed_experts"])
    assert [np.asarray(r) for r in framed["routed_experts"]] == [] or all(
        np.array_equal(a, b)
        for a, b in zip(decode(framed["routed_experts"], framed["moe"]), routes, strict=True)
    )
    # a request that sent base64 routes gets base64 back
    echoed = post(
        server, {**RAGGED, "routed_experts": [b64(r) for r in routes], "return_routed_experts": True}
    )
    assert echoed["routed_experts"] == strings["routed_experts"]


def test_the_frame_carries_routes_in_one_byte_each(server: TestClient) -> None:
    raw = to_frame({**RAGGED, "return_routed_experts": True})
    assert raw is not None
    reply = server.post("/logprobs", content=raw, headers=FRAMED)
    spec, data = unpack(reply.content).arrays["routed_experts"]
    assert (spec.dtype, spec.lengths, len(data)) == ("u1", (14, 8), 22)


def test_replaying_the_recorded_routes_reproduces_the_scores_in_every_form(server: TestClient) -> None:
    live, routes = recorded(server, RAGGED)
    forms = {
        "lists": post(server, {**RAGGED, "routed_experts": [r.tolist() for r in routes]}),
        "base64": post(server, {**RAGGED, "routed_experts": [b64(r) for r in routes]}),
        "frames": post(server, {**RAGGED, "routed_experts": [r.tolist() for r in routes]}, framed=True),
        # SGLang's L-1 positions: the last token, never forwarded, routes live
        "sglang": post(server, {**RAGGED, "routed_experts": [b64(r[:-1]) for r in routes]}),
    }
    for name, answer in forms.items():
        for got, want in zip(answer["logprobs"], forms["lists"]["logprobs"], strict=True):  # bitwise
            np.testing.assert_array_equal(np.float32(got), np.float32(want), err_msg=name)
        np.testing.assert_allclose(
            np.concatenate(answer["logprobs"]), np.concatenate(live["logprobs"]), atol=1e-5, err_msg=name
        )
        assert answer["route_agreement"]["exact_fraction"] == 1.0, name
        assert answer["route_mean_overlap"] == [1.0, 1.0], name
    assert forms["lists"]["route_agreement"]["compared"] == 11
    assert forms["sglang"]["route_agreement"]["compared"] == 9


def test_padded_rows_record_and_replay_per_column(server: TestClient) -> None:
    _, ragged = recorded(server, RAGGED)
    live, per_column = recorded(server, PADDED)
    for row, mask, routes in zip(per_column, PADDED["attention_mask"], ragged, strict=True):
        real = np.flatnonzero(mask)
        np.testing.assert_array_equal(row[real], routes)  # the same tokens, the same experts
        assert not row[np.asarray(mask) == 0].any()  # padding columns hold 0, as verl's
    replayed = post(server, {**PADDED, "routed_experts": [r.tolist() for r in per_column]})
    np.testing.assert_allclose(
        np.concatenate(replayed["logprobs"]), np.concatenate(live["logprobs"]), atol=1e-5
    )
    assert replayed["route_agreement"]["exact_fraction"] == 1.0


def random_routes(rng: np.random.Generator, n: int) -> np.ndarray:
    return np.stack([rng.choice(8, 2, replace=False) for _ in range(n)])[:, None, :]


def test_other_routes_change_the_scores_and_the_agreement_shows_it(server: TestClient) -> None:
    live = post(server, RAGGED)
    rng = np.random.default_rng(0)
    given = [random_routes(rng, 7), random_routes(rng, 4)]
    _, ragged = recorded(server, RAGGED)
    replayed = post(server, {**RAGGED, "routed_experts": [b64(r) for r in given]})
    assert not np.allclose(np.concatenate(replayed["logprobs"]), np.concatenate(live["logprobs"]), atol=1e-3)
    same = [(set(g[t, 0]) == set(r[t, 0])) for g, r in zip(given, ragged, strict=True) for t in range(len(g))]
    overlap = [
        len(set(g[t, 0]) & set(r[t, 0])) / 2
        for g, r in zip(given, ragged, strict=True)
        for t in range(len(g))
    ]
    agreement = replayed["route_agreement"]
    assert agreement["compared"] == 11
    assert agreement["exact_fraction"] == pytest.approx(np.mean(same))
    assert agreement["mean_overlap"] == pytest.approx(np.mean(overlap))
    assert replayed["route_exact_fraction"][1] == pytest.approx(np.mean(same[7:]))
    after = observed(server)
    replayed_again = post(server, {**RAGGED, "routed_experts": [b64(r) for r in given]})
    assert replayed_again["route_agreement"] == agreement
    now = observed(server)  # one more request observed, by its own numbers
    assert now["exact_count"] - after["exact_count"] == 1
    assert now["exact_sum"] - after["exact_sum"] == pytest.approx(agreement["exact_fraction"])
    assert now["overlap_sum"] - after["overlap_sum"] == pytest.approx(agreement["mean_overlap"])


@pytest.mark.parametrize("form", ["lists", "base64", "frames"])
def test_given_routes_in_every_form_score_as_the_forced_float64_forward(
    server: TestClient, reference_models: dict[str, Any], form: str
) -> None:
    """Random routes from position 1 (row 0) and over every position (row 1), sent as nested lists,
    SGLang's base64 or a frame: each row's log-probs within 1e-4 of transformers' float64 forward
    with its routers forced to those routes."""
    rng = np.random.default_rng(3)
    given = [random_routes(rng, 6), random_routes(rng, 4)]
    sent = [b64(r) if form == "base64" else r.tolist() for r in given]
    body = {**RAGGED, "routed_experts": sent, "routed_experts_start": [1, 0]}
    answer = post(server, body, framed=form == "frames")
    rows = cast("list[list[int]]", RAGGED["input_ids"])
    actions = cast("list[int]", RAGGED["num_actions"])
    for i, (tokens, n) in enumerate(zip(rows, actions, strict=True)):
        start = 1 if i == 0 else 0
        job = SequenceJob(
            tokens=np.asarray(tokens),
            actions=np.arange(len(tokens) - n, len(tokens)),
            temperature=1.0,
            return_entropy=False,
            routes=GivenRoutes(start, given[i].astype(np.uint8)),
        )
        want, _ = reference(reference_models["qwen3_moe"], job)
        np.testing.assert_allclose(np.asarray(answer["logprobs"][i], np.float64), want, atol=1e-4)


def observed(server: TestClient) -> dict[str, float]:
    text = server.get("/metrics").text

    def sample(series: str) -> float:
        found = re.search(rf"^{series} (\S+)$", text, re.MULTILINE)
        assert found is not None, series
        return float(found.group(1))

    return {
        "exact_count": sample("logprobd_route_exact_fraction_count"),
        "exact_sum": sample("logprobd_route_exact_fraction_sum"),
        "overlap_sum": sample("logprobd_route_mean_overlap_sum"),
    }


def test_grouped_routes_equal_flat_routes(server: TestClient) -> None:
    prompt, responses = [3, 14, 15, 92], [[65, 35, 89], [7, 7]]
    flat_body = {"input_ids": [prompt + r for r in responses], "num_actions": [3, 2]}
    _, routes = recorded(server, flat_body)
    flat = post(server, {**flat_body, "routed_experts": [b64(r) for r in routes]})
    grouped_body = {"input_ids": responses, "prompt_ids": [prompt], "prompt_index": [0, 0]}
    grouped = post(
        server,
        {
            **grouped_body,
            "prompt_routed_experts": [routes[0][:4].tolist()],
            "routed_experts": [r[4:].tolist() for r in routes],
            "return_routed_experts": True,
        },
    )
    assert grouped["logprobs"] == flat["logprobs"]
    assert grouped["route_agreement"] == flat["route_agreement"]
    got = decode(grouped["routed_experts"], grouped["moe"])  # every position of prompt + response
    assert all(np.array_equal(a, b) for a, b in zip(got, routes, strict=True))


@pytest.mark.parametrize(
    ("extra", "field", "row"),
    [
        ({"routed_experts": [None, [[[1, 9]]]]}, "routed_experts", 1),
        ({"routed_experts": [None, [[[3, 3]]]]}, "routed_experts", 1),
        ({"routed_experts": [None, [[[1, 2], [3, 4]]]]}, "routed_experts", 1),
        ({"routed_experts": [None, [[[1, 2, 3]]]]}, "routed_experts", 1),
        ({"routed_experts": ["@@@", None]}, "routed_experts", 0),
        ({"routed_experts": [None, base64.b64encode(b"12345").decode()]}, "routed_experts", 1),
        ({"routed_experts": [None, [[[1, 2]]] * 5]}, "routed_experts", 1),
    ],
)
def test_bad_routes_are_422_and_the_server_keeps_serving(
    server: TestClient, extra: dict[str, Any], field: str, row: int
) -> None:
    reply = server.post("/logprobs", json={**RAGGED, **extra})
    assert reply.status_code == 422, reply.text
    error = reply.json()["error"]
    assert (error["field"], error.get("row")) == (field, row), error
    assert post(server, RAGGED)["logprobs"]


def test_a_dense_policy_refuses_routes(model_dirs: dict[str, Path]) -> None:
    with running(settings_for(model_dirs["qwen2"])) as client:
        for body, field in [
            ({**RAGGED, "routed_experts": [None, [[[1, 2]]]]}, "routed_experts"),
            ({**RAGGED, "return_routed_experts": True}, "return_routed_experts"),
        ]:
            reply = client.post("/logprobs", json=body)
            assert reply.status_code == 422
            assert reply.json()["error"]["field"] == field
            assert "dense" in reply.json()["error"]["message"]
