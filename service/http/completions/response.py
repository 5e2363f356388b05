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

Token text is the checkpoint tokenizer's `decode([id])`; without a tokenizer, decoded_token is null,
a token's text is vLLM's id placeholder "token_id:<id>" (--return-tokens-as-token-ids), `text` is ""
and every text_offset is 0 (an offset into the text returned).

The answer is written as JSON bytes, the bytes orjson.dumps writes for it as dicts: the big arrays
by jsonwriter.py, a block of positions at a time, the rest by orjson here. `completion_stream` gives
its chunks (about a block each, the document once, no joined copy) in order as the blocks come off
a pool, all submitted at once, so the route sends the first while later ones are written. Whatever
can fail on the scores' content (an id or rank outside the vocabulary's pieces) is checked before it
returns; the blocks left are numpy copies over checked arrays. The same bytes a choice at a time:
answer_head, choice_stream of each choice (checked as it is written), answer_tail.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import orjson

from service.core.errors import EngineFailure
from service.core.jobs import SequenceScores
from service.engine.contract import TokenText
from service.http.completions import jsonwriter
from service.http.completions.jsonwriter import Map, Positions
from service.http.completions.pieces import TokenPieces
from service.http.completions.plan import CompletionPlan

CHUNK_BYTES = 1 << 20  # small pieces of the answer are sent together, up to this many bytes
RENDER_THREADS = min(4, os.cpu_count() or 1)  # each holds one block's temporaries (a few MB) at a time


@dataclass(frozen=True, slots=True)
class Drawn:
    """The token drawn after a prompt (max_tokens 1), its log-prob and rank at the job's temperature."""

    token: int
    logprob: float
    rank: int


@dataclass(frozen=True, slots=True)
class Position:
    """One scored position: its own token, log-prob and rank, and the head's top ids and log-probs."""

    token: int
    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


def last_position(scores: SequenceScores) -> Position:
    """The distribution after the prompt (the draw's action, the job's last); token: the head's top 1."""
    assert scores.top_ids is not None
    assert scores.top_logprobs is not None
    top_ids, top_lps = scores.top_ids[-1].tolist(), scores.top_logprobs[-1].tolist()
    return Position(top_ids[0], top_lps[0], 1, top_ids, top_lps)


def prompt_positions(prompt: np.ndarray, scores: SequenceScores) -> Positions:
    """Prompt positions 1 .. L-1 (the job's first L-1 actions)."""
    assert scores.top_ids is not None
    assert scores.top_logprobs is not None
    assert scores.ranks is not None
    n = prompt.shape[0] - 1
    return Positions(
        token=prompt[1:].astype(np.int64),
        logprob=scores.logprobs[:n],
        rank=scores.ranks[:n].astype(np.int64),
        top_ids=scores.top_ids[:n].astype(np.int64),
        top_logprobs=scores.top_logprobs[:n],
    )


def drawn_position(drawn: Drawn, scores: SequenceScores) -> Positions:
    """The drawn token over the distribution after the prompt (the job's last action)."""
    assert scores.top_ids is not None
    assert scores.top_logprobs is not None
    return Positions(
        token=np.array([drawn.token], dtype=np.int64),
        logprob=np.array([drawn.logprob], dtype=np.float64),
        rank=np.array([drawn.rank], dtype=np.int64),
        top_ids=scores.top_ids[-1:].astype(np.int64),
        top_logprobs=scores.top_logprobs[-1:],
    )


class Chunks:
    """The answer's bytes in order: big pieces kept as they are, small ones gathered together. A
    part may be an iterator of pieces (an array's blocks, rendered meanwhile), read in done()."""

    def __init__(self) -> None:
        self._parts: list[bytes | Iterator[bytes]] = []

    def add(self, *parts: bytes | Iterator[bytes]) -> None:
        self._parts.extend(parts)

    def stream(self) -> Iterator[bytes]:
        """The chunks in order, each as soon as its pieces are in."""
        small: list[bytes] = []
        size = 0
        for part in self._parts:
            for piece in [part] if isinstance(part, bytes) else part:
                if len(piece) >= CHUNK_BYTES or size + len(piece) >= CHUNK_BYTES:
                    yield b"".join([*small, piece]) if small else piece
                    small, size = [], 0
                else:
                    small.append(piece)
                    size += len(piece)
        if small:
            yield b"".join(small)

    def done(self) -> list[bytes]:
        return list(self.stream())


def _openai_logprobs(
    out: Chunks,
    pieces: TokenPieces,
    k: int,
    prompt: np.ndarray,
    *,
    positions: Positions | None,
    drawn: Positions | None,
    echo: bool,
    run: Map,
) -> None:
    """choices[i].logprobs: with echo the prompt's tokens (the first without scores), then the drawn one."""
    shown = [p for p in ((positions if echo else None), drawn) if p is not None]
    if not shown:  # no echo, no token drawn (max_tokens 0)
        out.add(b'{"tokens":[],"token_logprobs":[],"top_logprobs":[],"text_offset":[]}')
        return
    rows = Positions.concat(shown)
    tokens = np.concatenate([prompt[:1] if echo else prompt[:0], rows.token]).astype(np.int64)
    out.add(b'{"tokens":', jsonwriter.token_strings(pieces, tokens))
    out.add(b',"token_logprobs":', jsonwriter.logprob_list(rows.logprob, null_first=echo))
    out.add(b',"top_logprobs":', jsonwriter.top_logprobs(pieces, rows, k, null_first=echo, run=run))
    out.add(b',"text_offset":', jsonwriter.text_offsets(pieces, tokens), b"}")


def _text(plan: CompletionPlan, prompt: np.ndarray, drawn: Drawn | None, token_text: TokenText | None) -> str:
    """choices[i].text: the prompt's text with echo, then the drawn token's; "" without a tokenizer."""
    if token_text is None:
        return ""
    generated = token_text.decode([drawn.token]) if drawn is not None else ""
    return token_text.decode(prompt.tolist()) + generated if plan.echo else generated


def completion_chunks(
    plan: CompletionPlan,
    scores: list[SequenceScores],
    drawn: list[Drawn | None],
    *,
    model: str,
    token_text: TokenText | None,
    pieces: TokenPieces,
    request_id: str,
    created: int,
) -> list[bytes]:
    """A CompletionResponse as JSON bytes: one choice per prompt, in order; the big arrays' blocks
    rendered on RENDER_THREADS threads (numpy lets go of the GIL while it copies), all submitted
    before the first is read."""
    with render_pool() as pool:
        shared = Shared(model, token_text, pieces, request_id, created)
        return list(completion_stream(plan, scores, drawn, shared, pool))


def render_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(RENDER_THREADS, thread_name_prefix="completions-json")


def completion_stream(  # noqa: PLR0917
    plan: CompletionPlan,
    scores: list[SequenceScores],
    drawn: list[Drawn | None],
    h: Shared,
    pool: Executor,
    cached_tokens: int = 0,
) -> Iterator[bytes]:
    """completion_chunks' chunks, each given as soon as it is written: the scores checked and
    everything but the big arrays' blocks written before this returns, the blocks submitted to
    `pool` at once (the iterator holds what is written and not yet read). Raises EngineFailure
    where the scores hold an id or rank the vocabulary has no piece for."""
    _check_scores(plan, scores, drawn, h.pieces.vocab_size)
    out = Chunks()
    out.add(answer_head(h))
    for i, (s, d) in enumerate(zip(scores, drawn, strict=True)):
        _choice(out, plan, i, s, d, h=h, run=pool.map)
    out.add(answer_tail(plan, cached_tokens))
    return out.stream()


def choice_stream(
    plan: CompletionPlan, i: int, scores: SequenceScores, drawn: Drawn | None, *, h: Shared, pool: Executor
) -> Iterator[bytes]:
    """Choice i's chunks (its leading comma with it): answer_head, then choices 0 .. n-1, then
    answer_tail are completion_stream's bytes. Checked, and its blocks submitted to `pool`, before
    this returns; raises EngineFailure as completion_stream does, naming prompt i."""
    _check_choice(plan, i, scores, drawn, h.pieces.vocab_size)
    out = Chunks()
    _choice(out, plan, i, scores, drawn, h=h, run=pool.map)
    return out.stream()


def answer_head(h: Shared) -> bytes:
    """The answer's bytes before its first choice."""
    dumps = orjson.dumps
    return b"".join(
        [
            b'{"id":',
            dumps(h.request_id),
            b',"object":"text_completion","created":',
            dumps(h.created),
            b',"model":',
            dumps(h.model),
            b',"choices":[',
        ]
    )


def answer_tail(plan: CompletionPlan, cached_tokens: int = 0) -> bytes:
    """The answer's bytes after its last choice: OpenAI's usage, with the prompt tokens the prefix
    cache served (`prompt_tokens_details.cached_tokens`, as OpenAI and vLLM name them)."""
    prompt_tokens = plan.input_tokens
    completion_tokens = len(plan.prompts) if plan.draw else 0
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
    return b'],"usage":' + orjson.dumps(usage) + b"}"


def _check_scores(
    plan: CompletionPlan, scores: list[SequenceScores], drawn: list[Drawn | None], vocab: int
) -> None:
    for i, (s, d) in enumerate(zip(scores, drawn, strict=True)):
        _check_choice(plan, i, s, d, vocab)


def _check_choice(plan: CompletionPlan, i: int, s: SequenceScores, d: Drawn | None, vocab: int) -> None:
    """Top ids in [0, V) and ranks in [0, V] (the pieces' tables), the drawn token in [0, V)."""
    if plan.prompt_k is None and plan.logprobs_k is None:
        return
    bad = []
    if s.top_ids is not None and s.top_ids.size and not 0 <= s.top_ids.min() <= s.top_ids.max() < vocab:
        bad.append("a top id")
    if s.ranks is not None and s.ranks.size and not 0 <= s.ranks.min() <= s.ranks.max() <= vocab:
        bad.append("a rank")
    if d is not None and not (0 <= d.token < vocab and 0 <= d.rank <= vocab):
        bad.append("the drawn token")
    if bad:
        raise EngineFailure(
            f"the engine's scores of prompt {i} hold {' and '.join(bad)} outside [0, {vocab})"
        )


@dataclass(frozen=True, slots=True)
class Shared:
    """What every choice's rendering needs besides its scores."""

    model: str
    token_text: TokenText | None
    pieces: TokenPieces
    request_id: str
    created: int


def _choice(
    out: Chunks,
    plan: CompletionPlan,
    i: int,
    s: SequenceScores,
    d: Drawn | None,
    *,
    h: Shared,
    run: Map,
) -> None:
    """choices[i], its leading comma with it."""
    prompt = plan.prompts[i]
    positions = prompt_positions(prompt, s) if plan.scores_prompt else None
    drawn_at = drawn_position(d, s) if d is not None else None
    dumps = orjson.dumps
    out.add(
        b"," if i else b"", b'{"index":', dumps(i), b',"text":', dumps(_text(plan, prompt, d, h.token_text))
    )
    out.add(b',"logprobs":')
    if plan.logprobs_k is None:
        out.add(b"null")
    else:
        _openai_logprobs(
            out,
            h.pieces,
            plan.logprobs_k,
            prompt,
            positions=positions,
            drawn=drawn_at,
            echo=plan.echo,
            run=run,
        )
    out.add(b',"finish_reason":"length","stop_reason":null,"prompt_logprobs":')
    if plan.prompt_k is None or positions is None:
        out.add(b"null")
    else:
        out.add(jsonwriter.prompt_logprobs(h.pieces, positions, plan.prompt_k, run=run))
    out.add(b"}")
