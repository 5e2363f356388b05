"""The input side of a SwiGLU MLP, from one [gate; up] weight: x -> silu(x·Wgateᵀ + bg) · (x·Wupᵀ + bu).

Two implementations of the same function:

- split: one cuBLAS GEMM writes gate|up [N, 2·I] in the activation dtype; the SwiGLU op of
         ops/elementwise.py reads it back and writes [N, I]. Gate and up are rounded to the activation
         dtype before the product, as in transformers' forward.
- quack: quack-kernels' GEMM whose epilogue applies SwiGLU to the float32 accumulators and writes
         only [N, I] (CuTe DSL kernels, CUDA compute capability 9.0 and later, bf16/fp16). It
         saves the [N, 2·I] round trip through memory and rounds once where split rounds twice.
         An MLP with a bias (rare: Llama's mlp_bias) runs split: quack's epilogue with a [gate; up]
         bias does not match the reference (tests/engine/ops/test_gate_up.py).

`choose` resolves the `mlp_kernel` setting. quack's kernels compile on first use and its releases
pin narrow nvidia-cutlass-dsl versions (pyproject's `hopper` extra has a pair that works), so before
`auto` takes quack it runs it once against split on a small input; any failure leaves split.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from service.engine.runtime import packages as optional
from service.engine.runtime.packages import FAST_DTYPES

log = logging.getLogger(__name__)

# x [N, H], weight [2·I, H] (gate rows, then up rows), bias [2·I] or None -> [N, I]
Projection = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


@dataclass(frozen=True, slots=True)
class GatedProjection:
    name: str  # split | quack
    project: Projection


def split(swiglu: Callable[[torch.Tensor], torch.Tensor]) -> GatedProjection:
    def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return swiglu(F.linear(x, weight, bias))

    return GatedProjection("split", project)


def _quack(fallback: GatedProjection) -> GatedProjection:
    from quack.gemm_interface import gemm_act

    def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.dtype not in FAST_DTYPES or x.shape[0] == 0 or bias is not None:
            return fallback.project(x, weight, bias)
        _, postact = gemm_act(
            x,
            weight.t(),  # [H, 2·I] whose columns are [gate; up]: concat_layout says so
            bias=bias,
            activation="swiglu",
            store_preact=False,
            tuned=False,  # quack's heuristic tile; tuning runs every candidate per new shape
            concat_layout=("B",),
        )
        assert isinstance(postact, torch.Tensor)
        return postact

    return GatedProjection("quack", project)


QUACK = ("quack.gemm_interface", "quack-kernels")


def _device_can_run(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def quack_available(device: torch.device) -> bool:
    """A CUDA device of compute capability 9.0+ and a quack-kernels that imports (a broken one: one
    warning, False)."""
    return _device_can_run(device) and optional.importable(*QUACK)


def choose(
    setting: str, device: torch.device, dtype: torch.dtype, swiglu: Callable[[torch.Tensor], torch.Tensor]
) -> GatedProjection:
    """auto: quack on a CUDA device of compute capability 9.0+ in bf16/fp16 where quack-kernels is
    importable and its probe passes; split otherwise."""
    fallback = split(swiglu)
    if setting == "split":
        return fallback
    if setting == "quack":
        if not quack_available(device):
            if _device_can_run(device):
                optional.required(*QUACK, "mlp_kernel=quack")  # raises: what is wrong with the package
            raise RuntimeError(
                "mlp_kernel=quack needs the quack-kernels package and a CUDA device of compute "
                "capability 9.0 or later"
            )
        return _quack(fallback)
    if not quack_available(device) or dtype not in FAST_DTYPES:
        return fallback
    try:
        fused = _quack(fallback)
        probe(fused, fallback, device, dtype)
    except Exception as exc:  # an import, compile or launch failure of a third-party kernel
        log.warning(
            "mlp_kernel=auto: quack-kernels cannot run here (%s: %s); using split", type(exc).__name__, exc
        )
        return fallback
    return fused


def probe(
    fused: GatedProjection, fallback: GatedProjection, device: torch.device, dtype: torch.dtype
) -> None:
    """Run `fused` once on a small random input; raise unless it is within rounding of `fallback`."""
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(256, 256, device=device, dtype=dtype, generator=gen)
    weight = torch.randn(512, 256, device=device, dtype=dtype, generator=gen) / 16
    got, want = fused.project(x, weight, None).float(), fallback.project(x, weight, None).float()
    error = float((got - want).abs().max()) / max(float(want.abs().max()), 1e-30)
    if not error <= 2e-2:
        raise RuntimeError(f"its SwiGLU GEMM is {error:.3g} (relative) from the split path's")
