"""Split one request body into chunks of whole rows, and merge the chunks' responses back in order.

Every layout splits by rows: a padded chunk keeps its rows' full width (attention_mask and
action_mask rows travel with them, response_length stays global), a ragged chunk its rows'
`num_actions` entries when that is a list; `rollout_logprobs` rows, and any other field that is a
list of lists, travel with their rows too. Scalar fields (temperature, eos_token_id, flags) go to
every chunk unchanged. A body whose per-row fields disagree on the row count is never split, so
the server reports that error against the caller's own rows.

A grouped body (`prompt_ids` + `prompt_index`) splits by its rows too: each chunk carries the
prompts its rows name, once each, and its `prompt_index` renumbered to them; a row's tokens are
counted with its prompt's, as the server counts them.

Rows that share a prompt (group_keys.py's key) stay on one replica when the client shards over several:
the rows are parted by key (a key's rows all go to replica key mod N) before they are cut into
chunks, each chunk then holding rows of the caller's batch that need not be contiguous (`rows`),
and `by_group` makes each group a request of its own (for a load balancer that hashes the group
header). The merged rows are put back in the caller's order.

Responses merge by the same rule: per-row lists are concatenated; `usage` counts are summed;
`rollout` statistics (over action tokens) and `route_agreement` (over (position, layer) pairs) are
recombined exactly: counts summed, maxima maxed, means weighted by the counts. Routes travel with
their rows (`routed_experts`, a per-row `routed_experts_start`) and prompts (`prompt_routed_experts`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# request fields with one entry per row (besides any list of lists, which is per row by its shape)
ROW_FIELDS = (
    "input_ids",
    "attention_mask",
    "action_mask",
    "num_actions",
    "prompt_index",
    "rollout_logprobs",
    "routed_experts",
    "routed_experts_start",
)
PROMPTS = "prompt_ids"  # a list of lists that is not per row: each chunk takes the prompts it names
PER_PROMPT = ("prompt_routed_experts",)  # one entry per prompt: they go with their prompts
SUMMED = frozenset({"usage"})  # response objects of counts
# response objects of statistics over a count of items (means are weighted by it, max_ maxed)
TOKEN_STATISTICS = {"rollout": "tokens", "route_agreement": "compared"}


@dataclass(frozen=True, slots=True)
class Chunk:
    """Rows `start .. stop-1` of the caller's batch (or, where given, its rows `rows`), as a complete
    request body; `replica`: the replica its groups go to (None: any); `group`: its first row's key."""

    start: int
    stop: int
    body: dict[str, Any]
    rows: tuple[int, ...] | None = None
    replica: int | None = None
    group: int | None = None


def split(
    body: Mapping[str, Any],
    *,
    max_chunk_tokens: int,
    max_chunk_rows: int,
    min_chunks: int,
    keys: Sequence[int] | None = None,
    replicas: int = 1,
    by_group: bool = False,
) -> list[Chunk]:
    """Chunks of about equal real-token counts: at least `min_chunks` (when there are that many rows),
    each of at most `max_chunk_rows` rows and `max_chunk_tokens` real tokens (unless one row alone is
    longer). Contiguous, unless `keys` (each row's group key) part them: over `replicas` > 1, every
    row of a key in chunks for replica key mod replicas; `by_group`, each key's rows on their own."""
    per_row = _row_fields(body)
    n_rows = len(body.get("input_ids") or ())
    if n_rows == 0 or any(len(body[name]) != n_rows for name in per_row) or not _indexes_prompts(body):
        return [Chunk(0, n_rows, dict(body), group=keys[0] if keys else None)]
    tokens = [max(1, n) for n in _real_tokens(body)]
    if keys is None or (replicas <= 1 and not by_group):
        bounds = _contiguous(tokens, max_chunk_tokens, max_chunk_rows, min_chunks)
        return [
            Chunk(a, b, _rows(body, per_row, range(a, b)), group=keys[a] if keys else None) for a, b in bounds
        ]
    parts: dict[int, list[int]] = {}
    for i, key in enumerate(keys):
        parts.setdefault(key if by_group else key % replicas, []).append(i)
    chunks = []
    for rows in parts.values():
        own = [tokens[i] for i in rows]
        for a, b in _contiguous(own, max_chunk_tokens, max_chunk_rows, 1):
            held = tuple(rows[a:b])
            replica = keys[held[0]] % replicas if replicas > 1 else None
            chunks.append(
                Chunk(held[0], held[-1] + 1, _rows(body, per_row, held), held, replica, keys[held[0]])
            )
    return chunks


def _contiguous(
    tokens: list[int], max_chunk_tokens: int, max_chunk_rows: int, min_chunks: int
) -> list[tuple[int, int]]:
    """[start, stop) of contiguous parts of rows of `tokens` real tokens each (split's rule)."""
    n_rows = len(tokens)
    total = sum(tokens)
    k = max(min(min_chunks, n_rows), math.ceil(total / max_chunk_tokens))
    # each row goes to the k-th part its token midpoint falls in; then parts are cut to the limits
    bounds: list[tuple[int, int]] = []
    start, held, part, before = 0, 0, 0, 0
    for i, n in enumerate(tokens):
        row_part = min(k - 1, (2 * before + n) * k // (2 * total))
        if i > start and (row_part != part or held + n > max_chunk_tokens or i - start == max_chunk_rows):
            bounds.append((start, i))
            start, held = i, 0
        part, held, before = row_part, held + n, before + n
    bounds.append((start, n_rows))
    return bounds


def reorder(merged: dict[str, Any], chunks: Sequence[Chunk]) -> dict[str, Any]:
    """`merged` (the chunks' replies merged in chunk order) with its per-row lists in the caller's
    order, where the chunks hold rows that are not contiguous."""
    if all(c.rows is None for c in chunks):
        return merged
    order = [r for c in chunks for r in (c.rows if c.rows is not None else range(c.start, c.stop))]
    out = dict(merged)
    for key, value in merged.items():
        if isinstance(value, list) and len(value) == len(order):
            rows: list[Any] = [None] * len(order)
            for value_row, row in zip(value, order, strict=True):
                rows[row] = value_row
            out[key] = rows
    return out


def _rows(body: Mapping[str, Any], per_row: list[str], held: Sequence[int]) -> dict[str, Any]:
    """The body of rows `held`; a grouped one with only the prompts they name, renumbered."""
    if isinstance(held, range) and held.step == 1:
        chunk = {**body, **{name: body[name][held.start : held.stop] for name in per_row}}
    else:
        chunk = {**body, **{name: [body[name][i] for i in held] for name in per_row}}
    if body.get(PROMPTS) is not None:
        named = list(dict.fromkeys(chunk["prompt_index"]))  # prompts in order of first use
        renumber = {p: k for k, p in enumerate(named)}
        chunk[PROMPTS] = [body[PROMPTS][p] for p in named]
        for name in PER_PROMPT:
            if isinstance(body.get(name), list | tuple) and len(body[name]) == len(body[PROMPTS]):
                chunk[name] = [body[name][p] for p in named]
        chunk["prompt_index"] = [renumber[p] for p in chunk["prompt_index"]]
    return chunk


def _indexes_prompts(body: Mapping[str, Any]) -> bool:
    """A body without prompts, or one whose prompt_index names each row's prompt: else it goes whole,
    for the server to name the fault."""
    prompts, index = body.get(PROMPTS), body.get("prompt_index")
    if prompts is None:
        return True
    return (
        isinstance(prompts, list | tuple)
        and isinstance(index, list | tuple)
        and all(
            isinstance(p, int)
            and not isinstance(p, bool)
            and 0 <= p < len(prompts)
            and isinstance(prompts[p], list | tuple)
            for p in index
        )
    )


def merge(replies: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One response body from the chunks' bodies, in chunk order. ValueError for an object field
    this client does not know how to combine, when the chunks disagree on it."""
    first = replies[0]
    merged: dict[str, Any] = {}
    for key, value in first.items():
        values = [reply.get(key) for reply in replies]
        if isinstance(value, list):
            merged[key] = [row for v in values for row in v or ()]
        elif isinstance(value, dict) and key in SUMMED:
            merged[key] = {k: sum(v[k] for v in values if v) for k in value}
        elif isinstance(value, dict) and key in TOKEN_STATISTICS:
            merged[key] = _token_statistics([v for v in values if v], TOKEN_STATISTICS[key])
        elif isinstance(value, dict) and any(v != value for v in values):
            raise ValueError(f"the chunks' `{key}` objects differ and this client cannot combine them")
        else:
            merged[key] = value
    return merged


def _token_statistics(parts: list[Mapping[str, Any]], count: str) -> dict[str, Any]:
    """Statistics over disjoint sets of `count` items (tokens), as if taken over their union."""
    tokens = sum(int(p[count]) for p in parts)
    merged: dict[str, Any] = {count: tokens}
    for name in parts[0]:
        if name == count:
            continue
        if any(p.get(name) is None for p in parts):  # a statistic the request did not ask
            merged[name] = None
        elif name.startswith("max_"):
            merged[name] = max(float(p[name]) for p in parts)
        else:
            merged[name] = sum(float(p[name]) * int(p[count]) for p in parts) / tokens if tokens else 0.0
    return merged


def _row_fields(body: Mapping[str, Any]) -> list[str]:
    def per_row(name: str, value: Any) -> bool:
        if not isinstance(value, list | tuple):
            return False
        return name in ROW_FIELDS or (bool(value) and all(isinstance(row, list | tuple) for row in value))

    return [
        name
        for name, value in body.items()
        if name != PROMPTS and name not in PER_PROMPT and per_row(name, value)
    ]


def _real_tokens(body: Mapping[str, Any]) -> list[int]:
    mask = body.get("attention_mask")
    if isinstance(mask, list):
        tokens = [sum(1 for m in row if m) for row in mask]
    else:
        tokens = [len(row) for row in body["input_ids"]]
    prompts = body.get(PROMPTS)
    if prompts is not None:  # a grouped body: each row is scored with its prompt
        tokens = [n + len(prompts[p]) for n, p in zip(tokens, body["prompt_index"], strict=True)]
    return tokens
