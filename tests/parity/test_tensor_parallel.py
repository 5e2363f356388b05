"""Tensor parallel over 2 ranks: the same scores as one process and as the per-sequence
reference, with a critic and a reference model, for every layout; a hot reload reaches both ranks;
what cannot be sharded is refused before any process starts.

Over gloo the ranks share the host, or in the GPU parity run (LOGPROBD_TEST_DEVICE=cuda) one GPU,
since gloo all-reduces CUDA tensors: the sharded kernels run on a GPU without a multi-GPU host. The
same cases run over NCCL, a GPU per rank (the production path), where the host has two GPUs."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient

from service.core.cache_plan import BLOCK
from service.engine.tensor_parallel import ranks
from tests.support import critics, models
from tests.support.device import DEVICE, TOLERANCE, settings_for
from tests.support.reference import check_reply, expected
from tests.support.requests import LAYOUTS, make
from tests.support.servers import running

pytestmark = pytest.mark.parity  # make test-gpu runs it again on cuda in each dtype

ADMIN = "admin-key"
AS_ADMIN = {"Authorization": f"Bearer {ADMIN}"}


@pytest.fixture(scope="module")
def critic_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return critics.save("trl", tmp_path_factory.mktemp("tp-critic") / "trl")


def _settings(model_dirs: dict[str, Path], ref_dir: Path, critic_dir: Path, tp: int, collectives: str) -> Any:
    return settings_for(
        model_dirs["qwen2"],
        critic=critic_dir,
        ref_model=ref_dir,
        max_batch_tokens=128,  # several micro-batches a request, and chunked sequences
        share_min_tokens=8,  # a group's prompt computed once (a Forest on every rank)
        admin_api_keys=ADMIN,
        tensor_parallel_size=tp,
        tensor_parallel_collectives=collectives,
        device="cuda" if collectives == "nccl" else DEVICE,  # gloo: two ranks may share one GPU
    )


@pytest.fixture(scope="module", params=["gloo", pytest.param("nccl", marks=pytest.mark.two_gpus)])
def pair(
    request: pytest.FixtureRequest, model_dirs: dict[str, Path], ref_dir: Path, critic_dir: Path
) -> Iterator[tuple[TestClient, TestClient]]:
    """The qwen2 policy with a reference and a critic: over 2 ranks (over gloo, then NCCL), and in
    one process."""
    collectives: str = request.param
    with (
        running(_settings(model_dirs, ref_dir, critic_dir, 2, collectives)) as sharded,
        running(_settings(model_dirs, ref_dir, critic_dir, 1, collectives)) as single,
    ):
        yield sharded, single


def _close(got: list[list[float]] | None, want: list[list[float]] | None) -> None:
    assert got is not None
    assert want is not None
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_two_ranks_score_as_one_and_as_the_reference(
    pair: tuple[TestClient, TestClient], layout: str, reference_models: dict[str, Any], ref_model: Any
) -> None:
    sharded, single = pair
    rng = random.Random(f"tp-{layout}")
    request = make(layout, rng, models.VOCAB, rows=5, max_len=40)
    while not sum(map(sum, expected(reference_models["qwen2"], request).action_mask)):
        request = make(layout, rng, models.VOCAB, rows=5, max_len=40)  # one with actions to compare
    request.update(return_values=True, return_ref_logprobs=True, return_entropy=True)
    reply = sharded.post("/logprobs", json=request)
    check_reply(reply, request, reference_models["qwen2"])
    got, want = reply.json(), single.post("/logprobs", json=request).json()
    _close(got["ref_logprobs"], expected(ref_model, request).logprobs)
    for key in ("logprobs", "entropy", "ref_logprobs", "values"):
        _close(got[key], want[key])


def test_chunked_and_shared_sequences(
    pair: tuple[TestClient, TestClient], reference_models: dict[str, Any]
) -> None:
    """A 200-token sequence scored in two chunks (each rank keeps its heads' keys and values between
    them), beside a GRPO group whose prompt is computed once."""
    rng = random.Random("tp-long")
    prompt = [rng.randrange(models.VOCAB) for _ in range(20)]
    rows = [prompt + [rng.randrange(models.VOCAB) for _ in range(12)] for _ in range(4)]
    rows.append([rng.randrange(models.VOCAB) for _ in range(200)])
    request = {"input_ids": rows, "num_actions": [12, 12, 12, 12, 150], "return_entropy": True}
    sharded, single = pair
    reply = sharded.post("/logprobs", json=request)
    check_reply(reply, request, reference_models["qwen2"])
    assert reply.json()["usage"]["computed_tokens"] < sum(map(len, rows))  # the prompt was shared
    _close(reply.json()["logprobs"], single.post("/logprobs", json=request).json()["logprobs"])


def test_the_prefix_cache_serves_every_rank_alike(
    pair: tuple[TestClient, TestClient], reference_models: dict[str, Any], ref_model: Any
) -> None:
    """GRPO groups split over requests posted in turn, then a long row (in chunks of the 128-token
    budget) that begins with one of their sequences: rank 0's plan names the pool slots, every rank
    reads and writes its own heads' keys there; the same scores and cached tokens as one process."""
    rng = random.Random("tp-cache")
    prompts = [[rng.randrange(3, models.VOCAB) for _ in range(3 * BLOCK + 5)] for _ in range(3)]
    samples = [
        [[3 + s, *(rng.randrange(3, models.VOCAB) for _ in range(6))] for s in range(3)] for _ in prompts
    ]
    requests: list[dict[str, Any]] = [
        {"input_ids": [p + r[s] for p, r in zip(prompts, samples, strict=True)], "num_actions": 7}
        for s in range(3)
    ]
    requests[2].update(return_ref_logprobs=True, return_values=True)
    first = requests[0]["input_ids"][0]
    long = first + [rng.randrange(3, models.VOCAB) for _ in range(180)]  # 240 of 256 positions
    requests.append({"input_ids": [long], "num_actions": 150, "return_entropy": True})
    sharded, single = pair
    for request in requests:
        reply = sharded.post("/logprobs", json=request)
        check_reply(reply, request, reference_models["qwen2"])
        got, want = reply.json(), single.post("/logprobs", json=request).json()
        assert got["usage"] == want["usage"]
        for key in ("logprobs", "entropy", "ref_logprobs", "values"):
            if want[key] is not None:
                _close(got[key], want[key])
        if request.get("return_ref_logprobs"):
            _close(got["ref_logprobs"], expected(ref_model, request).logprobs)
    cached = [sharded.post("/logprobs", json=r).json()["usage"]["cached_tokens"] for r in requests[1:2]]
    assert cached == [3 * (3 * BLOCK)]  # posted again: the prompts' blocks (their own past them too)


def test_info_reports_the_ranks(pair: tuple[TestClient, TestClient]) -> None:
    sharded, single = pair
    assert sharded.get("/info").json()["tensor_parallel_size"] == 2
    assert single.get("/info").json()["tensor_parallel_size"] == 1
    assert sharded.get("/info").json()["vocab_size"] == models.VOCAB  # the whole vocabulary, not a shard


def test_reload_reaches_every_rank(
    pair: tuple[TestClient, TestClient], weight_versions: dict[str, Path], version_models: dict[str, Any]
) -> None:
    """Run last in the module: the sharded server serves v11 from here on."""
    sharded, _ = pair
    body = {
        "input_ids": [[5, 6, 7, 8, 9, 40, 41], [10, 11, 12]],
        "num_actions": [5, 2],
        "return_entropy": True,
    }
    refused = sharded.post(
        "/admin/weights", json={"path": str(weight_versions["v11"]) + "-nope", "version": "x"}
    )
    assert refused.status_code in (400, 401, 403, 422)  # no admin key: not even looked at
    status = sharded.post(
        "/admin/weights", json={"path": str(weight_versions["v11"]), "version": "v11"}, headers=AS_ADMIN
    )
    assert status.status_code == 200, status.text
    assert status.json()["state"] == "done"
    reply = sharded.post("/logprobs", json=body)
    assert reply.json()["weights_version"] == "v11"
    check_reply(reply, body, version_models["v11"])  # each rank's half of every GEMM is v11's


@pytest.mark.parametrize(
    ("name", "error"),
    [("gemma2", "fused decoder"), ("phi3", "fused decoder")],
)
def test_what_cannot_be_sharded_is_refused_at_once(
    model_dirs: dict[str, Path], name: str, error: str
) -> None:
    config = settings_for(model_dirs[name], tensor_parallel_size=2, tensor_parallel_collectives="gloo")
    with pytest.raises(ValueError, match=error):
        ranks.load(config.engine_config())


@pytest.mark.parametrize(
    ("overrides", "error"),
    [
        ({"tensor_parallel_size": 3}, "does not divide the 4 query heads"),
        ({"tensor_parallel_size": 2, "batch_invariant": True}, "batch_invariant"),
        ({"tensor_parallel_size": 2, "decoder": "transformers"}, "fused decoder"),
        (
            {"tensor_parallel_size": 2, "device": "cpu", "tensor_parallel_collectives": "nccl"},
            "nccl runs on GPUs",
        ),
    ],
)
def test_settings_that_cannot_run_are_refused(
    model_dirs: dict[str, Path], overrides: dict[str, Any], error: str
) -> None:
    overrides = {"tensor_parallel_collectives": "gloo", **overrides}  # ranks may share a GPU
    with pytest.raises(ValueError, match=error):
        ranks.load(settings_for(model_dirs["qwen2"], **overrides).engine_config())


def test_the_demo_model_is_not_sharded() -> None:
    with pytest.raises(ValueError, match="demo model"):
        ranks.load(settings_for(None, tensor_parallel_size=2).engine_config())
