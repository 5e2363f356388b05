"""The vocabulary-parallel head and embedding against the unsharded ones, on random logits.

The ranks run as threads of this process whose all-reduces meet at a barrier (`ThreadRanks`), so the
arithmetic of the sharded softmax is checked without processes; the real collectives (gloo) are
tested end to end in tests/test_tensor_parallel.py.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from service.engine.heads.base import LogitTransform
from service.engine.heads.chunked import score_actions
from service.engine.heads.vocab_parallel import VocabParallelEmbedding, VocabParallelHead
from service.engine.heads.vocab_parallel import score_actions as sharded_scores
from service.engine.parallel import sharding


class ThreadRanks:
    """All-reduces among `world` threads: each contributes its tensor, all get the reduction."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.barrier = threading.Barrier(world)
        self.parts: dict[int, torch.Tensor] = {}

    def shard(self, rank: int) -> sharding.Shard:
        ranks = self

        class _Shard(sharding.Shard):
            def all_reduce_(self, x: torch.Tensor) -> None:
                ranks.reduce(rank, x, lambda parts: torch.stack(parts).sum(0))

            def all_reduce_max_(self, x: torch.Tensor) -> None:
                ranks.reduce(rank, x, lambda parts: torch.stack(parts).amax(0))

            def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
                return list(ranks.gather(rank, x))

        return _Shard(rank, self.world)

    def gather(self, rank: int, x: torch.Tensor) -> list[torch.Tensor]:
        self.parts[rank] = x.clone()
        self.barrier.wait()
        every = [self.parts[r] for r in range(self.world)]
        self.barrier.wait()
        return every

    def reduce(self, rank: int, x: torch.Tensor, op: Callable[[list[torch.Tensor]], torch.Tensor]) -> None:
        self.parts[rank] = x.clone()
        self.barrier.wait()
        result = op([self.parts[r] for r in range(self.world)])
        self.barrier.wait()
        x.copy_(result)


def _run(world: int, work: Callable[[int, sharding.Shard], Any]) -> list[Any]:
    ranks = ThreadRanks(world)
    with ThreadPoolExecutor(world) as pool:
        return list(pool.map(lambda r: work(r, ranks.shard(r)), range(world)))


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

    for got in _run(world, rank):
        torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-5, rtol=1e-5)
        assert want.entropy is not None
        torch.testing.assert_close(got.entropy, want.entropy, atol=1e-5, rtol=1e-5)


def test_sharded_embedding_embeds_every_token() -> None:
    vocab, hidden, world = 50, 8, 3
    weight = torch.randn(vocab, hidden)
    ids = torch.randint(0, vocab, (2, 33))

    def rank(r: int, shard: sharding.Shard) -> torch.Tensor:
        start, end = sharding.vocabulary(vocab, world, r)
        embed = VocabParallelEmbedding(torch.nn.Parameter(weight[start:end].clone()), start, vocab, shard)
        out: torch.Tensor = embed(ids)
        return out

    for got in _run(world, rank):
        torch.testing.assert_close(got, weight[ids])


def test_layout_slices_cover_every_tensor_once() -> None:
    """Concatenating every rank's slice of each sharded tensor gives the whole tensor."""
    from transformers import Qwen2Config

    config = Qwen2Config(
        vocab_size=90, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2
    )
    world, d = 2, 16
    shapes = {
        "model.layers.0.self_attn.q_proj.weight": (4 * d, 64),
        "model.layers.0.self_attn.k_proj.bias": (2 * d,),
        "model.layers.0.self_attn.o_proj.weight": (64, 4 * d),
        "model.layers.0.mlp.up_proj.weight": (96, 64),
        "model.layers.0.mlp.down_proj.weight": (64, 96),
        "lm_head.weight": (90, 64),
    }
    layouts = [sharding.Layout.of(config, sharding.Shard(r, world)) for r in range(world)]
    for name, shape in shapes.items():
        parts = [layout.part(name) for layout in layouts]
        dims = {p[0] for p in parts if p is not None}
        assert len(dims) == 1, name
        (dim,) = dims
        spans = [(p[1], p[2]) for p in parts if p is not None]
        assert spans[0][0] == 0
        assert spans[-1][1] == shape[dim]
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans)), name
    assert layouts[0].part("model.layers.0.input_layernorm.weight") is None  # replicated
    with pytest.raises(ValueError, match="does not divide the 2 key/value heads"):
        sharding.Layout.of(config, sharding.Shard(0, 4))
