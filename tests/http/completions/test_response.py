"""The whole completions answer (response.completion_chunks) against orjson.dumps of the dict built the
obvious way from the same scores: vLLM's prompt_logprobs, OpenAI's echo + logprobs with the drawn
token, both, neither, with and without a tokenizer."""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson
import pytest

from service.core.jobs import SequenceScores
from service.http.completions import jsonwriter, response
from service.http.completions.jsonwriter import Positions
from service.http.completions.pieces import TokenPieces
from service.http.completions.plan import CompletionPlan
from service.http.completions.response import Drawn, completion_chunks
from tests.support.completions import (
    Table,
    clamp,
    openai_reference,
    positions,
    text_of,
    vllm_reference,
    vocabulary,
)

V = 300


def scored(
    prompt_len: int, plan: CompletionPlan, rng: np.random.Generator
) -> tuple[np.ndarray, SequenceScores]:
    """A prompt and its scores: positions 1 .. L-1 when the answer shows them, then the draw's."""
    k = max(plan.prompt_k or 0, plan.logprobs_k or 0, 1)
    actions = (prompt_len - 1 if plan.scores_prompt else 0) + (1 if plan.draw else 0)
    p = positions(actions, V, k, rng)
    prompt = np.concatenate([[1], rng.integers(0, V, size=prompt_len - 1)]).astype(np.int64)
    if plan.scores_prompt:
        prompt[1:] = p.token[: prompt_len - 1]
    return prompt, SequenceScores(
        logprobs=p.logprob, entropy=None, top_ids=p.top_ids, top_logprobs=p.top_logprobs, ranks=p.rank
    )


def reference_body(
    plan: CompletionPlan,
    prompts: list[np.ndarray],
    scores: list[SequenceScores],
    drawn: list[Drawn | None],
    table: Table | None,
) -> dict[str, Any]:
    choices = []
    for i, (prompt, s, d) in enumerate(zip(prompts, scores, drawn, strict=True)):
        assert s.ranks is not None
        assert s.top_ids is not None
        assert s.top_logprobs is not None
        n = len(prompt) - 1
        at = Positions(
            prompt[1:], s.logprobs[:n], s.ranks[:n], s.top_ids[:n].astype(np.int64), s.top_logprobs[:n]
        )
        logprobs = None
        if plan.logprobs_k is not None:
            k = plan.logprobs_k
            ids: list[int] = []
            token_logprobs: list[float | None] = []
            tops: list[Any] = []
            if plan.echo:
                ids = prompt.tolist()
                token_logprobs = [None, *(clamp(float(x)) for x in s.logprobs[:n])]
                tops = [None, *openai_reference(at, k, table)]
            if d is not None:
                ids.append(d.token)
                token_logprobs.append(clamp(d.logprob))
                last = Positions(
                    np.array([d.token]),
                    np.array([d.logprob]),
                    np.array([d.rank]),
                    s.top_ids[-1:].astype(np.int64),
                    s.top_logprobs[-1:],
                )
                tops += openai_reference(last, k, table)
            texts = [text_of(table, t) for t in ids]
            logprobs = {
                "tokens": texts,
                "token_logprobs": token_logprobs,
                "top_logprobs": tops,
                # into the text returned: "" without a tokenizer
                "text_offset": [sum(map(len, texts[:j])) if table else 0 for j in range(len(texts))],
            }
        generated = table.decode([d.token]) if table and d else ""
        choices.append(
            {
                "index": i,
                "text": (table.decode(prompt.tolist()) if table else "") + generated
                if plan.echo
                else generated,
                "logprobs": logprobs,
                "finish_reason": "length",
                "stop_reason": None,
                "prompt_logprobs": vllm_reference(at, plan.prompt_k, table)
                if plan.prompt_k is not None
                else None,
            }
        )
    tokens = sum(len(p) for p in prompts)
    drawn_count = len(prompts) if plan.draw else 0
    return {
        "id": "cmpl-test",
        "object": "text_completion",
        "created": 1700000000,
        "model": "teacher",
        "choices": choices,
        "usage": {
            "prompt_tokens": tokens,
            "completion_tokens": drawn_count,
            "total_tokens": tokens + drawn_count,
            "prompt_tokens_details": {"cached_tokens": 0},
        },
    }


@pytest.mark.parametrize(
    ("prompt_k", "logprobs_k", "echo", "draw"),
    [
        (3, None, False, False),  # TRL's teacher call (max_tokens 0)
        (5, None, False, True),  # TRL's, max_tokens 1
        (None, 2, True, False),  # lm-eval's loglikelihood
        (None, 2, True, True),
        (None, 3, False, True),  # the drawn token alone
        (None, 1, False, False),  # nothing scored
        (4, 2, True, True),  # both forms at once
        (0, 0, True, True),
    ],
)
@pytest.mark.parametrize("with_tokenizer", [True, False])
def test_the_answer_is_orjson_of_the_dicts(
    prompt_k: int | None, logprobs_k: int | None, echo: bool, draw: bool, with_tokenizer: bool
) -> None:
    check_answer(prompt_k, logprobs_k, echo, draw, with_tokenizer)


def test_blocks_on_threads_keep_their_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks of a few positions each, rendered on the pool's threads, read back in order."""
    monkeypatch.setattr(jsonwriter, "BLOCK_ENTRIES", 11)
    monkeypatch.setattr(response, "RENDER_THREADS", 3)
    check_answer(4, 2, True, True, True)


def check_answer(
    prompt_k: int | None, logprobs_k: int | None, echo: bool, draw: bool, with_tokenizer: bool
) -> None:
    rng = np.random.default_rng(11)
    table = vocabulary(V, rng) if with_tokenizer else None
    plan = CompletionPlan(
        prompts=[], jobs=[], prompt_k=prompt_k, logprobs_k=logprobs_k, echo=echo, draw=draw, greedy=False
    )
    made = [scored(length, plan, rng) for length in (7, 1, 30)]
    prompts, scores = [p for p, _ in made], [s for _, s in made]
    plan = CompletionPlan(
        prompts=prompts, jobs=[], prompt_k=prompt_k, logprobs_k=logprobs_k, echo=echo, draw=draw, greedy=False
    )
    drawn: list[Drawn | None] = [
        Drawn(int(rng.integers(V)), float(rng.standard_normal()), int(rng.integers(1, V))) if draw else None
        for _ in prompts
    ]
    chunks = completion_chunks(
        plan,
        scores,
        drawn,
        model="teacher",
        token_text=table,
        pieces=TokenPieces.build(table, V),
        request_id="cmpl-test",
        created=1700000000,
    )
    assert b"".join(chunks) == orjson.dumps(reference_body(plan, prompts, scores, drawn, table))
