"""A CompletionRequest -> the SequenceJobs that score it, after every check that names a field.

Each prompt x_0 .. x_{L-1} is one job. Its prompt positions 1 .. L-1 are actions when the answer
carries prompt log-probs (`prompt_logprobs`, or `echo` with `logprobs`); with `max_tokens` 1, the
distribution after the last token is scored as the action one past it, L (SequenceJob): the head
reads logits at L-1, and only that position's top-K and draw are used, never its own log-prob (of
token AFTER_LAST). Every job asks the head for K = max(the K shown, 1) most likely tokens per
action, so ranks and the greedy token come with them; never a [tokens, vocab] tensor.

The drawn token shows in the answer only as its text (with a tokenizer) or in OpenAI's `logprobs`.
Where neither shows it and the prompt is scored (vLLM's prompt_logprobs without a tokenizer: TRL's
teacher call to a checkpoint without one), no token is drawn and no action L asked: the bytes are
the same, without the drawing row's float32 copy of its logits (engine/heads/chunked.py `_Draws`).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

import numpy as np

from service.core.errors import InvalidRequest
from service.core.jobs import IntArray, SequenceJob
from service.http.completions.schemas import CompletionRequest
from service.normalise import ModelLimits
from service.normalise.limits import check_length, check_request_size

# options that change what a sampler draws or a model reads: accepted at their default values only
_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    "use_beam_search": (False,),
    "top_p": (None, 1.0),
    "top_k": (None, 0, -1),
    "min_p": (None, 0.0),
    "presence_penalty": (None, 0.0),
    "frequency_penalty": (None, 0.0),
    "repetition_penalty": (None, 1.0),
    "logit_bias": (None, {}),
    "suffix": (None,),
}


@dataclass(frozen=True, slots=True)
class CompletionPlan:
    """prompts: [L_i] ids each; jobs: one per prompt, in order. prompt_k / logprobs_k: the K shown in
    choices[i].prompt_logprobs / choices[i].logprobs (None: not asked)."""

    prompts: list[IntArray]
    jobs: list[SequenceJob]
    prompt_k: int | None
    logprobs_k: int | None
    echo: bool
    draw: bool  # max_tokens 1: one token after each prompt (in `usage`)
    greedy: bool  # temperature 0: the most likely token (ties: the lower id)
    drawn_shown: bool = True  # the drawn token appears in the answer (its text, OpenAI logprobs)

    @property
    def scores_draw(self) -> bool:
        """The jobs score the distribution after each prompt (the action one past it, L) and draw."""
        return self.draw and (self.drawn_shown or not self.scores_prompt)

    @property
    def scores_prompt(self) -> bool:
        return self.prompt_k is not None or (self.echo and self.logprobs_k is not None)

    @property
    def input_tokens(self) -> int:
        return sum(int(p.shape[0]) for p in self.prompts)

    @property
    def scored_tokens(self) -> int:
        return sum(int(job.actions.shape[0]) for job in self.jobs)


def plan_completion(
    request: CompletionRequest, limits: ModelLimits, model: str, max_k: int, *, shows_text: bool = True
) -> CompletionPlan:
    """The jobs of `request` for the served `model`; `max_k` is the most tokens per position the
    server returns; `shows_text`: the server has a tokenizer (choices[i].text shows the drawn token).
    Raises InvalidRequest (422) or PayloadTooLarge / SequenceTooLarge (413)."""
    _check_served(request, model)
    prompts = _prompts(request)
    check_request_size(
        len(prompts), lambda: sum(int(p.shape[0]) for p in prompts), limits, unit="prompts", field="prompt"
    )
    draw = _max_tokens(request) == 1
    for i, prompt in enumerate(prompts):
        _check_prompt(prompt, i, limits, draw)
    prompt_k = _k("prompt_logprobs", request.prompt_logprobs, limits.vocab_size, max_k)
    logprobs_k = _k("logprobs", request.logprobs, limits.vocab_size, max_k)
    temperature = 1.0 if request.temperature is None else request.temperature
    greedy = temperature == 0.0
    drawn_shown = shows_text or logprobs_k is not None
    scores_prompt = prompt_k is not None or (request.echo and logprobs_k is not None)
    scores_draw = draw and (drawn_shown or not scores_prompt)  # as CompletionPlan.scores_draw
    top = max(prompt_k or 0, logprobs_k or 0, 1) if scores_prompt or scores_draw else 0
    jobs = [
        SequenceJob(
            tokens=prompt,
            actions=_actions(int(prompt.shape[0]), scores_prompt, scores_draw),
            temperature=temperature if temperature > 0 else 1.0,
            return_entropy=False,
            top_logprobs=top,
            draw_seed=_seed(request.seed) if scores_draw and not greedy else None,
        )
        for prompt in prompts
    ]
    return CompletionPlan(
        prompts=prompts,
        jobs=jobs,
        prompt_k=prompt_k,
        logprobs_k=logprobs_k,
        echo=request.echo,
        draw=draw,
        greedy=greedy,
        drawn_shown=drawn_shown,
    )


def _seed(seed: int | None) -> int:
    """The draw's seed: the request's (the same for every prompt, as vLLM's), else a fresh one."""
    return seed if seed is not None else secrets.randbits(63)


def _actions(length: int, prompt: bool, draw: bool) -> IntArray:
    """[A] positions 1 .. L-1 (prompt log-probs), then L (the draw)."""
    first = 1 if prompt else length
    return np.arange(first, length + 1 if draw else length, dtype=np.int64)


def _check_served(request: CompletionRequest, model: str) -> None:
    if request.model is not None and request.model != model:
        raise InvalidRequest(
            f"model: this server serves {model!r}, not {request.model!r} (GET /v1/models)", field="model"
        )
    if request.n != 1:
        raise InvalidRequest(
            f"n: {request.n} choices per prompt; logprobd returns one (send a prompt n times for n draws)",
            field="n",
        )
    if request.stream:
        raise InvalidRequest(
            "stream: logprobd answers in one JSON body; streaming is not served", field="stream"
        )
    for name, allowed in _DEFAULTS.items():
        value = getattr(request, name)
        if value not in allowed:
            shown = " or ".join(repr(a) for a in allowed if a is not None)
            raise InvalidRequest(
                f"{name}: {value!r} is not served; logprobd scores log_softmax(logits / T) and draws from it "
                f"untruncated ({name} takes only {shown})",
                field=name,
            )


def _max_tokens(request: CompletionRequest) -> int:
    value = 0 if request.max_tokens is None else request.max_tokens
    if value not in (0, 1):
        raise InvalidRequest(
            f"max_tokens: {value}; logprobd scores the prompt's tokens and draws at most one after it "
            "(max_tokens 0 or 1): generate with an inference server",
            field="max_tokens",
        )
    return value


def _prompts(request: CompletionRequest) -> list[IntArray]:
    prompt = request.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], str)):
        raise InvalidRequest(
            "prompt: logprobd scores token ids, not text: send each prompt as a list of token ids "
            "(the model's tokenizer's), or a list of such lists",
            field="prompt",
        )
    if not prompt:
        raise InvalidRequest("prompt: no token ids", field="prompt")
    rows = [prompt] if isinstance(prompt[0], int) else prompt
    out = []
    for i, row in enumerate(rows):
        if not row:
            raise InvalidRequest(f"prompt[{i}] has no token ids", field="prompt", row=i)
        try:
            out.append(np.asarray(row, dtype=np.int64))
        except OverflowError:  # valid JSON, but no token: named like any id outside the vocabulary
            raise InvalidRequest(
                f"prompt[{i}]: a token id is over 2^63 - 1, outside the vocabulary", field="prompt", row=i
            ) from None
    return out


def _check_prompt(prompt: IntArray, i: int, limits: ModelLimits, draw: bool) -> None:
    needs = f"{prompt.shape[0]} tokens" + (" and the drawn one" if draw else "")
    check_length(int(prompt.shape[0]) + int(draw), f"prompt[{i}] has {needs}", limits, field="prompt", row=i)
    outside = np.flatnonzero(prompt >= limits.vocab_size)
    if outside.size:
        k = int(outside[0])
        raise InvalidRequest(
            f"prompt[{i}]: token id {prompt[k]} (token {k}) is outside the vocabulary "
            f"[0, {limits.vocab_size})",
            field="prompt",
            row=i,
        )


def _k(name: str, value: int | None, vocab_size: int, max_k: int) -> int | None:
    """K of `name` (-1: the whole vocabulary, vLLM's), within the server's maximum."""
    if value is None:
        return None
    k = vocab_size if value == -1 else value
    if k > max_k:
        raise InvalidRequest(
            f"{name}: {value} asks {k} tokens per position; this server returns at most {max_k} "
            "(--max-top-logprobs)",
            field=name,
        )
    return min(k, vocab_size)
