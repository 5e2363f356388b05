"""Any accepted request layout -> one SequenceJob per row, plus where each score goes back.

This is where SEMANTICS.md's layouts, action windows and EOS policy are implemented; every rule
that a request can break raises InvalidRequest naming the field and the row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from service.errors import InvalidRequest, PayloadTooLarge, SequenceTooLarge
from service.grouped import expanded_tokens, grouped_rows, read_prompts
from service.jobs import FloatArray, IntArray, SequenceJob
from service.rows import Row, check_widths, int64, mask_row, per_row, real_tokens
from service.schemas import LogprobsRequest


@dataclass(frozen=True, slots=True)
class ModelLimits:
    vocab_size: int
    max_sequence_tokens: int  # 413 past it, naming it and what sets it
    max_positions: int | None = None  # 422 past it (None: max_sequence_tokens)
    max_sequence_limit: str = "positions"
    has_critic: bool = False
    has_reference: bool = False
    max_request_sequences: int | None = None
    max_request_tokens: int | None = None
    max_timeout_s: float | None = None


@dataclass(frozen=True, slots=True)
class RowWindow:
    """The action window of one request row: `width` entries; action k of the job fills slots[k]."""

    width: int
    slots: IntArray


@dataclass(frozen=True, slots=True)
class ScoringPlan:
    jobs: list[SequenceJob]
    windows: list[RowWindow]
    kl_estimator: str = "k1"
    rollout: list[FloatArray] | None = None  # per job, aligned with its actions
    pins: dict[str, str] = field(default_factory=dict)  # model -> the weights version the request requires

    @property
    def input_tokens(self) -> int:
        return sum(job.num_tokens for job in self.jobs)

    @property
    def scored_tokens(self) -> int:
        return sum(int(job.actions.shape[0]) for job in self.jobs)


_SPECS = ("num_actions", "action_mask", "response_length")


def normalise(request: LogprobsRequest, limits: ModelLimits) -> ScoringPlan:
    grouped = request.prompt_ids is not None or request.prompt_index is not None
    given = [name for name in _SPECS if getattr(request, name) is not None]
    if len(given) != 1 and not grouped:  # grouped.py checks its own
        found = " and ".join(given) if given else "none"
        raise InvalidRequest(
            f"give exactly one of num_actions, action_mask, response_length (got {found})",
            field=given[1] if len(given) > 1 else "num_actions",
        )
    _check_models(request, limits)
    if grouped:
        prompts = read_prompts(request)
        _check_size(request, limits, expanded_tokens(request, prompts))
        rows = grouped_rows(request, prompts)
    else:
        _check_size(request, limits, None)
        rows = _padded_rows(request) if request.attention_mask is not None else _ragged_rows(request)
    eos = _eos_ids(request.eos_token_id)
    jobs: list[SequenceJob] = []
    windows: list[RowWindow] = []
    for i, row in enumerate(rows):
        _check_tokens(row, i, limits)
        keep = _eos_cut(row.tokens[row.actions], eos)
        jobs.append(
            SequenceJob(
                tokens=row.tokens,
                actions=row.actions[:keep],
                temperature=request.temperature,
                return_entropy=request.return_entropy,
                return_values=request.return_values,
                return_ref=request.return_ref_logprobs,
            )
        )
        windows.append(RowWindow(width=row.width, slots=row.slots[:keep]))
    rollout = _rollout(request.rollout_logprobs, windows) if request.rollout_logprobs is not None else None
    return ScoringPlan(
        jobs=jobs, windows=windows, kl_estimator=request.kl_estimator, rollout=rollout, pins=_pins(request)
    )


def _check_size(request: LogprobsRequest, limits: ModelLimits, tokens: int | None) -> None:
    """Request-size limits of the server: 413 naming the limit (422 for a deadline over the cap).
    `tokens`: the real tokens of the sequences, when the caller has counted them (grouped form)."""
    rows = len(request.input_ids)
    if limits.max_request_sequences is not None and rows > limits.max_request_sequences:
        raise PayloadTooLarge(
            f"{rows} rows; this server takes at most {limits.max_request_sequences} per request "
            "(max_request_sequences)",
            field="input_ids",
        )
    if limits.max_request_tokens is not None:
        if tokens is None and request.attention_mask is not None:
            tokens = sum(int(np.count_nonzero(row)) for row in request.attention_mask)
        elif tokens is None:
            tokens = sum(len(row) for row in request.input_ids)
        if tokens > limits.max_request_tokens:
            raise PayloadTooLarge(
                f"{tokens} tokens; this server takes at most {limits.max_request_tokens} per request "
                "(max_request_tokens)",
                field="input_ids",
            )
    cap = limits.max_timeout_s
    if cap is not None and request.timeout_s is not None and request.timeout_s > cap:
        raise InvalidRequest(
            f"timeout_s {request.timeout_s} is over this server's cap of {limits.max_timeout_s} s",
            field="timeout_s",
        )


def _check_models(request: LogprobsRequest, limits: ModelLimits) -> None:
    if request.return_values and not limits.has_critic:
        raise InvalidRequest(
            "return_values needs a critic: this server was started without --critic", field="return_values"
        )
    if request.return_ref_logprobs and not limits.has_reference:
        raise InvalidRequest(
            "return_ref_logprobs needs a reference model: this server was started without --ref-model",
            field="return_ref_logprobs",
        )
    if request.critic_weights_version is not None and not limits.has_critic:
        raise InvalidRequest(
            "critic_weights_version pins a critic: this server has none", field="critic_weights_version"
        )
    if request.ref_weights_version is not None and not limits.has_reference:
        raise InvalidRequest(
            "ref_weights_version pins a reference model: this server has none", field="ref_weights_version"
        )


def _pins(request: LogprobsRequest) -> dict[str, str]:
    pins = {
        "policy": request.weights_version,
        "reference": request.ref_weights_version,
        "critic": request.critic_weights_version,
    }
    return {target: version for target, version in pins.items() if version is not None}


def _rollout(rows: list[list[float]], windows: list[RowWindow]) -> list[FloatArray]:
    """The rollout log-probs of each row's actions; rows are laid out like the response's."""
    if len(rows) != len(windows):
        raise InvalidRequest(
            f"rollout_logprobs has {len(rows)} rows, the request has {len(windows)}", field="rollout_logprobs"
        )
    out = []
    for i, (row, window) in enumerate(zip(rows, windows, strict=True)):
        if len(row) != window.width:
            raise InvalidRequest(
                f"rollout_logprobs row {i} has {len(row)} entries; its action window has {window.width}",
                field="rollout_logprobs",
                row=i,
            )
        out.append(np.asarray(row, dtype=np.float32)[window.slots])
    return out


def _ragged_rows(request: LogprobsRequest) -> list[Row]:
    if request.response_length is not None:
        raise InvalidRequest(
            "response_length needs padded input_ids with an attention_mask; "
            "for ragged rows use num_actions or action_mask",
            field="response_length",
        )
    batch = len(request.input_ids)
    rows: list[Row] = []
    for i, ids in enumerate(request.input_ids):
        tokens = int64(ids, "input_ids", i)
        length = len(ids)
        if length == 0:
            raise InvalidRequest(f"input_ids row {i} is empty", field="input_ids", row=i)
        if request.num_actions is not None:
            n = per_row(request.num_actions, batch, "num_actions")[i]
            if n >= length:
                raise InvalidRequest(
                    f"num_actions[{i}] = {n} must be smaller than the row length {length} "
                    "(position 0 is never an action)",
                    field="num_actions",
                    row=i,
                )
            actions = np.arange(length - n, length, dtype=np.int64)
            rows.append(Row(tokens, actions, np.arange(n, dtype=np.int64), n))
        else:
            assert request.action_mask is not None
            mask = mask_row(
                request.action_mask, "action_mask", batch=batch, i=i, length=length, what="one 0/1 per token"
            )
            if mask[0]:
                raise InvalidRequest(
                    f"action_mask[{i}][0] marks position 0, which is never an action",
                    field="action_mask",
                    row=i,
                )
            actions = np.flatnonzero(mask).astype(np.int64)
            rows.append(Row(tokens, actions, actions - 1, length - 1))
    return rows


def _padded_rows(request: LogprobsRequest) -> list[Row]:
    assert request.attention_mask is not None
    if request.num_actions is not None:
        raise InvalidRequest(
            "num_actions is for ragged input_ids (no attention_mask); "
            "padded input takes response_length or action_mask",
            field="num_actions",
        )
    batch, width = len(request.input_ids), check_widths(request.input_ids)
    if width == 0:
        raise InvalidRequest("input_ids rows are empty", field="input_ids", row=0)
    rows: list[Row] = []
    for i in range(batch):
        real = mask_row(
            request.attention_mask, "attention_mask", batch=batch, i=i, length=width, what="one per column"
        )
        columns = np.flatnonzero(real)  # [L_i] columns of the real tokens, in order
        if columns.size == 0:
            raise InvalidRequest(f"attention_mask row {i} has no real token", field="attention_mask", row=i)
        position = np.cumsum(real) - 1  # [L] position id of each real column
        if request.response_length is not None:
            r = request.response_length
            if r >= width:
                raise InvalidRequest(
                    f"response_length {r} must be smaller than the padded row length {width}",
                    field="response_length",
                )
            start = width - r
            action_columns = columns[columns >= start]
            field = "response_length"
        else:
            assert request.action_mask is not None
            marks = mask_row(
                request.action_mask,
                "action_mask",
                batch=batch,
                i=i,
                length=width - 1,
                what="one per column 1..L-1",
            )
            action_columns = np.flatnonzero(marks) + 1
            start, field = 1, "action_mask"
            padding = action_columns[real[action_columns] == 0]
            if padding.size:
                raise InvalidRequest(
                    f"action_mask[{i}][{padding[0] - 1}] marks column {padding[0]}, which is padding "
                    "(attention_mask 0)",
                    field="action_mask",
                    row=i,
                )
        if action_columns.size and action_columns[0] == columns[0]:
            raise InvalidRequest(
                f"{field} row {i}: column {columns[0]} is the first real token (position 0) and cannot be an "
                "action; the prompt must hold at least one real token",
                field=field,
                row=i,
            )
        rows.append(
            Row(
                tokens=real_tokens(request.input_ids[i], columns, i),
                actions=position[action_columns].astype(np.int64),
                slots=(action_columns - start).astype(np.int64),
                width=width - start,
            )
        )
    return rows


def _check_tokens(row: Row, i: int, limits: ModelLimits) -> None:
    tokens = row.tokens
    what = f"input_ids row {i}" if row.prompt is None else f"input_ids row {i} with prompt {row.prompt}"
    positions = limits.max_positions or limits.max_sequence_tokens
    if tokens.shape[0] > positions:
        raise InvalidRequest(
            f"{what} has {tokens.shape[0]} tokens; the model's positions cover {positions}",
            field="input_ids",
            row=i,
        )
    if tokens.shape[0] > limits.max_sequence_tokens:
        raise SequenceTooLarge(
            f"{what} has {tokens.shape[0]} tokens; the longest sequence this server scores is "
            f"{limits.max_sequence_tokens} (set by {limits.max_sequence_limit})",
            field="input_ids",
            row=i,
        )
    outside = np.flatnonzero(tokens >= limits.vocab_size)
    if not outside.size:
        return
    k, vocabulary = int(outside[0]), f"outside the vocabulary [0, {limits.vocab_size})"
    if k < row.prompt_length:  # grouped form: the prompt is at fault, named through this row
        raise InvalidRequest(
            f"prompt_ids[{row.prompt}]: token id {tokens[k]} (token {k}) is {vocabulary} "
            f"(input_ids row {i} continues it)",
            field="prompt_ids",
            row=i,
        )
    where = f"real token {k}" if row.prompt is None else f"response token {k - row.prompt_length}"
    raise InvalidRequest(
        f"input_ids row {i}: token id {tokens[k]} ({where}) is {vocabulary}", field="input_ids", row=i
    )


def _eos_ids(eos: int | list[int] | None) -> IntArray | None:
    if eos is None:
        return None
    ids = [eos] if isinstance(eos, int) else eos
    top = int(np.iinfo(np.int64).max)  # a larger id is valid JSON but can match no token: drop it
    return np.asarray([e for e in ids if e <= top], dtype=np.int64)


def _eos_cut(action_tokens: IntArray, eos: IntArray | None) -> int:
    """How many actions to keep: up to and including the first EOS action."""
    if eos is None or eos.size == 0:
        return int(action_tokens.shape[0])
    hits = np.flatnonzero(np.isin(action_tokens, eos))
    return int(hits[0]) + 1 if hits.size else int(action_tokens.shape[0])
