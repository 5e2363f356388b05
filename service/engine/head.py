"""The lm_head on action positions only, in row chunks, with log-softmax and entropy in float32.

Never builds a [tokens, vocab] tensor: at most [chunk_rows, vocab] logits exist at once, and only
rows that predict an action are computed. Does not rely on `logits_to_keep`-style model kwargs.
Each chunk is one fused log-softmax over float32 logits (upcast inside the kernel when there is
nothing to apply first): a chunk's logits are the head's largest tensors, so every extra pass over
them (an upcast copy, a temperature multiply, logsumexp's temporaries) costs memory bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class LogitTransform:
    """g in SEMANTICS.md: what a model's own forward applies to its final logits.

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
class ActionScores:
    logprobs: torch.Tensor  # [A] float32
    entropy: torch.Tensor | None  # [A] float32


def score_actions(
    *,
    hidden: torch.Tensor,  # [A, H] final hidden state at t-1 for each action t
    targets: torch.Tensor,  # [A]
    inv_temperature: torch.Tensor | None,  # [A]; None: every T is 1
    lm_head: torch.nn.Module,
    transform: LogitTransform,
    chunk_rows: int,
    want_entropy: bool,
) -> ActionScores:
    rows = hidden.shape[0]
    logprobs = torch.empty(rows, dtype=torch.float32, device=hidden.device)
    entropy = torch.empty_like(logprobs) if want_entropy else None
    for start in range(0, rows, chunk_rows):
        end = min(start + chunk_rows, rows)
        z = lm_head(hidden[start:end])  # [c, V] in the model's dtype
        if inv_temperature is not None or not transform.identity:
            z = transform(z.float())  # float32 temporary, modified in place
            if inv_temperature is not None:
                z.mul_(inv_temperature[start:end, None])
        logp = torch.log_softmax(z, dim=-1, dtype=torch.float32)  # [c, V] float32
        del z
        logprobs[start:end] = logp.gather(1, targets[start:end, None]).squeeze(1)
        if entropy is not None:
            entropy[start:end] = torch.special.entr(logp.exp_()).sum(dim=-1)  # -Σ p·log p
    return ActionScores(logprobs=logprobs, entropy=entropy)
