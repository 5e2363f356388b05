"""Bad requests over HTTP: each is a 422 naming the field (and row) at fault, and harms nothing.

Runs a tiny real qwen2 (vocab 96, 256 positions) with max_batch_tokens=64, so the longest sequence
the server scores is min(256, 64) = 64 real tokens.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient

from tests.support.device import TOLERANCE, settings_for
from tests.support.servers import Reply, running

VOCAB = 96
MAX_BATCH_TOKENS = 64


@dataclass(frozen=True)
class Raw:
    """A body sent as raw text with a JSON content type (NaN, Infinity, broken JSON)."""

    text: str


Body = dict[str, Any] | list[Any] | Raw


@pytest.fixture(scope="module")
def client(model_dirs: dict[str, Path]) -> Iterator[TestClient]:
    with running(settings_for(model_dirs["qwen2"], max_batch_tokens=MAX_BATCH_TOKENS)) as c:
        yield c


def post(client: TestClient, body: Body) -> Reply:
    response: Reply
    if isinstance(body, Raw):
        response = client.post("/logprobs", content=body.text, headers={"content-type": "application/json"})
    else:
        response = client.post("/logprobs", json=body)
    return response


def invalid_count(client: TestClient) -> float:
    text = client.get("/metrics").text
    found = re.search(r'^logprobd_requests_total\{outcome="invalid_request"\} (\S+)$', text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


# Valid bases that the bad cases below change in one place.
#   padded row 0: left-padded, real columns 2..4;  row 1: right-padded, real columns 0..2
P_IDS = [[0, 0, 11, 12, 13], [21, 22, 23, 0, 0]]
P_MASK = [[0, 0, 1, 1, 1], [1, 1, 1, 0, 0]]
P_ACTIONS = [[0, 0, 1, 1], [1, 1, 0, 0]]  # columns 3, 4 of row 0; columns 1, 2 of row 1


def ragged(**changes: Any) -> dict[str, Any]:
    return {"input_ids": [[1, 2, 3, 4], [5, 6, 7]], "num_actions": 2, **changes}


def ragged_mask(**changes: Any) -> dict[str, Any]:
    return {"input_ids": [[1, 2, 3, 4], [5, 6, 7]], "action_mask": [[0, 1, 1, 1], [0, 0, 1]], **changes}


def padded(**changes: Any) -> dict[str, Any]:
    return {"input_ids": P_IDS, "attention_mask": P_MASK, "response_length": 2, **changes}


def padded_mask(**changes: Any) -> dict[str, Any]:
    return {"input_ids": P_IDS, "attention_mask": P_MASK, "action_mask": P_ACTIONS, **changes}


def grouped(**changes: Any) -> dict[str, Any]:
    return {"prompt_ids": [[1, 2], [3]], "prompt_index": [0, 1], "input_ids": [[4, 5], [6]], **changes}


def without(body: dict[str, Any], *names: str) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k not in names}


SPLIT_IDS = [[0, 0, 11, 12, 13], [0, 21, 22, 23, 0]]  # row 1: left-padded prompt, right-padded response
SPLIT_MASK = [[0, 0, 1, 1, 1], [0, 1, 1, 1, 0]]
NAN_BODY = '{"input_ids": [[1, 2, 3]], "num_actions": 1, "temperature": %s}'

# (body, field, row): row is None where no single row is at fault
BAD: dict[str, tuple[Body, str, int | None]] = {
    # token ids
    "vocab_ragged": (ragged(input_ids=[[1, 2, 3, 4], [5, VOCAB, 7]]), "input_ids", 1),
    "vocab_ragged_huge": (ragged(input_ids=[[1, 2, 3, 4], [5, 2**70, 7]]), "input_ids", 1),
    "vocab_padded": (padded(input_ids=[[0, 0, 11, 12, 13], [21, VOCAB + 7, 23, 0, 0]]), "input_ids", 1),
    "vocab_padded_last_column": (padded(input_ids=[[0, 0, 11, 12, 300], [21, 22, 23, 0, 0]]), "input_ids", 0),
    "negative_token": (ragged(input_ids=[[1, 2, 3, 4], [5, -1, 7]]), "input_ids", 1),
    "negative_token_padded": (padded(input_ids=[[0, 0, 11, 12, 13], [-21, 22, 23, 0, 0]]), "input_ids", 1),
    "float_token": (ragged(input_ids=[[1, 2, 3, 4], [5, 6.0, 7]]), "input_ids", 1),
    "fractional_token": (ragged(input_ids=[[1, 2.5, 3, 4], [5, 6, 7]]), "input_ids", 0),
    "string_token": (ragged(input_ids=[[1, 2, 3, 4], [5, "6", 7]]), "input_ids", 1),
    "bool_token": (ragged(input_ids=[[1, 2, 3, 4], [5, True, 7]]), "input_ids", 1),
    "null_token": (ragged(input_ids=[[1, 2, 3, 4], [5, None, 7]]), "input_ids", 1),
    "row_not_a_list": (ragged(input_ids=[[1, 2, 3, 4], 5]), "input_ids", 1),
    "input_ids_flat": (ragged(input_ids=[1, 2, 3]), "input_ids", None),  # no row at fault: not rows
    # num_actions
    "num_actions_negative": (ragged(num_actions=-1), "num_actions", None),
    "num_actions_list_negative": (ragged(num_actions=[2, -1]), "num_actions", 1),
    "num_actions_float": (ragged(num_actions=1.5), "num_actions", None),
    "num_actions_equals_row_length": (ragged(num_actions=3), "num_actions", 1),
    "num_actions_exceeds_first_row": (ragged(num_actions=4), "num_actions", 0),
    "num_actions_huge": (ragged(num_actions=2**70), "num_actions", 0),
    "num_actions_list_equals_row_length": (ragged(num_actions=[2, 3]), "num_actions", 1),
    "num_actions_list_too_long": (ragged(num_actions=[1, 1, 1]), "num_actions", None),
    "num_actions_list_too_short": (ragged(num_actions=[1]), "num_actions", None),
    "num_actions_with_padded": (without(padded(num_actions=1), "response_length"), "num_actions", None),
    # padded shape and attention_mask
    "padded_rows_unequal": (padded(input_ids=[[0, 0, 11, 12, 13], [21, 22, 23, 0]]), "input_ids", 1),
    "attention_mask_two": (padded(attention_mask=[[0, 0, 1, 1, 1], [1, 2, 1, 0, 0]]), "attention_mask", 1),
    "attention_mask_negative": (padded(attention_mask=[[0, 0, -1, 1, 1], P_MASK[1]]), "attention_mask", 0),
    "attention_mask_bool": (padded(attention_mask=[P_MASK[0], [1, True, 1, 0, 0]]), "attention_mask", 1),
    "attention_mask_huge": (padded(attention_mask=[P_MASK[0], [1, 2**70, 1, 0, 0]]), "attention_mask", 1),
    "attention_mask_all_zero": (padded(attention_mask=[P_MASK[0], [0, 0, 0, 0, 0]]), "attention_mask", 1),
    "attention_mask_too_few_rows": (padded(attention_mask=[P_MASK[0]]), "attention_mask", None),
    "attention_mask_too_many_rows": (padded(attention_mask=[*P_MASK, P_MASK[0]]), "attention_mask", None),
    "attention_mask_short_row": (padded(attention_mask=[P_MASK[0], [1, 1, 1, 0]]), "attention_mask", 1),
    "attention_mask_long_row": (padded(attention_mask=[[0, 0, 1, 1, 1, 1], P_MASK[1]]), "attention_mask", 0),
    # action_mask, ragged (one per token)
    "action_mask_ragged_short": (ragged_mask(action_mask=[[0, 1, 1, 1], [0, 1]]), "action_mask", 1),
    "action_mask_ragged_long": (ragged_mask(action_mask=[[0, 1, 1, 1], [0, 1, 1, 1]]), "action_mask", 1),
    "action_mask_ragged_rows": (ragged_mask(action_mask=[[0, 1, 1, 1]]), "action_mask", None),
    "action_mask_ragged_two": (ragged_mask(action_mask=[[0, 1, 2, 1], [0, 0, 1]]), "action_mask", 0),
    "action_mask_ragged_position_0": (ragged_mask(action_mask=[[0, 1, 1, 1], [1, 0, 1]]), "action_mask", 1),
    "action_mask_ragged_huge": (ragged_mask(action_mask=[[0, 1, 1, 1], [0, 0, -(2**70)]]), "action_mask", 1),
    # action_mask, padded ([B, L-1], entry j is column j+1)
    "action_mask_padded_short": (padded_mask(action_mask=[P_ACTIONS[0], [1, 1, 0]]), "action_mask", 1),
    "action_mask_padded_full_width": (
        padded_mask(action_mask=[[0, 0, 0, 1, 1], [0, 1, 1, 0, 0]]),
        "action_mask",
        0,
    ),
    "action_mask_padded_rows": (padded_mask(action_mask=[P_ACTIONS[0]]), "action_mask", None),
    "action_mask_padded_first_real": (
        padded_mask(action_mask=[[0, 1, 1, 1], P_ACTIONS[1]]),
        "action_mask",
        0,
    ),
    "action_mask_split_first_real": (
        padded_mask(input_ids=SPLIT_IDS, attention_mask=SPLIT_MASK, action_mask=[[0, 0, 1, 1], [1, 1, 1, 0]]),
        "action_mask",
        1,
    ),
    "action_mask_padded_padding": (padded_mask(action_mask=[P_ACTIONS[0], [1, 0, 0, 1]]), "action_mask", 1),
    "action_mask_padded_left_padding": (
        padded_mask(action_mask=[[1, 0, 1, 1], P_ACTIONS[1]]),
        "action_mask",
        0,
    ),
    "action_mask_padded_hole": (
        padded_mask(
            attention_mask=[[0, 0, 1, 1, 1], [1, 0, 1, 1, 0]], action_mask=[[0, 0, 1, 1], [1, 0, 0, 0]]
        ),
        "action_mask",
        1,
    ),
    # response_length
    "response_length_equals_width": (padded(response_length=5), "response_length", None),
    "response_length_exceeds_width": (padded(response_length=9), "response_length", None),
    "response_length_negative": (padded(response_length=-1), "response_length", None),
    "response_length_float": (padded(response_length=2.0), "response_length", None),
    "response_length_first_real_row_0": (padded(response_length=3), "response_length", 0),
    "response_length_first_real_row_1": (
        padded(
            input_ids=[[11, 12, 13, 14, 15], [0, 0, 0, 21, 22]], attention_mask=[[1] * 5, [0, 0, 0, 1, 1]]
        ),
        "response_length",
        1,
    ),
    "response_length_ragged": (without(ragged(response_length=1), "num_actions"), "response_length", None),
    # action specs
    "specs_num_actions_and_action_mask": (ragged(action_mask=[[0, 1, 1, 1], [0, 0, 1]]), "action_mask", None),
    "specs_action_mask_and_response_length": (padded_mask(response_length=1), "response_length", None),
    "specs_all_three": (padded_mask(response_length=1, num_actions=1), "action_mask", None),
    "specs_none": (without(ragged(), "num_actions"), "num_actions", None),
    # empty input
    "input_ids_empty": (ragged(input_ids=[]), "input_ids", None),
    "input_ids_missing": (without(ragged(), "input_ids"), "input_ids", None),
    "row_empty": (ragged(input_ids=[[1, 2, 3], []], num_actions=0), "input_ids", 1),
    "rows_empty_padded": (
        padded(input_ids=[[], []], attention_mask=[[], []], response_length=0),
        "input_ids",
        0,
    ),
    # temperature
    "temperature_zero": (ragged(temperature=0), "temperature", None),
    "temperature_negative": (ragged(temperature=-0.5), "temperature", None),
    "temperature_string": (ragged(temperature="hot"), "temperature", None),
    "temperature_numeric_string": (ragged(temperature="1"), "temperature", None),
    "temperature_nan": (Raw(NAN_BODY % "NaN"), "temperature", None),
    "temperature_infinity": (Raw(NAN_BODY % "Infinity"), "temperature", None),
    "temperature_minus_infinity": (Raw(NAN_BODY % "-Infinity"), "temperature", None),
    "temperature_overflows_to_infinity": (Raw(NAN_BODY % "1e999"), "temperature", None),
    # length limit: the model's 256 positions (longer than the 64-token budget: scored in chunks)
    "too_long_ragged": (ragged(input_ids=[[1, 2, 3], [5] * 257], num_actions=1), "input_ids", 1),
    "too_long_padded": (
        padded(
            input_ids=[[0] * 6 + [5] * 256, [0] * 5 + [6] * 257],
            attention_mask=[[0] * 6 + [1] * 256, [0] * 5 + [1] * 257],
            response_length=1,
        ),
        "input_ids",
        1,
    ),
    # the grouped form: prompt_ids once each, input_ids rows are responses, prompt_index per row
    "grouped_prompt_index_out_of_range": (grouped(prompt_index=[0, 2]), "prompt_index", 1),
    "grouped_prompt_index_negative": (grouped(prompt_index=[0, -1]), "prompt_index", 1),
    "grouped_prompt_index_short": (grouped(prompt_index=[0]), "prompt_index", None),
    "grouped_prompt_index_missing": (without(grouped(), "prompt_index"), "prompt_index", None),
    "grouped_prompt_empty": (grouped(prompt_ids=[[1, 2], []]), "prompt_ids", 1),
    "grouped_prompt_negative_token": (grouped(prompt_ids=[[1, 2], [3, -4]]), "prompt_ids", None),
    "grouped_prompt_vocab": (grouped(prompt_ids=[[1, 2], [3, VOCAB]]), "prompt_ids", 1),
    "grouped_response_length": (grouped(response_length=1), "response_length", None),
    # other fields and the body itself
    "eos_negative": (ragged(eos_token_id=-2), "eos_token_id", None),
    "eos_list_negative": (ragged(eos_token_id=[2, -2]), "eos_token_id", None),
    "return_entropy_two": (ragged(return_entropy=2), "return_entropy", None),
    "unknown_field": (ragged(position_ids=[[0, 1, 2, 3], [0, 1, 2]]), "position_ids", None),
    "malformed_json": (Raw('{"input_ids": [[1, 2'), "body", None),
    "json_trailing_comma": (Raw('{"input_ids": [[1, 2, 3]], "num_actions": 1,}'), "body", None),
    "empty_body": (Raw(""), "body", None),
    "body_is_list": ([[1, 2, 3]], "body", None),
    "body_is_null": (Raw("null"), "body", None),
    "body_is_string": (Raw('"score me"'), "body", None),
}


def check_rejected(response: Reply, field: str, row: int | None) -> None:
    assert response.status_code == 422, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"type", "message", "field"} | ({"row"} if row is not None else set())
    assert error["type"] == "invalid_request"
    assert error["field"] == field
    assert error.get("row") == row
    assert isinstance(error["message"], str)
    assert field in error["message"], error["message"]


@pytest.mark.parametrize(("body", "field", "row"), list(BAD.values()), ids=list(BAD))
def test_bad_request_is_422_naming_field_and_row(
    client: TestClient, body: Body, field: str, row: int | None
) -> None:
    before = invalid_count(client)
    check_rejected(post(client, body), field, row)
    assert invalid_count(client) == before + 1


# Valid requests; each is also checked against its expected action_mask, worked out by hand.
GOOD: list[tuple[dict[str, Any], list[list[int]]]] = [
    (
        ragged(input_ids=[[1, 5, 9, 13, 17, 21], [3, 4, 8]], num_actions=[3, 2], return_entropy=True),
        [[1, 1, 1], [1, 1]],
    ),
    (ragged_mask(eos_token_id=[3, 7], temperature=0.7), [[1, 1, 0], [0, 1]]),  # cut after token 3
    (padded(), [[1, 1], [0, 0]]),
    (padded_mask(return_entropy=True), [[0, 0, 1, 1], [1, 1, 0, 0]]),
    (grouped(input_ids=[[5, 4], [6, 2]], eos_token_id=5), [[1, 0], [1, 1]]),  # row 0 ends at its EOS
    # the largest sequence allowed, and an EOS id too large to match anything
    (ragged(input_ids=[[5] * 64], num_actions=1, eos_token_id=2**70), [[1]]),
    # a padding column's value is never read
    (padded(input_ids=[[2**70, VOCAB, 11, 12, 13], [21, 22, 23, 0, 10**6]]), [[1, 1], [0, 0]]),
]


def score_good(client: TestClient) -> list[dict[str, Any]]:
    results = []
    for request, _ in GOOD:
        response = client.post("/logprobs", json=request)
        assert response.status_code == 200, response.text
        results.append(response.json())
    return results


def test_good_requests_are_scored(client: TestClient) -> None:
    for (request, mask), result in zip(GOOD, score_good(client), strict=True):
        assert result["action_mask"] == mask
        for row, row_mask in zip(result["logprobs"], mask, strict=True):
            assert len(row) == len(row_mask)
            assert all((v < 0.0) if m else (v == 0.0) for v, m in zip(row, row_mask, strict=True))
        assert result["usage"]["scored_tokens"] == sum(map(sum, mask))
        assert (result["entropy"] is not None) == request.get("return_entropy", False)


def test_good_answers_unchanged_after_each_bad_request(client: TestClient) -> None:
    before = invalid_count(client)
    baseline = score_good(client)
    for name, (body, field, _) in BAD.items():
        response = post(client, body)
        assert response.status_code == 422, name
        assert response.json()["error"]["field"] == field, name
        assert score_good(client) == baseline, f"good answers changed after {name}"
    assert invalid_count(client) == before + len(BAD)


def send_all_bad(client: TestClient, offset: int) -> list[tuple[Reply, str, int | None]]:
    cases = list(BAD.values())
    cases = cases[offset:] + cases[:offset]
    return [(post(client, body), field, row) for body, field, row in cases]


BAD_THREADS = (0, 30, 60)  # each sends every bad case, starting at this offset


def test_bad_requests_concurrent_with_one_good_stream_change_nothing(client: TestClient) -> None:
    """Good requests sent one at a time are batched alone, as in the baseline: answers are bitwise equal."""
    baseline = score_good(client)
    before = invalid_count(client)
    with ThreadPoolExecutor(max_workers=len(BAD_THREADS) + 1) as pool:
        bad = [pool.submit(send_all_bad, client, offset) for offset in BAD_THREADS]
        good = pool.submit(lambda: [score_good(client) for _ in range(4)])
        good_results = good.result()
        bad_results = [item for future in bad for item in future.result()]
    for results in good_results:
        assert results == baseline
    for response, field, row in bad_results:
        check_rejected(response, field, row)
    assert invalid_count(client) == before + len(BAD_THREADS) * len(BAD)


def test_bad_requests_concurrent_with_many_good_streams(client: TestClient) -> None:
    """Good requests from several threads share micro-batches: equal within the float tolerance."""
    baseline = score_good(client)
    before = invalid_count(client)

    def repeat(k: int) -> list[dict[str, Any]]:
        results = []
        for _ in range(3):
            response = client.post("/logprobs", json=GOOD[k][0])
            assert response.status_code == 200, response.text
            results.append(response.json())
        return results

    with ThreadPoolExecutor(max_workers=len(BAD_THREADS) + len(GOOD)) as pool:
        bad = [pool.submit(send_all_bad, client, offset) for offset in BAD_THREADS]
        good = [pool.submit(repeat, k) for k in range(len(GOOD))]
        good_results = [future.result() for future in good]
        bad_results = [item for future in bad for item in future.result()]
    for response, field, row in bad_results:
        check_rejected(response, field, row)
    for want, results in zip(baseline, good_results, strict=True):
        for got in results:
            assert got["action_mask"] == want["action_mask"]
            assert got["usage"] == want["usage"]
            for key in ("logprobs", "entropy"):
                if want[key] is None:
                    assert got[key] is None
                    continue
                for g, w in zip(got[key], want[key], strict=True):
                    np.testing.assert_allclose(g, w, rtol=0, atol=TOLERANCE)
    assert invalid_count(client) == before + len(BAD_THREADS) * len(BAD)


@pytest.mark.parametrize(
    ("overrides", "longest", "limit"),
    [
        ({"max_batch_tokens": 64}, 256, "positions"),
        ({"max_batch_tokens": 1024}, 256, "positions"),
        ({"max_batch_tokens": 64, "max_sequence_tokens": 100}, 100, "setting"),
    ],
)
def test_longest_sequence_is_the_positions_or_the_setting_whatever_the_budget(
    model_dirs: dict[str, Path], overrides: dict[str, int], longest: int, limit: str
) -> None:
    with running(settings_for(model_dirs["qwen2"], **overrides)) as c:
        info = c.get("/info").json()
        assert (info["max_positions"], info["max_sequence_tokens"], info["max_sequence_limit"]) == (
            256,
            longest,
            limit,
        )
        ok = c.post("/logprobs", json={"input_ids": [[1, 2], [7] * longest], "num_actions": 1})
        assert ok.status_code == 200, ok.text
        assert ok.json()["usage"] == {
            "input_tokens": longest + 2,
            "scored_tokens": 2,
            "computed_tokens": longest + 2,
            "cached_tokens": 0,
        }
        too_long = c.post("/logprobs", json={"input_ids": [[1, 2], [7] * (longest + 1)], "num_actions": 1})
        if limit == "positions":
            check_rejected(too_long, "input_ids", 1)  # 422: past the model's positions
            assert "positions cover 256" in too_long.json()["error"]["message"]
        else:
            assert too_long.status_code == 413, too_long.text
            error = too_long.json()["error"]
            assert (error["type"], error["field"], error["row"]) == ("sequence_too_large", "input_ids", 1)
            limited = f"longest sequence this server scores is {longest} (set by --max-sequence-tokens)"
            assert limited in error["message"]
