"""The vocabulary-parallel head's scores against the unsharded head's, on random logits.

The ranks run as threads of this process whose all-reduces meet at a barrier
(tests/engine/parallel/thread_ranks.py), so the arithmetic of the sharded softmax is checked without
processes; the real collectives (gloo) are tested end to end in tests/parity/test_tensor_parallel.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from service.engine.heads.base import LogitTransform
from service.engine.heads.chunked import score_actions
from service.engine.heads.vocab_parallel import score_actions as sharded_scores
from service.engine.parallel import sharding
from service.engine.parallel.vocab_layers import VocabParallelHead
from tests.engine.parallel.thread_ranks import run_ranks


@pytest.mark.parametrize(
    ("world", "vocab", "transform", "temperature"),
    [
        (2, 96, LogitTransform(), False),
        (3, 100, LogitTransform(scale=0.5), True),  # uneven shards: 34, 34, 32 rows
        (4, 97, LogitTransform(softcap=3.0), True),
    ],
)
def test_sharded_head_scores_as_the_whole_head(
    world: int, vocab: int, transform: LogitTransform, temperature: bool
) -> None:
    gen = torch.Generator().manual_seed(world)
    rows, hidden = 37, 16
    weight = torch.randn(vocab, hidden, generator=gen) * 2  # peaked softmaxes: large logits
    h = torch.randn(rows, hidden, generator=gen)
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    inv_t = torch.rand(rows, generator=gen) + 0.5 if temperature else None
    whole = torch.nn.Linear(hidden, vocab, bias=False)
    whole.weight.data = weight
    want = score_actions(
        hidden=h,
        targets=targets,
        inv_temperature=inv_t,
        lm_head=whole,
        transform=transform,
        chunk_rows=8,
        want_entropy=True,
        fused=False,
    )

    def rank(r: int, shard: sharding.Shard) -> Any:
        start, end = sharding.vocabulary(vocab, world, r)
        head = VocabParallelHead(torch.nn.Parameter(weight[start:end].clone()), start, vocab, shard)
        return sharded_scores(
            hidden=h,
            targets=targets,
            inv_temperature=inv_t,
            lm_head=head,
            transform=transform,
            chunk_rows=8,
            want_entropy=True,
        )

    for got in run_ranks(world, rank):
        torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-5, rtol=1e-5)
        assert want.entropy is not None
        torch.testing.assert_close(got.entropy, want.entropy, atol=1e-5, rtol=1e-5)
