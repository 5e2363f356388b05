"""The mixture-of-experts benchmark: the fused MoE path against transformers' own experts, in one run.

    python -m benchmarks.moe                        # on an H200: every shape; results/moe-latest.json
    python -m benchmarks.moe --models qwen3-30b-a3b-8l mixtral-8l   # fits an H100
    python -m benchmarks.moe --models tiny-moe --device cpu --dtype float32 --sequences 4 --reps 1

Shapes (random bf16 weights built on the device; nothing downloaded): Qwen3-30B-A3B in full (48
layers, 61 GB of weights: an H200) and its first 8 layers, and a Mixtral-style 8-layer model (8
experts of 14336, top-2). Per shape, on the standard workload (workload.py, 64 sequences):

- transformers_eager / transformers_grouped_mm: the engine in-process with decoder=transformers, the
  model's experts run by transformers' `eager` (a loop over experts) and `grouped_mm` experts
  implementations (`default_experts_implementation` says which one transformers picks unasked);
- fused: the engine in-process with logprobd's fused decoder and MoE layer (moe.py);
- http: the same over HTTP, 8 connections of one client process (as benchmarks.run's `http`).

Each variant: every round's ms after a warm-up round, the median, its fraction of the floor and
the slowest round over the median. The floor is (2 · active non-embedding parameters · tokens +
2 · vocab · hidden · action tokens + causal attention over heads · head_dim) at the measured bf16
matmul rate. `ready_s`: the server's time from the weights built to /health/ready (the engine's
set-up, warm-up, shapes met and self-check). `max_abs_diff_vs_transformers`: the fused path's
log-probs against transformers' grouped_mm path's on a sample of sequences (both in the run's dtype).
The result's `clocks` (benchmarks/clocks.py) give the GPU's SM clock and power while the matmul rates
and each of the `http` and `fused` variants ran.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.clocks import window
from benchmarks.harness import (
    ACCURACY_SAMPLE,
    CACHE_IN_ROUNDS,
    RESULTS,
    active_params,
    max_abs_diff,
    packed_model,
    reference_logprobs,
    run_models,
    sync,
)
from benchmarks.server import HttpServer, http_bodies, http_rounds
from benchmarks.shapes import MOE_SHAPES, floor_shape
from benchmarks.workload import Sample, floor_flops, jobs, workload
from service.batcher import Batcher
from service.core.jobs import SequenceJob
from service.engine.config import EngineConfig
from service.engine.loading.pretrained import LoadedModel
from service.engine.scorer.engine import PackedScorer
from service.metrics import Metrics
from service.settings import Settings


def summary(rounds: list[float], tokens: int, floor_s: float, device: torch.device) -> dict[str, Any]:
    median = statistics.median(rounds)
    return {
        "ms": median * 1e3,
        "rounds_ms": [round(r * 1e3, 1) for r in rounds],
        "slowest_over_median": max(rounds) / median - 1.0,
        "tokens_per_s": tokens / median,
        "floor_fraction": floor_s / median,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0,
    }


def engine_rounds(
    engine: PackedScorer, settings: Settings, the_jobs: list[SequenceJob], reps: int, device: torch.device
) -> tuple[list[float], list[np.ndarray]]:
    """Seconds of each round of every job through the batcher in-process (after a warm-up round),
    and the log-probs of the first ACCURACY_SAMPLE jobs."""
    loop = asyncio.new_event_loop()
    batcher = Batcher.from_settings(engine, settings, Metrics())
    loop.run_until_complete(asyncio.sleep(0))
    loop.call_soon(batcher.start)
    sample = loop.run_until_complete(batcher.score(the_jobs[:ACCURACY_SAMPLE])).scores
    loop.run_until_complete(batcher.score(the_jobs))
    rounds = []
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        loop.run_until_complete(batcher.score(the_jobs))
        sync(device)
        rounds.append(time.perf_counter() - start)
    loop.run_until_complete(batcher.stop())
    loop.close()
    return rounds, [s.logprobs for s in sample]


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def experts_variants(
    loaded: LoadedModel, backend: Any, settings: Settings, the_jobs: list[SequenceJob], reps: int
) -> dict[str, tuple[list[float], list[np.ndarray]]]:
    """engine_rounds with transformers' decoder, per experts implementation it has (eager, grouped_mm);
    the model's own implementation is restored after."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    model, device = loaded.model, torch.device(settings.device)
    default = model.config._experts_implementation
    out = {}
    for implementation in [i for i in ("eager", "grouped_mm") if i == "eager" or i in ALL_EXPERTS_FUNCTIONS]:
        model.set_experts_implementation(implementation)
        engine = PackedScorer(loaded, device, backend, settings.engine_config())
        engine.warm_up()
        _release(device)
        out[implementation] = engine_rounds(engine, settings, the_jobs, reps, device)
        del engine
        _release(device)
    model.set_experts_implementation(default)
    return out


def float32_accuracy(
    model: Any, samples: list[Sample], scores: dict[str, list[np.ndarray]], device: torch.device
) -> dict[str, dict[str, float]] | None:
    """Each variant's largest and mean |Δ| over the sample's action tokens against the float32 forward
    (transformers' own, sdpa and `eager` experts, one sequence at a time); None where the float32
    copy does not fit. Leaves the model in float32: the last thing a run does with it."""
    params = sum(p.numel() for p in model.parameters())
    if device.type == "cuda" and params * 2 + 4 * 2**30 > torch.cuda.mem_get_info(device)[0]:
        return None
    _release(device)
    model.set_attn_implementation("sdpa")
    model.set_experts_implementation("eager")
    model.float()
    want = reference_logprobs(model, samples, device)
    flat = np.concatenate(want).astype(np.float64)
    return {
        variant: {
            "max": max_abs_diff(got, want),
            "mean": float(np.mean(np.abs(np.concatenate(got).astype(np.float64) - flat))),
        }
        for variant, got in scores.items()
    }


def expert_load(text: str) -> dict[str, float]:
    """The server's logprobd_moe_expert_load histogram over the HTTP rounds: observations, the mean
    share (1 by construction), and the shares of idle experts and of ones over 4x an even share."""
    found = {
        f"{s.name}{s.labels.get('le', '')}": s.value
        for family in text_string_to_metric_families(text)
        if family.name == "logprobd_moe_expert_load"
        for s in family.samples
    }
    count = found["logprobd_moe_expert_load_count"]
    return {
        "observations": count,
        "mean_share": found["logprobd_moe_expert_load_sum"] / count if count else float("nan"),
        "idle": found["logprobd_moe_expert_load_bucket0.0"] / count if count else float("nan"),
        "over_4x": 1 - found["logprobd_moe_expert_load_bucket4.0"] / count if count else float("nan"),
    }


def bench_model(name: str, args: argparse.Namespace, device: torch.device, rate: float) -> dict[str, Any]:
    shape = dict(MOE_SHAPES[name])
    if args.layers is not None:
        shape["num_hidden_layers"] = args.layers
    dtype = getattr(torch, args.dtype)
    backend, _, model = packed_model(shape, dtype, device, args.attention)
    loaded = time.perf_counter()  # the weights are in place: a server's start counts from here
    default = str(model.config._experts_implementation)
    samples: list[Sample] = workload(int(shape["vocab_size"]), sequences=args.sequences)
    the_jobs = jobs(samples)
    tokens = sum(len(s.tokens) for s in samples)
    active = active_params(model)
    floor_s = floor_flops(floor_shape(shape), active, samples) / rate
    common = {"device": device.type, "dtype": args.dtype, "max_batch_tokens": args.max_batch_tokens}
    variants: dict[str, dict[str, Any]] = {}
    scores: dict[str, list[np.ndarray]] = {}

    def report(variant: str, rounds: list[float]) -> None:
        variants[variant] = summary(rounds, tokens, floor_s, device)
        v = variants[variant]
        print(
            f"  {name} {variant:>24}: {v['ms']:9.1f} ms  {v['floor_fraction']:6.1%} of floor  "
            f"slowest round +{v['slowest_over_median']:.1%}",
            flush=True,
        )

    # the service's fused path first: its start is timed from the weights built
    settings = Settings(
        **common,
        decoder="fused",
        kernels=args.kernels,
        cuda_graphs=args.cuda_graphs,
        moe_kernel=args.moe_kernel,
        prefix_cache=CACHE_IN_ROUNDS,
    )
    built: list[PackedScorer] = []

    def factory(_: EngineConfig) -> PackedScorer:
        built.append(
            PackedScorer(LoadedModel(model, name, demo=False), device, backend, settings.engine_config())
        )
        return built[0]

    _release(device)
    server = HttpServer(factory, settings)
    with server as url:
        ready_s = server.ready_at - loaded
        engine = built[0]
        print(
            f"  {name}: ready {ready_s:.1f} s after the weights; moe_kernel {engine.info.moe_kernel}",
            flush=True,
        )
        with window(f"{name}/http"):
            report("http", http_rounds(url, http_bodies(samples), args.reps))
        load = expert_load(httpx.get(f"{url}/metrics", timeout=30).text)
        print(f"  {name}: expert load {load}", flush=True)
    _release(device)
    with window(f"{name}/fused"):
        rounds, scores["fused"] = engine_rounds(engine, settings, the_jobs, args.reps, device)
    report("fused", rounds)
    info = engine.info
    del engine, built[:]
    _release(device)

    peers: dict[str, Any] = {"speedup_vs_transformers": None, "max_abs_diff_vs_transformers": None}
    if args.peers:
        plain = Settings(**common, decoder="transformers", kernels="none", cuda_graphs="off")
        for implementation, (rounds, scores[implementation]) in experts_variants(
            LoadedModel(model, name, demo=False), backend, plain, the_jobs, args.reps
        ).items():
            report(f"transformers_{implementation}", rounds)
        against = scores.get("grouped_mm", scores["eager"])
        peers["max_abs_diff_vs_transformers"] = max(
            float(np.max(np.abs(g.astype(np.float64) - w)))
            for g, w in zip(scores["fused"], against, strict=True)
        )
        best = min((v for k, v in variants.items() if k.startswith("transformers")), key=lambda v: v["ms"])
        peers["speedup_vs_transformers"] = best["ms"] / variants["http"]["ms"]
    peers["max_abs_diff_vs_float32"] = float32_accuracy(model, samples[:ACCURACY_SAMPLE], scores, device)
    return {
        "shape": shape,
        "active_non_embedding_params": active,
        "parameters": sum(p.numel() for p in model.parameters()),
        "attention": info.attention_backend,
        "kernels": info.kernels,
        "moe_kernel": info.moe_kernel,
        "max_batch_tokens": info.max_batch_tokens,
        "default_experts_implementation": default,
        "tokens": tokens,
        "action_tokens": sum(len(s.response) for s in samples),
        "floor_ms": floor_s * 1e3,
        "ready_s": ready_s,
        "expert_load": load,
        "variants": variants,
        **peers,
    }


def _number(value: float | None, spec: str) -> str:
    return "not run" if value is None else format(value, spec)


def _float32(result: dict[str, Any]) -> str:
    diffs = result.get("max_abs_diff_vs_float32")
    if not diffs:
        return "not run"
    peer = diffs.get("grouped_mm", diffs.get("eager"))
    if peer is None:
        return f"{diffs['fused']['max']:.3g} / not run"
    fused = diffs["fused"]
    return f"{fused['max']:.3g} / {peer['max']:.3g} (mean {fused['mean']:.3g} / {peer['mean']:.3g})"


def table(results: dict[str, Any]) -> str:
    lines = [
        "| model | variant | ms | tokens/s | floor | slowest round vs median | peak GiB |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, r in results["models"].items():
        for variant, v in r["variants"].items():
            lines.append(
                f"| {name} | {variant} | {v['ms']:.1f} | {v['tokens_per_s']:,.0f} | "
                f"{v['floor_fraction']:.1%} | +{v['slowest_over_median']:.1%} | {v['peak_memory_gib']:.1f} |"
            )
    lines += [
        "",
        "| model | floor ms | HTTP floor | speed-up vs transformers' best | ready s | moe_kernel | kernels | "
        "max abs Δ vs transformers | |Δ| vs float32, max (mean): fused / transformers |",
        "| --- | ---: | ---: | ---: | ---: | --- | --- | ---: | ---: |",
    ]
    for name, r in results["models"].items():
        lines.append(
            f"| {name} | {r['floor_ms']:.1f} | {r['variants']['http']['floor_fraction']:.1%} | "
            f"{_number(r['speedup_vs_transformers'], '.2f')} | {r['ready_s']:.1f} | {r['moe_kernel']} | "
            f"{r['kernels']} | {_number(r['max_abs_diff_vs_transformers'], '.3g')} | {_float32(r)} |"
        )
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    """The command line (tests/benchmarks/test_page.py parses each cited command with it)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.moe", description=__doc__)
    parser.add_argument("--models", nargs="+", default=["qwen3-30b-a3b-8l", "mixtral-8l", "qwen3-30b-a3b"])
    parser.add_argument("--layers", type=int, help="every model cut to this many layers")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--attention", default="auto")
    parser.add_argument("--kernels", default="auto", choices=["auto", "none"])
    parser.add_argument("--cuda-graphs", default="auto", choices=["auto", "on", "off"])
    parser.add_argument("--moe-kernel", default="auto", choices=["auto", "quack", "grouped_mm", "loop"])
    parser.add_argument(
        "--no-peers", dest="peers", action="store_false", help="skip transformers' experts implementations"
    )
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--max-batch-tokens", type=int, help="unset: the service's default")
    parser.add_argument("--output", type=Path, default=RESULTS / "moe-latest.json")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    results = run_models("moe", args, argv, bench_model)
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
