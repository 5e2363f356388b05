"""Ranks as threads of one process: each rank's Shard all-reduces and all-gathers with the others at a
barrier, so sharded arithmetic is checked without processes or a process group."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

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


def run_ranks(world: int, work: Callable[[int, sharding.Shard], Any]) -> list[Any]:
    """work(rank, its Shard) on `world` threads whose collectives meet; each rank's result, in order."""
    ranks = ThreadRanks(world)
    with ThreadPoolExecutor(world) as pool:
        return list(pool.map(lambda r: work(r, ranks.shard(r)), range(world)))
