"""A teacher's top-K log-probs for distillation, as TRL's trainers take them.

`get_sequence_logprobs` returns exactly the dict of TRL 1.16's
`VLLMClient.get_sequence_logprobs` (trl/generation/vllm_client.py) for the same arguments, without
needing vLLM installed as TRL's client does. Per completion position of each sequence (from its
prompt length on), [K] lists padded to K:

    logprobs          the K most likely log-probs, by rank, padded with -inf (NaN read as -inf)
    logprob_token_ids their token ids, padded with 0
    actual_logprobs   [1] the sequence's own token's log-prob (-inf if the answer lacks it)
    actual_token_ids  [1] that token's id

TRL's client asks /v1/completions for every prompt position's top K (`prompt_logprobs`) as JSON and
keeps the completion positions: for 8 sequences of 4,096 tokens at K 100, a 232 MB answer that it
then parses (seconds). `get_sequence_logprobs` asks POST /logprobs for the completion positions only
(`num_actions`, `top_logprobs`), in compact frames (Client): their [window, K] ids and float32
log-probs as binary arrays, written into TRL's lists as TRL reads them from vLLM's JSON (-inf as
vLLM's -9999.0). The sequences go in requests of at most CHUNK_TOKENS tokens, WORKERS at once: while
the server scores one the next waits in its queue, and a request is sent as soon as one answers; a
thread of its own writes each answer into lists meanwhile. `TeacherClient` is TRL's VLLMClient for a
trainer's `teacher_client`, with that call. tests/e2e/test_completions_clients.py holds both to TRL's
own client.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
from numpy.typing import NDArray

from service.client._sync import Client
from service.client.errors import LogprobdError
from service.client.wire import Scores

KEYS = ("logprobs", "logprob_token_ids", "actual_logprobs", "actual_token_ids")
CHUNK_TOKENS = 4096  # a request's tokens: answers come back, and are written as lists, while others compute
WORKERS = 2  # requests in flight: one computing, the next queued behind it
FLOOR = -9999.0  # vLLM's prompt_logprobs clamp for -inf (JSON cannot carry it)
LIST_ROWS = 256  # positions written into lists per call (_lists)
Rows = list[tuple[Sequence[int], int]]  # a request's (sequence, first position scored)


def get_sequence_logprobs(
    url: str,
    sequences: Sequence[Sequence[int]],
    prompt_lengths: Sequence[int],
    top_logprobs: int = 100,
    temperature: float = 1.0,
    *,
    api_key: str | None = None,
    timeout: float = 600.0,
) -> dict[str, list[Any]]:
    """Score `sequences` (prompt + completion token ids) on the server at `url`; TRL's dict. A 4xx or
    5xx raises LogprobdError naming the server's field and row; no answer, LogprobdConnectionError.
    A sequence's first token has no distribution: with prompt length 0 its entry is padding, as in
    TRL's dict (vLLM's first prompt_logprobs entry is None)."""
    with TeacherClient(url, api_key=api_key, timeout=timeout) as teacher:
        return teacher.get_sequence_logprobs(sequences, prompt_lengths, top_logprobs, temperature)


class TeacherClient:
    """A drop-in for TRL's `VLLMClient` where a trainer holds it as its teacher (TRL's server-teacher
    trainers' `teacher_client`): the same `get_sequence_logprobs`, over one logprobd Client whose
    connections it keeps between calls. Close it (or use `with`) to free them."""

    def __init__(self, base_url: str, *, api_key: str | None = None, timeout: float = 600.0) -> None:
        self._client = Client(base_url, api_key=api_key, timeout=timeout)

    def get_sequence_logprobs(  # noqa: PLR0917 (TRL's signature)
        self,
        sequences: Sequence[Sequence[int]],
        prompt_lengths: Sequence[int],
        top_logprobs: int = 100,
        temperature: float = 1.0,
        chunk_size: int = 0,
        max_concurrent_requests: int = 4,
    ) -> dict[str, list[Any]]:
        """TRL's dict, as `VLLMClient.get_sequence_logprobs` returns it (the module's
        get_sequence_logprobs). `chunk_size` and `max_concurrent_requests` are TRL's, taken for its
        signature: the requests are this module's (CHUNK_TOKENS, WORKERS)."""
        del chunk_size, max_concurrent_requests
        if temperature <= 0:
            raise ValueError(f"temperature must be positive, got {temperature}")
        if len(sequences) != len(prompt_lengths):
            raise ValueError(f"{len(sequences)} sequences but {len(prompt_lengths)} prompt lengths")
        if any(length < 0 for length in prompt_lengths):
            raise ValueError(f"prompt lengths must be at least 0, got {list(prompt_lengths)}")
        first = [max(length, 1) for length in prompt_lengths]  # the first position with a distribution
        asked = [i for i, seq in enumerate(sequences) if len(seq) > first[i]]
        chunks = _chunks(asked, [len(s) for s in sequences])
        rows = [[(sequences[i], first[i]) for i in c] for c in chunks]
        lists = self._scored(chunks, rows, top_logprobs, temperature)
        results = []
        for i, (sequence, length) in enumerate(zip(sequences, prompt_lengths, strict=True)):
            head = _padding(sequence, top_logprobs) if length == 0 and sequence else _empty()
            body = lists.get(i)
            results.append(head if body is None else {key: head[key] + body[key] for key in KEYS})
        return {key: [r[key] for r in results] for key in KEYS}

    def _scored(
        self, chunks: list[list[int]], rows: list[Rows], k: int, temperature: float
    ) -> dict[int, dict[str, list[Any]]]:
        """Each chunk's rows scored (a request each, WORKERS in flight) and written as TRL's lists on a
        thread of their own as the answers come in: sequence index -> its lists."""
        scored: dict[int, dict[str, list[Any]]] = {}
        with ThreadPoolExecutor(WORKERS) as requests, ThreadPoolExecutor(1) as writer:
            answers = [requests.submit(_score, self._client, r, k, temperature) for r in rows]
            written = [writer.submit(_write, a, r, k) for a, r in zip(answers, rows, strict=True)]
            try:
                for chunk, done in zip(chunks, written, strict=True):
                    scored.update(zip(chunk, done.result(), strict=True))
            except BaseException:  # what is not sent yet is not sent
                for answer in answers:
                    answer.cancel()
                for done in written:
                    done.cancel()
                raise
        return scored

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> TeacherClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _chunks(rows: list[int], lengths: list[int]) -> list[list[int]]:
    """`rows` in order, in requests of at most CHUNK_TOKENS tokens (a longer sequence alone)."""
    chunks: list[list[int]] = []
    tokens = 0
    for i in rows:
        if not chunks or tokens + lengths[i] > CHUNK_TOKENS:
            chunks.append([])
            tokens = 0
        chunks[-1].append(i)
        tokens += lengths[i]
    return chunks


def _score(client: Client, rows: Rows, k: int, temperature: float) -> Scores:
    """One request of (sequence, first position scored) rows."""
    return client.score(
        [list(s) for s, _ in rows],
        num_actions=[len(s) - f for s, f in rows],
        temperature=temperature,
        top_logprobs=k,
    )


def _write(answer: Future[Scores], rows: Rows, k: int) -> list[dict[str, list[Any]]]:
    """A request's answer, once in, as TRL's lists per row (while the next request computes)."""
    scores = answer.result()
    ids, values = _top_blocks(scores)
    return [
        _positions(ids[j], values[j], np.asarray(s[f:], dtype=np.int64), scores.logprobs[j], k)
        for j, (s, f) in enumerate(rows)
    ]


def _top_blocks(scores: Scores) -> tuple[list[NDArray[np.int64]], list[NDArray[np.float32]]]:
    """The answer's per-row top_ids and top_logprobs blocks, which `top_logprobs` asked for."""
    if scores.top_ids is None or scores.top_logprobs is None:
        raise LogprobdError("the server's answer has no top_ids / top_logprobs")
    return scores.top_ids, scores.top_logprobs


def _positions(
    ids: NDArray[np.int64], values: NDArray[np.float32], own: NDArray[np.int64], actual: list[float], k: int
) -> dict[str, list[Any]]:
    """A row's window [n] of /logprobs' answer -> TRL's four lists: the [n, K'] top blocks (K' <= K:
    the vocabulary's cap, padded to K), the tokens `own` [n] and their log-probs `actual` [n]. Where a
    token is among its position's K, its log-prob is that entry's, as a vLLM answer shows it once."""
    ids, logprobs = ids[:, :k], _as_vllm(values[:, :k])
    n, shown = ids.shape
    if shown < k:  # the vocabulary caps K: padded as TRL pads
        logprobs = np.concatenate([logprobs, np.full((n, k - shown), -math.inf)], axis=1)
    token_ids = ids if shown == k else np.concatenate([ids, np.zeros((n, k - shown), np.int64)], axis=1)
    mine = _as_vllm(np.asarray(actual, dtype=np.float32))
    hit = ids == own[:, None]
    found = hit.any(axis=1)
    mine[found] = logprobs[found, hit[found].argmax(axis=1)]
    return {
        "logprobs": _lists(logprobs),
        "logprob_token_ids": _lists(token_ids),
        "actual_logprobs": mine[:, None].tolist(),
        "actual_token_ids": own[:, None].tolist(),
    }


def _lists(block: NDArray[Any]) -> list[Any]:
    """block.tolist(), LIST_ROWS rows a call: one call holds the GIL throughout (~25 ms for [4096, 100]
    floats), and the thread that sends the next request would wait that long."""
    out: list[Any] = []
    for start in range(0, block.shape[0], LIST_ROWS):
        out += block[start : start + LIST_ROWS].tolist()
    return out


def _as_vllm(values: NDArray[np.float32]) -> NDArray[np.float64]:
    """float32 log-probs as TRL reads them from vLLM's JSON: -inf as vLLM's clamp, NaN (null) as -inf."""
    out = values.astype(np.float64)
    out[out == -math.inf] = FLOOR
    out[np.isnan(out)] = -math.inf
    return out


def _padding(sequence: Sequence[int], k: int) -> dict[str, list[Any]]:
    """The entry of position 0, which has no distribution: as TRL reads vLLM's None."""
    return {
        "logprobs": [[-math.inf] * k],
        "logprob_token_ids": [[0] * k],
        "actual_logprobs": [[-math.inf]],
        "actual_token_ids": [[sequence[0]]],
    }


def _empty() -> dict[str, list[Any]]:
    return {key: [] for key in KEYS}
