"""The vocabulary-parallel embedding (parallel/vocab_layers.py) against the whole one: every token
embedded once, over ranks run as threads."""

from __future__ import annotations

import torch

from service.engine.parallel import sharding
from service.engine.parallel.vocab_layers import VocabParallelEmbedding
from tests.engine.parallel.thread_ranks import run_ranks


def test_sharded_embedding_embeds_every_token() -> None:
    vocab, hidden, world = 50, 8, 3
    weight = torch.randn(vocab, hidden)
    ids = torch.randint(0, vocab, (2, 33))

    def rank(r: int, shard: sharding.Shard) -> torch.Tensor:
        start, end = sharding.vocabulary(vocab, world, r)
        embed = VocabParallelEmbedding(torch.nn.Parameter(weight[start:end].clone()), start, vocab, shard)
        out: torch.Tensor = embed(ids)
        return out

    for got in run_ranks(world, rank):
        torch.testing.assert_close(got, weight[ids])
