"""The radix select's Triton kernels compile for Hopper (sm_90) on a machine without a GPU: triton
lowers them to PTX and its bundled ptxas assembles a cubin, so a kernel that the interpreter runs
but the compiler rejects fails here rather than on the GPU host."""

from __future__ import annotations

from typing import Any

import pytest

from service.engine.heads import topk_kernel
from tests.support.sm90 import compile_sm90

pytest.importorskip("triton.compiler")

VOCAB = 152064  # Qwen2.5's
ROW = {"z_ptr": "*bf16", "row_stride": "i64", "rows_ptr": "*i64"}


def _compile(fn: Any, signature: dict[str, str], constants: dict[str, Any]) -> bytes:
    return bytes(compile_sm90(fn, signature, constants).asm["cubin"])


@pytest.mark.parametrize(
    ("picks", "bound", "gated"), [(0, False, False), (4, False, False), (4, True, False), (4, False, True)]
)
def test_stats_kernel_compiles_for_sm90(picks: int, bound: bool, gated: bool) -> None:
    signature = {
        **ROW,
        **{"target_ptr": "*i64", "scale": "fp32", "temp_ptr": "*fp32", "k_ptr": "*i32", "shift_ptr": "*fp32"},
        **{"rank_ptr": "*i32", "max_ptr": "*fp32", "threshold_ptr": "*i32", "above_ptr": "*i32"},
        **{"tied_ptr": "*i32", "before_ptr": "*i32", "picks_ptr": "*i64", "picked_ptr": "*bf16"},
        **{"count_ptr": "*i32", "cap": "i32"},
    }
    constants = {"VOCAB": VOCAB, "HAS_SCALE": True, "HAS_TEMP": True, "SELECT": True, "PICKS": picks}
    constants |= {"PICKS_BLOCK": max(picks, 1), "BLOCK": topk_kernel.BLOCK, "DIGIT": topk_kernel.DIGIT}
    constants |= {"BOUND": bound, "GATED": gated}
    assert _compile(topk_kernel._stats_kernel, signature, constants)


@pytest.mark.parametrize("gated", [False, True])
def test_write_and_gather_kernels_compile_for_sm90(gated: bool) -> None:
    write = {**ROW, "k_ptr": "*i32", "threshold_ptr": "*i32", "above_ptr": "*i32", "ids_ptr": "*i32"}
    write |= {"values_ptr": "*bf16", "width": "i32", "count_ptr": "*i32", "cap": "i32"}
    constants = {"VOCAB": VOCAB, "BLOCK": topk_kernel.BLOCK, "GATED": gated}
    assert _compile(topk_kernel._write_kernel, write, constants)
    gather = {**ROW, "bound_ptr": "*i32", "count_ptr": "*i32", "ids_ptr": "*i32", "values_ptr": "*bf16"}
    gather |= {"width": "i32"}
    span = topk_kernel.gather_span(VOCAB, topk_kernel.BLOCK)
    constants = {"VOCAB": VOCAB, "BLOCK": topk_kernel.BLOCK, "SPAN": span}
    assert _compile(topk_kernel._gather_kernel, gather, constants)


def test_mass_kernel_compiles_for_sm90() -> None:
    mass = {**ROW, "scale": "fp32", "temp_ptr": "*fp32", "shift_ptr": "*fp32", "floor_ptr": "*fp32"}
    mass |= {"least_ptr": "*i32", "out_ptr": "*fp32"}
    constants = {"VOCAB": VOCAB, "HAS_SCALE": True, "HAS_TEMP": True, "BLOCK": topk_kernel.BLOCK}
    assert _compile(topk_kernel._mass_kernel, mass, constants)
