"""The client's fleet-wide weight update: every replica reloads, the call returns once all serve the
version; scores carry the version; a batch never mixes versions across replicas; pins raise 409."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from service.client import AsyncClient, Client, LogprobdError, resolve_replicas
from service.client import group_keys as groups
from tests.support.device import TOLERANCE
from tests.support.reference import expected
from tests.support.servers import serving

ADMIN = "fleet-admin"
ROWS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [14, 15, 16, 17], [18, 19, 20, 21, 22]]
NUM_ACTIONS = [3, 2, 2, 4]


@pytest.fixture
def fleet(weight_versions: dict[str, Path], tmp_path: Path) -> Iterator[tuple[str, str]]:
    """Two replicas of v10; the second only reloads from under `tmp_path/allowed`."""
    settings: dict[str, Any] = {"admin_api_keys": ADMIN, "weights_version": "v10"}
    with (
        serving(weight_versions["v10"], **settings) as a,
        serving(weight_versions["v10"], **settings, reload_roots=str(tmp_path / "allowed")) as b,
    ):
        yield a, b


def test_update_weights_reaches_every_replica(
    weight_versions: dict[str, Path], version_models: dict[str, Any]
) -> None:
    settings: dict[str, Any] = {"admin_api_keys": ADMIN, "weights_version": "v10"}
    with (
        serving(weight_versions["v10"], **settings) as a,
        serving(weight_versions["v10"], **settings) as b,
        Client([a, b], max_chunk_rows=1) as client,
    ):
        assert client.score(ROWS, num_actions=NUM_ACTIONS).weights_version == "v10"
        statuses = client.update_weights(str(weight_versions["v11"]), "v11", admin_key=ADMIN, mode="swap")
        assert set(statuses) == {a, b}
        assert {s["state"] for s in statuses.values()} == {"done"}
        assert {s["mode"] for s in statuses.values()} == {"swap"}
        scores = client.score(ROWS, num_actions=NUM_ACTIONS, weights_version="v11")  # pinned, over both
        assert scores.weights_version == "v11"
        want = expected(version_models["v11"], {"input_ids": ROWS, "num_actions": NUM_ACTIONS}).logprobs
        for got, row in zip(scores.logprobs, want, strict=True):
            np.testing.assert_allclose(got, row, atol=TOLERANCE)
        again = client.update_weights(str(weight_versions["v11"]), "v11", admin_key=ADMIN)
        assert {s["state"] for s in again.values()} == {"unchanged"}
        with pytest.raises(LogprobdError) as stale:
            client.score(ROWS, num_actions=NUM_ACTIONS, weights_version="v10")
        assert (stale.value.status, stale.value.type, stale.value.attempts) == (
            409,
            "weights_version_mismatch",
            1,
        )


def test_a_replica_that_refuses_is_named_and_batches_never_mix_versions(
    fleet: tuple[str, str], weight_versions: dict[str, Path]
) -> None:
    a, b = fleet
    with Client([a, b], max_chunk_rows=1) as client:
        with pytest.raises(LogprobdError) as refused:
            client.update_weights(str(weight_versions["v12"]), "v12", admin_key=ADMIN)
        assert "1 of 2 replicas did not reload" in str(refused.value)
        assert b in str(refused.value)
        assert "outside the reload roots" in str(refused.value)
        assert (refused.value.status, refused.value.field) == (422, "path")
        # a now serves v12 and b v10: an unpinned batch split over both must not come back mixed (a
        # row's prompt goes to replica key mod 2, groups.py: the last row's to the other one)
        spread, actions = [*ROWS, [23, 24, 25, 26]], [*NUM_ACTIONS, 2]
        keys = groups.row_keys({"input_ids": spread, "num_actions": actions})
        assert {k % 2 for k in keys} == {0, 1}
        with pytest.raises(LogprobdError, match="different weights_versions") as mixed:
            client.score(spread, num_actions=actions)
        assert mixed.value.type == "replica_mismatch"
        with pytest.raises(TimeoutError, match=re.escape(b)):
            client.wait_for_version("v12", timeout=0.3, interval=0.05)
    with Client(a) as only_a:
        assert only_a.score(ROWS, num_actions=NUM_ACTIONS).weights_version == "v12"
        with pytest.raises(LogprobdError) as no_key:
            only_a.update_weights(str(weight_versions["v10"]), "v10")
        assert no_key.value.status == 401


def test_async_update_weights_equals_sync(weight_versions: dict[str, Path]) -> None:
    settings: dict[str, Any] = {"admin_api_keys": ADMIN, "weights_version": "v10"}
    with serving(weight_versions["v10"], **settings) as a, serving(weight_versions["v10"], **settings) as b:

        async def main() -> tuple[dict[str, dict[str, Any]], str | None]:
            async with AsyncClient([a, b], max_chunk_rows=1) as client:
                statuses = await client.update_weights(str(weight_versions["v12"]), "v12", admin_key=ADMIN)
                await client.wait_for_version("v12", timeout=5)
                return statuses, (await client.score(ROWS, num_actions=NUM_ACTIONS)).weights_version

        statuses, version = asyncio.run(main())
        assert {s["version"] for s in statuses.values()} == {"v12"}
        assert version == "v12"


def test_resolve_replicas_lists_every_address_of_a_name() -> None:
    urls = resolve_replicas("localhost", 8000)
    assert "http://127.0.0.1:8000" in urls
    assert urls == sorted(set(urls))
    assert all(u.startswith("http://") and u.endswith(":8000") for u in urls)
    with pytest.raises(LogprobdError, match=r"no-such-host\.invalid"):
        resolve_replicas("no-such-host.invalid", 8000)
