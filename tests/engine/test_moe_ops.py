"""The MoE layer's last step (moe_ops): the torch twin against a per-token loop written here, the Triton
kernel against the twin (CPU: Triton's interpreter in float32, in a fresh process; GPU: bf16, bitwise)."""

from __future__ import annotations

import pytest
import torch

from service.engine import moe_ops
from tests.engine.interpreter import INTERPRETED, only_interpreted, run_interpreter_cases

gpu = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED, reason="needs CUDA, compiled kernels")


def test_kernel_cases_in_a_fresh_process() -> None:
    run_interpreter_cases(__file__)


def inputs(  # noqa: PLR0917
    t: int, k: int, width: int, dtype: torch.dtype, w_dtype: torch.dtype, device: str = "cpu", seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [t, width], y [t·k, width] (grouped rows), slots [t, k] (a permutation), w [t, k], extra."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, width, generator=gen).to(device=device, dtype=dtype)
    y = (torch.randn(t * k, width, generator=gen) * 3).to(device=device, dtype=dtype)
    slots = torch.randperm(t * k, generator=gen).view(t, k).to(device)
    w = torch.rand(t, k, generator=gen).to(device=device, dtype=w_dtype)
    extra = torch.randn(t, width, generator=gen).to(device=device, dtype=dtype)
    return x, y, slots, w, extra


def loop_reference(
    x: torch.Tensor, y: torch.Tensor, slots: torch.Tensor, w: torch.Tensor, extra: torch.Tensor | None
) -> torch.Tensor:
    """Token by token, slot by slot: products rounded to w's dtype, a float32 sum, one rounding."""
    out = x.clone()
    for t in range(x.shape[0]):
        acc = torch.zeros(x.shape[1], dtype=torch.float32)
        for j in range(w.shape[1]):
            acc += (y[slots[t, j]] * w[t, j]).to(w.dtype).float()
        total = acc.to(x.dtype)
        if extra is not None:
            total = total + extra[t]
        out[t] += total
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("w_dtype", ["model", torch.float32], ids=["w_model_dtype", "w_float32"])
@pytest.mark.parametrize("shared", [False, True], ids=["plain", "extra"])
def test_twin_equals_the_loop(dtype: torch.dtype, w_dtype: torch.dtype | str, shared: bool) -> None:
    x, y, slots, w, extra = inputs(9, 4, 48, dtype, dtype if w_dtype == "model" else torch.float32)
    want = loop_reference(x, y, slots, w, extra if shared else None)
    moe_ops.combine_torch(x, y, slots, w, extra if shared else None)
    if dtype == torch.float32:
        torch.testing.assert_close(x, want, atol=1e-6, rtol=1e-6)
    else:  # torch sums in its own order: one rounding apart, twice more rounded (extra, the residual)
        assert float((x.float() - want.float()).abs().max()) <= 2**-6 * float(want.float().abs().max())


@only_interpreted
@pytest.mark.parametrize("shared", [False, True], ids=["plain", "extra"])
@pytest.mark.parametrize("width", [48, 100])
def test_interpreter_kernel_equals_the_twin(shared: bool, width: int) -> None:
    x, y, slots, w, extra = inputs(7, 3, width, torch.float32, torch.float32)
    want = x.clone()
    moe_ops.combine_torch(want, y, slots, w, extra if shared else None)
    strided = torch.zeros(7, width + 16)[:, 5 : 5 + width]  # a residual that is a view with a row stride
    strided.copy_(x)
    moe_ops.combine_kernel(strided, y, slots, w, extra if shared else None)
    torch.testing.assert_close(strided, want, atol=1e-6, rtol=1e-6)


def test_kernel_refuses_cpu_tensors_outside_the_interpreter() -> None:
    if INTERPRETED:
        pytest.skip("the interpreter runs it on CPU")
    x, y, slots, w, _ = inputs(2, 2, 8, torch.float32, torch.float32)
    with pytest.raises(ValueError, match="CUDA or under TRITON_INTERPRET"):
        moe_ops.combine_kernel(x, y, slots, w, None)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("w_dtype", ["model", torch.float32], ids=["w_bf16", "w_float32"])
@pytest.mark.parametrize("shared", [False, True], ids=["plain", "extra"])
def test_kernel_equals_the_loop_on_cuda(w_dtype: torch.dtype | str, shared: bool) -> None:
    """Qwen3-30B-A3B's width and top-8: the same rounding steps as the loop, and the same float32 sum
    order, so the same bits."""
    dtype = torch.bfloat16
    x, y, slots, w, extra = inputs(300, 8, 2048, dtype, dtype if w_dtype == "model" else torch.float32)
    want = loop_reference(x, y, slots, w, extra if shared else None)
    x, y, slots, w, extra = (a.cuda() for a in (x, y, slots, w, extra))
    moe_ops.combine_kernel(x, y, slots, w, extra if shared else None)
    assert torch.equal(x.cpu(), want)
