"""Batch-invariant mode's fixed-tile GEMMs (ops/fixed_tile.py): quack at one configuration on the GPU,
whose rows keep their bits in a call of any rows; on the CPU, the choice, the probe and the fallback
(against the CPU twin, tests/engine/strategies/twin.py)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from service.engine.ops import fixed_tile
from service.engine.ops import gate_up as gated
from service.engine.ops.elementwise import TRITON
from tests.engine.strategies.twin import BlockedTiles

CPU = torch.device("cpu")


def test_no_fixed_tile_kernel_on_the_cpu_or_in_float32() -> None:
    assert fixed_tile.choose(CPU, torch.bfloat16) is None
    assert fixed_tile.choose(CPU, torch.float32) is None


def test_the_probe_passes_a_row_invariant_kernel() -> None:
    fixed_tile.probe(BlockedTiles(), CPU, torch.float32)


@dataclass(frozen=True, slots=True)
class _RowCountDependent(BlockedTiles):
    """A kernel whose rows change with the call's row count (as a library's shape-picked kernel's do)."""

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, weight, bias) * (1 + 0.01 * (x.shape[0] % 3))


def test_the_probe_rejects_a_kernel_whose_rows_depend_on_the_call() -> None:
    with pytest.raises(ValueError, match="differ from the same rows alone"):
        fixed_tile.probe(_RowCountDependent(), CPU, torch.float32)


def test_a_kernel_that_fails_its_probe_leaves_fixed_rows_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(fixed_tile, "quack_available", lambda device: True)
    monkeypatch.setattr(fixed_tile, "quack_tiles", lambda device: _RowCountDependent())
    with caplog.at_level(logging.WARNING, logger=fixed_tile.__name__):
        assert fixed_tile.choose(CPU, torch.bfloat16) is None
    assert "GEMMs run in calls of 1024 rows instead" in caplog.text


def _quack_like(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    add_to_output: bool = False,
    config: object = None,
) -> None:
    """quack's gemm as far as these tests need: it refuses rows that are not 16-byte aligned (its TMA
    does, at compile time), and computes each row alone (row-invariant, as quack at one configuration)."""
    for m in (a, b.t(), out):
        if (m.shape[1] * m.element_size()) % 16 or (m.stride(0) * m.element_size()) % 16:
            raise ValueError("Invalid mD.strides[0]")
    for i in range(a.shape[0]):
        row = a[i : i + 1] @ b + (0 if bias is None else bias)
        out[i : i + 1] = out[i : i + 1] + row if add_to_output else row


def test_gemms_quack_cannot_align_run_in_calls_of_one_shape() -> None:
    """A router over 60 experts, a one-column gate: rows 120 and 2 bytes wide, which quack refuses.
    They run in padded calls of FALLBACK_ROWS rows; the probe's cut rows keep their bits."""
    tiles = fixed_tile.QuackTiles(_quack_like, None)
    fixed_tile.probe(tiles, CPU, torch.float32)  # widths 384 (quack), 60 and 1 (the fallback)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2100, 64, generator=gen)
    for width in (60, 1):
        weight = torch.randn(width, 64, generator=gen)
        whole = tiles.linear(x, weight, None)
        torch.testing.assert_close(whole, F.linear(x, weight))
        for start, end in ((0, 1), (5, 1030), (1024, 2100)):
            assert torch.equal(tiles.linear(x[start:end], weight, None), whole[start:end]), (width, start)
        summed = torch.ones(2100, width)
        tiles.accumulate(summed, x, weight)
        torch.testing.assert_close(summed, 1 + F.linear(x, weight))


# Qwen2.5-7B's projections over tokens: qkv (with a bias), o, down; and its head
SHAPES = {"qkv": (3584, 4608, True), "o": (3584, 3584, False), "down": (18944, 3584, False)}
CUTS = ((0, 1), (1, 129), (100, 1124), (1500, 4096), (4095, 4096), (7, 3000))


@pytest.mark.quack
@pytest.mark.parametrize("name", list(SHAPES))
def test_quack_at_one_configuration_gives_a_row_its_bits_in_a_call_of_any_rows(name: str) -> None:
    k, n, with_bias = SHAPES[name]
    device, dtype = torch.device("cuda"), torch.bfloat16
    tiles = fixed_tile.choose(device, dtype)
    assert tiles is not None
    gen = torch.Generator(device=device).manual_seed(k + n)
    x = torch.randn(4096, k, device=device, dtype=dtype, generator=gen)
    weight = torch.randn(n, k, device=device, dtype=dtype, generator=gen) / k**0.5
    bias = torch.randn(n, device=device, dtype=dtype, generator=gen) if with_bias else None
    whole = tiles.linear(x, weight, bias)
    torch.testing.assert_close(whole, F.linear(x, weight, bias), rtol=2e-2, atol=2e-2)
    for start, end in CUTS:
        assert torch.equal(tiles.linear(x[start:end], weight, bias), whole[start:end]), (start, end)
    residual = torch.randn(4096, n, device=device, dtype=dtype, generator=gen)
    summed = residual.clone()
    tiles.accumulate(summed, x, weight)
    torch.testing.assert_close(summed, residual + F.linear(x, weight), rtol=2e-2, atol=5e-2)
    for start, end in CUTS:
        part = residual[start:end].clone()
        tiles.accumulate(part, x[start:end], weight)
        assert torch.equal(part, summed[start:end]), (start, end)


@pytest.mark.quack
def test_quacks_gated_projection_is_row_invariant_too() -> None:
    """The MLP's gate|up with its SwiGLU epilogue (ops/gate_up.py), which FixedTiles runs whole."""
    device, dtype = torch.device("cuda"), torch.bfloat16
    projection = gated.choose("quack", device, dtype, TRITON.swiglu)
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(4096, 3584, device=device, dtype=dtype, generator=gen)
    weight = torch.randn(2 * 18944, 3584, device=device, dtype=dtype, generator=gen) / 60
    whole = projection.project(x, weight, None)
    for start, end in CUTS:
        assert torch.equal(projection.project(x[start:end], weight, None), whole[start:end]), (start, end)
