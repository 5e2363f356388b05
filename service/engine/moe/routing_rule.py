"""How an architecture's router turns its logits into each token's k experts and weights (Routing),
and which architectures logprobd routes (MOE_TYPES): the rule the sparse layer (layer.py), its
planners (dispatch.py) and routing replay (replay.py) share.

    logits [T, E] -> weights [T, k] (float32, or the model's dtype where the router rounds them),
                     expert ids [T, k] int64

Boundary: a transformers config in; a Routing, or None where the model type is not one logprobd knows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class Routing:
    """How an architecture's router turns logits into k weights (transformers' TopKRouter of each):
    softmax over every expert in float32, top-k, divided by their sum where `normalise`; rounded to
    the model's dtype where `round_weights`."""

    top_k: int
    normalise: bool
    round_weights: bool

    def __call__(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [T, E] -> weights [T, k] (float32, or logits' dtype), expert ids [T, k] int64.
        torch.topk as transformers calls it, on the same float32 values: ties resolve alike."""
        weights, experts = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), self.top_k, dim=-1)
        return self.finish(weights, logits.dtype), experts

    def weights_at(self, logits: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """The weights [T, k] of the given expert ids [T, k] (int64) under this rule."""
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        return self.finish(probs.gather(1, experts), logits.dtype)

    def finish(self, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """float32 weights [T, k] at the chosen experts -> the layer's: renormalised, rounded (the rule)."""
        if self.normalise:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(dtype) if self.round_weights else weights


def routing(model_type: str, config: Any) -> Routing | None:
    """The router of `model_type`; None where logprobd does not know it."""
    k = int(getattr(config, "num_experts_per_tok", 0) or 0)
    if model_type in {"qwen3_moe", "qwen2_moe"}:
        return Routing(k, bool(config.norm_topk_prob), round_weights=True)
    if model_type == "mixtral":
        return Routing(k, normalise=True, round_weights=False)
    return None


MOE_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral")
