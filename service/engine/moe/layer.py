"""Mixture-of-experts MLP layers for the fused decoder: route, group by expert, two grouped GEMMs.

A sparse layer of Qwen3-MoE, Qwen2-MoE or Mixtral over the normalised tokens h [T, H] (E experts,
k of them per token, expert width I), into the residual stream x [T, H]:

    logits = h @ Wrouterᵀ                         [T, E] in the model's dtype, as transformers
    w, e = route(logits)                          [T, k] float32 weights, int64 expert ids (routing_rule.py)
    order = argsort(e.flatten(), stable)          [T·k] slots grouped by expert, tokens ascending in one
    offsets = searchsorted(sorted ids, -1..E-1)   [E+1] int32: expert j's grouped rows from offsets[j] on
                                                  (the three lines: a Plan, dispatch.py)
    a = swiglu(grouped(h[order // k], Wgate|up))  [T·k, I]   (grouped_gemm.py)
    y = grouped(a, Wdown)                         [T·k, H]
    x += Σ_k y[slot] · w[slot]                    [T, H] each token's k outputs, in its top-k order (moe_ops)
                                                  (+ the shared expert, Qwen2-MoE), one rounding

Rounding as transformers' forward (its `grouped_mm` experts implementation, the default in 5.x): the
weights are rounded to the model's dtype before the product where the architecture's router does so
(the Qwen family; Mixtral keeps them float32), each product rounds to that dtype (float32 for
Mixtral), the k products are summed with a float32 accumulator and rounded once. The sum gathers
each token's k rows back in slot order and reduces them, rather than an index_add_ into x: on CUDA
an index_add_ of several rows into one adds them in whatever order the atomics land, so a score
would change from run to run.

The experts' weights are read from the model's own 3-D parameters at every call (gate_up_proj
[E, 2·I, H], down_proj [E, H, I]; the transposed views the grouped GEMM takes are views): no copy,
and a reload that rebinds them is taken up as it is.

A layer given a Tally (the fused decoder's sparse layers but the last) also adds the real tokens each
of its experts took to the decoder's Load [layers, E] (moe_ops' counting), which the engine copies
out per micro-batch for the expert-load metric. A layer given LayerRoutes (routing replay and recorded
routes, batch/device_routes.py) hands them to its planner (dispatch.py, replay.py).

Boundary: a transformers MoE block's modules in (`unsupported` says why one is not); x += moe(h) out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from service.engine.batch.device_routes import LayerRoutes
from service.engine.moe import grouped_gemm
from service.engine.moe import kernels as moe_ops
from service.engine.moe.dispatch import Pin, Plan, Planner, plan
from service.engine.moe.routing_rule import Routing, routing
from service.engine.strategies.gemm import ONE_CALL, TokenGemms


@dataclass(frozen=True, slots=True)
class Tally:
    """Where one sparse layer counts the real tokens each of its experts takes: `counts` [E] int32, its
    row of the decoder's Load; `load` for the bound on the filler rows."""

    counts: torch.Tensor
    load: Load


class Load:
    """The real tokens each expert of each counted sparse layer took in a decoder's last forward:
    counts [layers, E] int32 on the device, which the layers' kernels add to (CUDA graphs included).

    `begin` zeroes it and sets `real` [1] int32, the micro-batch's tokens before its filler (the filler
    ends a packed row: batch/packing.py), outside any graph; `tail`, a power of 2 above the filler a packed
    row can have, bounds what the counting kernel reads (moe_ops)."""

    def __init__(self, layers: int, experts: int, tail: int, device: torch.device) -> None:
        self.counts = torch.zeros((layers, experts), dtype=torch.int32, device=device)
        self.real = torch.zeros(1, dtype=torch.int32, device=device)
        self.tail = tail

    def tally(self, layer: int) -> Tally:
        return Tally(self.counts[layer], self)

    def begin(self, tokens: int, filler: int) -> None:
        """A forward over `tokens` rows whose last `filler` are filler."""
        if filler >= self.tail:
            raise ValueError(f"{filler} filler rows: the expert counts take fewer than {self.tail}")
        self.counts.zero_()
        self.real.fill_(tokens - filler)


# h [T, H] -> sigmoid(h·wgᵀ) · mlp(h) [T, H] in the model's dtype (Qwen2-MoE's gated shared expert)
SharedExpert = Callable[[torch.Tensor], torch.Tensor]


@dataclass(slots=True)
class SparseMoe:
    """One sparse MLP over the modules of a transformers MoE block (`gate`: the router, `experts`)."""

    router: Any  # .weight [E, H] (read per call: a reload may rebind it)
    experts: Any  # .gate_up_proj [E, 2·I, H], .down_proj [E, H, I]
    routing: Routing
    kernel: grouped_gemm.MoeKernel
    swiglu: Callable[[torch.Tensor], torch.Tensor]  # [S, 2·I] gate|up -> [S, I]
    shared: SharedExpert | None = None
    combine: moe_ops.Combine = moe_ops.combine_torch
    planner: Planner = plan
    pinned: Pin | None = None  # set only for the start-up check's eager forward
    tally: Tally | None = None  # where it counts its experts' real tokens (None: it does not)
    count: moe_ops.Count = moe_ops.count_torch
    gemm: TokenGemms = ONE_CALL  # how the router's GEMM runs (batch invariance: fixed-row calls)
    routes: LayerRoutes | None = None  # set for a forward that replays or records (replay.py)

    def add_to(self, x: torch.Tensor, h: torch.Tensor, first: int = 0) -> None:
        """x += moe(h), in place, for x and h [T, H] (the forward's rows from `first` on). Under
        fixed-row GEMMs (batch invariance), where the kernel is not row-invariant, the whole layer runs
        over blocks of that many tokens (every call then has one shape)."""
        n, rows = x.shape[0], self.gemm.rows
        if rows is None or n <= rows or n % rows or self.pinned is not None or self.kernel.row_invariant:
            self._add(x, h, first)
            return
        for start in range(0, n, rows):
            self._add(x[start : start + rows], h[start : start + rows], first + start)

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """h [T, H] -> the block's output [T, H] in h's dtype."""
        out = torch.zeros_like(h)
        self._add(out, h, 0)
        return out

    def observe(self, h: torch.Tensor) -> None:
        """Route h [T, H] (every row of the forward) and record it, running no expert: the last
        layer's experts run on the rows the heads read, its routes are recorded for all."""
        self._plan(h, 0)

    def _plan(self, h: torch.Tensor, first: int) -> Plan:
        """The Plan of h [n, H], the forward's rows first .. first + n - 1: pinned (the self-check), else
        the planner's, which replays and records the layer's routes where set (replay.py)."""
        if self.pinned is not None:
            return self.pinned.take(h, self.router.weight, self.routing, self.gemm)
        return self.planner(h, self.router.weight, self.routing, self.gemm, self.routes, first)

    def _add(self, x: torch.Tensor, h: torch.Tensor, first: int) -> None:
        route = self._plan(h, first)
        if self.pinned is None and self.tally is not None:
            load = self.tally.load
            self.count(route.rows, route.groups.offsets, load.real, first, self.tally.counts, load.tail)
        act = grouped_gemm.expand(
            self.kernel, h, route.rows, self.experts.gate_up_proj, route.groups, self.swiglu
        )
        down = self.kernel.matmul(act, self.experts.down_proj, route.groups)  # [S, H]
        del act
        extra = self.shared(h) if self.shared is not None else None
        self.combine(x, down, route.slots, route.weights, extra)


def unsupported(mlp: Any, model_type: str, config: Any) -> str | None:
    """Why `mlp` is not a sparse block SparseMoe computes for `model_type`; None when it is."""
    router, experts = getattr(mlp, "gate", None), getattr(mlp, "experts", None)
    weight = getattr(router, "weight", None)
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return "the block has no router weight [experts, hidden]"
    if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor):
        return "the experts are not gate_up_proj / down_proj tensors"
    if gate_up.dim() != 3 or down.dim() != 3:
        return "the expert weights are not [experts, out, in] tensors"
    e, two_i, h = gate_up.shape
    if two_i % 2 or weight.shape != (e, h) or down.shape != (e, h, two_i // 2):
        shapes = [tuple(weight.shape), tuple(gate_up.shape), tuple(down.shape)]
        return f"router, gate_up_proj and down_proj shapes {shapes} do not fit together"
    layout = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True}
    for name, want in layout.items():
        if getattr(experts, name, want) != want:
            return f"experts.{name} is {getattr(experts, name)} (the fused layer takes {want})"
    if getattr(router, "bias", None) is not None:
        return "the router has a bias"
    rule = routing(model_type, config)
    if rule is None or getattr(router, "top_k", rule.top_k) != rule.top_k or not 0 < rule.top_k <= e:
        return f"the router's top-k does not follow {model_type}'s config"
    if (getattr(mlp, "shared_expert", None) is not None) != (model_type == "qwen2_moe"):
        return f"the block's shared expert does not match {model_type}"
    return None
