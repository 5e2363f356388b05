"""GPU time of the fused head's extras: top-K and processed log-probs from a chunk of 16-bit logits,
by the float32-copy torch path and by the radix select (service/engine/heads/extras_radix.py).

    python -m benchmarks.probes.head_extras [--rows 512 4096] [--vocab 152064] [--chunk 512]
                                     [--reps 20] [--warmup 3] [--output head_extras.json]
    TRITON_INTERPRET=1 python -m benchmarks.probes.head_extras --device cpu --rows 4 --vocab 3000 --reps 1

bf16 logits [rows, V] (random, scaled like a 7B head's) at T = 0.7 (s != 1), every row asking.
Cases, each the median over --reps after --warmup, CUDA events on a GPU:
- plain: the fused log-prob kernel (heads/fused_kernel.py) over the rows in chunks of --chunk;
- top100 / top1000 {old, new}: plain plus top_logprobs K (with ranks): old, extras.score per chunk
  over a float32 copy; new, the radix kernels per chunk and the torch work once after the chunks
  (rows > --chunk: several chunks, so the per-chunk launches show against the GPU time);
- processed {old, new}: plain plus processed log-probs under top_k 50, top_p 0.9, min_p 0.05.
Prints a table (ms, and the cost over plain in %) and writes the runs as JSON to --output. On CPU
the kernels run in Triton's interpreter (TRITON_INTERPRET=1 before triton is imported): a smoke run.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from benchmarks.harness import median_ms, provenance, write_result
from service.engine.batch.asks import Extras
from service.engine.heads import chunked, extras_radix, fused_kernel
from service.engine.heads.base import LogitTransform
from service.engine.runtime import triton_jit

TEMPERATURE = 0.7
SAMPLER = (50, 0.9, 0.05)  # top_k, top_p, min_p


def common_arguments(parser: argparse.ArgumentParser) -> None:
    """--vocab, --device, --reps and --output, as the head's kernel benchmarks take them."""
    parser.add_argument("--vocab", type=int, default=152064)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--output", type=Path, default=None)


def random_rows(
    rows: int, vocab: int, device: torch.device, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """bf16 logits [rows, vocab] (random, scaled like a 7B head's), target ids [rows] and 1 / T [rows]."""
    z = (torch.randn(rows, vocab, device=device, generator=gen) * 2.5).to(torch.bfloat16)
    targets = torch.randint(0, vocab, (rows,), device=device, generator=gen)
    return z, targets, torch.full((rows,), 1.0 / TEMPERATURE, device=device)


def asks(rows: int, device: torch.device, *, top: int = 0, sampler: bool = False) -> Extras:
    index = np.arange(rows)
    top_k, top_p, min_p = SAMPLER
    return Extras(
        rows=index,
        index=torch.from_numpy(index).to(device),
        top=top,
        top_k=torch.full((rows,), top_k, device=device) if sampler else None,
        top_p=torch.full((rows,), top_p, device=device) if sampler else None,
        min_p=torch.full((rows,), min_p, device=device) if sampler else None,
        most_top_k=top_k if sampler else 0,
        least_top_k=top_k if sampler else 0,
        any_top_p=sampler,
    )


def head(  # noqa: PLR0917 (the logits, their rows' targets and 1 / T, and what to time)
    z: torch.Tensor, targets: torch.Tensor, inv_t: torch.Tensor, chunk: int, extras: Extras | None, path: str
) -> Callable[[], None]:
    """One score_actions call's fused-head work over z, past the lm_head: per chunk the kernel and the
    extras' per-chunk work by `path` (new: the radix kernels; old: extras.score over a float32 copy),
    then, on the new path, the extras' torch work over all the rows once (extras_radix.Collector)."""
    scale = inv_t.float()
    transform = LogitTransform()
    rows = z.shape[0]

    def run() -> None:
        radix = None
        if extras is not None and path == "new":
            radix = extras_radix.Collector(
                extras, targets, inv_t, transform.scale, 0, chunk, lambda at: z[at : at + chunk]
            )
        for start in range(0, rows, chunk):
            end = min(start + chunk, rows)
            if radix is not None:
                radix.chunk_of(z[start:end], start, end)
            elif extras is not None:
                chunked.from_float_copy(z[start:end], start, end, targets, inv_t, transform, extras)
            fused_kernel.fused_logprobs(z[start:end], targets[start:end], scale[start:end], True)
        if radix is not None:
            radix.done()

    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.probes.head_extras", description=__doc__)
    parser.add_argument("--rows", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--vocab", type=int, default=152064)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type != "cuda" and not triton_jit.interpreting():
        parser.error("on CPU the kernels need TRITON_INTERPRET=1 in the environment")
    gen = torch.Generator(device=device).manual_seed(0)
    runs = []
    print(f"{'rows':>6} {'case':<16} {'ms':>10} {'over plain':>11}")
    for rows in args.rows:
        z, targets, inv_t = random_rows(rows, args.vocab, device, gen)
        cases: dict[str, tuple[Extras | None, str]] = {"plain": (None, "new")}
        for k in (100, 1000):
            for path in ("old", "new"):
                cases[f"top{k} {path}"] = (asks(rows, device, top=min(k, args.vocab)), path)
        for path in ("old", "new"):
            cases[f"processed {path}"] = (asks(rows, device, sampler=True), path)
        plain = 0.0
        with torch.no_grad():
            for name, (extras, path) in cases.items():
                ms = median_ms(
                    head(z, targets, inv_t, args.chunk, extras, path), device, args.reps, args.warmup
                )
                plain = ms if name == "plain" else plain
                over = 100.0 * (ms - plain) / plain
                print(f"{rows:>6} {name:<16} {ms:>10.3f} {over:>10.1f}%")
                runs.append({"rows": rows, "case": name, "ms": ms, "over_plain_pct": over})
        del z
    result = {
        **provenance("probes.head_extras", device, argv),
        "vocab": args.vocab,
        "chunk": args.chunk,
        "temperature": TEMPERATURE,
        "sampler": dict(zip(("top_k", "top_p", "min_p"), SAMPLER, strict=True)),
        "runs": runs,
    }
    if args.output is not None:
        write_result(args.output, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
