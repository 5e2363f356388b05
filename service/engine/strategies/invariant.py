"""Batch invariance: a sequence's scores bit for bit the same however it is batched.

GEMM libraries (cuBLAS, oneDNN/MKL) choose their kernel, tiling and split of the reduction by the
shape of the call, so a row's result depends on how many rows share the call: on which other
sequences share its micro-batch. In batch-invariant mode (`--batch-invariant`) every GEMM over tokens
runs as calls of exactly GEMM_ROWS rows: the packed row is padded to a multiple of GEMM_ROWS tokens
(actions likewise), so every call has one shape per weight, one kernel, and a row's reduction order
depends on nothing but its own values. Everything else a score goes through is already computed per
row or per sequence with shapes that depend on that sequence alone: the embedding gather, RoPE, the
Triton RMSNorm / SwiGLU / fused-head kernels (one program per row), the log-softmax over fixed
[chunk_rows, V] chunks, and varlen attention, whose tiles start at each sequence's first token (a
sequence longer than a micro-batch is cut at fixed positions, every GEMM_ROWS-multiple chunk,
whatever else is queued).

Boundary: x [N, K] with N a multiple of GEMM_ROWS -> GEMM_ROWS-row calls; any other N (the lm_head's
fixed chunks, a warm-up probe) is one call, whose shape is then fixed by its caller.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from service.engine.contract import GEMM_ROWS

__all__ = ["GEMM_ROWS", "accumulate", "block_linears", "by_rows", "linear"]


def _blocks(n: int, rows: int | None) -> bool:
    return rows is not None and n > rows and n % rows == 0


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int | None
) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [N, K], as calls of `rows` rows (None: one call)."""
    n = x.shape[0]
    if not _blocks(n, rows):
        return F.linear(x, weight, bias)
    assert rows is not None
    out = x.new_empty((n, weight.shape[0]))
    for start in range(0, n, rows):
        end = start + rows
        if bias is None:
            torch.mm(x[start:end], weight.t(), out=out[start:end])
        else:
            torch.addmm(bias, x[start:end], weight.t(), out=out[start:end])
    return out


def accumulate(x: torch.Tensor, a: torch.Tensor, weight: torch.Tensor, rows: int | None) -> None:
    """x += a @ weightᵀ in place, as calls of `rows` rows (None: one call)."""
    n = x.shape[0]
    if not _blocks(n, rows):
        x.addmm_(a, weight.t())
        return
    assert rows is not None
    for start in range(0, n, rows):
        x[start : start + rows].addmm_(a[start : start + rows], weight.t())


def by_rows(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, rows: int | None) -> torch.Tensor:
    """fn(x) for a row-wise fn (a GEMM with an epilogue), as calls of `rows` rows (None: one call)."""
    n = x.shape[0]
    if not _blocks(n, rows):
        return fn(x)
    assert rows is not None
    first = fn(x[:rows])
    out = first.new_empty((n, *first.shape[1:]))
    out[:rows] = first
    for start in range(rows, n, rows):
        out[start : start + rows] = fn(x[start : start + rows])
    return out


def _linear_forward(module: torch.nn.Linear, rows: int, x: torch.Tensor) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1])
    return linear(flat, module.weight, module.bias, rows).reshape(*x.shape[:-1], module.out_features)


def block_linears(model: Any, rows: int) -> int:
    """Make every nn.Linear of `model` (transformers' own modules) run in `rows`-row calls; returns
    how many. Parameters are read at each call, so reloads keep working."""
    count = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.forward = functools.partial(_linear_forward, module, rows)  # type: ignore[method-assign]
            count += 1
    return count
