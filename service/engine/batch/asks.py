"""What a micro-batch's action rows ask beyond the log-prob (Extras), which the heads compute
(heads/extras.py).

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


@dataclass(frozen=True, slots=True)
class Part:
    """Actions [lo, hi) of `job` (indices into job.actions) scored at rows first .. first + hi - lo - 1."""

    job: SequenceJob
    lo: int
    hi: int
    first: int


@dataclass(frozen=True, slots=True)
class Extras:
    """What R of the A action rows ask beyond their log-prob (docs/semantics.md, 'Beyond the log-prob').

    Every asking row gets every field asked by any of them (one micro-batch's union); the engine
    hands each job only what it asked. Device tensors are [R] per asking row, in row order.

    rows:        [R] host int64, sorted: the asking rows' indices in [0, A)
    index:       [R] the same on the device
    top:         K of the top list (0: none)
    candidates:  [R, C] token ids (a job's shorter lists padded with 0); None: none asked
    top_k, top_p, min_p: [R] the sampler of each row (0 / 1 / 0: off); None: no processed log-probs
    seeds, positions: [R] int64 seed and position in the sequence of each draw; None: no draw
    drawing:     host int64 indices into the R rows of those whose job draws (the others' seeds are
                 the union's filler); None: every row with a seed draws
    """

    rows: np.ndarray
    index: torch.Tensor
    top: int = 0
    candidates: torch.Tensor | None = None
    top_k: torch.Tensor | None = None
    top_p: torch.Tensor | None = None
    min_p: torch.Tensor | None = None
    seeds: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    drawing: np.ndarray | None = None
    most_top_k: int = 0  # host: the largest top_k of the rows (0: no row truncates by rank)
    least_top_k: int = 0  # host: the smallest top_k of the rows (0: some row does not truncate by rank)
    any_top_p: bool = False  # host: some row's top_p is below 1

    def part(self, lo: int, hi: int) -> Extras:
        """Asking rows [lo, hi) of these."""

        def cut(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[lo:hi]

        return Extras(
            rows=self.rows[lo:hi],
            index=self.index[lo:hi],
            top=self.top,
            candidates=cut(self.candidates),
            top_k=cut(self.top_k),
            top_p=cut(self.top_p),
            min_p=cut(self.min_p),
            seeds=cut(self.seeds),
            positions=cut(self.positions),
            drawing=None if self.drawing is None else self.drawn_rows(lo, hi) - lo,
            most_top_k=self.most_top_k,
            least_top_k=self.least_top_k,
            any_top_p=self.any_top_p,
        )

    def drawn_rows(self, lo: int, hi: int) -> np.ndarray:
        """The rows among [lo, hi) of the R that draw (host int64, into the R): `drawing`'s, or every
        row where only `seeds` is given; none without a draw."""
        if self.drawing is not None:
            return self.drawing[(self.drawing >= lo) & (self.drawing < hi)]
        return np.arange(lo, hi) if self.seeds is not None else np.zeros(0, dtype=np.int64)

    def span(self, start: int, end: int) -> tuple[int, int]:
        """[lo, hi): the asking rows among action rows [start, end), as indices into the R rows."""
        lo, hi = np.searchsorted(self.rows, [start, end])
        return int(lo), int(hi)


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
