"""A completions request -> its jobs, and every refusal naming its field (no model needed)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from service.core.errors import InvalidRequest, PayloadTooLarge, SequenceTooLarge, ServiceError
from service.core.jobs import AFTER_LAST
from service.http.completions.plan import plan_completion
from service.http.completions.schemas import CompletionRequest
from service.normalise import ModelLimits

LIMITS = ModelLimits(vocab_size=96, max_sequence_tokens=32, max_positions=64, max_request_sequences=4)
MAX_K = 20


def plan(**body: Any) -> Any:
    return plan_completion(CompletionRequest.model_validate(body), LIMITS, "teacher", MAX_K)


def test_trl_request_scores_every_prompt_position_and_the_position_after() -> None:
    p = plan(
        model="teacher", prompt=[[5, 6, 7], [5, 6, 8, 9]], max_tokens=1, temperature=0.7, prompt_logprobs=5
    )
    assert [j.tokens.tolist() for j in p.jobs] == [[5, 6, 7], [5, 6, 8, 9]]  # the prompts as they are
    assert [j.actions.tolist() for j in p.jobs] == [[1, 2, 3], [1, 2, 3, 4]]  # and one past each
    assert [j.targets.tolist() for j in p.jobs] == [[6, 7, AFTER_LAST], [6, 8, 9, AFTER_LAST]]
    assert all(j.temperature == 0.7 and j.top_logprobs == 5 for j in p.jobs)
    assert all(j.draw_seed is not None for j in p.jobs)  # T > 0: a seeded draw
    assert (p.prompt_k, p.logprobs_k, p.draw, p.greedy) == (5, None, True, False)
    assert (p.input_tokens, p.scored_tokens) == (7, 7)


def test_a_draw_no_answer_shows_is_not_made() -> None:
    """Without a tokenizer, TRL's call shows no drawn token (text "", no logprobs): no action L, no
    seed, only the prompt's positions (the head's radix select stays usable); still one completion token
    in usage. Where the draw shows (OpenAI logprobs) or is all the job scores, it is made."""
    body = {"prompt": [[5, 6, 7], [5, 6, 8, 9]], "max_tokens": 1, "temperature": 0.7, "prompt_logprobs": 5}
    p = plan_completion(CompletionRequest.model_validate(body), LIMITS, "teacher", MAX_K, shows_text=False)
    assert [j.tokens.tolist() for j in p.jobs] == [[5, 6, 7], [5, 6, 8, 9]]
    assert [j.actions.tolist() for j in p.jobs] == [[1, 2], [1, 2, 3]]
    assert all(j.draw_seed is None and j.top_logprobs == 5 for j in p.jobs)
    assert (p.draw, p.scores_draw) == (True, False)
    shown = plan_completion(
        CompletionRequest.model_validate(body | {"logprobs": 2}), LIMITS, "teacher", MAX_K, shows_text=False
    )
    assert shown.scores_draw
    assert all(j.draw_seed is not None and j.actions[-1] == j.tokens.shape[0] for j in shown.jobs)
    alone = plan_completion(
        CompletionRequest(prompt=[5, 6], max_tokens=1), LIMITS, "teacher", MAX_K, shows_text=False
    )
    assert alone.jobs[0].actions.tolist() == [2]
    assert alone.jobs[0].draw_seed is not None


def test_lm_eval_request_is_greedy_at_temperature_zero_scored_at_one() -> None:
    p = plan(prompt=[[5, 6, 7]], max_tokens=1, temperature=0, logprobs=1, echo=True, seed=1234)
    job = p.jobs[0]
    assert (job.temperature, job.top_logprobs, job.draw_seed) == (1.0, 1, None)
    assert job.actions.tolist() == [1, 2, 3]
    assert p.greedy


def test_one_flat_prompt_max_tokens_zero_and_the_seed_shared() -> None:
    p = plan(prompt=[5, 6, 7], prompt_logprobs=0)
    assert len(p.jobs) == 1
    assert p.jobs[0].tokens.tolist() == [5, 6, 7]
    assert p.jobs[0].actions.tolist() == [1, 2]
    assert p.jobs[0].top_logprobs == 1  # K = 0 still needs the head's ranks
    seeded = plan(prompt=[[5, 6], [7, 8]], max_tokens=1, seed=42)
    assert [j.draw_seed for j in seeded.jobs] == [42, 42]
    assert seeded.jobs[0].actions.tolist() == [2]  # no prompt log-probs asked: only the draw


def test_whole_vocabulary_is_clamped_to_it() -> None:
    limits = ModelLimits(vocab_size=16, max_sequence_tokens=32)
    p = plan_completion(CompletionRequest(prompt=[1, 2], prompt_logprobs=-1), limits, "teacher", MAX_K)
    assert p.prompt_k == 16
    np.testing.assert_array_equal(p.jobs[0].actions, [1])


@pytest.mark.parametrize(
    ("body", "error", "field", "row", "says"),
    [
        ({"prompt": "hello"}, InvalidRequest, "prompt", None, "token ids, not text"),
        ({"prompt": ["hello", "world"]}, InvalidRequest, "prompt", None, "token ids, not text"),
        ({"prompt": []}, InvalidRequest, "prompt", None, "no token ids"),
        ({"prompt": [[1], []]}, InvalidRequest, "prompt", 1, "no token ids"),
        ({"prompt": [1], "n": 2}, InvalidRequest, "n", None, "one"),
        ({"prompt": [1], "stream": True}, InvalidRequest, "stream", None, "streaming"),
        ({"prompt": [1], "max_tokens": 16}, InvalidRequest, "max_tokens", None, "0 or 1"),
        ({"prompt": [1, 2], "prompt_logprobs": 21}, InvalidRequest, "prompt_logprobs", None, "at most 20"),
        ({"prompt": [1, 2], "prompt_logprobs": -1}, InvalidRequest, "prompt_logprobs", None, "96 tokens"),
        ({"prompt": [1, 2], "logprobs": 21, "echo": True}, InvalidRequest, "logprobs", None, "at most 20"),
        ({"prompt": [1], "model": "other"}, InvalidRequest, "model", None, "'teacher'"),
        ({"prompt": [1], "top_p": 0.9}, InvalidRequest, "top_p", None, "0.9"),
        ({"prompt": [1], "best_of": 2}, InvalidRequest, "best_of", None, "2"),
        ({"prompt": [1], "logit_bias": {"5": 1}}, InvalidRequest, "logit_bias", None, "not served"),
        ({"prompt": [[1, 2], [3, 96]]}, InvalidRequest, "prompt", 1, "token id 96 (token 1)"),
        ({"prompt": [[1]] * 5}, PayloadTooLarge, "prompt", None, "at most 4"),
        ({"prompt": [[1], [2] * 33]}, SequenceTooLarge, "prompt", 1, "33 tokens"),
        ({"prompt": [[1], [2] * 32], "max_tokens": 1}, SequenceTooLarge, "prompt", 1, "and the drawn one"),
        ({"prompt": [[1], [2] * 65]}, InvalidRequest, "prompt", 1, "positions cover 64"),
    ],
)
def test_refusals_name_the_field(
    body: dict[str, Any], error: type[ServiceError], field: str, row: int | None, says: str
) -> None:
    with pytest.raises(error) as caught:
        plan(**body)
    assert type(caught.value) is error
    assert (caught.value.field, caught.value.row) == (field, row)
    assert says in caught.value.message


def test_unknown_fields_are_ignored_and_defaults_accepted() -> None:
    p = plan(prompt=[1, 2], user="me", stop=["\n"], top_p=1.0, top_k=-1, n=1, stream=False, max_tokens=0)
    assert len(p.jobs) == 1
