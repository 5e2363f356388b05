"""Engine variants, measured side by side in one run (`python -m benchmarks.variants`): what pays.

For each model: the service's engine in-process on the benchmark workload with different token
budgets, lm_head chunk sizes and (optionally) liger-kernel's fused RMSNorm/SwiGLU/RoPE.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import sys
from typing import Any

import torch

from benchmarks.run import build_model, peak_memory, timed
from benchmarks.workload import SHAPES, jobs, workload
from service.batcher import Batcher
from service.engine.attention import choose_backend, register
from service.engine.loading import LoadedModel
from service.engine.scorer import PackedScorer
from service.metrics import Metrics
from service.settings import Settings

CONFIGS = [(16384, 1024), (16384, 256), (32768, 256)]


def measure(model: Any, name: str, budget: int, chunk: int, reps: int) -> tuple[float, float]:
    device = torch.device("cuda")
    backend = choose_backend("auto", device)
    settings = Settings(device="cuda", dtype="bfloat16", max_batch_tokens=budget, logits_chunk_rows=chunk)
    engine = PackedScorer(LoadedModel(model, name, demo=False), device, backend, settings)
    the_jobs = jobs(workload(int(SHAPES[name]["vocab_size"])))
    loop = asyncio.new_event_loop()
    batcher = Batcher(engine, budget, Metrics(), wait_s=settings.batch_wait_ms / 1e3)
    loop.call_soon(batcher.start)
    run = lambda: loop.run_until_complete(batcher.score(the_jobs))  # noqa: E731
    seconds = timed(run, device, reps)
    peak = peak_memory(run, device)
    loop.run_until_complete(batcher.stop())
    loop.close()
    return seconds * 1e3, peak


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="+", default=["qwen2.5-0.5b", "qwen2.5-1.5b"])
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    impl = register(choose_backend("auto", device))
    for name in args.models:
        model = build_model(name, torch.bfloat16, device, impl)
        for budget, chunk in CONFIGS:
            ms, peak = measure(model, name, budget, chunk, args.reps)
            print(
                f"{name} budget={budget:6d} chunk={chunk:5d}: {ms:8.1f} ms  peak {peak:5.1f} GiB", flush=True
            )
        if importlib.util.find_spec("liger_kernel"):
            from liger_kernel.transformers import apply_liger_kernel_to_qwen2

            apply_liger_kernel_to_qwen2(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                        fused_linear_cross_entropy=False, model=model)  # fmt: skip
            for budget, chunk in CONFIGS[1:3]:
                ms, peak = measure(model, name, budget, chunk, args.reps)
                print(
                    f"{name} +liger budget={budget:6d} chunk={chunk:5d}: {ms:8.1f} ms  peak {peak:5.1f} GiB"
                )
        del model
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
