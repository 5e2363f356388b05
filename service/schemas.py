"""Wire models of the HTTP API, with their limits; openapi.yaml is generated from them.

These check types and single-field bounds. Rules that relate fields to each other or to the model
(layouts, lengths, vocabulary) live in normalise.py, which names the row at fault.
"""

from __future__ import annotations

from typing import Annotated, Literal

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
    return_values: Annotated[bool, Strict()] = Field(
        False,
        description="Also return the critic's values head(h_{t-1}) (needs a server started with --critic).",
    )
    return_ref_logprobs: Annotated[bool, Strict()] = Field(
        False,
        description="Also return the reference model's log-probs and the per-token KL (needs --ref-model).",
    )
    kl_estimator: Literal["k1", "k2", "k3"] = Field(
        "k1",
        description="KL estimator of `kl`, with r = logprob - ref_logprob: k1 = r, k2 = r²/2, "
        "k3 = exp(-r) - 1 + r (Schulman).",
    )
    rollout_logprobs: list[list[Annotated[float, Strict(), Field(allow_inf_nan=False)]]] | None = Field(
        None,
        description="The log-probs the inference engine reported at sampling time, laid out like the "
        "response's rows; the response then carries training-inference mismatch statistics.",
    )
    timeout_s: Annotated[float, Strict()] | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="Deadline of this request in seconds (default and cap: server settings); past it, "
        "504 and its unscored work is dropped.",
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


class RolloutMismatch(BaseModel):
    """Over the request's action tokens, with d = logprob - rollout_logprob."""

    tokens: int
    mean_abs_diff: float = Field(description="mean |d|")
    max_abs_diff: float = Field(description="max |d|")
    mean_kl_k3: float = Field(description="mean of exp(d) - 1 - d: k3 estimate of KL(rollout || policy)")
    ratio_outside_fraction: float = Field(
        description="fraction of tokens whose ratio exp(d) is outside [0.5, 2]"
    )


class LogprobsResponse(BaseModel):
    """Every row is aligned to the request's action window; non-action entries are 0.0."""

    model: str
    logprobs: list[list[float]]
    entropy: list[list[float]] | None = None
    values: list[list[float]] | None = None
    ref_logprobs: list[list[float]] | None = None
    kl: list[list[float]] | None = None
    rollout: RolloutMismatch | None = None
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


class ModelSummary(BaseModel):
    role: str = Field(description="policy, reference or critic")
    name: str
    architecture: str
    parameters: int
    memory_bytes: int


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
    models: list[ModelSummary] = Field(description="Every model loaded, with its memory.")
