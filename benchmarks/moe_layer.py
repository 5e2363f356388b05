"""One sparse MoE layer, step by step: where its time goes, and what each grouped-GEMM kernel costs.

    python -m benchmarks.moe_layer                      # Qwen3-30B-A3B's layer, a 16k-token micro-batch
    python -m benchmarks.moe_layer --tokens 4096 --tuned   # also quack's autotuned configs (slow start)

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
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from service.engine import decoder_ops, moe, moe_ops


def timed(fn: Callable[[], object], reps: int) -> float:
    """Median GPU ms of `fn` over `reps` replays of a CUDA graph of it (as the server replays a layer:
    no launch overhead), after a warm-up call; eager calls where it cannot be captured."""
    stream = torch.cuda.Stream()
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
    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def dense_rate(reps: int) -> float:
    """bf16 TFLOP/s of one large square GEMM."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return 2 * 8192**3 / timed(lambda: a @ b, reps) / 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--tuned", action="store_true", help="also quack's autotuned configurations")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    dev, dtype = torch.device("cuda"), torch.bfloat16
    t, h, e, i, k = args.tokens, args.hidden, args.experts, args.width, args.top_k
    router = SimpleNamespace(weight=torch.randn(e, h, device=dev, dtype=dtype) * h**-0.5)
    experts = SimpleNamespace(
        gate_up_proj=torch.randn(e, 2 * i, h, device=dev, dtype=dtype) * h**-0.5,
        down_proj=torch.randn(e, h, i, device=dev, dtype=dtype) * i**-0.5,
    )
    hidden = torch.randn(t, h, device=dev, dtype=dtype)
    residual = torch.randn(t, h, device=dev, dtype=dtype)
    rule = moe.Routing(k, normalise=True, round_weights=True)
    rate = dense_rate(args.reps)
    flops1, flops2 = 2 * t * k * h * 2 * i, 2 * t * k * i * h
    results: dict[str, Any] = {
        "tokens": t,
        "hidden": h,
        "experts": e,
        "width": i,
        "top_k": k,
        "dense_tflops": rate,
    }
    steps: dict[str, float] = {}

    plan = moe.plan(hidden, router.weight, rule)
    gathered = hidden.index_select(0, plan.rows)
    gate_up = torch.empty(t * k, 2 * i, device=dev, dtype=dtype)
    act = torch.empty(t * k, i, device=dev, dtype=dtype)
    down = torch.empty(t * k, h, device=dev, dtype=dtype)
    weight1, weight2 = experts.gate_up_proj.transpose(1, 2), experts.down_proj.transpose(1, 2)
    grouped = moe.choose("grouped_mm", dev, dtype)
    steps["route_and_sort"] = timed(lambda: moe.plan(hidden, router.weight, rule), args.reps)
    steps["route_and_sort_kernels"] = timed(lambda: moe.plan_kernel(hidden, router.weight, rule), args.reps)
    logits = hidden @ router.weight.t()
    _, chosen = rule(logits)
    steps["route_router_gemm"] = timed(lambda: hidden @ router.weight.t(), args.reps)
    steps["route_softmax_topk"] = timed(lambda: rule(logits), args.reps)
    steps["route_sort"] = timed(lambda: torch.sort(chosen.flatten(), stable=True), args.reps)
    steps["gather"] = timed(lambda: hidden.index_select(0, plan.rows), args.reps)
    steps["gemm1_grouped_mm"] = timed(
        lambda: gate_up.copy_(grouped.matmul(gathered, experts.gate_up_proj, plan.groups)), args.reps
    )
    steps["swiglu"] = timed(lambda: decoder_ops.swiglu_kernel(gate_up), args.reps)
    steps["gemm2_grouped_mm"] = timed(lambda: grouped.matmul(act, experts.down_proj, plan.groups), args.reps)
    x = residual.clone()
    steps["combine_torch"] = timed(
        lambda: moe_ops.combine_torch(x, down, plan.slots, plan.weights, None), args.reps
    )
    steps["combine_kernel"] = timed(
        lambda: moe_ops.combine_kernel(x, down, plan.slots, plan.weights, None), args.reps
    )
    try:
        from quack.gemm_interface import gemm, gemm_act

        def quack1(a_idx: torch.Tensor | None, tuned: bool, dynamic: bool = False) -> Callable[[], object]:
            source = hidden if a_idx is not None else gathered
            return lambda: gemm_act(
                source,
                weight1,
                activation="swiglu",
                cu_seqlens_m=plan.groups.offsets,
                A_idx=a_idx,
                store_preact=False,
                tuned=tuned,
                concat_layout=("B",),
                dynamic_scheduler=dynamic,
            )

        steps["gemm1_quack_gather_swiglu_dynamic"] = timed(quack1(plan.rows, False, True), args.reps)

        for tuned in (False, True) if args.tuned else (False,):
            tag = "tuned" if tuned else "heuristic"
            steps[f"gemm1_quack_gather_swiglu_{tag}"] = timed(quack1(plan.rows, tuned), args.reps)
            steps[f"gemm1_quack_swiglu_{tag}"] = timed(quack1(None, tuned), args.reps)
            steps["gemm2_quack_dynamic"] = timed(
                lambda: gemm(
                    act,
                    weight2,
                    out=down,
                    cu_seqlens_m=plan.groups.offsets,
                    tuned=False,
                    dynamic_scheduler=True,
                ),
                args.reps,
            )
            steps[f"gemm2_quack_{tag}"] = timed(
                lambda tuned=tuned: gemm(
                    act, weight2, out=down, cu_seqlens_m=plan.groups.offsets, tuned=tuned
                ),
                args.reps,
            )
    except Exception as exc:  # report what failed and go on with the rest
        results["quack_error"] = f"{type(exc).__name__}: {exc}"

    layers: dict[str, float] = {}
    outputs: dict[str, torch.Tensor] = {}
    for name in ("grouped_mm", "quack"):
        try:
            kernel = moe.choose(name, dev, dtype)
        except Exception as exc:
            results[f"{name}_error"] = f"{type(exc).__name__}: {exc}"
            continue
        layer = moe.SparseMoe(
            router,
            experts,
            rule,
            kernel,
            decoder_ops.swiglu_kernel,
            combine=moe_ops.combine_kernel,
            planner=moe.plan_kernel,
        )
        out = residual.clone()
        layer.add_to(out, hidden)
        outputs[name] = out
        x = residual.clone()
        layers[name] = timed(lambda layer=layer, x=x: layer.add_to(x, hidden), args.reps)
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
    base = residual.float()
    if "grouped_mm" in outputs and "quack" in outputs:
        a, b = outputs["grouped_mm"].float() - base, outputs["quack"].float() - base
        results["quack_vs_grouped_mm_max_abs_over_max"] = float((a - b).abs().max() / a.abs().max())
    results["device"] = torch.cuda.get_device_name()
    results["torch"] = torch.__version__
    text = json.dumps(results, indent=2)
    print(text)
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
