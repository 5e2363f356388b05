"""The scoring benchmark: the service against the naive and TRL-style peers, in one run.

    python -m benchmarks.run                      # on a GPU host: 0.5B, 1.5B, 7B; writes results/latest.json
    python -m benchmarks.run --models tiny --device cpu --sequences 8   # CPU smoke test

Per model (random bf16 weights with the real shapes) and per variant: milliseconds (median of
--reps after a warm-up), tokens/s, fraction of the FLOP floor, peak GPU memory; plus the largest
|Δ| of the service's scores against a float32 reference on a sample of sequences. Over HTTP the 8
clients are 8 connections of one client process sending compact frames, as logprobd's AsyncClient
does (`http`, the figure the targets use); beside it the same in JSON (`http_json`), on httpx's
default transport instead of logprobd's (`http_httpcore`), from 8 client processes with one
framed request each (`http_8proc`), and as a trainer writes it without logprobd's client: a default
httpx.AsyncClient, `json=` and `response.json()` (`http_plain`), and the same from 8 client processes,
each a default httpx.Client posting its own body (`http_plain_8proc`, as 8 trainer ranks); see
client.py.

`load`: continuous load after those rounds: --load-tasks client tasks (--load-processes processes)
send requests of the standard workload's per-client size (8 sequences each, from a pool of
--load-bodies bodies) at the instants of a Poisson process, for --load-seconds; the offered rate is
--load-fraction x the `http` variant's tokens/s (or --load-rate requests/s). It reports the offered
and achieved requests/s and tokens/s and the p50/p99 latency from each request's scheduled instant.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, get_args

import torch

from benchmarks import peers
from benchmarks.client import write_bodies
from benchmarks.harness import (
    ACCURACY_SAMPLE,
    CACHE_IN_ROUNDS,
    RESULTS,
    active_params,
    max_abs_diff,
    packed_model,
    peak_memory,
    reference_logprobs,
    run_models,
    timed,
)
from benchmarks.server import HttpServer, http_bodies, http_rounds, http_seconds
from benchmarks.shapes import SHAPES
from benchmarks.workload import Sample, floor_flops, jobs, workload
from service.batcher import Batcher
from service.core.jobs import SequenceScores
from service.engine.loading.pretrained import LoadedModel
from service.engine.scorer.engine import PackedScorer
from service.metrics import Metrics
from service.settings import CudaGraphs, Settings

LOAD_SEQUENCES = 8  # a load request: one client's share of the standard workload


def load_variant(
    url: str, samples: list[Sample], args: argparse.Namespace, capacity: float
) -> dict[str, Any]:
    """Poisson load at --load-rate requests/s, or --load-fraction x `capacity` tokens/s (client.py)."""
    bodies = http_bodies(samples, per=LOAD_SEQUENCES)
    per_body = [
        sum(len(s.tokens) for s in samples[i : i + LOAD_SEQUENCES])
        for i in range(0, len(samples), LOAD_SEQUENCES)
    ]
    rate = args.load_rate or args.load_fraction * capacity / statistics.mean(per_body)
    procs = args.load_processes
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bodies.bin"
        write_bodies(path, bodies)
        clients = [
            subprocess.Popen(
                [sys.executable, "-m", "benchmarks.client", url, str(path), "0", "--mode", "load", "--frames",
                 "--rate", str(rate / procs), "--seconds", str(args.load_seconds),
                 "--tasks", str(max(1, args.load_tasks // procs)), "--seed", str(i)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            )
            for i in range(procs)
        ]  # fmt: skip
        for c in clients:  # every connection is open
            assert c.stdout is not None
            assert c.stdout.readline().strip() == "ready"
        start = time.perf_counter() + 0.1
        outs = [c.communicate(f"{start!r}\n", timeout=args.load_seconds + 600)[0] for c in clients]
        if any(c.returncode for c in clients):
            raise RuntimeError("a load client failed")
    parts = [json.loads(out) for out in outs]
    requests = [r for p in parts for r in p["requests"]]  # body, scheduled, sent, answered
    lags = sorted(lag for p in parts for lag in p["loop_lag_s"])
    latencies = sorted(answered - scheduled for _, scheduled, _, answered in requests)
    span = max(answered for *_, answered in requests) - start
    tokens = sum(per_body[body] for body, *_ in requests)

    def pct(values: list[float], q: float) -> float:
        return values[min(len(values) - 1, int(q * len(values)))] * 1e3 if values else 0.0

    return {
        "offered_requests_per_s": rate,
        "offered_tokens_per_s": rate * statistics.mean(per_body),
        "requests": len(requests),
        "requests_per_s": len(requests) / span,
        "tokens_per_s": tokens / span,
        "p50_ms": pct(latencies, 0.5),
        "p99_ms": pct(latencies, 0.99),
        "client_loop_lag_p99_ms": pct(lags, 0.99),
        "seconds": args.load_seconds,
        "span_s": span,
        "tasks": max(1, args.load_tasks // procs) * procs,
        "processes": procs,
    }


def bench_model(name: str, args: argparse.Namespace, device: torch.device, rate: float) -> dict[str, Any]:
    dtype = getattr(torch, args.dtype)
    settings = Settings(
        device=device.type,
        dtype=args.dtype,
        max_batch_tokens=args.max_batch_tokens,
        decoder=args.decoder,
        kernels=args.kernels,
        cuda_graphs=args.cuda_graphs,
        launch_hold_ms=args.launch_hold_ms,
        batch_wait_ms=args.batch_wait_ms,
        batch_invariant=args.batch_invariant,
        prefix_cache=CACHE_IN_ROUNDS,
    )
    backend, packed_impl, model = packed_model(dict(SHAPES[name]), dtype, device, args.attention)
    samples = workload(int(SHAPES[name]["vocab_size"]), sequences=args.sequences)
    tokens = sum(len(s.tokens) for s in samples)
    floor_s = floor_flops(SHAPES[name], active_params(model), samples) / rate
    variants: dict[str, dict[str, float]] = {}

    def record(variant: str, fn: Callable[[], object]) -> None:
        seconds = timed(fn, device, args.reps)
        variants[variant] = {
            "ms": seconds * 1e3,
            "tokens_per_s": tokens / seconds,
            "floor_fraction": floor_s / seconds,
            "peak_memory_gib": peak_memory(fn, device),
        }
        print(
            f"  {name} {variant:>6}: {seconds * 1e3:9.1f} ms  {floor_s / seconds:6.1%} of floor", flush=True
        )

    model.set_attn_implementation("sdpa")
    naive_scores = peers.naive(model, samples[:ACCURACY_SAMPLE], device)
    record("naive", lambda: peers.naive(model, samples, device))
    record("trl", lambda: peers.trl(model, samples, device))
    # float32 reference (the model's own sdpa forward, one sequence at a time): same weights upcast
    # in place and back (bf16 -> fp32 -> bf16 is exact), before any fused kernel is patched in
    model.float()
    want = reference_logprobs(model, samples[:ACCURACY_SAMPLE], device)
    for p in model.parameters():  # parameters only: buffers such as RoPE's inv_freq stay float32
        p.data = p.data.to(dtype)
    model.set_attn_implementation(packed_impl)
    # after the peers: they stay plain HF (the engine fuses weights and may patch modules)
    engine = PackedScorer(LoadedModel(model, name, demo=False), device, backend, settings.engine_config())
    engine.warm_up()

    the_jobs = jobs(samples)
    loop = asyncio.new_event_loop()
    batcher = Batcher.from_settings(engine, settings, Metrics())
    loop.run_until_complete(asyncio.sleep(0))
    loop.call_soon(batcher.start)
    engine_scores: list[SequenceScores] = loop.run_until_complete(
        batcher.score(the_jobs[:ACCURACY_SAMPLE])
    ).scores
    record("engine", lambda: loop.run_until_complete(batcher.score(the_jobs)))
    loop.run_until_complete(batcher.stop())
    loop.close()

    rounds: dict[str, list[float]] = {}
    with HttpServer(engine, settings) as url:
        framed, plain = http_bodies(samples), http_bodies(samples, frames=False)
        for variant, frames, mode in (
            ("http", True, "asyncio"),
            ("http_json", False, "asyncio"),  # the same bodies in JSON, both ways
            ("http_httpcore", True, "httpcore"),  # the same on httpx's default transport
            ("http_8proc", True, "processes"),  # the same load from 8 client processes, one request each
            ("http_plain", False, "plain"),  # httpx defaults, json= and response.json(): no logprobd client
            ("http_plain_8proc", False, "plain-processes"),  # the same, each body from its own process
        ):
            rounds[variant] = http_rounds(url, framed if frames else plain, args.reps, mode, frames)
            seconds = statistics.median(rounds[variant])
            variants[variant] = {
                "ms": seconds * 1e3,
                "tokens_per_s": tokens / seconds,
                "floor_fraction": floor_s / seconds,
                "peak_memory_gib": peak_memory(lambda: http_seconds(url, framed, 1), device)
                if variant == "http"
                else variants["http"]["peak_memory_gib"],  # the same server work
            }
            print(
                f"  {name} {variant:>10}: {seconds * 1e3:9.1f} ms  {floor_s / seconds:6.1%} of floor",
                flush=True,
            )
        vocab = int(SHAPES[name]["vocab_size"])
        pool = workload(vocab, sequences=LOAD_SEQUENCES * args.load_bodies, seed=1)
        load = load_variant(url, pool, args, capacity=variants["http"]["tokens_per_s"])
        print(f"  {name}       load: {load}", flush=True)

    result = {
        "attention": engine.info.attention_backend,
        "decoder": engine.info.decoder,
        "kernels": engine.info.kernels,
        "engine_versions": engine.info.versions,
        "http_rounds_ms": {k: [round(x * 1e3, 1) for x in v] for k, v in rounds.items()},
        "http_client": f"one client process, {len(http_bodies(samples))} connections (client.py asyncio: "
        "httpx on logprobd's StreamTransport), compact frames both ways (http_json: JSON both ways; "
        "http_httpcore: httpx's default transport; http_8proc: 8 client processes, httpx.Client; http_plain: "
        "httpx.AsyncClient defaults, json=; http_plain_8proc: the same from 8 processes, httpx.Client)",
        "tokens": tokens,
        "action_tokens": sum(len(s.response) for s in samples),
        "floor_ms": floor_s * 1e3,
        "variants": variants,
        "floor_fraction_http": variants["http"]["floor_fraction"],
        "floor_fraction_engine": variants["engine"]["floor_fraction"],
        "speedup_vs_naive": variants["naive"]["ms"] / variants["http"]["ms"],
        "peak_memory_vs_naive": (
            variants["http"]["peak_memory_gib"] / variants["naive"]["peak_memory_gib"]
            if variants["naive"]["peak_memory_gib"]
            else None
        ),
        "http_overhead": (variants["http"]["ms"] - variants["engine"]["ms"]) / variants["http"]["ms"],
        "http_overhead_json": (variants["http_json"]["ms"] - variants["engine"]["ms"])
        / variants["http_json"]["ms"],
        "http_overhead_httpcore": (variants["http_httpcore"]["ms"] - variants["engine"]["ms"])
        / variants["http_httpcore"]["ms"],
        "http_overhead_8proc_clients": (variants["http_8proc"]["ms"] - variants["engine"]["ms"])
        / variants["http_8proc"]["ms"],
        "http_overhead_plain": (variants["http_plain"]["ms"] - variants["engine"]["ms"])
        / variants["http_plain"]["ms"],
        "http_overhead_plain_8proc": (variants["http_plain_8proc"]["ms"] - variants["engine"]["ms"])
        / variants["http_plain_8proc"]["ms"],
        "load": load,
        "max_abs_diff_bf16": max_abs_diff([s.logprobs for s in engine_scores], want),
        "max_abs_diff_bf16_naive_peer": max_abs_diff(naive_scores, want),
    }
    return result


def table(results: dict[str, Any]) -> str:
    lines = [
        "| model | variant | ms | tokens/s | floor | peak GiB |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for name, r in results["models"].items():
        for variant, v in r["variants"].items():
            lines.append(
                f"| {name} | {variant} | {v['ms']:.1f} | {v['tokens_per_s']:,.0f} | "
                f"{v['floor_fraction']:.1%} | {v['peak_memory_gib']:.1f} |"
            )
    lines += [
        "",
        "| model | floor ms | HTTP floor | engine floor | speed-up vs naive | memory / naive | HTTP overhead "
        "| (JSON) | (httpcore) | (8 client processes) | (plain httpx + json) "
        "| max abs Δ bf16 (service / naive peer) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, r in results["models"].items():
        mem = r["peak_memory_vs_naive"]
        lines.append(
            f"| {name} | {r['floor_ms']:.1f} | {r['floor_fraction_http']:.1%} | "
            f"{r['floor_fraction_engine']:.1%} | {r['speedup_vs_naive']:.2f} | "
            f"{'n/a' if mem is None else f'{mem:.1%}'} | {r['http_overhead']:.1%} | "
            f"{r['http_overhead_json']:.1%} | {r['http_overhead_httpcore']:.1%} | "
            f"{r['http_overhead_8proc_clients']:.1%} | {r['http_overhead_plain']:.1%} | "
            f"{r['max_abs_diff_bf16']:.3g} / {r['max_abs_diff_bf16_naive_peer']:.3g} |"
        )
    lines += [
        "",
        "| model | load: offered req/s (tokens/s) | achieved req/s | tokens/s | p50 ms | p99 ms "
        "| client loop lag p99 ms |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, r in results["models"].items():
        ld = r["load"]
        lines.append(
            f"| {name} | {ld['offered_requests_per_s']:.1f} ({ld['offered_tokens_per_s']:,.0f}) | "
            f"{ld['requests_per_s']:.1f} | {ld['tokens_per_s']:,.0f} | {ld['p50_ms']:.1f} | "
            f"{ld['p99_ms']:.1f} | {ld['client_loop_lag_p99_ms']:.1f} |"
        )
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    """The command line (tests/benchmarks/test_page.py parses each cited command with it)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__)
    parser.add_argument("--models", nargs="+", default=["qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--attention", default="auto")
    parser.add_argument("--decoder", default="auto", choices=["auto", "fused", "transformers"])
    parser.add_argument("--kernels", default="auto", choices=["auto", "liger", "none"])
    parser.add_argument("--cuda-graphs", default="auto", choices=get_args(CudaGraphs))
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--batch-invariant", action="store_true", help="the server's --batch-invariant")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--max-batch-tokens", type=int, default=16384)
    parser.add_argument("--launch-hold-ms", type=float, default=Settings().launch_hold_ms)
    parser.add_argument("--batch-wait-ms", type=float, default=Settings().batch_wait_ms)
    parser.add_argument("--load-seconds", type=float, default=60.0, help="the load's duration")
    parser.add_argument("--load-fraction", type=float, default=0.8, help="offered load / http tokens/s")
    parser.add_argument("--load-rate", type=float, help="offered requests/s (instead of --load-fraction)")
    parser.add_argument("--load-tasks", type=int, default=64)
    parser.add_argument("--load-processes", type=int, default=1, help="client processes sharing the tasks")
    parser.add_argument("--load-bodies", type=int, default=32, help="distinct request bodies of the load")
    parser.add_argument("--output", type=Path, default=RESULTS / "latest.json")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    results = run_models("run", args, argv, bench_model)
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
