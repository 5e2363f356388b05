"""A teacher's top-K log-probs for distillation, as TRL's trainers take them, from /v1/completions.

`get_sequence_logprobs` returns exactly the dict of TRL 1.16's
`VLLMClient.get_sequence_logprobs` (trl/generation/vllm_client.py) and sends it the same request
(`prompt` the token-id sequences, `max_tokens` 1, `temperature`, `prompt_logprobs` K), without
needing vLLM installed as TRL's client does. Per completion position of each sequence (from its
prompt length on), [K] lists padded to K:

    logprobs          the K most likely log-probs, by rank, padded with -inf (NaN read as -inf)
    logprob_token_ids their token ids, padded with 0
    actual_logprobs   [1] the sequence's own token's log-prob (-inf if the answer lacks it)
    actual_token_ids  [1] that token's id
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import httpx

from service.client.errors import from_response, from_transport

KEYS = ("logprobs", "logprob_token_ids", "actual_logprobs", "actual_token_ids")


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
    5xx raises LogprobdError naming the server's field and row; no answer, LogprobdConnectionError."""
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    if len(sequences) != len(prompt_lengths):
        raise ValueError(f"{len(sequences)} sequences but {len(prompt_lengths)} prompt lengths")
    payload = {
        "prompt": [list(s) for s in sequences],
        "max_tokens": 1,
        "temperature": temperature,
        "prompt_logprobs": top_logprobs,
    }
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    endpoint = f"{url.rstrip('/')}/v1/completions"
    try:
        reply = httpx.post(endpoint, json=payload, headers=headers, timeout=timeout)
    except httpx.TransportError as exc:
        raise from_transport(exc, endpoint) from exc
    if reply.status_code != 200:
        raise from_response(reply)
    choices = reply.json()["choices"]
    results = [
        sequence_logprobs(choice["prompt_logprobs"], sequence, length, top_logprobs)
        for choice, sequence, length in zip(choices, sequences, prompt_lengths, strict=True)
    ]
    return {key: [r[key] for r in results] for key in KEYS}


def sequence_logprobs(
    prompt_logprobs: Sequence[Mapping[str, Mapping[str, Any]] | None],
    sequence: Sequence[int],
    prompt_length: int,
    top_logprobs: int,
) -> dict[str, list[Any]]:
    """One choice's `prompt_logprobs` (vLLM's form) -> TRL's four lists for positions prompt_length..L-1."""
    logprobs, token_ids, actual_logprobs, actual_ids = [], [], [], []
    for position in range(prompt_length, len(prompt_logprobs)):
        entry = prompt_logprobs[position] or {}
        ranked = sorted(entry.items(), key=lambda item: item[1]["rank"])[:top_logprobs]
        values = [_finite_or_floor(item["logprob"]) for _, item in ranked]
        pad = top_logprobs - len(ranked)
        logprobs.append(values + [-math.inf] * pad)
        token_ids.append([int(token) for token, _ in ranked] + [0] * pad)
        actual = entry.get(str(sequence[position]))
        actual_logprobs.append([-math.inf if actual is None else _finite_or_floor(actual["logprob"])])
        actual_ids.append([sequence[position]])
    return {
        "logprobs": logprobs,
        "logprob_token_ids": token_ids,
        "actual_logprobs": actual_logprobs,
        "actual_token_ids": actual_ids,
    }


def _finite_or_floor(value: float | None) -> float:
    """TRL reads NaN as -inf; JSON brings a NaN as null."""
    return -math.inf if value is None or math.isnan(value) else float(value)
