"""batch/route_buffers.lay_out: the given ids packed on the row, row by row as a per-position reference lays
them, and the engine's range guard."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from service.core.jobs import Chunk, GivenRoutes, SequenceJob
from service.core.prefixes import Forest, share
from service.engine.batch.packing import pack
from service.engine.contract import MoeShape

SHAPE = MoeShape(layers=3, experts=16, top_k=2)
CPU = torch.device("cpu")


def _routes(rng: np.random.Generator, positions: int, dtype: type = np.uint8) -> np.ndarray:
    keys = rng.random((positions, SHAPE.layers, SHAPE.experts))
    return np.argsort(keys, axis=-1)[..., : SHAPE.top_k].astype(dtype)


def _job(tokens: np.ndarray, routes: GivenRoutes | None) -> SequenceJob:
    return SequenceJob(tokens, np.arange(1, tokens.shape[0]), 1.0, False, routes=routes)


def _reference(jobs: list[SequenceJob], forest: Forest, chunk: Chunk | None, tokens: int):  # type: ignore[no-untyped-def]
    """given [tokens, layers, k] and covered [tokens], one position at a time: the row of position p
    of sequence i is in the node of its path that holds p; the chunk's rows follow the nodes'."""
    given = np.zeros((tokens, SHAPE.layers, SHAPE.top_k), dtype=np.int64)
    covered = np.zeros(tokens, dtype=bool)
    row_of_node = np.cumsum([0] + [n.length for n in forest.nodes])
    for i, path in enumerate(forest.paths):
        routes = jobs[i].routes
        for n in path:
            node = forest.nodes[n]
            for p in range(node.start, node.end):
                if routes is not None and routes.start <= p < routes.end:
                    given[row_of_node[n] + p - node.start] = routes.experts[p - routes.start]
                    covered[row_of_node[n] + p - node.start] = True
    if chunk is not None and chunk.job.routes is not None:
        routes, first = chunk.job.routes, int(row_of_node[-1])
        for p in range(chunk.start, chunk.end):
            if routes.start <= p < routes.end:
                given[first + p - chunk.start] = routes.experts[p - routes.start]
                covered[first + p - chunk.start] = True
    return given, covered


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)  # cuda: packed in pinned memory, copied without a wait
def test_given_routes_land_on_their_rows_with_shared_prefixes_and_a_chunk(device: str) -> None:
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 100, 12)
    prompt_routes = _routes(rng, 12)
    a = np.concatenate([prompt, rng.integers(0, 100, 5)])
    b = np.concatenate([prompt, rng.integers(0, 100, 7)])
    jobs = [
        _job(a, GivenRoutes(0, np.concatenate([prompt_routes, _routes(rng, 4)]))),  # the last uncovered
        _job(b, GivenRoutes(0, np.concatenate([prompt_routes, _routes(rng, 7)]))),
        _job(rng.integers(0, 100, 9), None),  # live routing throughout
        _job(rng.integers(0, 100, 10), GivenRoutes(3, _routes(rng, 5))),  # positions 3 .. 7
    ]
    long = _job(rng.integers(0, 100, 40), GivenRoutes(2, _routes(rng, 30)))
    chunk = Chunk(long, 7, 16, 34)
    forest = share([j.tokens for j in jobs], 8, [j.routes for j in jobs])
    assert forest.shared  # a and b compute their prompt once
    batch = pack(jobs, torch.device(device), step=16, chunk=chunk, forest=forest, moe=SHAPE)
    routes = batch.routes
    assert routes is not None
    assert routes.given is not None
    assert routes.covered is not None
    assert routes.given.dtype == torch.uint8
    given, covered = _reference(jobs, forest, chunk, batch.num_tokens)
    assert routes.given.device.type == device
    got = routes.given.cpu().numpy()  # waits for the copy
    assert routes.covered.cpu().numpy().tolist() == covered.tolist()
    assert np.array_equal(got[covered], given[covered])
    assert not got[~covered].any()  # the rows between segments are zeroed


def test_an_expert_id_out_of_range_is_refused_naming_the_sequence() -> None:
    rng = np.random.default_rng(1)
    good = _routes(rng, 6)
    bad = _routes(rng, 6)
    bad[4, 1, 0] = SHAPE.experts  # one past the last expert
    jobs = [
        _job(rng.integers(0, 100, 6), GivenRoutes(0, good)),
        _job(rng.integers(0, 100, 6), GivenRoutes(0, bad)),
    ]
    with pytest.raises(ValueError, match=r"sequence 1: an expert id outside 0\.\.15"):
        pack(jobs, CPU, step=4, moe=SHAPE)
    jobs[1] = _job(jobs[1].tokens, GivenRoutes(0, _routes(rng, 6)))
    assert pack(jobs, CPU, step=4, moe=SHAPE).routes is not None


@pytest.mark.parametrize("value", [256 + 3, -1])
def test_ids_in_a_wider_dtype_are_checked_before_they_are_narrowed(value: int) -> None:
    rng = np.random.default_rng(2)
    wide = _routes(rng, 5, np.int32)
    wide[2, 0, 1] = value  # 259 would wrap to 3 in uint8, -1 to 255
    jobs = [_job(rng.integers(0, 100, 5), GivenRoutes(0, wide))]
    with pytest.raises(ValueError, match="sequence 0: an expert id outside"):
        pack(jobs, CPU, step=4, moe=SHAPE)
