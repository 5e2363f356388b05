"""Which rows of a request share a prompt: the group key that keeps a GRPO group on one replica.

A server's prefix cache computes a prompt once only where every row that holds it reaches that server
(docs/deploying.md, 'Keeping a group on one replica'). A row's group key is a 64-bit hash (BLAKE2b) of
its prompt's token ids: in a grouped body its `prompt_ids` entry; with `num_actions`, the tokens
before its actions; in a padded body with `response_length`, its real tokens before the response
columns; with an `action_mask`, its tokens before the first action. `key_tokens` hashes the first
that many of them only: the steps of one agent trajectory (each step's prompt the one before with
its tool result and answer) then share the key of their common beginning.

The client sends rows of one key to one replica when it shards over several (fanout.split), and
names the key of each request's first row in the HEADER, on which a load balancer can hash
(ingress-nginx's `upstream-hash-by`). Standard library only.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Mapping, Sequence
from typing import Any

HEADER = "X-Logprobd-Group"


def row_keys(body: Mapping[str, Any], key_tokens: int | None = None) -> list[int]:
    """Each row's group key (a body whose layout is not read: every row the key of its first
    `key_tokens`, else 2048, tokens)."""
    return [_hash(tokens[:key_tokens] if key_tokens else tokens) for tokens in prompts(body)]


def header_value(key: int) -> str:
    return f"{key:016x}"


def prompts(body: Mapping[str, Any]) -> list[Sequence[int]]:
    """Each row's prompt: the tokens before its actions, as far as the layout tells."""
    rows = list(body.get("input_ids") or ())
    if body.get("prompt_ids") is not None and body.get("prompt_index") is not None:
        return [body["prompt_ids"][p] for p in body["prompt_index"]]
    n = body.get("num_actions")
    if n is not None and "attention_mask" not in body:
        counts = [n] * len(rows) if isinstance(n, int) else list(n)
        return [row[: max(0, len(row) - int(c))] for row, c in zip(rows, counts, strict=False)]
    mask = body.get("attention_mask")
    if mask is not None and isinstance(body.get("response_length"), int):
        width = body["response_length"]
        return [
            [t for t, m in zip(row[: len(row) - width], keep, strict=False) if m]
            for row, keep in zip(rows, mask, strict=False)
        ]
    actions = body.get("action_mask")
    if actions is not None and mask is None:
        return [row[: _first(acts)] for row, acts in zip(rows, actions, strict=False)]
    return [row[:2048] for row in rows]


def _first(flags: Sequence[Any]) -> int:
    """The index of the first set flag (the row's length where none is)."""
    return next((i for i, f in enumerate(flags) if f), len(flags))


def _hash(tokens: Sequence[Any]) -> int:
    data = array("q", (int(t) for t in tokens)).tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")
