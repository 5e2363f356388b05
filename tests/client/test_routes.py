"""The client's routes: `Client.score(routed_experts=...)` in every form, and verl's router-replay
tensor through `verl_log_probs`, on a real server of a tiny Qwen3-MoE (8 experts, top-2, one
sparse layer).

verl's layout is built the way verl 0.9.1's agent loop builds it (`experimental/agent_loop/
agent_loop.py`: a zeroed [1, P+R, layers, top_k] int16 tensor, the rollout's routes written at
`start_pos : start_pos + length`, start_pos the prompt's left padding, length = real tokens - 1), and
checked against verl's own `_compute_rollout_moe_load_counts` (trainer/ppo/metric_utils.py), which
reads the recorded routes of the response columns of that same layout.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from service.client import Client
from service.client.adapters import verl_log_probs
from service.client.wire import to_frame
from tests.support.releases import importing
from tests.support.servers import serving

PROMPTS = [[3, 14, 15, 92], [3, 14, 15, 92], [65, 35]]
RESPONSES = [[89, 79, 32], [38, 46], [26, 43, 38]]


@pytest.fixture(scope="module")
def moe_server(model_dirs: dict[str, Path]) -> Iterator[str]:
    with serving(model_dirs["qwen3_moe"]) as url:
        yield url


def verl_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids, attention_mask, responses as verl pads them: prompts left, responses right."""
    p, r = max(map(len, PROMPTS)), max(map(len, RESPONSES))
    ids = torch.zeros(len(PROMPTS), p + r, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, (prompt, response) in enumerate(zip(PROMPTS, RESPONSES, strict=True)):
        ids[i, p - len(prompt) : p] = torch.tensor(prompt)
        ids[i, p : p + len(response)] = torch.tensor(response)
        mask[i, p - len(prompt) : p + len(response)] = 1
    return ids, mask, ids[:, p:]


def verl_routes(recorded: list[np.ndarray], mask: torch.Tensor) -> torch.Tensor:
    """verl's agent loop: each row's rollout routes (length = its real tokens - 1) into a zeroed
    [B, P+R, layers, top_k] int16 tensor at start_pos = the prompt's left padding."""
    layers, top_k = recorded[0].shape[1:]
    out = torch.zeros(mask.shape[0], mask.shape[1], layers, top_k, dtype=torch.int16)
    for i, routes in enumerate(recorded):
        start = int(mask[i].nonzero()[0])
        out[i, start : start + routes.shape[0]] = torch.from_numpy(routes).to(torch.int16)
    return out


def test_client_takes_arrays_lists_and_base64_alike(moe_server: str) -> None:
    ids = [p + r for p, r in zip(PROMPTS, RESPONSES, strict=True)]
    with (
        Client(moe_server) as client,
        Client(moe_server, frames=False) as plain,
        Client(moe_server, max_chunk_rows=1) as chunked,
    ):
        live = client.score(ids, num_actions=2, return_routed_experts=True)
        routes = live.routed_experts
        assert routes is not None
        assert [r.shape for r in routes] == [(7, 1, 2), (6, 1, 2), (5, 1, 2)]
        assert all(r.dtype == np.int64 for r in routes)
        forms = {
            "arrays, frames": client.score(ids, num_actions=2, routed_experts=routes),
            "tensors, json": plain.score(
                ids, num_actions=2, routed_experts=[torch.from_numpy(r) for r in routes]
            ),
            "lists, json": plain.score(ids, num_actions=2, routed_experts=[r.tolist() for r in routes]),
            "one array, chunked": chunked.score(
                ids[:2], num_actions=2, routed_experts=np.stack([routes[0][:6], routes[1]])
            ),
        }
        for name, scores in forms.items():
            rows = len(scores.logprobs)
            np.testing.assert_allclose(
                np.asarray(scores.logprobs, dtype=np.float32),
                np.asarray(live.logprobs[:rows], dtype=np.float32),
                atol=1e-5,
                err_msg=name,
            )
            agreement = scores.route_agreement
            assert agreement is not None
            assert agreement.exact_fraction == 1.0, name
        assert forms["one array, chunked"].route_agreement is not None
        assert forms["one array, chunked"].route_agreement.compared == 12  # merged over two chunks
        # recorded routes come back through the frame, JSON lists and base64 alike
        again = plain.score(ids, num_actions=2, return_routed_experts=True, routed_experts_format="base64")
        assert again.routed_experts is not None
        assert all(np.array_equal(a, b) for a, b in zip(again.routed_experts, routes, strict=True))


@pytest.mark.parametrize("grouped", [True, False])
def test_verl_router_replay_tensor_replays_and_records_in_verls_layout(
    moe_server: str, grouped: bool
) -> None:
    ids, mask, responses = verl_batch()
    with Client(moe_server) as client:
        live = verl_log_probs(client, ids, mask, responses, temperature=1.0, return_routed_experts=True)
        assert live.routed_experts is not None
        assert live.routed_experts.dtype == torch.int16
        assert live.routed_experts.shape == (3, ids.shape[1], 1, 2)
        assert not live.routed_experts[mask == 0].any()  # 0 at padding, as verl's
        # the rollout's record: every real token but the last, as SGLang/vLLM return it
        rollout = [live.routed_experts[i][mask[i].bool()][:-1].numpy() for i in range(3)]
        given = verl_routes(rollout, mask)
        replayed = verl_log_probs(
            client, ids, mask, responses, temperature=1.0, routed_experts=given, grouped=grouped
        )
    torch.testing.assert_close(replayed.log_probs, live.log_probs, atol=1e-5, rtol=0)
    assert replayed.route_agreement is not None
    assert replayed.route_agreement.exact_fraction == 1.0
    # every real token but each row's last: 6 + 5 + 4 (verl's build_r3_replay_mask)
    assert replayed.route_agreement.compared == 15
    # verl's own reader of the layout sees the same response routes in both
    with importing(stand_ins=("tensordict", "ray", "codetiming", "omegaconf", "hydra")):
        from verl.trainer.ppo import metric_utils  # type: ignore[import-not-found]
    response_mask = mask[:, -responses.shape[1] :]
    counts = metric_utils._compute_rollout_moe_load_counts(given, response_mask, 8)
    recorded = metric_utils._compute_rollout_moe_load_counts(live.routed_experts, response_mask, 8)
    assert counts is not None
    torch.testing.assert_close(counts, recorded)
    assert int(counts.sum()) == 2 * (2 + 1 + 2)  # top_k x the response tokens but each row's last


def test_verl_routes_of_another_rollout_change_the_scores(moe_server: str) -> None:
    ids, mask, responses = verl_batch()
    rng = np.random.default_rng(1)
    rollout = [
        np.stack([rng.choice(8, 2, replace=False) for _ in range(int(m.sum()) - 1)])[:, None, :] for m in mask
    ]
    with Client(moe_server) as client:
        live = verl_log_probs(client, ids, mask, responses, temperature=1.0)
        replayed = verl_log_probs(
            client, ids, mask, responses, temperature=1.0, routed_experts=verl_routes(rollout, mask)
        )
    assert not torch.allclose(replayed.log_probs, live.log_probs, atol=1e-3)
    assert replayed.route_agreement is not None
    assert replayed.route_agreement.exact_fraction < 1.0


def test_frames_take_arrays_tensors_strings_and_lists_alike() -> None:
    """Every row form flattens to the same ids, in the narrowest dtype that holds them; a row that
    is not routes (bad base64, ragged lists, floats) gives no frame (JSON goes)."""
    import base64

    from service.client.routed_experts import frame_rows
    from service.wire.frame import unpack

    rng = np.random.default_rng(3)
    rows = [rng.integers(0, 128, size=(n, 2, 4)) for n in (3, 0, 5)]
    forms: list[list[Any]] = [
        [r.astype(np.uint8) for r in rows],
        [torch.from_numpy(r) for r in rows],
        [base64.b64encode(r.astype("<i4").tobytes()).decode() for r in rows],
        [r.tolist() for r in rows],
    ]
    want = [r.ravel().tolist() for r in rows]
    for form in forms:
        got = frame_rows("routed_experts", [*form, None])
        assert got is not None
        spec, data = got
        assert spec.dtype == "u1"
        assert spec.lengths == (24, 0, 40, 0)
        assert np.frombuffer(data, dtype=np.uint8).tolist() == [x for row in want for x in row]
    for value, dtype in ((300, "u2"), (-1, "i4"), (1 << 40, "i8")):
        wide = rows[0].copy()
        wide[2, 1, 3] = value
        got = frame_rows("routed_experts", [wide])
        assert got is not None
        assert got[0].dtype == dtype
        sent = np.frombuffer(got[1], dtype=np.dtype(dtype).newbyteorder("<"))
        assert sent.tolist() == wide.ravel().tolist()
    good = base64.b64encode(rows[0].astype("<i4").tobytes()).decode()
    for bad in (good[:-4] + "*AAA", good[:8] + "=" + good[9:], good[:-4], [[[1, 2]], [[3]]], [[[1.5]]], 7):
        assert frame_rows("routed_experts", [bad]) is None, bad
    framed = to_frame({"input_ids": [[1, 2, 3]], "routed_experts": [rows[0]]})
    assert framed is not None
    spec, view = unpack(framed).arrays["routed_experts"]
    assert (spec.dtype, bytes(view)) == ("u1", rows[0].astype(np.uint8).tobytes())
