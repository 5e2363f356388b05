"""Where a sparse layer's tokens go: the Plan of T tokens' k slots each (S = T·k), grouped by expert.

    h [T, H] @ router [E, H]ᵀ -> logits [T, E] -> weights, expert ids [T, k] (routing_rule.Routing)
    ids grouped by expert, tokens ascending in one (a stable sort) -> rows [S] int32, slots [T, k]
    int64, Groups (offsets [E+1] int32)

Three planners give the same Plan: `plan` in torch ops (the rule's own top-k: ties as transformers
resolves them), `plan_kernel` in two Triton kernels (kernels.py: a tie of the top-k goes to the lower
expert id) and `Pin` (the start-up check's pinned ids). Given a layer's LayerRoutes, the planner
replays and records them (replay.py), plan_kernel in its routing kernel's pass.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from service.engine.batch.device_routes import LayerRoutes
from service.engine.moe import kernels as moe_ops
from service.engine.moe import replay
from service.engine.moe.grouped_gemm import Groups
from service.engine.moe.routing_rule import Routing
from service.engine.strategies.gemm import ONE_CALL, TokenGemms


@dataclass(frozen=True, slots=True)
class Plan:
    """Where a micro-batch's tokens go (S = T·k slots, slot t·k + j: token t's j-th expert)."""

    weights: torch.Tensor  # [T, k] routing weights (Routing's dtype)
    rows: torch.Tensor  # [S] int32: the token of each grouped row (grouped by expert, ascending in one)
    slots: torch.Tensor  # [T, k] int64: where each slot's row sits in the grouped order
    groups: Groups
    experts: torch.Tensor  # [T, k] the expert ids (int64, or int32 from the kernels)


# h [T, H], router weight [E, H], the rule, how the router GEMM runs (strategies/gemm.py), the layer's
# routes to replay and record (None: none) and the row of the forward h starts at -> Plan
Planner = Callable[[torch.Tensor, torch.Tensor, Routing, TokenGemms, LayerRoutes | None, int], Plan]


def plan(  # noqa: PLR0917
    h: torch.Tensor,
    router: torch.Tensor,
    rule: Routing,
    gemm: TokenGemms = ONE_CALL,
    routes: LayerRoutes | None = None,
    first: int = 0,
) -> Plan:
    """Route h [T, H] with the router weight [E, H] (its GEMM run by `gemm`): torch
    ops, the rule's own topk (ties as transformers resolves them) and a stable sort; with `routes`,
    the given ids where covered and the records (replay.choose: plan_kernel's twin)."""
    logits = gemm.linear(h, router, None)
    # weights and expert ids [T, k]
    weights, experts = rule(logits) if routes is None else replay.choose(routes, logits, rule, first)
    return by_expert(weights, experts, router.shape[0])


def by_expert(weights: torch.Tensor, experts: torch.Tensor, count: int) -> Plan:
    """The Plan of weights and expert ids [T, k] over `count` experts, grouped by a stable sort."""
    k = experts.shape[1]
    ids, order = torch.sort(experts.flatten(), stable=True)  # grouped by expert, tokens ascending in each
    bounds = torch.arange(-1, count, device=ids.device, dtype=ids.dtype)
    offsets = torch.searchsorted(ids, bounds, right=True).to(torch.int32)  # [E+1], offsets[0] = 0
    positions = torch.arange(order.shape[0], device=ids.device)
    slots = torch.empty_like(order).index_copy_(0, order, positions).view(weights.shape)
    return Plan(weights, (order // k).to(torch.int32), slots, Groups(offsets), experts)


@dataclass(slots=True)
class Pin:
    """Expert ids [T, k] a layer takes instead of its own top-k (the start-up check against
    transformers' forward: its routing, so that a near-tie flipped by rounding is not counted against
    the rest of the layer), consumed in order by the layer's calls; the ids the layer would have
    chosen, recorded alongside."""

    experts: torch.Tensor
    used: int = 0
    own: list[torch.Tensor] = field(default_factory=list)

    def take(self, h: torch.Tensor, router: torch.Tensor, rule: Routing, gemm: TokenGemms) -> Plan:
        """The Plan of h [n, H] with the next n rows of pinned ids, weighted by `rule`."""
        logits = gemm.linear(h, router, None)
        experts = self.experts[self.used : self.used + h.shape[0]]
        if experts.shape != (h.shape[0], rule.top_k):
            raise ValueError(
                f"pinned expert ids {tuple(self.experts.shape)} do not fit {h.shape[0]} more tokens' "
                f"top-{rule.top_k}"
            )
        self.used += h.shape[0]
        self.own.append(rule(logits)[1])
        return by_expert(rule.weights_at(logits, experts), experts, router.shape[0])


def plan_kernel(  # noqa: PLR0917
    h: torch.Tensor,
    router: torch.Tensor,
    rule: Routing,
    gemm: TokenGemms = ONE_CALL,
    routes: LayerRoutes | None = None,
    first: int = 0,
) -> Plan:
    """plan in two Triton kernels and a few small ops (moe_ops: the same order; a tie of the top-k goes
    to the lower expert id); the replay and the records in the routing kernel's pass."""
    logits = gemm.linear(h, router, None)  # [T, E]
    weight_dtype = logits.dtype if rule.round_weights else torch.float32
    routed = moe_ops.route_kernel(logits, rule.top_k, rule.normalise, weight_dtype, routes, first)
    grouped, slots, offsets = moe_ops.group_kernel(routed)
    return Plan(routed.weights, grouped, slots, Groups(offsets), routed.experts)
