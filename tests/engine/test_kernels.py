"""Fused-kernel selection: off on CPU, a clear error when asked for and unavailable.

On CUDA with liger-kernel importable, tests/gpu/run_parity.sh runs the whole parity suite with the
fused kernels applied (`kernels=auto`), which is their correctness check against the reference.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from service.engine.kernels import apply_fused_kernels
from tests import models


def test_auto_is_off_on_cpu() -> None:
    assert apply_fused_kernels(models.build("qwen2"), "auto", torch.device("cpu")) == "none"
    assert apply_fused_kernels(models.build("qwen2"), "none", torch.device("cuda")) == "none"


@pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is not None, reason="liger-kernel is installed")
def test_asking_for_liger_without_it_fails_loudly() -> None:
    with pytest.raises(RuntimeError, match="liger-kernel"):
        apply_fused_kernels(models.build("qwen2"), "liger", torch.device("cuda"))
