"""A distillation teacher's calls repeating one system prompt (vLLM skips its prefix cache for
prompt_logprobs; logprobd does not): the system prompt is computed by the first call only, later calls
read its keys and hidden states, and their prompt_logprobs still equal the float64 reference.
`usage.prompt_tokens_details.cached_tokens` says what the cache served, as OpenAI's usage does."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from service.core.cache_plan import BLOCK
from tests.support import models
from tests.support.device import settings_for
from tests.support.servers import running
from tests.support.teacher import TOLERANCE, Reference


def _check(choice: dict[str, Any], prompt: list[int], reference: Reference, k: int) -> None:
    entries = choice["prompt_logprobs"]
    assert len(entries) == len(prompt)
    lp = reference.logprobs(prompt)
    for p in range(1, len(prompt)):
        row, entry = lp[p - 1], entries[p]
        assert abs(entry[str(prompt[p])]["logprob"] - row[prompt[p]].item()) < TOLERANCE
        top = sorted(entry.items(), key=lambda kv: kv[1]["rank"])[:k]
        for token, logprob in top:
            assert abs(logprob["logprob"] - row[int(token)].item()) < TOLERANCE


def test_a_repeated_system_prompt_is_computed_once(teacher_dir: Path, teacher_reference: Reference) -> None:
    rng = random.Random("teacher-system-prompt")
    system = [rng.randrange(3, models.VOCAB) for _ in range(5 * BLOCK + 4)]
    prompts = [[*system, 3 + i, *(rng.randrange(3, models.VOCAB) for _ in range(20))] for i in range(4)]
    k = 2
    with running(settings_for(teacher_dir)) as client:

        def call(prompt: list[int]) -> dict[str, Any]:
            body = {"model": "teacher", "prompt": [prompt], "max_tokens": 1, "prompt_logprobs": k}
            reply = client.post("/v1/completions", json=body)
            assert reply.status_code == 200, reply.text
            answer: dict[str, Any] = reply.json()
            return answer

        first = call(prompts[0])
        assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        _check(first["choices"][0], prompts[0], teacher_reference, k)
        for prompt in prompts[1:3]:  # one after another: each reads the system prompt's 5 blocks
            answer = call(prompt)
            assert answer["usage"]["prompt_tokens_details"] == {"cached_tokens": 5 * BLOCK}
            assert answer["usage"]["prompt_tokens"] == len(prompt)
            _check(answer["choices"][0], prompt, teacher_reference, k)
        with ThreadPoolExecutor(max_workers=2) as pool:  # the same prompt twice at once: read, or shared
            answers = list(pool.map(call, [prompts[3], prompts[3]]))
        for answer in answers:
            assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] >= 5 * BLOCK
            _check(answer["choices"][0], prompts[3], teacher_reference, k)
