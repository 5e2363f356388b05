"""The radix select's launch parameters on a GPU: BLOCK, num_warps and DIGIT of
service/engine/heads/topk_kernel.py, each timed on the same logits, each checked against the module's
defaults (the same ids, shift and ranks).

    python -m benchmarks.probes.topk_sweep [--rows 4096] [--vocab 152064] [--k 100 1000] [--reps 20]
    python -m benchmarks.probes.topk_sweep --gathered --rows 512 --k 100     # the serving path, a chunk
    TRITON_INTERPRET=1 python -m benchmarks.probes.topk_sweep --device cpu --rows 4 --vocab 3000 --reps 1 \\
        --blocks 512 --warps 4 --digits 8                              # CPU smoke test

bf16 logits [rows, V] (random, scaled like a 7B head's) at T = 0.7; `select` over every row with K
(stats and write kernels), median milliseconds over --reps after 3 warm-ups (CUDA events). Prints
one line per configuration and K, fastest first, and writes them to --output (JSON).

`--gathered`: what a chunk of `top_logprobs` K rows runs while serving: extras_radix.Batch.make and
`score`'s launch, with Candidates (the stats pass bounding each row's K-th key, the gather, the gated
exact selection and write for the rows that overflow); `same` is the rows' ExtraScores (`finish`:
top ids, ranks, top log-probs) against those at the module's defaults.
"""

from __future__ import annotations

import argparse
import itertools

import numpy as np
import torch

from benchmarks.harness import median_ms, provenance, write_result
from benchmarks.probes.head_extras import asks, common_arguments, random_rows
from service.engine.heads import topk_kernel
from service.engine.heads.base import ExtraScores
from service.engine.heads.extras_radix import Batch, finish


def gathered(z: torch.Tensor, targets: torch.Tensor, inv_t: torch.Tensor, k: int, block: int) -> Batch:
    """A chunk of z's rows asking the top k, as serving runs it (extras_radix.Batch.make and `score`'s
    launch) but at `block`: the batch, whose `finish` gives the rows' ExtraScores."""
    rows = z.shape[0]
    batch = Batch.make(
        asks(rows, z.device, top=k), np.zeros(rows, dtype=np.int64), targets, inv_t, 1.0, z, lambda _: z
    )
    topk_kernel.launch(
        z, batch.local, batch.targets, batch.scale, batch.inv_t, batch.k, batch.out,
        picks=batch.picks, found=batch.found, block=block,
    )  # fmt: skip
    return batch


def same_extras(got: ExtraScores, want: ExtraScores) -> bool:
    """The same top ids and ranks, and top log-probs within the shift's rounding."""
    assert got.top_ids is not None
    assert want.top_ids is not None
    assert got.top_logprobs is not None
    assert want.top_logprobs is not None
    return bool(
        torch.equal(got.top_ids, want.top_ids) and torch.equal(got.ranks, want.ranks)
        and torch.allclose(got.top_logprobs, want.top_logprobs, rtol=1e-5, atol=1e-5)
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--k", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--blocks", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--warps", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--digits", type=int, nargs="+", default=[4, 8])
    parser.add_argument(
        "--gathered", action="store_true", help="time the serving path (`launch` with Candidates)"
    )
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
        served = finish(gathered(z, targets, inv_t, k, topk_kernel.BLOCK)) if args.gathered else None
        digits = [topk_kernel.DIGIT] if args.gathered else args.digits  # the gather path never histograms
        for block, warps, digit in itertools.product(args.blocks, args.warps, digits):
            topk_kernel.NUM_WARPS = warps
            try:
                if served is not None:
                    same = same_extras(finish(gathered(z, targets, inv_t, k, block)), served)
                else:
                    got = topk_kernel.select(z, rows, targets, 1.0, inv_t, k, block=block, digit=digit)
                    assert got.ids is not None
                    assert want.ids is not None
                    same = bool(
                        torch.equal(got.ids, want.ids) and torch.equal(got.ranks, want.ranks)
                        and torch.allclose(got.shift, want.shift, rtol=1e-5, atol=1e-5)
                    )  # fmt: skip

                def run(k: int = k, block: int = block, digit: int = digit) -> None:
                    if args.gathered:
                        gathered(z, targets, inv_t, k, block)
                    else:
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
