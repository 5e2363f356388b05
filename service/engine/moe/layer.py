"""Mixture-of-experts MLP layers for the fused decoder: route, group by expert, two grouped GEMMs.

A sparse layer of Qwen3-MoE, Qwen2-MoE or Mixtral over the normalised tokens h [T, H] (E experts,
k of them per token, expert width I), into the residual stream x [T, H]:

    logits = h @ Wrouterᵀ                         [T, E] in the model's dtype, as transformers
    w, e = route(logits)                          [T, k] float32 weights, int64 expert ids (Routing)
    order = argsort(e.flatten(), stable)          [T·k] slots grouped by expert, tokens ascending in one
    offsets = searchsorted(sorted ids, -1..E-1)   [E+1] int32: expert j's grouped rows from offsets[j] on
    a = swiglu(grouped(h[order // k], Wgate|up))  [T·k, I]
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

Three kernels compute the same function:

- quack: quack-kernels' varlen GEMMs (CUDA compute capability 9.0+). The first gathers the tokens'
  rows itself (h[order // k] is never written) and applies SwiGLU to its float32 accumulators (one
  rounding where transformers rounds gate|up first: within bf16 noise); the second is plain.
- grouped_mm: torch's grouped GEMM (`torch.nn.functional.grouped_mm`, else `torch._grouped_mm`), the
  gathered rows and the SwiGLU as separate steps.
- loop: one GEMM per expert over its rows, the group ends read on the host; the CPU twin.

quack and grouped_mm run every expert in one call, the group offsets read on the device: no loop
over experts and no host synchronisation, so a layer can be captured in a CUDA graph. What the host
sees of a call (and what a kernel is chosen by) is the total rows T·k and the weight's shape, never
the per-expert counts, so a warm-up over each padded token count meets every call a micro-batch can
make.

A layer given a Tally (the fused decoder's sparse layers but the last) also adds the real tokens each
of its experts took to the decoder's Load [layers, E] (moe_ops' counting), which the engine copies
out per micro-batch for the expert-load metric.

A layer given LayerRoutes (routing replay and recorded routes, moe/replay.py) hands them to its
planner: the given ids where a token is covered, the top-k elsewhere, weighted by the rule at those ids
(docs/semantics.md), and the ids taken recorded; plan_kernel does it in its routing kernel's pass,
plan (the twin) in torch ops (LayerRoutes.choose).

`choose` resolves the `moe_kernel` setting; `auto` takes quack, else grouped_mm, else the loop, each
after running it once against the loop on a small input (a failure there: a warning, the next one).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F

from service.engine.moe import kernels as moe_ops
from service.engine.moe.replay import LayerRoutes
from service.engine.ops import gate_up as gated
from service.engine.runtime.packages import FAST_DTYPES
from service.engine.strategies.gemm import ONE_CALL, TokenGemms

log = logging.getLogger(__name__)

MoeKernelName = Literal["quack", "grouped_mm", "loop"]


@dataclass(frozen=True, slots=True)
class Groups:
    """Where each expert's rows lie in the grouped order: offsets [E+1] int32 (offsets[0] = 0), ends
    [E] its view offsets[1:]."""

    offsets: torch.Tensor

    @property
    def ends(self) -> torch.Tensor:
        return self.offsets[1:]


# x [S, K] grouped by expert, weight [E, N, K] (the checkpoint's layout), groups -> [S, N]
GroupedMatmul = Callable[[torch.Tensor, torch.Tensor, Groups], torch.Tensor]
# h [T, H], rows [S] int32 (the token of each grouped row), gate|up weight [E, 2·I, H], groups -> [S, I]
GatheredSwiglu = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Groups], torch.Tensor]


@dataclass(frozen=True, slots=True)
class MoeKernel:
    """The grouped GEMMs of one kernel: `matmul` for the down projection (and the gate|up one where
    `gathered_swiglu` is None: then the rows are gathered and the SwiGLU applied as separate steps).
    `row_invariant`: a row's result does not depend on the call's other rows or their grouping (one
    configuration for every call), so batch-invariant mode need not cut the tokens into fixed blocks."""

    name: MoeKernelName
    matmul: GroupedMatmul
    gathered_swiglu: GatheredSwiglu | None = None
    row_invariant: bool = False


def _loop(x: torch.Tensor, weight: torch.Tensor, groups: Groups) -> torch.Tensor:
    out = x.new_empty((x.shape[0], weight.shape[1]))
    start = 0
    for expert, end in enumerate(groups.ends.tolist()):  # the host reads the ends: the CPU twin only
        if end > start:
            out[start:end] = F.linear(x[start:end], weight[expert])
        start = end
    return out


EXPERT_ROWS = 64  # the loop's call size in batch-invariant mode (blocked)


def _loop_blocked(x: torch.Tensor, weight: torch.Tensor, groups: Groups) -> torch.Tensor:
    """_loop with every GEMM call of EXPERT_ROWS rows (an expert's last call zero-padded): a row's
    bits then do not depend on how many other rows its expert took."""
    out = x.new_empty((x.shape[0], weight.shape[1]))
    block = x.new_zeros((EXPERT_ROWS, x.shape[1]))
    start = 0
    for expert, end in enumerate(groups.ends.tolist()):
        for first in range(start, end, EXPERT_ROWS):
            n = min(EXPERT_ROWS, end - first)
            block[:n] = x[first : first + n]
            block[n:] = 0
            out[first : first + n] = F.linear(block, weight[expert])[:n]
        start = end
    return out


def blocked(kernel: MoeKernel) -> MoeKernel:
    """`kernel` as batch-invariant mode runs it. The loop's per-expert calls, whose rows the routing
    decides, become calls of EXPERT_ROWS rows (row-invariant); quack is row-invariant as it is (its
    varlen GEMMs take one configuration whatever the rows, a tile reducing over K alone); grouped_mm
    makes one call over T·k rows, which the layer then runs over fixed blocks of tokens (add_to)."""
    return MoeKernel("loop", _loop_blocked, row_invariant=True) if kernel.matmul is _loop else kernel


def _grouped_function() -> Callable[..., torch.Tensor] | None:
    fn = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    return fn if callable(fn) else None


def _grouped(fn: Callable[..., torch.Tensor]) -> GroupedMatmul:
    def matmul(x: torch.Tensor, weight: torch.Tensor, groups: Groups) -> torch.Tensor:
        return fn(x, weight.transpose(1, 2), offs=groups.ends)  # [E, K, N]: a view, column-major per expert

    return matmul


def _quack() -> MoeKernel:
    from quack.gemm_interface import gemm, gemm_act

    def matmul(x: torch.Tensor, weight: torch.Tensor, groups: Groups) -> torch.Tensor:
        out: torch.Tensor = gemm(x, weight.transpose(1, 2), cu_seqlens_m=groups.offsets, tuned=False)
        return out

    def gathered_swiglu(
        h: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor, groups: Groups
    ) -> torch.Tensor:
        outputs = gemm_act(
            h,
            weight.transpose(1, 2),  # [E, H, 2·I] whose columns are [gate; up]: concat_layout says so
            activation="swiglu",
            cu_seqlens_m=groups.offsets,
            A_idx=rows,
            store_preact=False,
            tuned=False,  # quack's heuristic tile: tuning would run every candidate per new shape
            dynamic_scheduler=True,  # tiles taken as CTAs free up: groups of uneven size (1.42 ms vs 1.60)
            concat_layout=("B",),
        )
        act: torch.Tensor = outputs[1]
        return act

    return MoeKernel("quack", matmul, gathered_swiglu, row_invariant=True)  # tuned=False: one config


LOOP = MoeKernel("loop", _loop)


def _wants_fast(device: torch.device) -> bool:
    """Where auto tries the device kernels: CUDA (on CPU the loop is the twin the tests hold)."""
    return device.type == "cuda"


def _candidates(setting: str, device: torch.device, dtype: torch.dtype) -> list[Callable[[], MoeKernel]]:
    """The kernels `setting` allows, best first, each built on demand (an import may fail)."""
    quack: list[Callable[[], MoeKernel]] = []
    if dtype in FAST_DTYPES and (setting == "quack" or gated.quack_available(device)):
        quack = [_quack]
    grouped: list[Callable[[], MoeKernel]] = [_grouped_mm]
    return {"quack": quack or [_quack], "grouped_mm": grouped, "auto": [*quack, *grouped]}[setting]


def _grouped_mm() -> MoeKernel:
    fn = _grouped_function()
    if fn is None:
        raise RuntimeError(f"torch {torch.__version__} has no grouped GEMM")
    return MoeKernel("grouped_mm", _grouped(fn))


def choose(setting: str, device: torch.device, dtype: torch.dtype) -> MoeKernel:
    """loop: the per-expert loop; quack / grouped_mm: that kernel (failing the start where it is
    missing or fails its probe); auto: on CUDA the first of quack (compute capability 9.0+, bf16 or
    fp16) and grouped_mm that passes its probe, else the loop (one warning per kernel that fails)."""
    if setting == "loop" or (setting == "auto" and not _wants_fast(device)):
        return LOOP
    for build in _candidates(setting, device, dtype):
        try:
            kernel = build()
            probe(kernel, device, dtype)
        except Exception as exc:  # an import, compile or launch failure, or a result off the loop's
            if setting != "auto":
                raise RuntimeError(f"moe_kernel={setting}: {type(exc).__name__}: {exc}") from exc
            log.warning(
                "moe_kernel=auto: %s cannot run here (%s: %s)",
                build.__name__.strip("_"),
                type(exc).__name__,
                exc,
            )
            continue
        return kernel
    log.warning("moe_kernel=auto: no grouped GEMM runs here; experts run one by one")
    return LOOP


def probe(kernel: MoeKernel, device: torch.device, dtype: torch.dtype) -> None:
    """Run `kernel`'s GEMMs once on a small input with an empty group; raise unless each is within
    rounding of the loop's result."""
    gen = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(48, 128, device=device, dtype=dtype, generator=gen)
    rows = torch.randint(0, 48, (96,), device=device, generator=gen, dtype=torch.int32)
    gate_up = torch.randn(4, 128, 128, device=device, dtype=dtype, generator=gen) / 8
    down = torch.randn(4, 128, 64, device=device, dtype=dtype, generator=gen) / 8
    groups = Groups(torch.tensor([0, 40, 40, 90, 96], device=device, dtype=torch.int32))
    want_act = _swiglu_torch(_loop(h.index_select(0, rows), gate_up, groups))
    got_act = _expand(kernel, h, rows, gate_up, groups, _swiglu_torch)
    pairs = [(got_act, want_act), (kernel.matmul(want_act, down, groups), _loop(want_act, down, groups))]
    for what, (got, want) in zip(("gate|up GEMM and SwiGLU", "down GEMM"), pairs, strict=True):
        error = float((got.float() - want.float()).abs().max()) / max(float(want.float().abs().max()), 1e-30)
        if not error <= 2e-2:
            raise RuntimeError(f"its {what} is {error:.3g} (relative) from one GEMM per expert")


def _swiglu_torch(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _expand(  # noqa: PLR0917
    kernel: MoeKernel,
    h: torch.Tensor,
    rows: torch.Tensor,
    gate_up: torch.Tensor,
    groups: Groups,
    swiglu: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """h [T, H] -> swiglu(h[rows] · gate|up of each row's expert) [S, I]."""
    if kernel.gathered_swiglu is not None:
        return kernel.gathered_swiglu(h, rows, gate_up, groups)
    return swiglu(kernel.matmul(h.index_select(0, rows), gate_up, groups))


# ---- routing ---------------------------------------------------------------------------------------


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


# ---- the layer -------------------------------------------------------------------------------------

# rows [S] int32, offsets [E+1] int32, real [1] int32, first, counts [E] int32, tail: moe_ops
Count = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor, int], None]


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
# x [T, H] += Σ_j y[slots[:, j]] · w[:, j] (+ extra), in place: moe_ops
Combine = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], None]


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
    the given ids where covered and the records (LayerRoutes.choose: plan_kernel's twin)."""
    logits = gemm.linear(h, router, None)
    weights, experts = rule(logits) if routes is None else routes.choose(logits, rule, first)  # [T, k] each
    return _sorted(weights, experts, router.shape[0])


def _sorted(weights: torch.Tensor, experts: torch.Tensor, count: int) -> Plan:
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
        return _sorted(rule.weights_at(logits, experts), experts, router.shape[0])


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


@dataclass(slots=True)
class SparseMoe:
    """One sparse MLP over the modules of a transformers MoE block (`gate`: the router, `experts`)."""

    router: Any  # .weight [E, H] (read per call: a reload may rebind it)
    experts: Any  # .gate_up_proj [E, 2·I, H], .down_proj [E, H, I]
    routing: Routing
    kernel: MoeKernel
    swiglu: Callable[[torch.Tensor], torch.Tensor]  # [S, 2·I] gate|up -> [S, I]
    shared: SharedExpert | None = None
    combine: Combine = moe_ops.combine_torch
    planner: Planner = plan
    pinned: Pin | None = None  # set only for the start-up check's eager forward
    tally: Tally | None = None  # where it counts its experts' real tokens (None: it does not)
    count: Count = moe_ops.count_torch
    gemm: TokenGemms = ONE_CALL  # how the router's GEMM runs (batch invariance: fixed-row calls)
    routes: LayerRoutes | None = None  # set for a forward that replays or records (moe/replay.py)

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
        self._route(h, 0)

    def _route(self, h: torch.Tensor, first: int) -> Plan:
        """The Plan of h [n, H], the forward's rows first .. first + n - 1: pinned (the self-check), else
        the planner's, which replays and records the layer's routes where set (moe/replay.py)."""
        if self.pinned is not None:
            return self.pinned.take(h, self.router.weight, self.routing, self.gemm)
        return self.planner(h, self.router.weight, self.routing, self.gemm, self.routes, first)

    def _add(self, x: torch.Tensor, h: torch.Tensor, first: int) -> None:
        route = self._route(h, first)
        if self.pinned is None and self.tally is not None:
            load = self.tally.load
            self.count(route.rows, route.groups.offsets, load.real, first, self.tally.counts, load.tail)
        act = _expand(self.kernel, h, route.rows, self.experts.gate_up_proj, route.groups, self.swiglu)
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


# ---- transformers' own sparse blocks in batch-invariant mode ----------------------------------------


def block_sparse(model: Any, rows: int) -> int:
    """Make every sparse block of `model` (transformers' modules, for the transformers decoder) give a
    token the same bits however it is batched; returns how many blocks.

    The block runs over `rows` tokens at a time (its router's GEMM then has one shape; a block is
    token-wise, so this is the same function), and its experts module computes transformers'
    `grouped_mm` arithmetic with GEMM calls of fixed shapes (`_experts`): on CUDA one grouped GEMM
    over the block's rows·k rows, elsewhere the loop in EXPERT_ROWS-row calls. Raises where an
    experts module is not one of transformers' `use_experts_implementation` modules (its own code,
    whose GEMMs this cannot reach)."""
    count = 0
    for module in model.modules():
        experts = getattr(module, "experts", None)
        if not isinstance(experts, torch.nn.Module):
            continue
        if not all(hasattr(experts, name) for name in ("has_gate", "has_bias", "is_transposed", "down_proj")):
            raise RuntimeError(
                f"batch_invariant: the experts of {type(module).__name__} run their own code, whose GEMMs "
                "the batch-invariant mode cannot fix (it covers transformers' use_experts_implementation "
                "modules, and the fused decoder's Qwen3-MoE, Qwen2-MoE and Mixtral)"
            )
        device = experts.down_proj.device
        grouped = _grouped_function() if device.type == "cuda" else None
        kernel = MoeKernel("grouped_mm", _grouped(grouped)) if grouped is not None else blocked(LOOP)
        experts.forward = functools.partial(_experts, experts, kernel)
        module.forward = functools.partial(_in_blocks, module.forward, rows)
        count += 1
    return count


def _in_blocks(
    forward: Callable[..., Any], rows: int, hidden_states: torch.Tensor, *args: Any, **kwargs: Any
) -> Any:
    """A sparse block's forward over hidden_states [..., H] as calls of `rows` tokens [1, rows, H] where
    the tokens are a multiple of `rows` (the packed row in batch-invariant mode), else one call. A
    tuple's tensors (router logits [tokens, E]) are joined along their first dimension."""
    flat = hidden_states.reshape(-1, hidden_states.shape[-1])
    n = flat.shape[0]
    if n <= rows or n % rows:
        return forward(hidden_states, *args, **kwargs)
    parts = [forward(flat[start : start + rows].unsqueeze(0), *args, **kwargs) for start in range(0, n, rows)]
    if isinstance(parts[0], torch.Tensor):
        return torch.cat([p.reshape(rows, -1) for p in parts]).reshape(hidden_states.shape)
    first = torch.cat([p[0].reshape(rows, -1) for p in parts]).reshape(hidden_states.shape)
    rest = [
        torch.cat(list(column)) if isinstance(column[0], torch.Tensor) else column[0]
        for column in zip(*(p[1:] for p in parts), strict=True)
    ]
    return (first, *rest)


def _experts(
    module: Any,
    kernel: MoeKernel,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """transformers' `grouped_mm` experts forward (hidden_states [T, H], top_k_index and top_k_weights
    [T, k] -> [T, H]) with `kernel`'s grouped GEMMs: the slots grouped by expert (`_sorted`), gate|up
    (or up) GEMM + bias, the module's own gate or activation, down GEMM + bias, each token's k rows
    weighted and summed in slot order (`moe_ops.combine_torch`)."""
    route = _sorted(top_k_weights, top_k_index, module.down_proj.shape[0])
    x = hidden_states.index_select(0, route.rows)
    ids = None  # each grouped row's expert, for the biases
    if module.has_bias:
        grouped = torch.arange(x.shape[0], device=x.device, dtype=route.groups.ends.dtype)
        ids = torch.searchsorted(route.groups.ends, grouped, right=True)

    def linear(x: torch.Tensor, name: str) -> torch.Tensor:
        weight = getattr(module, name)  # [E, out, in], or [E, in, out] where is_transposed
        out = kernel.matmul(
            x.to(weight.dtype), weight.transpose(1, 2) if module.is_transposed else weight, route.groups
        )
        return out + getattr(module, f"{name}_bias")[ids] if ids is not None else out

    if module.has_gate:
        act = module._apply_gate(linear(x, "gate_up_proj"))
    else:
        act = module.act_fn(linear(x, "up_proj"))
    out = torch.zeros_like(hidden_states)
    moe_ops.combine_torch(out, linear(act, "down_proj"), route.slots, top_k_weights, None)
    return out
