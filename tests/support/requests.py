"""Random requests in each of the four layouts of docs/semantics.md, and in the grouped form."""

from __future__ import annotations

import random
from typing import Any

from tests.support import models

LAYOUTS = ("ragged_num_actions", "ragged_action_mask", "padded_response_length", "padded_action_mask")
PAD = 0


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def _with_options(rng: random.Random, request: dict[str, Any], vocab: int) -> dict[str, Any]:
    request["temperature"] = rng.choice([1.0, 0.7, 1.6])
    choice = rng.random()
    if choice < 0.3:
        request["eos_token_id"] = rng.randrange(vocab)
    elif choice < 0.5:
        request["eos_token_id"] = [rng.randrange(vocab) for _ in range(6)]
    request["return_entropy"] = rng.random() < 0.5
    return request


def make(layout: str, rng: random.Random, vocab: int, rows: int = 4, max_len: int = 24) -> dict[str, Any]:
    if layout.startswith("ragged"):
        ids = [_tokens(rng, rng.randint(1, max_len), vocab) for _ in range(rows)]
        return _with_options(rng, lay_out(layout, rng, [(row, []) for row in ids]), vocab)
    prompts = [_tokens(rng, rng.randint(1, max_len // 2), vocab) for _ in range(rows)]
    responses = [_tokens(rng, rng.randint(0, max_len // 2), vocab) for _ in range(rows)]
    return _with_options(rng, lay_out(layout, rng, list(zip(prompts, responses, strict=True))), vocab)


def lay_out(layout: str, rng: random.Random, rows: list[tuple[list[int], list[int]]]) -> dict[str, Any]:
    """A request of `rows` (prompt, response) in `layout`, random action counts or masks. Ragged: each
    row is prompt + response, whose last `len(response)` tokens or more are actions (num_actions)
    or a random mask; padded: prompts and responses padded apart or together, each row on a random
    side, the window the responses' columns (response_length) or a random mask over real columns."""
    if layout.startswith("ragged"):
        ids = [prompt + response for prompt, response in rows]
        request: dict[str, Any] = {"input_ids": ids}
        if layout == "ragged_num_actions":
            counts = [
                rng.randint(min(len(r), len(p + r) - 1), len(p + r) - 1) if len(p + r) > 1 else 0
                for p, r in rows
            ]
            request["num_actions"] = counts if rng.random() < 0.7 else min(counts)
        else:
            request["action_mask"] = [[0] + [int(rng.random() < 0.6) for _ in row[1:]] for row in ids]
        return request
    p_width = max(len(p) for p, _ in rows)
    r_width = max(len(r) for _, r in rows)
    ids, mask = [], []
    for prompt, response in rows:
        side = rng.choice(["left", "right", "split"])
        seq = prompt + response
        if side == "split":  # left-padded prompt, right-padded response (verl)
            row = [PAD] * (p_width - len(prompt)) + seq + [PAD] * (r_width - len(response))
            m = [0] * (p_width - len(prompt)) + [1] * len(seq) + [0] * (r_width - len(response))
        elif side == "left":
            row = [PAD] * (p_width + r_width - len(seq)) + seq
            m = [0] * (p_width + r_width - len(seq)) + [1] * len(seq)
        else:
            row = seq + [PAD] * (p_width + r_width - len(seq))
            m = [1] * len(seq) + [0] * (p_width + r_width - len(seq))
        ids.append(row)
        mask.append(m)
    request = {"input_ids": ids, "attention_mask": mask}
    width = p_width + r_width
    if layout == "padded_response_length":
        # the window may not reach any row's first real token
        first_real = max(m.index(1) for m in mask)
        request["response_length"] = min(r_width, width - 1 - first_real)
    else:
        action_mask = []
        for m in mask:
            first = m.index(1)
            action_mask.append(
                [int(m[c] == 1 and c != first and rng.random() < 0.7) for c in range(1, width)]
            )
        request["action_mask"] = action_mask
    return request


GROUPED_LAYOUTS = ("ragged", "ragged_num_actions", "ragged_action_mask", "padded", "padded_action_mask")


def make_grouped(
    layout: str, rng: random.Random, vocab: int, rows: int = 8, max_len: int = 12
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A grouped request (prompt_ids + prompt_index, `input_ids` rows are responses) and its ungrouped
    twin: the same sequences and actions, written out in full. Prompt 0 is shared by rows - 4 rows,
    prompt 1 by 3, prompt 2 by one, prompt 3 by none; rows are shuffled; two rows are identical.

    The twin's action window of row i ends with the grouped row's window (the response): the grouped
    row's scores are the last `len(grouped row)` entries of the twin's row.
    """
    prompt_ids = [_tokens(rng, rng.randint(1, max_len), vocab) for _ in range(4)]
    index = [0] * (rows - 4) + [1, 1, 1, 2]
    rng.shuffle(index)
    responses = [_tokens(rng, rng.randint(0, max_len), vocab) for _ in index]
    twins = [i for i, p in enumerate(index) if p == 1]
    responses[twins[1]] = responses[twins[0]]
    marks = [[int(rng.random() < 0.7) for _ in r] for r in responses]
    grouped: dict[str, Any] = {"prompt_ids": prompt_ids, "prompt_index": index}
    full = [prompt_ids[p] + r for p, r in zip(index, responses, strict=True)]
    twin: dict[str, Any] = {}
    if layout.startswith("ragged"):
        grouped["input_ids"] = responses
        twin["input_ids"] = full
        if layout == "ragged_num_actions":
            counts = [rng.randint(0, len(r)) for r in responses]
            marks = [
                [int(k >= len(r) - n) for k in range(len(r))] for r, n in zip(responses, counts, strict=True)
            ]
            grouped["num_actions"] = counts
        elif layout == "ragged_action_mask":
            grouped["action_mask"] = marks
        else:
            marks = [[1] * len(r) for r in responses]
        twin["action_mask"] = [[0] * len(prompt_ids[p]) + m for p, m in zip(index, marks, strict=True)]
        return _with_options(rng, grouped, vocab), _copy_options(grouped, twin)
    width = max(len(r) for r in responses)
    padded, mask = [], []
    for r in responses:
        pad = width - len(r)
        left = rng.random() < 0.2  # responses are right-padded (verl, TRL); any side is read the same
        padded.append([PAD] * pad + r if left else r + [PAD] * pad)
        mask.append([0] * pad + [1] * len(r) if left else [1] * len(r) + [0] * pad)
    grouped.update(input_ids=padded, attention_mask=mask)
    p_width = max(len(p) for p in prompt_ids)
    lead = [[PAD] * (p_width - len(prompt_ids[p])) + prompt_ids[p] for p in index]
    lead_mask = [[0] * (p_width - len(prompt_ids[p])) + [1] * len(prompt_ids[p]) for p in index]
    twin["input_ids"] = [a + b for a, b in zip(lead, padded, strict=True)]
    twin["attention_mask"] = [a + b for a, b in zip(lead_mask, mask, strict=True)]
    if layout == "padded":
        twin["response_length"] = width
    else:
        narrowed = [[int(m and rng.random() < 0.7) for m in row] for row in mask]
        grouped["action_mask"] = narrowed
        twin["action_mask"] = [([0] * p_width + row)[1:] for row in narrowed]
    return _with_options(rng, grouped, vocab), _copy_options(grouped, twin)


def _copy_options(grouped: dict[str, Any], twin: dict[str, Any]) -> dict[str, Any]:
    for name in ("temperature", "eos_token_id", "return_entropy"):
        if name in grouped:
            twin[name] = grouped[name]
    return twin


def ragged(seed: int, rows: int) -> dict[str, Any]:
    """`rows` random rows of 4 to 14 tokens of the tiny models' vocabulary, num_actions each."""
    rng = random.Random(seed)
    ids = [[rng.randrange(models.VOCAB) for _ in range(rng.randint(4, 14))] for _ in range(rows)]
    return {"input_ids": ids, "num_actions": [rng.randint(1, len(r) - 1) for r in ids]}
