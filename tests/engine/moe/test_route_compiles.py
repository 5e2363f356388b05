"""The MoE routing kernel compiles for Hopper (sm_90) on a machine without a GPU, in each mode a
server meets (live, recording, replaying with records), with its rounds over k kept as loops: unrolled,
its PTX was 1.05 MB and each mode took ~4 s to compile, most of a cold start's routed check."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from service.engine.moe import kernels
from tests.support.sm90 import compile_sm90

pytest.importorskip("triton.compiler")

POINTERS = {
    "logits_ptr": "*bf16",
    "w_ptr": "*bf16",
    "e_ptr": "*i32",
    "ranks_ptr": "*i32",
    "counts_ptr": "*i32",
    "given_ptr": "*i32",
    "covered_ptr": "*u8",
    "used_ptr": "*i32",
    "live_ptr": "*i32",
    "matches_ptr": "*i8",
}


def _compile(**modes: bool) -> Any:
    """_route for Qwen3-30B-A3B's router (128 experts, top-8) as route_kernel launches it."""
    constants: dict[str, Any] = {"EXPERTS": 128, "K": 8, "BLOCK_T": kernels.ROUTE_TOKENS, "BLOCK_E": 128}
    constants |= {"BLOCK_K": 8, "NORMALISE": True, **modes}
    names = [name for name in inspect.signature(kernels._route).parameters if name not in constants]
    return compile_sm90(kernels._route, {name: POINTERS.get(name, "i32") for name in names}, constants)


@pytest.mark.parametrize(
    "modes",
    [
        {"REPLAY": False, "USED": False, "LIVE": False, "MATCHES": False},  # live
        {"REPLAY": False, "USED": True, "LIVE": False, "MATCHES": False},  # recording
        {"REPLAY": True, "USED": True, "LIVE": True, "MATCHES": True},  # replaying, with its records
    ],
)
def test_the_routing_kernel_compiles_for_sm90_with_its_rounds_as_loops(modes: dict[str, bool]) -> None:
    kernel = _compile(**modes)
    assert bytes(kernel.asm["cubin"])
    assert len(kernel.asm["ptx"]) < 600_000  # unrolled over k = 8: ~1,000,000
