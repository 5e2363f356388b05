"""What the /v1/completions tests share.

- Random distributions over a vocabulary of texts that need escaping (`positions`, `vocabulary`), and
  the vLLM prompt_logprobs / OpenAI top_logprobs they make, built entry by entry the obvious way
  (`vllm_reference`, `openai_reference`): the dicts jsonwriter.py's bytes must be orjson's of.
- The streamed answers' prompts over fakes.TopEngine (`prompts`, `body`) and the bytes
  response.completion_chunks writes for them whole (`expected`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import orjson

from service.http.completions import response
from service.http.completions.jsonwriter import Positions
from service.http.completions.pieces import TokenPieces
from service.http.completions.plan import plan_completion
from service.http.completions.response import Shared, completion_chunks
from service.http.completions.schemas import CompletionRequest
from service.normalise import ModelLimits
from tests.support.fakes import TopEngine

FLOOR = -9999.0
ODD_TEXTS = ['"', "\\", "\n", "\t\r", "\x00\x01\x1f\x7f", "é", "日本語", "🙂", " the", "", 'a"b\\c', "\u2028"]


class Table:
    """TokenText over a fixed list of pieces."""

    def __init__(self, pieces: Sequence[str]) -> None:
        self.pieces = list(pieces)

    def piece(self, token_id: int) -> str:
        return self.pieces[token_id]

    def decode(self, token_ids: Sequence[int]) -> str:
        return "".join(self.pieces[t] for t in token_ids)


def vocabulary(v: int, rng: np.random.Generator, shared: bool = True) -> Table:
    """Texts with escapes, non-ASCII, long runs, and (shared) several ids of one text."""
    texts = [f"{ODD_TEXTS[i % len(ODD_TEXTS)]}{i}" for i in range(v)]
    for i in range(0, v, 7):
        texts[i] = ODD_TEXTS[int(rng.integers(len(ODD_TEXTS)))] * int(rng.integers(1, 40))
    if shared:
        for i in range(3, v, 5):
            texts[i] = "\ufffd"  # byte tokens alone decode to the replacement character
    return Table(texts)


def positions(n: int, v: int, k: int, rng: np.random.Generator, ties: bool = False) -> Positions:
    """Random distributions; a third of the positions' tokens among the top K."""
    scores = rng.standard_normal((n, v)) * 3
    if ties:
        scores = np.round(scores)
    logprobs = (scores - np.log(np.exp(scores).sum(axis=1, keepdims=True))).astype(np.float32)
    logprobs[rng.random((n, v)) < 0.05] = -np.inf
    logprobs[:1, :3] = np.nan
    order = np.argsort(-logprobs, axis=1, kind="stable")  # ties by the lower id
    top = order[:, : max(k, 1)]
    token = rng.integers(0, v, size=n)
    among = rng.random(n) < 0.33
    token[among] = top[among, rng.integers(0, max(k, 1), size=among.sum())]
    rank = (logprobs > logprobs[np.arange(n), token][:, None]).sum(axis=1) + 1
    return Positions(
        token=token.astype(np.int64),
        logprob=logprobs[np.arange(n), token],
        rank=rank.astype(np.int64),
        top_ids=top.astype(np.int64),
        top_logprobs=np.take_along_axis(logprobs, top, axis=1),
    )


def clamp(x: float) -> float:
    return x if math.isnan(x) else max(x, FLOOR)


def vllm_reference(p: Positions, k: int, table: Table | None) -> list[Any]:
    out: list[Any] = [None]
    for i in range(len(p)):
        token = int(p.token[i])
        entry = {
            str(token): {
                "logprob": clamp(float(p.logprob[i])),
                "rank": int(p.rank[i]),
                "decoded_token": table.piece(token) if table else None,
            }
        }
        for j in range(k):
            t = int(p.top_ids[i, j])
            entry[str(t)] = {
                "logprob": clamp(float(p.top_logprobs[i, j])),
                "rank": j + 1,
                "decoded_token": table.piece(t) if table else None,
            }
        out.append(entry)
    return out


def text_of(table: Table | None, t: int) -> str:
    return table.piece(t) if table else f"token_id:{t}"


def openai_reference(p: Positions, k: int, table: Table | None) -> list[Any]:
    out = []
    for i in range(len(p)):
        by_id = {int(p.token[i]): float(p.logprob[i])}
        for j in range(k):
            by_id[int(p.top_ids[i, j])] = float(p.top_logprobs[i, j])
        out.append({text_of(table, t): clamp(lp) for t, lp in by_id.items()})
    return out


K = 8  # the streamed tests' prompt_logprobs (and the server's max_top_logprobs)
LENGTH = 40
MARKER = 999  # a prompt holding it fails late, as a device error reported at collection does


def prompts(fail_at: int | None = None) -> list[list[int]]:
    rows = [((np.arange(LENGTH) * (3 + i)) % 500 + 1).tolist() for i in range(3)]
    if fail_at is not None:
        rows[fail_at][5] = MARKER
    return rows


def body(rows: list[list[int]]) -> dict[str, Any]:
    return {"prompt": rows, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": K}


def expected(reply: bytes, rows: list[list[int]], engine: TopEngine) -> bytes:
    """completion_chunks' bytes for these prompts, with the reply's id and created."""
    head = orjson.loads(reply)
    limits = ModelLimits(vocab_size=engine.info.vocab_size, max_sequence_tokens=4096, max_top_logprobs=K)
    plan = plan_completion(CompletionRequest.model_validate(body(rows)), limits, engine.info.model, K)
    scores = engine.score(plan.jobs)  # the extras with them
    drawn: list[response.Drawn | None] = []
    for s in scores:  # the draw is the top id after the prompt (TopEngine's), rank 1
        assert s.top_ids is not None
        assert s.top_logprobs is not None
        drawn.append(response.Drawn(int(s.top_ids[-1, 0]), float(s.top_logprobs[-1, 0]), 1))
    pieces = TokenPieces.build(None, engine.info.vocab_size)
    h = Shared(engine.info.model, None, pieces, head["id"], head["created"])
    return b"".join(
        completion_chunks(
            plan,
            scores,
            drawn,
            model=h.model,
            token_text=None,
            pieces=pieces,
            request_id=h.request_id,
            created=h.created,
        )
    )
