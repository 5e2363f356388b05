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

`--gathered`: what a chunk of `top_logprobs` K rows runs while serving (extras_radix.Batch without a
sampler): `launch` with Candidates (the stats pass bounding each row's K-th key, the gather, the gated
exact selection and write for the rows that overflow), its buffers made as Batch.make makes them;
`same` is each row's K largest (z desc, id asc), shift and rank against `select` at the defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools

import torch

from benchmarks.harness import median_ms, provenance, write_result
from benchmarks.probes.head_extras import common_arguments, random_rows
from service.engine.heads import topk_kernel


def gathered(  # noqa: PLR0917
    z: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor, inv_t: torch.Tensor, k: int, block: int
) -> tuple[topk_kernel.Out, topk_kernel.Candidates]:
    """The serving path's kernels for top_logprobs k over `rows` of z, in new buffers (Batch.make's)."""
    r, vocab, device = rows.shape[0], z.shape[1], z.device
    out = dataclasses.replace(
        topk_kernel.Out.empty(r, device),
        ids=torch.full((r, k), -1, dtype=torch.int32, device=device),
        values=torch.empty(r, k, dtype=z.dtype, device=device),
        picked=torch.empty(r, 1, dtype=z.dtype, device=device),
    )
    found = topk_kernel.Candidates.empty(r, min(vocab, k + max(k // 2, 64)), z.dtype, device)
    ks = torch.full((r,), k, dtype=torch.int32, device=device)
    picks = targets[rows][:, None].contiguous()
    topk_kernel.launch(
        z, rows, targets[rows], 1.0, inv_t[rows], ks, out, picks=picks, found=found, block=block
    )
    return out, found


def top_lists(out: topk_kernel.Out, found: topk_kernel.Candidates, k: int) -> list[list[int]]:
    """Each row's k largest ids (z desc, id asc), ascending: from its candidates where they fit, else
    from the exact selection's ids."""
    width = found.ids.shape[1]
    keys = topk_kernel.order_keys(found.values).cpu().tolist()
    ids, counts = found.ids.cpu().tolist(), found.count.cpu().tolist()
    assert out.ids is not None
    exact = out.ids.cpu().tolist()
    lists = []
    for i, n in enumerate(counts):
        if n > width:
            lists.append(sorted(exact[i]))
            continue
        best = sorted(zip(keys[i][:n], ids[i][:n], strict=True), key=lambda kv: (-kv[0], kv[1]))[:k]
        lists.append(sorted(t for _, t in best))
    return lists


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
        assert want.ids is not None
        want_lists = [sorted(row) for row in want.ids.cpu().tolist()]
        digits = [topk_kernel.DIGIT] if args.gathered else args.digits  # the gather path never histograms
        for block, warps, digit in itertools.product(args.blocks, args.warps, digits):
            topk_kernel.NUM_WARPS = warps
            try:
                if args.gathered:
                    served, candidates = gathered(z, rows, targets, inv_t, k, block)
                    same = bool(
                        top_lists(served, candidates, k) == want_lists
                        and torch.equal(served.ranks.long(), want.ranks.long())
                        and torch.allclose(served.shift, want.shift, rtol=1e-5, atol=1e-5)
                    )  # fmt: skip
                else:
                    got = topk_kernel.select(z, rows, targets, 1.0, inv_t, k, block=block, digit=digit)
                    assert got.ids is not None
                    same = bool(
                        torch.equal(got.ids, want.ids) and torch.equal(got.ranks, want.ranks)
                        and torch.allclose(got.shift, want.shift, rtol=1e-5, atol=1e-5)
                    )  # fmt: skip

                def run(k: int = k, block: int = block, digit: int = digit) -> None:
                    if args.gathered:
                        gathered(z, rows, targets, inv_t, k, block)
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
