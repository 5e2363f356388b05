"""The client's weight push (service/client/push.py) from this process, rank 0 over gloo, to real replica
processes (tests/support/pushing.py): after each push every replica serves the pushed weights, whose
scores are the reference's of the very tensors pushed (tests/support/reference.py: the model's own forward,
float64 softmax); one replica or a fleet of two in one group; a module, a state dict of mixed dtypes,
a lazy iterator (holding a bucket or two, never the model); the reference and critic targets; and the
failures, each naming its replica, after which the replicas serve what they served and the next push
joins a new group."""

from __future__ import annotations

import copy
import re
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from service.client import LogprobdConnectionError, LogprobdError, WeightPusher, push_weights
from tests.support import critics, models, pushing
from tests.support.device import TOLERANCE, eager
from tests.support.pushing import ADMIN, BODY, PUSH_TIMEOUT_S, Replicas, score, version
from tests.support.reference import check_reply, expected
from tests.support.servers import free_port

KIB = 1 << 10


def pusher(*urls: str, **options: Any) -> WeightPusher:
    options = {"bucket_bytes": 64 * KIB, **options}
    return WeightPusher(list(urls), admin_key=ADMIN, backend="gloo", **options)


def policy(seed: int) -> Any:
    return models.build("qwen3_moe", seed=seed)


@pytest.mark.parametrize("load_format", ["flattened_bucket", None])
def test_a_module_pushed_to_one_replica_scores_as_its_weights(
    push_replicas: Replicas, load_format: str | None
) -> None:
    model = policy(seed=11 if load_format else 12)
    params = dict(model.named_parameters())
    with pusher(push_replicas.main, load_format=load_format) as p:
        result = p.push(model, version=f"module-{load_format}")
        assert p.rank_offsets == (1,)
    assert result.serving
    assert (result.version, result.target, result.replicas) == (
        f"module-{load_format}", "policy", (push_replicas.main,),
    )  # fmt: skip
    assert result.tensors == len(params)
    assert result.nbytes == sum(t.numel() * t.element_size() for t in params.values())
    assert result.buckets > 2  # 64 KiB buckets of a ~440 KiB model
    reply = score(push_replicas.main)
    assert reply.json()["weights_version"] == f"module-{load_format}"
    check_reply(reply, BODY, model)


def test_a_fleet_is_one_group_and_every_replica_serves_each_step(push_replicas: Replicas) -> None:
    """Ranks 1 and 2 of 3; two steps over the same group; both replicas score alike."""
    urls = (push_replicas.main, push_replicas.second)
    with pusher(*urls) as p:
        for step in (1, 2):
            model = policy(seed=20 + step)
            result = p.push(model, version=f"fleet-{step}")
            assert (result.serving, result.replicas, p.rank_offsets) == (True, urls, (1, 2))
            replies = [score(url, weights_version=f"fleet-{step}") for url in urls]  # pinned
            for reply in replies:
                check_reply(reply, BODY, model)
            assert replies[0].json()["logprobs"] == replies[1].json()["logprobs"]
    assert [version(url) for url in urls] == ["fleet-2", "fleet-2"]


@pytest.mark.parametrize("load_format", ["flattened_bucket", None])
def test_an_iterator_is_pushed_as_it_comes_holding_a_bucket_or_two(
    push_replicas: Replicas, load_format: str | None, tmp_path: Path
) -> None:
    """A sharded trainer gathers tensor by tensor (here a checkpoint's, experts one by one): the pusher
    holds the bucket under way and the one it fills, never the model."""
    saved = models.save("qwen3_moe", tmp_path / "policy", seed=31)
    state = load_file(str(saved / "model.safetensors"))
    alive: dict[int, int] = {}
    most = 0

    def gathered() -> Iterator[tuple[str, torch.Tensor]]:
        nonlocal most
        for name, tensor in state.items():
            full = tensor.clone()  # what a gather returns: a tensor of its own
            alive[id(full)] = full.numel() * full.element_size()
            weakref.finalize(full, alive.pop, id(full))
            most = max(most, sum(alive.values()))
            yield name, full

    bucket = 16 * KIB
    with pusher(push_replicas.main, load_format=load_format, bucket_bytes=bucket) as p:
        result = p.push(gathered(), version=f"iterated-{load_format}")
    largest = max(t.numel() * t.element_size() for t in state.values())
    assert most <= 2 * bucket + largest, (most, bucket, largest)
    assert 4 * most < result.nbytes == sum(t.numel() * t.element_size() for t in state.values())
    check_reply(score(push_replicas.main), BODY, eager(saved))


def test_mixed_dtypes_share_flattened_buckets(push_replicas: Replicas) -> None:
    """float32, bfloat16 and float16 tensors in the same buckets, in the order given (the pusher orders
    each flattened bucket so that every entry is aligned); the replica serves them in float32."""
    model = policy(seed=41)
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    mixed = {name: t.detach().to(dtypes[i % 3]) for i, (name, t) in enumerate(model.named_parameters())}
    rounded = copy.deepcopy(model)
    rounded.load_state_dict({name: t.float() for name, t in mixed.items()}, strict=False)
    with pusher(push_replicas.main, bucket_bytes=128 * KIB) as p:
        result = p.push(mixed, version="mixed")
    assert result.nbytes == sum(t.numel() * t.element_size() for t in mixed.values())
    check_reply(score(push_replicas.main), BODY, rounded)


def test_the_reference_and_the_critic_are_pushed_under_their_names(
    push_replicas: Replicas, tmp_path: Path
) -> None:
    """A tied reference model (its head is the embedding: named_parameters leaves it out) and an
    OpenRLHF critic's state dict (backbone under model.*, value_head.weight); the policy stays."""
    main = push_replicas.main
    before = version(main)
    reference = models.build("qwen2", seed=8)
    critic_dir = critics.save("openrlhf", tmp_path / "critic", seed=4)
    with pusher(main) as p:
        assert p.push(reference, version="ref-8", target="reference").serving
        assert p.push(
            load_file(str(critic_dir / "model.safetensors")), version="critic-4", target="critic"
        ).serving
    body = {**BODY, "return_ref_logprobs": True, "return_values": True}
    got = httpx.post(f"{main}/logprobs", json=body, timeout=60).json()
    assert (got["weights_version"], got["ref_weights_version"], got["critic_weights_version"]) == (
        before, "ref-8", "critic-4",
    )  # fmt: skip
    for got_row, want_row in zip(got["ref_logprobs"], expected(reference, body).logprobs, strict=True):
        np.testing.assert_allclose(got_row, want_row, atol=TOLERANCE)
    for row, n, values in zip(BODY["input_ids"], BODY["num_actions"], got["values"], strict=True):
        np.testing.assert_allclose(values, critics.expected_values(critic_dir, row)[-n:], atol=TOLERANCE)


def test_one_push_with_a_group_of_its_own(push_replicas: Replicas) -> None:
    model = policy(seed=51)
    result = push_weights(push_replicas.main, model, version="one-shot", admin_key=ADMIN, backend="gloo")
    assert result.serving
    check_reply(score(push_replicas.main), BODY, model)


def test_pipeline_stages_each_push_their_layers_over_a_group_of_their_own(push_replicas: Replicas) -> None:
    """A trainer of two pipeline stages: each stage's first rank pushes its own layers with a pusher
    of its own (a group each), at the same time, uncommitted; the version serves once both are in."""
    model = policy(seed=61)
    params = list(model.named_parameters())
    head = ("model.embed_tokens.", "model.layers.0.")  # stage 0's; stage 1: layer 1, the norm, the head
    stages = [
        [(n, t) for n, t in params if n.startswith(head)],
        [(n, t) for n, t in params if not n.startswith(head)],
    ]
    results: dict[int, Any] = {}

    def stage(i: int) -> None:
        with pusher(push_replicas.main, group_name=f"logprobd-pp_{i}") as p:
            results[i] = p.push(stages[i], version="stages", commit=False)

    threads = [threading.Thread(target=stage, args=(i,)) for i in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert sorted(results) == [0, 1]
    assert sum(results[i].tensors for i in (0, 1)) == len(params)
    assert any(results[i].serving for i in (0, 1))  # the stage that completed it saw it serve
    reply = score(push_replicas.main)
    assert reply.json()["weights_version"] == "stages"
    check_reply(reply, BODY, model)


def test_a_wrong_admin_key_is_named(push_replicas: Replicas) -> None:
    with pytest.raises(LogprobdError) as failed, WeightPusher(push_replicas.main, admin_key="wrong") as p:
        p.push(policy(seed=0), version="never")
    assert (failed.value.status, failed.value.type) == (401, "unauthorized")
    assert push_replicas.main in str(failed.value)
    assert list(failed.value.replicas) == [push_replicas.main]


def test_a_replica_that_is_down_is_named_and_nothing_is_pushed(push_replicas: Replicas) -> None:
    down = f"http://127.0.0.1:{free_port()}"
    before = version(push_replicas.main)
    with pytest.raises(LogprobdConnectionError) as failed, pusher(push_replicas.main, down) as p:
        p.push(policy(seed=0), version="never")
    assert failed.value.status is None
    assert list(failed.value.replicas) == [down]
    assert down in str(failed.value)
    assert version(push_replicas.main) == before


def test_a_target_a_replica_lacks_is_refused_before_anything_is_sent(push_replicas: Replicas) -> None:
    state = load_file(str(push_replicas.checkpoints["critic"] / "model.safetensors"))
    urls = (push_replicas.main, push_replicas.second)
    with pytest.raises(LogprobdError, match="no critic model on") as failed, pusher(*urls) as p:
        p.push(state, version="never", target="critic")
    assert push_replicas.second in str(failed.value)
    assert push_replicas.main not in str(failed.value)


def test_a_refused_bucket_surfaces_the_replicas_reason_and_the_last_version_serves(
    push_replicas: Replicas,
) -> None:
    """A tensor of the wrong shape halfway: the replica drains the bucket, then refuses it; the push
    raises its message, the group is torn down (the partial version dropped), the replica serves what
    it served, and the same pusher's next push joins again."""
    main = push_replicas.main
    before, scores_before = version(main), score(main).json()["logprobs"]
    model = policy(seed=61)
    state = {name: t.detach() for name, t in model.named_parameters()}
    names = list(state)
    bad = names[len(names) // 2]
    broken = {**state, bad: torch.zeros(*state[bad].shape[:-1], state[bad].shape[-1] + 1)}
    with pusher(main) as p:
        with pytest.raises(LogprobdError) as failed:
            p.push(broken, version="broken")
        assert not p.connected
        assert version(main) == before
        assert score(main).json()["logprobs"] == scores_before
        assert p.push(model, version="after-refusal").serving
    error = failed.value
    assert (error.status, error.type, list(error.replicas)) == (400, "weight_push_failed", [main])
    assert f"{bad}: shape {list(broken[bad].shape)}, the served policy takes {list(state[bad].shape)}" in str(
        error
    )
    check_reply(score(main), BODY, model)


@pytest.mark.slow
def test_a_replica_that_left_the_group_fails_the_push_not_the_trainer(push_replicas: Replicas) -> None:
    """A replica refuses a bucket before its broadcasts (it no longer has the group), which therefore
    never complete: the push raises naming it once the other replica gave up its receive (the
    replicas' --weight-push-timeout-s, well before the pusher's own timeout) and left the group, which
    keeps its version; the next push joins both again."""
    main, second = push_replicas.main, push_replicas.second
    with pusher(main, second, timeout_s=120) as p:
        assert p.push(policy(seed=71), version="left-0").serving
        left = httpx.post(
            f"{second}/destroy_weights_update_group",
            json={"group_name": p.group_name},
            headers={"Authorization": f"Bearer {ADMIN}"},
        )
        assert left.status_code == 200, left.text
        started = time.monotonic()
        with pytest.raises(LogprobdError) as failed:
            p.push(policy(seed=72), version="left-1")
        elapsed = time.monotonic() - started
        assert [version(main), version(second)] == ["left-0", "left-0"]
        model = policy(seed=73)
        assert p.push(model, version="left-2").serving
    assert elapsed < PUSH_TIMEOUT_S + 15, elapsed
    assert second in failed.value.replicas, str(failed.value)
    assert "Please call `init_weights_update_group` first" in failed.value.replicas[second]
    for url in (main, second):
        check_reply(score(url), BODY, model)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs: the trainer's and the replica's")
def test_nccl_from_this_gpu_to_a_replica_on_another(tmp_path: Path) -> None:
    """The NCCL path end to end: tensors from cuda:0 (this process) to a replica on the second GPU,
    flattened and per tensor; a bucket refused (the group's communicator then aborted and destroyed
    on both sides) and a push over a new group."""
    saved = models.save("qwen3_moe", tmp_path / "policy", seed=0)
    port = free_port()
    argv = pushing.command(port, saved, "--dtype", "float32", device="cuda")
    torch.cuda.set_device(0)
    with pushing.started(tmp_path, {port: argv}, CUDA_VISIBLE_DEVICES="1") as [url]:
        with WeightPusher(url, admin_key=ADMIN, backend="nccl", bucket_bytes=64 * KIB) as p:
            for load_format in ("flattened_bucket", None):
                p.load_format = load_format
                model = policy(seed=101 if load_format else 102).cuda()
                assert p.push(model, version=f"nccl-{load_format}").serving
                check_reply(score(url), BODY, model)
            state = {name: t.detach() for name, t in model.named_parameters()}
            state["model.norm.weight"] = torch.ones(models.COMMON["hidden_size"] + 1, device="cuda")
            with pytest.raises(LogprobdError, match=re.escape("model.norm.weight: shape [65]")):
                p.push(state, version="refused")
            assert version(url) == "nccl-None"
            model = policy(seed=103).cuda()
            assert p.push(model, version="nccl-again", dtype=torch.bfloat16).serving
        rounded = copy.deepcopy(model)
        rounded.load_state_dict({n: t.to(torch.bfloat16).float() for n, t in model.state_dict().items()})
        check_reply(score(url), BODY, rounded)
