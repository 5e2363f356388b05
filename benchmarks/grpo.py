"""GRPO groups and multi-turn trees: the service with prefix sharing off and on, and the naive peer.

    python -m benchmarks.grpo --models qwen2.5-1.5b qwen2.5-7b   # on a GPU host; results/grpo-latest.json
    python -m benchmarks.grpo --models qwen2.5-1.5b --workloads grpo-short grpo-long --client plain
    python -m benchmarks.grpo --models tiny --device cpu --dtype float32 --scale 0.05 --share-min-tokens 4 \\
        --reps 1                                               # CPU smoke test (tests/benchmarks runs it)

Workloads (benchmarks/workload.py, fixed seeds; the response is the action window):

- `grpo-short`: 8 prompts x 8 responses, prompt U[256, 1024], response Exp(250) in [16, 1024];
- `grpo-long`: 8 prompts x 8 responses, prompt U[2048, 4096], response Exp(300) in [16, 1024];
- `chat-header` (not by default): the standard workload, every prompt starting with the same 32
  tokens, as a chat template's header: run with --share-min-tokens 16 and 64 to see what sharing a
  short prefix costs or saves;
- `multi-turn`: 8 conversations x 4 samples, two levels of sharing (workload.multi_turn): a system
  prompt and first user turn shared by the conversation, a first assistant turn and second user
  turn shared by each pair of its samples, a last assistant turn (the actions) of each sample's own.

Per model (random bf16 weights with the real shapes) and workload, in one run: the service over HTTP
(the real app on loopback, one request per GRPO group or conversation, all at once from a client in
another process: --client frames, compact frames over 8 connections of logprobd's transport; or --client
plain, JSON as a trainer without logprobd's client writes it: a default httpx.AsyncClient, `json=` and
`response.json()`, benchmarks/client.py's `plain` mode; --client plain-processes, the same with each
request from its own process and httpx.Client, as trainer ranks on their own hosts) with
`share_prefixes` off and on, both serving one engine; and the naive peer (padded rows of 8, full logits:
what a trainer runs in-process; fewer rows where 8 run out of memory). Each reports milliseconds (median
of --reps after a warm-up), tokens/s (tokens sent), the fraction of the FLOP floor counted on all tokens
and on unique tokens (a trie over the sequences: what sharing can save), peak GPU memory, the
`usage.computed_tokens` the server reports (summed over the answers; null where the server does not
report it) and the largest |Δ| against a float32 reference on the workload's first 4 sequences (one GRPO
group's, one conversation's: they share).
Each workload also reports its tokens sent, unique tokens (full tree) and the tokens computed when
only one level is shared (each top-level group's longest common prefix once).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, get_args

import httpx
import numpy as np
import orjson
import torch

from benchmarks import peers
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
from benchmarks.server import HttpServer, batch_counts, http_bodies, http_rounds
from benchmarks.shapes import SHAPES
from benchmarks.workload import (
    Sample,
    chat_header,
    floor_flops,
    grpo_long,
    grpo_short,
    multi_turn,
    one_level_tokens,
    unique_floor_flops,
    unique_tokens,
)
from service.engine.config import BATCH_TOKENS
from service.engine.loading.pretrained import LoadedModel
from service.engine.scorer.engine import PackedScorer
from service.settings import CudaGraphs, Settings

WORKLOADS: dict[str, Callable[[int, float], list[Sample]]] = {
    "grpo-short": grpo_short,
    "grpo-long": grpo_long,
    "multi-turn": multi_turn,
    "chat-header": chat_header,
}
DEFAULT_WORKLOADS = ["grpo-short", "grpo-long", "multi-turn"]
SHARING = {"sharing_off": False, "sharing_on": True}
# --client -> benchmarks/client.py's mode
CLIENTS = {"frames": "asyncio", "plain": "plain", "plain-processes": "plain-processes"}


def describe(samples: list[Sample], min_shared: int) -> dict[str, Any]:
    tokens = sum(len(s.tokens) for s in samples)
    unique = unique_tokens(samples)
    return {
        "sequences": len(samples),
        "tokens": tokens,
        "unique_tokens": unique,
        "one_level_tokens": one_level_tokens(samples, min_shared),
        "action_tokens": sum(len(s.response) for s in samples),
        "longest": max(len(s.tokens) for s in samples),
        "unique_fraction": unique / tokens,
        # the 8 clients' bodies, per GRPO group or conversation: rows in full, or each prompt once
        "wire_bytes": {
            f"{form}{'_grouped' if grouped else ''}": sum(
                len(b) for b in http_bodies(samples, frames=form == "frames", grouped=grouped)
            )
            for form in ("json", "frames")
            for grouped in (False, True)
        },
    }


def naive_variant(model: Any, samples: list[Sample], device: torch.device, reps: int) -> dict[str, Any]:
    """The naive peer's median seconds and peak memory, in padded batches of 8 rows, or of fewer
    where 8 run out of memory (long prompts: its [rows, L, vocab] float32 logits)."""
    rows = peers.ROWS
    while True:
        run = functools.partial(peers.naive, model, samples, device, rows)
        try:
            seconds = timed(run, device, reps)
            return {"seconds": seconds, "peak_memory_gib": peak_memory(run, device), "rows": rows}
        except torch.OutOfMemoryError:
            if rows == 1:
                raise
            rows //= 2
            torch.cuda.empty_cache()
            print(f"    naive peer: out of memory, {rows} rows a batch", flush=True)


async def _answers(url: str, samples: list[Sample]) -> list[dict[str, Any]]:
    """The 8 clients' requests once, at once, in JSON: the answers (scores and usage)."""
    bodies = http_bodies(samples, frames=False)
    headers = {"content-type": "application/json"}
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        replies = await asyncio.gather(
            *(client.post("/logprobs", content=b, headers=headers) for b in bodies)
        )
    answers = []
    for reply in replies:
        reply.raise_for_status()
        answers.append(orjson.loads(reply.content))
    return answers


def computed_tokens(answers: list[dict[str, Any]]) -> int | None:
    """usage.computed_tokens summed over the answers; None while the server does not report it."""
    counts = [a.get("usage", {}).get("computed_tokens") for a in answers]
    return None if any(c is None for c in counts) else sum(int(c) for c in counts)


def accuracy(url: str, samples: list[Sample], want: list[np.ndarray]) -> float:
    """|Δ| of the first sequences scored together in one request (they share a prefix)."""
    first = samples[: len(want)]
    body = {"input_ids": [s.tokens for s in first], "num_actions": [len(s.response) for s in first]}
    reply = httpx.post(f"{url}/logprobs", json=body, timeout=600)
    reply.raise_for_status()
    got = [np.asarray(row, dtype=np.float64) for row in reply.json()["logprobs"]]
    return max_abs_diff(got, want)


def counted_rounds(
    url: str, bodies: list[bytes], reps: int, mode: str, frames: bool
) -> tuple[list[float], dict[str, float]]:
    """http_rounds, and the server's micro-batches per round and their mean computed tokens (over
    the rounds and the warm-up round)."""
    before = batch_counts(url)
    rounds = http_rounds(url, bodies, reps, mode, frames)
    after = batch_counts(url)
    count = after[0] - before[0]
    return rounds, {
        "micro_batches_per_round": count / (reps + 1),
        "micro_batch_tokens": (after[1] - before[1]) / max(1.0, count),
    }


def bench_model(name: str, args: argparse.Namespace, device: torch.device, rate: float) -> dict[str, Any]:
    dtype = getattr(torch, args.dtype)
    settings = Settings(
        device=device.type,
        dtype=args.dtype,
        max_batch_tokens=args.max_batch_tokens,
        cuda_graphs=args.cuda_graphs,
        launch_hold_ms=args.launch_hold_ms,
        batch_wait_ms=args.batch_wait_ms,
        share_min_tokens=args.share_min_tokens,
        prefix_cache=CACHE_IN_ROUNDS,
    )
    backend, packed_impl, model = packed_model(dict(SHAPES[name]), dtype, device, args.attention)
    vocab, params = int(SHAPES[name]["vocab_size"]), active_params(model)
    workloads = {w: WORKLOADS[w](vocab, args.scale) for w in args.workloads}
    results: dict[str, dict[str, Any]] = {}
    for w, samples in workloads.items():
        results[w] = describe(samples, args.share_min_tokens)
        results[w]["floor_ms"] = floor_flops(SHAPES[name], params, samples) / rate * 1e3
        results[w]["unique_floor_ms"] = unique_floor_flops(SHAPES[name], params, samples) / rate * 1e3
        results[w]["variants"] = {}
        print(f"  {name} {w}: {results[w]}", flush=True)

    def record(w: str, variant: str, seconds: float, peak: float, **extra: Any) -> None:
        r = results[w]
        r["variants"][variant] = {
            "ms": seconds * 1e3,
            "tokens_per_s": r["tokens"] / seconds,
            "floor_fraction": r["floor_ms"] / 1e3 / seconds,
            "unique_floor_fraction": r["unique_floor_ms"] / 1e3 / seconds,
            "peak_memory_gib": peak,
            **extra,
        }
        print(f"  {name} {w} {variant:>11}: {seconds * 1e3:9.1f} ms  {extra}", flush=True)

    # the peers and the float32 reference first, on the plain HF model (the engine fuses weights)
    model.set_attn_implementation("sdpa")
    want = naive_and_reference(model, workloads, results, args, device, record)
    for p in model.parameters():  # parameters only: buffers such as RoPE's inv_freq stay float32
        p.data = p.data.to(dtype)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    model.set_attn_implementation(packed_impl)
    engine = PackedScorer(LoadedModel(model, name, demo=False), device, backend, settings.engine_config())
    engine.warm_up()

    frames, mode = args.client == "frames", CLIENTS[args.client]
    for variant, share in SHARING.items():  # one engine; each server's batcher reads share_prefixes
        if variant not in args.variants:
            continue
        served = Settings(**{**settings.model_dump(), "share_prefixes": share})
        with HttpServer(engine, served) as url:
            for w, samples in workloads.items():
                bodies = http_bodies(samples, frames=frames)
                diff = accuracy(url, samples, want[w])
                rounds, batching = counted_rounds(url, bodies, args.reps, mode, frames)
                answers = asyncio.run(_answers(url, samples))
                peak = peak_memory(functools.partial(http_rounds, url, bodies, 1, mode, frames), device)
                record(
                    w,
                    variant,
                    statistics.median(rounds),
                    peak,
                    rounds_ms=[round(r * 1e3, 1) for r in rounds],
                    computed_tokens=computed_tokens(answers),
                    max_abs_diff_vs_float32=diff,
                    **batching,
                )
                if share:  # the same groups sent grouped: each prompt once on the wire
                    grouped = http_bodies(samples, frames=frames, grouped=True)
                    rounds = http_rounds(url, grouped, args.reps, mode, frames)
                    record(
                        w,
                        "sharing_on_grouped",
                        statistics.median(rounds),
                        peak,
                        rounds_ms=[round(r * 1e3, 1) for r in rounds],
                        wire_bytes=sum(map(len, grouped)),
                    )
    for r in results.values():
        v = r["variants"]
        if "sharing_off" in v and "sharing_on" in v:
            r["speedup_sharing"] = v["sharing_off"]["ms"] / v["sharing_on"]["ms"]
        if "naive" in v and "sharing_on" in v:
            r["speedup_vs_naive"] = v["naive"]["ms"] / v["sharing_on"]["ms"]
    return {
        "client": args.client,
        "attention": engine.info.attention_backend,
        "decoder": engine.info.decoder,
        "kernels": engine.info.kernels,
        "workloads": results,
    }


Record = Callable[..., None]


def naive_and_reference(  # noqa: PLR0917
    model: Any,
    workloads: dict[str, list[Sample]],
    results: dict[str, dict[str, Any]],
    args: argparse.Namespace,
    device: torch.device,
    record: Record,
) -> dict[str, list[np.ndarray]]:
    """The naive peer's rounds (where --variants asks for them) on the model as loaded, then the float32
    reference's log-probs of each workload's first samples (the model cast to float32 and left so)."""
    want: dict[str, list[np.ndarray]] = {}
    for w, samples in workloads.items():
        if "naive" not in args.variants:
            continue
        naive_scores = peers.naive(model, samples[:ACCURACY_SAMPLE], device)
        naive = naive_variant(model, samples, device, args.reps)
        record(w, "naive", naive["seconds"], naive["peak_memory_gib"], rows=naive["rows"])
        results[w]["naive_scores"] = naive_scores
    model.float()  # bf16 -> fp32 -> bf16 is exact
    for w, samples in workloads.items():
        want[w] = reference_logprobs(model, samples[:ACCURACY_SAMPLE], device)
        if "naive" in args.variants:
            naive_variant_result = results[w]["variants"]["naive"]
            naive_variant_result["max_abs_diff_vs_float32"] = max_abs_diff(
                results[w].pop("naive_scores"), want[w]
            )
    return want


def table(results: dict[str, Any]) -> str:
    clients = {m["client"] for m in results["models"].values()}
    lines = [
        f"client: {', '.join(sorted(clients))}",
        "",
        "| model | workload | tokens | unique (trie) | one level | variant | ms | tokens/s | floor | "
        "unique floor | computed tokens | peak GiB | max abs Δ vs fp32 |",
        "| --- | --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, m in results["models"].items():
        for w, r in m["workloads"].items():
            for variant, v in r["variants"].items():
                computed = v.get("computed_tokens")
                diff = v.get("max_abs_diff_vs_float32")
                lines.append(
                    f"| {name} | {w} | {r['tokens']:,} | {r['unique_tokens']:,} | "
                    f"{r['one_level_tokens']:,} | {variant} | {v['ms']:.1f} | {v['tokens_per_s']:,.0f} | "
                    f"{v['floor_fraction']:.1%} | {v['unique_floor_fraction']:.1%} | "
                    f"{'n/a' if computed is None else f'{computed:,}'} | "
                    f"{v['peak_memory_gib']:.1f} | {'n/a' if diff is None else f'{diff:.3g}'} |"
                )
    lines += [
        "",
        "| model | workload | sharing on / off speed-up | vs naive peer |",
        "| --- | --- | ---: | ---: |",
    ]
    for name, m in results["models"].items():
        for w, r in m["workloads"].items():
            on_off, vs_naive = r.get("speedup_sharing"), r.get("speedup_vs_naive")
            lines.append(
                f"| {name} | {w} | {'n/a' if on_off is None else f'{on_off:.2f}x'} | "
                f"{'n/a' if vs_naive is None else f'{vs_naive:.2f}x'} |"
            )
    lines += [
        "",
        "| model | workload | JSON bytes (rows in full / grouped) | frames bytes (rows in full / grouped) |",
        "| --- | --- | ---: | ---: |",
    ]
    for name, m in results["models"].items():
        for w, r in m["workloads"].items():
            b = r["wire_bytes"]
            json_ratio, frames_ratio = b["json"] / b["json_grouped"], b["frames"] / b["frames_grouped"]
            lines.append(
                f"| {name} | {w} | {b['json']:,} / {b['json_grouped']:,} ({json_ratio:.1f}x) | "
                f"{b['frames']:,} / {b['frames_grouped']:,} ({frames_ratio:.1f}x) |"
            )
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    """The command line (tests/benchmarks/test_page.py parses each cited command with it)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.grpo", description=__doc__)
    parser.add_argument("--models", nargs="+", default=["qwen2.5-1.5b", "qwen2.5-7b"])
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=DEFAULT_WORKLOADS)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--attention", default="auto")
    parser.add_argument("--cuda-graphs", default="auto", choices=get_args(CudaGraphs))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=["naive", *SHARING],
        default=["naive", *SHARING],
        help="which to run (sharing_on also runs the grouped form)",
    )
    parser.add_argument("--max-batch-tokens", type=int, default=BATCH_TOKENS)
    parser.add_argument("--launch-hold-ms", type=float, default=Settings().launch_hold_ms)
    parser.add_argument("--batch-wait-ms", type=float, default=Settings().batch_wait_ms)
    parser.add_argument("--share-min-tokens", type=int, default=Settings().share_min_tokens)
    parser.add_argument(
        "--client",
        choices=list(CLIENTS),
        default="frames",
        help="frames: compact frames, logprobd's transport; plain: JSON, httpx defaults, one process; "
        "plain-processes: the same, each request from its own process (client.py)",
    )
    parser.add_argument("--scale", type=float, default=1.0, help="every length x this (a CPU smoke test)")
    parser.add_argument("--output", type=Path, default=RESULTS / "grpo-latest.json")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    results = run_models("grpo", args, argv, bench_model)
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
