"""The decoder's dense projections by GEMM library: cuBLAS (what the default mode runs) against quack.

    python -m benchmarks.probes.dense_gemms [--models qwen2.5-7b] [--tokens 4096 16384] [--reps 20]
    python -m benchmarks.probes.dense_gemms --models tiny --device cpu --tokens 64 --reps 1  # smoke test

For each model shape (benchmarks/shapes.py) and micro-batch of T tokens, the projections the fused
decoder runs as plain GEMMs over tokens, on random bf16 operands:

- qkv: x [T, H] @ W_qkvᵀ (+ the bias where the family has one: Qwen2) -> [T, (heads + 2 kv heads) · d];
- o: x [T, H] += a [T, heads · d] @ W_oᵀ, accumulated into the residual (strategies/gemm.py
  `accumulate`: one rounding);
- down: x [T, H] += a [T, I] @ W_downᵀ, likewise (dense shapes; an MoE shape's experts are
  benchmarks.probes.moe_layer's).

Implementations: `cublas`, the default mode's own calls (strategies/gemm.py ONE_CALL: F.linear and
addmm_); `quack`, quack's GEMM at its heuristic tile (`tuned=False`, as ops/gate_up.py calls it), its
add-to-output epilogue for the accumulating projections. Each: the median ms of --reps launches
between CUDA events after a warm-up, its TFLOP/s, and the largest |Δ| against the float32 product
relative to its largest |value|.
An implementation this host cannot run (quack off CUDA, or not installed) is reported skipped.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import RESULTS, median_ms, provenance, write_result
from benchmarks.shapes import MOE_SHAPES, shape_of
from service.engine.ops.gate_up import quack_available
from service.engine.strategies.gemm import ONE_CALL

IMPLEMENTATIONS = ("cublas", "quack")
BIASED = ("qwen2",)  # families whose q, k and v projections carry a bias


@dataclass(frozen=True, slots=True)
class Projection:
    """One GEMM over tokens: x [T, k] @ weight [n, k]ᵀ, into a new [T, n] or accumulated into one."""

    name: str
    k: int
    n: int
    accumulate: bool
    bias: bool = False

    def flops(self, tokens: int) -> float:
        return 2.0 * tokens * self.k * self.n


def projections(name: str) -> list[Projection]:
    shape = shape_of(name)
    hidden = int(shape["hidden_size"])
    heads, kv = int(shape["num_attention_heads"]), int(shape["num_key_value_heads"])
    head_dim = int(shape.get("head_dim", hidden // heads))
    biased = str(shape.get("family", "qwen2")) in BIASED
    out = [
        Projection("qkv", hidden, (heads + 2 * kv) * head_dim, accumulate=False, bias=biased),
        Projection("o", heads * head_dim, hidden, accumulate=True),
    ]
    if name not in MOE_SHAPES:
        out.append(Projection("down", int(shape["intermediate_size"]), hidden, accumulate=True))
    return out


Run = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor], object]


def runners(device: torch.device) -> dict[str, tuple[Run, Run] | str]:
    """Each implementation's (new output, accumulate) calls, or why it cannot run here."""

    def torch_new(a: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, _: torch.Tensor) -> object:
        return ONE_CALL.linear(a, w, b)

    def torch_add(a: torch.Tensor, w: torch.Tensor, _: torch.Tensor | None, x: torch.Tensor) -> object:
        ONE_CALL.accumulate(x, a, w)
        return x

    out: dict[str, tuple[Run, Run] | str] = {"cublas": (torch_new, torch_add)}
    if not quack_available(device):
        out["quack"] = "needs quack-kernels on a CUDA device of compute capability 9.0+"
        return out
    from quack.gemm_interface import gemm, gemm_add_inplace

    def quack_new(a: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, _: torch.Tensor) -> object:
        return gemm(a, w.t(), bias=b, tuned=False)

    def quack_add(a: torch.Tensor, w: torch.Tensor, _: torch.Tensor | None, x: torch.Tensor) -> object:
        gemm_add_inplace(a, w.t(), x, tuned=False)
        return x

    out["quack"] = (quack_new, quack_add)
    return out


def measure(
    name: str, tokens: int, device: torch.device, dtype: torch.dtype, reps: int
) -> dict[str, dict[str, Any]]:
    gen = torch.Generator(device=device).manual_seed(0)
    found = runners(device)
    result: dict[str, dict[str, Any]] = {}
    for p in projections(name):
        a = torch.randn(tokens, p.k, device=device, dtype=dtype, generator=gen)
        weight = torch.randn(p.n, p.k, device=device, dtype=dtype, generator=gen) * p.k**-0.5
        bias = torch.randn(p.n, device=device, dtype=dtype, generator=gen) if p.bias else None
        residual = torch.randn(tokens, p.n, device=device, dtype=dtype, generator=gen)
        want = a.float() @ weight.float().t() + (residual.float() if p.accumulate else 0.0)
        if bias is not None:
            want += bias.float()
        row: dict[str, Any] = {"k": p.k, "n": p.n, "accumulate": p.accumulate, "bias": p.bias}
        for impl, run in found.items():
            if isinstance(run, str):
                row[impl] = {"skipped": run}
                continue
            call = run[1] if p.accumulate else run[0]
            x = residual.clone()
            got = call(a, weight, bias, x)
            assert isinstance(got, torch.Tensor)
            diff = float((got.float() - want).abs().max() / want.abs().max())
            # each timed call accumulates into the same x: the values drift, the work does not
            ms = median_ms(functools.partial(call, a, weight, bias, x), device, reps)
            row[impl] = {"ms": ms, "tflops": p.flops(tokens) / ms / 1e9, "rel_diff": diff}
        result[p.name] = row
    return result


def _cell(r: dict[str, Any]) -> str:
    return str(r["skipped"]) if "skipped" in r else f"{r['ms']:.3f} ({r['tflops']:.0f})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.probes.dense_gemms")
    parser.add_argument("--models", nargs="+", default=["qwen2.5-7b"])
    parser.add_argument("--tokens", nargs="+", type=int, default=[4096, 16384])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--output", type=Path, default=RESULTS / "dense-gemms-latest.json")
    args = parser.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    out: dict[str, Any] = {
        **provenance("probes.dense_gemms", device, argv),
        "settings": vars(args) | {"output": str(args.output)},
    }
    out["models"] = {
        name: {str(t): measure(name, t, device, dtype, args.reps) for t in args.tokens}
        for name in args.models
    }
    print(json.dumps(out["models"], indent=1))
    print(
        "| model | tokens | projection | " + " | ".join(f"{i} ms (TFLOP/s)" for i in IMPLEMENTATIONS) + " |"
    )
    print("|---|---:|---|" + "---:|" * len(IMPLEMENTATIONS))
    for name, by_tokens in out["models"].items():
        for t, rows in by_tokens.items():
            for proj, row in rows.items():
                cells = [
                    row[i]["skipped"]
                    if "skipped" in row[i]
                    else f"{row[i]['ms']:.3f} ({row[i]['tflops']:.0f})"
                    for i in IMPLEMENTATIONS
                ]
                print(f"| {name} | {t} | {proj} | " + " | ".join(cells) + " |")
    write_result(args.output, out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
