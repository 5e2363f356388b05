"""The elementwise steps of a Llama-family decoder layer, as Triton kernels with torch twins.

Each op computes what the transformers modules compute, rounding to the activation dtype where
they do (the kernels work in float32 and round at the same steps), so the fused decoder matches the
model's own forward up to the order of float32 sums:

- rms_norm:  `weight * (x.float() * rsqrt(mean(x²) + eps)).to(dtype)` over the last dimension;
- rope_:     Qwen3's per-head q/k RMSNorm (optional), then `x·cos + rotate_half(x)·sin` over the
             whole head, in place, for the query and key heads at the start of each packed qkv row;
- swiglu:    `silu(gate) * up` from a fused [rows, 2·I] gate|up projection.

`Ops.for_device` picks the kernels on CUDA with triton, the torch twins elsewhere (the CPU tests run
the kernels under Triton's interpreter against the twins).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from service.engine.runtime import triton_jit

tl: Any = None  # triton.language, bound by triton_jit.jit


@dataclass(frozen=True, slots=True)
class HeadNorms:
    """Per-head RMSNorm of queries and keys before RoPE (Qwen3's q_norm / k_norm): weights [D]."""

    q: torch.Tensor
    k: torch.Tensor
    eps: float


@dataclass(frozen=True, slots=True)
class Ops:
    """The three ops on one backend: TRITON (the compiled kernels) or TORCH (their twins)."""

    name: str
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]  # x, weight, eps
    rope_: Callable[  # qkv, cos, sin, q_heads, k_heads, head_dim, norms; in place
        [torch.Tensor, torch.Tensor, torch.Tensor, int, int, int, HeadNorms | None], None
    ]
    swiglu: Callable[[torch.Tensor], torch.Tensor]  # [N, 2·I] gate|up -> [N, I]

    @staticmethod
    def for_device(device: torch.device, allow_triton: bool = True) -> Ops:
        return TRITON if allow_triton and triton_jit.available(device) else TORCH


# ---- torch twins: the transformers modules' own arithmetic --------------------------------------


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., H] -> [..., H] in x's dtype (LlamaRMSNorm, Qwen2RMSNorm, Qwen3RMSNorm)."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rope_torch_(  # noqa: PLR0917
    qkv: torch.Tensor,  # [N, (Hq + 2·Hk)·D]; queries, then keys, then values
    cos: torch.Tensor,  # [N, D]
    sin: torch.Tensor,  # [N, D]
    q_heads: int,
    k_heads: int,
    head_dim: int,
    norms: HeadNorms | None,
) -> None:
    n = qkv.shape[0]
    width = q_heads * head_dim
    parts = [(qkv[:, :width], q_heads), (qkv[:, width : width + k_heads * head_dim], k_heads)]
    for i, (flat, heads) in enumerate(parts):
        x = flat.view(n, heads, head_dim)
        if norms is not None:
            x = rms_norm_torch(x, norms.q if i == 0 else norms.k, norms.eps)
        half = head_dim // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        flat.view(n, heads, head_dim).copy_(x * cos[:, None] + rotated * sin[:, None])


def swiglu_torch(gate_up: torch.Tensor) -> torch.Tensor:
    """[N, 2·I] (gate | up) -> [N, I]: silu(gate) * up, as LlamaMLP."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# ---- Triton kernels ------------------------------------------------------------------------------


def rms_norm_kernel(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    triton_jit.runnable(x)
    hidden = x.shape[-1]
    rows = x.reshape(-1, hidden)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        block = triton_jit.next_power_of_2(hidden)
        with triton_jit.on_device(x):
            triton_jit.jit(_rms_norm)[(rows.shape[0],)](
                rows, rows.stride(0), weight, out, eps, HIDDEN=hidden, BLOCK=block, num_warps=_warps(block)
            )
    return out.view(x.shape)


def rope_kernel_(  # noqa: PLR0917
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_heads: int,
    k_heads: int,
    head_dim: int,
    norms: HeadNorms | None,
) -> None:
    triton_jit.runnable(qkv)
    if qkv.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1 or cos.stride(0) != sin.stride(0):
        raise ValueError("rope_: qkv, cos and sin need unit-stride rows, cos and sin the same layout")
    if head_dim % 2:
        raise ValueError(f"rope_: odd head_dim {head_dim}")
    if qkv.shape[0] == 0:
        return
    half = head_dim // 2
    heads = q_heads + k_heads
    block = triton_jit.next_power_of_2(heads) * triton_jit.next_power_of_2(half)
    with triton_jit.on_device(qkv):
        triton_jit.jit(_rope)[(qkv.shape[0],)](
            qkv,
            qkv.stride(0),
            cos,
            sin,
            cos.stride(0),
            norms.q if norms is not None else cos,  # unread without norms
            norms.k if norms is not None else cos,
            norms.eps if norms is not None else 0.0,
            Q_HEADS=q_heads,
            HEADS=heads,
            HALF=half,
            BLOCK_H=triton_jit.next_power_of_2(heads),
            BLOCK_D=triton_jit.next_power_of_2(half),
            NORM=norms is not None,
            num_warps=_warps(block),
        )


def swiglu_kernel(gate_up: torch.Tensor) -> torch.Tensor:
    triton_jit.runnable(gate_up)
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    rows, width = gate_up.shape
    inner = width // 2
    out = torch.empty((rows, inner), dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        block = min(1024, triton_jit.next_power_of_2(inner))
        grid = (rows, triton_jit.cdiv(inner, block))
        with triton_jit.on_device(gate_up):
            kernel = triton_jit.jit(_swiglu)
            kernel[grid](gate_up, gate_up.stride(0), out, INNER=inner, BLOCK=block, num_warps=4)
    return out


def _warps(block: int) -> int:
    return max(1, min(8, block // 256))


def _rms_norm(  # noqa: PLR0917 (a Triton kernel takes its arguments positionally)
    x_ptr: tl.tensor,
    row_stride: tl.tensor,
    w_ptr: tl.tensor,
    out_ptr: tl.tensor,
    eps: tl.tensor,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
) -> None:
    """One row: float32 statistics; normalised value rounded to the dtype, then times the weight."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    x = tl.load(x_ptr + row * row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / HIDDEN + eps)
    dtype = out_ptr.dtype.element_ty
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (x * rstd).to(dtype).to(tl.float32) * w
    tl.store(out_ptr + row * HIDDEN + cols, y.to(dtype), mask=mask)


def _rope(  # noqa: PLR0917
    qkv_ptr: tl.tensor,
    row_stride: tl.tensor,
    cos_ptr: tl.tensor,
    sin_ptr: tl.tensor,
    cs_stride: tl.tensor,
    qw_ptr: tl.tensor,
    kw_ptr: tl.tensor,
    eps: tl.tensor,
    Q_HEADS: tl.constexpr,
    HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NORM: tl.constexpr,
) -> None:
    """One token: every query and key head, as [heads, half] tiles of its two halves, in place.

    Rounded like transformers' bf16 arithmetic: (x·cos) and (rotate_half(x)·sin) each round to the
    dtype before their sum does; Qwen3's head norm rounds before and after its weight.
    """
    row = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    dmask = d < HALF
    mask = (h < HEADS) & dmask
    first = qkv_ptr + row * row_stride + h * (2 * HALF) + d
    dtype = qkv_ptr.dtype.element_ty
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)
        is_q = h < Q_HEADS
        w1 = tl.where(is_q, tl.load(qw_ptr + d, mask=dmask), tl.load(kw_ptr + d, mask=dmask))
        w2 = tl.where(is_q, tl.load(qw_ptr + HALF + d, mask=dmask), tl.load(kw_ptr + HALF + d, mask=dmask))
        w1, w2 = w1.to(tl.float32), w2.to(tl.float32)
        x1 = ((x1 * rstd[:, None]).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
        x2 = ((x2 * rstd[:, None]).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    cs = row * cs_stride + d
    c1 = tl.load(cos_ptr + cs, mask=dmask).to(tl.float32)
    c2 = tl.load(cos_ptr + cs + HALF, mask=dmask).to(tl.float32)
    s1 = tl.load(sin_ptr + cs, mask=dmask).to(tl.float32)
    s2 = tl.load(sin_ptr + cs + HALF, mask=dmask).to(tl.float32)
    o1 = (x1 * c1).to(dtype).to(tl.float32) - (x2 * s1).to(dtype).to(tl.float32)
    o2 = (x2 * c2).to(dtype).to(tl.float32) + (x1 * s2).to(dtype).to(tl.float32)
    tl.store(first, o1.to(dtype), mask=mask)
    tl.store(first + HALF, o2.to(dtype), mask=mask)


def _swiglu(
    gu_ptr: tl.tensor,
    row_stride: tl.tensor,
    out_ptr: tl.tensor,
    INNER: tl.constexpr,
    BLOCK: tl.constexpr,
) -> None:
    """silu(gate) rounds to the dtype before the product, as `act_fn(gate) * up` does."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INNER
    base = gu_ptr + row * row_stride + cols
    gate = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(base + INNER, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    e = tl.exp(-tl.abs(gate))  # sigmoid without overflow: e / (1 + e) for negative gates
    sigmoid = tl.where(gate >= 0.0, 1.0 / (1.0 + e), e / (1.0 + e))
    act = (gate * sigmoid).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * INNER + cols, (act * up).to(dtype), mask=mask)


TORCH = Ops("torch", rms_norm_torch, rope_torch_, swiglu_torch)
TRITON = Ops("triton", rms_norm_kernel, rope_kernel_, swiglu_kernel)
