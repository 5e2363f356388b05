"""The vocabulary-parallel embedding and lm_head of a tensor-parallel rank: each holds rows
[start, end) of the vocabulary (sharding.Layout.vocab) on the model's own parameters.

    embedding: ids [...] -> [..., H], the rows this rank holds looked up, zeros elsewhere, one
               all-reduce over the ranks
    lm_head:   hidden [n, H] -> this rank's logits [n, end - start] only (heads/vocab_parallel.py
               scores them without gathering)

`install` swaps a model's own modules for these (loading/shards.py, before its slices are read).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from service.engine.parallel.sharding import Shard


class VocabParallelEmbedding(torch.nn.Embedding):
    """nn.Embedding of this rank's vocabulary rows; a forward sums every rank's lookups."""

    def __init__(self, weight: torch.nn.Parameter, start: int, vocab_size: int, shard: Shard) -> None:
        super().__init__(weight.shape[0], weight.shape[1], device="meta")
        self.weight = weight  # the same Parameter: a tied head keeps sharing it
        self.start, self.end, self.vocab_size, self.shard = start, start + weight.shape[0], vocab_size, shard

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] -> [..., H]: the rows this rank holds, zeros elsewhere, all-reduced."""
        local = ids - self.start
        outside = (ids < self.start) | (ids >= self.end)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x.masked_fill_(outside[..., None], 0)
        self.shard.all_reduce_(x)
        return x


class VocabParallelHead(torch.nn.Linear):
    """The lm_head's rows [start, end) of the vocabulary: a forward gives this rank's logits only."""

    def __init__(self, weight: torch.nn.Parameter, start: int, vocab_size: int, shard: Shard) -> None:
        super().__init__(weight.shape[1], weight.shape[0], bias=False, device="meta")
        self.weight = weight
        self.start, self.vocab_size, self.shard = start, vocab_size, shard


def install(model: Any, start: int, vocab_size: int, shard: Shard) -> None:
    """Swap the model's embedding and lm_head (when it has one) for their vocabulary-parallel twins,
    on the same parameters (tied ones stay tied)."""
    embed = model.get_input_embeddings()
    model.set_input_embeddings(VocabParallelEmbedding(embed.weight, start, vocab_size, shard))
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None:
        model.set_output_embeddings(VocabParallelHead(head.weight, start, vocab_size, shard))


def full_rows(module: Any) -> int:
    """Rows of the whole vocabulary of an embedding or a head, sharded or not."""
    if isinstance(module, VocabParallelEmbedding | VocabParallelHead):
        return module.vocab_size
    return int(module.num_embeddings if isinstance(module, torch.nn.Embedding) else module.out_features)
