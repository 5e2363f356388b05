"""Packed causal attention kernels on the benchmark's micro-batches: which one pays.

    python -m benchmarks.probes.attention [--models qwen2.5-1.5b qwen3-30b-a3b ...] [--reps 10]
        [--sequence-tokens N]

For each model's attention shape (query heads, key/value heads, head dim 128; dense or a mixture of
experts) the benchmark
workload is cut into micro-batches as the batcher cuts it (sequences in order, under
`max_batch_tokens`) and packed as the engine packs them. Every kernel importable here runs the
attention of a whole round: one call per layer per micro-batch, on random bf16 q/k/v, timed as
benchmarks.run times (between device synchronisations, after a warm-up; medians of --reps). Beside
the time, the largest |Δ| of each kernel's output against the exact float32 per-sequence reference
on the first micro-batch. `--sequence-tokens N`: the same micro-batches' tokens cut into sequences of
N tokens each (the last of a micro-batch shorter), to see the kernels' rate by sequence length.

The kernels are the service's attention backends (service/engine/ops/attention.py) that this host can
run: torch's varlen_attn (FA2 kernels shipped with torch), flash-attn 2 and flash-attn 4's CuTe
kernels (FA3-class on Hopper), the last also with its PackGQA off (`pack_gqa off`: each tile's rows
one query head's, where flash-attn packs a key/value head's query heads together).
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from typing import Any

import torch

from benchmarks.harness import timed
from benchmarks.probes.kernels import cli, micro_batches
from benchmarks.shapes import shape_of
from benchmarks.workload import jobs, workload
from service.engine.batch.packing import pack
from service.engine.ops.attention import (
    BACKENDS,
    Kernel,
    Segments,
    choose_backend,
    flash_cute_kernel,
    sdpa_kernel,
)

HEAD_DIM = 128
# the `attention` settings a packed kernel answers to: not sdpa (the reference) nor blocked (batch
# invariance's, built by its mode, not chosen)
CHOSEN = tuple(name for name in BACKENDS if name not in ("sdpa", "blocked"))


def attention_flops(segments: list[Segments], q_heads: int) -> float:
    """QKᵀ and PV over the causal half of each sequence, per layer."""
    total = 0.0
    for seg in segments:
        lengths = (seg.cu[1:] - seg.cu[:-1]).tolist()
        total += sum(2.0 * 2.0 * q_heads * HEAD_DIM * n * (n + 1) / 2 for n in lengths)
    return total


def cut(seg: Segments, tokens: int, length: int) -> Segments:
    """seg's `tokens` tokens as sequences of `length` tokens (the last shorter)."""
    ends = [*range(length, tokens, length), tokens]
    cu = torch.tensor([0, *ends], dtype=torch.int32, device=seg.cu.device)
    return Segments(cu, min(length, tokens), seg.scale, None, None)


def measure(name: str, reps: int, budget: int, sequence_tokens: int | None = None) -> dict[str, Any]:
    device = torch.device("cuda")
    shape = shape_of(name)  # dense or a mixture of experts: the attention is the same
    hq, hk = int(shape["num_attention_heads"]), int(shape["num_key_value_heads"])
    assert int(shape.get("head_dim", int(shape["hidden_size"]) // hq)) == HEAD_DIM, name
    layers = int(shape["num_hidden_layers"])
    batches = [pack(b, device) for b in micro_batches(jobs(workload(int(shape["vocab_size"]))), budget)]
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(n: int, heads: int) -> torch.Tensor:
        return torch.randn(n, heads, HEAD_DIM, device=device, dtype=torch.bfloat16, generator=gen)

    inputs = [(rand(b.num_tokens, hq), rand(b.num_tokens, hk), rand(b.num_tokens, hk)) for b in batches]
    segments = [Segments(b.cu_seqlens, b.max_len, HEAD_DIM**-0.5, None, None) for b in batches]
    if sequence_tokens is not None:
        segments = [cut(seg, b.num_tokens, sequence_tokens) for seg, b in zip(segments, batches, strict=True)]
    q0, k0, v0 = inputs[0]
    want = sdpa_kernel(q0.float(), k0.float(), v0.float(), segments[0])
    flops = attention_flops(segments, hq) * layers
    row: dict[str, Any] = {"micro_batch_tokens": [b.num_tokens for b in batches]}
    kernels: dict[str, Kernel | str] = {}
    for backend_name in CHOSEN:
        try:
            kernels[backend_name] = choose_backend(backend_name, device).kernel
        except RuntimeError as error:
            kernels[backend_name] = str(error)
    if not isinstance(kernels.get("flash_attn_cute", ""), str):
        kernels["flash_attn_cute, pack_gqa off"] = flash_cute_kernel(pack_gqa=False)
    for backend_name, kernel in kernels.items():
        if isinstance(kernel, str):
            row[backend_name] = {"skipped": kernel}
            continue

        def round_(kernel: Kernel = kernel) -> None:
            for (q, k, v), seg in zip(inputs, segments, strict=True):
                for _ in range(layers):
                    kernel(q, k, v, seg)

        ms = timed(round_, device, reps) * 1e3  # after a warm-up call (and any JIT compile)
        diff = (kernel(q0, k0, v0, segments[0]).float() - want).abs().max().item()
        row[backend_name] = {"ms": ms, "tflops": flops / ms / 1e9, "max_abs_diff": diff}
    return row


def main(argv: list[str] | None = None) -> int:
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--sequence-tokens", type=int, help="cut every micro-batch into sequences of N tokens")
    known, _ = own.parse_known_args(argv)
    title = "attention of one round, all layers"
    if known.sequence_tokens is not None:
        title += f", in sequences of {known.sequence_tokens} tokens"
    diff = ("max_abs_diff", "max abs Δ vs fp32")
    return cli(
        argv,
        prog="python -m benchmarks.probes.attention",
        measure=partial(measure, sequence_tokens=known.sequence_tokens),
        title=title,
        column="kernel",
        diff=diff,
        parents=[own],
    )


if __name__ == "__main__":
    sys.exit(main())
