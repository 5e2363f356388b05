"""Wire models of the completions surface: the scoring subset of OpenAI's legacy completions API
as vLLM serves it (vllm/entrypoints/openai/completion/protocol.py), token-id prompts only.

These check types and single-field bounds; what relates fields to each other or to the model
(text prompts, n, stream, max_tokens, K over the server's maximum, token ids) is plan.py's, which
names the field. Fields a client may send that change nothing logprobd computes (`user`, `stop`,
`stream_options`, vLLM's extensions) are accepted and ignored, as vLLM ignores unknown ones.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict

from service.wire.schemas import TokenId

Number = Annotated[float, Strict(), Field(allow_inf_nan=False)]


class CompletionRequest(BaseModel):
    """POST /v1/completions: score token-id prompts, and draw at most one token after each."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(None, description="The served model's id (GET /v1/models); omitted: that one.")
    prompt: list[TokenId] | list[list[TokenId]] | str | list[str] = Field(
        description="Token ids: one prompt (a list of ids) or several (a list of lists); text is refused."
    )
    max_tokens: Annotated[int, Strict()] | None = Field(
        None,
        description="0 or 1: tokens drawn after each prompt (omitted: 0; OpenAI's default of 16 is refused).",
    )
    temperature: Number | None = Field(
        None,
        ge=0,
        description="Scores are log_softmax(logits / T) (T = 0 scores at 1.0, vLLM's raw log-probs, and "
        "draws greedily); omitted: 1.0.",
    )
    seed: Annotated[int, Strict()] | None = Field(
        None, ge=0, le=2**63 - 1, description="Seed of the drawn token's sample (T > 0)."
    )
    prompt_logprobs: Annotated[int, Strict()] | None = Field(
        None,
        ge=-1,
        description="vLLM's: the K most likely tokens at every prompt position after the first, and the "
        "prompt token, in choices[i].prompt_logprobs (-1: the whole vocabulary).",
    )
    logprobs: Annotated[int, Strict()] | None = Field(
        None,
        ge=0,
        description="OpenAI's: with echo, the prompt's tokens and log-probs and the K most likely at each "
        "position, in choices[i].logprobs; with max_tokens 1, the drawn token's too.",
    )
    echo: Annotated[bool, Strict()] = Field(False, description="Return the prompt in text and logprobs.")
    n: Annotated[int, Strict()] = Field(1, ge=1, description="Choices per prompt: only 1.")
    best_of: Annotated[int, Strict()] | None = Field(None, ge=1, description="Only 1.")
    stream: Annotated[bool, Strict()] | None = Field(False, description="Only false: one JSON answer.")
    use_beam_search: Annotated[bool, Strict()] = Field(False, description="Only false.")
    top_p: Number | None = Field(None, description="Only 1 (a truncated draw is not served here).")
    top_k: Annotated[int, Strict()] | None = Field(None, description="Only 0 or -1 (off).")
    min_p: Number | None = Field(None, description="Only 0.")
    presence_penalty: Number | None = Field(None, description="Only 0.")
    frequency_penalty: Number | None = Field(None, description="Only 0.")
    repetition_penalty: Number | None = Field(None, description="Only 1.")
    logit_bias: dict[str, Any] | None = Field(None, description="Only empty.")
    suffix: str | None = Field(None, description="Only absent.")


class PromptLogprob(BaseModel):
    """vLLM's Logprob (vllm/logprobs.py): one token at one position."""

    logprob: float = Field(
        description="log_softmax(logits / T) of the token; -inf is sent as -9999.0 (vLLM's clamp)."
    )
    rank: int = Field(description="1 + the number of tokens more likely than this one.")
    decoded_token: str | None = Field(
        description="tokenizer.decode([id]) of the checkpoint's tokenizer; null without one."
    )


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy logprobs of a choice, one entry per token (lm-eval reads token_logprobs and
    top_logprobs)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["length"]
    stop_reason: None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = Field(
        description="One entry per prompt token: null for the first; then a map from the token id (as a "
        "string) to its Logprob, holding the prompt token itself (first) and the K most likely."
    )


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(
        description="Prompt tokens the prefix cache served: their keys, values and hidden states were "
        "computed for an earlier request and read, not computed again."
    )


class CompletionUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice] = Field(description="One per prompt, in the request's order.")
    usage: CompletionUsage


class ModelCard(BaseModel):
    id: str = Field(description="The model name logprobd reports in /info.")
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    parent: str | None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]
