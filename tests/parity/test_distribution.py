"""POST /logprobs' top_logprobs, candidate_ids and sampling, end to end, for every parity
architecture, against tests/support/distribution.py's float64 reference on the model's own eager logits:
ragged and padded layouts, the grouped form with shared prefixes, a sequence scored in chunks, the
client, the three forms of the answer's [window, K] blocks (JSON lists, JSON base64 read by
docs/api.md's own snippet, a frame: the same float32 bits), and the 422s (docs/api.md, 'Beyond the
log-prob')."""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from service.client.wire import from_frame, to_frame
from service.wire.frame import MEDIA_TYPE
from tests.support import ROOT, models
from tests.support import distribution as ref
from tests.support.device import settings_for
from tests.support.servers import running

SAMPLING = {"top_k": 20, "top_p": 0.9, "min_p": 0.01}
ATOL = 2e-4
BLOCKS = ("top_ids", "top_logprobs", "candidate_logprobs")


def documented_decoder() -> Callable[[dict[str, Any]], dict[str, list[np.ndarray]]]:
    """docs/api.md's snippet for `distribution_format: "base64"`, run as it is written there."""
    page = (ROOT / "docs" / "api.md").read_text()
    (code,) = [
        b
        for b in re.findall(r"^```python\n(.*?)^```", page, re.MULTILINE | re.DOTALL)
        if "def distribution_blocks" in b
    ]
    scope: dict[str, Any] = {}
    exec(code, scope)  # the documentation's own code
    decoder: Callable[[dict[str, Any]], dict[str, list[np.ndarray]]] = scope["distribution_blocks"]
    return decoder


@pytest.fixture(scope="module", params=models.EVERY)
def served(request: pytest.FixtureRequest, model_dirs: dict[str, Path]) -> Iterator[tuple[str, TestClient]]:
    settings = settings_for(model_dirs[request.param], max_batch_tokens=64, share_min_tokens=4)
    with running(settings) as client:
        yield request.param, client


def _sequences(body: dict[str, Any]) -> list[tuple[list[int], list[int | None]]]:
    """Each row's real tokens and, per window entry, the position it scores (None: not an action)."""
    out: list[tuple[list[int], list[int | None]]] = []
    for i, ids in enumerate(body["input_ids"]):
        if "prompt_index" in body:
            prompt = body["prompt_ids"][body["prompt_index"][i]]
            out.append((prompt + ids, [len(prompt) + k for k in range(len(ids))]))
        elif "attention_mask" in body:
            mask = body["attention_mask"][i]
            tokens = [t for t, m in zip(ids, mask, strict=True) if m]
            seen = np.cumsum(mask) - 1
            window = range(len(ids) - body["response_length"], len(ids))
            out.append((tokens, [int(seen[c]) if mask[c] else None for c in window]))
        else:
            n = body["num_actions"][i]
            out.append((ids, [*range(len(ids) - n, len(ids))]))
    return out


def _check(model: Any, body: dict[str, Any], reply: dict[str, Any], *, framed: bool = False) -> None:
    """`reply` parsed from JSON, or (framed) from a compact frame by the client's from_frame: the
    [window, K] fields numpy blocks, -inf where JSON writes null."""
    t = body.get("temperature", 1.0)
    shared = body.get("candidate_ids")
    for i, (tokens, window) in enumerate(_sequences(body)):
        with torch.no_grad():
            logits = model(torch.tensor([tokens])).logits[0].double().numpy()
        for slot, position in enumerate(window):
            if position is None:
                assert reply["action_mask"][i][slot] == 0
                continue
            ids = shared if shared is None or isinstance(shared[0], int) else shared[i][slot]
            want = ref.position(
                logits[position - 1], tokens[position], temperature=t, top=body.get("top_logprobs", 0),
                candidates=ids, **body.get("sampling", {}),
            )  # fmt: skip
            logp = ref.logprobs(logits[position - 1], t)[tokens[position]]
            assert abs(reply["logprobs"][i][slot] - logp) < ATOL
            if "top_logprobs" in body:
                got_ids = np.asarray(reply["top_ids"][i][slot]).tolist()
                assert got_ids == want.top_ids.tolist(), (i, slot)
                np.testing.assert_allclose(reply["top_logprobs"][i][slot], want.top_logprobs, atol=ATOL)
                assert reply["ranks"][i][slot] == want.rank
            if ids is not None:
                np.testing.assert_allclose(reply["candidate_logprobs"][i][slot], want.candidates, atol=ATOL)
            if "sampling" in body:
                got = reply["processed_logprobs"][i][slot]
                if np.isinf(want.processed):
                    assert got == -np.inf if framed else got is None, (i, slot, got)  # JSON's -inf: null
                else:
                    assert got is not None
                    assert abs(got - want.processed) < ATOL


def _ragged(rng: random.Random, lengths: tuple[int, ...] = (9, 17, 30)) -> dict[str, Any]:
    return {
        "input_ids": [[rng.randrange(3, models.VOCAB) for _ in range(n)] for n in lengths],
        "num_actions": [n // 2 for n in lengths],
        "temperature": 0.8,
    }


def _post(client: TestClient, body: dict[str, Any], form: str) -> dict[str, Any]:
    """The answer in `form`: JSON lists, JSON base64 (its blocks decoded by docs/api.md's snippet) or
    a frame (read by the client's from_frame)."""
    if form == "frames":
        raw = to_frame(body)
        assert raw is not None
        reply = client.post(
            "/logprobs", content=raw, headers={"content-type": MEDIA_TYPE, "accept": MEDIA_TYPE}
        )
        assert reply.status_code == 200, reply.text
        assert reply.headers["content-type"] == MEDIA_TYPE
        return from_frame(reply.content)
    asked = {**body, "distribution_format": "base64"} if form == "base64" else body
    reply = client.post("/logprobs", json=asked)
    assert reply.status_code == 200, reply.text
    answer: dict[str, Any] = reply.json()
    if form == "base64":
        assert all(
            isinstance(row, str) for name in BLOCKS if name in answer["columns"] for row in answer[name]
        )
        answer |= documented_decoder()(answer)
    else:
        assert "columns" not in answer or answer["columns"] is None
    return answer


@pytest.mark.parametrize("form", ["lists", "base64", "frames"])
def test_ragged_top_k_candidates_and_sampler(
    served: tuple[str, TestClient], reference_models: dict[str, Any], form: str
) -> None:
    name, client = served
    body = _ragged(random.Random(name)) | {
        "top_logprobs": 5,
        "candidate_ids": [3, 1, 95],
        "sampling": SAMPLING,
    }
    answer = _post(client, body, form)
    _check(reference_models[name], body, answer, framed=form == "frames")
    processed = [v for row in answer["processed_logprobs"] for v in row]
    outside = sum(v is None or v == -np.inf for v in processed)
    assert answer["rollout"]["outside_kept_fraction"] == pytest.approx(outside / len(processed))


def test_every_form_carries_the_same_bits(served: tuple[str, TestClient]) -> None:
    """JSON lists (the shortest decimal of each float32), JSON base64 and a frame: the same ids and
    float32 log-probs, bit for bit, padding entries (zeros) too."""
    name, client = served
    rng = random.Random(f"forms-{name}")
    body = {
        "input_ids": [
            [0, 0, *[rng.randrange(3, 96) for _ in range(10)]],
            [rng.randrange(3, 96) for _ in range(12)],
        ],
        "attention_mask": [[0, 0, *[1] * 10], [1] * 9 + [0] * 3],
        "response_length": 5,
        "temperature": 0.7,
        "top_logprobs": 7,
        "candidate_ids": [5, 9],
    }
    answers = {form: _post(client, body, form) for form in ("lists", "base64", "frames")}
    framed = answers["frames"]
    for form in ("lists", "base64"):
        for field, dtype in (
            ("top_ids", np.int64),
            ("top_logprobs", np.float32),
            ("candidate_logprobs", np.float32),
        ):
            for row, want in zip(answers[form][field], framed[field], strict=True):
                got = np.asarray(row, dtype=dtype)
                assert got.shape == want.shape, (form, field)
                assert got.tobytes() == np.asarray(want, dtype=dtype).tobytes(), (form, field)


def test_padded_k1_and_whole_vocabulary(
    served: tuple[str, TestClient], reference_models: dict[str, Any]
) -> None:
    name, client = served
    rng = random.Random(f"padded-{name}")
    for top in (1, models.VOCAB):
        body: dict[str, Any] = {
            "input_ids": [
                [0, 0, *[rng.randrange(3, 96) for _ in range(10)]],
                [rng.randrange(3, 96) for _ in range(12)],
            ],
            "attention_mask": [[0, 0, *[1] * 10], [1] * 9 + [0] * 3],
            "response_length": 4,
            "top_logprobs": top,
            "sampling": {"top_k": 0, "top_p": 1.0, "min_p": 0.0},  # off: processed == logprobs
        }
        reply = client.post("/logprobs", json=body).json()
        _check(reference_models[name], body, reply)
        assert reply["processed_logprobs"] == reply["logprobs"]


def test_grouped_shared_prefixes_with_per_position_candidates(
    served: tuple[str, TestClient], reference_models: dict[str, Any]
) -> None:
    name, client = served
    rng = random.Random(f"grouped-{name}")
    responses = [[rng.randrange(3, 96) for _ in range(n)] for n in (5, 7, 6, 4)]
    body = {
        "prompt_ids": [[rng.randrange(3, 96) for _ in range(12)], [rng.randrange(3, 96) for _ in range(9)]],
        "prompt_index": [0, 0, 1, 0],
        "input_ids": responses,
        "top_logprobs": 3,
        "candidate_ids": [[[rng.randrange(96) for _ in range(2)] for _ in r] for r in responses],
        "sampling": {"top_k": 5, "top_p": 0.7, "min_p": 0.0},
    }
    reply = client.post("/logprobs", json=body).json()
    assert reply["usage"]["computed_tokens"] < reply["usage"]["input_tokens"]  # the prefix was shared
    _check(reference_models[name], body, reply)


def test_a_sequence_scored_in_chunks(
    served: tuple[str, TestClient], reference_models: dict[str, Any]
) -> None:
    name, client = served
    body = _ragged(random.Random(f"long-{name}"), (150,)) | {"top_logprobs": 4, "sampling": SAMPLING}
    body["num_actions"] = [140]
    _check(reference_models[name], body, client.post("/logprobs", json=body).json())


BAD = [
    ({"top_logprobs": 2000}, "top_logprobs", None),
    ({"top_logprobs": 0}, "top_logprobs", None),
    ({"candidate_ids": [1, 96]}, "candidate_ids", None),
    ({"candidate_ids": [[[1]] * 4, [[1]] * 7]}, "candidate_ids", 1),  # row 1's window has 8 entries
    ({"sampling": {"top_p": 0.0}}, "sampling", None),
    ({"sampling": {"top_p": 1.5}}, "sampling", None),
    ({"sampling": {"top_k": -2}}, "sampling", None),
    ({"sampling": {"min_p": -0.1}}, "sampling", None),
    ({"sampling": {"top_q": 1}}, "sampling", None),
]


@pytest.fixture(scope="module")
def qwen2(model_dirs: dict[str, Path]) -> Iterator[TestClient]:
    with running(settings_for(model_dirs["qwen2"])) as client:
        yield client


@pytest.mark.parametrize(("extra", "field", "row"), BAD)
def test_bad_asks_are_422_naming_field_and_row(
    qwen2: TestClient, extra: dict[str, Any], field: str, row: int | None
) -> None:
    body = _ragged(random.Random(0), (9, 17)) | extra
    reply = qwen2.post("/logprobs", json=body)
    assert reply.status_code == 422, reply.text
    error = reply.json()["error"]
    assert (error["field"], error.get("row")) == (field, row), error
