"""Wire models of the HTTP API, with their limits; openapi.yaml is generated from them.

These check types and single-field bounds. Rules that relate fields to each other or to the model
(layouts, lengths, vocabulary) live in service/normalise/, which names the row at fault.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationError, create_model

from service.core.errors import InvalidRequest, from_pydantic
from service.settings import ReloadMode, Version

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

Body = TypeVar("Body", bound=BaseModel)
TokenId = Annotated[int, Strict(), Field(ge=0)]
Count = Annotated[int, Strict(), Field(ge=0)]
Flag = Annotated[int, Strict()]
ExpertId = Annotated[int, Strict()]
# one row's routed experts: [positions, moe_layers, top_k] ids, or SGLang's base64 of little-endian
# int32 (`meta_info.routed_experts`), or null (the row replays nothing)
RowRoutes = list[list[list[ExpertId]]] | str | None
RouteFormat = Literal["lists", "base64"]
DistributionFormat = Literal["lists", "base64"]


@dataclass(frozen=True, slots=True)
class Base64Ids:
    """A row of routes sent as SGLang's base64 string and decoded by the JSON reader (jsonrows.py):
    its ids, flat, a numpy view of the field's ids (u1 where every id of the field fits, else int32).
    A request read by the reader holds these where pydantic would hold the str."""

    ids: npt.NDArray[np.integer[Any]]


class SamplingParams(BaseModel):
    """The sampler a rollout drew with, applied after `temperature` in vLLM v1's order: min-p, then
    top-k, then top-p (docs/semantics.md, 'Beyond the log-prob'); vLLM's accepted ranges."""

    model_config = ConfigDict(extra="forbid")

    top_k: Annotated[int, Strict()] = Field(
        0, ge=-1, description="Keep the k most likely tokens (ties at the k-th kept); 0 or -1: off."
    )
    top_p: Annotated[float, Strict()] = Field(
        1.0,
        gt=0,
        le=1,
        allow_inf_nan=False,
        description="Keep the most likely tokens while those before hold less than top_p; 1: off.",
    )
    min_p: Annotated[float, Strict()] = Field(
        0.0,
        ge=0,
        le=1,
        allow_inf_nan=False,
        description="Keep tokens at least min_p times as likely as the most likely one; 0: off.",
    )


class LogprobsRequest(BaseModel):
    """Sequences to score, in one of four layouts (docs/api.md, 'Layouts').

    - ragged `input_ids` + `num_actions`: the last `num_actions[i]` tokens of each row are actions;
    - ragged `input_ids` + `action_mask` (one 0/1 per token): window is tokens 1..L-1;
    - padded `input_ids` + `attention_mask` + `response_length` R: window is the last R columns;
    - padded `input_ids` + `attention_mask` + `action_mask` [B, L-1]: window is columns 1..L-1.

    Grouped (docs/api.md, 'Grouped requests'): with `prompt_ids` and `prompt_index`, each row of
    `input_ids` is a response only, continuing prompt `prompt_ids[prompt_index[i]]`; the window is
    the response.
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
    prompt_ids: list[list[TokenId]] | None = Field(
        None,
        description="Grouped form: unpadded prompts, each sent once and non-empty; `input_ids` rows are "
        "then responses only, and each row's action window is its response.",
    )
    prompt_index: list[Count] | None = Field(
        None,
        description="Grouped form: one entry per `input_ids` row, the index in `prompt_ids` of the prompt "
        "the row's response continues.",
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
    top_logprobs: Annotated[int, Strict()] | None = Field(
        None,
        ge=1,
        description="Also return, at each action, the K most likely tokens (`top_ids`, `top_logprobs`, most "
        "likely first, equal logits by the lower id) at `temperature`, and the action token's `ranks` "
        "(vLLM's rank). At most the server's max_top_logprobs; past the vocabulary, the whole vocabulary.",
    )
    candidate_ids: list[TokenId] | list[list[list[TokenId]]] | None = Field(
        None,
        description="Token ids whose log-probs to return at each action (`candidate_logprobs`): one list for "
        "every action of every row, or per row one list per action window entry (laid out like the "
        "response's rows; entries that are not actions are ignored), every list of the same length.",
    )
    sampling: SamplingParams | None = Field(
        None,
        description="The rollout's sampler: also return `processed_logprobs`, each action's log-prob under "
        "the truncated, renormalised distribution (vLLM's processed_logprobs; null in JSON where the "
        "token lies outside the kept set, -inf in a frame), and the share outside in `rollout`.",
    )
    distribution_format: DistributionFormat = Field(
        "lists",
        description="How a JSON answer writes `top_ids`, `top_logprobs` and `candidate_logprobs`: nested "
        "lists, or base64: per row one string of its [window, K] block, little-endian int32 ids and "
        "float32 log-probs (-inf as it is), with `columns` giving each field's K (docs/api.md, 'Beyond "
        "the log-prob'). A compact frame carries them as arrays either way.",
    )
    routed_experts: list[RowRoutes] | None = Field(
        None,
        description="Routing replay (R3; MoE policies): per row, the experts the rollout chose, "
        "[positions, moe_layers, top_k] for positions `routed_experts_start` onward (padded layouts: "
        "columns; ragged and grouped: positions of the row's sequence, prompt then response), as nested "
        "lists or as SGLang's `meta_info.routed_experts` (base64 of little-endian int32); null replays "
        "nothing for that row. Positions not covered use the live router (docs/api.md, 'Routing replay').",
    )
    routed_experts_start: Count | list[Count] | None = Field(
        None,
        description="Where each row's `routed_experts` begin (one for all rows, or one per row); default 0, "
        "or in the grouped form the end of the prompt's `prompt_routed_experts` when those are given.",
    )
    prompt_routed_experts: list[RowRoutes] | None = Field(
        None,
        description="Grouped form: per prompt of `prompt_ids`, the experts the rollout chose over its "
        "positions 0 .. P-1 (P at most the prompt's length), sent once; each row's `routed_experts` "
        "then continue them over its response.",
    )
    return_routed_experts: Annotated[bool, Strict()] = Field(
        False,
        description="Recorded routes (R2; MoE policies): also return, per row, the experts the policy's "
        "own router chose at every position, in the request's route format.",
    )
    routed_experts_format: RouteFormat | None = Field(
        None,
        description="How a JSON answer writes `routed_experts`: lists, or base64 (little-endian int32, "
        "as SGLang). Default: base64 when the request's routes were base64 strings, else lists. A "
        "compact frame carries them as an array.",
    )
    weights_version: Version | None = Field(
        None,
        description="Pin the policy weights: if this replica serves another version, 409 and nothing is "
        "scored. Use it for old log-probs, which must come from the weights that sampled the rollouts.",
    )
    ref_weights_version: Version | None = Field(None, description="Pin the reference model's weights (409).")
    critic_weights_version: Version | None = Field(None, description="Pin the critic's weights (409).")


# the [rows, length] fields: a compact frame (frame.py) carries them as arrays, and the rest, the
# options, as a JSON object validated by ScoringOptions: the same fields, types and bounds
ARRAY_FIELDS = (
    "input_ids",
    "prompt_ids",
    "attention_mask",
    "action_mask",
    "rollout_logprobs",
    "routed_experts",
    "prompt_routed_experts",
)
_OPTIONS: dict[str, Any] = {
    name: (f.annotation, f) for name, f in LogprobsRequest.model_fields.items() if name not in ARRAY_FIELDS
}
ScoringOptions: type[BaseModel] = create_model(
    "ScoringOptions", __config__=ConfigDict(extra="forbid"), **_OPTIONS
)

# the rows of integers of a JSON body, which jsonrows.py reads into numpy; the other members are
# validated by JsonOptions: the same fields, types and bounds
MATRIX_FIELDS = ("input_ids", "prompt_ids", "attention_mask", "action_mask")
# the rows of routes of a JSON body, which jsonrows.py reads natively where it can (base64 decoded,
# nested lists as arrays), else JsonOptions validates them like the rest
ROUTE_FIELDS = ("routed_experts", "prompt_routed_experts")
_JSON_OPTIONS: dict[str, Any] = {
    name: (f.annotation, f) for name, f in LogprobsRequest.model_fields.items() if name not in MATRIX_FIELDS
}
JsonOptions: type[BaseModel] = create_model(
    "JsonOptions", __config__=ConfigDict(extra="forbid"), **_JSON_OPTIONS
)


def parse_request(raw: bytes) -> LogprobsRequest:
    """Parse and validate a JSON body in one pass (pydantic's Rust parser, no intermediate dicts)."""
    return parse_body(LogprobsRequest, raw)


def parse_body(model: type[Body], raw: bytes) -> Body:
    """`model` from a JSON body; any error is an InvalidRequest naming the field (422)."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        errors = exc.errors()
        raise (_flat_rows(errors) or from_pydantic(errors)) from None


# the fields that take a list of rows, one per sequence ([[...], [...]])
ROW_LIST_FIELDS = (*MATRIX_FIELDS, "rollout_logprobs")


def _flat_rows(errors: list[Any]) -> InvalidRequest | None:
    """A field of rows sent as one flat row (`"input_ids": [1, 2, 3]`) said so, rather than as
    pydantic's first complaint about its first number."""
    first = errors[0]
    loc = [part for part in first.get("loc", ()) if part != "body"]
    if first.get("type") != "list_type" or len(loc) != 2 or loc[0] not in ROW_LIST_FIELDS:
        return None
    if loc[1] != 0 or not isinstance(first.get("input"), int | float):  # its first entry is a number
        return None
    return InvalidRequest(
        f"{loc[0]}: a list of rows, one list per sequence ([[1, 2, 3]] for one sequence), not one flat "
        "list of numbers",
        field=str(loc[0]),
    )


class Usage(BaseModel):
    input_tokens: int = Field(description="Real (non-padding) tokens in the request.")
    scored_tokens: int = Field(description="Action tokens scored, after the EOS policy.")
    computed_tokens: int = Field(
        description="Tokens run through the decoder for this request: input_tokens less the prefixes "
        "shared with other sequences and computed once (a shared prefix's tokens are split among the "
        "sequences that share it, across requests too) and less cached_tokens."
    )
    cached_tokens: int = Field(
        0,
        description="Tokens of this request's sequences the prefix cache served: their keys, values and "
        "hidden states were computed for an earlier micro-batch (of this request or another) and read, "
        "not computed again (OpenAI's name for them).",
    )


class RolloutMismatch(BaseModel):
    """Over the request's action tokens, with d = logprob - rollout_logprob (null without
    rollout_logprobs), and the share of them outside the sampler's kept set (null without sampling)."""

    tokens: int
    mean_abs_diff: float | None = Field(None, description="mean |d|")
    max_abs_diff: float | None = Field(None, description="max |d|")
    mean_kl_k3: float | None = Field(
        None, description="mean of exp(d) - 1 - d: k3 estimate of KL(rollout || policy)"
    )
    ratio_outside_fraction: float | None = Field(
        None, description="fraction of tokens whose ratio exp(d) is outside [0.5, 2]"
    )
    outside_kept_fraction: float | None = Field(
        None,
        description="With `sampling`: fraction of tokens outside the sampler's kept set (processed log-prob "
        "-inf): tokens that sampler could not have drawn.",
    )


class MoeSummary(BaseModel):
    """The policy's sparse layers, as routes address them."""

    layers: int = Field(description="Sparse (MoE) layers, in model order: the routes' second axis.")
    experts: int = Field(description="Experts per layer: ids are 0 .. experts-1.")
    top_k: int = Field(description="Experts chosen per token: the routes' third axis.")


class RouteAgreementSummary(BaseModel):
    """Over the request's (position, layer) pairs with given routes: how far the live router strayed."""

    compared: int = Field(description="(position, layer) pairs with given routes")
    exact_fraction: float = Field(description="fraction whose live top-k set equals the given set")
    mean_overlap: float = Field(description="mean of |given ∩ live| / top_k")


class LogprobsResponse(BaseModel):
    """Every row is aligned to the request's action window; non-action entries are 0.0."""

    model: str
    logprobs: list[list[float]]
    entropy: list[list[float]] | None = None
    values: list[list[float]] | None = None
    ref_logprobs: list[list[float]] | None = None
    kl: list[list[float]] | None = None
    top_ids: list[list[list[int]] | str] | None = Field(
        None,
        description="With top_logprobs: per window entry, the K most likely token ids; with "
        "distribution_format base64, per row a base64 string of its [window, K] little-endian int32.",
    )
    top_logprobs: list[list[list[float]] | str] | None = Field(
        None, description="Their log-probs, alike (base64: little-endian float32)."
    )
    ranks: list[list[int]] | None = Field(
        None,
        description="With top_logprobs: the action token's rank, the tokens at least as likely, itself "
        "included (vLLM's; 1: most likely).",
    )
    candidate_logprobs: list[list[list[float]] | str] | None = Field(
        None,
        description="With candidate_ids: per window entry, the candidates' log-probs, in their order "
        "(base64: [window, C] little-endian float32).",
    )
    columns: dict[str, int] | None = Field(
        None,
        description="With distribution_format base64: each base64 field's K (top_ids, top_logprobs) or C "
        "(candidate_logprobs), the columns of its rows' [window, K] blocks.",
    )
    processed_logprobs: list[list[float | None]] | None = Field(
        None,
        description="With sampling: the log-prob under the sampler; null (JSON) where outside its kept set.",
    )
    rollout: RolloutMismatch | None = None
    routed_experts: list[list[list[list[int]]] | str] | None = Field(
        None,
        description="With return_routed_experts: per row, the experts the policy's router chose, "
        "[positions, moe_layers, top_k]: every column of a padded row (0 at padding), every position of "
        "a ragged or grouped row's sequence (prompt then response); lists, or base64 little-endian int32.",
    )
    moe: MoeSummary | None = Field(
        None, description="The policy's sparse layers, with routed_experts or given routes."
    )
    route_exact_fraction: list[float | None] | None = Field(
        None,
        description="With routed_experts: per row, the fraction of its (position, layer) pairs with given "
        "routes whose live top-k set equals the given set (null: the row gave none).",
    )
    route_mean_overlap: list[float | None] | None = Field(
        None, description="With routed_experts: per row, the mean of |given ∩ live| / top_k (null: none)."
    )
    route_agreement: RouteAgreementSummary | None = Field(
        None, description="With routed_experts: the agreement over every row that gave routes."
    )
    action_mask: list[list[int]] = Field(description="The mask actually applied, after the EOS policy.")
    usage: Usage
    weights_version: str = Field(description="Version of the policy weights that produced every score.")
    ref_weights_version: str | None = Field(
        None, description="Version of the reference weights (with ref_logprobs)."
    )
    critic_weights_version: str | None = Field(
        None, description="Version of the critic weights (with values)."
    )
    batch_invariant: bool = Field(
        False,
        description="The server runs batch-invariant (--batch-invariant): these scores are bitwise the same "
        "however the sequences were batched.",
    )


class ErrorDetail(BaseModel):
    type: str
    message: str
    field: str | None = None
    row: int | None = None
    target: str | None = Field(None, description="weights_version_mismatch: the pinned model.")
    requested_version: str | None = Field(None, description="weights_version_mismatch: the pinned version.")
    serving_version: str | None = Field(
        None, description="weights_version_mismatch: what this replica serves."
    )


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


Target = Literal["policy", "reference", "critic"]


class WeightsUpdate(BaseModel):
    """Serve new weights for one model, without a restart (POST /admin/weights)."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(
        min_length=1,
        max_length=4096,
        description="Local path, as the server sees it, of a safetensors checkpoint of the same "
        "architecture: a model directory (config.json + *.safetensors, sharded or not) or one "
        ".safetensors file.",
    )
    version: Version = Field(
        description="Label of the new weights; responses report it, requests may pin it."
    )
    target: Target = Field("policy", description="Which model to reload.")
    mode: ReloadMode | None = Field(
        None,
        description="swap: stage a second copy on the device, then copy it in there; copy: stage on the "
        "host, then copy in place between micro-batches; auto: swap when there is room. Default: the "
        "server's reload_mode.",
    )
    wait: Annotated[bool, Strict()] = Field(
        True, description="Answer once the weights serve (200) or were refused (422); false: 202 at once."
    )


class WeightsInfo(BaseModel):
    """The weights one model serves."""

    version: str
    source: str = Field(description="The checkpoint they came from.")
    mode: str = Field(description="initial, swap or copy: how they were put in service.")
    loaded_at: float = Field(description="Unix time they began serving.")
    reloads: int = Field(description="Reloads of this model since the start.")


class ReloadStatus(BaseModel):
    """One weight reload, under way or finished."""

    target: Target
    version: str
    path: str
    state: Literal["loading", "done", "unchanged", "rejected", "failed"] = Field(
        description="rejected: the checkpoint was refused (422) and the old weights keep serving; failed: "
        "the server could not apply it (500)."
    )
    mode: str | None = Field(None, description="swap or copy, once chosen.")
    bytes: int | None = Field(None, description="Bytes of weights staged.")
    started_at: float = Field(description="Unix time the reload was asked for.")
    stage_seconds: float | None = Field(None, description="Reading, checking and placing the checkpoint.")
    wait_seconds: float | None = Field(None, description="Waiting for the requests in flight to finish.")
    pause_seconds: float | None = Field(None, description="Scoring paused while the weights were applied.")
    error: str | None = Field(None, description="Why the reload failed; the old weights keep serving.")


class WeightsReport(BaseModel):
    """GET /admin/weights: what every model serves, and the latest reload of each."""

    weights: dict[str, WeightsInfo]
    reloads: dict[str, ReloadStatus]


class Info(BaseModel):
    model: str
    demo: bool = Field(description="True when serving the built-in random-weight demo model.")
    architecture: str
    dtype: str
    device: str
    attention_backend: str
    decoder: str = Field(
        description='The decoder forward: "fused" (logprobd\'s own: Llama-family models and Qwen3-MoE, '
        'Qwen2-MoE, Mixtral) or "transformers".'
    )
    kernels: str = Field(
        description='Fused kernels in use: "triton" (the fused decoder\'s), "liger" (patched into the '
        'transformers decoder) or "none" (plain torch).'
    )
    moe_kernel: str = Field(
        description="The fused decoder's mixture-of-experts layers: \"quack\" (quack-kernels' varlen GEMMs "
        'over every expert at once, the gather and SwiGLU inside), "grouped_mm" (torch\'s grouped GEMM over '
        'every expert at once), "loop" (one GEMM per expert) or "none" (no sparse layer runs fused: a dense '
        "model, or the transformers decoder)."
    )
    head_kernel: str = Field(
        "chunked",
        description='The policy\'s lm_head on calls that ask for log-probs alone: "quack" (one GEMM whose '
        'epilogue keeps each row\'s log-sum-exp and target logit; no logits written) or "chunked" (the GEMM '
        "over chunks of rows, then the log-softmax; every call asking more runs it too).",
    )
    vocab_size: int
    max_positions: int = Field(description="Positions the model covers, with its rope scaling (422 past it).")
    max_sequence_tokens: int = Field(
        description="The longest sequence this server scores (413 past it); longer than max_batch_tokens, "
        "it is scored in chunks."
    )
    max_sequence_limit: Literal["positions", "memory", "setting"] = Field(
        description="What sets max_sequence_tokens: the model's positions, the accelerator's memory for "
        "the sequence's keys and values, or the max_sequence_tokens setting."
    )
    max_batch_tokens: int = Field(
        description="Token budget of one packed micro-batch: the max_batch_tokens setting, or where it is "
        "unset the default for this policy and device."
    )
    batch_invariant: bool = Field(
        description="Scores are bitwise independent of batching (--batch-invariant; GEMMs in fixed calls)."
    )
    gemm: str = Field(
        "one-call",
        description="How GEMMs over tokens run: one-call; in batch-invariant mode fixed-tiles-quack (one "
        "call of a kernel whose configuration does not depend on the rows) or fixed-rows-1024 (calls of "
        "1024 rows). The bits of batch-invariant scores depend on it.",
    )
    share_prefixes: bool = Field(
        description="Prefixes that queued sequences share are computed once (share_prefixes; off in "
        "batch-invariant mode)."
    )
    share_min_tokens: int = Field(description="The shortest prefix shared.")
    prefix_cache_tokens: int = Field(
        0,
        description="Tokens each served model's prefix cache holds across micro-batches and requests "
        "(--prefix-cache-tokens, or measured at start); 0: no prefix cache.",
    )
    tensor_parallel_size: int = Field(
        1, description="GPUs (ranks) each model is sharded over (--tensor-parallel-size; 1: one process)."
    )
    versions: dict[str, str]
    models: list[ModelSummary] = Field(description="Every model loaded, with its memory.")
    weights_version: str = Field(description="Version of the policy weights now serving.")
    weights: dict[str, WeightsInfo] = Field(
        description="The weights every model serves (policy, reference, critic)."
    )
