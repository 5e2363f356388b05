"""Weight pushes in SGLang's protocol over HTTP, on an engine that takes pushed weights without a
model (tests/support/fakes.py FakePushEngine: the policy holds tensors a, b, c; a push serves a shift of the
count of its tensors): when a version serves (complete, committed, another version, dropped after the
timeout), how versions are named, FIFO per group, the conflicts, the refusals, the admin key and
SGLang's answers."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from service.http.app import create_app
from service.settings import Settings
from service.weights.push import next_version
from tests.support.fakes import FakeEngine, FakePushEngine
from tests.support.servers import Reply, loopback, wait_ready

ADMIN = "admin-key"
AS_ADMIN = {"Authorization": f"Bearer {ADMIN}"}
ROWS = {"input_ids": [[5, 6, 7]], "num_actions": 2}
INIT = {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2}


def _app(engine: FakeEngine, **settings: Any) -> Any:
    return create_app(Settings(admin_api_keys=ADMIN, **settings), engine_factory=lambda _: engine)


@pytest.fixture
def engine() -> FakePushEngine:
    return FakePushEngine()


@pytest.fixture
def client(engine: FakePushEngine) -> Iterator[TestClient]:
    with TestClient(_app(engine)) as client:
        wait_ready(client)
        assert client.post("/init_weights_update_group", json=INIT, headers=AS_ADMIN).status_code == 200
        yield client


def bucket(client: Any, names: list[str], version: str | None = None, **extra: Any) -> Reply:
    body = {"names": names, "dtypes": ["bfloat16"] * len(names), "shapes": [[2, 2]] * len(names), **extra}
    if version is not None:
        body["weight_version"] = version
    reply: Reply = client.post("/update_weights_from_distributed", json=body, headers=AS_ADMIN)
    return reply


def init(client: Any, group: str = "weight_update_group") -> Reply:
    """SGLang's /init_weights_update_group of `group` (SGLang's default name unless given)."""
    body = {**INIT, "group_name": group}
    reply: Reply = client.post("/init_weights_update_group", json=body, headers=AS_ADMIN)
    return reply


def served(client: Any) -> tuple[str, float]:
    """The policy's version and shift, as a scoring answer reports them."""
    body = client.post("/logprobs", json=ROWS).json()
    return body["weights_version"], -(6 + 1) - body["logprobs"][0][0]


def test_a_version_serves_once_complete(client: TestClient) -> None:
    first = bucket(client, ["a"], "v1")
    assert first.status_code == 200
    assert first.json()["success"] is True
    assert "staged" in first.json()["message"]
    assert served(client) == ("initial", 0.0)  # staged, not served
    assert bucket(client, ["b"], "v1").status_code == 200
    last = bucket(client, ["c"], "v1")
    assert last.json() == {
        "success": True,
        "message": "Succeeded to update parameter online. Weight version updated to v1.",
    }
    assert served(client) == ("v1", 3.0)  # applied before the completing call answered
    assert client.get("/get_weight_version", headers=AS_ADMIN).json() == {"weight_version": "v1"}
    assert client.get("/weight_version", headers=AS_ADMIN).json() == {"weight_version": "v1"}
    assert client.get("/info").json()["weights"]["policy"]["source"] == "push"
    metrics = client.get("/metrics").text
    assert 'logprobd_weights_version{target="policy",version="v1"} 1.0' in metrics
    assert 'logprobd_weights_pushes_total{outcome="applied",target="policy"} 1.0' in metrics
    assert 'logprobd_weights_push_buckets_total{outcome="received",target="policy"} 3.0' in metrics
    assert 'logprobd_weights_push_bytes_total{target="policy"} 12.0' in metrics
    assert 'logprobd_weights_push_duration_seconds_count{target="policy"} 1.0' in metrics


@pytest.mark.parametrize("end", ["/continue_generation", "/end_weight_update"])
def test_the_trainer_ends_a_partial_version(client: TestClient, end: str) -> None:
    assert bucket(client, ["a", "b"], "v2").status_code == 200
    assert served(client) == ("initial", 0.0)
    assert client.post(end, headers=AS_ADMIN).status_code == 200  # no body, as SGLang allows
    assert served(client) == ("v2", 2.0)  # what arrived; c kept its value
    metrics = client.get("/metrics").text
    assert 'logprobd_weights_pushes_total{outcome="committed",target="policy"} 1.0' in metrics


def test_a_bucket_of_another_version_commits_the_pending_one(
    client: TestClient, engine: FakePushEngine
) -> None:
    assert bucket(client, ["a"], "v1").status_code == 200
    assert bucket(client, ["b", "c"], "v2").status_code == 200
    assert served(client) == ("v1", 1.0)
    assert client.post("/continue_generation", json={}, headers=AS_ADMIN).status_code == 200
    assert served(client) == ("v2", 2.0)
    assert engine.received == [("v1", ("a",)), ("v2", ("b", "c"))]


def test_pushes_without_a_version_are_named_after_the_served_one(client: TestClient) -> None:
    assert next_version("v7") == "v7+1"
    assert next_version("v7+1") == "v7+2"
    assert next_version("step-12+9") == "step-12+10"
    for expected in ("initial+1", "initial+2"):  # AReaL: no weight_version, abort_all_requests true
        assert bucket(client, ["a"], abort_all_requests=True).status_code == 200
        assert bucket(client, ["b", "c"], abort_all_requests=True).json()["message"].endswith("online.")
        assert served(client) == (expected, 3.0)
    assert bucket(client, ["a"]).status_code == 200  # a pending unnamed version takes unnamed buckets
    assert bucket(client, ["b"]).status_code == 200
    assert client.post("/continue_generation", json={}, headers=AS_ADMIN).status_code == 200
    assert served(client) == ("initial+3", 2.0)


def test_a_partial_version_is_dropped_after_the_timeout(engine: FakePushEngine) -> None:
    with TestClient(_app(engine, weight_push_partial_timeout_s=0.3)) as client:
        wait_ready(client)
        assert client.post("/init_weights_update_group", json=INIT, headers=AS_ADMIN).status_code == 200
        assert bucket(client, ["a"], "v1").status_code == 200
        time.sleep(0.8)
        assert client.post("/continue_generation", json={}, headers=AS_ADMIN).status_code == 200
        assert served(client) == ("initial", 0.0)  # nothing was pending any more
        assert 'outcome="dropped",target="policy"} 1.0' in client.get("/metrics").text
        reload = client.post("/admin/weights", json={"path": "/w/5", "version": "r5"}, headers=AS_ADMIN)
        assert reload.status_code == 200  # the push no longer holds the gate


def test_one_groups_calls_run_one_at_a_time_in_arrival_order(engine: FakePushEngine) -> None:
    engine.receive_delay = 0.2
    with loopback(_app(engine)) as url:
        assert httpx.post(f"{url}/init_weights_update_group", json=INIT, headers=AS_ADMIN).status_code == 200
        answers: dict[str, int] = {}

        def send(name: str) -> None:
            with httpx.Client(base_url=url, timeout=30) as http:
                answers[name] = bucket(http, [name], "v1").status_code

        threads = []
        for name in ("c", "a", "b"):
            threads.append(threading.Thread(target=send, args=(name,)))
            threads[-1].start()
            time.sleep(0.05)  # they arrive in this order, while the first is still receiving
        for thread in threads:
            thread.join()
        assert answers == {"c": 200, "a": 200, "b": 200}
        assert engine.received == [("v1", ("c",)), ("v1", ("a",)), ("v1", ("b",))]
        assert httpx.post(f"{url}/logprobs", json=ROWS).json()["weights_version"] == "v1"


def test_a_refused_bucket_leaves_the_pending_version(client: TestClient) -> None:
    assert bucket(client, ["a"], "v1").status_code == 200
    refused = bucket(client, ["b", "unknown.weight"], "v1")
    assert refused.status_code == 400
    assert refused.json()["success"] is False
    assert refused.json()["message"].startswith("Failed to update parameter online: unknown.weight:")
    assert client.post("/continue_generation", json={}, headers=AS_ADMIN).status_code == 200
    assert served(client) == ("v1", 1.0)
    assert 'outcome="refused",target="policy"} 1.0' in client.get("/metrics").text


def test_a_broken_group_is_gone_and_the_next_init_is_accepted(client: TestClient) -> None:
    assert bucket(client, ["a"], "v1").status_code == 200
    broken = bucket(client, ["die"], "v1")
    assert broken.status_code == 400
    assert "the trainer went away" in broken.json()["message"]
    assert served(client) == ("initial", 0.0)  # what the group left pending is dropped
    gone = bucket(client, ["a"], "v1")
    assert gone.json() == {
        "success": False,
        "message": "Group weight_update_group not in []. Please call `init_weights_update_group` first.",
    }
    assert client.post("/init_weights_update_group", json=INIT, headers=AS_ADMIN).status_code == 200
    assert bucket(client, ["a", "b", "c"], "v3").status_code == 200
    assert served(client) == ("v3", 3.0)


def test_groups_up_to_the_setting_are_open_at_once(engine: FakePushEngine) -> None:
    with TestClient(_app(engine, weight_push_max_groups=2)) as client:
        wait_ready(client)
        assert client.post("/init_weights_update_group", json=INIT, headers=AS_ADMIN).status_code == 200
        again = client.post("/init_weights_update_group", json=INIT, headers=AS_ADMIN)
        assert again.status_code == 400
        assert "already been used" in again.json()["message"]
        assert init(client, "pp1").status_code == 200
        assert "\nlogprobd_weights_push_groups 2.0\n" in client.get("/metrics").text
        third = init(client, "pp2")
        assert third.status_code == 409
        assert third.json()["success"] is False
        assert "2 group(s) are open ('weight_update_group', 'pp1')" in third.json()["message"]
        assert "weight_push_max_groups" in third.json()["message"]
        gone = client.post("/destroy_weights_update_group", json={"group_name": "pp2"}, headers=AS_ADMIN)
        assert gone.json() == {"success": False, "message": "The group to be destroyed does not exist."}
        done = client.post("/destroy_weights_update_group", json={}, headers=AS_ADMIN)
        assert done.json() == {"success": True, "message": "Succeeded to destroy custom process group."}
        assert "\nlogprobd_weights_push_groups 1.0\n" in client.get("/metrics").text
        assert init(client, "pp2").status_code == 200


def test_pipeline_stages_fill_one_version_side_by_side(engine: FakePushEngine) -> None:
    """slime's pipeline stages: a group each, their buckets of one version at once; the version serves
    when the bucket that completes it is staged, whichever group sent it."""
    engine.meet = threading.Barrier(2)  # each bucket waits in the engine for the other: side by side
    with loopback(_app(engine)) as url:
        answers: dict[str, Reply] = {}
        with httpx.Client(base_url=url, timeout=30) as http:
            assert [init(http, stage).status_code for stage in ("pp0", "pp1")] == [200, 200]

        def send(stage: str, names: list[str]) -> None:
            with httpx.Client(base_url=url, timeout=30) as http:
                answers[stage] = bucket(http, names, "v1", group_name=stage)

        threads = [
            threading.Thread(target=send, args=("pp0", ["a"])),
            threading.Thread(target=send, args=("pp1", ["b", "c"])),
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert {stage: answer.status_code for stage, answer in answers.items()} == {"pp0": 200, "pp1": 200}
        messages = sorted(answer.json()["message"] for answer in answers.values())
        # one answer staged its stage's part, the other completed the version and served it
        assert messages[0].endswith("Weight version updated to v1.")
        assert "Weight version v1 is staged" in messages[1]
        assert sorted(engine.received) == [("v1", ("a",)), ("v1", ("b", "c"))]
        body = httpx.post(f"{url}/logprobs", json=ROWS).json()
        assert (body["weights_version"], -(6 + 1) - body["logprobs"][0][0]) == ("v1", 3.0)


def test_the_trainer_ends_a_version_once_every_stages_bucket_in_flight_is_in(engine: FakePushEngine) -> None:
    """/continue_generation while a stage's bucket is still arriving: the version serves with it."""
    with loopback(_app(engine)) as url:
        with httpx.Client(base_url=url, timeout=30) as http:
            assert [init(http, stage).status_code for stage in ("pp0", "pp1")] == [200, 200]
        with httpx.Client(base_url=url, timeout=30) as http:
            assert bucket(http, ["a"], "v1", group_name="pp0").status_code == 200
        engine.receive_delay = 0.5
        engine.receiving.clear()
        late: list[Reply] = []

        def send() -> None:
            with httpx.Client(base_url=url, timeout=30) as http:
                late.append(bucket(http, ["b"], "v1", group_name="pp1"))

        thread = threading.Thread(target=send)
        thread.start()
        assert engine.receiving.wait(10)  # pp1's bucket is being received
        ended = httpx.post(f"{url}/continue_generation", json={}, headers=AS_ADMIN, timeout=30)
        thread.join()
        assert ended.status_code == 200
        assert late[0].status_code == 200
        body = httpx.post(f"{url}/logprobs", json=ROWS).json()
        assert (body["weights_version"], -(6 + 1) - body["logprobs"][0][0]) == ("v1", 2.0)


def test_a_version_pending_from_other_groups_is_not_ended_by_a_stranger(client: TestClient) -> None:
    assert init(client, "other").status_code == 200
    assert bucket(client, ["a"], "v1").status_code == 200
    stranger = bucket(client, ["b"], "v2", group_name="other")
    assert stranger.status_code == 409
    assert "version 'v1' is pending from group(s) 'weight_update_group'" in stranger.json()["message"]
    assert bucket(client, ["b"], "v1", group_name="other").status_code == 200  # joins it
    assert bucket(client, ["c"], "v2").status_code == 200  # a group that sent to v1 ends it
    assert served(client) == ("v1", 2.0)
    assert client.post("/continue_generation", json={}, headers=AS_ADMIN).status_code == 200
    assert served(client) == ("v2", 1.0)


def test_a_group_that_breaks_drops_the_version_every_stage_sent_to(client: TestClient) -> None:
    assert init(client, "pp1").status_code == 200
    assert bucket(client, ["a"], "v1").status_code == 200
    assert bucket(client, ["b"], "v1", group_name="pp1").status_code == 200
    assert bucket(client, ["die"], "v1", group_name="pp1").status_code == 400
    assert "\nlogprobd_weights_push_groups 1.0\n" in client.get("/metrics").text  # pp1 is gone
    assert client.post("/continue_generation", json={}, headers=AS_ADMIN).status_code == 200
    assert served(client) == ("initial", 0.0)  # nothing of v1 serves: a stage's part of it is lost
    assert 'outcome="dropped",target="policy"} 1.0' in client.get("/metrics").text
    assert bucket(client, ["a", "b", "c"], "v2").status_code == 200  # the other stage's group goes on
    assert served(client) == ("v2", 3.0)


def test_destroying_the_group_drops_its_pending_version(client: TestClient, engine: FakePushEngine) -> None:
    assert bucket(client, ["a"], "v1").status_code == 200
    assert client.post("/destroy_weights_update_group", json={}, headers=AS_ADMIN).status_code == 200
    assert engine.left == ["weight_update_group"]
    assert client.post("/continue_generation", json={}, headers=AS_ADMIN).status_code == 200
    assert served(client) == ("initial", 0.0)


def test_a_reload_and_a_push_exclude_each_other(client: TestClient, engine: FakePushEngine) -> None:
    assert bucket(client, ["a"], "v1").status_code == 200
    reload = client.post("/admin/weights", json={"path": "/w/5", "version": "r5"}, headers=AS_ADMIN)
    assert reload.status_code == 409
    assert reload.json()["error"]["type"] == "reload_in_progress"
    assert "a push of the policy to 'v1' is pending" in reload.json()["error"]["message"]
    assert bucket(client, ["b", "c"], "v1").status_code == 200  # served: the gate is free again
    engine.staging.clear()  # the reload stays under way until set
    started = client.post(
        "/admin/weights", json={"path": "/w/5", "version": "r5", "wait": False}, headers=AS_ADMIN
    )
    assert started.status_code == 202
    push = bucket(client, ["a"], "v2")
    engine.staging.set()
    assert push.status_code == 409
    assert push.json()["success"] is False
    assert "a reload of the policy to 'r5' is under way" in push.json()["message"]
    assert engine.drained == [("a",)]  # the trainer's broadcasts were met all the same


def test_pins_see_the_pushed_version(client: TestClient) -> None:
    assert bucket(client, ["a", "b", "c"], "v1").status_code == 200
    stale = client.post("/logprobs", json={**ROWS, "weights_version": "initial"})
    assert stale.status_code == 409
    assert stale.json()["error"]["serving_version"] == "v1"
    assert client.post("/logprobs", json={**ROWS, "weights_version": "v1"}).status_code == 200


def test_update_weight_version_names_the_pending_or_the_served_weights(client: TestClient) -> None:
    named = client.post("/update_weight_version", json={"new_version": "v9"}, headers=AS_ADMIN)
    assert named.json() == {"success": True, "message": "Weight version updated to v9", "new_version": "v9"}
    assert served(client) == ("v9", 0.0)
    assert bucket(client, ["a"]).status_code == 200  # pending as v9+1
    assert (
        client.post("/update_weight_version", json={"new_version": "v10"}, headers=AS_ADMIN).status_code
        == 200
    )
    assert served(client) == ("v10", 1.0)
    bad = client.post("/update_weight_version", json={"new_version": "has spaces"}, headers=AS_ADMIN)
    assert (bad.status_code, bad.json()["success"]) == (400, False)


def test_sglang_bodies_are_parsed_as_sglang_parses_them(client: TestClient, engine: FakePushEngine) -> None:
    # unknown fields ignored, a port as a string (AReaL), no body where SGLang has defaults
    assert (
        client.post("/destroy_weights_update_group", json={"rid": "x"}, headers=AS_ADMIN).status_code == 200
    )
    areal = {
        **INIT,
        "master_port": "29731",
        "pp_rank": 0,
        "backend": "gloo",
        "group_name": "update_weight_group",
    }
    assert client.post("/init_weights_update_group", json=areal, headers=AS_ADMIN).status_code == 200
    missing = client.post("/update_weights_from_distributed", json={"names": ["a"]}, headers=AS_ADMIN)
    assert missing.status_code == 400
    assert missing.json()["object"] == "error"
    assert missing.json()["code"] == 400
    assert missing.json()["message"].startswith("dtypes:")
    number = bucket(client, ["a"], group_name="update_weight_group", weight_version=3)
    assert number.status_code == 400  # SGLang does not make a number a string
    assert (
        bucket(client, ["a"], "v1", group_name="update_weight_group", load_format="pickle").status_code == 400
    )
    bad = bucket(client, ["a"], "a b", group_name="update_weight_group")
    assert (bad.status_code, bad.json()["success"]) == (400, False)
    assert "is not a version" in bad.json()["message"]
    assert engine.drained == [("a",)]  # refused before it was looked at, its broadcasts met
    fine = bucket(client, ["a"], "v1", group_name="update_weight_group", flush_cache=False, selector="all")
    assert fine.status_code == 200


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"rank_offset": 0}, "do not fit a world of 2"),
        ({"rank_offset": 2}, "do not fit a world of 2"),
        ({"master_address": "unreachable"}, "no trainer came"),
    ],
)
def test_refused_inits(engine: FakePushEngine, change: dict[str, Any], reason: str) -> None:
    with TestClient(_app(engine)) as client:
        wait_ready(client)
        reply = client.post("/init_weights_update_group", json={**INIT, **change}, headers=AS_ADMIN)
        assert reply.status_code == 400
        assert reply.json()["message"].startswith("Failed to initialize custom process group: ")
        assert reason in reply.json()["message"]
        assert client.post("/init_weights_update_group", json=INIT, headers=AS_ADMIN).status_code == 200


def test_the_server_dials_only_the_addresses_it_allows(engine: FakePushEngine) -> None:
    with TestClient(_app(engine, weight_push_addresses="10.0.0.0/8, 192.168.1.7")) as client:
        wait_ready(client)
        for address in ("127.0.0.1", "localhost"):
            refused = client.post(
                "/init_weights_update_group", json={**INIT, "master_address": address}, headers=AS_ADMIN
            )
            assert refused.status_code == 400
            assert "is not in this server's weight_push_addresses" in refused.json()["message"]
        assert engine.groups == {}
    with TestClient(_app(engine, weight_push_addresses="127.0.0.0/8")) as client:
        wait_ready(client)
        allowed = {**INIT, "master_address": "localhost"}
        assert client.post("/init_weights_update_group", json=allowed, headers=AS_ADMIN).status_code == 200


ROUTES = [
    ("post", "/init_weights_update_group", INIT),
    ("post", "/update_weights_from_distributed", {"names": [], "dtypes": [], "shapes": []}),
    ("post", "/destroy_weights_update_group", {}),
    ("get", "/get_weight_version", None),
    ("get", "/weight_version", None),
    ("post", "/update_weight_version", {"new_version": "v1"}),
    ("get", "/flush_cache", None),
    ("post", "/flush_cache", None),
    ("post", "/pause_generation", {}),
    ("post", "/continue_generation", {}),
    ("post", "/begin_weight_update", {}),
    ("post", "/end_weight_update", {}),
    ("get", "/server_info", None),
    ("get", "/model_info", None),
]


def test_every_route_needs_an_admin_key(engine: FakePushEngine) -> None:
    with TestClient(create_app(Settings(), engine_factory=lambda _: engine)) as off:
        wait_ready(off)
        for method, path, body in ROUTES:
            reply = off.request(method, path, json=body, headers=AS_ADMIN)
            assert (reply.status_code, reply.json()["error"]["type"]) == (403, "forbidden"), path
            assert "weight push is off" in reply.json()["error"]["message"]
    with TestClient(_app(engine, api_keys="user-key")) as on:
        wait_ready(on)
        for method, path, body in ROUTES:
            for headers in ({}, {"Authorization": "Bearer user-key"}, {"Authorization": "Bearer nope"}):
                assert on.request(method, path, json=body, headers=headers).status_code == 401, path
    assert engine.groups == {}


def test_the_answers_around_a_push_are_sglangs(client: TestClient) -> None:
    paused = client.post("/pause_generation", json={}, headers=AS_ADMIN)
    assert paused.json() == {"message": "Generation paused successfully.", "status": "ok"}
    for method in ("get", "post"):
        flushed = client.request(method, "/flush_cache", headers=AS_ADMIN)
        assert flushed.status_code == 200
        assert flushed.headers["content-type"].startswith("text/plain")
        assert flushed.text.startswith("Cache flushed.\nPlease check backend logs")
    resumed = client.post("/continue_generation", headers=AS_ADMIN)
    assert resumed.json() == {"message": "Generation continued successfully.", "status": "ok"}
    assert client.post("/begin_weight_update", json={"selector": "all"}, headers=AS_ADMIN).json()["success"]
    info = client.get("/server_info", headers=AS_ADMIN).json()
    assert (info["tp_size"], info["pp_size"], info["enable_memory_saver"]) == (1, 1, False)
    assert (info["weight_version"], info["dtype"]) == ("initial", "float32")
    assert client.get("/get_server_info", headers=AS_ADMIN).json() == info
    model = client.get("/model_info", headers=AS_ADMIN).json()
    assert (model["weight_version"], model["is_generation"]) == ("initial", True)


def test_an_engine_that_takes_no_pushes_says_so() -> None:
    with TestClient(_app(FakeEngine())) as client:
        wait_ready(client)
        reply = client.post("/init_weights_update_group", json=INIT, headers=AS_ADMIN)
        assert reply.status_code == 400
        assert reply.json()["message"].endswith("this engine does not take pushed weights.")
