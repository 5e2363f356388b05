"""How a layer adds a row-parallel GEMM's output into the residual stream: LOCAL (one process: the GEMM
adds into the residual itself) or AllReduce (tensor parallel: each rank holds some of the GEMM's input
columns, so its output is a partial sum, which one all-reduce per projection sums over the ranks).

Chosen once at build time and carried by the fused decoder; the decoder's loop is the same for both.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from service.engine.strategies.gemm import TokenGemms

# (rows of x, a [len(rows), K]): the parts of the projection's input, produced one at a time (an MLP's
# row chunks: its [rows, I] intermediate is never whole)
Parts = Iterable[tuple[slice, torch.Tensor]]


@dataclass(frozen=True, slots=True)
class Local:
    """x[rows] += a @ Wᵀ + b for each part, the GEMM accumulating into x (one rounding)."""

    def add(self, x: torch.Tensor, parts: Parts, linear: torch.nn.Linear, gemm: TokenGemms) -> None:
        """x [N, H] += linear(a) for each (rows, a) of `parts`, in place."""
        for rows, a in parts:
            gemm.accumulate(x[rows], a, linear.weight)
            if linear.bias is not None:
                x[rows].add_(linear.bias)


@dataclass(frozen=True, slots=True)
class AllReduce:
    """The parts' partial products [N, H] into one buffer, one in-place all-reduce of it over the ranks,
    then x += the sum and the bias once (each rank holds the whole bias)."""

    all_reduce_: Callable[[torch.Tensor], None]

    def add(self, x: torch.Tensor, parts: Parts, linear: torch.nn.Linear, gemm: TokenGemms) -> None:
        partial = torch.empty_like(x)
        for rows, a in parts:
            partial[rows] = gemm.linear(a, linear.weight, None)
        self.all_reduce_(partial)
        x.add_(partial)
        if linear.bias is not None:
            x.add_(linear.bias)


PartialSums = Local | AllReduce
LOCAL = Local()
