"""Per-prompt scores -> the completions answer, as vLLM's OpenAI server writes it.

Read from vllm/entrypoints/openai/completion/serving.py (request_output_to_completion_response,
_create_completion_logprobs), vllm/logprobs.py (append_logprobs_for_next_position) and
vllm/entrypoints/generate/base/serving.py (clamp_prompt_logprobs):

- choices[i].prompt_logprobs: one entry per prompt token, None for the first; then a dict keyed by
  the token id as a string, the prompt token first (its own rank, which may exceed K) and then the K
  most likely (ranks 1..K; the prompt token among them keeps its first place), each
  {logprob, rank, decoded_token}; -inf is sent as -9999.0.
- choices[i].logprobs (OpenAI legacy): tokens, token_logprobs (None for the first prompt token),
  top_logprobs (a dict from token text to log-prob: the position's own token, then the K most
  likely, at most K + 1 texts), text_offset (running sum of the tokens' text lengths from 0).
  With echo, the prompt's tokens and then the drawn one; without, the drawn one only.

Token text is the checkpoint tokenizer's `decode([id])`; without a tokenizer, decoded_token is null
and a token's text is vLLM's id placeholder "token_id:<id>" (--return-tokens-as-token-ids).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from service.completions.plan import CompletionPlan
from service.engine.contract import TokenText
from service.jobs import SequenceScores

FLOOR = -9999.0  # vLLM's clamp for -inf, which JSON cannot carry


@dataclass(frozen=True, slots=True)
class Drawn:
    """The token drawn after a prompt (max_tokens 1), its log-prob and rank at the job's temperature."""

    token: int
    logprob: float
    rank: int


class Texts:
    """Token text: the tokenizer's pieces, or the id placeholder and a null decoded_token without one."""

    def __init__(self, token_text: TokenText | None) -> None:
        self.token_text = token_text

    def decoded(self, token: int) -> str | None:
        return self.token_text.piece(token) if self.token_text is not None else None

    def token(self, token: int) -> str:
        return self.token_text.piece(token) if self.token_text is not None else f"token_id:{token}"

    def text(self, tokens: list[int]) -> str:
        return self.token_text.decode(tokens) if self.token_text is not None else ""


def _lp(value: float) -> float:
    return value if value >= FLOOR else FLOOR  # NaN stays NaN (null in JSON), as vLLM's


@dataclass(frozen=True, slots=True)
class Position:
    """One scored position: its own token, log-prob and rank, and the head's top ids and log-probs."""

    token: int
    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


def _positions(prompt: list[int], scores: SequenceScores) -> list[Position]:
    """Prompt positions 1 .. L-1 (the job's first L-1 actions)."""
    assert scores.top_ids is not None
    assert scores.top_logprobs is not None
    assert scores.ranks is not None
    n = len(prompt) - 1
    logprobs, ranks = scores.logprobs[:n].tolist(), scores.ranks[:n].tolist()
    top_ids, top_lps = scores.top_ids[:n].tolist(), scores.top_logprobs[:n].tolist()
    return [Position(prompt[p + 1], logprobs[p], ranks[p], top_ids[p], top_lps[p]) for p in range(n)]


def _vllm_entry(position: Position, k: int, texts: Texts) -> dict[str, dict[str, Any]]:
    def one(lp: float, rank: int, token: int) -> dict[str, Any]:
        return {"logprob": _lp(lp), "rank": rank, "decoded_token": texts.decoded(token)}

    entry = {str(position.token): one(position.logprob, position.rank, position.token)}
    for j in range(k):
        token = position.top_ids[j]
        entry[str(token)] = one(position.top_logprobs[j], j + 1, token)
    return entry


def _openai_top(token: int, logprob: float, top: Position, *, k: int, texts: Texts) -> dict[str, float]:
    """The position's token then the K most likely, by id (K + 1 at most), keyed by their text."""
    by_id = {token: logprob}
    for j in range(k):
        by_id[top.top_ids[j]] = top.top_logprobs[j]
    return {texts.token(t): _lp(lp) for t, lp in list(by_id.items())[: k + 1]}


def _openai_logprobs(
    prompt: list[int],
    positions: list[Position],
    plan: CompletionPlan,
    texts: Texts,
    *,
    drawn: Drawn | None,
    last: Position | None,
) -> dict[str, Any]:
    k = plan.logprobs_k or 0
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    if plan.echo:
        tokens.append(texts.token(prompt[0]))
        token_logprobs.append(None)
        tops.append(None)
        for p in positions:
            tokens.append(texts.token(p.token))
            token_logprobs.append(_lp(p.logprob))
            tops.append(_openai_top(p.token, p.logprob, p, k=k, texts=texts))
    if drawn is not None and last is not None:
        tokens.append(texts.token(drawn.token))
        token_logprobs.append(_lp(drawn.logprob))
        tops.append(_openai_top(drawn.token, drawn.logprob, last, k=k, texts=texts))
    offsets, at = [], 0
    for token in tokens:
        offsets.append(at)
        at += len(token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def last_position(scores: SequenceScores) -> Position:
    """The distribution after the prompt (the draw's action, the job's last); token: the head's top 1."""
    assert scores.top_ids is not None
    assert scores.top_logprobs is not None
    top_ids, top_lps = scores.top_ids[-1].tolist(), scores.top_logprobs[-1].tolist()
    return Position(top_ids[0], top_lps[0], 1, top_ids, top_lps)


def completion_body(
    plan: CompletionPlan,
    scores: list[SequenceScores],
    drawn: list[Drawn | None],
    model: str,
    token_text: TokenText | None,
) -> dict[str, Any]:
    """A CompletionResponse: one choice per prompt, in order."""
    texts = Texts(token_text)
    choices = []
    for i, (prompt_ids, s, d) in enumerate(zip(plan.prompts, scores, drawn, strict=True)):
        prompt = prompt_ids.tolist()
        positions = _positions(prompt, s) if plan.scores_prompt else []
        last = last_position(s) if plan.draw else None
        prompt_logprobs = None
        if plan.prompt_k is not None:
            prompt_logprobs = [None, *(_vllm_entry(p, plan.prompt_k, texts) for p in positions)]
        logprobs = (
            _openai_logprobs(prompt, positions, plan, texts, drawn=d, last=last)
            if plan.logprobs_k is not None
            else None
        )
        generated = texts.text([d.token]) if d is not None else ""
        choices.append(
            {
                "index": i,
                "text": (texts.text(prompt) + generated) if plan.echo else generated,
                "logprobs": logprobs,
                "finish_reason": "length",
                "stop_reason": None,
                "prompt_logprobs": prompt_logprobs,
            }
        )
    prompt_tokens = plan.input_tokens
    completion_tokens = len(plan.prompts) if plan.draw else 0
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }
