"""A micro-batch's reads and writes of the pools, laid out on its packed row from the torch-free plan
(core/prefix_cache.CachePlan) and the row's segments (batch/packing.py).

Positions are a sequence's, rows the packed row's, pool rows slot * BLOCK + position % BLOCK, and
action indices index the micro-batch's [A] action rows (every job's actions in order, then the
chunk's). For a whole sequence i whose first C_i tokens are cached (its root node starts at C_i):

- its keys: the pool rows of its read blocks, gathered after the row's N keys once per distinct read
  (`read`, and `read_at`: where each root's cached rows start in it, for the key index);
- the actions t whose predicting position t - 1 < C_i: their final hidden states from the pool
  (`cached`, `cached_rows`); the decoder computes the others (`computed`, `computed_rows`);
- its written blocks: the keys and values of their positions' rows, and the hidden states of its
  action rows there, per model the plan writes for (`saves`, `hidden_saves`; one write a pool row).

A chunk's reads fill its store's first C tokens (`fill`); its written blocks are read from the store
(`store_saves`), whose positions before the chunk earlier chunks wrote.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from service.core.cache_plan import BLOCK, CachePlan, Reuse
from service.core.jobs import Chunk, SequenceJob
from service.core.prefixes import Forest
from service.engine.cache.pool import ModelPool, PoolIO, Saves

ToDevice = Callable[[np.ndarray], torch.Tensor]


def rows_at(path: Sequence[int], positions: np.ndarray, starts: np.ndarray, forest: Forest) -> np.ndarray:
    """[P] the rows of a sequence's `positions` (each at or past its root's start), through `path`."""
    nodes = np.asarray(path, dtype=np.int64)
    first = np.asarray([forest.nodes[n].start for n in path], dtype=np.int64)
    ends = np.asarray([forest.nodes[n].end for n in path], dtype=np.int64)
    at = np.searchsorted(ends, positions, side="right")
    return np.asarray(starts[nodes[at]] + positions - first[at], dtype=np.int64)


def pool_rows(slots: Sequence[int], positions: np.ndarray, first_block: int = 0) -> np.ndarray:
    """The pool rows of `positions`, in blocks first_block, first_block + 1, ... held in `slots`."""
    table = np.asarray(slots, dtype=np.int64)
    return np.asarray(table[positions // BLOCK - first_block] * BLOCK + positions % BLOCK, dtype=np.int64)


def written(reuse: Reuse) -> np.ndarray:
    """The positions of a Reuse's written blocks."""
    first = reuse.write_from * BLOCK
    return np.arange(first, first + len(reuse.write) * BLOCK, dtype=np.int64)


@dataclass(slots=True)
class _Pairs:
    """(source, pool row) pairs per model, one per pool row (the first given)."""

    pairs: dict[str, list[tuple[np.ndarray, np.ndarray]]] = field(default_factory=dict)

    def add(self, models: frozenset[str], src: np.ndarray, dst: np.ndarray) -> None:
        if src.size:
            for m in models:
                self.pairs.setdefault(m, []).append((src, dst))

    def saves(self, to: ToDevice) -> dict[str, Saves]:
        out = {}
        for m, parts in self.pairs.items():
            src, dst = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
            dst, first = np.unique(dst, return_index=True)
            out[m] = Saves(to(src[first]), to(dst))
        return out


@dataclass(frozen=True, slots=True)
class CacheRows:
    """A micro-batch's reads and writes of every model's pool, on the device."""

    read: torch.Tensor | None
    saves: dict[str, Saves]
    fill: torch.Tensor | None
    store_saves: dict[str, Saves]
    computed: torch.Tensor | None  # [Ac] action indices (None: the decoder computes every action row)
    computed_rows: torch.Tensor | None
    cached: torch.Tensor | None  # [Ah] action indices whose hidden states are the pool's
    cached_rows: torch.Tensor | None
    hidden_saves: dict[str, Saves]

    def io(self, model: str, pool: ModelPool) -> PoolIO:
        return PoolIO(pool, self.read, self.saves.get(model), self.fill, self.store_saves.get(model))

    def hidden(
        self,
        compute: Callable[[torch.Tensor], torch.Tensor],
        index: torch.Tensor,
        model: str,
        pool: ModelPool,
    ) -> torch.Tensor:
        """[A, H] the action rows' final hidden states: `compute(rows)` (the decoder) where computed,
        the pool's where cached; the written ones kept in the pool."""
        if self.cached is None:
            hidden = compute(index)
        else:
            assert self.computed is not None
            assert self.computed_rows is not None
            assert self.cached_rows is not None
            part = compute(self.computed_rows)
            hidden = part.new_empty((index.shape[0], part.shape[1]))
            hidden.index_copy_(0, self.computed, part[: self.computed.shape[0]])
            hidden.index_copy_(0, self.cached, pool.hidden.index_select(0, self.cached_rows))
        saves = self.hidden_saves.get(model)
        if saves is not None:
            saves.write(pool.hidden, hidden)
        return hidden


def lay_out(  # noqa: PLR0917 (a packed row's every part)
    plan: CachePlan,
    jobs: Sequence[SequenceJob],
    forest: Forest,
    starts: np.ndarray,
    chunk: Chunk | None,
    firsts: np.ndarray,
    hidden_index: np.ndarray,
    step: int,
    to: ToDevice,
) -> tuple[CacheRows, dict[int, int]]:
    """The micro-batch's CacheRows, and where each cached root's rows start in `read` (node -> offset).
    `firsts`: each job's (then the chunk's) first action index; `hidden_index` [A] the rows the packing
    gave every action (any row where cached); `step`: the computed actions are padded to it."""
    read: list[np.ndarray] = []
    read_at: dict[int, int] = {}
    offsets: dict[tuple[int, ...], int] = {}
    saves, hidden_saves, store_saves = _Pairs(), _Pairs(), _Pairs()
    cached = np.zeros(hidden_index.shape[0], dtype=np.bool_)
    cached_rows = np.zeros(hidden_index.shape[0], dtype=np.int64)
    for i, (job, reuse, path) in enumerate(zip(jobs, plan.jobs, forest.paths, strict=True)):
        root = path[0]
        if reuse.read and root not in read_at:
            if reuse.read not in offsets:
                offsets[reuse.read] = sum(r.shape[0] for r in read)
                read.append(pool_rows(reuse.read, np.arange(reuse.cached, dtype=np.int64)))
            read_at[root] = offsets[reuse.read]
        before = job.actions - 1
        index = firsts[i] + np.arange(before.shape[0])
        inside = before < reuse.cached
        cached[index[inside]] = True
        cached_rows[index[inside]] = pool_rows(reuse.read, before[inside])
        if reuse.write:
            positions = written(reuse)
            saves.add(
                reuse.models,
                rows_at(path, positions, starts, forest),
                pool_rows(reuse.write, positions, reuse.write_from),
            )
            _add_hidden(hidden_saves, reuse, before, index, reuse.cached)
    fill = None
    if chunk is not None and plan.chunk is not None:
        reuse = plan.chunk
        before = chunk.actions - 1
        index = firsts[len(jobs)] + np.arange(before.shape[0])
        inside = before < reuse.cached
        cached[index[inside]] = True
        cached_rows[index[inside]] = pool_rows(reuse.read, before[inside])
        if reuse.read:
            fill = to(pool_rows(reuse.read, np.arange(reuse.cached, dtype=np.int64)))
        if reuse.write:
            positions = written(reuse)
            store_saves.add(reuse.models, positions, pool_rows(reuse.write, positions, reuse.write_from))
            _add_hidden(hidden_saves, reuse, before, index, chunk.start)
    computed = np.flatnonzero(~cached)
    pad = -computed.shape[0] % step if computed.size else step  # the decoder's rows: a multiple of step
    padded = np.concatenate([computed, np.zeros(pad, dtype=np.int64)])
    some = bool(cached.any())
    rows = CacheRows(
        read=to(np.concatenate(read)) if read else None,
        saves=saves.saves(to),
        fill=fill,
        store_saves=store_saves.saves(to),
        computed=to(computed) if some else None,
        computed_rows=to(hidden_index[padded]) if some else None,
        cached=to(np.flatnonzero(cached)) if some else None,
        cached_rows=to(cached_rows[cached]) if some else None,
        hidden_saves=hidden_saves.saves(to),
    )
    return rows, read_at


def _add_hidden(
    pairs: _Pairs, reuse: Reuse, before: np.ndarray, index: np.ndarray, computed_from: int
) -> None:
    """The hidden states of the actions whose predicting position lies in a written block, computed here."""
    lo, hi = reuse.write_from * BLOCK, (reuse.write_from + len(reuse.write)) * BLOCK
    keep = (before >= max(lo, computed_from)) & (before < hi)
    pairs.add(reuse.models, index[keep], pool_rows(reuse.write, before[keep], reuse.write_from))
