"""quack's GEMMs at one configuration: the TileKernel of batch-invariant mode's FixedTiles
(strategies/gemm.py), where quack runs (CUDA compute capability 9.0+, bf16/fp16).

A quack GEMM given its configuration runs one tile shape, one cluster shape and one K loop per output
tile for any row count, and never splits K: an output row's bits depend on its own input row and the
weight alone, so one call over every token of a micro-batch gives each row the bits it has alone.
quack's own choice of configuration (its heuristic for a plain GEMM, the autotuner) depends on the
shape, so every call here names quack's default configuration for the device.

    linear      x [N, K], weight [out, K], bias [out] | None -> [N, out]
    accumulate  x [N, out] += a [N, K] @ weightᵀ, in place (quack's add-to-output epilogue)

quack reads and writes rows through TMA, which needs every row 16-byte aligned. A GEMM whose K or
output width is not (a router over 60 experts, Qwen2-MoE's one-column shared-expert gate) runs instead
as calls of exactly FALLBACK_ROWS rows, the last zero-padded: one shape per GEMM, so the library picks
one kernel for it and a row's bits again depend on its own row alone.

`choose` builds it and probes it once on the device (against F.linear within rounding, and row for
row against itself on cut inputs, bitwise); where quack is absent, cannot run, or the probe fails, it
returns None (batch-invariant mode then runs FixedRows) with a warning.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from service.engine.ops.gate_up import quack_available
from service.engine.runtime.packages import FAST_DTYPES
from service.engine.strategies.gemm import TileKernel, padded_blocks

log = logging.getLogger(__name__)


FALLBACK_ROWS = 1024  # the rows of each call of a GEMM quack cannot take


@dataclass(frozen=True, slots=True)
class QuackTiles:
    """quack's plain and add-to-output GEMMs (`gemm`: quack's untuned GEMM, which takes a
    configuration), both at `config` (one per device); GEMMs whose rows quack cannot align in calls
    of FALLBACK_ROWS rows."""

    gemm: Callable[..., Any]  # quack.gemm_interface.gemm_tuned.fn
    config: Any  # quack.gemm_config.GemmConfig
    name: str = "quack"

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = x.new_empty((x.shape[0], weight.shape[0]))
        if not x.shape[0]:
            return out
        if not quack_aligned(x, weight, out):
            blocks = padded_blocks(x, FALLBACK_ROWS)
            return torch.cat([F.linear(block, weight, bias) for block in blocks])[: x.shape[0]]
        self.gemm(x, weight.t(), out, bias=bias, config=self.config)
        return out

    def accumulate(self, x: torch.Tensor, a: torch.Tensor, weight: torch.Tensor) -> None:
        if not x.shape[0]:
            return
        if not quack_aligned(a, weight, x):
            pairs = zip(padded_blocks(x, FALLBACK_ROWS), padded_blocks(a, FALLBACK_ROWS), strict=True)
            for i, (xb, ab) in enumerate(pairs):
                start = i * FALLBACK_ROWS
                end = min(start + FALLBACK_ROWS, x.shape[0])
                x[start:end] = torch.addmm(xb, ab, weight.t())[: end - start]  # one rounding
            return
        self.gemm(a, weight.t(), x, add_to_output=True, config=self.config)


def quack_aligned(*matrices: torch.Tensor) -> bool:
    """Whether quack can take these operands (a [N, K], weight [out, K], the output [N, out]): unit
    last stride, and rows and start addresses 16-byte aligned."""
    return all(
        m.stride(-1) == 1
        and (m.stride(0) * m.element_size()) % 16 == 0
        and (m.shape[1] * m.element_size()) % 16 == 0
        and m.data_ptr() % 16 == 0
        for m in matrices
    )


def quack_tiles(device: torch.device) -> QuackTiles:
    from quack.gemm_config import default_config
    from quack.gemm_interface import gemm_tuned

    return QuackTiles(gemm_tuned.fn, default_config(device))


def choose(device: torch.device, dtype: torch.dtype) -> QuackTiles | None:
    """QuackTiles where quack runs on `device` in `dtype` and keeps its promise in the probe; else None."""
    if dtype not in FAST_DTYPES or not quack_available(device):
        return None
    try:
        tiles = quack_tiles(device)
        probe(tiles, device, dtype)
    except Exception as exc:  # an import, compile or launch failure of a third-party kernel, or bits
        log.warning(
            "batch_invariant: quack's fixed-tile GEMMs cannot serve here (%s: %s); GEMMs run in calls of "
            "1024 rows instead",
            type(exc).__name__,
            exc,
        )
        return None
    return tiles


def probe(tiles: TileKernel, device: torch.device, dtype: torch.dtype) -> None:
    """Raise unless `tiles` computes F.linear within rounding and gives rows cut from a larger call
    the bits they had in it (linear and accumulate, with a bias and without; outputs 384 wide, and 60
    and 1 wide, which quack cannot align)."""
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(1100, 256, device=device, dtype=dtype, generator=gen)
    for width in (384, 60, 1):
        weight = torch.randn(width, 256, device=device, dtype=dtype, generator=gen) / 16
        bias = torch.randn(width, device=device, dtype=dtype, generator=gen)
        for b in (None, bias):
            whole = tiles.linear(x, weight, b)
            want = F.linear(x.float(), weight.float(), None if b is None else b.float())
            torch.testing.assert_close(whole.float(), want, rtol=2e-2, atol=2e-2)
            for start, end in ((0, 1), (3, 130), (517, 1100)):
                if not torch.equal(tiles.linear(x[start:end], weight, b), whole[start:end]):
                    raise ValueError(
                        f"rows {start}:{end} of a linear call {width} wide differ from the same rows alone"
                    )
        base = torch.randn(1100, width, device=device, dtype=dtype, generator=gen)
        whole = base.clone()
        tiles.accumulate(whole, x, weight)
        want = base.float() + x.float() @ weight.float().t()
        torch.testing.assert_close(whole.float(), want, rtol=2e-2, atol=2e-2)
        part = base[3:130].clone()
        tiles.accumulate(part, x[3:130], weight)
        if not torch.equal(part, whole[3:130]):
            raise ValueError(
                f"rows 3:130 of an accumulating call {width} wide differ from the same rows alone"
            )
