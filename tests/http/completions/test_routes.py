"""/v1/completions' answer field by field against the float64 reference, /v1/models, /health, and
bad input over HTTP (422 naming the field, nothing scored)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.support import models
from tests.support.device import eager, settings_for
from tests.support.servers import running
from tests.support.teacher import MAX_TOP, TOLERANCE, Reference, top_k

PROMPTS = [[1, 17, 23, 5, 9], [1, 17, 23, 60]]


def rank(row: Any, token: int) -> int:
    return int((row > row[token]).sum()) + 1


def post(url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def test_prompt_logprobs_as_vllm_returns_them(teacher_server: str, teacher_reference: Reference) -> None:
    k, t = 3, 0.7
    reply = post(
        teacher_server,
        {"model": "teacher", "prompt": PROMPTS, "max_tokens": 1, "temperature": t, "prompt_logprobs": k},
    )
    assert reply.status_code == 200, reply.text
    assert int(reply.headers["content-length"]) == len(reply.content)  # under a chunk: sent whole
    assert reply.headers["content-type"] == "application/json"
    body = reply.json()
    assert body["object"] == "text_completion"
    assert body["model"] == "teacher"
    assert body["usage"] == {
        "prompt_tokens": 9,
        "completion_tokens": 2,
        "total_tokens": 11,
        "prompt_tokens_details": {"cached_tokens": 0},  # prompts of 4 and 5 tokens: no whole block
    }
    assert [c["index"] for c in body["choices"]] == [0, 1]
    for prompt, choice in zip(PROMPTS, body["choices"], strict=True):
        entries = choice["prompt_logprobs"]
        assert len(entries) == len(prompt)
        assert entries[0] is None
        lp = teacher_reference.logprobs(prompt, t)
        for p in range(1, len(prompt)):
            row, entry = lp[p - 1], entries[p]
            token = prompt[p]
            top = top_k(row, k)
            keys = [str(token), *(str(v) for v in top if v != token)]
            assert list(entry) == keys  # the prompt token first, then the top K by rank
            assert entry[str(token)]["rank"] == rank(row, token)
            for v in {token, *top}:
                assert entry[str(v)]["decoded_token"] == (f"w{v}" if v > 2 else ["<pad>", "<s>", "</s>"][v])
                assert abs(entry[str(v)]["logprob"] - row[v].item()) < TOLERANCE
            assert [entry[str(v)]["rank"] for v in top] == list(range(1, k + 1))
        assert choice["logprobs"] is None
        assert choice["finish_reason"] == "length"


def test_echo_logprobs_as_openai_and_the_greedy_token(
    teacher_server: str, teacher_reference: Reference
) -> None:
    prompt = PROMPTS[0]
    reply = post(
        teacher_server, {"prompt": [prompt], "max_tokens": 1, "temperature": 0, "logprobs": 2, "echo": True}
    )
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    lp = teacher_reference.logprobs(prompt)
    greedy = int(lp[-1].argmax())
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == [f"w{v}" if v > 2 else "<s>" for v in prompt] + [f"w{greedy}"]
    assert logprobs["token_logprobs"][0] is None
    assert logprobs["top_logprobs"][0] is None
    for p in range(1, len(prompt) + 1):
        token = prompt[p] if p < len(prompt) else greedy
        assert abs(logprobs["token_logprobs"][p] - lp[p - 1, token].item()) < TOLERANCE
        top = logprobs["top_logprobs"][p]
        assert 1 <= len(top) <= 3  # the position's token and the 2 most likely
        assert abs(max(top.values()) - lp[p - 1].max().item()) < TOLERANCE
    offsets = [0]
    for token in logprobs["tokens"][:-1]:
        offsets.append(offsets[-1] + len(token))
    assert logprobs["text_offset"] == offsets
    assert choice["text"].endswith(f"w{greedy}")


def test_a_seeded_draw_repeats_and_lies_in_the_vocabulary(teacher_server: str) -> None:
    body = {"prompt": [PROMPTS[0]] * 3, "max_tokens": 1, "temperature": 1.0, "seed": 7, "logprobs": 1}
    first = post(teacher_server, body).json()["choices"]
    again = post(teacher_server, body).json()["choices"]
    tokens = [c["logprobs"]["tokens"][0] for c in first]
    assert tokens == [c["logprobs"]["tokens"][0] for c in again]
    assert len(set(tokens)) == 1  # one seed, one prompt: one token, as vLLM's per-request seed
    assert all(c["logprobs"]["token_logprobs"][0] <= 0 for c in first)


def test_models_and_health(teacher_server: str) -> None:
    models = httpx.get(f"{teacher_server}/v1/models").json()
    assert models["object"] == "list"
    assert (
        [m["id"] for m in models["data"]]
        == [httpx.get(f"{teacher_server}/info").json()["model"]]
        == ["teacher"]
    )
    assert httpx.get(f"{teacher_server}/health").status_code == 200


@pytest.mark.parametrize(
    ("body", "field", "row"),
    [
        ({"prompt": "the capital of France"}, "prompt", None),
        ({"prompt": [1, 2], "n": 4}, "n", None),
        ({"prompt": [1, 2], "stream": True}, "stream", None),
        ({"prompt": [1, 2], "max_tokens": 16}, "max_tokens", None),
        ({"prompt": [1, 2], "prompt_logprobs": MAX_TOP + 1}, "prompt_logprobs", None),
        ({"prompt": [1, 2], "prompt_logprobs": -1}, "prompt_logprobs", None),
        ({"prompt": [[1, 2], [3, 4000]]}, "prompt", 1),
        ({"prompt": [1, 2], "model": "gpt-4"}, "model", None),
        ({"prompt": [1, 2], "temperature": -1}, "temperature", None),
        ({"prompt": [1, 2], "top_p": 0.5}, "top_p", None),
    ],
)
def test_bad_input_is_a_422_naming_the_field(
    teacher_server: str, body: dict[str, Any], field: str, row: int | None
) -> None:
    reply = post(teacher_server, body)
    assert reply.status_code == 422, reply.text
    error = reply.json()["error"]
    assert (error["type"], error["field"], error.get("row")) == ("invalid_request", field, row)


def test_a_large_answer_arrives_whole(teacher_server: str) -> None:
    """Twelve prompts of 250 tokens, K = 64: blocks rendered on the pool, each sent as it is done
    (chunked transfer: the length is known only at the end), all of them, in order."""
    prompts = [[1, *((np.arange(249) * (7 + i)) % 90 + 3).tolist()] for i in range(12)]
    reply = post(teacher_server, {"prompt": prompts, "max_tokens": 0, "prompt_logprobs": MAX_TOP})
    assert reply.status_code == 200, reply.text
    assert reply.headers["transfer-encoding"] == "chunked"
    assert len(reply.content) > 8 << 20
    choices = reply.json()["choices"]
    assert [c["index"] for c in choices] == list(range(12))
    for prompt, choice in zip(prompts, choices, strict=True):
        entries = choice["prompt_logprobs"]
        assert len(entries) == len(prompt)
        for p in (1, 150, 249):
            entry = entries[p]
            assert next(iter(entry)) == str(prompt[p])
            assert len(entry) in (MAX_TOP, MAX_TOP + 1)
            assert sorted(e["rank"] for e in entry.values())[: MAX_TOP - 1] == list(range(1, MAX_TOP))


def test_the_token_after_a_prompt_in_chunks_and_shared(model_dirs: dict[str, Path]) -> None:
    """The distribution after each prompt is the action one past its last token (no token appended):
    a prompt longer than the budget (scored in chunks, the action in the last), two prompts sharing
    a prefix (and one that is that prefix), and one of a single token; the greedy token and OpenAI's
    top entries at that position against the float64 reference (no tokenizer: tokens are vLLM's
    `token_id:<id>`)."""
    rng = np.random.default_rng(11)
    shared = rng.integers(3, models.VOCAB, 20).tolist()
    prompts = [
        rng.integers(3, models.VOCAB, 150).tolist(),
        [*shared, 5, 9],
        [*shared, 7],
        shared,  # wholly the others' prefix: its last position is in their shared node
        [1],
    ]
    settings = settings_for(  # on the CPU in float32, as the served teacher (its tolerance)
        model_dirs["qwen2"],
        max_batch_tokens=64,
        share_min_tokens=4,
        device="cpu",
        dtype="float32",
        attention="auto",
    )
    body = {"prompt": prompts, "max_tokens": 1, "temperature": 0, "logprobs": 3, "echo": True}
    with running(settings) as client:
        reply = client.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    reference = Reference(eager(model_dirs["qwen2"]).double())
    for prompt, choice in zip(prompts, reply.json()["choices"], strict=True):
        lp = reference.logprobs(prompt)[-1]  # the distribution after the prompt's last token
        greedy = top_k(lp, 1)[0]
        logprobs = choice["logprobs"]
        assert logprobs["tokens"][-1] == f"token_id:{greedy}"
        assert len(logprobs["tokens"]) == len(prompt) + 1
        assert abs(logprobs["token_logprobs"][-1] - lp[greedy].item()) < TOLERANCE
        top = logprobs["top_logprobs"][-1]
        assert list(top) == [f"token_id:{v}" for v in top_k(lp, 3)]
        np.testing.assert_allclose(list(top.values()), [lp[v].item() for v in top_k(lp, 3)], atol=TOLERANCE)
