"""The head's contract: what a model applies to its final logits (LogitTransform), what scoring the
action rows returns (ActionScores), and the one `score_actions` signature its implementations share:

- chunked.py: the lm_head over row chunks, torch's log-softmax or fused_kernel.py's Triton pass;
- heads/vocab_parallel.py: the same scores from a head whose vocabulary rows are split over the ranks.

Boundary: hidden [A, H] (the final hidden state before each action) and targets [A] in; float32
log-probs [A] (and entropy [A]) under softmax(g(z) / T) out; never a [A, V] tensor at once. Rows may
ask more of the same distribution (Extras: the top K, candidates' log-probs, the sampler's processed
log-prob, a seeded draw; heads/extras.py computes them from the chunk of logits the head holds).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch


@dataclass(frozen=True, slots=True)
class LogitTransform:
    """g in docs/semantics.md: what a model's own forward applies to its final logits.

    scale:   multiply (Cohere `logit_scale`; Granite's `1 / logits_scaling`)
    softcap: tanh soft-capping (Gemma2/3 `final_logit_softcapping`)
    """

    scale: float = 1.0
    softcap: float | None = None

    @classmethod
    def from_config(cls, config: Any) -> LogitTransform:
        scale = float(getattr(config, "logit_scale", None) or 1.0)
        divide = getattr(config, "logits_scaling", None)
        if divide:
            scale /= float(divide)
        softcap = getattr(config, "final_logit_softcapping", None)
        return cls(scale=scale, softcap=float(softcap) if softcap else None)

    @property
    def identity(self) -> bool:
        return self.scale == 1.0 and self.softcap is None

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """Applied in place: `logits` is a float32 temporary of the head."""
        if self.scale != 1.0:
            logits.mul_(self.scale)
        if self.softcap is not None:
            logits.div_(self.softcap).tanh_().mul_(self.softcap)
        return logits


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


@dataclass(frozen=True, slots=True)
class ExtraScores:
    """Per asking row of Extras (None: not asked): the top list, the rank of the row's target
    (vLLM's: tokens at least as likely), candidates' log-probs, the processed log-prob, the draw."""

    top_ids: torch.Tensor | None  # [R, K] int64, most likely first, equal logits by the lower id
    top_logprobs: torch.Tensor | None  # [R, K] float32
    ranks: torch.Tensor  # [R] int64
    candidate_logprobs: torch.Tensor | None  # [R, C] float32
    processed: torch.Tensor | None  # [R] float32, -inf outside the sampler's kept set
    drawn: torch.Tensor | None  # [R] int64


@dataclass(frozen=True, slots=True)
class ActionScores:
    logprobs: torch.Tensor  # [A] float32
    entropy: torch.Tensor | None  # [A] float32
    extras: ExtraScores | None = None  # for Extras.rows, when some row asked


class ScoreActions(Protocol):
    def __call__(
        self,
        *,
        hidden: torch.Tensor,  # [A, H] final hidden state at t-1 for each action t
        targets: torch.Tensor,  # [A] token ids
        inv_temperature: torch.Tensor | None,  # [A]; None: every T is 1
        lm_head: torch.nn.Module,
        transform: LogitTransform,
        chunk_rows: int,
        want_entropy: bool,
        fused: bool | None = None,
        extras: Extras | None = None,
    ) -> ActionScores:
        """Each row's log-prob of its target (and entropy) under softmax(g(z) / T), z = lm_head(hidden)."""
