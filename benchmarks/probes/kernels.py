"""What benchmarks.probes.attention and benchmarks.probes.mlp share: the workload cut into
micro-batches, and the command line that measures each model and prints its table."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from typing import Any

import torch

from service.core.jobs import SequenceJob
from service.engine.config import BATCH_TOKENS

# model, reps, token budget -> {"micro_batch_tokens": [...], variant: {"ms", "tflops", diff} | {"skipped"}}
Measure = Callable[[str, int, int], dict[str, Any]]
MODELS = ["qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b"]


def micro_batches(the_jobs: list[SequenceJob], budget: int) -> list[list[SequenceJob]]:
    """Whole sequences in order, as many as fit the token budget (at least one)."""
    batches: list[list[SequenceJob]] = [[]]
    tokens = 0
    for job in the_jobs:
        if batches[-1] and tokens + job.num_tokens > budget:
            batches.append([])
            tokens = 0
        batches[-1].append(job)
        tokens += job.num_tokens
    return batches


def cli(
    argv: list[str] | None,
    *,
    prog: str,
    measure: Measure,
    title: str,
    column: str,
    diff: tuple[str, str],
    parents: Sequence[argparse.ArgumentParser] = (),
) -> int:
    """Measure every model of --models, print the results as JSON, then as a table whose variants
    are in `column` and whose last column is the result's `diff[0]`, headed `diff[1]`. `parents`: a
    probe's own options (argparse parents, add_help=False), shown in --help and accepted."""
    parser = argparse.ArgumentParser(prog=prog, parents=list(parents))
    parser.add_argument("--models", nargs="+", default=MODELS)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--max-batch-tokens", type=int, default=BATCH_TOKENS)
    args = parser.parse_args(argv)
    results = {name: measure(name, args.reps, args.max_batch_tokens) for name in args.models}
    print(json.dumps(results, indent=1))
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}; {title}")
    print(f"| model | {column} | ms | TFLOP/s | {diff[1]} |")
    print("|---|---|---:|---:|---:|")
    for name, row in results.items():
        for variant, r in row.items():
            if variant == "micro_batch_tokens":
                continue
            if "skipped" in r:
                print(f"| {name} | {variant} | skipped: {r['skipped']} | | |")
            else:
                print(f"| {name} | {variant} | {r['ms']:.2f} | {r['tflops']:.0f} | {r[diff[0]]:.2e} |")
    return 0
