"""What each pass of the head's radix select costs on a GPU, and the gathered select beside it
(service/engine/heads/topk_kernel.py).

    python -m benchmarks.probes.select_passes [--rows 4096] [--vocab 152064] [--k 50 100] [--reps 20]
    TRITON_INTERPRET=1 python -m benchmarks.probes.select_passes --device cpu --rows 4 --vocab 3000 \\
        --k 5 --reps 1

bf16 logits [rows, V] (random, scaled like a 7B head's) at T = 0.7, every row selecting K. Cases, each
the median milliseconds over --reps after 3 warm-ups (CUDA events on a GPU):
- `logprob`, `logprob+entropy`: the fused log-prob kernel (heads/fused_kernel.py), one pass;
- `first pass`: the stats kernel without the selection (log-sum-exp, rank, largest key);
- `first pass + window`: with the histogram pass that finds the K-th largest key;
- `exact select`: the stats and write kernels (the K ids in id order);
- `gathered select`: the first pass bounding the K-th largest from below, the gather of every key
  at or above the bound, and the exact kernels gated to the rows whose candidates overflowed;
- `mass`: the kept-mass pass of the sampler (its top_k-th key, no floor).
Also how many rows overflowed and the largest candidate count. Writes the runs to --output (JSON).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.harness import median_ms, provenance, write_result
from benchmarks.probes.head_extras import common_arguments, random_rows
from service.engine.heads import fused_kernel, topk_kernel


def cases(
    z: torch.Tensor, targets: torch.Tensor, inv_t: torch.Tensor, k: int
) -> tuple[dict[str, Callable[[], None]], topk_kernel.Candidates]:
    """The passes of a K select over every row of z, each a callable that launches it, and the
    candidates buffer the gathered select writes."""
    rows, device = z.shape[0], z.device
    at = torch.arange(rows, device=device)
    per_row = torch.full((rows,), k, dtype=torch.int32, device=device)
    stats = topk_kernel.Out.empty(rows, device)
    exact = dataclasses.replace(
        stats,
        ids=torch.full((rows, k), -1, dtype=torch.int32, device=device),
        values=torch.empty(rows, k, dtype=z.dtype, device=device),
    )
    found = topk_kernel.Candidates.empty(rows, k + max(k // 2, 64), z.dtype, device)
    floor = torch.zeros(rows, device=device)

    def logprob(entropy: bool) -> Callable[[], None]:
        def run() -> None:
            fused_kernel.fused_logprobs(z, targets, inv_t, entropy)

        return run

    def select(out: topk_kernel.Out, **kw: Any) -> Callable[[], None]:
        return lambda: topk_kernel.launch(z, at, targets, 1.0, inv_t, per_row, out, **kw)

    def mass() -> None:
        topk_kernel.mass(z, at, 1.0, inv_t, stats.shift, floor, stats.threshold)

    launches = {
        "logprob": logprob(False),
        "logprob+entropy": logprob(True),
        "first pass": select(stats, select=False),
        "first pass + window": select(stats),
        "exact select": select(exact),
        "gathered select": select(exact, found=found),
        "mass": mass,
    }
    return launches, found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--k", type=int, nargs="+", default=[50, 100])
    common_arguments(parser)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    z, targets, inv_t = random_rows(
        args.rows, args.vocab, device, torch.Generator(device=device).manual_seed(0)
    )
    runs = []
    for k in args.k:
        launches, found = cases(z, targets, inv_t, k)
        for name, run in launches.items():
            ms = median_ms(run, device, args.reps)
            runs.append({"k": k, "case": name, "ms": ms})
            print(f"K {k:5d}  {name:22s} {ms:8.3f} ms", flush=True)
        overflowed = int((found.count > found.ids.shape[1]).sum())
        largest = int(found.count.max())
        runs.append({"k": k, "case": "candidates", "overflowed_rows": overflowed, "largest_count": largest})
        print(f"K {k:5d}  candidates: {overflowed} of {args.rows} rows overflowed; largest count {largest}")
    if args.output is not None:
        result = {"rows": args.rows, "vocab": args.vocab, "runs": runs}
        write_result(args.output, {**provenance("probes.select_passes", device, argv), **result})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
