"""The experts' grouped GEMMs of a sparse layer: rows grouped by expert times each expert's weight,
in one of three kernels that compute the same function, and `choose`, which resolves `moe_kernel`.

    matmul:          x [S, K] grouped by expert, weight [E, N, K] (the checkpoint's layout),
                     Groups (offsets [E+1] int32) -> [S, N]
    gathered_swiglu: h [T, H], rows [S] int32 (each grouped row's token), gate|up [E, 2·I, H],
                     Groups -> swiglu [S, I] (h[rows] is never written)

- quack: quack-kernels' varlen GEMMs (CUDA compute capability 9.0+). The first gathers the tokens'
  rows itself and applies SwiGLU to its float32 accumulators (one rounding where transformers rounds
  gate|up first: within bf16 noise); the second is plain.
- grouped_mm: torch's grouped GEMM (`torch.nn.functional.grouped_mm`, else `torch._grouped_mm`), the
  gathered rows and the SwiGLU as separate steps.
- loop: one GEMM per expert over its rows, the group ends read on the host; the CPU twin.

quack and grouped_mm run every expert in one call, the group offsets read on the device: no loop
over experts and no host synchronisation, so a layer can be captured in a CUDA graph. What the host
sees of a call (and what a kernel is chosen by) is the total rows T·k and the weight's shape, never
the per-expert counts, so a warm-up over each padded token count meets every call a micro-batch can
make. `blocked` is a kernel as batch-invariant mode runs it.

`choose`: `auto` takes quack, else grouped_mm, else the loop, each after running it once against the
loop on a small input (`probe`; a failure there: a warning, the next one).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Literal

import torch
import torch.nn.functional as F

from service.engine.ops import gate_up as gated
from service.engine.runtime.packages import FAST_DTYPES

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


def grouped_mm_function() -> Callable[..., torch.Tensor] | None:
    """torch's grouped GEMM function (public, else private), None where this torch has none."""
    fn = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    return fn if callable(fn) else None


def grouped_matmul(fn: Callable[..., torch.Tensor]) -> GroupedMatmul:
    """A GroupedMatmul over torch's grouped GEMM `fn` (grouped_mm_function's)."""

    def matmul(x: torch.Tensor, weight: torch.Tensor, groups: Groups) -> torch.Tensor:
        return fn(x, weight.transpose(1, 2), offs=groups.ends)  # [E, K, N]: a view, column-major per expert

    return matmul


# gate|up widths (2·I) up to this take the pinned Hopper tile (_hopper_gate_up_config); wider ones
# quack's heuristic
NARROW_GATE_UP = 3072


def _hopper_gate_up_config(device: torch.device) -> object | None:
    """The gathered gate|up GEMM's tile for narrow experts (2·I up to NARROW_GATE_UP) on Hopper
    (compute capability 9.x): 128 by 256, cooperative, no cluster, the dynamic scheduler; None elsewhere
    (quack's heuristic tile). docs/performance.md gives the sweep that chose it
    (benchmarks/probes/moe_layer.py --sweep)."""
    if torch.cuda.get_device_capability(device)[0] != 9:
        return None
    from quack.gemm_config import GemmConfig

    config: object = GemmConfig(
        tile_m=128,
        tile_n=256,
        pingpong=False,
        cluster_m=1,
        cluster_n=1,
        is_dynamic_persistent=True,
        device_capacity=9,
    )
    return config


def _quack(device: torch.device) -> MoeKernel:
    from quack.gemm_interface import gemm, gemm_act

    gate_up_config = _hopper_gate_up_config(device)

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
            tuned=False,  # one tile per shape: tuning would run every candidate per new row count
            config=gate_up_config if weight.shape[1] <= NARROW_GATE_UP else None,  # None: the heuristic
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
    quack: list[Callable[[], MoeKernel]] = [partial(_quack, device)]
    grouped: list[Callable[[], MoeKernel]] = [_grouped_mm]
    if setting != "auto":
        return {"quack": quack, "grouped_mm": grouped}[setting]
    fast = dtype in FAST_DTYPES and gated.quack_available(device)
    return [*quack, *grouped] if fast else grouped


def _grouped_mm() -> MoeKernel:
    fn = grouped_mm_function()
    if fn is None:
        raise RuntimeError(f"torch {torch.__version__} has no grouped GEMM")
    return MoeKernel("grouped_mm", grouped_matmul(fn))


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
                getattr(build, "func", build).__name__.strip("_"),
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
    got_act = expand(kernel, h, rows, gate_up, groups, _swiglu_torch)
    pairs = [(got_act, want_act), (kernel.matmul(want_act, down, groups), _loop(want_act, down, groups))]
    for what, (got, want) in zip(("gate|up GEMM and SwiGLU", "down GEMM"), pairs, strict=True):
        error = float((got.float() - want.float()).abs().max()) / max(float(want.float().abs().max()), 1e-30)
        if not error <= 2e-2:
            raise RuntimeError(f"its {what} is {error:.3g} (relative) from one GEMM per expert")


def _swiglu_torch(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def expand(  # noqa: PLR0917
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
