"""The CPU twin of a fixed-tile GEMM kernel (ops/fixed_tile.py's QuackTiles): every call runs in
blocks of `block` rows, the last zero-padded, so the library meets one shape per weight and a row's
bits do not depend on the call's other rows, as a kernel of one tile configuration gives on the GPU."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True, slots=True)
class BlockedTiles:
    block: int = 16
    name: str = "blocked-twin"

    def _blocks(self, x: torch.Tensor) -> list[torch.Tensor]:
        out = []
        for start in range(0, x.shape[0], self.block):
            part = x[start : start + self.block]
            pad = self.block - part.shape[0]
            out.append(torch.cat([part, part.new_zeros((pad, x.shape[1]))]) if pad else part)
        return out

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.shape[0] == 0:
            return x.new_empty((0, weight.shape[0]))
        return torch.cat([F.linear(b, weight, bias) for b in self._blocks(x)])[: x.shape[0]]

    def accumulate(self, x: torch.Tensor, a: torch.Tensor, weight: torch.Tensor) -> None:
        """x += a @ weightᵀ in one rounding, block by block (x's blocks padded alike)."""
        for i, (xb, ab) in enumerate(zip(self._blocks(x), self._blocks(a), strict=True)):
            start = i * self.block
            end = min(start + self.block, x.shape[0])
            x[start:end] = torch.addmm(xb, ab, weight.t())[: end - start]
