"""Weights pushed in SGLang's protocol to a real `python -m service serve` on loopback (CPU, gloo),
by a trainer process on SGLang's own released helpers (tests/support/trainer.py), in slime's and AReaL's
payloads: the scores after a push are the float64 reference's of the pushed weights, for a
mixture-of-experts policy (per-expert Hugging Face names, or transformers' fused ones), a reference
model with tied embeddings and a critic; a push serves bitwise what a reload of the same checkpoint
serves; a pushed version drops what the prefix cache kept of the weights it replaces; a partial
version committed keeps the values it did not get; metadata that does not fit is drained, then
refused, and the group goes on."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from safetensors.torch import load_file, save_file

from service.core.cache_plan import BLOCK
from service.weights.push import next_version
from tests.support import critics, models
from tests.support.device import TOLERANCE, eager
from tests.support.reference import check_reply, expected
from tests.support.servers import free_port, server_process
from tests.support.trainer import Trainer, trainer

ADMIN = "admin-key"
AS_ADMIN = {"Authorization": f"Bearer {ADMIN}"}
BODY: dict[str, Any] = {
    "input_ids": [[5, 6, 7, 8, 9, 40, 41], [10, 11, 12, 13]],
    "num_actions": [5, 2],
    "return_entropy": True,
}
PUSH_TIMEOUT_S = 15  # the servers' weight_push_timeout_s
# a prompt of 3 whole blocks and 5 tokens, then 3 actions: the prefix cache keeps its 3 blocks
CACHED_BODY: dict[str, Any] = {
    "input_ids": [[3 + (7 * i) % 90 for i in range(3 * BLOCK + 8)]],
    "num_actions": 3,
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("push")
    return {
        "p0": models.save("qwen3_moe", root / "p0", seed=0),
        "p1": models.save("qwen3_moe", root / "p1", seed=1),
        "p2": models.save("qwen3_moe", root / "p2", seed=2),
        "r0": models.save("qwen2", root / "r0", seed=7),
        "r1": models.save("qwen2", root / "r1", seed=8),
        "c0": critics.save("openrlhf", root / "c0", seed=3),
        "c1": critics.save("openrlhf", root / "c1", seed=4),
    }


def serve_command(port: int, model: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "service", "serve", "--port", str(port), "--device", "cpu",
        "--model", str(model), "--batch-wait-ms", "0", "--drain-seconds", "0",
        "--weight-push-timeout-s", str(PUSH_TIMEOUT_S), *extra,
    ]  # fmt: skip


@contextmanager
def serving(command: list[str], port: int, log: Path) -> Iterator[str]:
    env = {**os.environ, "LOGPROBD_ADMIN_API_KEYS": ADMIN}
    with server_process(command, port, env=env, log=log, timeout=300, what="the server") as url:
        yield url


@pytest.fixture(scope="module")
def server(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A MoE policy, a tied reference and a critic, one server."""
    port = free_port()
    command = serve_command(
        port, checkpoints["p0"], "--ref-model", str(checkpoints["r0"]), "--critic", str(checkpoints["c0"]),
        "--weights-version", "p0", "--ref-weights-version", "r0", "--critic-weights-version", "c0",
    )  # fmt: skip
    with serving(command, port, tmp_path_factory.mktemp("logs") / "server.log") as url:
        yield url


@pytest.fixture(scope="module")
def rank0(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Trainer]:
    with trainer(tmp_path_factory.mktemp("logs") / "trainer.log") as process:
        yield process


@contextmanager
def group(
    rank0: Trainer, urls: list[str], name: str = "g", ranks: list[int] | None = None, **init: Any
) -> Iterator[dict[str, Any]]:
    """A group of the trainer and `urls` (each of `ranks` ranks: its tensor-parallel size, 1 by
    default), ranks 1.. in order; yields what every push needs; destroyed after."""
    sizes = ranks or [1] * len(urls)
    offsets = [1 + sum(sizes[:i]) for i in range(len(urls))]
    joined = rank0.call(
        "init", urls=urls, rank_offsets=offsets, port=free_port(), world_size=1 + sum(sizes), group=name,
        headers=AS_ADMIN, timeout_s=60, **init,
    )  # fmt: skip
    assert [r["status"] for r in joined["replies"]] == [200] * len(urls), joined
    try:
        yield {"urls": urls, "group": name, "headers": AS_ADMIN}
    finally:
        rank0.call("destroy", urls=urls, group=name, headers=AS_ADMIN)


def statuses(calls: list[list[dict[str, Any]]]) -> list[int]:
    return [reply["status"] for call in calls for reply in call]


def score(url: str, **extra: Any) -> dict[str, Any]:
    reply = httpx.post(f"{url}/logprobs", json={**BODY, **extra}, timeout=60)
    assert reply.status_code == 200, reply.text
    body: dict[str, Any] = reply.json()
    return body


def test_a_moe_policy_pushed_as_slime_pushes(
    server: str, rank0: Trainer, checkpoints: dict[str, Path]
) -> None:
    """slime: pause, GET flush_cache, three buckets of one named version (per-expert names), continue."""
    with group(rank0, [server]) as g:
        pushed = rank0.call(
            "push", checkpoint=str(checkpoints["p1"]), version="s1", buckets=3, style="slime", **g
        )
    assert set(statuses(pushed["calls"])) == {200}, pushed
    last = pushed["calls"][-2][0]["body"]  # the last bucket's answer, before continue_generation
    assert last == {
        "success": True,
        "message": "Succeeded to update parameter online. Weight version updated to s1.",
    }
    reply = httpx.post(f"{server}/logprobs", json=BODY, timeout=60)
    check_reply(reply, BODY, eager(checkpoints["p1"]))
    assert reply.json()["weights_version"] == "s1"
    assert httpx.get(f"{server}/get_weight_version", headers=AS_ADMIN).json() == {"weight_version": "s1"}
    assert (
        httpx.get(f"{server}/info")
        .json()["weights"]["policy"]["source"]
        .startswith("push:g@tcp://127.0.0.1:")
    )


def test_a_push_serves_bitwise_what_a_reload_of_the_same_weights_serves(
    server: str, rank0: Trainer, checkpoints: dict[str, Path]
) -> None:
    """AReaL: master_port as a string, pause, flattened buckets with abort_all_requests and no
    version, continue; then the same checkpoint reloaded from disk, and pushed again in copy mode."""
    served = score(server)["weights_version"]
    with group(rank0, [server], port_as_string=True) as g:
        pushed = rank0.call(
            "push", checkpoint=str(checkpoints["p2"]), buckets=2, flattened=True, style="areal", **g
        )
        assert set(statuses(pushed["calls"])) == {200}, pushed
        by_push = score(server)
        assert by_push["weights_version"] == next_version(served)  # no version: the served one's + 1
        reload = httpx.post(
            f"{server}/admin/weights",
            json={"path": str(checkpoints["p2"]), "version": "disk"},
            headers=AS_ADMIN,
        )
        assert reload.status_code == 200, reload.text
        by_reload = score(server)
        copied = rank0.call(
            "push", checkpoint=str(checkpoints["p2"]), version="copied", extra={"mode": "copy"}, **g
        )
        assert set(statuses(copied["calls"])) == {200}, copied
        by_copy = score(server)
    assert (by_reload["weights_version"], by_copy["weights_version"]) == ("disk", "copied")
    for field in ("logprobs", "entropy"):
        assert by_push[field] == by_reload[field] == by_copy[field]  # every bit
    check_reply(httpx.post(f"{server}/logprobs", json=BODY, timeout=60), BODY, eager(checkpoints["p2"]))


def cached_tokens(url: str, model: Path) -> int:
    """CACHED_BODY scored as `model` scores it; the tokens the prefix cache served it."""
    reply = httpx.post(f"{url}/logprobs", json=CACHED_BODY, timeout=60)
    check_reply(reply, CACHED_BODY, eager(model))
    tokens: int = reply.json()["usage"]["cached_tokens"]
    return tokens


def test_a_push_drops_what_the_old_weights_cached(
    server: str, rank0: Trainer, checkpoints: dict[str, Path]
) -> None:
    """The same prompt before and after a push: the request after it reads nothing the old weights
    computed (cached_tokens 0) and scores under the pushed ones; the next reads the new blocks."""

    with group(rank0, [server]) as g:
        assert statuses(
            rank0.call("push", checkpoint=str(checkpoints["p0"]), version="c0", **g)["calls"]
        ) == [200]
        assert [cached_tokens(server, checkpoints["p0"]) for _ in range(2)] == [0, 3 * BLOCK]
        assert statuses(
            rank0.call("push", checkpoint=str(checkpoints["p1"]), version="c1", **g)["calls"]
        ) == [200]
        assert [cached_tokens(server, checkpoints["p1"]) for _ in range(2)] == [0, 3 * BLOCK]


def test_a_moe_policy_pushed_under_transformers_own_names(
    server: str, rank0: Trainer, checkpoints: dict[str, Path]
) -> None:
    """A trainer on transformers 5 sends named_parameters(): experts fused, gate_up_proj [E, 2I, H]."""
    with group(rank0, [server]) as g:
        pushed = rank0.call("push", checkpoint=str(checkpoints["p1"]), names="module", version="fused", **g)
    assert set(statuses(pushed["calls"])) == {200}, pushed
    assert "model.layers.1.mlp.experts.gate_up_proj" in pushed["names"]
    check_reply(httpx.post(f"{server}/logprobs", json=BODY, timeout=60), BODY, eager(checkpoints["p1"]))


def test_a_tied_reference_with_its_head_left_out_or_sent(
    server: str, rank0: Trainer, checkpoints: dict[str, Path]
) -> None:
    body = {**BODY, "return_ref_logprobs": True}
    tie = {"lm_head.weight": ["model.embed_tokens.weight", 0.0]}
    untied = {"lm_head.weight": ["model.embed_tokens.weight", 0.5]}
    with group(rank0, [server]) as g:
        left_out = rank0.call(
            "push", checkpoint=str(checkpoints["r1"]), version="ref1", extra={"target": "reference"}, **g
        )
        assert set(statuses(left_out["calls"])) == {200}, left_out
        ref1 = score(server, return_ref_logprobs=True)
        sent = rank0.call(
            "push",
            checkpoint=str(checkpoints["r0"]),
            version="ref0",
            add=tie,
            extra={"target": "reference"},
            **g,
        )
        assert set(statuses(sent["calls"])) == {200}, sent
        ref0 = score(server, return_ref_logprobs=True)
        differ = rank0.call(
            "push",
            checkpoint=str(checkpoints["r1"]),
            version="bad",
            add=untied,
            extra={"target": "reference"},
            **g,
        )
        refused = differ["calls"][0][0]
        assert refused["status"] == 400
        assert "differ; the served reference ties them" in refused["body"]["message"]
        assert score(server, return_ref_logprobs=True)["ref_weights_version"] == "ref0"
    assert (ref1["ref_weights_version"], ref0["ref_weights_version"]) == ("ref1", "ref0")
    for got, model in ((ref1, eager(checkpoints["r1"])), (ref0, eager(checkpoints["r0"]))):
        want = expected(model, body).logprobs
        for g_row, w_row in zip(got["ref_logprobs"], want, strict=True):
            np.testing.assert_allclose(g_row, w_row, atol=TOLERANCE)


def test_a_critic_pushed_under_its_checkpoint_names(
    server: str, rank0: Trainer, checkpoints: dict[str, Path]
) -> None:
    """OpenRLHF's critic: the backbone under model.*, the head as value_head.weight."""
    with group(rank0, [server]) as g:
        pushed = rank0.call(
            "push", checkpoint=str(checkpoints["c1"]), version="crit1", extra={"target": "critic"}, **g
        )
    assert set(statuses(pushed["calls"])) == {200}, pushed
    got = score(server, return_values=True)
    assert got["critic_weights_version"] == "crit1"
    for row, n, values in zip(BODY["input_ids"], BODY["num_actions"], got["values"], strict=True):
        np.testing.assert_allclose(
            values, critics.expected_values(checkpoints["c1"], row)[-n:], atol=TOLERANCE
        )


def test_a_partial_version_committed_keeps_what_it_did_not_get(
    server: str, rank0: Trainer, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """Layer 1 and the head pushed, then continue_generation: those serve, the rest keeps its values;
    a reload while the version is pending answers 409."""
    start = load_file(str(checkpoints["p0"] / "model.safetensors"))
    new = load_file(str(checkpoints["p1"] / "model.safetensors"))
    only = sorted(n for n in new if n.startswith("model.layers.1.") or n == "lm_head.weight")
    with group(rank0, [server]) as g:
        assert statuses(
            rank0.call("push", checkpoint=str(checkpoints["p0"]), version="base", **g)["calls"]
        ) == [200]
        part = rank0.call("push", checkpoint=str(checkpoints["p1"]), version="part", only=only, **g)
        assert "is staged" in part["calls"][0][0]["body"]["message"]
        assert score(server)["weights_version"] == "base"
        reload = httpx.post(
            f"{server}/admin/weights", json={"path": str(checkpoints["p2"]), "version": "x"}, headers=AS_ADMIN
        )
        assert reload.status_code == 409
        assert "a push of the policy to 'part' is pending" in reload.json()["error"]["message"]
        assert httpx.post(f"{server}/continue_generation", json={}, headers=AS_ADMIN).status_code == 200
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    save_file(
        {n: (new[n] if n in only else t).contiguous() for n, t in start.items()},
        str(mixed / "model.safetensors"),
    )
    (mixed / "config.json").write_text((checkpoints["p0"] / "config.json").read_text())
    reply = httpx.post(f"{server}/logprobs", json=BODY, timeout=60)
    assert reply.json()["weights_version"] == "part"
    check_reply(reply, BODY, eager(mixed))


def test_metadata_that_does_not_fit_is_drained_then_refused(
    server: str, rank0: Trainer, checkpoints: dict[str, Path]
) -> None:
    """The trainer's broadcasts all complete (it would hang otherwise), the answer names the reason,
    nothing is staged, and the same group pushes on."""
    cases = [
        ({"names": ["model.nope.weight"], "dtypes": ["float32"], "shapes": [[4, 4]]}, [("float32", [4, 4])],
         "model.nope.weight: the served policy has no such tensor"),
        ({"names": ["model.norm.weight"], "dtypes": ["torch.float32"], "shapes": [[65]]}, [("float32", [65])],
         "model.norm.weight: shape [65], the served policy takes [64]"),
        ({"names": ["model.norm.weight"], "dtypes": ["int64"], "shapes": [[64]]}, [("int64", [64])],
         "model.norm.weight: dtype torch.int64 for a tensor served in torch.float32"),
        ({"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]],
          "weight_version": "not one"},  # refused before it is looked at: drained all the same
         [("float32", [64])], "weight_version 'not one' is not a version"),
        ({"names": ["model.norm.weight", "lm_head.weight"], "dtypes": ["float32", "float32"],
          "shapes": [[64], [96, 64]]}, [("float32", [64]), ("float32", [96, 64])], None),
    ]  # fmt: skip
    with group(rank0, [server]) as g:
        for body, send, reason in cases:
            replies = rank0.call(
                "raw", body={"group_name": "g", "weight_version": "raw", **body}, send=send, **g
            )["replies"]
            if reason is None:  # fits: a partial version, dropped by the next case's other version
                assert replies[0]["status"] == 200, replies
                continue
            assert (replies[0]["status"], replies[0]["body"]["success"]) == (400, False), replies
            assert reason in replies[0]["body"]["message"]
        misaligned = {
            "names": ["model.norm.weight", "lm_head.weight"], "dtypes": ["float16", "float32"],
            "shapes": [[3], [96, 64]], "load_format": "flattened_bucket", "group_name": "g",
            "weight_version": "m",
        }  # fmt: skip
        refused = rank0.call(
            "raw", body=misaligned, send=[("float16", [3]), ("float32", [96, 64])], flattened=True, **g
        )
        assert refused["replies"][0]["status"] == 400
        assert "do not start at a multiple of their dtype's size" in refused["replies"][0]["body"]["message"]
        after = rank0.call("push", checkpoint=str(checkpoints["p2"]), version="after", **g)
        assert statuses(after["calls"]) == [200]
    check_reply(httpx.post(f"{server}/logprobs", json=BODY, timeout=60), BODY, eager(checkpoints["p2"]))


@pytest.mark.slow
def test_a_trainer_killed_mid_push_leaves_the_last_version_serving(
    server: str, rank0: Trainer, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """A real trainer process, killed after 2 of a bucket's broadcasts: the server gives the push up
    (gloo sees the peer gone), tears the group down, serves what it served, and takes a new init."""
    before = score(server)
    with trainer(tmp_path / "dying.log") as dying:
        port = free_port()
        joined = dying.call(
            "init", urls=[server], rank_offsets=[1], port=port, world_size=2, group="dying", headers=AS_ADMIN
        )
        assert joined["replies"][0]["status"] == 200
        dying.send(
            "push", urls=[server], group="dying", headers=AS_ADMIN, checkpoint=str(checkpoints["p1"]),
            version="never", stop_after=2,
        )  # fmt: skip
        assert dying.read(timeout=60) == {"stalled": 2}
        dying.process.kill()
        killed = time.monotonic()
        given_up = empty_bucket(server, "dying")  # queued behind the stuck call (FIFO)
        elapsed = time.monotonic() - killed
    assert given_up.status_code == 400
    assert elapsed < PUSH_TIMEOUT_S + 10, elapsed
    after = score(server)
    assert after["weights_version"] == before["weights_version"]
    assert after["logprobs"] == before["logprobs"]
    with group(rank0, [server]) as g:  # a new init, and a push over it
        assert statuses(
            rank0.call("push", checkpoint=str(checkpoints["p1"]), version="again", **g)["calls"]
        ) == [200]
    check_reply(httpx.post(f"{server}/logprobs", json=BODY, timeout=60), BODY, eager(checkpoints["p1"]))


@pytest.mark.slow
def test_a_stalled_trainer_is_given_up_after_the_timeout(
    server: str, rank0: Trainer, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """A trainer alive but silent mid-bucket: the push fails within weight_push_timeout_s (and the
    grace), the group is torn down, the served weights stay and a new group is taken."""
    before = score(server)
    with trainer(tmp_path / "stalled.log") as stalled:
        joined = stalled.call(
            "init",
            urls=[server],
            rank_offsets=[1],
            port=free_port(),
            world_size=2,
            group="stalled",
            headers=AS_ADMIN,
        )
        assert joined["replies"][0]["status"] == 200
        stalled.send(
            "push", urls=[server], group="stalled", headers=AS_ADMIN, checkpoint=str(checkpoints["p2"]),
            version="never", stop_after=1,
        )  # fmt: skip
        assert stalled.read(timeout=60) == {"stalled": 1}
        started = time.monotonic()
        given_up = empty_bucket(server, "stalled")
        elapsed = time.monotonic() - started
    assert given_up.status_code == 400
    assert elapsed < PUSH_TIMEOUT_S + 10, elapsed
    assert score(server)["logprobs"] == before["logprobs"]
    with group(rank0, [server], name="after-stall") as g:
        assert statuses(
            rank0.call("push", checkpoint=str(checkpoints["p2"]), version="p2", **g)["calls"]
        ) == [200]


@pytest.mark.slow
def test_two_replicas_in_one_group(
    server: str, rank0: Trainer, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """slime's layout: one group of the trainer and every replica (ranks 1 and 2 of 3)."""
    port = free_port()
    with serving(serve_command(port, checkpoints["p0"]), port, tmp_path / "second.log") as second:
        with group(rank0, [server, second]) as g:
            pushed = rank0.call(
                "push", checkpoint=str(checkpoints["p1"]), version="both", buckets=2, style="slime", **g
            )
        assert set(statuses(pushed["calls"])) == {200}, pushed
        for url in (server, second):
            reply = httpx.post(f"{url}/logprobs", json=BODY, timeout=60)
            assert reply.json()["weights_version"] == "both"
            check_reply(reply, BODY, eager(checkpoints["p1"]))


def stage_names(checkpoint: Path) -> tuple[list[str], list[str]]:
    """A two-stage pipeline's tensors: the embeddings and layer 0, then layer 1, the norm and the head."""
    names = list(load_file(str(next(checkpoint.glob("*.safetensors")))))
    first = [n for n in names if n.startswith(("model.embed_tokens.", "model.layers.0."))]
    return first, [n for n in names if n not in first]


def test_pipeline_stages_push_one_version_over_a_group_each(
    server: str, rank0: Trainer, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """slime with two pipeline stages: each stage a trainer process of its own, over a group of its
    own ("slime-pp_0", "slime-pp_1"), pushing its layers at the same time under one version; the
    version serves once both stages' tensors are in. Then a stage killed mid-push: the version both
    stages sent to is dropped, and the other stage's group goes on."""
    first, second = stage_names(checkpoints["p1"])
    with trainer(tmp_path / "stage1.log") as stage1, group(rank0, [server], name="slime-pp_0") as g0:
        joined = stage1.call(
            "init", urls=[server], rank_offsets=[1], port=free_port(), world_size=2, group="slime-pp_1",
            headers=AS_ADMIN,
        )  # fmt: skip
        assert joined["replies"][0]["status"] == 200
        g1 = {**g0, "group": "slime-pp_1"}
        push: dict[str, Any] = {"checkpoint": str(checkpoints["p1"]), "version": "pp", "buckets": 2}
        rank0.send("push", only=first, **push, **g0)
        stage1.send("push", only=second, **push, **g1)
        pushed = [rank0.read(timeout=120), stage1.read(timeout=120)]
        assert [statuses(p["calls"]) for p in pushed] == [[200, 200], [200, 200]], pushed
        reply = httpx.post(f"{server}/logprobs", json=BODY, timeout=60)
        check_reply(reply, BODY, eager(checkpoints["p1"]))
        assert reply.json()["weights_version"] == "pp"

        lost = {**push, "version": "pp-lost"}
        stage1.send("push", only=second, stop_after=1, **lost, **g1)
        assert stage1.read(timeout=60) == {"stalled": 1}
        staged = rank0.call("push", only=first, **lost, **g0)
        assert statuses(staged["calls"]) == [200, 200]
        assert "Weight version pp-lost is staged" in staged["calls"][-1][0]["body"]["message"]
        stage1.process.kill()
        assert empty_bucket(server, "slime-pp_1").status_code == 400  # after the killed stage's call
        ended = httpx.post(f"{server}/continue_generation", json={}, headers=AS_ADMIN, timeout=60)
        assert ended.status_code == 200
        after = score(server)
        assert after["weights_version"] == "pp"  # nothing of pp-lost serves
        assert after["logprobs"] == reply.json()["logprobs"]
        assert empty_bucket(server, "slime-pp_0").status_code == 200  # stage 0's group goes on


def empty_bucket(url: str, name: str) -> httpx.Response:
    """A bucket of no tensors for group `name`: answered once the calls before it are."""
    body = {"names": [], "dtypes": [], "shapes": [], "group_name": name}
    return httpx.post(f"{url}/update_weights_from_distributed", json=body, headers=AS_ADMIN, timeout=120)


@pytest.mark.slow
def test_a_tensor_parallel_replica_joins_as_its_ranks(
    rank0: Trainer, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """A replica of 2 ranks (gloo) joins as ranks 1 and 2 of 3; each rank receives every tensor whole
    and keeps its slice (vocabulary rows, heads, MLP columns), the tied head included; a version
    applied on every rank drops what rank 0's prefix cache kept of the old one."""

    port = free_port()
    command = serve_command(port, checkpoints["r0"], "--tensor-parallel-size", "2")
    with serving(command, port, tmp_path / "tp.log") as url:
        assert httpx.get(f"{url}/server_info", headers=AS_ADMIN).json()["tp_size"] == 2
        refused = httpx.post(
            f"{url}/init_weights_update_group",
            json={
                "master_address": "127.0.0.1",
                "master_port": free_port(),
                "rank_offset": 1,
                "world_size": 2,
            },
            headers=AS_ADMIN,
        )
        assert refused.status_code == 400  # ranks 1..2 do not fit a world of 2
        with group(rank0, [url], ranks=[2]) as g:
            per_tensor = rank0.call("push", checkpoint=str(checkpoints["r1"]), version="tp1", buckets=2, **g)
            assert set(statuses(per_tensor["calls"])) == {200}, per_tensor
            check_reply(httpx.post(f"{url}/logprobs", json=BODY, timeout=60), BODY, eager(checkpoints["r1"]))
            assert [cached_tokens(url, checkpoints["r1"]) for _ in range(2)] == [0, 3 * BLOCK]
            flat = rank0.call("push", checkpoint=str(checkpoints["r0"]), version="tp0", flattened=True, **g)
            assert set(statuses(flat["calls"])) == {200}, flat
            assert cached_tokens(url, checkpoints["r0"]) == 0
            drained = rank0.call(
                "raw", body={"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[65]],
                             "group_name": "g", "weight_version": "x"}, send=[("float32", [65])], **g,
            )  # fmt: skip
            assert drained["replies"][0]["status"] == 400  # every rank drained it, every rank refused it
            assert "shape [65], the served policy takes [64]" in drained["replies"][0]["body"]["message"]
        reply = httpx.post(f"{url}/logprobs", json=BODY, timeout=60)
        assert reply.json()["weights_version"] == "tp0"
        check_reply(reply, BODY, eager(checkpoints["r0"]))
