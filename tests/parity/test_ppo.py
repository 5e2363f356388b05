"""One request, everything PPO needs: logprobs, ref_logprobs, kl, values and rollout mismatch,
each against an independent reference, for every critic format and every layout."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient

from service.engine.loading.critic import find_value_head
from tests.support import critics, models
from tests.support.device import DTYPE, TOLERANCE, settings_for
from tests.support.reference import expected, row_tokens_and_window
from tests.support.requests import LAYOUTS, make
from tests.support.servers import running

pytestmark = pytest.mark.parity  # make test-gpu runs it again on cuda in each dtype


@pytest.fixture(scope="module", params=critics.FORMATS)
def ppo(
    request: pytest.FixtureRequest,
    model_dirs: dict[str, Path],
    ref_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Path, TestClient]]:
    critic_dir = critics.save(request.param, tmp_path_factory.mktemp("critic") / request.param)
    settings = settings_for(model_dirs["qwen2"], critic=critic_dir, ref_model=ref_dir, max_batch_tokens=64)
    with running(settings) as client:
        yield critic_dir, client


def _kl(logp: float, ref: float, estimator: str) -> float:
    r = logp - ref
    return {"k1": r, "k2": 0.5 * r * r, "k3": math.expm1(-r) + r}[estimator]


def _close(
    got: list[list[float]], want: list[list[float]], tol: float = TOLERANCE, rtol: float = 0.0
) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, atol=tol, rtol=rtol)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_one_request_returns_everything(
    ppo: tuple[Path, TestClient], layout: str, reference_models: dict[str, Any], ref_model: Any
) -> None:
    critic_dir, client = ppo
    rng = random.Random(f"ppo-{critic_dir.name}-{layout}")
    request = make(layout, rng, models.VOCAB, rows=4)
    policy = expected(reference_models["qwen2"], request)
    reference = expected(ref_model, request)
    estimator = rng.choice(["k1", "k2", "k3"])
    # what an inference engine might have reported: the true scores plus noise, junk off the actions
    rollout = [
        [lp + rng.gauss(0, 0.5) if m else rng.uniform(-9, 0) for lp, m in zip(row, mask, strict=True)]
        for row, mask in zip(policy.logprobs, policy.action_mask, strict=True)
    ]
    request.update(
        return_values=True, return_ref_logprobs=True, kl_estimator=estimator, rollout_logprobs=rollout
    )
    response = client.post("/logprobs", json=request)
    assert response.status_code == 200, response.text
    body = response.json()

    assert body["action_mask"] == policy.action_mask
    _close(body["logprobs"], policy.logprobs)
    _close(body["ref_logprobs"], reference.logprobs)

    def kl_rows(logprobs: list[list[float]], ref: list[list[float]]) -> list[list[float]]:
        return [
            [_kl(lp, rf, estimator) if m else 0.0 for lp, rf, m in zip(a, b, c, strict=True)]
            for a, b, c in zip(logprobs, ref, policy.action_mask, strict=True)
        ]

    # the estimator itself, on the float32 numbers it returned (k3 can reach hundreds in bf16)
    _close(body["kl"], kl_rows(body["logprobs"], body["ref_logprobs"]), tol=1e-4, rtol=1e-5)
    if DTYPE == "float32":  # and, in float32, against the independent reference
        _close(body["kl"], kl_rows(policy.logprobs, reference.logprobs), tol=1e-3)

    values_want = []
    for i, mask in enumerate(policy.action_mask):
        tokens, window = row_tokens_and_window(request, i)
        per_position = critics.expected_values(critic_dir, tokens)  # index t-1 -> action t
        values_want.append(
            [per_position[p - 1] if m and p is not None else 0.0 for p, m in zip(window, mask, strict=True)]
        )
    _close(body["values"], values_want)

    # the statistics of the scores this response returned (checked above) against the rollout's
    d = [lp - ro for row_lp, row_ro, mask in zip(body["logprobs"], rollout, policy.action_mask, strict=True)
         for lp, ro, m in zip(row_lp, row_ro, mask, strict=True) if m]  # fmt: skip
    stats = body["rollout"]
    assert stats["tokens"] == len(d)
    if d:
        assert stats["mean_abs_diff"] == pytest.approx(np.mean(np.abs(d)), abs=1e-4)
        assert stats["max_abs_diff"] == pytest.approx(np.max(np.abs(d)), abs=1e-4)
        assert stats["mean_kl_k3"] == pytest.approx(np.mean([math.expm1(x) - x for x in d]), abs=1e-3)
        outside = np.mean([not (0.5 <= math.exp(x) <= 2.0) for x in d])
        assert stats["ratio_outside_fraction"] == pytest.approx(outside, abs=1e-9)


def test_info_lists_every_model_and_metrics_show_mismatch(ppo: tuple[Path, TestClient]) -> None:
    critic_dir, client = ppo
    info = client.get("/info").json()
    roles = [m["role"] for m in info["models"]]
    assert roles == ["policy", "reference", "critic"]
    assert all(m["memory_bytes"] > 0 and m["parameters"] > 0 for m in info["models"])
    assert critic_dir.name in info["models"][2]["name"]
    client.post(
        "/logprobs",
        json={"input_ids": [[1, 2, 3, 4]], "num_actions": 2, "rollout_logprobs": [[-1.0, -2.0]]},
    )
    metrics = client.get("/metrics").text
    for name in (
        "rollout_abs_diff",
        "rollout_max_abs_diff",
        "rollout_kl_k3",
        "rollout_ratio_outside_fraction",
    ):
        assert f"logprobd_{name}_count" in metrics


def test_values_and_ref_need_their_models(model_dirs: dict[str, Path]) -> None:
    with running(settings_for(model_dirs["qwen2"])) as client:
        for field in ("return_values", "return_ref_logprobs"):
            r = client.post("/logprobs", json={"input_ids": [[1, 2, 3]], "num_actions": 1, field: True})
            assert r.status_code == 422
            assert r.json()["error"]["field"] == field
        r = client.post(
            "/logprobs", json={"input_ids": [[1, 2, 3]], "num_actions": 1, "rollout_logprobs": [[0.1, 0.2]]}
        )
        assert r.status_code == 422
        assert r.json()["error"]["field"] == "rollout_logprobs"
        assert r.json()["error"]["row"] == 0


def test_checkpoint_without_a_value_head_is_refused(tmp_path: Path) -> None:
    path = models.save("qwen2", tmp_path / "plain")
    config = {"architectures": ["Qwen2ForCausalLM"]}
    with pytest.raises(ValueError, match="no value head found"):
        find_value_head(path, config, 64)
