"""The head's contract: what a model applies to its final logits (LogitTransform), what scoring the
action rows returns (ActionScores), and the one `score_actions` signature its implementations share:

- chunked.py: the lm_head over row chunks, torch's log-softmax or fused_kernel.py's Triton pass;
- heads/vocab_parallel.py: the same scores from a head whose vocabulary rows are split over the ranks.

Boundary: hidden [A, H] (the final hidden state before each action) and targets [A] in; float32
log-probs [A] (and entropy [A]) under softmax(g(z) / T) out; never a [A, V] tensor at once. Rows may
ask more of the same distribution (batch/asks.py's Extras: the top K, candidates' log-probs, the
sampler's processed log-prob, a seeded draw; heads/extras.py computes them from the chunk of logits the
head holds).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from service.engine.batch.asks import Extras


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
