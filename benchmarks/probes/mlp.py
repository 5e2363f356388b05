"""The MLP's gate|up projection and SwiGLU on the benchmark's micro-batches: split or fused.

    python -m benchmarks.probes.mlp [--models qwen2.5-1.5b ...] [--reps 10]

For each model's MLP shape, the benchmark workload is cut into micro-batches as
benchmarks.probes.attention cuts it (benchmarks/probes/kernels.py). Every implementation of
service/engine/ops/gate_up.py that this host can run computes silu(x·Wgateᵀ)·(x·Wupᵀ) for a whole
round: one call per layer per micro-batch, on random bf16 activations and weights, timed as
benchmarks.run times (medians of --reps). Beside the time, the largest |Δ| against the float32
product on the first 2,048 rows, relative to the largest |value| there.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from benchmarks.harness import timed
from benchmarks.probes.kernels import cli, micro_batches
from benchmarks.shapes import SHAPES
from benchmarks.workload import jobs, workload
from service.engine.batch.packing import SHAPE_STEP
from service.engine.ops import gate_up as gated
from service.engine.ops.elementwise import TRITON

IMPLEMENTATIONS = ("split", "quack")


def measure(name: str, reps: int, budget: int) -> dict[str, Any]:
    device = torch.device("cuda")
    shape = SHAPES[name]
    hidden, inner, layers = (int(shape[k]) for k in ("hidden_size", "intermediate_size", "num_hidden_layers"))
    rows = [
        -(-sum(j.num_tokens for j in b) // SHAPE_STEP) * SHAPE_STEP
        for b in micro_batches(jobs(workload(int(shape["vocab_size"]))), budget)
    ]
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(max(rows), hidden, device=device, dtype=torch.bfloat16, generator=gen)
    weight = torch.randn(2 * inner, hidden, device=device, dtype=torch.bfloat16, generator=gen) * hidden**-0.5
    gate, up = (x[:2048].float() @ weight.float().t()).chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    row: dict[str, Any] = {"micro_batch_tokens": rows}
    for implementation in IMPLEMENTATIONS:
        try:
            project = gated.choose(implementation, device, torch.bfloat16, TRITON.swiglu).project
        except RuntimeError as error:
            row[implementation] = {"skipped": str(error)}
            continue

        def round_(project: gated.Projection = project) -> None:
            for n in rows:
                for _ in range(layers):
                    project(x[:n], weight, None)

        ms = timed(round_, device, reps) * 1e3
        flops = 2.0 * sum(rows) * hidden * 2 * inner * layers
        diff = (project(x[:2048], weight, None).float() - want).abs().max().item() / want.abs().max().item()
        row[implementation] = {"ms": ms, "tflops": flops / ms / 1e9, "max_rel_diff": diff}
    return row


def main(argv: list[str] | None = None) -> int:
    title = "the MLP input side of a round"
    diff = ("max_rel_diff", "max |Δ| / max |value| vs fp32")
    return cli(
        argv,
        prog="python -m benchmarks.probes.mlp",
        measure=measure,
        title=title,
        column="implementation",
        diff=diff,
    )


if __name__ == "__main__":
    sys.exit(main())
