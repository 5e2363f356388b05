"""A micro-batch's reads and writes of a model's pool (cache/row_slots.py, cache/pool.py), under the fused
decoder eager and through its CUDA graphs (EagerRecorder on CPU: the graph body's static index of pool
rows, the rows not kept written to the trash row):

- the keys, values and hidden states written are the forward's own, at the plan's pool rows;
- a later micro-batch that reads them (a cached root, and a chunk's store filled from the pool)
  gives the hidden states of the whole sequence computed at once.
"""

from __future__ import annotations

import numpy as np
import torch

from service.core.cache_plan import BLOCK
from service.core.jobs import Chunk, SequenceJob
from service.core.prefix_cache import ChunkStep, PrefixIndex
from service.core.prefixes import alone, share
from service.engine.batch.kv_store import KVStore
from service.engine.batch.packing import PackedBatch, pack
from service.engine.cache.pool import ModelPool
from service.engine.decoder import FusedDecoder
from service.engine.decoder.graphs import EagerRecorder, GraphedDecoder
from service.engine.ops.elementwise import TORCH
from tests.engine.decoder.test_fused import KERNEL, packed_model
from tests.support import models

CPU = torch.device("cpu")


def _job(tokens: np.ndarray, first_action: int = 1) -> SequenceJob:
    return SequenceJob(tokens, np.arange(first_action, tokens.shape[0]), 1.0, False)


def _planned(index: PrefixIndex, jobs: list[SequenceJob], shared: bool = False) -> PackedBatch:
    """The micro-batch of `jobs` as the batcher plans it: lookups, the forest cut at each floor, the plan."""
    hits = [index.lookup(job) for job in jobs]
    lease = index.plan(list(zip(jobs, hits, strict=True)))
    index.release(lease)
    floors, roots = [h.cached for h in hits], [h.root for h in hits]
    if shared:
        forest = share([j.tokens for j in jobs], 4, None, floors, roots)
    else:
        forest = alone([j.num_tokens for j in jobs], floors)
    return pack(jobs, CPU, forest=forest, cache=lease.plan)


def _hidden(decoder: object, batch: PackedBatch, pool: ModelPool) -> torch.Tensor:
    attached = batch.attach(None, pool, "policy")
    with torch.inference_mode():
        return attached.hidden(lambda rows: decoder(attached, rows))  # type: ignore[operator]


def test_graphs_write_the_pool_as_the_eager_forward_does_and_reads_score_as_the_whole() -> None:
    model = packed_model("qwen2")
    config = model.config
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, models.VOCAB, 3 * BLOCK + 5)
    first = [_job(np.concatenate((prompt, rng.integers(3, models.VOCAB, n)))) for n in (9, 14)]
    eager = FusedDecoder(model.base_model, KERNEL, TORCH, 0)
    pools = [ModelPool.allocate(config, 32, torch.float32, CPU) for _ in range(2)]
    graph = GraphedDecoder(FusedDecoder(model.base_model, KERNEL, TORCH, 0), EagerRecorder(), 512, True, 8)
    graph.attach_pool(pools[1])
    index = PrefixIndex(32, ["policy"])
    batch = _planned(index, first, shared=True)
    assert batch.cache is not None
    want = _hidden(eager, batch, pools[0])
    got = _hidden(graph, batch, pools[1])
    assert graph.graphs == 1  # the graph ran, writing the pool through its static index
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    rows = torch.cat([torch.arange(s * BLOCK, (s + 1) * BLOCK) for s in range(len(index._blocks))])
    for layer in range(config.num_hidden_layers):
        torch.testing.assert_close(
            pools[1].keys[layer][rows], pools[0].keys[layer][rows], atol=1e-5, rtol=1e-5
        )
        torch.testing.assert_close(
            pools[1].values[layer][rows], pools[0].values[layer][rows], atol=1e-5, rtol=1e-5
        )
    torch.testing.assert_close(pools[1].hidden[rows], pools[0].hidden[rows], atol=1e-5, rtol=1e-5)
    # a later micro-batch: one sequence reads the prompt's blocks (its actions from inside them read
    # the hidden states kept), a long one reads its cached context into its store in chunks
    later = _job(np.concatenate((prompt, rng.integers(3, models.VOCAB, 11))))
    read = _planned(index, [later])
    assert read.cache is not None
    assert read.cache.read is not None
    whole, real = pack([later], CPU), later.actions.shape[0]  # the rows past it: filler actions
    torch.testing.assert_close(
        _hidden(graph, read, pools[1])[:real], _hidden(eager, whole, pools[0])[:real], atol=1e-4, rtol=1e-4
    )
    long = _job(np.concatenate((first[0].tokens, rng.integers(3, models.VOCAB, 90))), first_action=10)
    hit = index.lookup(long)
    assert hit.cached == first[0].num_tokens // BLOCK * BLOCK
    store, tail, parts = KVStore(long.num_tokens + 128), None, []
    for start, end in ((hit.cached, hit.cached + 64), (hit.cached + 64, long.num_tokens)):
        chunk = Chunk(long, 7, start, end, hit.cached)
        lease = index.plan([], ChunkStep(long, start, end, hit, tail))
        index.release(lease)
        tail = lease.tail
        attached = pack([], CPU, chunk=chunk, cache=lease.plan).attach(store, pools[1], "policy")
        with torch.inference_mode():
            hidden = attached.hidden(lambda rows, a=attached: graph(a, rows))  # type: ignore[misc]
        parts.append(hidden[: chunk.actions.shape[0]])
    alone_batch = pack([long], CPU)
    with torch.inference_mode():
        want_long = eager(alone_batch, alone_batch.hidden_index)[: long.actions.shape[0]]
    torch.testing.assert_close(torch.cat(parts), want_long, atol=1e-4, rtol=1e-4)
    assert index.lookup(_job(np.concatenate((long.tokens, [5])))).cached == long.num_tokens // BLOCK * BLOCK
