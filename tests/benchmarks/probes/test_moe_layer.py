"""The MoE layer probe's tile sweep on CPU: quack stood in by per-expert GEMMs (one tile computes
something else, one cannot take the shape), the timer by a clock that counts calls."""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from benchmarks.probes import moe_layer
from service.engine.moe import dispatch, grouped_gemm, routing_rule


@dataclass
class FakeConfig:
    tile_m: int
    tile_n: int
    pingpong: bool
    cluster_m: int
    cluster_n: int
    is_dynamic_persistent: bool
    device_capacity: int


def per_expert(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x [S, K] grouped by expert @ weight [E, K, N] (quack's layout) -> [S, N]: the CPU loop's GEMM."""
    return grouped_gemm.LOOP.matmul(x, weight.transpose(1, 2), grouped_gemm.Groups(offsets))


def fake_quack() -> dict[str, types.ModuleType]:
    def gemm_act(a: torch.Tensor, b: torch.Tensor, **kw: Any) -> tuple[None, torch.Tensor]:
        gate, up = per_expert(a[kw["A_idx"].long()], b, kw["cu_seqlens_m"]).chunk(2, dim=-1)
        wrong = kw.get("config") is not None and kw["config"].tile_m == 192  # a tile that miscomputes
        return None, F.silu(gate) * up * (2.0 if wrong else 1.0)

    def gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, **kw: Any) -> torch.Tensor:
        return out.copy_(per_expert(a, b, kw["cu_seqlens_m"]))

    def pinned(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, **kw: Any) -> None:
        if kw["config"].tile_n == 256:
            raise ValueError("this tile cannot take the shape")
        out.copy_(per_expert(a, b, kw["cu_seqlens_m"]))

    config = types.ModuleType("quack.gemm_config")
    config.GemmConfig = FakeConfig  # type: ignore[attr-defined]
    interface = types.ModuleType("quack.gemm_interface")
    interface.gemm_act = gemm_act  # type: ignore[attr-defined]
    interface.gemm = gemm  # type: ignore[attr-defined]
    interface.gemm_tuned = SimpleNamespace(fn=pinned)  # type: ignore[attr-defined]
    return {
        "quack": types.ModuleType("quack"),
        "quack.gemm_config": config,
        "quack.gemm_interface": interface,
    }


def test_the_sweep_checks_each_tile_against_the_heuristic_and_times_the_passes_both_ways(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name, module in fake_quack().items():
        monkeypatch.setitem(sys.modules, name, module)
    order: list[Callable[[], object]] = []

    def clock(fn: Callable[[], object], reps: int) -> float:
        order.append(fn)
        return float(len(order))  # each timing later than the one before: a drifting clock

    monkeypatch.setattr(moe_layer, "timed", clock)
    gen = torch.Generator().manual_seed(0)
    t, h, e, i, k = 40, 16, 4, 8, 2
    router = SimpleNamespace(weight=torch.randn(e, h, generator=gen))
    experts = SimpleNamespace(
        gate_up_proj=torch.randn(e, 2 * i, h, generator=gen), down_proj=torch.randn(e, h, i, generator=gen)
    )
    hidden, rule = (
        torch.randn(t, h, generator=gen),
        routing_rule.Routing(k, normalise=True, round_weights=True),
    )
    layer = moe_layer.Layer(
        router, experts, hidden, torch.zeros_like(hidden), rule, dispatch.plan(hidden, router.weight, rule)
    )

    sweep = moe_layer.sweep_steps(layer, reps=3, passes=2)

    gate_up, down = sweep["gemm1"], sweep["gemm2"]
    tiles = len(moe_layer.SWEEP_TILES)
    assert len(gate_up) == len(down) == 1 + 2 * tiles  # the heuristic and every pin
    assert gate_up["192x128_pp_c11_dyn"]["max_abs_over_max"] == pytest.approx(1.0)  # twice the heuristic's
    assert gate_up["128x256_coop_c11_dyn"]["max_abs_over_max"] == 0.0
    assert down["128x192_pp_c21_static"]["max_abs_over_max"] == 0.0
    assert down["128x256_coop_c21_dyn"].startswith("ValueError: this tile cannot take")
    timed = [v for by in sweep.values() for v in by.values() if isinstance(v, dict)]
    assert len(order) == 2 * len(timed)
    assert order[: len(timed)] == order[len(timed) :][::-1]  # the second pass in reverse order
    for v in timed:  # each config's figure is the lower of its two passes
        assert len(v["passes_ms"]) == 2
        assert v["ms"] == min(v["passes_ms"])
    first, last = gate_up["heuristic_dyn"], down["256x192_coop_c21_dyn"]
    assert first["passes_ms"] == [1.0, 2.0 * len(timed)]  # first in the first pass, last in the second
    assert last["passes_ms"] == [len(timed), len(timed) + 1.0]
