"""Any accepted request layout -> one SequenceJob per row, plus where each score goes back.

Normalisation sits between the wire models (wire/schemas.py, wire/arrays.py) and the batcher: it
implements docs/semantics.md's layouts, action windows and EOS policy, and every rule that relates
fields to each other or to the model raises InvalidRequest (or a 413) naming the field and the row.
Its users need `normalise(request, limits) -> ScoringPlan`, `ModelLimits`, and the plan's `RowWindow`.

Modules, top-down as the data flows; each imports only modules below it:

    __init__       normalise(): the request's checks, its layout read into Rows, each sequence checked
    limits         ModelLimits and what the server allows: models held, request size, each sequence
    plan           Rows -> ScoringPlan: the EOS cut, jobs, windows, rollout log-probs, pins
    distribution   top_logprobs, candidate_ids, sampling -> Asks, each job's share of them
    ragged         ragged input_ids [B][L_i] + num_actions | action_mask -> Rows
    padded         padded input_ids [B, L] + attention_mask + response_length | action_mask -> Rows
    grouped        prompt_ids + prompt_index + responses (ragged or padded) -> Rows
    expert_routes  routed_experts (lists, base64, frame rows) -> GivenRoutes per row, positions mapped
    rows           Row (tokens [L], actions [A], slots [A], width) and the readers every layout shares
"""

from __future__ import annotations

from service.core.errors import InvalidRequest
from service.normalise.distribution import read_asks
from service.normalise.expert_routes import given_routes, route_format
from service.normalise.grouped import expanded_tokens, grouped_rows, read_prompts
from service.normalise.limits import ModelLimits, check_models, check_sequence, check_size
from service.normalise.padded import padded_rows
from service.normalise.plan import RowWindow, ScoringPlan, build_plan
from service.normalise.ragged import ragged_rows
from service.normalise.rows import Row
from service.wire.schemas import LogprobsRequest

__all__ = ["ModelLimits", "RowWindow", "ScoringPlan", "normalise"]

_SPECS = ("num_actions", "action_mask", "response_length")


def normalise(request: LogprobsRequest, limits: ModelLimits) -> ScoringPlan:
    grouped = request.prompt_ids is not None or request.prompt_index is not None
    if not grouped:  # grouped rows check their own action fields
        _check_one_spec(request)
    check_models(request, limits)
    rows = _grouped_rows(request, limits) if grouped else _ungrouped_rows(request, limits)
    for i, row in enumerate(rows):
        check_sequence(row, i, limits)
    widths = [row.width for row in rows]
    asks = read_asks(request, limits.max_top_logprobs, limits.vocab_size, widths)
    routes = given_routes(request, rows, limits.moe)
    return build_plan(request, rows, asks, routes, route_format(request))


def _check_one_spec(request: LogprobsRequest) -> None:
    given = [name for name in _SPECS if getattr(request, name) is not None]
    if len(given) != 1:
        found = " and ".join(given) if given else "none"
        raise InvalidRequest(
            f"give exactly one of num_actions, action_mask, response_length (got {found})",
            field=given[1] if len(given) > 1 else "num_actions",
        )


def _grouped_rows(request: LogprobsRequest, limits: ModelLimits) -> list[Row]:
    prompts = read_prompts(request)
    check_size(request, limits, expanded_tokens(request, prompts))
    return grouped_rows(request, prompts)


def _ungrouped_rows(request: LogprobsRequest, limits: ModelLimits) -> list[Row]:
    check_size(request, limits, None)
    return padded_rows(request) if request.attention_mask is not None else ragged_rows(request)
