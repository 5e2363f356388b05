"""How a GEMM over tokens runs: in one call (ONE_CALL); in calls of a fixed number of rows
(FixedRows: batch invariance anywhere); or in one call of a kernel whose configuration is fixed
(FixedTiles: batch invariance where such a kernel runs). Chosen once at build time and carried by the
decoder's layers.

GEMM libraries (cuBLAS, oneDNN/MKL) choose their kernel, tiling and split of the reduction by the
shape of the call, so a row's result depends on how many rows share the call: on which other
sequences share its micro-batch. Two ways out:

- FixedRows: every GEMM over tokens runs as calls of exactly `rows` rows: the packed row is padded to
  a multiple of `rows` tokens (actions likewise; `step`), so every call has one shape per weight, one
  kernel, and a row's reduction order depends on nothing but its own values.
- FixedTiles: every GEMM over tokens is one call of a TileKernel, whose tile, cluster and K loop do
  not depend on the row count and which never splits K: an output tile reduces over K alone, so a row
  gets the same bits in a call of any rows (ops/fixed_tile.py: quack's GEMMs at one configuration).
  No padding past the shape step, no loop of calls. A function that is not such a kernel (the
  critic's value head) still runs in padded blocks of `rows` (`by_rows`).

Everything else a score goes through is computed per row or per sequence with shapes that depend on
that sequence alone (the embedding gather, RoPE, the row-wise Triton kernels, the log-softmax over
[chunk_rows, V] chunks, attention reducing each query over its sequence's keys in one order however
the queries are cut: ops/attention.py `invariant`).

Boundary: x [N, K]. FixedRows: with N a multiple of `rows`, `rows`-row calls; any other N (the
lm_head's fixed chunks, a warm-up probe) is one call, whose shape its caller then fixes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from service.engine.contract import GEMM_ROWS, SHAPE_STEP

__all__ = [
    "GEMM_ROWS",
    "ONE_CALL",
    "FixedRows",
    "FixedTiles",
    "OneCall",
    "TileKernel",
    "TokenGemms",
    "choose",
    "padded_blocks",
]


@dataclass(frozen=True, slots=True)
class OneCall:
    """Each GEMM over tokens is one call, whatever its rows (the library picks the kernel per shape)."""

    rows: None = None
    step: int = SHAPE_STEP  # token and action counts are padded to multiples of it (batch/packing.py)

    @property
    def name(self) -> str:
        """What /info reports (gemm)."""
        return "one-call"

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """F.linear(x, weight, bias) for x [N, K] -> [N, out]."""
        return F.linear(x, weight, bias)

    def accumulate(self, x: torch.Tensor, a: torch.Tensor, weight: torch.Tensor) -> None:
        """x [N, out] += a [N, K] @ weightᵀ, in place (one rounding)."""
        x.addmm_(a, weight.t())

    def by_rows(
        self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, *, fixed_tile: bool = False
    ) -> torch.Tensor:
        """fn(x) for a row-wise fn (a GEMM with an epilogue, a head). `fixed_tile`: fn is one call of a
        kernel of one configuration (FixedTiles runs it whole)."""
        return fn(x)

    def whole_calls(self, tokens: int) -> int:
        """An MLP chunk of `tokens` rows (0: unchunked), as a whole number of calls."""
        return tokens

    def patch(self, model: Any) -> int:
        """Make transformers' own modules of `model` run their GEMMs this way; returns how many."""
        return 0


@dataclass(frozen=True, slots=True)
class FixedRows:
    """Each GEMM over N tokens, N a multiple of `rows`, is N / rows calls of `rows` rows: a row's bits
    then do not depend on the other rows (batch-invariant mode)."""

    rows: int = GEMM_ROWS

    @property
    def step(self) -> int:
        return self.rows

    @property
    def name(self) -> str:
        return f"fixed-rows-{self.rows}"

    def _blocks(self, n: int) -> bool:
        return n > self.rows and n % self.rows == 0

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        n = x.shape[0]
        if not self._blocks(n):
            return F.linear(x, weight, bias)
        out = x.new_empty((n, weight.shape[0]))
        for start in range(0, n, self.rows):
            end = start + self.rows
            if bias is None:
                torch.mm(x[start:end], weight.t(), out=out[start:end])
            else:
                torch.addmm(bias, x[start:end], weight.t(), out=out[start:end])
        return out

    def accumulate(self, x: torch.Tensor, a: torch.Tensor, weight: torch.Tensor) -> None:
        n = x.shape[0]
        if not self._blocks(n):
            x.addmm_(a, weight.t())
            return
        for start in range(0, n, self.rows):
            x[start : start + self.rows].addmm_(a[start : start + self.rows], weight.t())

    def by_rows(
        self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, *, fixed_tile: bool = False
    ) -> torch.Tensor:
        n = x.shape[0]
        if not self._blocks(n):
            return fn(x)
        first = fn(x[: self.rows])
        out = first.new_empty((n, *first.shape[1:]))
        out[: self.rows] = first
        for start in range(self.rows, n, self.rows):
            out[start : start + self.rows] = fn(x[start : start + self.rows])
        return out

    def whole_calls(self, tokens: int) -> int:
        return max(self.rows, tokens // self.rows * self.rows) if tokens > 0 else tokens

    def patch(self, model: Any) -> int:
        """Every nn.Linear of `model` in `rows`-row calls (parameters read per call: reloads work)."""
        return _patch_linears(model, self)


class TileKernel(Protocol):
    """GEMMs of one configuration whatever the row count, with no split of K (ops/fixed_tile.py)."""

    @property
    def name(self) -> str: ...

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [N, K] @ weightᵀ [K, out] (+ bias) -> [N, out] in x's dtype."""
        ...

    def accumulate(self, x: torch.Tensor, a: torch.Tensor, weight: torch.Tensor) -> None:
        """x [N, out] += a [N, K] @ weightᵀ, in place, one rounding."""
        ...


@dataclass(frozen=True, slots=True)
class FixedTiles:
    """Each GEMM over tokens is one call of `kernel`, whose bits for a row do not depend on the call's
    other rows; tokens and actions are padded to the shape step only (batch-invariant mode)."""

    kernel: TileKernel
    rows: int = GEMM_ROWS  # by_rows' blocks, for a function that is not a fixed-tile kernel
    step: int = SHAPE_STEP

    @property
    def name(self) -> str:
        return f"fixed-tiles-{self.kernel.name}"

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.kernel.linear(x, weight, bias)

    def accumulate(self, x: torch.Tensor, a: torch.Tensor, weight: torch.Tensor) -> None:
        self.kernel.accumulate(x, a, weight)

    def by_rows(
        self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, *, fixed_tile: bool = False
    ) -> torch.Tensor:
        """fn(x): whole where fn is a fixed-tile kernel's call; else in blocks of `rows` rows, the last
        zero-padded, so that every call has one shape."""
        n = x.shape[0]
        if fixed_tile or n == 0:
            return fn(x)
        return torch.cat([fn(block) for block in padded_blocks(x, self.rows)])[:n]

    def whole_calls(self, tokens: int) -> int:
        return tokens

    def patch(self, model: Any) -> int:
        """Every nn.Linear of `model` (itself, if one) through the kernel (parameters read per call:
        reloads work)."""
        return _patch_linears(model, self)


TokenGemms = OneCall | FixedRows | FixedTiles
ONE_CALL = OneCall()


def padded_blocks(x: torch.Tensor, rows: int) -> list[torch.Tensor]:
    """x [N, ...] in blocks of `rows` rows, the last zero-padded to as many: calls of one shape."""
    blocks = []
    for start in range(0, x.shape[0], rows):
        block = x[start : start + rows]
        if block.shape[0] < rows:
            block = torch.cat([block, block.new_zeros((rows - block.shape[0], *x.shape[1:]))])
        blocks.append(block)
    return blocks


def choose(batch_invariant: bool, tiles: TileKernel | None = None) -> TokenGemms:
    """In batch-invariant mode FixedTiles over `tiles` where given (a fixed-tile kernel runs here), else
    FixedRows(GEMM_ROWS); ONE_CALL otherwise."""
    if not batch_invariant:
        return ONE_CALL
    return FixedTiles(tiles) if tiles is not None else FixedRows(GEMM_ROWS)


def _patch_linears(model: Any, gemm: FixedRows | FixedTiles) -> int:
    count = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.forward = functools.partial(_linear_forward, module, gemm)  # type: ignore[method-assign]
            count += 1
    return count


def _linear_forward(module: torch.nn.Linear, gemm: FixedRows | FixedTiles, x: torch.Tensor) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1])
    return gemm.linear(flat, module.weight, module.bias).reshape(*x.shape[:-1], module.out_features)
