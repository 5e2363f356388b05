"""POST /admin/weights over HTTP: admin keys, versions on every response and in /info and /metrics,
pins, refused checkpoints; and weights switched several times under concurrent load on loopback,
where every answer must equal the reference of the version it reports."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient

from service.http.app import create_app
from service.settings import Settings
from tests.support import critics, models
from tests.support.device import TOLERANCE, settings_for
from tests.support.fakes import FakeEngine
from tests.support.reference import expected
from tests.support.servers import Reply, loopback, running, wait_ready

ADMIN, USER = "admin-key", "user-key"
AS_ADMIN = {"Authorization": f"Bearer {ADMIN}"}
ROWS, ACTIONS = [[5, 6, 7, 8, 9], [10, 11, 12]], [3, 2]
BODY: dict[str, Any] = {"input_ids": ROWS, "num_actions": ACTIONS}


@pytest.fixture
def client(weight_versions: dict[str, Path]) -> Iterator[TestClient]:
    settings = settings_for(weight_versions["v10"], admin_api_keys=ADMIN, weights_version="v10")
    with running(settings) as client:
        yield client


def reload(client: TestClient, path: Path | str, version: str, **extra: Any) -> Reply:
    body = {"path": str(path), "version": version, **extra}
    reply: Reply = client.post("/admin/weights", json=body, headers=AS_ADMIN)
    return reply


def close(got: list[list[float]], want: list[list[float]]) -> bool:
    return all(np.allclose(g, w, atol=TOLERANCE, rtol=0) for g, w in zip(got, want, strict=True))


def test_reload_serves_the_new_version_everywhere(
    client: TestClient, weight_versions: dict[str, Path], version_models: dict[str, Any]
) -> None:
    first = client.post("/logprobs", json=BODY).json()
    assert first["weights_version"] == "v10"
    assert close(first["logprobs"], expected(version_models["v10"], BODY).logprobs)

    status = reload(client, weight_versions["v11"], "v11", mode="copy")
    assert status.status_code == 200, status.text
    done = status.json()
    assert (done["state"], done["mode"], done["version"], done["target"]) == ("done", "copy", "v11", "policy")
    assert done["bytes"] > 0
    assert done["pause_seconds"] >= 0

    after = client.post("/logprobs", json=BODY).json()
    assert after["weights_version"] == "v11"
    assert close(after["logprobs"], expected(version_models["v11"], BODY).logprobs)
    info = client.get("/info").json()
    assert info["weights_version"] == "v11"
    assert info["weights"]["policy"]["mode"] == "copy"
    assert info["weights"]["policy"]["reloads"] == 1
    assert info["weights"]["policy"]["source"] == str(weight_versions["v11"])
    metrics = client.get("/metrics").text
    assert 'logprobd_weights_version{target="policy",version="v11"} 1.0' in metrics
    assert 'version="v10"' not in metrics
    assert 'logprobd_weights_reloads_total{outcome="applied",target="policy"} 1.0' in metrics

    again = reload(client, weight_versions["v11"], "v11")
    assert again.json()["state"] == "unchanged"


def test_pinned_request_gets_409_with_both_versions(
    client: TestClient, weight_versions: dict[str, Path]
) -> None:
    assert client.post("/logprobs", json={**BODY, "weights_version": "v10"}).status_code == 200
    assert reload(client, weight_versions["v12"], "v12").status_code == 200
    stale = client.post("/logprobs", json={**BODY, "weights_version": "v10"})
    assert stale.status_code == 409
    error = stale.json()["error"]
    assert error["type"] == "weights_version_mismatch"
    assert (error["field"], error["target"]) == ("weights_version", "policy")
    assert (error["requested_version"], error["serving_version"]) == ("v10", "v12")
    assert "v10" in error["message"]
    assert "v12" in error["message"]
    assert (
        client.post("/logprobs", json={**BODY, "weights_version": "v12"}).json()["weights_version"] == "v12"
    )
    critic_pin = client.post("/logprobs", json={**BODY, "critic_weights_version": "c1"})
    assert critic_pin.status_code == 422
    assert critic_pin.json()["error"]["field"] == "critic_weights_version"


@pytest.mark.parametrize(
    ("change", "field", "status", "kind"),
    [
        ({"path": "{other}"}, "path", 422, "weights_rejected"),
        ({"path": "{missing}"}, "path", 422, "weights_rejected"),
        ({"target": "critic"}, "target", 422, "invalid_request"),
        ({"version": "has spaces"}, "version", 422, "invalid_request"),
        ({"mode": "fast"}, "mode", 422, "invalid_request"),
        ({"paths": "x"}, "paths", 422, "invalid_request"),
    ],
)
def test_refused_reloads_name_the_field_and_serving_goes_on(  # noqa: PLR0917 (parametrised)
    client: TestClient,
    weight_versions: dict[str, Path],
    tmp_path: Path,
    change: dict[str, str],
    field: str,
    status: int,
    kind: str,
) -> None:
    other = models.save("llama", tmp_path / "llama")
    places = {"other": str(other), "missing": str(tmp_path / "nothing")}
    body = {"path": str(weight_versions["v11"]), "version": "v11"}
    body.update({k: v.format(**places) for k, v in change.items()})
    reply = client.post("/admin/weights", json=body, headers=AS_ADMIN)
    assert reply.status_code == status, reply.text
    assert (reply.json()["error"]["type"], reply.json()["error"]["field"]) == (kind, field)
    served = client.post("/logprobs", json=BODY)
    assert (served.status_code, served.json()["weights_version"]) == (200, "v10")
    if kind == "weights_rejected":
        report = client.get("/admin/weights", headers=AS_ADMIN).json()
        assert report["reloads"]["policy"]["state"] == "rejected"
        assert report["reloads"]["policy"]["error"]
        assert report["weights"]["policy"]["version"] == "v10"
        assert (
            'logprobd_weights_reloads_total{outcome="rejected",target="policy"} 1.0'
            in client.get("/metrics").text
        )


def test_admin_routes_need_an_admin_key(weight_versions: dict[str, Path]) -> None:
    body = {"path": str(weight_versions["v11"]), "version": "v11"}
    with running(settings_for(weight_versions["v10"])) as off:
        reply = off.post("/admin/weights", json=body, headers=AS_ADMIN)
        assert (reply.status_code, reply.json()["error"]["type"]) == (403, "forbidden")
        assert "LOGPROBD_ADMIN_API_KEYS" in reply.json()["error"]["message"]
    settings = settings_for(weight_versions["v10"], api_keys=USER, admin_api_keys=ADMIN)
    with running(settings) as on:
        for headers in ({}, {"Authorization": f"Bearer {USER}"}, {"Authorization": "Bearer nope"}):
            assert on.post("/admin/weights", json=body, headers=headers).status_code == 401
            assert on.get("/admin/weights", headers=headers).status_code == 401
        assert on.post("/logprobs", json=BODY, headers=AS_ADMIN).status_code == 200  # admins may score
        assert on.post("/logprobs", json=BODY, headers={"Authorization": f"Bearer {USER}"}).status_code == 200


def test_reload_roots_confine_paths(weight_versions: dict[str, Path], tmp_path: Path) -> None:
    settings = settings_for(weight_versions["v10"], admin_api_keys=ADMIN, reload_roots=str(tmp_path))
    with running(settings) as client:
        reply = reload(client, weight_versions["v11"], "v11")
        assert (reply.status_code, reply.json()["error"]["field"]) == (422, "path")
        assert "outside the reload roots" in reply.json()["error"]["message"]


def test_background_reload_and_one_at_a_time() -> None:
    engine = FakeEngine()
    engine.stage_delay = 0.3
    with TestClient(create_app(Settings(admin_api_keys=ADMIN), engine_factory=lambda s: engine)) as client:
        wait_ready(client)
        started = reload(client, "/weights/3", "v3", wait=False)
        assert started.status_code == 202
        assert started.json()["state"] == "loading"
        busy = reload(client, "/weights/4", "v4")
        assert (busy.status_code, busy.json()["error"]["type"]) == (409, "reload_in_progress")
        assert "v3" in busy.json()["error"]["message"]
        deadline = time.monotonic() + 10
        while (
            client.get("/admin/weights", headers=AS_ADMIN).json()["reloads"]["policy"]["state"] == "loading"
        ):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        report = client.get("/admin/weights", headers=AS_ADMIN).json()
        assert report["reloads"]["policy"]["state"] == "done"
        assert report["weights"]["policy"]["version"] == "v3"
        reply = client.post("/logprobs", json=BODY).json()
        assert reply["weights_version"] == "v3"
        assert reply["logprobs"][0] == [-(7 + 2) - 3.0, -(8 + 3) - 3.0, -(9 + 4) - 3.0]


@dataclass
class Outcome:
    request: int
    pin: str | None
    status: int
    body: dict[str, Any]


def test_switching_weights_under_concurrent_load(
    weight_versions: dict[str, Path], version_models: dict[str, Any], tmp_path: Path
) -> None:
    """Six clients score (some pinned to the version they last saw) while the weights switch five
    times, in both modes, and one corrupt checkpoint is refused. Micro-batches of 64 tokens split
    every request, so a swap inside a request would give a mix that matches no reference."""
    rng = random.Random(8)
    pool = []
    for _ in range(8):
        rows = [[rng.randrange(3, models.VOCAB) for _ in range(rng.randint(12, 40))] for _ in range(4)]
        pool.append({"input_ids": rows, "num_actions": [rng.randint(1, len(r) - 1) for r in rows]})
    want = {v: [expected(m, r).logprobs for r in pool] for v, m in version_models.items()}
    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes((weight_versions["v11"] / "model.safetensors").read_bytes()[:5000])
    settings = settings_for(
        weight_versions["v10"],
        admin_api_keys=ADMIN,
        weights_version="v10",
        max_batch_tokens=64,
        batch_wait_ms=0,
    )
    outcomes: list[Outcome] = []
    stop = threading.Event()

    def load(seed: int, url: str) -> None:
        local = random.Random(seed)
        seen: str | None = None
        with httpx.Client(base_url=url, timeout=60) as http:
            while not stop.is_set():
                i = local.randrange(len(pool))
                pin = seen if local.random() < 0.5 else None
                body = {**pool[i], **({"weights_version": pin} if pin else {})}
                reply = http.post("/logprobs", json=body)
                outcomes.append(Outcome(i, pin, reply.status_code, reply.json()))
                if reply.status_code == 200:
                    seen = reply.json()["weights_version"]

    plan = [
        ("v11", "copy"),
        ("v12", "swap"),
        ("corrupt", "swap"),
        ("v10", "copy"),
        ("v12", "copy"),
        ("v11", "swap"),
    ]
    with loopback(create_app(settings)) as url:
        clients = [threading.Thread(target=load, args=(seed, url)) for seed in range(6)]
        for thread in clients:
            thread.start()
        statuses = []
        with httpx.Client(base_url=url, timeout=60, headers=AS_ADMIN) as admin:
            for version, mode in plan:
                time.sleep(0.4)
                path = corrupt if version == "corrupt" else weight_versions[version]
                statuses.append(
                    admin.post("/admin/weights", json={"path": str(path), "version": version, "mode": mode})
                )
            time.sleep(0.4)
            stop.set()
            for thread in clients:
                thread.join()
            info = admin.get("/info").json()
            metrics = admin.get("/metrics").text

    assert [s.status_code for s in statuses] == [200, 200, 422, 200, 200, 200]
    assert info["weights_version"] == "v11"
    assert info["weights"]["policy"]["reloads"] == 5
    assert 'logprobd_weights_reloads_total{outcome="applied",target="policy"} 5.0' in metrics
    assert 'logprobd_weights_reloads_total{outcome="rejected",target="policy"} 1.0' in metrics

    check_outcomes(outcomes, want)


def check_outcomes(outcomes: list[Outcome], want: dict[str, list[list[list[float]]]]) -> None:
    """Only 200 and 409; every 200 equals the reference of its version; 409s only for pins."""
    assert {o.status for o in outcomes} <= {200, 409}, [
        o.body for o in outcomes if o.status not in (200, 409)
    ][:2]
    ok = [o for o in outcomes if o.status == 200]
    refused = [o for o in outcomes if o.status == 409]
    wrong = [o for o in ok if not close(o.body["logprobs"], want[o.body["weights_version"]][o.request])]
    assert not wrong, f"{len(wrong)} answers match no reference of the version they report"
    assert all(o.pin in (None, o.body["weights_version"]) for o in ok)
    assert all(o.pin is not None for o in refused)
    assert all(o.body["error"]["requested_version"] == o.pin for o in refused)
    assert all(o.body["error"]["serving_version"] != o.pin for o in refused)
    served = {o.body["weights_version"] for o in ok}
    assert served == {"v10", "v11", "v12"}, served
    assert len(ok) > 60


def test_critic_reload_over_http(weight_versions: dict[str, Path], tmp_path: Path) -> None:
    old, new = (
        critics.save("openrlhf", tmp_path / "c3", seed=3),
        critics.save("openrlhf", tmp_path / "c4", seed=4),
    )
    settings = settings_for(
        weight_versions["v10"], critic=old, admin_api_keys=ADMIN, critic_weights_version="c3"
    )
    body = {**BODY, "return_values": True}
    with running(settings) as client:
        before = client.post("/logprobs", json=body).json()
        assert (before["weights_version"], before["critic_weights_version"]) == ("initial", "c3")
        assert reload(client, new, "c4", target="critic").status_code == 200
        after = client.post("/logprobs", json={**body, "critic_weights_version": "c4"}).json()
        assert (after["weights_version"], after["critic_weights_version"]) == ("initial", "c4")
        assert client.post("/logprobs", json=BODY).json()["critic_weights_version"] is None  # no values asked
        for i, (row, n) in enumerate(zip(ROWS, ACTIONS, strict=True)):
            want = critics.expected_values(new, row)[-n:]
            np.testing.assert_allclose(after["values"][i], want, atol=TOLERANCE)
        assert client.get("/info").json()["weights"]["critic"]["version"] == "c4"


def test_replicas_follow_a_version_file(
    weight_versions: dict[str, Path], version_models: dict[str, Any], tmp_path: Path
) -> None:
    """No admin request: two replicas watch one file; each rewrite is loaded by both, a broken or
    refused one is logged and the weights stay, and a rewrite after it is loaded again."""
    file = tmp_path / "weights.json"
    settings = settings_for(weight_versions["v10"], weights_follow=file, weights_follow_interval_s=0.05)

    def write(content: str) -> None:
        (tmp_path / "tmp.json").write_text(content)
        (tmp_path / "tmp.json").replace(file)  # atomically, as a trainer should

    def versions(urls: list[str]) -> list[str]:
        return [httpx.get(f"{url}/info").json()["weights_version"] for url in urls]

    def until(urls: list[str], version: str) -> None:
        deadline = time.monotonic() + 20
        while versions(urls) != [version] * len(urls):
            assert time.monotonic() < deadline, versions(urls)
            time.sleep(0.05)

    with loopback(create_app(settings)) as a, loopback(create_app(settings)) as b:
        assert versions([a, b]) == ["initial", "initial"]
        write(f'{{"path": "{weight_versions["v11"]}", "version": "v11"}}')
        until([a, b], "v11")
        reply = httpx.post(f"{b}/logprobs", json=BODY).json()
        assert close(reply["logprobs"], expected(version_models["v11"], BODY).logprobs)
        write("{not json")
        write(f'[{{"path": "{tmp_path}", "version": "broken"}}]')  # no config.json: refused
        time.sleep(0.5)
        assert versions([a, b]) == ["v11", "v11"]
        write(f'[{{"path": "{weight_versions["v12"]}", "version": "v12", "mode": "copy"}}]')
        until([a, b], "v12")
        info = httpx.get(f"{a}/info").json()["weights"]["policy"]
        assert (info["mode"], info["reloads"]) == ("copy", 2)
