"""Per-sequence scores -> the request's layout: one row per request row, aligned to its window.

Recorded routes (R2) go back per column of a padded row (0 at padding, as verl lays them out) or
per position of a ragged or grouped row's sequence, as the engine's narrow arrays; route agreement
per row and over the request. `to_json` writes the answer in the request's JSON forms: routes and
the [window, K] blocks of the distribution as nested lists, or as base64 little-endian int32 /
float32 strings, one a row (SGLang's encoding of routes), with `columns` giving the blocks' K; the
routes' and the blocks' text written natively, the GIL released (wire/jsonarrays.py), so answers
written on worker threads are written in parallel.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

import numpy as np
import orjson

from service.answer.diagnostics import kl
from service.core.errors import EngineFailure
from service.core.jobs import RouteAgreement, RouteArray, SequenceScores
from service.engine.contract import EngineInfo
from service.normalise import RowWindow, ScoringPlan
from service.wire.jsonarrays import base64_rows, float_lists, int_lists
from service.wire.schemas import RolloutMismatch, RouteAgreementSummary


def _row(window: RowWindow, values: np.ndarray | None, dtype: type, width: int | None) -> np.ndarray:
    """A zero row as wide as the window with a job's per-action values scattered in: [A] into
    [window], or with `width`, [A, <= width] into [window, width]."""
    row: np.ndarray = np.zeros((window.width,) if width is None else (window.width, width), dtype=dtype)
    if values is not None and width is None:
        row[window.slots] = values
    elif values is not None:
        row[window.slots, : values.shape[1]] = values
    return row


def _rows(
    plan: ScoringPlan,
    per_job: Sequence[np.ndarray | None],
    dtype: type = np.float32,
    width: int | None = None,
) -> list[np.ndarray]:
    """Each job's per-action values scattered into its row's window (_row)."""
    return [_row(w, values, dtype, width) for w, values in zip(plan.windows, per_job, strict=True)]


def _fills(window: RowWindow) -> bool:
    """The job's actions fill the row's window in order: action k is entry k."""
    slots, n = window.slots, window.width
    return slots.shape[0] == n and (n == 0 or (int(slots[0]) == 0 and bool(np.all(np.diff(slots) == 1))))


def _blocks(
    plan: ScoringPlan, per_job: Sequence[np.ndarray | None], dtype: type, width: int
) -> list[np.ndarray]:
    """[A, K] per job -> [window, width] per row, C-contiguous in `dtype`. Where a job's actions fill
    its window and the engine's block is already that (the usual case: one K, every response token
    an action), the block itself, no copy; else a zero row with the values scattered in (_row)."""
    rows = []
    for window, values in zip(plan.windows, per_job, strict=True):
        if (
            values is not None
            and values.dtype == dtype
            and values.shape == (window.width, width)
            and values.flags.c_contiguous
            and _fills(window)
        ):
            rows.append(values)
        else:
            rows.append(_row(window, values, dtype, width))
    return rows


def distribution(plan: ScoringPlan, scores: list[SequenceScores]) -> dict[str, Any]:
    """The response's top_ids (int32), top_logprobs, ranks, candidate_logprobs and processed_logprobs
    that the request asked (docs/api.md, 'Beyond the log-prob'); window entries that are not actions: 0."""
    job = plan.jobs[0]
    out: dict[str, Any] = {}
    if job.top_logprobs:
        width = max((s.top_ids.shape[1] for s in scores if s.top_ids is not None), default=0)
        out["top_ids"] = _blocks(plan, [s.top_ids for s in scores], np.int32, width)
        out["top_logprobs"] = _blocks(plan, [s.top_logprobs for s in scores], np.float32, width)
        out["ranks"] = _rows(plan, [s.ranks for s in scores], np.int64)
    if any(j.candidate_ids is not None for j in plan.jobs):
        values = [s.candidate_logprobs for s in scores]
        width = max((v.shape[1] for v in values if v is not None), default=0)
        out["candidate_logprobs"] = _blocks(plan, values, np.float32, width)
    if job.sampling is not None:
        out["processed_logprobs"] = _rows(plan, [s.processed_logprobs for s in scores])
    return out


def _recorded_routes(plan: ScoringPlan, scores: Sequence[SequenceScores]) -> list[RouteArray]:
    """Each row's recorded routes [L or width, layers, top_k], in the plan's layout, in the engine's
    narrow dtype (a frame packs them as they are, to_json writes them in the request's form)."""
    rows: list[RouteArray] = []
    for i, s in enumerate(scores):
        if s.routes is None:
            raise EngineFailure("the engine returned no routes for a sequence that asked for them")
        columns = plan.route_columns[i] if plan.route_columns is not None else None
        if columns is None:
            rows.append(np.ascontiguousarray(s.routes))
            continue
        wide = np.zeros((plan.padded_width, *s.routes.shape[1:]), dtype=s.routes.dtype)
        wide[columns] = s.routes
        rows.append(wide)
    return rows


def route_agreement(scores: Sequence[SequenceScores]) -> RouteAgreementSummary | None:
    """Agreement over every sequence that gave routes (None: none did)."""
    parts = [s.route_agreement for s in scores if s.route_agreement is not None]
    if not parts:
        return None
    total = RouteAgreement.join(parts)
    n = total.compared
    return RouteAgreementSummary(
        compared=n,
        exact_fraction=total.exact / n if n else 0.0,
        mean_overlap=total.overlap / n if n else 0.0,
    )


def _agreement_rows(
    agreements: Sequence[RouteAgreement | None],
) -> tuple[list[float | None], list[float | None]]:
    """Per row: the exact fraction and the mean overlap (None: the row gave no routes)."""
    exact: list[float | None] = []
    overlap: list[float | None] = []
    for a in agreements:
        exact.append(a.exact / a.compared if a is not None and a.compared else None)
        overlap.append(a.overlap / a.compared if a is not None and a.compared else None)
    return exact, overlap


# the [window, K] blocks of the distribution and their wire dtype in the base64 form
BLOCKS = {"top_ids": "<i4", "top_logprobs": "<f4", "candidate_logprobs": "<f4"}
LISTS = {"top_ids": int_lists, "top_logprobs": float_lists, "candidate_logprobs": float_lists}


# where a big array's text goes: orjson writes no raw NUL anywhere else (a string escapes it)
_NUL = b"\0"
_HOLE = orjson.Fragment(_NUL)


def to_json(body: dict[str, Any], *, routes: str = "lists", distribution: str = "lists") -> bytes:
    """An answer (see `answer`) as the JSON body of a LogprobsResponse: recorded routes and the
    distribution's blocks as nested lists, or (base64) one base64 string a row (`columns`: K)."""
    return b"".join(json_parts(body, routes=routes, distribution=distribution))


def json_parts(body: dict[str, Any], *, routes: str = "lists", distribution: str = "lists") -> list[bytes]:
    """`to_json`'s bytes as parts to send one after another: each big array's text (recorded routes,
    the distribution's blocks: ~14 MB of a 48-layer request's routes) as its writer wrote it, and
    orjson's JSON around them, so that the big texts are never copied into one buffer (orjson would
    copy them into its own, growing it as it goes)."""
    out = body
    big: dict[str, bytes] = {}
    recorded = body.get("routed_experts")
    if recorded is not None:
        big["routed_experts"] = base64_rows(recorded, "<i4") if routes == "base64" else int_lists(recorded)
    blocks = {name: body[name] for name in BLOCKS if body.get(name) is not None}
    if blocks and distribution == "base64":
        out = {**out, "columns": {name: _width(rows) for name, rows in blocks.items()}}
        big |= {name: base64_rows(rows, BLOCKS[name]) for name, rows in blocks.items()}
    elif blocks:
        big |= {name: LISTS[name](rows) for name, rows in blocks.items()}
    out = {**out, **dict.fromkeys(big, _HOLE)}  # keys keep their places: the holes come in `out`'s order
    around = orjson.dumps(out, option=orjson.OPT_SERIALIZE_NUMPY).split(_NUL)
    parts = [around[0]]
    for name, after in zip((k for k in out if k in big), around[1:], strict=True):
        parts += [big[name], after]
    return parts


def _width(rows: Sequence[np.ndarray]) -> int:
    """K of [window, K] blocks (every row's the same, an empty window's too)."""
    return int(rows[0].shape[1]) if rows else 0


def answer(
    plan: ScoringPlan,
    scores: list[SequenceScores],
    info: EngineInfo,
    versions: Mapping[str, str],
    rollout: RolloutMismatch | None = None,
    *,
    computed_tokens: int | None = None,
    cached_tokens: int = 0,
    agreement: RouteAgreementSummary | None = None,
) -> dict[str, Any]:
    """A LogprobsResponse, its rows as numpy arrays (JSON or a frame writes it). Non-action entries
    of a window are exactly 0.0; `versions` are the weights (model -> version) the request ran on;
    `computed_tokens` what the decoder ran for it (None: its input tokens), `cached_tokens` what the
    prefix cache served it; `agreement` the
    request's route agreement (route_agreement), when it gave routes."""
    job = plan.jobs[0]  # the options are the request's, the same for every job
    masks = []
    for window in plan.windows:
        mask = np.zeros(window.width, dtype=np.uint8)
        mask[window.slots] = 1
        masks.append(mask)
    body: dict[str, Any] = {
        "model": info.model,
        "logprobs": _rows(plan, [s.logprobs for s in scores]),
        "entropy": _rows(plan, [s.entropy for s in scores]) if job.return_entropy else None,
        "values": _rows(plan, [s.values for s in scores]) if job.return_values else None,
        "ref_logprobs": None,
        "kl": None,
        "rollout": rollout.model_dump() if rollout is not None else None,
        "action_mask": masks,
        "usage": {
            "input_tokens": plan.input_tokens,
            "scored_tokens": plan.scored_tokens,
            "computed_tokens": plan.input_tokens if computed_tokens is None else computed_tokens,
            "cached_tokens": cached_tokens,
        },
        "weights_version": versions["policy"],
        "ref_weights_version": versions["reference"] if job.return_ref else None,
        "critic_weights_version": versions["critic"] if job.return_values else None,
        "batch_invariant": info.batch_invariant,
    }
    body |= distribution(plan, scores)
    given = any(j.routes is not None for j in plan.jobs)
    if job.return_routes:
        body["routed_experts"] = _recorded_routes(plan, scores)
    if (job.return_routes or given) and info.moe is not None:
        body["moe"] = asdict(info.moe)
    if given:
        body["route_exact_fraction"], body["route_mean_overlap"] = _agreement_rows(
            [
                s.route_agreement if j.routes is not None else None
                for s, j in zip(scores, plan.jobs, strict=True)
            ]
        )
        body["route_agreement"] = agreement.model_dump() if agreement is not None else None
    if job.return_ref:
        body["ref_logprobs"] = _rows(plan, [s.ref_logprobs for s in scores])
        body["kl"] = _rows(
            plan,
            [
                kl(s.logprobs, s.ref_logprobs, plan.kl_estimator) if s.ref_logprobs is not None else None
                for s in scores
            ],
        )
    return body
