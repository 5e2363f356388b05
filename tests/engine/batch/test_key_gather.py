"""The graphed shared-prefix gather: the first `count` rows of a static index, the rest left alone.

The reference is `index_select` over the real index. The Triton kernel runs on CPU under Triton's
interpreter in a fresh process, and on CUDA where there is one.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from service.engine.batch import key_gather
from service.engine.runtime import triton_jit
from tests.engine.interpreter import only_interpreted, run_interpreter_cases

Gather = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def test_kernel_cases_in_a_fresh_process() -> None:
    run_interpreter_cases(__file__)


def qkv_views(n: int, hq: int, hk: int, d: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """k and v as the fused decoder has them: [N, Hk, D] column slices of the packed qkv rows."""
    qkv = torch.randn(n, (hq + 2 * hk) * d, device=device)
    k = qkv[:, hq * d : (hq + hk) * d].view(n, hk, d)
    v = qkv[:, (hq + hk) * d :].view(n, hk, d)
    return k, v


def check(gather: Gather, n: int, hk: int, d: int, *, count: int, capacity: int, device: str = "cpu") -> None:
    k, v = qkv_views(n, 4, hk, d, device)
    generator = torch.Generator().manual_seed(count)
    real = torch.randint(0, n, (count,), generator=generator).to(device)
    stale = torch.full((capacity - count,), 10**9, dtype=torch.long, device=device)  # past count: never read
    index = torch.cat([real, stale])
    keys, values = gather(k, v, index, torch.tensor([count], dtype=torch.int32, device=device))
    assert keys.shape == values.shape == (capacity, hk, d)
    torch.testing.assert_close(keys[:count], k.index_select(0, real), rtol=0, atol=0)
    torch.testing.assert_close(values[:count], v.index_select(0, real), rtol=0, atol=0)


@pytest.mark.parametrize(("count", "capacity"), [(0, 16), (1, 16), (37, 64), (64, 64)])
def test_torch_twin(count: int, capacity: int) -> None:
    check(key_gather.rows_torch, 50, 2, 8, count=count, capacity=capacity)


def test_rows_picks_the_twin_on_cpu() -> None:
    check(key_gather.rows, 50, 2, 8, count=20, capacity=32)


@only_interpreted
@pytest.mark.parametrize(("hk", "d"), [(2, 8), (1, 16), (3, 8)])
@pytest.mark.parametrize(("count", "capacity"), [(0, 16), (5, 16), (37, 64), (64, 64), (70, 100)])
def test_interpreter_gather(hk: int, d: int, count: int, capacity: int) -> None:
    check(key_gather.rows_kernel, 50, hk, d, count=count, capacity=capacity)


def test_the_kernel_refuses_other_layouts() -> None:
    pytest.importorskip("triton")
    k = torch.randn(10, 2, 8, device="cuda" if torch.cuda.is_available() else "cpu")
    if k.device.type != "cuda" and not triton_jit.interpreting():
        with pytest.raises(ValueError, match="Triton kernels run on CUDA"):
            key_gather.rows_kernel(k, k, torch.zeros(4, dtype=torch.long), torch.ones(1, dtype=torch.int32))
        return
    with pytest.raises(ValueError, match="one layout"):
        key_gather.rows_kernel(
            k, k.transpose(1, 2), torch.zeros(4, dtype=torch.long), torch.ones(1, dtype=torch.int32)
        )


@pytest.mark.gpu
@pytest.mark.parametrize(("hk", "d"), [(2, 128), (4, 128), (8, 64)])
def test_the_kernel_on_cuda(hk: int, d: int) -> None:
    check(key_gather.rows_kernel, 4096, hk, d, count=30000, capacity=65536, device="cuda")
    check(key_gather.rows_kernel, 4096, hk, d, count=0, capacity=1024, device="cuda")
