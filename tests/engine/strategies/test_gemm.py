"""The token-GEMM strategies: one call, fixed-row calls and fixed-tile calls (batch invariance), against
F.linear; the fixed-tile kernel is its CPU twin (twin.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from service.engine.strategies import gemm as gemms
from service.engine.strategies.gemm import GEMM_ROWS, ONE_CALL, FixedRows, FixedTiles
from tests.engine.strategies.twin import BlockedTiles


@pytest.mark.parametrize(
    "strategy",
    [ONE_CALL, FixedRows(32), FixedTiles(BlockedTiles(16), rows=32)],
    ids=["one-call", "fixed-rows", "fixed-tiles"],
)
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


def test_fixed_tiles_run_each_gemm_whole_through_the_kernel_and_block_other_functions() -> None:
    tiles = FixedTiles(BlockedTiles(16), rows=32)
    assert (tiles.step, tiles.whole_calls(2500), tiles.name) == (128, 2500, "fixed-tiles-blocked-twin")
    assert gemms.choose(True, BlockedTiles()) == FixedTiles(BlockedTiles())
    assert gemms.choose(False, BlockedTiles()) is ONE_CALL
    assert (ONE_CALL.name, FixedRows(1024).name) == ("one-call", "fixed-rows-1024")
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(70, 24, generator=gen), torch.randn(16, 24, generator=gen)
    calls: list[int] = []

    def head(t: torch.Tensor) -> torch.Tensor:
        calls.append(t.shape[0])
        return t @ w.T

    # a function that is not the kernel's call: blocks of `rows`, the last zero-padded
    torch.testing.assert_close(tiles.by_rows(head, x), x @ w.T)
    assert calls == [32, 32, 32]
    calls.clear()
    torch.testing.assert_close(tiles.by_rows(head, x, fixed_tile=True), x @ w.T)
    assert calls == [70]
    # a row's bits alone are its bits in any call
    whole = tiles.linear(x, w, None)
    for start, end in ((0, 1), (5, 40), (33, 70)):
        assert torch.equal(tiles.linear(x[start:end], w, None), whole[start:end])
    acc, part = torch.ones(70, 16), torch.ones(35, 16)
    tiles.accumulate(acc, x, w)
    tiles.accumulate(part, x[35:], w)
    assert torch.equal(acc[35:], part)


def test_fixed_tiles_patch_every_plain_linear_of_a_model() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4, bias=False))
    x = torch.randn(3, 50, 8)
    with torch.inference_mode():
        want = model(x)
        assert FixedTiles(BlockedTiles()).patch(model) == 2
        torch.testing.assert_close(model(x), want)
        assert FixedTiles(BlockedTiles()).patch(model[2]) == 1  # a head alone: the module itself
