"""Batch-invariant mode's cost and bits on a GPU: --batch-invariant off and on, in one run, per workload.

    python -m benchmarks.invariance                                  # on a GPU host: 7B, every workload
    python -m benchmarks.invariance --models qwen2.5-1.5b qwen2.5-7b --workloads standard grpo-short
    python -m benchmarks.invariance --models qwen3-30b-a3b-8l        # a mixture of experts (shapes.py)
    python -m benchmarks.invariance --models tiny --device cpu --dtype float32 --sequences 8 --scale 0.02 \\
        --max-batch-tokens 256 --reps 1                             # CPU smoke test (tests/benchmarks)

Expected time: about 2.5 minutes for the 7B shape with every workload on an H100 (reps 3 after a
warm-up round, both modes: model build and engine warm-up about 30 s, the long workload about half the
rest); the 1.5B shape about a minute.

Workloads (benchmarks/workload.py; fixed seeds; the response is the action window):

- `standard`: 64 sequences, prompt U[256, 1024], response Exp(250) in [16, 1024];
- `grpo-short`: 8 prompts x 8 responses, prompt U[256, 1024] (sharing);
- `grpo-long`: 8 prompts x 8 responses, prompt U[2048, 4096] (sharing);
- `long`: 8 sequences of a 1k-token prompt and a response U[8k, 24k] (chunked past the budget).

Per model (random weights with the real shape) and mode, one engine built from the same weights,
served by the real app on loopback with prefix sharing on (the default): each workload sent by 8
clients in another process, compact frames, one request per GRPO group or per eighth of the
sequences (what benchmarks/grpo.py and long.py send): the median of --reps rounds after a warm-up
round. Then, in this process under the server's batcher: a sample of each workload's sequences
scored alone and within the workload's 8 concurrent requests (and, after all that traffic, one
standard sequence first in a request, split from a request larger than the budget, and last in each
of 8 concurrent requests):
`bitwise` is whether every one scored the same bits (log-probs and entropy) as alone. Prints one line
per workload (ms off, ms on, cost, bitwise with the mode on and off) and writes --output (JSON).
Pass: `bitwise_on` true for every workload; the issue's target is cost <= 15 % at 7B, <= 20 % at 1.5B.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, get_args

import torch

from benchmarks.harness import CACHE_IN_ROUNDS, RESULTS, packed_model, run_models
from benchmarks.server import CLIENTS, HttpServer, http_bodies, http_rounds
from benchmarks.shapes import MOE_SHAPES, SHAPES, shape_of
from benchmarks.workload import Sample, _scaled, grpo_long, grpo_short, jobs, long_workload, workload
from service.batcher import Batcher
from service.core.jobs import SequenceJob, SequenceScores
from service.engine.config import BATCH_TOKENS
from service.engine.loading.pretrained import LoadedModel
from service.engine.scorer.engine import PackedScorer
from service.metrics import Metrics
from service.settings import Kernels, Settings

MODES = {"off": False, "on": True}
SAMPLE = 4  # sequences of each workload checked bit for bit


def standard(vocab: int, scale: float, sequences: int) -> list[Sample]:
    return workload(
        vocab,
        sequences=sequences,
        prompt_range=_scaled(256, 1024, scale),
        response_mean=250.0 * scale,
        response_clip=_scaled(16, 1024, scale),
    )


WORKLOADS: dict[str, Callable[[int, float, int], list[Sample]]] = {
    "standard": standard,
    "grpo-short": lambda vocab, scale, _: grpo_short(vocab, scale),
    "grpo-long": lambda vocab, scale, _: grpo_long(vocab, scale),
    "long": lambda vocab, scale, _: long_workload(vocab, scale),
}


def requests(batch: list[SequenceJob]) -> list[list[SequenceJob]]:
    """The 8 clients' requests, as http_bodies cuts them: a GRPO group, or an eighth of the sequences."""
    per = len(batch) // CLIENTS or 1
    return [batch[i : i + per] for i in range(0, len(batch), per)]


def bits(scores: SequenceScores) -> bytes:
    assert scores.entropy is not None
    return scores.logprobs.tobytes() + scores.entropy.tobytes()


async def check_bits(
    engine: PackedScorer, settings: Settings, workloads: dict[str, list[Sample]]
) -> dict[str, dict[str, bool]]:
    """Per workload, per case: whether the sampled sequences scored the bits they score alone."""
    batcher = Batcher.from_settings(engine, settings, Metrics())
    batcher.start()

    async def score(batch: list[SequenceJob]) -> list[SequenceScores]:
        return (await batcher.score(batch)).scores

    out: dict[str, dict[str, bool]] = {}
    try:
        for name, samples in workloads.items():
            batch = [dataclasses.replace(job, return_entropy=True) for job in jobs(samples)]
            picked = sorted({round(i * (len(batch) - 1) / (SAMPLE - 1)) for i in range(SAMPLE)})
            alone = {i: bits((await score([batch[i]]))[0]) for i in picked}
            answers = await asyncio.gather(*(score(r) for r in requests(batch)))
            flat = [s for a in answers for s in a]
            out[name] = {"in_8_concurrent_requests": all(bits(flat[i]) == alone[i] for i in picked)}
        if "standard" in workloads:  # one sequence, after all the traffic above and the timed rounds
            batch = [dataclasses.replace(job, return_entropy=True) for job in jobs(workloads["standard"])]
            k = len(batch) // 2
            target, others, want = batch[k], batch[:k] + batch[k + 1 :], bits((await score([batch[k]]))[0])
            cases = out["standard"]
            cases["first_in_a_request"] = bits((await score([target, *others]))[0]) == want
            split = (await score([*others, *others, target]))[-1]  # past the budget: micro-batches
            cases["split_from_its_request"] = bits(split) == want
            concurrent = await asyncio.gather(*(score([*r, target]) for r in requests(others)))
            cases["last_of_each_concurrent_request"] = all(bits(c[-1]) == want for c in concurrent)
    finally:
        await batcher.stop()
    return out


def bench_model(name: str, args: argparse.Namespace, device: torch.device, rate: float) -> dict[str, Any]:
    """Both modes of `name` on every workload asked (`rate`, the matmul rate, is not used: no floor)."""
    del rate
    shape = shape_of(name)
    backend, _, model = packed_model(shape, getattr(torch, args.dtype), device)
    vocab = int(shape["vocab_size"])
    workloads = {w: WORKLOADS[w](vocab, args.scale, args.sequences) for w in args.workloads}
    result: dict[str, Any] = {
        w: {
            "sequences": len(s),
            "tokens": sum(len(x.tokens) for x in s),
            "longest": max(len(x.tokens) for x in s),
        }
        for w, s in workloads.items()
    }
    info: dict[str, Any] = {}
    for mode, on in MODES.items():
        settings = Settings(
            device=device.type,
            dtype=args.dtype,
            batch_invariant=on,
            decoder=args.decoder,
            kernels=args.kernels,
            max_batch_tokens=args.max_batch_tokens,
            share_prefixes=True,
            prefix_cache=CACHE_IN_ROUNDS,
        )
        engine = PackedScorer(LoadedModel(model, name, demo=False), device, backend, settings.engine_config())
        engine.warm_up()
        info[mode] = {
            "attention": engine.info.attention_backend,
            "decoder": engine.info.decoder,
            "kernels": engine.info.kernels,
            "moe_kernel": engine.info.moe_kernel,
            "gemm": engine.info.gemm,
        }
        with HttpServer(engine, settings) as url:
            for w, samples in workloads.items():
                rounds = http_rounds(url, http_bodies(samples), args.reps)
                result[w][f"ms_{mode}"] = 1e3 * statistics.median(rounds)
                result[w][f"rounds_ms_{mode}"] = [round(1e3 * r, 1) for r in rounds]
                print(f"  {name} {w:>10} mode {mode:>3}: {result[w][f'ms_{mode}']:9.1f} ms", flush=True)
        checked = asyncio.run(check_bits(engine, settings, workloads))
        for w, cases in checked.items():
            result[w][f"cases_{mode}"] = cases
            result[w][f"bitwise_{mode}"] = all(cases.values())
        del engine
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for w, r in result.items():
        r["cost"] = r["ms_on"] / r["ms_off"] - 1.0
        print(
            f"{name} {w:>10}: off {r['ms_off']:9.1f} ms  on {r['ms_on']:9.1f} ms  cost {r['cost']:+7.1%}  "
            f"bitwise on {r['bitwise_on']} (off {r['bitwise_off']})",
            flush=True,
        )
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"engine": info, "workloads": result}


def parser() -> argparse.ArgumentParser:
    """The command line (tests/benchmarks/test_page.py parses each cited command with it)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.invariance", description=__doc__)
    parser.add_argument("--models", nargs="+", default=["qwen2.5-7b"], choices=[*SHAPES, *MOE_SHAPES])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--decoder", default="auto", choices=["auto", "fused", "transformers"])
    parser.add_argument("--kernels", default="auto", choices=get_args(Kernels))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--sequences", type=int, default=64, help="the standard workload's")
    parser.add_argument("--scale", type=float, default=1.0, help="every length x this (a CPU smoke test)")
    parser.add_argument("--max-batch-tokens", type=int, default=BATCH_TOKENS)
    parser.add_argument("--output", type=Path, default=RESULTS / "invariance-latest.json")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    results = run_models("invariance", args, argv, bench_model)
    every = [r["bitwise_on"] for m in results["models"].values() for r in m["workloads"].values()]
    print(f"bitwise with the mode on in every workload: {all(every)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
