"""Routing replay (R3) and recorded routes (R2) inside a forward: the experts a sparse layer takes,
and what it writes down (docs/semantics.md, "Routing replay"), into one layer's LayerRoutes
(batch/device_routes.py: the buffers and their shapes).

At a sparse layer the router's logits are computed as usual; a covered token takes the given ids, in
the given slot order, weighted by the architecture's own rule at those ids (Routing.weights_at: the
float32 softmax over every expert gathered at them, renormalised where the architecture renormalises);
any other token keeps the router's own top-k and weights. Megatron-LM's RouterReplay and verl's
router replay (R2/R3) take the same definition.

The fused decoder's Triton path does all of a layer's routing in moe_ops.route_kernel; `choose` is its
torch twin (dispatch.plan's, and the transformers decoder's router hook's).

Boundary: router logits [n, E] of rows first .. first + n - 1 in; weights [n, k] and expert ids [n, k]
int64 out, with the layer's used, live and matches written.
"""

from __future__ import annotations

from typing import Any

import torch

from service.engine.batch.device_routes import LayerRoutes
from service.engine.moe.routing_rule import Routing


def choose(
    routes: LayerRoutes,
    logits: torch.Tensor,
    rule: Routing,
    first: int,
    live: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights [n, k] and expert ids [n, k] int64 for rows first .. first + n - 1 of the layer, from
    their router logits [n, E] (and the router's own (weights, ids), where computed already); writes
    used and live."""
    n = logits.shape[0]
    if routes.given is None or routes.covered is None:
        weights, experts = live if live is not None else rule(logits)
        routes.record(first, experts)
        return weights, experts
    covered = routes.covered[first : first + n, None]
    given = routes.given[first : first + n].long()
    if live is None:  # one softmax: the top-k's weights are the gather at the top-k
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        own = torch.topk(probs, rule.top_k, dim=-1).indices
        experts = torch.where(covered, given, own)
        weights = rule.finish(probs.gather(1, experts), logits.dtype)
    else:
        own = live[1]
        experts = torch.where(covered, given, own)
        weights = torch.where(covered, rule.weights_at(logits, experts), live[0])
    if routes.live is not None:
        routes.live[first : first + n].copy_(own)
    if routes.matches is not None:  # [n, k, k] for one layer's call: the twin's way
        overlap = (given[:, :, None] == own[:, None, :]).any(-1).sum(-1)
        routes.matches[first : first + n].copy_(torch.where(covered[:, 0], overlap, 0))
    routes.record(first, experts)
    return weights, experts


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
        weights, experts = choose(self.routes, logits, self.rule, first, (weights, own))
        return logits, weights, experts
