"""The experts' grouped GEMMs (moe/grouped_gemm.py): the blocked loop of batch-invariant mode, and the
`moe_kernel` setting with its fallbacks. CPU, float32; the layer's own tests (test_layer.py) run each
kernel inside a sparse layer against transformers' blocks.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from service.engine.moe import grouped_gemm
from tests.engine.decoder.test_fused import CPU
from tests.engine.moe.test_layer import GROUPED


def test_the_blocked_loop_gives_a_row_the_same_bits_whatever_its_group_holds() -> None:
    """Batch-invariant mode's loop (grouped_gemm.blocked): every call EXPERT_ROWS rows, so a row's bits do not
    depend on how many rows its expert took; the same products as the loop."""
    gen = torch.Generator().manual_seed(6)
    weight = torch.randn(3, 48, 40, generator=gen)
    x = torch.randn(300, 40, generator=gen)
    kernel = grouped_gemm.blocked(grouped_gemm.LOOP)
    assert grouped_gemm.blocked(GROUPED) is GROUPED
    assert kernel.row_invariant
    outs = []
    for ends in ([1, 150, 300], [130, 200, 300], [5, 10, 300]):
        groups = grouped_gemm.Groups(torch.tensor([0, *ends], dtype=torch.int32))
        got = kernel.matmul(x, weight, groups)
        torch.testing.assert_close(got, grouped_gemm.LOOP.matmul(x, weight, groups), atol=1e-5, rtol=1e-5)
        outs.append(got)
    assert torch.equal(outs[0][0], outs[1][0])  # expert 0 either way: row 0 alone, then among 130
    assert torch.equal(outs[1][250], outs[2][250])  # expert 2: among 100, then among 290


def test_the_kernel_setting(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    assert grouped_gemm.choose("auto", CPU, torch.float32) is grouped_gemm.LOOP
    assert grouped_gemm.choose("loop", CPU, torch.float32) is grouped_gemm.LOOP
    assert GROUPED.name == "grouped_mm"

    def broken(*_: Any, **__: Any) -> torch.Tensor:
        raise RuntimeError("no kernel image for this architecture")

    monkeypatch.setattr(grouped_gemm, "grouped_mm_function", lambda: broken)
    with pytest.raises(RuntimeError, match="moe_kernel=grouped_mm: RuntimeError: no kernel image"):
        grouped_gemm.choose("grouped_mm", CPU, torch.float32)
    with pytest.raises(RuntimeError, match="moe_kernel=quack: "):  # no quack on a CPU
        grouped_gemm.choose("quack", CPU, torch.float32)
    monkeypatch.setattr(grouped_gemm, "_wants_fast", lambda device: True)
    with caplog.at_level(logging.WARNING):
        assert grouped_gemm.choose("auto", CPU, torch.float32) is grouped_gemm.LOOP
    assert "grouped_mm cannot run here (RuntimeError: no kernel image" in caplog.text
    assert "experts run one by one" in caplog.text
    monkeypatch.setattr(grouped_gemm, "grouped_mm_function", lambda: None)
    with pytest.raises(RuntimeError, match="has no grouped GEMM"):
        grouped_gemm.choose("grouped_mm", CPU, torch.float32)
