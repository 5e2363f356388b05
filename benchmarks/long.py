"""Reasoning-length sequences: chunked scoring against a budget that holds each sequence whole.

    python -m benchmarks.long            # on a GPU host: 1.5B and 7B shapes; results/long-latest.json
    python -m benchmarks.long --models tiny --device cpu --long-scale 0.01 --max-batch-tokens 64 \
        --whole-budget 512 --single --single-models tiny --fairness-seconds 2 --fairness-models tiny
                                                  # CPU smoke test (tests/benchmarks runs it)

Per model (random bf16 weights with the real shapes, positions for 128k tokens), over HTTP (the
real app on loopback, clients in another process, compact frames):

- `long`: 8 sequences of a 1k-token prompt and a response uniform in [8k, 24k] tokens, one per
  client, on a default server (max_batch_tokens 16384: every sequence longer is chunked) and on a
  server whose budget holds each sequence whole (32768: the only way before chunking); the naive
  peer (padded, full logits) one sequence at a time, where it fits;
- `128k` (--single): one sequence of 131,072 tokens on the default server;
- `fairness` (--fairness-seconds): closed-loop short requests (4 clients, 8 sequences of the
  standard workload each) for that long, alone and beside a client streaming the long workload's
  sequences one after another: the short requests' p50/p99 latency.

Each reports milliseconds (median of --reps), the fraction of the FLOP floor (causal attention
included), the peak GPU memory with its parts (weights, the longest sequence's key/value store, the
rest: activations), and the largest |Δ| of the chunked scores against float32 on one sequence.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch

from benchmarks.client import write_bodies
from benchmarks.harness import (
    CACHE_IN_ROUNDS,
    RESULTS,
    active_params,
    max_abs_diff,
    packed_model,
    peak_memory,
    run_models,
    sync,
)
from benchmarks.server import HttpServer, http_bodies, http_rounds
from benchmarks.shapes import SHAPES
from benchmarks.workload import Sample, floor_flops, long_workload, workload
from service.engine.batch.kv_store import cache_bytes_per_token
from service.engine.config import BATCH_TOKENS
from service.engine.loading.pretrained import LoadedModel
from service.engine.scorer.engine import PackedScorer
from service.settings import Settings

POSITIONS = 131072
SHORT_CLIENTS = 4


def single(vocab: int, length: int, seed: int = 2) -> list[Sample]:
    tokens = np.random.default_rng(seed).integers(0, vocab, size=length).tolist()
    return [Sample(tokens[:1024], tokens[1024:])]


def _blocked_attention(  # noqa: PLR0917 (transformers calls it positionally)
    module: Any,
    query: torch.Tensor,  # [1, Hq, L, D]
    key: torch.Tensor,  # [1, Hk, L, D]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    *args: Any,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Exact causal attention of one whole sequence, 1024 queries at a time ([Hq, 1024, L] scores,
    not [Hq, L, L]): the float32 reference of a sequence whose full score matrix does not fit."""
    del module, attention_mask, args, kwargs
    groups = query.shape[1] // key.shape[1]
    k = key[0].repeat_interleave(groups, dim=0)  # [Hq, L, D]
    v = value[0].repeat_interleave(groups, dim=0)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    length, out = query.shape[2], torch.empty_like(query[0])
    for start in range(0, length, 1024):
        end = min(start + 1024, length)
        scores = torch.matmul(query[0, :, start:end], k[:, :end].transpose(1, 2)) * scale
        causal = (
            torch.arange(end, device=k.device)[None, :] > torch.arange(start, end, device=k.device)[:, None]
        )
        out[:, start:end] = torch.matmul(
            torch.softmax(scores.masked_fill(causal, float("-inf")), -1), v[:, :end]
        )
    return out.transpose(0, 1)[None], None


@torch.inference_mode()
def float32_reference(model: Any, sample: Sample, chunk_rows: int = 2048) -> np.ndarray:
    """The model's own float32 forward (sdpa, whole sequence), log-softmax on response rows in chunks."""
    ids = torch.tensor([sample.tokens], device=model.device)
    from transformers import AttentionInterface

    AttentionInterface.register("reference_blocked", _blocked_attention)
    model.set_attn_implementation("reference_blocked")
    try:
        hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state[0]
    finally:
        model.set_attn_implementation("sdpa")
    rows = hidden[len(sample.prompt) - 1 : len(sample.tokens) - 1]
    targets = ids[0, len(sample.prompt) :]
    out = []
    for start in range(0, rows.shape[0], chunk_rows):
        logp = torch.log_softmax(model.lm_head(rows[start : start + chunk_rows]).float(), dim=-1)
        out.append(logp.gather(1, targets[start : start + chunk_rows, None])[:, 0])
    return torch.cat(out).cpu().numpy()


@torch.inference_mode()
def naive_one(model: Any, sample: Sample) -> None:
    """The naive peer on one sequence: the whole forward, full logits, log-softmax over them."""
    ids = torch.tensor([sample.tokens], device=model.device)
    logits = model(input_ids=ids, use_cache=False).logits
    torch.log_softmax(logits.float(), dim=-1)[0, :-1].gather(1, ids[0, 1:, None])


def naive_peer(model: Any, longs: list[Sample], device: torch.device) -> dict[str, Any]:
    """The naive peer's time over the sequences one at a time, or why it did not fit."""
    try:
        naive_one(model, longs[0])
        sync(device)
        start = time.perf_counter()
        for s in longs:
            naive_one(model, s)
        sync(device)
        return {"ms": (time.perf_counter() - start) * 1e3}
    except torch.OutOfMemoryError as exc:
        return {"did_not_fit": str(exc).split("\n")[0][:200]}
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()


def post_scores(url: str, samples: list[Sample]) -> list[np.ndarray]:
    body = {"input_ids": [s.tokens for s in samples], "num_actions": [len(s.response) for s in samples]}
    reply = httpx.post(f"{url}/logprobs", json=body, timeout=600)
    reply.raise_for_status()
    return [np.asarray(row, dtype=np.float64) for row in reply.json()["logprobs"]]


def timed_http(url: str, samples: list[Sample], reps: int) -> tuple[float, list[float]]:
    rounds = http_rounds(url, http_bodies(samples), reps)
    return statistics.median(rounds), rounds


def fairness(url: str, shorts: list[Sample], longs: list[Sample], seconds: float) -> dict[str, Any]:
    """Short requests' latency alone, then beside a stream of long sequences (a client process)."""
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        short_path, long_path = Path(tmp) / "short.bin", Path(tmp) / "long.bin"
        write_bodies(short_path, http_bodies(shorts)[:SHORT_CLIENTS])
        write_bodies(long_path, http_bodies(longs))
        for case, extra in (("alone", []), ("with_long_stream", ["--long", str(long_path)])):
            cmd = [sys.executable, "-m", "benchmarks.fairness_load", url, str(short_path), str(seconds)]
            done = subprocess.run([*cmd, *extra], capture_output=True, text=True, check=True)
            result = json.loads(done.stdout)
            lat = sorted(result["short_latencies_s"])
            out[case] = {
                "short_requests": len(lat),
                "short_p50_ms": 1e3 * lat[len(lat) // 2],
                "short_p99_ms": 1e3 * lat[min(len(lat) - 1, int(0.99 * len(lat)))],
                "long_sequences_done": result["long_done"],
            }
            print(f"  fairness {case}: {out[case]}", flush=True)
    out["p99_ratio"] = out["with_long_stream"]["short_p99_ms"] / out["alone"]["short_p99_ms"]
    return out


def memory_parts(engine: PackedScorer, model: Any, longest: int, peak_gib: float) -> dict[str, float]:
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
    store = cache_bytes_per_token(model.config, next(model.parameters()).dtype) * longest / 2**30
    return {
        "peak_gib": peak_gib,
        "weights_gib": weights,
        "store_gib": store,
        "activations_gib": peak_gib - weights - store,
    }


def single_sequence(  # noqa: PLR0917
    engine: PackedScorer, model: Any, name: str, args: argparse.Namespace, device: torch.device, rate: float
) -> dict[str, Any]:
    """One sequence of the model's positions (x --long-scale) on the default server."""
    one = single(int(SHAPES[name]["vocab_size"]), round(POSITIONS * args.long_scale))
    one_floor = floor_flops(SHAPES[name], active_params(model), one) / rate
    settings = Settings(
        device=device.type,
        dtype=args.dtype,
        max_batch_tokens=args.max_batch_tokens,
        prefix_cache=CACHE_IN_ROUNDS,
    )
    with HttpServer(engine, settings) as url:
        seconds, rounds = timed_http(url, one, max(1, args.reps - 1))
        peak = peak_memory(lambda: http_rounds(url, http_bodies(one), 1), device)
    out = {
        "tokens": len(one[0].tokens),
        "ms": seconds * 1e3,
        "rounds_ms": [round(r * 1e3, 1) for r in rounds],
        "floor_ms": one_floor * 1e3,
        "floor_fraction": one_floor / seconds,
        "memory": memory_parts(engine, model, len(one[0].tokens), peak),
    }
    print(f"  {name} single: {out}", flush=True)
    return out


def bench_model(name: str, args: argparse.Namespace, device: torch.device, rate: float) -> dict[str, Any]:
    dtype = getattr(torch, args.dtype)
    settings = Settings(
        device=device.type,
        dtype=args.dtype,
        cuda_graphs=args.cuda_graphs,
        max_batch_tokens=args.max_batch_tokens,
        prefix_cache=CACHE_IN_ROUNDS,
    )
    backend, packed_impl, model = packed_model(dict(SHAPES[name]), dtype, device, positions=POSITIONS)
    vocab = int(SHAPES[name]["vocab_size"])
    params = active_params(model)
    longs = long_workload(vocab, args.long_scale)
    sample = min((s for s in longs if len(s.tokens) > args.max_batch_tokens), key=lambda s: len(s.tokens))
    result: dict[str, Any] = {"long_tokens": [len(s.tokens) for s in longs]}

    model.set_attn_implementation("sdpa")
    result["naive"] = naive_peer(model, longs, device)
    print(f"  {name} naive: {result['naive']}", flush=True)
    model.float()
    want = float32_reference(model, sample)
    for p in model.parameters():
        p.data = p.data.to(dtype)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    model.set_attn_implementation(packed_impl)

    engine = PackedScorer(LoadedModel(model, name, demo=False), device, backend, settings.engine_config())
    engine.warm_up()
    info = engine.info
    result["max_sequence_tokens"] = info.max_sequence_tokens
    result["max_sequence_limit"] = info.max_sequence_limit
    print(f"  {name}: longest sequence {info.max_sequence_tokens} ({info.max_sequence_limit})", flush=True)
    floor_s = floor_flops(SHAPES[name], params, longs) / rate

    def variant(budget: int) -> dict[str, Any]:
        served = Settings(**{**settings.model_dump(), "max_batch_tokens": budget})
        with HttpServer(engine, served) as url:
            got = post_scores(url, [sample])
            seconds, rounds = timed_http(url, longs, args.reps)
            peak = peak_memory(lambda: http_rounds(url, http_bodies(longs), 1), device)
            out: dict[str, Any] = {
                "ms": seconds * 1e3,
                "rounds_ms": [round(r * 1e3, 1) for r in rounds],
                "floor_fraction": floor_s / seconds,
                "memory": memory_parts(engine, model, max(len(s.tokens) for s in longs), peak),
                "max_abs_diff_vs_float32": max_abs_diff(got, [want]),
            }
            print(f"  {name} long, budget {budget}: {out}", flush=True)
            return out

    result["floor_ms"] = floor_s * 1e3
    result["chunked"] = variant(args.max_batch_tokens)
    result["whole"] = variant(args.whole_budget)
    result["chunked_vs_whole"] = result["chunked"]["ms"] / result["whole"]["ms"]
    if args.single and name in args.single_models:
        result["single"] = single_sequence(engine, model, name, args, device, rate)
    if args.fairness_seconds and name in args.fairness_models:
        shorts = workload(vocab, sequences=8 * SHORT_CLIENTS)
        with HttpServer(engine, settings) as url:
            result["fairness"] = fairness(url, shorts, longs, args.fairness_seconds)
    return result


def parser() -> argparse.ArgumentParser:
    """The command line (tests/benchmarks/test_page.py parses each cited command with it)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.long", description=__doc__)
    parser.add_argument("--models", nargs="+", default=["qwen2.5-1.5b", "qwen2.5-7b"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--cuda-graphs", default="auto")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--max-batch-tokens", type=int, default=BATCH_TOKENS)
    parser.add_argument("--whole-budget", type=int, default=32768, help="a budget that holds each sequence")
    parser.add_argument("--long-scale", type=float, default=1.0, help="lengths x this (a CPU smoke test)")
    parser.add_argument("--single", action="store_true", help="also the one 128k-token sequence")
    parser.add_argument("--single-models", nargs="+", default=["qwen2.5-7b"])
    parser.add_argument("--fairness-seconds", type=float, default=0.0)
    parser.add_argument("--fairness-models", nargs="+", default=["qwen2.5-7b"])
    parser.add_argument("--output", type=Path, default=RESULTS / "long-latest.json")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    run_models("long", args, argv, bench_model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
