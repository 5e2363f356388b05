"""The grouped form (`prompt_ids` + `prompt_index`) -> one Row per response row of `input_ids`.

Each prompt is sent once: `prompt_ids` holds unpadded prompts, and row i of `input_ids` is a
response continuing prompt `prompt_ids[prompt_index[i]]`. Each row becomes the Row its ungrouped
twin would (tokens = the prompt + the response's real tokens), with the response as its window:

- ragged responses: window = the response's tokens; actions = all of them, the last
  `num_actions[i]`, or those `action_mask` (one 0/1 per response token) marks;
- padded responses `[B, R]` + `attention_mask` `[B, R]`: window = the R columns; actions = the real
  columns, narrowed by `action_mask` `[B, R]` when given.

The prompt is never an action. A prompt's fault is reported at the first row that continues it
(`row` always counts rows of `input_ids`). This module checks its own action fields.
"""

from __future__ import annotations

import numpy as np

from service.core.errors import InvalidRequest
from service.core.jobs import IntArray
from service.normalise.rows import Row, check_widths, int64, mask_row, per_row, real_tokens
from service.wire.schemas import LogprobsRequest

Prompts = dict[int, IntArray]  # prompt index -> its tokens [P], for the prompts some row names


def read_prompts(request: LogprobsRequest) -> Prompts:
    """The prompts some row names, as int64, checked against `prompt_index`. A prompt's errors name
    the first row that continues it (`row` always counts rows of `input_ids`); a prompt no row names
    is ignored, whatever it holds (docs/api.md, 'Grouped requests')."""
    if request.prompt_ids is None:
        raise InvalidRequest("prompt_index needs prompt_ids, the prompts it indexes", field="prompt_ids")
    index = request.prompt_index
    batch = len(request.input_ids)
    if index is None:
        raise InvalidRequest(
            "prompt_ids needs prompt_index: one entry per input_ids row, the prompt its response continues",
            field="prompt_index",
        )
    if len(index) != batch:
        raise InvalidRequest(
            f"prompt_index has {len(index)} entries for {batch} input_ids rows", field="prompt_index"
        )
    count = len(request.prompt_ids)
    first_row: dict[int, int] = {}
    for i, p in enumerate(index):
        if p >= count:
            raise InvalidRequest(
                f"prompt_index[{i}] is {p}; prompt_ids holds {count} prompt{'s' if count != 1 else ''}",
                field="prompt_index",
                row=i,
            )
        first_row.setdefault(p, i)
    prompts: Prompts = {}
    for p, row in sorted(first_row.items()):  # in prompt order: the first faulty prompt is reported
        ids = request.prompt_ids[p]
        if len(ids) == 0:
            raise InvalidRequest(
                f"prompt_ids[{p}] is empty; a prompt holds at least one token "
                f"(input_ids row {row} continues it)",
                field="prompt_ids",
                row=row,
            )
        prompts[p] = int64(ids, "prompt_ids", row, name=f"prompt_ids[{p}]")
    return prompts


def expanded_tokens(request: LogprobsRequest, prompts: Prompts) -> int:
    """Real tokens of the sequences the request stands for: each row's prompt plus its response."""
    assert request.prompt_index is not None
    prompt_tokens = sum(int(prompts[p].shape[0]) for p in request.prompt_index)
    if request.attention_mask is not None:
        return prompt_tokens + sum(int(np.count_nonzero(row)) for row in request.attention_mask)
    return prompt_tokens + sum(len(row) for row in request.input_ids)


def grouped_rows(request: LogprobsRequest, prompts: Prompts) -> list[Row]:
    if request.response_length is not None:
        raise InvalidRequest(
            "response_length does not apply with prompt_ids: each row's action window is its response "
            "(mark actions with num_actions or action_mask, or give neither to score every response token)",
            field="response_length",
        )
    if request.num_actions is not None and request.action_mask is not None:
        raise InvalidRequest(
            "give at most one of num_actions, action_mask (got num_actions and action_mask)",
            field="action_mask",
        )
    if request.attention_mask is not None:
        return _padded_responses(request, prompts)
    return _ragged_responses(request, prompts)


def _ragged_responses(request: LogprobsRequest, prompts: Prompts) -> list[Row]:
    assert request.prompt_index is not None
    batch = len(request.input_ids)
    counts = per_row(request.num_actions, batch, "num_actions") if request.num_actions is not None else None
    rows = []
    for i, ids in enumerate(request.input_ids):
        response = int64(ids, "input_ids", i)
        n = len(ids)
        if counts is not None:
            if counts[i] > n:
                raise InvalidRequest(
                    f"num_actions[{i}] = {counts[i]} is more than the {n} tokens of response row {i}",
                    field="num_actions",
                    row=i,
                )
            marked = np.arange(n - counts[i], n, dtype=np.int64)
        elif request.action_mask is not None:
            mask = mask_row(
                request.action_mask,
                "action_mask",
                batch=batch,
                i=i,
                length=n,
                what="one 0/1 per response token",
            )
            marked = np.flatnonzero(mask).astype(np.int64)
        else:
            marked = np.arange(n, dtype=np.int64)
        rows.append(_row(prompts, request.prompt_index[i], response, marked, slots=marked, width=n))
    return rows


def _padded_responses(request: LogprobsRequest, prompts: Prompts) -> list[Row]:
    assert request.attention_mask is not None
    assert request.prompt_index is not None
    if request.num_actions is not None:
        raise InvalidRequest(
            "num_actions is for ragged responses; padded responses (with attention_mask) take action_mask "
            "[B, R], or neither to score every real response token",
            field="num_actions",
        )
    batch, width = len(request.input_ids), check_widths(request.input_ids)
    rows = []
    for i in range(batch):
        real = mask_row(
            request.attention_mask, "attention_mask", batch=batch, i=i, length=width, what="one per column"
        )
        columns = np.flatnonzero(real)  # [R_i] columns of the real response tokens, in order
        marked = columns
        if request.action_mask is not None:
            marks = mask_row(
                request.action_mask, "action_mask", batch=batch, i=i, length=width, what="one per column"
            )
            marked = np.flatnonzero(marks)
            padding = marked[real[marked] == 0]
            if padding.size:
                raise InvalidRequest(
                    f"action_mask[{i}][{padding[0]}] marks column {padding[0]}, which is padding "
                    "(attention_mask 0)",
                    field="action_mask",
                    row=i,
                )
        position = np.cumsum(real) - 1  # [R] index of each real column among the response's tokens
        response = real_tokens(request.input_ids[i], columns, i)
        p = request.prompt_index[i]
        rows.append(_row(prompts, p, response, position[marked], slots=marked, width=width))
    return rows


def _row(
    prompts: Prompts, p: int, response: IntArray, marked: IntArray, *, slots: IntArray, width: int
) -> Row:
    """Sequence = prompt p + response; `marked` are action indices within the response's tokens."""
    prompt = prompts[p]
    n = int(prompt.shape[0])
    return Row(
        tokens=np.concatenate([prompt, response]),
        actions=(marked + n).astype(np.int64),
        slots=slots.astype(np.int64),
        width=width,
        prompt=p,
        prompt_length=n,
    )
