"""The radix select's launch parameters on a GPU: BLOCK, num_warps and DIGIT of
service/engine/heads/topk_kernel.py, each timed on the same logits, each checked against the module's
defaults (the same ids, shift and ranks).

    python -m benchmarks.probes.topk_sweep [--rows 4096] [--vocab 152064] [--k 100 1000] [--reps 20]
    TRITON_INTERPRET=1 python -m benchmarks.probes.topk_sweep --device cpu --rows 4 --vocab 3000 --reps 1 \\
        --blocks 512 --warps 4 --digits 8                              # CPU smoke test

bf16 logits [rows, V] (random, scaled like a 7B head's) at T = 0.7; `select` over every row with K
(stats and write kernels), median milliseconds over --reps after 3 warm-ups (CUDA events). Prints
one line per configuration and K, fastest first, and writes them to --output (JSON).
"""

from __future__ import annotations

import argparse
import itertools

import torch

from benchmarks.harness import median_ms, provenance, write_result
from benchmarks.probes.head_extras import common_arguments, random_rows
from service.engine.heads import topk_kernel


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--k", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--blocks", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--warps", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--digits", type=int, nargs="+", default=[4, 8])
    common_arguments(parser)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    z, targets, inv_t = random_rows(
        args.rows, args.vocab, device, torch.Generator(device=device).manual_seed(0)
    )
    rows = torch.arange(args.rows, device=device)
    default = (topk_kernel.BLOCK, topk_kernel.NUM_WARPS, topk_kernel.DIGIT)
    results = []
    for k in args.k:
        want = topk_kernel.select(z, rows, targets, 1.0, inv_t, k)
        for block, warps, digit in itertools.product(args.blocks, args.warps, args.digits):
            topk_kernel.NUM_WARPS = warps
            try:
                got = topk_kernel.select(z, rows, targets, 1.0, inv_t, k, block=block, digit=digit)
                assert got.ids is not None
                assert want.ids is not None
                same = bool(
                    torch.equal(got.ids, want.ids) and torch.equal(got.ranks, want.ranks)
                    and torch.allclose(got.shift, want.shift, rtol=1e-5, atol=1e-5)
                )  # fmt: skip

                def run(k: int = k, block: int = block, digit: int = digit) -> None:
                    topk_kernel.select(z, rows, targets, 1.0, inv_t, k, block=block, digit=digit)

                ms = median_ms(run, device, args.reps)
                results.append(
                    {"k": k, "block": block, "warps": warps, "digit": digit, "ms": ms, "same": same}
                )
            except Exception as exc:  # a configuration that does not compile or launch
                results.append(
                    {"k": k, "block": block, "warps": warps, "digit": digit, "error": repr(exc)[:200]}
                )
            finally:
                topk_kernel.NUM_WARPS = default[1]
    for k in args.k:
        rows_k = sorted((r for r in results if r["k"] == k and "ms" in r), key=lambda r: r["ms"])
        block, warps, digit = default
        print(f"K = {k}, {args.rows} rows x {args.vocab}; default block {block} warps {warps} digit {digit}")
        for r in rows_k:
            where = f"block {r['block']:5d} warps {r['warps']:2d} digit {r['digit']}"
            print(f"  {where}: {r['ms']:8.3f} ms  same {r['same']}")
        for r in results:
            if r["k"] == k and "error" in r:
                print(f"  block {r['block']:5d} warps {r['warps']:2d} digit {r['digit']}: {r['error']}")
    if args.output is not None:
        found = {"rows": args.rows, "vocab": args.vocab, "results": results}
        write_result(args.output, {**provenance("probes.topk_sweep", device, argv), **found})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
