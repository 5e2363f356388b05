"""Chunking a batch by rows in every layout, merging in order, and spreading over real replicas."""

from __future__ import annotations

from typing import Any

import httpx
import numpy as np
import pytest

from service.client import Client, LogprobdError
from service.client.fanout import merge, split
from service.client.replicas import ReplicaPool
from tests.support.device import TOLERANCE
from tests.support.faults import sent_body
from tests.support.frameworks import make_batch
from tests.support.reference import expected
from tests.support.requests import ragged
from tests.support.servers import requests_ok


def test_ragged_rows_split_with_their_num_actions() -> None:
    body = {"input_ids": [[1, 2, 3, 4]] * 6, "num_actions": [1, 2, 3, 1, 2, 3], "temperature": 0.5}
    chunks = split(body, max_chunk_tokens=8, max_chunk_rows=100, min_chunks=1)
    assert [(c.start, c.stop) for c in chunks] == [(0, 2), (2, 4), (4, 6)]
    assert [c.body["num_actions"] for c in chunks] == [[1, 2], [3, 1], [2, 3]]
    assert all(c.body["temperature"] == 0.5 and len(c.body["input_ids"]) == 2 for c in chunks)
    same = split({**body, "num_actions": 2}, max_chunk_tokens=8, max_chunk_rows=100, min_chunks=1)
    assert [c.body["num_actions"] for c in same] == [2, 2, 2]


def test_padded_rows_keep_their_width_masks_and_the_global_window() -> None:
    ids = [[0, 0, 0, 5, 6, 7, 0], [0, 0, 5, 6, 7, 8, 9], [5, 6, 7, 0, 0, 0, 0], [0, 0, 0, 0, 5, 6, 7]]
    mask = [[int(t != 0) for t in row] for row in ids]
    body = {"input_ids": ids, "attention_mask": mask, "response_length": 3, "eos_token_id": [2, 3]}
    chunks = split(body, max_chunk_tokens=8, max_chunk_rows=100, min_chunks=1)  # real tokens: 3, 5, 3, 3
    assert [(c.start, c.stop) for c in chunks] == [(0, 2), (2, 4)]
    for c in chunks:
        assert c.body["input_ids"] == ids[c.start : c.stop]
        assert c.body["attention_mask"] == mask[c.start : c.stop]
        assert (c.body["response_length"], c.body["eos_token_id"]) == (3, [2, 3])
    action_mask = [[int(c >= 4 and m[c]) for c in range(1, 7)] for m in mask]
    chunks = split({**body, "response_length": None, "action_mask": action_mask}, max_chunk_tokens=8,
                   max_chunk_rows=100, min_chunks=1)  # fmt: skip
    assert [c.body["action_mask"] for c in chunks] == [action_mask[:2], action_mask[2:]]


def test_chunk_counts_follow_replicas_rows_and_budget() -> None:
    body = {"input_ids": [[1] * 5] * 5, "num_actions": 1}
    bounds = [
        (c.start, c.stop) for c in split(body, max_chunk_tokens=10**6, max_chunk_rows=100, min_chunks=2)
    ]
    assert bounds == [(0, 2), (2, 5)]  # at least one chunk per replica
    bounds = [(c.start, c.stop) for c in split(body, max_chunk_tokens=10**6, max_chunk_rows=2, min_chunks=1)]
    assert bounds == [(0, 2), (2, 4), (4, 5)]
    long = {"input_ids": [[1] * 3, [1] * 50, [1] * 3], "num_actions": 1}
    bounds = [(c.start, c.stop) for c in split(long, max_chunk_tokens=10, max_chunk_rows=100, min_chunks=1)]
    assert bounds == [(0, 1), (1, 2), (2, 3)]  # a row over the budget goes alone, never cut
    tiny = {"input_ids": [[1, 2]], "num_actions": 1}
    assert len(split(tiny, max_chunk_tokens=10, max_chunk_rows=100, min_chunks=4)) == 1


def test_a_body_whose_rows_disagree_is_sent_whole() -> None:
    body = {"input_ids": [[1, 2, 3]] * 4, "num_actions": [1, 1, 1]}
    (chunk,) = split(body, max_chunk_tokens=3, max_chunk_rows=1, min_chunks=2)
    assert (chunk.start, chunk.stop, chunk.body) == (0, 4, body)


def test_merge_concatenates_rows_and_sums_usage() -> None:
    replies = [
        {"model": "m", "logprobs": [[-1.0], [-2.0]], "entropy": None, "values": [[0.5], [0.25]],
         "usage": {"input_tokens": 6, "scored_tokens": 2}},
        {"model": "m", "logprobs": [[-3.0, 0.0]], "entropy": None, "values": [[0.125, 0.0]],
         "usage": {"input_tokens": 4, "scored_tokens": 1}},
    ]  # fmt: skip
    merged = merge(replies)
    assert merged == {
        "model": "m", "logprobs": [[-1.0], [-2.0], [-3.0, 0.0]], "entropy": None,
        "values": [[0.5], [0.25], [0.125, 0.0]], "usage": {"input_tokens": 10, "scored_tokens": 3},
    }  # fmt: skip


def test_rollout_statistics_merge_as_over_the_union_of_tokens() -> None:
    rng = np.random.default_rng(0)
    diffs = [rng.normal(size=n) for n in (3, 0, 5)]  # per chunk: logprob - rollout_logprob

    def stats(d: np.ndarray) -> dict[str, Any]:
        if d.size == 0:
            return {"tokens": 0, "mean_abs_diff": 0.0, "max_abs_diff": 0.0, "mean_kl_k3": 0.0,
                    "ratio_outside_fraction": 0.0}  # fmt: skip
        return {
            "tokens": int(d.size),
            "mean_abs_diff": float(np.abs(d).mean()),
            "max_abs_diff": float(np.abs(d).max()),
            "mean_kl_k3": float((np.expm1(d) - d).mean()),
            "ratio_outside_fraction": float((np.abs(d) > np.log(2)).mean()),
        }

    replies = [{"model": "m", "logprobs": [], "rollout": stats(d)} for d in diffs]
    merged = merge(replies)["rollout"]
    want = stats(np.concatenate(diffs))
    assert merged["tokens"] == want["tokens"]
    assert merged == {k: pytest.approx(v, abs=1e-12) for k, v in want.items()}


def test_rollout_logprobs_travel_with_their_rows() -> None:
    body = {"input_ids": [[1, 2, 3]] * 4, "num_actions": [2, 1, 2, 1], "eos_token_id": [2, 3, 4, 5],
            "rollout_logprobs": [[-1.0, -2.0], [-3.0], [-4.0, -5.0], [-6.0]]}  # fmt: skip
    chunks = split(body, max_chunk_tokens=6, max_chunk_rows=100, min_chunks=1)
    assert [c.body["rollout_logprobs"] for c in chunks] == [[[-1.0, -2.0], [-3.0]], [[-4.0, -5.0], [-6.0]]]
    assert all(c.body["eos_token_id"] == [2, 3, 4, 5] for c in chunks)  # a list of ids, not per row


def test_unknown_objects_that_differ_between_chunks_are_refused() -> None:
    with pytest.raises(ValueError, match="`stats`"):
        merge([{"logprobs": [], "stats": {"p50": 1.0}}, {"logprobs": [], "stats": {"p50": 2.0}}])
    assert merge([{"stats": {"p50": 1.0}}, {"stats": {"p50": 1.0}}]) == {"stats": {"p50": 1.0}}


def test_rollout_mismatch_over_replicas_equals_one_request(qwen2_replicas: tuple[str, str]) -> None:
    request = ragged(seed=12, rows=10)
    rng = np.random.default_rng(1)
    request["rollout_logprobs"] = [(-rng.uniform(1, 8, n)).tolist() for n in request["num_actions"]]
    with Client(qwen2_replicas[0], max_chunk_tokens=10**6) as one:
        whole = one.score(**request)
    with Client(list(qwen2_replicas), max_chunk_tokens=30) as two:
        sharded = two.score(**request)
    assert len(two.config.chunks(request)) >= 3
    assert whole.extra["rollout"]["tokens"] == sum(request["num_actions"])
    assert sharded.extra["rollout"] == {
        k: pytest.approx(v, abs=1e-5) for k, v in whole.extra["rollout"].items()
    }


def test_pool_prefers_the_least_loaded_replica_in_turn_and_skips_one_backing_off() -> None:
    pool = ReplicaPool(("a", "b", "c"))
    leases = [pool.acquire() for _ in range(4)]
    assert [lease.replica.url for lease in leases] == ["a", "b", "c", "a"]
    pool.release(leases[1].replica)  # b now has the fewest in flight
    assert pool.acquire().replica.url == "b"
    pool.back_off(pool.replicas[2], 60.0)
    for lease in leases:
        pool.release(lease.replica)
    assert {pool.acquire().replica.url for _ in range(4)} == {"a", "b"}
    only = ReplicaPool(("x",))
    only.back_off(only.replicas[0], 0.5)
    assert 0.4 < only.acquire().wait <= 0.5  # nothing else to go to: wait for it


def test_future_per_row_fields_pass_through_and_merge_in_order() -> None:
    """What the critic issue adds (return_values=True -> "values") needs no client change."""
    sent: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = sent_body(request.content, request.headers["content-type"])
        sent.append(body)
        rows = body["input_ids"]
        reply = {
            "model": "m",
            "logprobs": [[-1.0] for _ in rows],
            "entropy": None,
            "action_mask": [[1] for _ in rows],
            "values": [[float(r[0])] for r in rows],
            "usage": {"input_tokens": 2 * len(rows), "scored_tokens": len(rows)},
        }
        return httpx.Response(200, json=reply)

    transport = httpx.MockTransport(handler)
    with Client(["http://r1.invalid", "http://r2.invalid"], transport=transport, max_chunk_rows=2) as client:
        scores = client.score([[i, 1] for i in range(7)], num_actions=1, return_values=True)
    assert scores.extra["values"] == [[float(i)] for i in range(7)]
    assert all(body["return_values"] is True for body in sent)
    assert len(sent) == 4
    assert (scores.usage.input_tokens, scores.usage.scored_tokens) == (14, 7)


def test_two_replicas_score_as_one(qwen2_replicas: tuple[str, str], reference_models: dict[str, Any]) -> None:
    a, b = qwen2_replicas
    request = ragged(seed=5, rows=12)
    batch = make_batch("split", seed=5, rows=9)
    padded: dict[str, Any] = {
        "input_ids": batch.input_ids.tolist(),
        "attention_mask": batch.attention_mask.tolist(),
        "response_length": batch.window,
        "return_entropy": True,
    }
    with Client(a, max_chunk_tokens=10**6) as one:
        whole = [one.score(**request), one.score(**padded)]
    before = requests_ok(a), requests_ok(b)
    with Client([a, b], max_chunk_tokens=40) as two:
        sharded = [two.score(**request), two.score(**padded)]
    after = requests_ok(a), requests_ok(b)
    assert after[0] - before[0] >= 2
    assert after[1] - before[1] >= 2
    for w, s, req in zip(whole, sharded, [request, padded], strict=True):
        assert s.action_mask == w.action_mask
        assert (s.usage.input_tokens, s.usage.scored_tokens) == (w.usage.input_tokens, w.usage.scored_tokens)
        np.testing.assert_allclose(np.concatenate(s.logprobs), np.concatenate(w.logprobs), atol=1e-5, rtol=0)
        want = expected(reference_models["qwen2"], req).logprobs
        np.testing.assert_allclose(np.concatenate(s.logprobs), np.concatenate(want), atol=TOLERANCE, rtol=0)
    assert sharded[1].entropy is not None
    np.testing.assert_allclose(np.array(sharded[1].entropy), np.array(whole[1].entropy), atol=1e-5, rtol=0)


def test_grouped_rows_split_with_only_the_prompts_they_name() -> None:
    prompts = [[1] * 3, [2] * 5, [3] * 2]
    body: dict[str, Any] = {
        "prompt_ids": prompts,
        "prompt_index": [0, 1, 0, 2, 1, 1],
        "input_ids": [[9]] * 6,
        "temperature": 0.5,
    }
    # each row counts its prompt's tokens too: 4, 6, 4, 3, 6, 6 (the server's max_request_tokens does)
    chunks = split(body, max_chunk_tokens=10, max_chunk_rows=100, min_chunks=1)
    assert [(c.start, c.stop) for c in chunks] == [(0, 2), (2, 4), (4, 5), (5, 6)]
    assert [c.body["prompt_ids"] for c in chunks] == [
        [prompts[0], prompts[1]],
        [prompts[0], prompts[2]],
        [prompts[1]],
        [prompts[1]],
    ]
    assert [c.body["prompt_index"] for c in chunks] == [[0, 1], [0, 1], [0], [0]]
    for c in chunks:
        sent = [c.body["prompt_ids"][p] for p in c.body["prompt_index"]]
        assert sent == [prompts[p] for p in body["prompt_index"][c.start : c.stop]]
        assert c.body["temperature"] == 0.5
    assert len(split(body, max_chunk_tokens=100, max_chunk_rows=100, min_chunks=1)) == 1


@pytest.mark.parametrize(
    "broken",
    [
        {"prompt_index": [0, 1, 0, 3, 1, 1]},
        {"prompt_index": [0, 1]},
        {"prompt_index": None},
        {"prompt_ids": 5},
    ],
)
def test_a_grouped_body_with_a_broken_index_goes_whole(broken: dict[str, Any]) -> None:
    body = {
        "prompt_ids": [[1], [2], [3]],
        "prompt_index": [0, 1, 0, 2, 1, 1],
        "input_ids": [[9]] * 6,
        **broken,
    }
    chunks = split(body, max_chunk_tokens=2, max_chunk_rows=1, min_chunks=2)
    assert [(c.start, c.stop, c.body) for c in chunks] == [(0, 6, body)]


def test_grouped_chunks_on_two_replicas_score_as_one(qwen2_replicas: tuple[str, str]) -> None:
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [14, 15, 16, 17]]
    index = [0, 1, 0, 2, 1, 0, 2, 1]
    responses = [[20 + i, 30 + i, 40 + i][: 1 + i % 3] for i in range(8)]
    a, b = qwen2_replicas
    with Client(a, max_chunk_tokens=10**6) as one:
        whole = one.score(responses, prompt_ids=prompts, prompt_index=index, return_entropy=True)
        flat = one.score(
            [prompts[p] + r for p, r in zip(index, responses, strict=True)],
            num_actions=[len(r) for r in responses],
        )
    with Client([a, b], max_chunk_tokens=12) as two:
        sharded = two.score(responses, prompt_ids=prompts, prompt_index=index, return_entropy=True)
        bad = [0, 1, 0, 2, 1, 0, 1, 1]  # prompt 2, only row 3's, holds a token outside the vocabulary
        with pytest.raises(LogprobdError) as raised:
            two.score(responses, prompt_ids=[*prompts[:2], [14, 96]], prompt_index=bad)
    assert sharded.action_mask == whole.action_mask == flat.action_mask
    counts = [(u.input_tokens, u.scored_tokens) for u in (sharded.usage, whole.usage, flat.usage)]
    assert counts[0] == counts[1] == counts[2]  # computed and cached: what the prefix cache held then
    rows: list[list[float]]
    for rows in (sharded.logprobs, flat.logprobs):
        np.testing.assert_allclose(np.concatenate(rows), np.concatenate(whole.logprobs), atol=1e-5, rtol=0)
    # the row that continues prompt 2 is row 3 of the batch, in a chunk that does not start at row 0
    assert (raised.value.status, raised.value.field, raised.value.row) == (422, "prompt_ids", 3)
    assert raised.value.chunk_start > 0
