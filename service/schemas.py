"""Wire models of the HTTP API, with their limits; openapi.yaml is generated from them.

These check types and single-field bounds. Rules that relate fields to each other or to the model
(layouts, lengths, vocabulary) live in normalise.py, which names the row at fault.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationError

from service.errors import from_pydantic

TokenId = Annotated[int, Strict(), Field(ge=0)]
Count = Annotated[int, Strict(), Field(ge=0)]
Flag = Annotated[int, Strict()]


class LogprobsRequest(BaseModel):
    """Sequences to score, in one of four layouts (see the README's semantics section).

    - ragged `input_ids` + `num_actions`: the last `num_actions[i]` tokens of each row are actions;
    - ragged `input_ids` + `action_mask` (one 0/1 per token): window is tokens 1..L-1;
    - padded `input_ids` + `attention_mask` + `response_length` R: window is the last R columns;
    - padded `input_ids` + `attention_mask` + `action_mask` [B, L-1]: window is columns 1..L-1.
    """

    model_config = ConfigDict(extra="forbid")

    input_ids: list[list[TokenId]] = Field(
        min_length=1, description="Token ids: a list of unpadded rows, or a padded [B, L] matrix."
    )
    attention_mask: list[list[Flag]] | None = Field(
        None, description="Padded layouts only: [B, L] of 0/1; 1 marks a real token."
    )
    num_actions: Count | list[Count] | None = Field(
        None, description="Ragged layout: how many trailing tokens of each row are actions."
    )
    action_mask: list[list[Flag]] | None = Field(
        None, description="0/1 per token (ragged, length L_i) or per column 1..L-1 (padded, length L-1)."
    )
    response_length: Count | None = Field(
        None, description="Padded layout: the last `response_length` columns are the action window."
    )
    temperature: Annotated[float, Strict()] = Field(
        1.0, gt=0, allow_inf_nan=False, description="Sampling temperature T: log_softmax(logits / T)."
    )
    eos_token_id: TokenId | list[TokenId] | None = Field(
        None, description="Actions after the first EOS action of a row are dropped (reported as masked)."
    )
    return_entropy: Annotated[bool, Strict()] = Field(
        False, description="Also return the entropy of each action's distribution."
    )


def parse_request(raw: bytes) -> LogprobsRequest:
    """Parse and validate a JSON body in one pass (pydantic's Rust parser, no intermediate dicts)."""
    try:
        return LogprobsRequest.model_validate_json(raw)
    except ValidationError as exc:
        raise from_pydantic(exc.errors()) from None


class Usage(BaseModel):
    input_tokens: int = Field(description="Real (non-padding) tokens in the request.")
    scored_tokens: int = Field(description="Action tokens scored, after the EOS policy.")


class LogprobsResponse(BaseModel):
    """Every row is aligned to the request's action window; non-action entries are 0.0."""

    model: str
    logprobs: list[list[float]]
    entropy: list[list[float]] | None = None
    action_mask: list[list[int]] = Field(description="The mask actually applied, after the EOS policy.")
    usage: Usage


class ErrorDetail(BaseModel):
    type: str
    message: str
    field: str | None = None
    row: int | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail


class Health(BaseModel):
    status: str


class Info(BaseModel):
    model: str
    demo: bool = Field(description="True when serving the built-in random-weight demo model.")
    architecture: str
    dtype: str
    device: str
    attention_backend: str
    kernels: str = Field(description='Fused decoder kernels in use ("liger" or "none").')
    vocab_size: int
    max_positions: int
    max_batch_tokens: int
    versions: dict[str, str]
