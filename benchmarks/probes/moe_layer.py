"""One sparse MoE layer, step by step: where its time goes, and what each grouped-GEMM kernel costs.

    python -m benchmarks.probes.moe_layer                  # Qwen3-30B-A3B's layer, a 16k-token micro-batch
    python -m benchmarks.probes.moe_layer --tokens 4096 --tuned   # also quack's autotuned configs (slow)
    python -m benchmarks.probes.moe_layer --sweep          # each GEMM under each Hopper tile config

Random bf16 weights of Qwen3-30B-A3B's shape (hidden 2048, 128 experts of 768, top-8) on one GPU.
Each step is timed alone with CUDA events (median of --reps after a warm-up): the router and the
sort by expert, the gather of the tokens' rows, each grouped GEMM by every kernel that runs here
(torch's grouped_mm; quack's varlen GEMM, with the gather and the SwiGLU in it or not), the SwiGLU,
and the weighted sum back into the residual (torch ops and moe_ops' kernel). Then the whole layer as
moe.py runs it under each `moe_kernel`, and the fraction of the layer's GEMM floor each reaches
(2 · T · k · 3 · H · I FLOPs at the measured dense bf16 rate). The whole layers' outputs are compared
with each other (largest |Δ| over the largest |x|).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from benchmarks.harness import matmul_rate, median_ms, provenance, write_result
from service.engine.moe import dispatch, grouped_gemm, routing_rule
from service.engine.moe import kernels as moe_ops
from service.engine.moe import layer as moe
from service.engine.ops import elementwise as decoder_ops


def timed(fn: Callable[[], object], reps: int) -> float:
    """Median GPU ms of `fn` over `reps` replays of a CUDA graph of it (as the server replays a layer:
    no launch overhead), after a warm-up call; eager calls where it cannot be captured."""
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
        run: Callable[[], object] = graph.replay
    except RuntimeError:
        run = fn
    return median_ms(run, torch.device("cuda"), reps, warmup=1)


@dataclass
class Layer:
    """One MoE layer's random weights and inputs, and a plan of its routing."""

    router: SimpleNamespace  # .weight [E, H]
    experts: SimpleNamespace  # .gate_up_proj [E, 2·I, H], .down_proj [E, H, I]
    hidden: torch.Tensor  # [T, H]
    residual: torch.Tensor  # [T, H]
    rule: routing_rule.Routing
    plan: dispatch.Plan

    @staticmethod
    def random(t: int, h: int, e: int, i: int, k: int) -> Layer:
        dev, dtype = torch.device("cuda"), torch.bfloat16
        router = SimpleNamespace(weight=torch.randn(e, h, device=dev, dtype=dtype) * h**-0.5)
        experts = SimpleNamespace(
            gate_up_proj=torch.randn(e, 2 * i, h, device=dev, dtype=dtype) * h**-0.5,
            down_proj=torch.randn(e, h, i, device=dev, dtype=dtype) * i**-0.5,
        )
        hidden = torch.randn(t, h, device=dev, dtype=dtype)
        rule = routing_rule.Routing(k, normalise=True, round_weights=True)
        plan = dispatch.plan(hidden, router.weight, rule)
        return Layer(router, experts, hidden, torch.randn_like(hidden), rule, plan)


def torch_steps(layer: Layer, reps: int) -> dict[str, float]:
    """The routing, the gather, torch's grouped GEMMs, the SwiGLU and the weighted sum, one by one."""
    hidden, router, experts, plan, rule = layer.hidden, layer.router, layer.experts, layer.plan, layer.rule
    s, i = plan.rows.shape[0], experts.down_proj.shape[2]
    gathered = hidden.index_select(0, plan.rows)
    gate_up = torch.empty(s, 2 * i, device=hidden.device, dtype=hidden.dtype)
    act = torch.empty(s, i, device=hidden.device, dtype=hidden.dtype)
    down = torch.empty_like(gathered)
    grouped = grouped_gemm.choose("grouped_mm", hidden.device, hidden.dtype)
    logits = hidden @ router.weight.t()
    _, chosen = rule(logits)
    routed = moe_ops.route_kernel(logits, rule.top_k, True, logits.dtype)
    x = layer.residual.clone()
    return {
        "route_and_sort": timed(lambda: dispatch.plan(hidden, router.weight, rule), reps),
        "route_and_sort_kernels": timed(lambda: dispatch.plan_kernel(hidden, router.weight, rule), reps),
        "route_router_gemm": timed(lambda: hidden @ router.weight.t(), reps),
        "route_softmax_topk": timed(lambda: rule(logits), reps),
        "route_sort": timed(lambda: torch.sort(chosen.flatten(), stable=True), reps),
        "route_kernel": timed(lambda: moe_ops.route_kernel(logits, rule.top_k, True, logits.dtype), reps),
        "group_kernel": timed(lambda: moe_ops.group_kernel(routed), reps),
        "gather": timed(lambda: hidden.index_select(0, plan.rows), reps),
        "gemm1_grouped_mm": timed(
            lambda: gate_up.copy_(grouped.matmul(gathered, experts.gate_up_proj, plan.groups)), reps
        ),
        "swiglu": timed(lambda: decoder_ops.swiglu_kernel(gate_up), reps),
        "gemm2_grouped_mm": timed(lambda: grouped.matmul(act, experts.down_proj, plan.groups), reps),
        "combine_torch": timed(lambda: moe_ops.combine_torch(x, down, plan.slots, plan.weights, None), reps),
        "combine_kernel": timed(
            lambda: moe_ops.combine_kernel(x, down, plan.slots, plan.weights, None), reps
        ),
    }


@dataclass
class QuackGemms:
    """quack's two grouped GEMMs of `layer` with the arguments the server gives them, as calls still
    open to options (a tile, the scheduler, tuning): gate|up with SwiGLU in the epilogue, down plain."""

    layer: Layer
    act: torch.Tensor  # [S, I]: the down GEMM's input (random)
    down: torch.Tensor  # [S, H]: its output

    @staticmethod
    def of(layer: Layer) -> QuackGemms:
        rows, (_, hidden, width) = layer.plan.rows.shape[0], layer.experts.down_proj.shape
        device, dtype = layer.hidden.device, layer.hidden.dtype
        act = torch.randn(rows, width, device=device, dtype=dtype)
        return QuackGemms(layer, act, torch.empty(rows, hidden, device=device, dtype=dtype))

    def gate_up(self, gather: bool = True, **options: Any) -> Callable[[], object]:
        """gate|up gathering its rows of h itself (or reading them gathered beforehand):
        returns (pre-activation, SwiGLU [S, I])."""
        from quack.gemm_interface import gemm_act

        h, plan = self.layer.hidden, self.layer.plan
        return partial(
            gemm_act,
            h if gather else h.index_select(0, plan.rows),
            self.layer.experts.gate_up_proj.transpose(1, 2),
            activation="swiglu",
            cu_seqlens_m=plan.groups.offsets,
            A_idx=plan.rows if gather else None,
            store_preact=False,
            concat_layout=("B",),
            **options,
        )

    def down_proj(self, fn: Callable[..., object], **options: Any) -> Callable[[], object]:
        """`fn` (quack's gemm, or gemm_tuned.fn with a pinned config) writing act @ down into `down`."""
        weight = self.layer.experts.down_proj.transpose(1, 2)
        return partial(
            fn, self.act, weight, self.down, cu_seqlens_m=self.layer.plan.groups.offsets, **options
        )


def quack_steps(layer: Layer, reps: int, tuned: bool) -> dict[str, float]:
    """quack's varlen GEMMs: gate|up with and without the gather, with the heuristic tile, its dynamic
    scheduler and (tuned) the autotuner's pick; the down GEMM the same ways."""
    from quack.gemm_interface import gemm

    gemms = QuackGemms.of(layer)
    modes: dict[str, dict[str, bool]] = {
        "heuristic": {"tuned": False},
        "dynamic": {"tuned": False, "dynamic_scheduler": True},
    }
    if tuned:
        modes["tuned"] = {"tuned": True}
    steps = {}
    for mode, options in modes.items():
        steps[f"gemm1_quack_gather_swiglu_{mode}"] = timed(gemms.gate_up(True, **options), reps)
        steps[f"gemm1_quack_swiglu_{mode}"] = timed(gemms.gate_up(False, **options), reps)
        steps[f"gemm2_quack_{mode}"] = timed(gemms.down_proj(gemm, **options), reps)
    return steps


# Hopper tile configurations the sweep pins, each as (tile_m, tile_n, pingpong): quack's own SM90
# candidates whose tile_n is a multiple of 32 (the SwiGLU epilogue's), pingpong at tile_m 128 and 192,
# cooperative at 256 (and 128 by 256)
SWEEP_TILES = [
    (128, 128, True),
    (128, 192, True),
    (192, 128, True),
    (128, 256, False),
    (256, 128, False),
    (256, 192, False),
]
# (gemm, cluster_m, cluster_n, dynamic scheduler): gate|up on the dynamic scheduler (as the server
# runs it), the down GEMM on both, each with and without a pair of CTAs along M
SWEEP_RUNS = [
    ("gemm1", 1, 1, True),
    ("gemm1", 2, 1, True),
    ("gemm2", 2, 1, False),
    ("gemm2", 2, 1, True),
]


def sweep_steps(layer: Layer, reps: int, passes: int) -> dict[str, dict[str, Any]]:
    """Each grouped GEMM as the server calls it (gate|up gathering its rows, SwiGLU in the epilogue;
    down plain) under quack's heuristic tile and with each SWEEP_TILES config pinned, for each of
    SWEEP_RUNS: {gemm: {config name: {"ms", "passes_ms", "max_abs_over_max"}, or the error's text}}.
    The configs are timed in `passes` passes, every other one in reverse order, so a clock that drifts
    over the sweep does not favour one end; "ms" is the lowest of a config's medians. Each result is
    compared with the heuristic's (largest |Δ| over the largest |output|): a tile that computes
    something else shows there, not as a fast time."""
    from quack.gemm_config import GemmConfig
    from quack.gemm_interface import gemm, gemm_tuned

    gemms = QuackGemms.of(layer)

    def gate_up(call: Callable[[], object]) -> torch.Tensor:
        outputs = call()
        assert isinstance(outputs, tuple)
        result: torch.Tensor = outputs[1]  # (pre-activation, post-activation)
        return result

    def down_of(call: Callable[[], object]) -> torch.Tensor:
        call()
        return gemms.down.clone()

    calls: dict[tuple[str, str], Callable[[], object]] = {
        ("gemm1", "heuristic_dyn"): gemms.gate_up(tuned=False, dynamic_scheduler=True),
        ("gemm2", "heuristic_static"): gemms.down_proj(gemm, tuned=False),
    }
    for (gemm_name, cluster_m, cluster_n, dynamic), (tile_m, tile_n, pingpong) in itertools.product(
        SWEEP_RUNS, SWEEP_TILES
    ):
        config = GemmConfig(
            tile_m=tile_m,
            tile_n=tile_n,
            pingpong=pingpong,
            cluster_m=cluster_m,
            cluster_n=cluster_n,
            is_dynamic_persistent=dynamic,
            device_capacity=9,
        )
        kind = f"{'pp' if pingpong else 'coop'}_c{cluster_m}{cluster_n}_{'dyn' if dynamic else 'static'}"
        calls[gemm_name, f"{tile_m}x{tile_n}_{kind}"] = (
            gemms.gate_up(dynamic_scheduler=dynamic, config=config)
            if gemm_name == "gemm1"
            else gemms.down_proj(gemm_tuned.fn, config=config)
        )
    reference = {
        "gemm1": gate_up(calls["gemm1", "heuristic_dyn"]).float(),
        "gemm2": down_of(calls["gemm2", "heuristic_static"]).float(),
    }
    out: dict[str, dict[str, Any]] = {"gemm1": {}, "gemm2": {}}
    timings: dict[tuple[str, str], list[float]] = {}
    for key, call in calls.items():  # each config once, checked against the heuristic
        gemm_name, name = key
        try:
            got = gate_up(call) if gemm_name == "gemm1" else down_of(call)
        except Exception as exc:  # a config this shape cannot take is reported, not fatal
            out[gemm_name][name] = f"{type(exc).__name__}: {str(exc)[:120]}"
            continue
        want = reference[gemm_name]
        error = float((got.float() - want).abs().max() / want.abs().max())
        out[gemm_name][name] = {"max_abs_over_max": error}
        timings[key] = []
    for turn in range(passes):
        for key in list(timings)[:: -1 if turn % 2 else 1]:
            timings[key].append(timed(calls[key], reps))
    for (gemm_name, name), medians in timings.items():
        out[gemm_name][name].update(ms=min(medians), passes_ms=medians)
        print(f"  {gemm_name} {name}: {out[gemm_name][name]}", file=sys.stderr, flush=True)
    return out


def whole_layers(layer: Layer, reps: int, results: dict[str, Any]) -> dict[str, float]:
    """moe.SparseMoe as the fused decoder builds it on CUDA, per device kernel: its ms; the largest
    |Δ| of quack's output from grouped_mm's, over the largest |output|, into `results`."""
    times: dict[str, float] = {}
    outputs: dict[str, torch.Tensor] = {}
    for name in ("grouped_mm", "quack"):
        try:
            kernel = grouped_gemm.choose(name, layer.hidden.device, layer.hidden.dtype)
        except Exception as exc:  # a kernel this machine cannot run is reported
            results[f"{name}_error"] = f"{type(exc).__name__}: {exc}"
            continue
        sparse = moe.SparseMoe(
            layer.router,
            layer.experts,
            layer.rule,
            kernel,
            decoder_ops.swiglu_kernel,
            combine=moe_ops.combine_kernel,
            planner=dispatch.plan_kernel,
        )
        outputs[name] = sparse(layer.hidden).float()
        times[name] = timed(partial(sparse.add_to, layer.residual.clone(), layer.hidden), reps)
    if len(outputs) == 2:
        a, b = outputs["grouped_mm"], outputs["quack"]
        results["quack_vs_grouped_mm_max_abs_over_max"] = float((a - b).abs().max() / a.abs().max())
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--tuned", action="store_true", help="also quack's autotuned configurations")
    parser.add_argument("--sweep", action="store_true", help="also each GEMM under each pinned tile config")
    parser.add_argument("--sweep-passes", type=int, default=2, help="timing passes of the sweep")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    t, h, e, i, k = args.tokens, args.hidden, args.experts, args.width, args.top_k
    layer = Layer.random(t, h, e, i, k)
    rate = matmul_rate(torch.device("cuda"), torch.bfloat16) / 1e12  # TFLOP/s, the floors' rate
    flops1, flops2 = 2 * t * k * h * 2 * i, 2 * t * k * i * h
    results: dict[str, Any] = {"tokens": t, "hidden": h, "experts": e, "width": i, "top_k": k}
    results["dense_tflops"] = rate
    steps = torch_steps(layer, args.reps)
    try:
        steps.update(quack_steps(layer, args.reps, args.tuned))
    except Exception as exc:  # report what failed and go on with the rest
        results["quack_error"] = f"{type(exc).__name__}: {exc}"
    if args.sweep:
        sweep = sweep_steps(layer, args.reps, args.sweep_passes)
        flops = {"gemm1": flops1, "gemm2": flops2}
        timed_ok = {
            gemm: {n: v["ms"] for n, v in by.items() if isinstance(v, dict)} for gemm, by in sweep.items()
        }
        results["sweep"] = sweep
        results["sweep_best"] = {
            gemm: min(((ms, n) for n, ms in by.items()), default=None) for gemm, by in timed_ok.items()
        }
        results["sweep_tflops"] = {
            gemm: {n: flops[gemm] / ms / 1e9 for n, ms in by.items()} for gemm, by in timed_ok.items()
        }
    layers = whole_layers(layer, args.reps, results)
    floor_ms = (flops1 + flops2) / rate / 1e9
    results["steps_ms"] = steps
    results["layer_ms"] = layers
    results["layer_floor_ms"] = floor_ms
    results["layer_fraction_of_floor"] = {name: floor_ms / ms for name, ms in layers.items()}
    results["gemm_tflops"] = {
        name: (flops1 if name.startswith("gemm1") else flops2) / ms / 1e9
        for name, ms in steps.items()
        if name.startswith("gemm")
    }
    results = {**provenance("probes.moe_layer", torch.device("cuda"), argv), **results}
    print(json.dumps(results, indent=2))
    if args.output is not None:
        write_result(args.output, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
