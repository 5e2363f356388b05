"""Fused-kernel selection: off on CPU, a clear error when asked for and unavailable.

On CUDA with liger-kernel importable, `make test-gpu` runs the parity suites with the fused kernels
applied (`kernels=auto`), which is their correctness check against the reference.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import pytest
import torch

from service.engine.ops import liger as kernels
from service.engine.ops.liger import apply_fused_kernels
from service.engine.runtime import packages as optional
from tests.support import models


def test_auto_is_off_on_cpu() -> None:
    assert apply_fused_kernels(models.build("qwen2"), "auto", torch.device("cpu")) == "none"
    assert apply_fused_kernels(models.build("qwen2"), "none", torch.device("cuda")) == "none"


def test_asking_for_liger_without_it_fails_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    for module in ("liger_kernel", kernels.LIGER):  # import raises ModuleNotFoundError: not installed
        monkeypatch.setitem(sys.modules, module, None)
    optional.forget()
    try:
        with pytest.raises(RuntimeError, match="needs the liger-kernel package, which is not installed"):
            apply_fused_kernels(models.build("qwen2"), "liger", torch.device("cuda"))
    finally:
        optional.forget()


def test_a_liger_patch_that_fails_is_undone_under_auto(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """liger's qwen3_moe patch raises on a model with dense layers (mlp_only_layers) after patching
    the final norm: under auto the model runs without liger, as it was; kernels=liger fails the start."""

    def patch(model: Any, rms_norm: bool = True) -> None:
        norm = model.base_model.norm
        norm.forward = lambda x: x * 0
        norm.row_mode = None
        raise AttributeError("'Qwen3MoeMLP' object has no attribute 'experts'")

    monkeypatch.setattr(kernels, "_liger_patch", lambda model_type, setting: patch)
    model = models.build("qwen3_moe")
    x = torch.randn(3, 64)
    want = model.base_model.norm(x)
    with caplog.at_level(logging.WARNING):
        assert apply_fused_kernels(model, "auto", torch.device("cuda")) == "none"
    assert "liger-kernel's patch for qwen3_moe failed" in caplog.text
    assert "forward" not in vars(model.base_model.norm)
    assert not hasattr(model.base_model.norm, "row_mode")
    torch.testing.assert_close(model.base_model.norm(x), want)
    with pytest.raises(RuntimeError, match="kernels=liger: liger-kernel's patch for qwen3_moe failed"):
        apply_fused_kernels(model, "liger", torch.device("cuda"))


@pytest.mark.liger
def test_batch_invariance_pins_liger_norms_to_their_row_kernel() -> None:
    """liger's RMSNorm switches to a 16-row block kernel at 32k rows of at most 256 columns (Qwen3's
    per-head q/k norms: 32 heads x 1024 tokens); pinned, a row's bits do not depend on the row count."""
    device = torch.device("cuda")
    model = models.build("qwen3").to(device=device, dtype=torch.bfloat16)
    assert apply_fused_kernels(model, "liger", device, batch_invariant=True) == "liger"
    norm = model.base_model.layers[0].self_attn.q_norm
    assert norm.row_mode is True
    rows = torch.randn(40_000, 16, device=device, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(norm(rows)[:100], norm(rows[:100].clone()))
