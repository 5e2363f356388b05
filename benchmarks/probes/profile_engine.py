"""Where device time goes in one round: a kernel-level torch.profiler trace of the engine, per variant.

    python -m benchmarks.probes.profile_engine --model qwen2.5-7b --workload grpo-short \\
        --variants plain invariant
    python -m benchmarks.probes.profile_engine --model qwen3-30b-a3b-8l --workload standard \\
        --variants plain record replay
    python -m benchmarks.probes.profile_engine --model qwen2.5-7b --workload grpo-short \\
        --variants plain top100
    python -m benchmarks.probes.profile_engine --model qwen2.5-7b --workload teacher \\
        --max-batch-tokens 4096 --variants plain top100             # TRL's teacher call's compute
    python -m benchmarks.probes.profile_engine --model tiny --device cpu --dtype float32 --scale 0.05 \\
        --share-min-tokens 4 --variants plain invariant top100        # CPU smoke test (tests/benchmarks)

In this process, no HTTP: the model with random weights and the real shape (benchmarks/harness.py's
build_model, dense or MoE), one PackedScorer with the server's default
settings (prefix sharing on; decoder `fused` for an MoE shape, as benchmarks/replay.py) under the
server's Batcher, and one round of the workload sent as the 8 clients send it (benchmarks/invariance.py's
`requests`: a GRPO group, or an eighth of the sequences, per request, all at once). Per variant: a
warm-up round (CUDA graphs, Triton compiles) once the engine's idle-time CUDA graphs are captured (as
the served benchmarks wait for them), then --rounds rounds under torch.profiler (CPU and CUDA
activities).

Variants, run one after the other on the same weights (the engine is rebuilt only where its
configuration differs, for `invariant`):

- plain: the jobs as benchmarks/workload.py's jobs() makes them;
- invariant: the same on an engine built with batch_invariant on (--batch-invariant);
- record: every job asks its routes back (return_routed_experts; an MoE shape only);
- replay: every job gives the routes a first, unprofiled record pass returned, from position 0 (what
  benchmarks/replay.py sends back as routed_experts; an MoE shape only); `route_exact_fraction` in
  the output must be 1.0;
- top100: every job asks top_logprobs 100 at each action (benchmarks/distribution.py's variant).

Printed per variant: the wall ms of the profiled rounds (and of as many rounds just before, without
the profiler: recording every thread's CPU operators slows the host's launches, so gaps under the
profiler are an upper bound; --no-cpu-ops records CUDA activity only), the total device time of the
kernels (and memcpy/memset), the top --top kernels by total device time (calls, total ms, share of
the variant's kernel time) and the device's idle gaps (the sum of gaps over 20 us between
consecutive kernels, counted on the union of every stream's activity: host-bound launching shows
there); then, from the first variant to each other one, the kernels whose total device time grew the
most. On a CPU there are no kernels: the same tables list CPU operators by self time, and no gaps.
Everything goes to --output (JSON); --trace DIR also writes each variant's Chrome trace there.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any, get_args

import torch
from torch._C._profiler import _ExperimentalConfig
from torch.autograd import DeviceType  # type: ignore[attr-defined]
from torch.profiler import ProfilerActivity, profile

from benchmarks.harness import CACHE_IN_ROUNDS, RESULTS, packed_model, provenance, sync, write_result
from benchmarks.invariance import WORKLOADS as SHARED_WORKLOADS
from benchmarks.invariance import requests
from benchmarks.shapes import MOE_SHAPES, SHAPES, shape_of
from benchmarks.workload import Sample, jobs, teacher
from service.batcher import Batcher
from service.core.jobs import GivenRoutes, RouteAgreement, Sampling, SequenceJob, SequenceScores
from service.engine.loading.pretrained import LoadedModel
from service.engine.scorer.engine import PackedScorer
from service.metrics import Metrics
from service.settings import CudaGraphs, Settings

# benchmarks.invariance's, and TRL's teacher call: 8 prompts of 4,096 tokens, every position after
# the first an action (with --variants top100, what prompt_logprobs 100 asks; --max-batch-tokens 4096
# cuts it a prompt per micro-batch, as the streamed completions answer does)
WORKLOADS: dict[str, Callable[[int, float, int], list[Sample]]] = {
    **SHARED_WORKLOADS,
    "teacher": lambda vocab, scale, _: teacher(vocab, scale),
}
VARIANTS = ("plain", "invariant", "record", "replay", "top100", "processed")
MOE_ONLY = {"record", "replay"}
TOP_K = 100
GAP_US = 20.0  # a device gap longer than this between consecutive kernels counts as idle
NAME_WIDTH = 70


@dataclasses.dataclass(frozen=True, slots=True)
class Interval:
    """One device activity (kernel, memcpy, memset) on the profiler's clock, in microseconds."""

    start: float
    end: float


def kernel_table(prof: Any, on_device: bool) -> tuple[dict[str, dict[str, float]], list[Interval]]:
    """Per name: calls and total microseconds; and every device activity's interval. On a device:
    its kernels' own durations; on a CPU: each operator's self time (nested ones are not counted twice)."""
    table: dict[str, dict[str, float]] = defaultdict(lambda: {"calls": 0.0, "us": 0.0})
    intervals: list[Interval] = []
    if on_device:
        for event in prof.events():
            if event.device_type != DeviceType.CUDA:
                continue
            start, end = float(event.time_range.start), float(event.time_range.end)
            table[event.name]["calls"] += 1
            table[event.name]["us"] += end - start
            intervals.append(Interval(start, end))
    else:
        for avg in prof.key_averages():
            if avg.device_type == DeviceType.CPU and avg.self_cpu_time_total > 0:
                table[avg.key]["calls"] += avg.count
                table[avg.key]["us"] += float(avg.self_cpu_time_total)
    return dict(table), intervals


def idle_gaps(intervals: list[Interval], threshold_us: float = GAP_US) -> tuple[float, int]:
    """The device's idle microseconds between its first activity and its last, summed over the gaps
    longer than `threshold_us` (activities on several streams merged: a gap is time none runs), and
    how many such gaps."""
    total, count, busy_until = 0.0, 0, None
    for interval in sorted(intervals, key=lambda i: i.start):
        if busy_until is not None and interval.start - busy_until > threshold_us:
            total += interval.start - busy_until
            count += 1
        busy_until = interval.end if busy_until is None else max(busy_until, interval.end)
    return total, count


def top_rows(table: dict[str, dict[str, float]], n: int) -> list[dict[str, Any]]:
    total = sum(v["us"] for v in table.values()) or 1.0
    ranked = sorted(table.items(), key=lambda kv: -kv[1]["us"])[:n]
    return [
        {
            "name": name[:NAME_WIDTH],
            "calls": int(v["calls"]),
            "total_ms": v["us"] / 1e3,
            "share": v["us"] / total,
        }
        for name, v in ranked
    ]


def grown(
    base: dict[str, dict[str, float]], other: dict[str, dict[str, float]], n: int
) -> list[dict[str, Any]]:
    """The `n` names whose total time grew the most from `base` to `other` (absent: 0)."""
    empty = {"calls": 0.0, "us": 0.0}
    rows = []
    for name in set(base) | set(other):
        was, now = base.get(name, empty), other.get(name, empty)
        rows.append(
            {
                "name": name[:NAME_WIDTH],
                "base_ms": was["us"] / 1e3,
                "ms": now["us"] / 1e3,
                "delta_ms": (now["us"] - was["us"]) / 1e3,
                "base_calls": int(was["calls"]),
                "calls": int(now["calls"]),
            }
        )
    return sorted(rows, key=lambda r: float(str(r["delta_ms"])), reverse=True)[:n]


class Session:
    """One engine and its server-default batcher on an event loop of this thread."""

    def __init__(self, engine: PackedScorer, settings: Settings) -> None:
        self.engine = engine
        self.loop = asyncio.new_event_loop()
        self.batcher = Batcher.from_settings(engine, settings, Metrics())
        self.loop.run_until_complete(asyncio.sleep(0))
        self.loop.call_soon(self.batcher.start)

    def settle(self, timeout: float = 600.0) -> None:
        """Runs the loop until the engine's idle-time CUDA graphs are captured (its batcher captures
        them while nothing runs), as a served engine's benchmarks wait for them (benchmarks/server.py)."""
        started = time.perf_counter()
        while (pending := self.engine.pending_graphs) > 0:
            if time.perf_counter() - started > timeout:
                raise TimeoutError(f"{pending} CUDA graphs still queued after {timeout:.0f} s")
            self.loop.run_until_complete(asyncio.sleep(0.05))
        if (seconds := time.perf_counter() - started) > 0.1:
            print(f"  idle-time CUDA graphs captured in {seconds:.1f} s", file=sys.stderr, flush=True)

    def round(self, batch: list[SequenceJob]) -> list[SequenceScores]:
        """One round: the 8 clients' requests at once; every job's scores, in order."""

        async def go() -> list[SequenceScores]:
            answers = await asyncio.gather(*(self.batcher.score(r) for r in requests(batch)))
            return [s for a in answers for s in a.scores]

        return self.loop.run_until_complete(go())

    def close(self) -> None:
        self.loop.run_until_complete(self.batcher.stop())
        self.loop.close()


def variant_jobs(variant: str, base: list[SequenceJob], session: Session) -> list[SequenceJob]:
    """The round's jobs for `variant` (replay: runs an unprofiled record round for the routes)."""
    if variant in ("plain", "invariant"):
        return base
    if variant == "record":
        return [dataclasses.replace(j, return_routes=True) for j in base]
    if variant == "top100":
        return [dataclasses.replace(j, top_logprobs=TOP_K) for j in base]
    if variant == "processed":  # benchmarks.distribution's sampler
        return [dataclasses.replace(j, sampling=Sampling(top_k=50, top_p=0.9, min_p=0.05)) for j in base]
    assert variant == "replay"
    recorded = session.round([dataclasses.replace(j, return_routes=True) for j in base])
    out = []
    for job, scores in zip(base, recorded, strict=True):
        assert scores.routes is not None
        assert scores.routes.shape[0] == job.num_tokens
        out.append(dataclasses.replace(job, routes=GivenRoutes(start=0, experts=scores.routes)))
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class Profiled:
    """One variant's rounds: the warm-up round's scores, the wall ms of `rounds` rounds without and
    with the profiler, and the profile."""

    scores: list[SequenceScores]
    plain_ms: float
    profiled_ms: float
    prof: Any


def profile_variant(
    session: Session,
    batch: list[SequenceJob],
    device: torch.device,
    rounds: int,
    *,
    cpu_ops: bool,
    trace: Path | None,
) -> Profiled:
    """A warm-up round, `rounds` rounds timed without the profiler, then `rounds` rounds under it
    (CPU operators of every thread unless `cpu_ops` is off on a device; CUDA activity on a device)."""

    def timed() -> float:
        sync(device)
        start = time.perf_counter()
        for _ in range(rounds):
            session.round(batch)
        sync(device)
        return (time.perf_counter() - start) * 1e3

    scores = session.round(batch)
    plain_ms = timed()
    on_device = device.type == "cuda"
    activities = [ProfilerActivity.CPU] if cpu_ops or not on_device else []
    activities += [ProfilerActivity.CUDA] if on_device else []
    # every thread: the batcher launches the engine's work from its own thread
    config = _ExperimentalConfig(profile_all_threads=True)
    with profile(activities=activities, experimental_config=config) as prof:
        profiled_ms = timed()
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    return Profiled(scores, plain_ms, profiled_ms, prof)


def settings_for(args: argparse.Namespace, invariant: bool) -> Settings:
    return Settings(
        device=args.device,
        dtype=args.dtype,
        batch_invariant=invariant,
        decoder="fused" if args.model in MOE_SHAPES else "auto",
        cuda_graphs=args.cuda_graphs,
        share_min_tokens=args.share_min_tokens,
        share_prefixes=True,
        max_batch_tokens=args.max_batch_tokens,
        logits_chunk_rows=args.logits_chunk_rows,
        prefix_cache=CACHE_IN_ROUNDS,
    )


def run(args: argparse.Namespace, argv: list[str] | None) -> dict[str, Any]:
    device = torch.device(args.device)
    if MOE_ONLY & set(args.variants) and args.model not in MOE_SHAPES:
        raise SystemExit(
            f"--variants {sorted(MOE_ONLY & set(args.variants))} need an MoE model: {list(MOE_SHAPES)}"
        )
    shape = shape_of(args.model)
    backend, _, model = packed_model(shape, getattr(torch, args.dtype), device)
    samples = WORKLOADS[args.workload](int(shape["vocab_size"]), args.scale, args.sequences)
    base = jobs(samples)
    on_device = device.type == "cuda"
    result: dict[str, Any] = {
        **provenance("probes.profile_engine", device, argv),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "measure": "CUDA kernels (device time)" if on_device else "CPU operators (self time)",
        "sequences": len(samples),
        "tokens": sum(len(s.tokens) for s in samples),
        "variants": {},
        "grown": {},
    }
    tables: dict[str, dict[str, dict[str, float]]] = {}
    session: Session | None = None
    invariant_now: bool | None = None
    for variant in args.variants:
        invariant = variant == "invariant"
        if session is None or invariant != invariant_now:  # an engine of this configuration
            if session is not None:
                session.close()
                session = None
                gc.collect()
                if on_device:
                    torch.cuda.empty_cache()
            settings = settings_for(args, invariant)
            loaded = LoadedModel(model, args.model, demo=False)
            engine = PackedScorer(loaded, device, backend, settings.engine_config())
            engine.warm_up()
            session, invariant_now = Session(engine, settings), invariant
            session.settle()
        batch = variant_jobs(variant, base, session)
        trace = args.trace / f"{variant}.json" if args.trace else None
        if trace is not None:
            trace.parent.mkdir(parents=True, exist_ok=True)
        profiled = profile_variant(session, batch, device, args.rounds, cpu_ops=args.cpu_ops, trace=trace)
        table, intervals = kernel_table(profiled.prof, on_device)
        tables[variant] = table
        gap_us, gaps = idle_gaps(intervals)
        info = session.engine.info
        result["variants"][variant] = {
            "wall_ms": profiled.profiled_ms,
            "wall_ms_unprofiled": profiled.plain_ms,
            "rounds": args.rounds,
            "kernel_ms": sum(v["us"] for v in table.values()) / 1e3,
            "kernels": len(intervals) if on_device else None,
            "idle_gap_ms": gap_us / 1e3 if on_device else None,
            "idle_gaps": gaps if on_device else None,
            "device_span_ms": (max(i.end for i in intervals) - min(i.start for i in intervals)) / 1e3
            if intervals
            else None,
            "engine": {
                "attention": info.attention_backend,
                "decoder": info.decoder,
                "kernels": info.kernels,
                "moe_kernel": info.moe_kernel,
            },
            "top": top_rows(table, args.top),
        }
        if variant == "replay":  # the given routes were used: the live router agrees everywhere
            agreement = RouteAgreement.join([s.route_agreement for s in profiled.scores if s.route_agreement])
            result["variants"][variant]["route_exact_fraction"] = agreement.exact / max(1, agreement.compared)
        print(variant_text(variant, result["variants"][variant], result["measure"]), flush=True)
    if session is not None:
        session.close()
    first = args.variants[0]
    for variant in args.variants[1:]:
        result["grown"][variant] = grown(tables[first], tables[variant], args.top)
        print(grown_text(first, variant, result["grown"][variant]), flush=True)
    return result


def variant_text(variant: str, v: dict[str, Any], measure: str) -> str:
    lines = [
        f"== {variant}: wall {v['wall_ms']:.1f} ms ({v['rounds']} round(s); "
        f"{v['wall_ms_unprofiled']:.1f} ms unprofiled), "
        f"{measure} {v['kernel_ms']:.1f} ms"
        + (
            f", device span {v['device_span_ms']:.1f} ms, idle gaps > {GAP_US:g} us: "
            f"{v['idle_gap_ms']:.2f} ms in {v['idle_gaps']}"
            if v["idle_gap_ms"] is not None
            else ""
        ),
        f"   engine {v['engine']}",
        f"   {'name':{NAME_WIDTH}s} {'calls':>7s} {'total ms':>10s} {'share':>7s}",
    ]
    for row in v["top"]:
        lines.append(
            f"   {row['name']:{NAME_WIDTH}s} {row['calls']:7d} {row['total_ms']:10.3f} {row['share']:7.1%}"
        )
    return "\n".join(lines)


def grown_text(first: str, variant: str, rows: list[dict[str, Any]]) -> str:
    lines = [
        f"== grown from {first} to {variant}",
        f"   {'name':{NAME_WIDTH}s} {first + ' ms':>12s} {variant + ' ms':>12s} {'delta ms':>10s} "
        f"{'calls':>13s}",
    ]
    for r in rows:
        lines.append(
            f"   {r['name']:{NAME_WIDTH}s} {r['base_ms']:12.3f} {r['ms']:12.3f} {r['delta_ms']:+10.3f} "
            f"{r['base_calls']:6d}>{r['calls']:<6d}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.probes.profile_engine", description=__doc__)
    parser.add_argument("--model", default="qwen2.5-7b", choices=[*SHAPES, *MOE_SHAPES])
    parser.add_argument("--workload", default="grpo-short", choices=list(WORKLOADS))
    parser.add_argument("--variants", nargs="+", default=["plain", "invariant"], choices=VARIANTS)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--cuda-graphs", default="auto", choices=get_args(CudaGraphs))
    parser.add_argument("--share-min-tokens", type=int, default=Settings().share_min_tokens)
    parser.add_argument("--max-batch-tokens", type=int, help="unset: the service's default")
    parser.add_argument("--logits-chunk-rows", type=int, default=Settings().logits_chunk_rows)
    parser.add_argument("--sequences", type=int, default=64, help="the standard workload's")
    parser.add_argument("--scale", type=float, default=1.0, help="every length x this (a CPU smoke test)")
    parser.add_argument("--rounds", type=int, default=1, help="profiled rounds per variant")
    parser.add_argument(
        "--cpu-ops",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="on a device, also record CPU operators (--no-cpu-ops: less host overhead, truer gaps)",
    )
    parser.add_argument("--top", type=int, default=15, help="rows of each table")
    parser.add_argument("--trace", type=Path, default=None, help="write each variant's Chrome trace here")
    parser.add_argument("--output", type=Path, default=RESULTS / "profile-latest.json")
    args = parser.parse_args(argv)
    if len(set(args.variants)) != len(args.variants):
        parser.error("--variants: each at most once")
    write_result(args.output, run(args, argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
