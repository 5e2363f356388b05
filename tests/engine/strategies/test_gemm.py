"""The token-GEMM strategies: one call, or fixed-row calls (batch invariance), against F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from service.engine.strategies import gemm as gemms
from service.engine.strategies.gemm import GEMM_ROWS, ONE_CALL, FixedRows


@pytest.mark.parametrize("strategy", [ONE_CALL, FixedRows(32)], ids=["one-call", "fixed-rows"])
@pytest.mark.parametrize("n", [7, 32, 96])
def test_every_strategy_computes_the_linear_map(strategy: gemms.TokenGemms, n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(n, 24, generator=gen, dtype=torch.float64)
    w, b = (
        torch.randn(16, 24, generator=gen, dtype=torch.float64),
        torch.randn(16, generator=gen, dtype=torch.float64),
    )
    torch.testing.assert_close(strategy.linear(x, w, b), x @ w.T + b)
    acc = torch.ones(n, 16, dtype=torch.float64)
    strategy.accumulate(acc, x, w)
    torch.testing.assert_close(acc, 1 + x @ w.T)
    torch.testing.assert_close(strategy.by_rows(lambda t: F.silu(t @ w.T), x), F.silu(x @ w.T))


def test_fixed_rows_pads_to_its_rows_and_rounds_mlp_chunks_to_whole_calls() -> None:
    fixed = FixedRows(1024)
    assert (fixed.step, ONE_CALL.step, ONE_CALL.rows) == (1024, 128, None)
    assert [fixed.whole_calls(t) for t in (0, 100, 1024, 2500)] == [0, 1024, 1024, 2048]
    assert ONE_CALL.whole_calls(2500) == 2500
    assert gemms.choose(True) == FixedRows(GEMM_ROWS)
    assert gemms.choose(False) is ONE_CALL


def test_fixed_rows_patches_every_plain_linear_of_a_model() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4, bias=False))
    x = torch.randn(2, 1024, 8)  # [batch, tokens, in]: 2048 flattened rows, two calls
    with torch.inference_mode():  # as the engine runs them
        want = model(x)
        assert FixedRows(1024).patch(model) == 2
        assert ONE_CALL.patch(model) == 0
        torch.testing.assert_close(model(x), want)
