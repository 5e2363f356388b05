"""Every architecture x every layout: scores equal the per-sequence reference of docs/semantics.md.

Runs the whole service path (HTTP -> normalise -> batcher -> packed engine -> response) against
tests/support/reference.py, which runs each unpadded sequence alone through the model's own eager forward.
The mixtures of experts run twice: in the fused decoder (decoder=auto) and in transformers' own.

In bf16 and fp16 the tiny random MoE models' routers hold near ties that rounding flips (a flipped
expert moves a score by up to a few nats, in transformers' own modules as in the fused ones), so the
live-routing cases bound the mean |Δ| there (MOE_LIVE_MEAN); the same layouts scored on the experts
the float32 reference chose (routing replay, `routed_experts`) bound every score by the tolerance.
"""

from __future__ import annotations

import json
import math
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.support import models
from tests.support.device import DEVICE, DTYPE, TOLERANCE, settings_for
from tests.support.reference import check_reply, expected, max_diff, mean_diff, reference_routes
from tests.support.requests import LAYOUTS, make
from tests.support.servers import running

pytestmark = pytest.mark.parity  # make test-gpu runs it again on cuda in each dtype

REQUESTS_PER_CASE = 3
MOE_LIVE_MEAN = 0.05  # bf16/fp16 live routing of the MoE models: the mean |Δ| over actions
_worst: dict[str, float] = {}


SERVED = [*models.EVERY, *(f"{name}/transformers" for name in models.MOE_ARCHITECTURES)]


@pytest.fixture(scope="module", params=SERVED)
def served(request: pytest.FixtureRequest, model_dirs: dict[str, Path]) -> Iterator[tuple[str, TestClient]]:
    """An app serving `name`, or `name/decoder` with that decoder setting."""
    name, _, decoder = str(request.param).partition("/")
    settings = settings_for(model_dirs[name], max_batch_tokens=64, decoder=decoder or "auto")
    with running(settings) as client:
        info = client.get("/info").json()
        if name in models.MOE_ARCHITECTURES:  # the path this case is about runs
            experts = {"loop"} if DEVICE == "cpu" else {"quack", "grouped_mm"}  # moe_kernel=auto's choice
            if decoder:
                assert (info["decoder"], info["moe_kernel"]) == ("transformers", "none")
            else:
                assert info["decoder"] == "fused"
                assert info["moe_kernel"] in experts
        yield name, client


@pytest.mark.parametrize("layout", LAYOUTS)
def test_scores_equal_reference(
    served: tuple[str, TestClient], layout: str, reference_models: dict[str, Any]
) -> None:
    name, client = served
    rng = random.Random(f"{name}-{layout}")
    for _ in range(REQUESTS_PER_CASE):
        request = make(layout, rng, models.VOCAB, rows=5)
        reply = client.post("/logprobs", json=request)
        diff = check_reply(reply, request, reference_models[name], tolerance=math.inf)  # bounded below
        if name in models.MOE_ARCHITECTURES and DTYPE != "float32":
            want = expected(reference_models[name], request)
            mean = mean_diff(reply.json()["logprobs"], want.logprobs, want.action_mask)
            assert mean <= MOE_LIVE_MEAN, f"{name}/{layout}: mean |Δ| {mean:.3g} (live routes)"
            continue
        _worst[name] = max(_worst.get(name, 0.0), diff)
        assert diff <= TOLERANCE, f"{name}/{layout}: max |Δ| {diff:.3g} > {TOLERANCE}"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_moe_scores_equal_reference_on_its_routes(
    served: tuple[str, TestClient], layout: str, reference_models: dict[str, Any]
) -> None:
    """Each row replays the experts the float32 reference chose on it: every score within the tolerance,
    in every dtype, and the reported agreement covers every position and layer."""
    name, client = served
    if name not in models.MOE_ARCHITECTURES:
        pytest.skip("a dense policy takes no routes")
    rng = random.Random(f"routes-{name}-{layout}")
    for _ in range(REQUESTS_PER_CASE):
        request = make(layout, rng, models.VOCAB, rows=5)
        request["routed_experts"] = reference_routes(reference_models[name], request)
        reply = client.post("/logprobs", json=request)
        diff = check_reply(reply, request, reference_models[name], tolerance=math.inf)  # bounded below
        key = f"{name} (reference routes)"
        _worst[key] = max(_worst.get(key, 0.0), diff)
        assert diff <= TOLERANCE, f"{name}/{layout}: max |Δ| {diff:.3g} on the reference's routes"
        agreement = reply.json()["route_agreement"]
        assert agreement["compared"] > 0
        if DTYPE == "float32":  # the live router chooses what the float32 reference chose
            assert agreement["exact_fraction"] == 1.0


def test_report_worst_difference() -> None:
    """Write the largest |Δ| per architecture where LOGPROBD_TEST_REPORT asks (the GPU run)."""
    target = os.environ.get("LOGPROBD_TEST_REPORT")
    if target:
        Path(target).write_text(json.dumps({"dtype": DTYPE, "max_abs_diff": _worst}, indent=2))
    assert all(v <= TOLERANCE for v in _worst.values())


@pytest.mark.parametrize("name", models.EVERY)
def test_chunked_mlp_changes_no_score(
    name: str, model_dirs: dict[str, Path], reference_models: dict[str, Any]
) -> None:
    """MLPs run over 5 tokens at a time: the packed row is split mid-sequence, scores stay exact (the
    MoE models in bf16/fp16 on the reference's routes, as above). The budget holds the request (at most
    4 x 24 tokens) and keeps the warm-up small: its forwards, and on a GPU the CUDA graphs of every
    padded size up to the budget, run in budget / 5 MLP chunks a layer."""
    rng = random.Random(f"chunked-{name}")
    request = make("ragged_action_mask", rng, models.VOCAB, rows=4)
    if name in models.MOE_ARCHITECTURES and DTYPE != "float32":
        request["routed_experts"] = reference_routes(reference_models[name], request)
    with running(settings_for(model_dirs[name], mlp_chunk_tokens=5, max_batch_tokens=256)) as client:
        body = client.post("/logprobs", json=request).json()
    want = expected(reference_models[name], request)
    assert max_diff(body["logprobs"], want.logprobs) <= TOLERANCE
