"""The partial-sums strategies: tensor parallel's all-reduced projection equals one process's.

Two ranks run as threads whose all-reduces meet at a barrier (ThreadRanks); each holds half of the
projection's input columns, as a row-parallel o_proj or down_proj shard does.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from service.engine.strategies.gemm import ONE_CALL, FixedRows
from service.engine.strategies.sums import LOCAL, AllReduce
from tests.engine.parallel.thread_ranks import ThreadRanks


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.nn.Linear:
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, dtype=weight.dtype)
    with torch.no_grad():
        linear.weight.copy_(weight)
        if bias is not None:
            linear.bias.copy_(bias)
    return linear


def test_local_adds_each_chunk_and_its_bias_into_the_residual() -> None:
    gen = torch.Generator().manual_seed(0)
    x, a = (
        torch.randn(10, 8, generator=gen, dtype=torch.float64),
        torch.randn(10, 12, generator=gen, dtype=torch.float64),
    )
    w, b = (
        torch.randn(8, 12, generator=gen, dtype=torch.float64),
        torch.randn(8, generator=gen, dtype=torch.float64),
    )
    want = x + a @ w.T + b
    got = x.clone()
    parts = [(slice(0, 4), a[0:4]), (slice(4, 10), a[4:10])]
    LOCAL.add(got, parts, _linear(w, b), ONE_CALL)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_all_reduce_over_column_shards_equals_the_whole_projection() -> None:
    gen = torch.Generator().manual_seed(1)
    rows, hidden, inner = 2048, 8, 12  # 2048 rows: FixedRows(1024) runs two calls
    x = torch.randn(rows, hidden, generator=gen, dtype=torch.float64)
    a = torch.randn(rows, inner, generator=gen, dtype=torch.float64)
    w, b = (
        torch.randn(hidden, inner, generator=gen, dtype=torch.float64),
        torch.randn(hidden, generator=gen, dtype=torch.float64),
    )
    want = x + a @ w.T + b
    ranks = ThreadRanks(2)
    half = inner // 2

    def rank(r: int) -> torch.Tensor:
        cols = slice(r * half, (r + 1) * half)
        shard = _linear(w[:, cols], b)  # each rank holds the whole bias, added once after the sum
        got = x.clone()
        parts = ((slice(s, s + 512), a[s : s + 512, cols]) for s in range(0, rows, 512))
        AllReduce(ranks.shard(r).all_reduce_).add(got, parts, shard, FixedRows(1024))
        return got

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(rank, range(2)))
    for got in results:
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
