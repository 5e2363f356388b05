"""What a micro-batch takes from the prefix cache and gives it: the plan the batcher makes with the
index (prefix_cache.py) and the engine lays out on its packed row (engine/cache/row_slots.py).

A block is BLOCK tokens of a sequence; slot s of the engine's pools holds rows s * BLOCK .. s * BLOCK +
BLOCK - 1 of every model's pool. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

BLOCK = 16  # tokens a block (vLLM's default block size): a prefix is served in whole blocks


@dataclass(frozen=True, slots=True)
class Reuse:
    """What one sequence of a micro-batch takes from the cache and gives it.

    read:   slots of its first len(read) blocks: tokens [0, cached) come from the pool
    write:  slots its blocks write_from, write_from + 1, ... go into (the keys, values and the hidden
            states of its action rows there), for `models`
    """

    read: tuple[int, ...] = ()
    write_from: int = 0
    write: tuple[int, ...] = ()
    models: frozenset[str] = frozenset()

    @property
    def cached(self) -> int:
        return len(self.read) * BLOCK


NOTHING = Reuse()


@dataclass(frozen=True, slots=True)
class CachePlan:
    """A micro-batch's reads and writes: one Reuse per whole sequence, in order, and the chunk's
    (its reads on its sequence's first chunk only; its writes: the blocks that end inside it, their
    keys and values read from the chunked sequence's store)."""

    jobs: tuple[Reuse, ...]
    chunk: Reuse | None = None

    @property
    def cached_tokens(self) -> int:
        return sum(r.cached for r in self.jobs) + (self.chunk.cached if self.chunk is not None else 0)
