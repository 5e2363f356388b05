"""Mixture-of-experts MLP layers for the fused decoder: route, group by expert, two grouped GEMMs.

A sparse layer of Qwen3-MoE, Qwen2-MoE or Mixtral over the normalised tokens h [T, H] (E experts,
k of them per token, expert width I), into the residual stream x [T, H]:

    logits = h @ Wrouterᵀ                         [T, E] in the model's dtype, as transformers
    w, e = route(logits)                          [T, k] float32 weights, int64 expert ids (Routing)
    order = argsort(e.flatten(), stable)          [T·k] slots grouped by expert, tokens ascending in one
    ends = searchsorted(sorted ids, 0..E-1)       [E] int32: expert j owns grouped rows ends[j-1]:ends[j]
    a = swiglu(grouped(h[order // k], Wgate|up))  [T·k, I]
    y = grouped(a, Wdown)                         [T·k, H]
    out = Σ_k y[slot] · w[slot]                   [T, H] each token's k outputs, in its top-k order
    x += out (+ the shared expert, Qwen2-MoE)     one rounding into the residual

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

Two grouped GEMMs compute the same function:

- grouped_mm: torch's grouped GEMM (`torch.nn.functional.grouped_mm`, else `torch._grouped_mm`) over
  every expert in one call, the group ends read on the device: no loop over experts and no host
  synchronisation, so a layer can be captured in a CUDA graph. What the host sees of a call (and
  what a kernel is chosen by) is the total rows T·k and the weight's shape, never the per-expert
  counts, so a warm-up over each padded token count meets every call a micro-batch can make.
- loop: one GEMM per expert over its rows, the group ends read on the host; the CPU twin.

`choose` resolves the `moe_kernel` setting; before `auto` takes grouped_mm it runs it once against
the loop on a small input, and any failure leaves the loop with a warning.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F

from service.engine import invariant

log = logging.getLogger(__name__)

MoeKernelName = Literal["grouped_mm", "loop"]
# x [S, K] grouped by expert, weight [E, N, K] (the checkpoint's layout), ends [E] int32 -> [S, N]
GroupedMatmul = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True, slots=True)
class MoeKernel:
    name: MoeKernelName
    matmul: GroupedMatmul


def _loop(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    out = x.new_empty((x.shape[0], weight.shape[1]))
    start = 0
    for expert, end in enumerate(ends.tolist()):  # the host reads the ends: the CPU twin only
        if end > start:
            out[start:end] = F.linear(x[start:end], weight[expert])
        start = end
    return out


def _grouped_function() -> Callable[..., torch.Tensor] | None:
    fn = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    return fn if callable(fn) else None


def _grouped(fn: Callable[..., torch.Tensor]) -> GroupedMatmul:
    def matmul(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        return fn(x, weight.transpose(1, 2), offs=ends)  # [E, K, N]: a view, column-major per expert

    return matmul


LOOP = MoeKernel("loop", _loop)


def _wants_grouped(device: torch.device) -> bool:
    """Where auto tries the grouped GEMM: CUDA (on CPU the loop is the twin the tests hold)."""
    return device.type == "cuda"


def choose(setting: str, device: torch.device, dtype: torch.dtype) -> MoeKernel:
    """loop: the per-expert loop; grouped_mm: torch's grouped GEMM (failing the start where it is
    missing or fails its probe); auto: grouped_mm on CUDA where it passes the probe, else the loop
    (one warning where it is there but fails)."""
    if setting == "loop" or (setting == "auto" and not _wants_grouped(device)):
        return LOOP
    fn = _grouped_function()
    if fn is None:
        if setting == "grouped_mm":
            raise RuntimeError(f"moe_kernel=grouped_mm: torch {torch.__version__} has no grouped GEMM")
        log.warning(
            "moe_kernel=auto: torch %s has no grouped GEMM; experts run one by one", torch.__version__
        )
        return LOOP
    kernel = MoeKernel("grouped_mm", _grouped(fn))
    try:
        probe(kernel, device, dtype)
    except Exception as exc:  # an unsupported dtype, architecture or layout of this torch build
        if setting == "grouped_mm":
            raise RuntimeError(f"moe_kernel=grouped_mm: {type(exc).__name__}: {exc}") from exc
        log.warning(
            "moe_kernel=auto: torch's grouped GEMM cannot run here (%s: %s); experts run one by one",
            type(exc).__name__,
            exc,
        )
        return LOOP
    return kernel


def probe(kernel: MoeKernel, device: torch.device, dtype: torch.dtype) -> None:
    """Run `kernel` once on a small input with an empty group; raise unless it is within rounding of
    the loop's result."""
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(96, 128, device=device, dtype=dtype, generator=gen)
    weight = torch.randn(4, 64, 128, device=device, dtype=dtype, generator=gen) / 8
    ends = torch.tensor([40, 40, 90, 96], device=device, dtype=torch.int32)
    got, want = kernel.matmul(x, weight, ends).float(), _loop(x, weight, ends).float()
    error = float((got - want).abs().max()) / max(float(want.abs().max()), 1e-30)
    if not error <= 2e-2:
        raise RuntimeError(f"its result is {error:.3g} (relative) from one GEMM per expert")


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
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.normalise:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights.to(logits.dtype) if self.round_weights else weights), experts


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

# h [T, H] -> sigmoid(h·wgᵀ) · mlp(h) [T, H] in the model's dtype (Qwen2-MoE's gated shared expert)
SharedExpert = Callable[[torch.Tensor], torch.Tensor]


@dataclass(slots=True)
class SparseMoe:
    """One sparse MLP over the modules of a transformers MoE block (`gate`: the router, `experts`)."""

    router: Any  # .weight [E, H] (read per call: a reload may rebind it)
    experts: Any  # .gate_up_proj [E, 2·I, H], .down_proj [E, H, I]
    routing: Routing
    kernel: MoeKernel
    swiglu: Callable[[torch.Tensor], torch.Tensor]  # [S, 2·I] gate|up -> [S, I]
    shared: SharedExpert | None = None

    def add_to(self, x: torch.Tensor, h: torch.Tensor, rows: int | None = None) -> None:
        """x += moe(h), in place, for x and h [T, H]; in blocks of `rows` tokens where given (batch
        invariance: every call then has one shape)."""
        n = x.shape[0]
        if rows is None or n <= rows or n % rows:
            x.add_(self(h, rows))
            return
        for start in range(0, n, rows):
            x[start : start + rows].add_(self(h[start : start + rows], rows))

    def __call__(self, h: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        """h [T, H] -> the block's output [T, H] in h's dtype."""
        t, width = h.shape
        k = self.routing.top_k
        logits = invariant.linear(h, self.router.weight, None, rows)  # [T, E]
        weights, experts = self.routing(logits)  # [T, k] each
        flat = experts.flatten()  # [T·k] slot t·k + j: token t's j-th expert
        ids, order = torch.sort(flat, stable=True)  # grouped by expert, tokens ascending in each
        count = self.experts.gate_up_proj.shape[0]
        wanted = torch.arange(count, device=h.device, dtype=ids.dtype)
        ends = torch.searchsorted(ids, wanted, right=True).to(torch.int32)  # [E]
        grouped = h.index_select(0, order // k)  # [T·k, H]
        act = self.swiglu(self.kernel.matmul(grouped, self.experts.gate_up_proj, ends))  # [T·k, I]
        del grouped
        down = self.kernel.matmul(act, self.experts.down_proj, ends)  # [T·k, H]
        del act
        slots = torch.empty_like(order).index_copy_(0, order, torch.arange(order.shape[0], device=h.device))
        per_slot = down.index_select(0, slots).view(t, k, width)  # back in slot order
        del down
        out = (per_slot * weights[..., None]).sum(dim=1).to(h.dtype)  # [T, H]
        if self.shared is not None:
            out = out + self.shared(h)
        return out


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
