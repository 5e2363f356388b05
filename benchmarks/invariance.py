"""Batch invariance on a GPU: the same sequence's bits in every batching, with --batch-invariant on and off.

    python -m benchmarks.invariance --model qwen2.5-7b --out DIR   # on a GPU host: both modes
    python -m benchmarks.invariance --model qwen3-30b-a3b-8l --out DIR   # a mixture of experts (moe.py)
    python -m benchmarks.invariance --model tiny --device cpu --out DIR   # CPU smoke test

Per mode (random bf16 weights with the real shape, the engine under the server's batcher, in this
process): the standard workload's time (median of --reps), then one target sequence scored alone,
first and 38th in a 64-sequence request, among 8 concurrent requests, split from its request (a
request larger than a micro-batch), and again alone after GRPO-shaped batches of other shapes; the
largest |Δ| of each case against alone (0.0: bitwise equal). Writes DIR/<model>-<mode>.json with the
target's log-probs and entropy as hex bytes, so two runs (a restart) can be compared bit for bit.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, get_args

import numpy as np
import torch

from benchmarks import moe
from benchmarks.run import build_model, matmul_rate, non_embedding_params, sync
from benchmarks.workload import SHAPES, floor_flops, jobs, workload
from service.batcher import Batcher
from service.engine.loading.models import LoadedModel
from service.engine.ops.attention import choose_backend, register
from service.engine.scorer.engine import PackedScorer
from service.jobs import SequenceJob, SequenceScores
from service.metrics import Metrics
from service.settings import Kernels, Settings


def grpo(vocab: int, seed: int) -> list[SequenceJob]:
    """8 prompts x 8 responses of other lengths than the standard workload's."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(8):
        prompt = rng.integers(0, vocab, int(rng.integers(2048, 4097))).tolist()
        for _ in range(8):
            response = rng.integers(0, vocab, int(rng.integers(16, 1025))).tolist()
            tokens = np.asarray(prompt + response, dtype=np.int64)
            out.append(SequenceJob(tokens, np.arange(len(prompt), len(tokens)), 1.0, True))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.invariance", description=__doc__)
    parser.add_argument("--model", default="qwen2.5-7b", choices=[*SHAPES, *moe.SHAPES])
    parser.add_argument("--decoder", default="auto", choices=["auto", "fused", "transformers"])
    parser.add_argument("--kernels", default="auto", choices=get_args(Kernels))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--modes", nargs="+", default=["off", "on"])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    rate = matmul_rate(device, dtype)
    backend = choose_backend("auto", device)
    if args.model in moe.SHAPES:  # the floor counts the parameters a token runs through
        shape = moe.SHAPES[args.model]
        model = moe.build_model(shape, dtype, device, register(backend))
        params, floor_shape = (
            moe.active_params(model),
            moe.floor_shape(shape, int(shape["num_hidden_layers"])),
        )
    else:
        model = build_model(args.model, dtype, device, register(backend))
        params, floor_shape = non_embedding_params(model), SHAPES[args.model]
    vocab = int(floor_shape["vocab_size"])
    samples = workload(vocab, sequences=args.sequences)
    floor_s = floor_flops(floor_shape, params, samples) / rate
    standard = [dataclasses.replace(job, return_entropy=True) for job in jobs(samples)]
    target = standard[5]
    args.out.mkdir(parents=True, exist_ok=True)
    for mode in args.modes:
        settings = Settings(
            device=device.type,
            dtype=args.dtype,
            batch_invariant=mode == "on",
            decoder=args.decoder,
            kernels=args.kernels,
        )
        engine = PackedScorer(
            LoadedModel(model, args.model, demo=False), device, backend, settings.engine_config()
        )
        engine.warm_up()
        result = asyncio.run(_cases(engine, settings, standard, target, vocab, args.reps))
        result |= {
            "model": args.model,
            "mode": mode,
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "versions": engine.info.versions,
            "kernels": engine.info.kernels,
            "decoder": engine.info.decoder,
            "moe_kernel": engine.info.moe_kernel,
            "attention": engine.info.attention_backend,
            "floor_fraction": floor_s / (result["standard_ms"] / 1e3),
        }
        variant = "".join(f"-{v}" for v in (args.decoder, args.kernels) if v != "auto")
        (args.out / f"{args.model}{variant}-{mode}.json").write_text(json.dumps(result, indent=2))
        shown = {k: v for k, v in result.items() if k not in ("bits", "versions")}
        print(json.dumps(shown), flush=True)
        del engine
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return 0


async def _cases(  # noqa: PLR0917
    engine: PackedScorer,
    settings: Settings,
    standard: list[SequenceJob],
    target: SequenceJob,
    vocab: int,
    reps: int,
) -> dict[str, Any]:
    batcher = Batcher.from_settings(engine, settings, Metrics())
    batcher.start()
    device = torch.device(settings.device)

    async def score(batch: list[SequenceJob]) -> list[SequenceScores]:
        return (await batcher.score(batch)).scores

    await score(standard)  # warm-up
    times = []
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        await score(standard)
        sync(device)
        times.append(time.perf_counter() - start)
    short = dataclasses.replace(target, tokens=target.tokens[:100], actions=np.arange(50, 100))
    alone: dict[str, SequenceScores] = {}
    cases: dict[str, SequenceScores] = {}
    for label, one in (("", target), ("short_", short)):  # the short one alone is a 128-row micro-batch
        others = [j for j in standard if j is not target]
        alone[label] = (await score([one]))[0]
        cases[f"{label}first_of_64"] = (await score([one, *others[:63]]))[0]
        cases[f"{label}38th_of_64"] = (await score([*others[:37], one, *others[37:63]]))[37]
        concurrent = await asyncio.gather(*(score([*others[i * 8 : i * 8 + 7], one]) for i in range(8)))
        cases |= {f"{label}concurrent_client_{i}": c[-1] for i, c in enumerate(concurrent)}
        big = others * 2  # past the budget: split across micro-batches, the target in the last ones
        cases[f"{label}split_from_its_request"] = (await score([*big[:100], one]))[-1]
    for seed in range(3):  # history: other shapes met
        await score(grpo(vocab, seed))
    cases["alone_after_grpo_batches"] = (await score([target]))[0]
    cases["short_alone_after_grpo_batches"] = (await score([short]))[0]
    await batcher.stop()

    def diff(name: str, a: SequenceScores) -> float:
        base = alone["short_" if name.startswith("short_") else ""]
        entropy = 0.0
        if a.entropy is not None and base.entropy is not None:
            entropy = float(np.abs(a.entropy - base.entropy).max())
        return max(float(np.abs(a.logprobs - base.logprobs).max()), entropy)

    diffs = {name: diff(name, s) for name, s in cases.items()}

    def bits(scores: SequenceScores) -> dict[str, str]:
        assert scores.entropy is not None
        return {"logprobs": scores.logprobs.tobytes().hex(), "entropy": scores.entropy.tobytes().hex()}

    return {
        "standard_ms": 1e3 * statistics.median(times),
        "max_abs_diff_vs_alone": diffs,
        "bitwise_invariant": all(d == 0.0 for d in diffs.values()),
        "bits": {"target": bits(alone[""]), "short": bits(alone["short_"])},
    }


if __name__ == "__main__":
    sys.exit(main())
