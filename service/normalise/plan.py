"""The request's rows -> the ScoringPlan the batcher and answer/layout.py read.

Applies the EOS policy (docs/semantics.md, 'Actions and EOS': each row keeps its actions up to and
including its first EOS action), turns each Row into a SequenceJob (tokens [L], actions [A]) and a
RowWindow (width, slots [A]), lays `rollout_logprobs` out like the response rows, and collects the
weights versions the request pins. The rows arrive checked; only `rollout_logprobs` is read here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from service.core.errors import InvalidRequest
from service.core.jobs import FloatArray, GivenRoutes, IntArray, SequenceJob
from service.normalise.distribution import Asks
from service.normalise.rows import Row
from service.wire.schemas import LogprobsRequest


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
    route_format: str = "lists"  # how a JSON answer writes routes: lists | base64
    distribution_format: str = "lists"  # how it writes the [window, K] blocks: lists | base64
    # padded layouts: per row, the column of each real token [L] and the padded width, so recorded
    # routes go back per column (0 at padding); None: per position of the sequence
    route_columns: list[IntArray | None] | None = None
    padded_width: int = 0

    @property
    def input_tokens(self) -> int:
        return sum(job.num_tokens for job in self.jobs)

    @property
    def scored_tokens(self) -> int:
        return sum(int(job.actions.shape[0]) for job in self.jobs)


def build_plan(
    request: LogprobsRequest,
    rows: list[Row],
    asks: Asks | None = None,
    routes: list[GivenRoutes | None] | None = None,
    route_format: str = "lists",
) -> ScoringPlan:
    """One job and one window per row, in the request's row order; `asks`: what each job wants beyond
    the log-prob; `routes`: each row's given routes."""
    asks = asks or Asks()
    routes = routes or [None] * len(rows)
    eos = _eos_ids(request.eos_token_id)
    jobs: list[SequenceJob] = []
    windows: list[RowWindow] = []
    for i, (row, given) in enumerate(zip(rows, routes, strict=True)):
        keep = _eos_cut(row.tokens[row.actions], eos)
        jobs.append(
            SequenceJob(
                tokens=row.tokens,
                actions=row.actions[:keep],
                temperature=request.temperature,
                return_entropy=request.return_entropy,
                return_values=request.return_values,
                return_ref=request.return_ref_logprobs,
                top_logprobs=asks.top_logprobs,
                candidate_ids=asks.candidates(i, row.slots[:keep]),
                sampling=asks.sampling,
                routes=given,
                return_routes=request.return_routed_experts,
            )
        )
        windows.append(RowWindow(width=row.width, slots=row.slots[:keep]))
    rollout = _rollout(request.rollout_logprobs, windows) if request.rollout_logprobs is not None else None
    padded = request.attention_mask is not None and request.prompt_ids is None
    return ScoringPlan(
        jobs=jobs,
        windows=windows,
        kl_estimator=request.kl_estimator,
        rollout=rollout,
        pins=_pins(request),
        route_format=route_format,
        distribution_format=request.distribution_format,
        route_columns=[row.columns for row in rows] if padded else None,
        padded_width=len(request.input_ids[0]) if padded else 0,
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


def _pins(request: LogprobsRequest) -> dict[str, str]:
    pins = {
        "policy": request.weights_version,
        "reference": request.ref_weights_version,
        "critic": request.critic_weights_version,
    }
    return {target: version for target, version in pins.items() if version is not None}
