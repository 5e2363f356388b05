"""What a micro-batch's sequences ask beyond the log-prob, as the head's Extras (heads/base.py).

Boundary: each scored part (a whole job, or a chunk's actions of one) with its first action row in
the packed batch in; one Extras over the asking rows out (None when no part asks). A job's
candidate lists, sampler and draw seed are laid on its rows (the draw's rows `drawing`: its last
action's, in the part that holds it); a chunk takes the rows of its actions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from service.core.jobs import IntArray, SequenceJob
from service.engine.heads.base import Extras


@dataclass(frozen=True, slots=True)
class Part:
    """Actions [lo, hi) of `job` (indices into job.actions) scored at rows first .. first + hi - lo - 1."""

    job: SequenceJob
    lo: int
    hi: int
    first: int


def extras(parts: Sequence[Part], to: Callable[[np.ndarray], torch.Tensor]) -> Extras | None:
    """The asking parts' Extras; `to` moves a host array to the device."""
    asking = [p for p in parts if p.job.wants_extras and p.hi > p.lo]
    if not asking:
        return None
    rows = np.concatenate([np.arange(p.first, p.first + p.hi - p.lo, dtype=np.int64) for p in asking])
    jobs = [p.job for p in asking]
    counts = [p.hi - p.lo for p in asking]

    def per_row(values: list[float] | list[int], dtype: type) -> torch.Tensor:
        return to(np.repeat(np.asarray(values, dtype=dtype), counts))

    out = Extras(rows=rows, index=to(rows), top=max(job.top_logprobs for job in jobs))
    fields: dict[str, Any] = {}
    if any(job.candidate_ids is not None for job in jobs):
        fields["candidates"] = to(_candidates(asking))
    samplers = [job.sampling for job in jobs]
    if any(s is not None for s in samplers):
        top_k = [s.top_k if s is not None else 0 for s in samplers]
        top_p = [s.top_p if s is not None else 1.0 for s in samplers]
        fields |= {
            "top_k": per_row(top_k, np.int64),
            "top_p": per_row(top_p, np.float32),
            "min_p": per_row([s.min_p if s is not None else 0.0 for s in samplers], np.float32),
            "most_top_k": max(top_k),
            "least_top_k": min(top_k),
            "any_top_p": min(top_p) < 1.0,
        }
    if any(job.draw_seed is not None for job in jobs):
        fields["seeds"] = per_row([job.draw_seed or 0 for job in jobs], np.int64)
        fields["positions"] = to(np.concatenate([p.job.actions[p.lo : p.hi] for p in asking]))
        # a job draws at its last action only: the part that holds it, at its last row
        ends = np.cumsum(counts) - 1
        last = [p.job.draw_seed is not None and p.hi == p.job.actions.shape[0] for p in asking]
        fields["drawing"] = ends[np.asarray(last, dtype=bool)]
    return dataclasses.replace(out, **fields)


def _candidates(parts: list[Part]) -> IntArray:
    """[R, C] each row's candidate ids: a job's one list on all its rows, or its per-action lists;
    shorter lists (and parts without any) padded with id 0."""
    width = max(0 if p.job.candidate_ids is None else int(p.job.candidate_ids.shape[-1]) for p in parts)
    blocks = []
    for p in parts:
        block = np.zeros((p.hi - p.lo, width), dtype=np.int64)
        ids = p.job.candidate_ids
        if ids is not None:
            block[:, : ids.shape[-1]] = ids if ids.ndim == 1 else ids[p.lo : p.hi]
        blocks.append(block)
    return np.concatenate(blocks)
