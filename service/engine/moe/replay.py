"""Routing replay (R3) and recorded routes (R2) inside a forward: the experts a sparse layer takes,
and what it writes down (docs/semantics.md, "Routing replay").

A micro-batch's routes cover its packed row of N tokens (batch/route_buffers.py builds them):

    given   [N, layers, k]  expert ids (a narrow int dtype), read where covered [N] bool
    used    [N, layers, k]  int32, written by the forward: the experts each token's layers used
    live    [N, layers, k]  int32, written where something is given: the layer's own router's top-k
    matches [N, layers]     int8, written where something is given: |given ∩ live| at covered tokens,
                            0 elsewhere (the route agreement, without an [N, layers, k, k] temporary)

At a sparse layer the router's logits are computed as usual; a covered token takes the given ids, in
the given slot order, weighted by the architecture's own rule at those ids (Routing.weights_at: the
float32 softmax over every expert gathered at them, renormalised where the architecture renormalises);
any other token keeps the router's own top-k and weights. Megatron-LM's RouterReplay and verl's
router replay (R2/R3) take the same definition.

A layer's calls take consecutive rows of the packed row (`first` on): LayerRoutes is one layer's view.
The fused decoder's Triton path does all of a layer's routing in moe_ops.route_kernel; `choose` is its
torch twin (and the transformers decoder's router hook).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from service.engine.moe.layer import Routing


@dataclass(frozen=True, slots=True)
class LayerRoutes:
    """One sparse layer's part of BatchRoutes: given [n, k] and covered [n] (None: nothing given in
    this micro-batch), used and live [n, k] and matches [n] to write (None: not recorded here)."""

    given: torch.Tensor | None = None
    covered: torch.Tensor | None = None
    used: torch.Tensor | None = None
    live: torch.Tensor | None = None
    matches: torch.Tensor | None = None

    def gathered(self, rows: torch.Tensor) -> LayerRoutes:
        """The inputs at rows [R] (the last layer's MLP runs on the rows the heads read); no outputs."""
        if self.given is None or self.covered is None:
            return LayerRoutes()
        return LayerRoutes(self.given.index_select(0, rows), self.covered.index_select(0, rows))

    def choose(
        self,
        logits: torch.Tensor,
        rule: Routing,
        first: int,
        live: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Weights [n, k] and expert ids [n, k] int64 for rows first .. first + n - 1 of the layer,
        from their router logits [n, E] (and the router's own (weights, ids), where computed
        already); writes used and live."""
        n = logits.shape[0]
        if self.given is None or self.covered is None:
            weights, experts = live if live is not None else rule(logits)
            self.record(first, experts)
            return weights, experts
        covered = self.covered[first : first + n, None]
        given = self.given[first : first + n].long()
        if live is None:  # one softmax: the top-k's weights are the gather at the top-k
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
            own = torch.topk(probs, rule.top_k, dim=-1).indices
            experts = torch.where(covered, given, own)
            weights = rule.finish(probs.gather(1, experts), logits.dtype)
        else:
            own = live[1]
            experts = torch.where(covered, given, own)
            weights = torch.where(covered, rule.weights_at(logits, experts), live[0])
        if self.live is not None:
            self.live[first : first + n].copy_(own)
        if self.matches is not None:  # [n, k, k] for one layer's call: the twin's way
            overlap = (given[:, :, None] == own[:, None, :]).any(-1).sum(-1)
            self.matches[first : first + n].copy_(torch.where(covered[:, 0], overlap, 0))
        self.record(first, experts)
        return weights, experts

    def record(self, first: int, experts: torch.Tensor) -> None:
        if self.used is not None:
            self.used[first : first + experts.shape[0]].copy_(experts)


@dataclass(frozen=True, slots=True)
class BatchRoutes:
    """A micro-batch's routes on the device (see the module); `given` and `covered` None when no
    sequence gave any (the forward records only), `live` None likewise."""

    used: torch.Tensor
    given: torch.Tensor | None = None
    covered: torch.Tensor | None = None
    live: torch.Tensor | None = None
    matches: torch.Tensor | None = None

    @property
    def replays(self) -> bool:
        return self.given is not None

    def layer(self, index: int) -> LayerRoutes:
        """The routes of sparse layer `index` (of the policy's sparse layers, in order)."""
        return LayerRoutes(
            None if self.given is None else self.given[:, index],
            self.covered,
            self.used[:, index],
            None if self.live is None else self.live[:, index],
            None if self.matches is None else self.matches[:, index],
        )

    def agreement(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Per token [N] int32: the layers whose live top-k set equals the given set, and the sum over
        layers of |given ∩ live| (divide by k for the overlap); None where nothing was given. Read at
        covered tokens only (ids are distinct within a token's top-k, so |∩| = k is set equality)."""
        if self.given is None or self.matches is None:
            return None
        k = self.used.shape[-1]
        exact = (self.matches == k).sum(-1, dtype=torch.int32)
        return exact, self.matches.sum(-1, dtype=torch.int32)


class RouterHook:
    """A forward hook on a transformers TopKRouter (transformers' (logits, weights, ids) output) that
    applies one layer's LayerRoutes, its calls taking consecutive rows (the MLP row chunks and
    batch invariance's blocks run a block's rows in order)."""

    def __init__(self, routes: LayerRoutes, rule: Routing) -> None:
        self.routes = routes
        self.rule = rule
        self.next = 0

    def __call__(self, module: Any, args: Any, output: Any) -> Any:
        logits, weights, own = output  # [n, E], [n, k], [n, k]
        first = self.next
        self.next += logits.shape[0]
        weights, experts = self.routes.choose(logits, self.rule, first, (weights, own))
        return logits, weights, experts
