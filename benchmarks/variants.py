"""Engine variants, measured one configuration set per process: what pays.

    python -m benchmarks.variants --model qwen2.5-1.5b --kernels none
    python -m benchmarks.variants --model qwen2.5-1.5b --kernels liger [--liger-rope]

The service's engine in-process on the benchmark workload, for several token budgets and lm_head
chunk sizes; `--liger-rope` also installs liger's RoPE (module-wide, so not used by the service).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

import torch

from benchmarks.run import build_model, peak_memory, timed
from benchmarks.workload import SHAPES, jobs, workload
from service.batcher import Batcher
from service.engine.attention import choose_backend, register
from service.engine.chunking import chunk_mlps
from service.engine.kernels import apply_fused_kernels
from service.engine.loading import LoadedModel
from service.engine.scorer import PackedScorer
from service.metrics import Metrics
from service.settings import Settings

CONFIGS = [(16384, 1024), (16384, 512), (16384, 256), (32768, 512), (8192, 512)]


def measure(model: Any, name: str, budget: int, chunk: int, reps: int) -> tuple[float, float]:
    device = torch.device("cuda")
    backend = choose_backend("auto", device)
    settings = Settings(device="cuda", dtype="bfloat16", max_batch_tokens=budget, logits_chunk_rows=chunk)
    engine = PackedScorer(LoadedModel(model, name, demo=False), device, backend, settings)
    the_jobs = jobs(workload(int(SHAPES[name]["vocab_size"])))
    loop = asyncio.new_event_loop()
    batcher = Batcher(engine, budget, Metrics())
    loop.call_soon(batcher.start)
    run = lambda: loop.run_until_complete(batcher.score(the_jobs))  # noqa: E731
    seconds = timed(run, device, reps)
    peak = peak_memory(run, device)
    loop.run_until_complete(batcher.stop())
    loop.close()
    return seconds * 1e3, peak


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen2.5-1.5b")
    parser.add_argument("--kernels", default="none", choices=["none", "liger"])
    parser.add_argument("--liger-rope", action="store_true")
    parser.add_argument("--mlp-chunk-tokens", type=int, default=0)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    model = build_model(args.model, torch.bfloat16, device, register(choose_backend("auto", device)))
    label = apply_fused_kernels(model, args.kernels, device)
    if chunk_mlps(model, args.mlp_chunk_tokens):
        label += f"+mlp{args.mlp_chunk_tokens}"
    if args.liger_rope:
        from liger_kernel.transformers import apply_liger_kernel_to_qwen2

        apply_liger_kernel_to_qwen2(rope=True, rms_norm=False, swiglu=False, cross_entropy=False,
                                    fused_linear_cross_entropy=False)  # fmt: skip
        label += "+rope"
    for budget, chunk in CONFIGS:
        ms, peak = measure(model, args.model, budget, chunk, args.reps)
        config = f"kernels={label:18s} budget={budget:6d} chunk={chunk:5d}"
        print(f"{args.model} {config}: {ms:8.1f} ms  peak {peak:5.1f} GiB", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
