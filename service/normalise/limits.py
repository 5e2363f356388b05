"""What this server allows a request: the models it holds, the request's size, each sequence's length.

`ModelLimits` is resolved once from the settings and the loaded models (http/app.py); the checks read it
and a request, never a layout: the size check takes the request's real tokens when the caller has
counted them (grouped form), and each sequence is checked as a `Row` after its layout is read.
Over a size limit of the server is a 413 naming the limit; what the model cannot take is a 422.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from service.core.errors import InvalidRequest, PayloadTooLarge, SequenceTooLarge
from service.engine.contract import MoeShape
from service.normalise.rows import Row
from service.wire.schemas import LogprobsRequest


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
    max_top_logprobs: int = 1024
    moe: MoeShape | None = None  # the policy's sparse layers (routes); None: dense


def check_models(request: LogprobsRequest, limits: ModelLimits) -> None:
    """A request for values, reference log-probs or a pin needs the model that gives them."""
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


def check_size(request: LogprobsRequest, limits: ModelLimits, tokens: int | None) -> None:
    """Request-size limits of the server: 413 naming the limit (422 for a deadline over the cap).
    `tokens`: the real tokens of the sequences, when the caller has counted them (grouped form);
    None counts them from `input_ids` (and `attention_mask` where given)."""

    def counted() -> int:
        if tokens is not None:
            return tokens
        if request.attention_mask is not None:
            return sum(int(np.count_nonzero(row)) for row in request.attention_mask)
        return sum(len(row) for row in request.input_ids)

    check_request_size(len(request.input_ids), counted, limits, unit="rows", field="input_ids")
    cap = limits.max_timeout_s
    if cap is not None and request.timeout_s is not None and request.timeout_s > cap:
        raise InvalidRequest(
            f"timeout_s {request.timeout_s} is over this server's cap of {limits.max_timeout_s} s",
            field="timeout_s",
        )


def check_request_size(
    sequences: int, tokens: Callable[[], int], limits: ModelLimits, *, unit: str, field: str
) -> None:
    """A request of `sequences` sequences (named `unit`) against max_request_sequences, and of
    `tokens()` tokens (counted only where the server caps them) against max_request_tokens: 413s
    naming the limit and `field`."""
    if limits.max_request_sequences is not None and sequences > limits.max_request_sequences:
        raise PayloadTooLarge(
            f"{sequences} {unit}; this server takes at most {limits.max_request_sequences} per request "
            "(max_request_sequences)",
            field=field,
        )
    if limits.max_request_tokens is not None:
        count = tokens()
        if count > limits.max_request_tokens:
            raise PayloadTooLarge(
                f"{count} tokens; this server takes at most {limits.max_request_tokens} per request "
                "(max_request_tokens)",
                field=field,
            )


def check_length(length: int, what: str, limits: ModelLimits, *, field: str, row: int) -> None:
    """A sequence of `length` tokens (`what`: how the message names it and its length) against the
    model's positions (422) and the longest sequence this server scores (413)."""
    positions = limits.max_positions or limits.max_sequence_tokens
    if length > positions:
        raise InvalidRequest(f"{what}; the model's positions cover {positions}", field=field, row=row)
    if length > limits.max_sequence_tokens:
        raise SequenceTooLarge(
            f"{what}; the longest sequence this server scores is {limits.max_sequence_tokens} "
            f"(set by {limits.max_sequence_limit})",
            field=field,
            row=row,
        )


def check_sequence(row: Row, i: int, limits: ModelLimits) -> None:
    """Row i's sequence against the model: its length (positions: 422; the server's longest: 413)
    and its token ids (inside the vocabulary). A grouped row's prompt is named as the fault's source."""
    tokens = row.tokens
    what = f"input_ids row {i}" if row.prompt is None else f"input_ids row {i} with prompt {row.prompt}"
    check_length(
        int(tokens.shape[0]), f"{what} has {tokens.shape[0]} tokens", limits, field="input_ids", row=i
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
