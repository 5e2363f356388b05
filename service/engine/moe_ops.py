"""The last step of a sparse MoE layer: each token's k expert outputs, weighted, summed, into the residual.

    x[t] += round(Σ_j round_w(y[slots[t, j]] · w[t, j]) (+ extra[t]))

y [S, H] holds the experts' outputs grouped by expert (S = T·k rows), slots [T, k] int64 says where
each of token t's k rows sits in y, w [T, k] are the routing weights (the model's dtype for the Qwen
family, float32 for Mixtral), extra [T, H] an optional term added before the residual (Qwen2-MoE's
shared expert). Rounded as transformers' forward: each product to w's dtype, the k products summed in
float32 and rounded once to x's dtype, `extra` added in that dtype, then the residual add.

The k rows of a token are read in slot order and added in that order: no atomics, so a score does not
change from run to run. `combine_kernel` is one Triton pass (reads k rows, writes one); `combine_torch`
is its twin (the CPU path and the reference the tests hold the kernel to).
"""

from __future__ import annotations

from typing import Any

import torch

from service.engine import triton_jit

tl: Any = None  # triton.language, bound by triton_jit.jit


def combine_torch(
    x: torch.Tensor, y: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, extra: torch.Tensor | None
) -> None:
    """x [T, H] += the weighted sum of y's rows at slots [T, k] (see the module), in place."""
    t, k = weights.shape
    per_slot = y.index_select(0, slots.flatten()).view(t, k, y.shape[1])
    out = (per_slot * weights[..., None]).sum(dim=1).to(x.dtype)  # products in w's dtype, one rounding
    if extra is not None:
        out = out + extra
    x.add_(out)


def combine_kernel(
    x: torch.Tensor, y: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, extra: torch.Tensor | None
) -> None:
    """combine_torch in one Triton kernel (CUDA, or the interpreter)."""
    triton_jit.runnable(y)
    t, k = weights.shape
    width = y.shape[1]
    if t == 0:
        return
    if x.stride(1) != 1 or y.stride(1) != 1 or (extra is not None and extra.stride(1) != 1):
        raise ValueError("combine_kernel takes row-major x, y and extra")
    slots, weights = slots.contiguous(), weights.contiguous()
    block = min(2048, triton_jit.next_power_of_2(width))
    grid = (t, triton_jit.cdiv(width, block))
    with triton_jit.on_device(y):
        kernel = triton_jit.jit(_combine)
        kernel[grid](
            x,
            x.stride(0),
            y,
            y.stride(0),
            slots,
            weights,
            extra if extra is not None else x,
            extra.stride(0) if extra is not None else 0,
            K=k,
            WIDTH=width,
            BLOCK=block,
            EXTRA=extra is not None,
            num_warps=max(1, min(8, block // 256)),
        )


def _combine(  # noqa: PLR0917 (a Triton kernel takes its arguments positionally)
    x_ptr: tl.tensor,
    x_stride: tl.tensor,
    y_ptr: tl.tensor,
    y_stride: tl.tensor,
    slots_ptr: tl.tensor,
    w_ptr: tl.tensor,
    extra_ptr: tl.tensor,
    extra_stride: tl.tensor,
    K: tl.constexpr,
    WIDTH: tl.constexpr,
    BLOCK: tl.constexpr,
    EXTRA: tl.constexpr,
) -> None:
    """One token, BLOCK columns: its k rows of y in slot order, float32 sum, one rounding."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < WIDTH
    dtype = x_ptr.dtype.element_ty
    w_dtype = w_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(K):
        slot = tl.load(slots_ptr + row * K + j).to(tl.int64)
        w = tl.load(w_ptr + row * K + j).to(tl.float32)
        y = tl.load(y_ptr + slot * y_stride + cols, mask=mask, other=0.0).to(tl.float32)
        acc += (y * w).to(w_dtype).to(tl.float32)
    out = acc.to(dtype).to(tl.float32)
    if EXTRA:
        extra = tl.load(extra_ptr + row * extra_stride + cols, mask=mask, other=0.0).to(tl.float32)
        out = (out + extra).to(dtype).to(tl.float32)
    target = x_ptr + row * x_stride + cols
    x = tl.load(target, mask=mask, other=0.0).to(tl.float32)
    tl.store(target, (x + out).to(dtype), mask=mask)
