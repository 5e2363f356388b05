"""Where routing replay's cost over live routing goes, per micro-batch: the engine in-process, no HTTP.

    python -m benchmarks.replay_profile --layers 8 --out results/replay-profile     # an H100
    python -m benchmarks.replay_profile --model tiny-moe --device cpu --dtype float32 --sequences 4

One engine (benchmarks/moe.py's SHAPES, random weights; `--layers` keeps the first N), the standard
workload (workload.py) cut into micro-batches of whole sequences in order, each at most
`--max-batch-tokens` (the batcher's budget). The routes come from one recording pass; then the same
micro-batches run as:

- live: plain jobs;
- record (R2): `return_routes` on every job;
- replay (R3): every job's recorded routes given (what benchmarks/replay.py sends), agreement counted.

Per variant, after a warm-up pass (which captures the mode's CUDA graphs): the median pass over
`--reps` (wall ms, every micro-batch launched then its scores read, as the batcher's launch and
collect), the host time of the launch path (engine.launch: packing, copies, the graph replay and the
eager last layer and heads, summed over the micro-batches), and one pass under torch.profiler: the
device's busy time (the union of its kernels, copies and memsets), the top kernels by device time and
the largest gaps where the device waited (with the kernels on either side). The Chrome traces go to
`--out` (`<variant>.json`), the figures to `--out/summary.json`. On CPU (the smoke test) the same code
runs, with the profiler's CPU operators in place of kernels.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.moe import SHAPES, build_model
from benchmarks.run import sync
from benchmarks.workload import jobs as workload_jobs
from benchmarks.workload import workload
from service.engine.loading.models import LoadedModel
from service.engine.ops.attention import choose_backend, register
from service.engine.scorer.engine import PackedScorer
from service.jobs import GivenRoutes, SequenceJob
from service.settings import Settings

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


@dataclass(frozen=True, slots=True)
class Interval:
    name: str
    start: float  # µs on the trace's clock
    end: float


def micro_batches(jobs: Sequence[SequenceJob], budget: int) -> list[list[SequenceJob]]:
    """Whole sequences in order, each micro-batch at most `budget` tokens (at least one sequence)."""
    out: list[list[SequenceJob]] = [[]]
    tokens = 0
    for job in jobs:
        if out[-1] and tokens + job.num_tokens > budget:
            out.append([])
            tokens = 0
        out[-1].append(job)
        tokens += job.num_tokens
    return out


def one_pass(
    engine: PackedScorer, batches: list[list[SequenceJob]], device: torch.device
) -> tuple[float, float]:
    """(wall seconds, host seconds in engine.launch) of every micro-batch launched, then read."""
    sync(device)
    start = time.perf_counter()
    launching = 0.0
    flights = []
    for batch in batches:
        t = time.perf_counter()
        flights.append(engine.launch(batch))
        launching += time.perf_counter() - t
    for flight in flights:
        flight.result()
    sync(device)
    return time.perf_counter() - start, launching


def device_intervals(trace: dict[str, Any], on_device: bool) -> list[Interval]:
    """The trace's device events (kernels, copies, memsets), or on CPU its top-level operators."""
    events = trace.get("traceEvents", [])
    if on_device:
        chosen = [e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES]
    else:
        chosen = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    spans = [
        Interval(str(e["name"]), float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in chosen
    ]
    return sorted(spans, key=lambda s: s.start)


def busy_and_gaps(spans: list[Interval], count: int) -> tuple[float, list[dict[str, Any]]]:
    """The union of `spans` in ms, and its `count` largest gaps (ms, the span before, the span after)."""
    busy = 0.0
    gaps: list[dict[str, Any]] = []
    end: float | None = None
    before = ""
    for span in spans:
        if end is None or span.start > end:
            if end is not None:
                gaps.append({"ms": (span.start - end) / 1e3, "after": before, "before": span.name})
            busy += span.end - span.start
            end = span.end
        elif span.end > end:
            busy += span.end - end
            end = span.end
        if end == span.end:
            before = span.name
    gaps.sort(key=lambda g: -float(g["ms"]))
    return busy / 1e3, gaps[:count]


def top_kernels(spans: list[Interval], count: int) -> list[dict[str, Any]]:
    """The `count` names with the most time (ms, calls), summed over their spans."""
    totals: dict[str, list[float]] = {}
    for span in spans:
        entry = totals.setdefault(span.name, [0.0, 0])
        entry[0] += span.end - span.start
        entry[1] += 1
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])[:count]
    return [{"name": name, "ms": ms / 1e3, "calls": int(calls)} for name, (ms, calls) in ranked]


def profiled(
    engine: PackedScorer, batches: list[list[SequenceJob]], device: torch.device, path: Path, count: int
) -> dict[str, Any]:
    """One pass under torch.profiler (CUDA activity on a GPU): the trace at `path`, its figures."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        one_pass(engine, batches, device)
    prof.export_chrome_trace(str(path))
    trace = json.loads(path.read_text())
    spans = device_intervals(trace, device.type == "cuda")
    busy, gaps = busy_and_gaps(spans, count)
    return {"device_busy_ms": busy, "top_kernels": top_kernels(spans, count), "largest_gaps": gaps}


def variants(engine: PackedScorer, batches: list[list[SequenceJob]]) -> dict[str, list[list[SequenceJob]]]:
    """live, record and replay over the same micro-batches; replay gives the routes a record pass took."""
    recorded = [
        engine.launch([replace(job, return_routes=True) for job in batch]).result() for batch in batches
    ]
    replayed = []
    for batch, scores in zip(batches, recorded, strict=True):
        given = []
        for job, score in zip(batch, scores, strict=True):
            assert score.routes is not None
            given.append(replace(job, routes=GivenRoutes(0, np.ascontiguousarray(score.routes))))
        replayed.append(given)
    return {
        "live": batches,
        "record": [[replace(job, return_routes=True) for job in batch] for batch in batches],
        "replay": replayed,
    }


def min_agreement(engine: PackedScorer, batches: list[list[SequenceJob]]) -> float:
    """The lowest exact route agreement of a replayed sequence (1.0 where the recorded routes are the
    live router's choice again: float32 on the CPU; bf16 near ties make it a little less)."""
    fractions = []
    for batch in batches:
        for score in engine.launch(batch).result():
            assert score.route_agreement is not None
            fractions.append(score.route_agreement.exact / max(score.route_agreement.compared, 1))
    return min(fractions)


def graph_state(engine: PackedScorer) -> dict[str, Any]:
    """Whether the policy's CUDA graphs run, and for which routed modes they are off (and why)."""
    forward = engine.served.policy.forward
    return {
        "decoder": type(forward).__name__,
        "graphs_off": getattr(forward, "disabled", None),
        "modes_off": dict(getattr(forward, "modes_off", {})),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    shape = dict(SHAPES[args.model])
    if args.layers is not None:
        shape["num_hidden_layers"] = min(args.layers, int(shape["num_hidden_layers"]))
    backend = choose_backend(args.attention, device)
    model = build_model(shape, getattr(torch, args.dtype), device, register(backend))
    settings = Settings(
        device=device.type,
        dtype=args.dtype,
        cuda_graphs=args.cuda_graphs,
        decoder="fused",
        max_batch_tokens=args.max_batch_tokens,
    )
    engine = PackedScorer(
        LoadedModel(model, args.model, demo=False), device, backend, settings.engine_config()
    )
    engine.warm_up()
    samples = workload(int(shape["vocab_size"]), sequences=args.sequences)
    batches = micro_batches(workload_jobs(samples), args.max_batch_tokens)
    args.out.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {
        "model": args.model,
        "layers": int(shape["num_hidden_layers"]),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
        "micro_batches": [sum(job.num_tokens for job in batch) for batch in batches],
        "variants": {},
    }
    jobs_of = variants(engine, batches)
    for name, jobs in jobs_of.items():
        one_pass(engine, jobs, device)  # warm-up: the mode's graphs captured
        passes = [one_pass(engine, jobs, device) for _ in range(args.reps)]
        wall = statistics.median(p[0] for p in passes) * 1e3
        launch = statistics.median(p[1] for p in passes) * 1e3
        figures = profiled(engine, jobs, device, args.out / f"{name}.json", args.top)
        out["variants"][name] = {"wall_ms": wall, "launch_host_ms": launch, **figures}
    out["graphs"] = graph_state(engine)
    out["replay_exact_agreement_min"] = min_agreement(engine, jobs_of["replay"])
    live = out["variants"]["live"]
    for figures in out["variants"].values():
        figures["wall_over_live"] = figures["wall_ms"] / live["wall_ms"] - 1
        figures["busy_over_live"] = figures["device_busy_ms"] / max(live["device_busy_ms"], 1e-9) - 1
    (args.out / "summary.json").write_text(json.dumps(out, indent=1))
    return out


def report(out: dict[str, Any], echo: Callable[[str], None] = print) -> None:
    echo(
        f"{out['model']}, {out['layers']} layers, {out['device']}; micro-batches of "
        f"{out['micro_batches']} tokens"
    )
    echo(f"graphs: {out['graphs']}; lowest exact agreement replayed {out['replay_exact_agreement_min']:.4f}")
    for name, v in out["variants"].items():
        echo(
            f"\n== {name}: pass {v['wall_ms']:.1f} ms ({v['wall_over_live']:+.1%}), device busy "
            f"{v['device_busy_ms']:.1f} ms ({v['busy_over_live']:+.1%}), launch path on the host "
            f"{v['launch_host_ms']:.1f} ms"
        )
        echo("  top by device time:")
        for k in v["top_kernels"]:
            echo(f"    {k['ms']:9.3f} ms {k['calls']:6d}x  {k['name'][:110]}")
        echo("  largest gaps (device idle):")
        for g in v["largest_gaps"]:
            echo(f"    {g['ms']:9.3f} ms  after {g['after'][:50]!r}  before {g['before'][:50]!r}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.replay_profile", description=__doc__)
    parser.add_argument("--model", default="qwen3-30b-a3b", choices=list(SHAPES))
    parser.add_argument("--layers", type=int, default=None, help="keep the first N layers (default: all)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--attention", default="auto")
    parser.add_argument("--cuda-graphs", default="auto")
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--max-batch-tokens", type=int, default=16384)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "replay-profile")
    args = parser.parse_args(argv)
    report(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
