"""The shared-prefix key gather of a graphed micro-batch: the first `count` rows of a static index.

A micro-batch whose segments attend to shared prefixes reads, per layer, its keys and values
gathered segment after segment (batch/kv_store.py, `KVContext.extend`). Eagerly that is an
`index_select` over the batch's K indices. A CUDA graph fixes every grid, so its gather reads a
static index of `capacity` rows and the real K from a device scalar: rows past K are neither read
nor written (their contents are left as the memory held), and attention never reads them, as the
key boundaries end at K.

    k, v:    [N, Hk, D] views of the packed qkv rows (unit stride within a row)
    index:   [capacity] int64 rows of k and v, the first `count` valid
    count:   [1] int32 on the device: K
    returns: [capacity, Hk, D] keys and values, rows 0..K-1 gathered

`rows` runs the Triton kernel on CUDA with triton, and its torch twin elsewhere (which reads K on
the host; the CPU tests run the kernel under Triton's interpreter against it).
"""

from __future__ import annotations

from typing import Any

import torch

from service.engine.runtime import triton_jit

tl: Any = None  # triton.language, bound by triton_jit.jit

_BLOCK_ROWS = 16


def rows(
    k: torch.Tensor, v: torch.Tensor, index: torch.Tensor, count: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """k[index[:count]], v[index[:count]] into [capacity, Hk, D] buffers (the rows past count unset)."""
    if k.is_cuda and triton_jit.triton() is not None:
        return rows_kernel(k, v, index, count)
    return rows_torch(k, v, index, count)


def rows_torch(
    k: torch.Tensor, v: torch.Tensor, index: torch.Tensor, count: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    keys = k.new_empty((index.shape[0], *k.shape[1:]))
    values = v.new_empty((index.shape[0], *v.shape[1:]))
    n = int(count.reshape(-1)[0])
    torch.index_select(k, 0, index[:n], out=keys[:n])
    torch.index_select(v, 0, index[:n], out=values[:n])
    return keys, values


def rows_kernel(
    k: torch.Tensor, v: torch.Tensor, index: torch.Tensor, count: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    triton_jit.runnable(k)
    if k.shape != v.shape or k.stride() != v.stride() or k.stride(-1) != 1 or k.stride(-2) != k.shape[-1]:
        raise ValueError("key_gather: k and v need one layout, each row's heads contiguous")
    capacity = index.shape[0]
    width = k.shape[1] * k.shape[2]
    keys = k.new_empty((capacity, *k.shape[1:]))
    values = v.new_empty((capacity, *v.shape[1:]))
    if capacity:
        block = min(1024, triton_jit.next_power_of_2(width))
        grid = (triton_jit.cdiv(capacity, _BLOCK_ROWS),)
        with triton_jit.on_device(k):
            triton_jit.jit(_gather)[grid](
                k,
                v,
                k.stride(0),
                index,
                count,
                keys,
                values,
                WIDTH=width,
                BLOCK_R=_BLOCK_ROWS,
                BLOCK_W=block,
                num_warps=4,
            )
    return keys, values


def _gather(  # noqa: PLR0917 (a Triton kernel takes its arguments positionally)
    k_ptr: tl.tensor,
    v_ptr: tl.tensor,
    row_stride: tl.tensor,
    index_ptr: tl.tensor,
    count_ptr: tl.tensor,
    keys_ptr: tl.tensor,
    values_ptr: tl.tensor,
    WIDTH: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_W: tl.constexpr,
) -> None:
    """BLOCK_R output rows: those below count copied from their index's row of k and v."""
    n = tl.load(count_ptr)
    out = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = out < n
    src = tl.load(index_ptr + out, mask=live, other=0)
    for first in tl.static_range(0, WIDTH, BLOCK_W):
        cols = first + tl.arange(0, BLOCK_W)
        mask = live[:, None] & (cols[None, :] < WIDTH)
        read = src[:, None] * row_stride + cols[None, :]
        write = out[:, None] * WIDTH + cols[None, :]
        tl.store(keys_ptr + write, tl.load(k_ptr + read, mask=mask), mask=mask)
        tl.store(values_ptr + write, tl.load(v_ptr + read, mask=mask), mask=mask)
