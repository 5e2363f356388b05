"""The prefix cache's index: which token prefixes the engine's pool holds keys, values and final
hidden states of, for which models, and what each micro-batch reads from it and writes to it.

Blocks of BLOCK tokens, chained as vLLM's and SGLang's caches chain them: block k of a sequence is
keyed by its parent's slot (block k - 1's; -1 for block 0) and its own tokens, compared exactly (a
dict of the bytes, never a hash alone). A block lives in one slot of the pool: rows slot * BLOCK ..
slot * BLOCK + BLOCK - 1 of every model's keys, values and hidden states (engine/cache/pool.py). Per
model it records the generation of that model's weights it was computed under (valid while the
generation stands: `drop` on new weights and `flush` bump it) and which of its positions' final
hidden states the pool holds (those that were action rows where it was computed: a later sequence
whose actions fall inside a cached prefix, a teacher's prompt_logprobs over a shared system prompt,
is scored from them).

A sequence reads (`lookup`) its longest prefix of whole blocks valid for every model it is scored by
(policy, and the reference and the critic where it asks for them), short of its last token (one
token at least is computed), and short of the first action whose predicting position's hidden state
the pool lacks; a sequence that gives MoE routes (routing replay) neither reads nor writes (its keys
follow the rollout's routes, not the live router's), and one that records routes does not read
(routes are recorded only where computed). A micro-batch writes (`plan`) every whole block its
sequences compute, for the models that run and whose keys under its prefix are valid.

Eviction: least recently used first among blocks without children (a leaf before its parent), none
that a plan holds: a plan pins what it reads and writes from planning until its launch is queued
(`release`), so planning another sequence of the same micro-batch never takes a slot it reads; after
that, the accelerator's one stream orders a later micro-batch's writes into a reused slot after every
earlier micro-batch's reads. Full: blocks are not written; scoring goes on.

Torch-free. The engine owns one index (its pool's slots) and drops a model's entries when it applies
new weights; the batcher plans each micro-batch with it. One lock guards it.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from service.core.cache_plan import BLOCK, CachePlan, Reuse
from service.core.jobs import SequenceJob


@dataclass(slots=True, eq=False)
class Block:
    slot: int
    parent: Block | None
    key: tuple[int, bytes]
    depth: int  # its index in the sequences holding it
    children: int = 0
    pins: int = 0
    used: int = 0  # the tick of its last use
    alive: bool = True
    valid: dict[str, int] = field(default_factory=dict)  # model -> generation its rows were computed under
    hidden: dict[str, int] = field(default_factory=dict)  # model -> bit p: position p's hidden state held


@dataclass(frozen=True, slots=True)
class Hit:
    """A sequence's lookup: the blocks it reads, and the models whose keys under them are valid
    (what its computed tokens' keys may be written for)."""

    blocks: tuple[Block, ...] = ()
    fresh: frozenset[str] | None = None  # None: every model (nothing read)
    writes: bool = True  # False: it neither reads nor writes (given MoE routes)

    @property
    def cached(self) -> int:
        return len(self.blocks) * BLOCK

    @property
    def root(self) -> int:
        """The slot of the last block read (-1: none): sequences sharing it share the cached prefix."""
        return self.blocks[-1].slot if self.blocks else -1


MISS = Hit()
APART = Hit(writes=False)


@dataclass(frozen=True, slots=True)
class ChunkStep:
    """The chunk a micro-batch holds, for the cache: tokens [start, end) of `job`, its sequence's
    lookup (`hit`, read on its first chunk: start == hit.cached) and, on a later chunk, the last block
    its sequence wrote (`tail`, Lease.tail of the chunk before: the parent of the blocks this one
    writes; None: it writes none)."""

    job: SequenceJob
    start: int
    end: int
    hit: Hit
    tail: Block | None


@dataclass(slots=True, eq=False)
class Lease:
    """A planned micro-batch's hold on the index: what it pins, and what it wrote (undone by
    `abandon` where its launch fails)."""

    plan: CachePlan
    pinned: list[Block] = field(default_factory=list)
    written: list[tuple[Block, frozenset[str]]] = field(default_factory=list)
    tail: Block | None = None  # the chunk's sequence's last block after this micro-batch


@dataclass(frozen=True, slots=True)
class Stats:
    hit_tokens: int
    miss_tokens: int
    evicted_blocks: int
    held_blocks: int
    capacity_blocks: int


def scored_by(job: SequenceJob, served: Iterable[str]) -> frozenset[str]:
    """The models a sequence is scored by: the policy, the reference and the critic where it asks."""
    wanted = {"policy"}
    if job.return_ref:
        wanted.add("reference")
    if job.return_values:
        wanted.add("critic")
    return frozenset(wanted.intersection(served))


class PrefixIndex:
    def __init__(self, slots: int, models: Iterable[str]) -> None:
        self.capacity = slots
        self._generation = dict.fromkeys(models, 0)
        self._free = list(range(slots - 1, -1, -1))
        self._blocks: dict[tuple[int, bytes], Block] = {}
        self._evictable: list[tuple[int, int, Block]] = []  # (used, order, block), lazily pruned
        self._order = itertools.count()
        self._tick = 0
        self._lock = threading.RLock()
        self._hits = self._misses = self._evictions = 0

    @property
    def models(self) -> frozenset[str]:
        return frozenset(self._generation)

    @property
    def lock(self) -> threading.RLock:
        """Held across a lookup and the plan made from it: no drop or flush comes between."""
        return self._lock

    def lookup(self, job: SequenceJob) -> Hit:
        """What `job` would read (nothing pinned)."""
        if job.routes is not None:
            return APART
        if job.return_routes:
            return MISS
        models = scored_by(job, self._generation)
        with self._lock:
            blocks: list[Block] = []
            parent = -1
            data = np.ascontiguousarray(job.tokens, dtype=np.int64).tobytes()
            for k in range((job.num_tokens - 1) // BLOCK):
                block = self._blocks.get((parent, data[k * BLOCK * 8 : (k + 1) * BLOCK * 8]))
                if block is None or not all(self._valid(block, m) for m in models):
                    break
                blocks.append(block)
                parent = block.slot
            blocks = blocks[: self._hidden_held(job, blocks, models)]
            fresh = frozenset(m for m in self._generation if all(self._valid(b, m) for b in blocks))
            return Hit(tuple(blocks), fresh)

    def plan(self, jobs: Sequence[tuple[SequenceJob, Hit]], chunk: ChunkStep | None = None) -> Lease:
        """The reads and writes of a micro-batch of `jobs` (each with its lookup, made since the last
        change of the index) and `chunk`: its reads pinned, slots taken for its writes (evicting),
        and the blocks marked as held for the models that run. Release the lease once the launch is
        queued, or abandon it."""
        with self._lock:
            self._tick += 1
            every = [job for job, _ in jobs] + ([chunk.job] if chunk is not None else [])
            run = frozenset().union(*(scored_by(job, self._generation) for job in every))
            lease = Lease(CachePlan(()))
            for _, hit in jobs:
                self._pin(hit.blocks[-1:], lease)
            if chunk is not None:
                self._pin([b for b in (chunk.tail, *chunk.hit.blocks[-1:]) if b is not None], lease)
            reuses = [self._write_job(job, hit, run, lease) for job, hit in jobs]
            chunk_reuse = None if chunk is None else self._write_chunk(chunk, lease)
            lease.plan = CachePlan(tuple(reuses), chunk_reuse)
            return lease

    def release(self, lease: Lease) -> None:
        """The lease's launch is queued: what it pinned may go."""
        with self._lock:
            for block in lease.pinned:
                block.pins -= 1
                self._maybe_evictable(block)
            lease.pinned.clear()

    def abandon(self, lease: Lease) -> None:
        """The lease's launch failed: what it was to write is not held; then `release`."""
        with self._lock:
            for block, models in lease.written:
                for m in models:
                    block.valid.pop(m, None)
                    block.hidden.pop(m, None)
            lease.written.clear()
            self.release(lease)

    def drop(self, model: str) -> None:
        """`model`'s weights changed: none of its entries is valid any more."""
        with self._lock:
            if model in self._generation:
                self._generation[model] += 1
                self._purge()

    def flush(self) -> None:
        """Every entry of every model goes (those a plan pins once it lets them go)."""
        with self._lock:
            for model in self._generation:
                self._generation[model] += 1
            self._purge()

    def stats(self) -> Stats:
        with self._lock:
            return Stats(self._hits, self._misses, self._evictions, len(self._blocks), self.capacity)

    # ---- what a plan writes

    def _write_job(self, job: SequenceJob, hit: Hit, run: frozenset[str], lease: Lease) -> Reuse:
        self._hits += hit.cached
        self._misses += job.num_tokens - hit.cached
        read = tuple(b.slot for b in hit.blocks)
        self._touch(hit.blocks)
        models = run if hit.fresh is None else run & hit.fresh
        if not hit.writes or not models:
            return Reuse(read=read)
        first = len(read)
        parent = hit.blocks[-1] if hit.blocks else None
        blocks = self._chain(job, parent, first, job.num_tokens // BLOCK, hit.cached, models, lease)
        return Reuse(read, first, tuple(b.slot for b in blocks), models)

    def _write_chunk(self, chunk: ChunkStep, lease: Lease) -> Reuse:
        job, hit = chunk.job, chunk.hit
        read: tuple[int, ...] = ()
        tail = chunk.tail
        if chunk.start == hit.cached:  # its sequence's first chunk
            self._hits += hit.cached
            self._misses += job.num_tokens - hit.cached
            read = tuple(b.slot for b in hit.blocks)
            self._touch(hit.blocks)
            tail = hit.blocks[-1] if hit.blocks else None
        first = chunk.start // BLOCK
        chained = tail.alive and tail.depth == first - 1 if tail is not None else first == 0
        if not hit.writes or not chained:
            return Reuse(read=read)
        models = scored_by(job, self._generation)
        blocks = self._chain(job, tail, first, chunk.end // BLOCK, chunk.start, models, lease)
        complete = len(blocks) == max(0, chunk.end // BLOCK - first)
        lease.tail = (blocks[-1] if blocks else tail) if complete else None
        return Reuse(read, first, tuple(b.slot for b in blocks), models)

    def _chain(  # noqa: PLR0917
        self,
        job: SequenceJob,
        parent: Block | None,
        first: int,
        end: int,
        computed_from: int,
        models: frozenset[str],
        lease: Lease,
    ) -> list[Block]:
        """Blocks first .. end - 1 of `job` below `parent`, found or given a slot (pinned, marked held
        for `models`; their action rows at positions from `computed_from` on with hidden states);
        stops where no slot is free."""
        data = np.ascontiguousarray(job.tokens, dtype=np.int64).tobytes()
        rows = job.actions - 1
        rows = rows[(rows >= max(computed_from, first * BLOCK)) & (rows < end * BLOCK)]
        masks = np.zeros(max(0, end - first), dtype=np.int64)  # per block: its rows with hidden states
        np.bitwise_or.at(masks, rows // BLOCK - first, np.left_shift(1, rows % BLOCK))
        blocks: list[Block] = []
        for k in range(first, end):
            key = (parent.slot if parent is not None else -1, data[k * BLOCK * 8 : (k + 1) * BLOCK * 8])
            block = self._blocks.get(key)
            if block is None:
                slot = self._take_slot()
                if slot is None:
                    break
                block = Block(slot, parent, key, k)
                self._blocks[key] = block
                if parent is not None:
                    parent.children += 1
            self._pin([block], lease)
            bits = int(masks[k - first])
            for m in models:
                generation = self._generation[m]
                held = block.hidden.get(m, 0) if block.valid.get(m) == generation else 0
                block.valid[m] = generation
                block.hidden[m] = held | bits
            block.used = self._tick
            lease.written.append((block, models))
            blocks.append(block)
            parent = block
        return blocks

    # ---- validity, pins and eviction

    def _valid(self, block: Block, model: str) -> bool:
        return block.valid.get(model) == self._generation[model]

    def _hidden_held(self, job: SequenceJob, blocks: list[Block], models: frozenset[str]) -> int:
        """How many of `blocks` hold the hidden state of every action row of `job` inside them."""
        rows = job.actions - 1
        rows = rows[rows < len(blocks) * BLOCK]
        if not rows.size:
            return len(blocks)
        at, bit = rows // BLOCK, rows % BLOCK
        held = np.ones(rows.shape[0], dtype=np.bool_)
        for m in models:
            masks = np.asarray([b.hidden.get(m, 0) for b in blocks], dtype=np.int64)
            held &= ((masks[at] >> bit) & 1).astype(np.bool_)
        missing = np.flatnonzero(~held)
        return int(at[missing[0]]) if missing.size else len(blocks)

    def _touch(self, blocks: Sequence[Block]) -> None:
        for block in blocks:
            block.used = self._tick

    def _pin(self, blocks: Iterable[Block], lease: Lease) -> None:
        for block in blocks:
            block.pins += 1
            lease.pinned.append(block)

    def _maybe_evictable(self, block: Block) -> None:
        if block.alive and not block.pins and not block.children:
            heapq.heappush(self._evictable, (block.used, next(self._order), block))
            if len(self._evictable) > 2 * len(self._blocks) + 64:  # stale entries: compact
                self._evictable = [e for e in self._evictable if e[2].alive and e[2].used == e[0]]
                heapq.heapify(self._evictable)

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        while self._evictable:
            used, _, block = heapq.heappop(self._evictable)
            if block.alive and not block.pins and not block.children and block.used == used:
                self._remove(block)
                self._evictions += 1
                return self._free.pop()
        return None

    def _remove(self, block: Block) -> None:
        block.alive = False
        del self._blocks[block.key]
        self._free.append(block.slot)
        parent = block.parent
        if parent is not None:
            parent.children -= 1
            self._maybe_evictable(parent)

    def _purge(self) -> None:
        """Remove every block no model holds that nothing pins, deepest first."""
        for block in sorted(self._blocks.values(), key=lambda b: -b.depth):
            dead = not any(self._valid(block, m) for m in self._generation)
            if dead and not block.pins and not block.children:
                self._remove(block)
        self._evictable = [e for e in self._evictable if e[2].alive]
        heapq.heapify(self._evictable)
