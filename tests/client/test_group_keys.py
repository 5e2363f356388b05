"""Rows that share a prompt stay on one replica: each row's group key in every layout, the chunks a
batch is parted into over replicas (and per group), the group header, and split GRPO groups from
several trainer ranks over two real replicas, each prompt computed once by the prefix cache."""

from __future__ import annotations

import random
import re
from typing import Any

import httpx
import numpy as np

from service.client import Client
from service.client import group_keys as groups
from service.client.fanout import merge, reorder, split
from service.core.cache_plan import BLOCK
from tests.support import models
from tests.support.device import TOLERANCE
from tests.support.faults import sent_body
from tests.support.reference import expected

PROMPT_A, PROMPT_B = [5, 6, 7, 8], [9, 10, 11]


def test_a_rows_key_is_its_prompts_in_every_layout() -> None:
    ragged = {"input_ids": [[*PROMPT_A, 1, 2], [*PROMPT_B, 3], [*PROMPT_A, 4]], "num_actions": [2, 1, 1]}
    keys = groups.row_keys(ragged)
    assert keys[0] == keys[2] != keys[1]
    grouped = {"prompt_ids": [PROMPT_A, PROMPT_B], "prompt_index": [0, 1, 0], "input_ids": [[1, 2], [3], [4]]}
    assert groups.row_keys(grouped) == keys
    masked = {
        "input_ids": ragged["input_ids"],
        "action_mask": [[0, 0, 0, 0, 1, 1], [0, 0, 0, 1], [0, 0, 0, 0, 1]],
    }
    assert groups.row_keys(masked) == keys
    padded = {
        "input_ids": [[0, *PROMPT_A, 1, 2], [0, 0, *PROMPT_B, 3, 0], [0, *PROMPT_A, 4, 0]],
        "attention_mask": [[0, 1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1, 0]],
        "response_length": 2,
    }
    assert groups.row_keys(padded) == keys
    # a trajectory's steps: each prompt extends the one before; keyed on their first tokens, they agree
    steps = {"input_ids": [[*PROMPT_A, 1, 2, 3], [*PROMPT_A, 1, 2, 3, 4, 5]], "num_actions": 1}
    assert len(set(groups.row_keys(steps))) == 2
    assert len(set(groups.row_keys(steps, key_tokens=4))) == 1
    assert groups.header_value(keys[0]) == f"{keys[0]:016x}"


def test_over_replicas_a_keys_rows_go_to_one_replica_and_come_back_in_order() -> None:
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 90) for _ in range(8)] for _ in range(6)]
    rows = [(p, [rng.randrange(3, 90) for _ in range(3)]) for _ in range(3) for p in prompts]
    body: dict[str, Any] = {"input_ids": [p + r for p, r in rows], "num_actions": [len(r) for _, r in rows]}
    keys = groups.row_keys(body)
    chunks = split(body, max_chunk_tokens=30, max_chunk_rows=100, min_chunks=2, keys=keys, replicas=2)
    for chunk in chunks:
        assert chunk.rows is not None
        assert {keys[r] % 2 for r in chunk.rows} == {chunk.replica}
        assert chunk.body["input_ids"] == [body["input_ids"][r] for r in chunk.rows]
        assert chunk.group == keys[chunk.rows[0]]
    assert sorted(r for c in chunks for r in c.rows or ()) == list(range(len(rows)))
    replies = [{"logprobs": [[float(r)] for r in c.rows or ()], "usage": {"input_tokens": 1}} for c in chunks]
    merged = reorder(merge(replies), chunks)
    assert merged["logprobs"] == [[float(r)] for r in range(len(rows))]
    assert merged["usage"] == {"input_tokens": len(chunks)}
    alone = split(body, max_chunk_tokens=10**6, max_chunk_rows=100, min_chunks=1, keys=keys, by_group=True)
    assert sorted(len(c.rows or ()) for c in alone) == [3] * 6  # each group a request of its own
    assert all(len({keys[r] for r in c.rows or ()}) == 1 for c in alone)


class Recording(httpx.BaseTransport):
    """The real transport, keeping each request's replica, group header and rows."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, str, list[list[int]]]] = []
        self._real = httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        body = sent_body(request.content, request.headers["content-type"])
        rows = [list(map(int, row)) for row in body["input_ids"]]
        self.sent.append(
            (f"{request.url.scheme}://{request.url.netloc.decode()}", request.headers[groups.HEADER], rows)
        )
        return self._real.handle_request(request)

    def close(self) -> None:
        self._real.close()


def cached_tokens(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    found = re.search(r"^logprobd_prefix_cache_hit_tokens_total (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def test_split_groups_from_several_ranks_reach_one_replica_each(
    qwen2_replicas: tuple[str, str], reference_models: dict[str, Any]
) -> None:
    """Four trainer ranks, rank s scoring sample s of every group (verl's balance_batch), each through
    its own client over both replicas: a group's rows all reach one replica, so every rank after the
    first reads the group's prompt from that replica's cache."""
    rng = random.Random("ranks")
    prompts = [[rng.randrange(3, models.VOCAB) for _ in range(3 * BLOCK + 5)] for _ in range(6)]
    before = sum(cached_tokens(url) for url in qwen2_replicas)
    replica_of: dict[int, str] = {}
    for rank in range(4):
        rows = [[*p, 3 + rank, *(rng.randrange(3, models.VOCAB) for _ in range(5))] for p in prompts]
        sent = Recording()
        with Client(list(qwen2_replicas), transport=sent, max_chunk_tokens=200) as client:
            scores = client.score(rows, num_actions=6, return_entropy=True)
        want = expected(reference_models["qwen2"], {"input_ids": rows, "num_actions": 6}).logprobs
        for got, row in zip(scores.logprobs, want, strict=True):
            np.testing.assert_allclose(got, row, atol=TOLERANCE)
        assert scores.usage.cached_tokens == (0 if rank == 0 else len(prompts) * 3 * BLOCK)
        for url, header, sent_rows in sent.sent:
            assert header == groups.header_value(
                groups.row_keys({"input_ids": sent_rows[:1], "num_actions": 6})[0]
            )
            for sent_row in sent_rows:
                assert replica_of.setdefault(prompts.index(sent_row[: len(prompts[0])]), url) == url
    assert len(set(replica_of.values())) == 2  # the groups spread over both
    assert sum(cached_tokens(url) for url in qwen2_replicas) - before == 3 * len(prompts) * 3 * BLOCK
