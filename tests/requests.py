"""Random requests in each of the four layouts of SEMANTICS.md."""

from __future__ import annotations

import random
from typing import Any

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
