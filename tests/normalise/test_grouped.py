"""The grouped form (prompt_ids + prompt_index): each row is a response, scored as its prompt + it.

Hand-written requests with tokens, actions and windows worked out by reading docs/api.md's
'Grouped requests'; random requests of every response layout against their ungrouped twins
(tests/support/requests.py), which must give the very same jobs; the errors, naming field and row; then
through the real app (a tiny qwen2 with a critic and a reference model), in JSON and in frames:
the twin's scores, the per-sequence reference's, and a fraction of the bytes.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient

from service.client.wire import from_frame
from service.client.wire import to_frame as wire_frame
from service.core.errors import InvalidRequest, PayloadTooLarge, SequenceTooLarge
from service.core.prefixes import share
from service.normalise import ModelLimits, normalise
from service.settings import Settings
from service.wire.frame import MEDIA_TYPE
from service.wire.schemas import LogprobsRequest
from tests.support import critics, models
from tests.support.device import TOLERANCE, settings_for
from tests.support.plans import LIMITS, plan_of, rows_of
from tests.support.reference import expected, max_diff
from tests.support.requests import GROUPED_LAYOUTS, make_grouped
from tests.support.servers import running

PROMPTS = [[5, 6, 7], [8, 9]]


def grouped(**fields: Any) -> dict[str, Any]:
    return {"prompt_ids": PROMPTS, "prompt_index": [0, 1, 0], **fields}


# ---------------------------------------------------------------- by hand


def test_ragged_responses_every_token_is_an_action() -> None:
    plan = plan_of(**grouped(input_ids=[[10, 11], [12], [13, 14, 15]]))
    assert rows_of(plan) == [
        ([5, 6, 7, 10, 11], [3, 4], 2, [0, 1]),  # prompt 0 (3 tokens) + response: positions 3, 4
        ([8, 9, 12], [2], 1, [0]),
        ([5, 6, 7, 13, 14, 15], [3, 4, 5], 3, [0, 1, 2]),
    ]
    assert (plan.input_tokens, plan.scored_tokens) == (5 + 3 + 6, 6)


def test_ragged_responses_num_actions_marks_the_last_ones_of_a_response_wide_window() -> None:
    plan = plan_of(**grouped(input_ids=[[10, 11], [12], [13, 14, 15]], num_actions=[1, 0, 3]))
    assert rows_of(plan) == [
        ([5, 6, 7, 10, 11], [4], 2, [1]),
        ([8, 9, 12], [], 1, []),
        ([5, 6, 7, 13, 14, 15], [3, 4, 5], 3, [0, 1, 2]),
    ]
    same = plan_of(**grouped(input_ids=[[10, 11], [12], [13, 14, 15]], num_actions=1))
    assert [actions for _, actions, _, _ in rows_of(same)] == [[4], [2], [5]]


def test_ragged_responses_action_mask_per_response_token() -> None:
    plan = plan_of(**grouped(input_ids=[[10, 11], [12], [13, 14, 15]], action_mask=[[1, 0], [0], [0, 1, 1]]))
    assert rows_of(plan) == [
        ([5, 6, 7, 10, 11], [3], 2, [0]),
        ([8, 9, 12], [], 1, []),
        ([5, 6, 7, 13, 14, 15], [4, 5], 3, [1, 2]),
    ]


def test_an_empty_response_scores_nothing_and_keeps_its_prompt() -> None:
    plan = plan_of(**grouped(input_ids=[[], [12], [13]]))
    assert rows_of(plan)[0] == ([5, 6, 7], [], 0, [])


def test_padded_responses_window_is_the_r_columns() -> None:
    ids = [[10, 11, 0], [12, 0, 0], [0, 13, 14]]  # right-padded, right-padded, left-padded
    mask = [[1, 1, 0], [1, 0, 0], [0, 1, 1]]
    plan = plan_of(**grouped(input_ids=ids, attention_mask=mask))
    assert rows_of(plan) == [
        ([5, 6, 7, 10, 11], [3, 4], 3, [0, 1]),
        ([8, 9, 12], [2], 3, [0]),
        ([5, 6, 7, 13, 14], [3, 4], 3, [1, 2]),  # column 0 is padding: columns 1, 2 are positions 3, 4
    ]
    narrowed = plan_of(
        **grouped(input_ids=ids, attention_mask=mask, action_mask=[[0, 1, 0], [1, 0, 0], [0, 0, 1]])
    )
    assert rows_of(narrowed) == [
        ([5, 6, 7, 10, 11], [4], 3, [1]),
        ([8, 9, 12], [2], 3, [0]),
        ([5, 6, 7, 13, 14], [4], 3, [2]),
    ]


def test_padding_values_of_a_response_are_never_read() -> None:
    plan = plan_of(**grouped(input_ids=[[10, 999], [12, 50], [13, 2**70]], attention_mask=[[1, 0]] * 3))
    assert [tokens for tokens, _, _, _ in rows_of(plan)] == [[5, 6, 7, 10], [8, 9, 12], [5, 6, 7, 13]]


def test_eos_cuts_within_the_response_never_in_the_prompt() -> None:
    # prompt 0 holds the EOS id 7: prompts are never actions, so it cuts nothing
    plan = plan_of(**grouped(input_ids=[[10, 7, 11], [7, 12], [13]], eos_token_id=7))
    assert rows_of(plan) == [
        ([5, 6, 7, 10, 7, 11], [3, 4], 3, [0, 1]),  # the EOS stays an action, 11 after it is dropped
        ([8, 9, 7, 12], [2], 2, [0]),
        ([5, 6, 7, 13], [3], 1, [0]),
    ]


def test_rollout_logprobs_are_laid_out_like_the_responses() -> None:
    plan = plan_of(
        **grouped(input_ids=[[10, 11], [12], [13, 14, 15]], action_mask=[[1, 0], [1], [0, 1, 1]]),
        rollout_logprobs=[[-1.0, 0.0], [-2.0], [0.0, -3.0, -4.0]],
    )
    assert plan.rollout is not None
    assert [r.tolist() for r in plan.rollout] == [[-1.0], [-2.0], [-3.0, -4.0]]


def test_options_reach_every_job() -> None:
    plan = plan_of(**grouped(input_ids=[[10], [12], [13]], temperature=0.5, return_entropy=True))
    assert {(job.temperature, job.return_entropy) for job in plan.jobs} == {(0.5, True)}


# ---------------------------------------------------------------- against the ungrouped twin


@pytest.mark.parametrize("layout", GROUPED_LAYOUTS)
def test_a_grouped_request_gives_the_jobs_of_its_ungrouped_twin(layout: str) -> None:
    rng = random.Random(layout)
    limits = ModelLimits(vocab_size=40, max_sequence_tokens=64)
    for _ in range(40):
        body, twin = make_grouped(layout, rng, vocab=40)
        got, want = normalise(LogprobsRequest(**body), limits), normalise(LogprobsRequest(**twin), limits)
        assert len(got.jobs) == len(want.jobs) == len(body["input_ids"])
        for g, w, gw, ww in zip(got.jobs, want.jobs, got.windows, want.windows, strict=True):
            assert g.tokens.tolist() == w.tokens.tolist()
            assert g.actions.tolist() == w.actions.tolist()
            assert (g.temperature, g.return_entropy) == (w.temperature, w.return_entropy)
            # the grouped window is the response: the last entries of the twin's window
            assert gw.slots.tolist() == (ww.slots - (ww.width - gw.width)).tolist()
        assert (got.input_tokens, got.scored_tokens) == (want.input_tokens, want.scored_tokens)
        widths = [w.width for w in got.windows]
        responses = body["input_ids"]
        assert widths == (
            [len(r) for r in responses]
            if layout.startswith("ragged")
            else [len(responses[0])] * len(responses)
        )


def test_identical_rows_give_identical_jobs() -> None:
    plan = plan_of(prompt_ids=[[3, 4]], prompt_index=[0, 0], input_ids=[[5, 6], [5, 6]], eos_token_id=6)
    assert rows_of(plan) == [([3, 4, 5, 6], [2, 3], 2, [0, 1])] * 2


# ---------------------------------------------------------------- errors


BAD: dict[str, tuple[dict[str, Any], str, int | None]] = {
    "prompt_index_missing": ({"prompt_ids": PROMPTS, "input_ids": [[1]]}, "prompt_index", None),
    "prompt_ids_missing": ({"prompt_index": [0], "input_ids": [[1]]}, "prompt_ids", None),
    "prompt_index_short": (grouped(input_ids=[[1], [2], [3], [4]]), "prompt_index", None),
    "prompt_index_long": (grouped(input_ids=[[1], [2]]), "prompt_index", None),
    "prompt_index_out_of_range": (
        grouped(input_ids=[[1], [2], [3]], prompt_index=[0, 1, 2]),
        "prompt_index",
        2,
    ),
    "prompt_empty": (grouped(input_ids=[[1], [2], [3]], prompt_ids=[[5], []]), "prompt_ids", 1),
    "prompt_outside_vocabulary": (
        grouped(input_ids=[[1], [2], [3]], prompt_ids=[[5], [6, 50]]),
        "prompt_ids",
        1,
    ),
    "prompt_huge_id": (grouped(input_ids=[[1], [2], [3]], prompt_ids=[[5], [2**70]]), "prompt_ids", 1),
    "response_outside_vocabulary": (grouped(input_ids=[[1], [2], [3, 50]]), "input_ids", 2),
    "response_length": (grouped(input_ids=[[1], [2], [3]], response_length=1), "response_length", None),
    "num_actions_and_action_mask": (
        grouped(input_ids=[[1], [2], [3]], num_actions=1, action_mask=[[1], [1], [1]]),
        "action_mask",
        None,
    ),
    "num_actions_over_the_response": (grouped(input_ids=[[1], [2, 3], [3]], num_actions=2), "num_actions", 0),
    "num_actions_padded": (
        grouped(input_ids=[[1], [2], [3]], attention_mask=[[1], [1], [1]], num_actions=1),
        "num_actions",
        None,
    ),
    "action_mask_over_the_prompt": (
        grouped(input_ids=[[1], [2], [3]], action_mask=[[1], [0, 1], [1]]),
        "action_mask",
        1,
    ),
    "action_mask_on_padding": (
        grouped(
            input_ids=[[1, 0], [2, 0], [3, 0]],
            attention_mask=[[1, 0]] * 3,
            action_mask=[[1, 0], [1, 1], [1, 0]],
        ),
        "action_mask",
        1,
    ),
    "padded_responses_unequal": (
        grouped(input_ids=[[1, 0], [2], [3, 0]], attention_mask=[[1, 0]] * 3),
        "input_ids",
        1,
    ),
    "attention_mask_rows": (
        grouped(input_ids=[[1, 0], [2, 0], [3, 0]], attention_mask=[[1, 0]] * 2),
        "attention_mask",
        None,
    ),
}


@pytest.mark.parametrize(("body", "field", "row"), list(BAD.values()), ids=list(BAD))
def test_a_bad_grouped_request_names_field_and_row(body: dict[str, Any], field: str, row: int | None) -> None:
    with pytest.raises(InvalidRequest) as raised:
        plan_of(**body)
    assert (raised.value.field, raised.value.row) == (field, row)
    assert field in raised.value.message


def test_sizes_count_the_tokens_the_sequences_expand_to() -> None:
    body = grouped(input_ids=[[10, 11], [12], [13, 14, 15]])  # 6 response tokens, 14 expanded
    limits = ModelLimits(vocab_size=50, max_sequence_tokens=12, max_request_tokens=14)
    assert plan_of(limits, **body).input_tokens == 14
    with pytest.raises(PayloadTooLarge, match="14 tokens"):
        plan_of(ModelLimits(vocab_size=50, max_sequence_tokens=12, max_request_tokens=13), **body)
    # a sequence's length is its prompt's plus its response's
    with pytest.raises(SequenceTooLarge) as raised:
        plan_of(ModelLimits(vocab_size=50, max_sequence_tokens=5, max_positions=64), **body)
    assert (raised.value.field, raised.value.row) == ("input_ids", 2)
    assert "prompt 0" in raised.value.message


def test_a_prompt_no_row_names_is_ignored_whatever_it_holds() -> None:
    """docs/api.md: 'a prompt that no row names is ignored': empty, outside the vocabulary, beyond
    64 bits or longer than any sequence may be, it neither fails the request nor counts in its size."""
    limits = ModelLimits(vocab_size=50, max_sequence_tokens=12, max_request_tokens=12)
    for unused in ([], [60], [2**70], list(range(1, 20))):
        # prompt 1 is named by no row; rows 0 and 2 continue prompt 0, row 1 prompt 2
        plan = plan_of(
            limits,
            prompt_ids=[PROMPTS[0], unused, PROMPTS[1]],
            prompt_index=[0, 2, 0],
            input_ids=[[10, 11], [12], [13]],
        )
        assert rows_of(plan) == [
            ([5, 6, 7, 10, 11], [3, 4], 2, [0, 1]),
            ([8, 9, 12], [2], 1, [0]),
            ([5, 6, 7, 13], [3], 1, [0]),
        ]
        assert (plan.input_tokens, plan.scored_tokens) == (5 + 3 + 4, 4)


def test_error_row_is_a_row_of_input_ids_even_for_a_prompt() -> None:
    """A prompt's fault is reported at the first row that continues it, the row a client maps back."""
    with pytest.raises(InvalidRequest) as raised:
        plan_of(LIMITS, prompt_ids=[[1], [60]], prompt_index=[0, 0, 1, 1], input_ids=[[2]] * 4)
    assert (raised.value.field, raised.value.row) == ("prompt_ids", 2)
    assert "prompt_ids[1]" in raised.value.message


# ---------------------------------------------------------------- through the real app


@pytest.fixture(scope="module")
def server(
    model_dirs: dict[str, Path], ref_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TestClient]:
    critic_dir = critics.save("openrlhf", tmp_path_factory.mktemp("critic") / "openrlhf")
    # the same rows posted in several forms, their usage compared: no prefix cache between them
    settings = settings_for(model_dirs["qwen2"], critic=critic_dir, ref_model=ref_dir, prefix_cache=False)
    with running(settings) as client:
        yield client


def post(server: TestClient, body: dict[str, Any], framed: bool = False) -> tuple[dict[str, Any], int]:
    """The answer (a JSON body, or a frame decoded to the same dict) and the request's bytes."""
    if framed:
        raw = wire_frame(body)
        assert raw is not None
        reply = server.post(
            "/logprobs", content=raw, headers={"content-type": MEDIA_TYPE, "accept": MEDIA_TYPE}
        )
        assert reply.status_code == 200, reply.text
        return from_frame(reply.content), len(raw)
    raw = json.dumps(body, separators=(",", ":")).encode()
    reply = server.post("/logprobs", content=raw, headers={"content-type": "application/json"})
    assert reply.status_code == 200, reply.text
    answer: dict[str, Any] = reply.json()
    return answer, len(raw)


def responses_of(rows: list[list[Any]], widths: list[int]) -> list[list[Any]]:
    """The last `width` entries of each row: the twin's window ends with the response."""
    return [row[len(row) - w :] for row, w in zip(rows, widths, strict=True)]


ROWS = ("logprobs", "entropy", "values", "ref_logprobs", "kl")


@pytest.mark.parametrize("layout", GROUPED_LAYOUTS)
def test_grouped_json_and_frames_score_as_the_ungrouped_request(
    server: TestClient, reference_models: dict[str, Any], layout: str
) -> None:
    rng = random.Random(f"e2e-{layout}")
    for _ in range(2):
        body, twin = make_grouped(layout, rng, vocab=models.VOCAB, rows=10)
        for request in (body, twin):
            request.update(
                return_values=True, return_ref_logprobs=True, kl_estimator="k3", return_entropy=True
            )
        want, _ = post(server, twin)
        got, _ = post(server, body)
        framed, _ = post(server, body, framed=True)
        widths = [len(row) for row in got["logprobs"]]
        assert widths == [len(row) for row in framed["logprobs"]]
        assert got["action_mask"] == framed["action_mask"] == responses_of(want["action_mask"], widths)
        assert got["usage"] == framed["usage"] == want["usage"]
        for name in ROWS:
            expected_rows = responses_of(want[name], widths)
            for answer in (got, framed):
                for g, w in zip(answer[name], expected_rows, strict=True):
                    np.testing.assert_allclose(
                        np.asarray(g, np.float32), np.asarray(w, np.float32), atol=1e-5, rtol=0
                    )
        # and the scores are the model's own, one unpadded sequence at a time
        reference = expected(reference_models["qwen2"], twin)
        assert got["action_mask"] == responses_of(reference.action_mask, widths)
        assert max_diff(got["logprobs"], responses_of(reference.logprobs, widths)) <= TOLERANCE
        assert max_diff(got["entropy"], responses_of(reference.entropy, widths)) <= TOLERANCE


def test_rollout_logprobs_and_pins_work_grouped(server: TestClient) -> None:
    body = grouped(
        input_ids=[[10, 11, 0], [12, 0, 0], [13, 14, 15]], attention_mask=[[1, 1, 0], [1, 0, 0], [1, 1, 1]]
    )
    scored, _ = post(server, body)
    rollout = [
        [v - 0.5 if m else -1e9 for v, m in zip(row, mask, strict=True)]
        for row, mask in zip(scored["logprobs"], scored["action_mask"], strict=True)
    ]
    got, _ = post(server, {**body, "rollout_logprobs": rollout, "weights_version": scored["weights_version"]})
    assert got["rollout"]["tokens"] == 6
    assert got["rollout"]["mean_abs_diff"] == pytest.approx(0.5, abs=1e-5)
    pinned = server.post("/logprobs", json={**body, "weights_version": "another"})
    assert pinned.status_code == 409
    assert pinned.json()["error"]["type"] == "weights_version_mismatch"


def test_a_grpo_batch_of_g_8_is_a_fraction_of_the_bytes_and_scores_the_same(server: TestClient) -> None:
    """4 prompts of 120 tokens, 8 responses of 10-30 tokens each: the prompts go once instead of 8 times."""
    rng = random.Random(8)
    prompts = [[rng.randrange(3, models.VOCAB) for _ in range(120)] for _ in range(4)]
    index = [p for p in range(4) for _ in range(8)]
    responses = [[rng.randrange(3, models.VOCAB) for _ in range(rng.randint(10, 30))] for _ in index]
    body = {"prompt_ids": prompts, "prompt_index": index, "input_ids": responses}
    flat = {
        "input_ids": [prompts[p] + r for p, r in zip(index, responses, strict=True)],
        "num_actions": [len(r) for r in responses],
    }
    sent = {}
    for framed in (False, True):
        got, sent[framed, "grouped"] = post(server, body, framed)
        want, sent[framed, "flat"] = post(server, flat, framed)
        assert got["action_mask"] == want["action_mask"]
        assert (
            got["usage"]
            == want["usage"]
            == {
                "input_tokens": 32 * 120 + sum(map(len, responses)),
                "scored_tokens": sum(map(len, responses)),
                # each prompt once (and the odd response token two responses share)
                "computed_tokens": share(
                    [np.asarray(prompts[p] + r) for p, r in zip(index, responses, strict=True)],
                    Settings().share_min_tokens,
                ).computed_tokens,
                "cached_tokens": 0,
            }
        )
        assert got["usage"]["computed_tokens"] <= 4 * 120 + sum(map(len, responses))
        for g, w in zip(got["logprobs"], want["logprobs"], strict=True):
            np.testing.assert_allclose(
                np.asarray(g, np.float32), np.asarray(w, np.float32), atol=1e-5, rtol=0
            )
    # tokens on the wire: 4 * 120 + ~640 against 32 * 120 + ~640
    assert sent[False, "grouped"] < 0.3 * sent[False, "flat"]
    assert sent[True, "grouped"] < 0.3 * sent[True, "flat"]


def test_a_prompt_no_row_names_is_ignored_over_http_in_json_and_in_frames(server: TestClient) -> None:
    twin = grouped(input_ids=[[10, 11], [12], [13]])
    body = {**twin, "prompt_ids": [PROMPTS[0], [], PROMPTS[1], [4000]], "prompt_index": [0, 2, 0]}
    want, _ = post(server, twin)
    for framed in (False, True):
        got, _ = post(server, body, framed)
        assert got["action_mask"] == want["action_mask"] == [[1, 1], [1], [1]]
        assert got["usage"]["input_tokens"] == want["usage"]["input_tokens"] == 5 + 3 + 4
        for g, w in zip(got["logprobs"], want["logprobs"], strict=True):
            np.testing.assert_allclose(
                np.asarray(g, np.float32), np.asarray(w, np.float32), atol=1e-5, rtol=0
            )


def test_a_bad_grouped_request_over_http_is_a_422_in_json_and_in_frames(server: TestClient) -> None:
    body = grouped(input_ids=[[10], [12], [13]], prompt_index=[0, 1, 2])
    framed = wire_frame(body)
    assert framed is not None
    for reply in (
        server.post("/logprobs", json=body),
        server.post("/logprobs", content=framed, headers={"content-type": MEDIA_TYPE, "accept": MEDIA_TYPE}),
    ):
        assert reply.status_code == 422
        error = reply.json()["error"]
        assert (error["field"], error["row"]) == ("prompt_index", 2)


@pytest.mark.parametrize(("prompts", "noun"), [(1, "1 prompt"), (2, "2 prompts")])
def test_a_prompt_index_past_the_prompts_counts_them_in_words(prompts: int, noun: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        plan_of(prompt_ids=[[1, 2]] * prompts, prompt_index=[prompts], input_ids=[[3, 4]])
    assert str(caught.value) == f"prompt_index[0] is {prompts}; prompt_ids holds {noun}"
