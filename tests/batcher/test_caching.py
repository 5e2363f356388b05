"""The policy with a prefix cache (batcher/caching.py), without an event loop: what the budget counts
when a sequence's prompt is cached, a long sequence chunked only past what it computes, the cached
keys a micro-batch may gather, the plan made with each micro-batch, and what an out-of-memory split and
a failed launch do to it."""

from __future__ import annotations

import numpy as np

from service.batcher.caching import READS_PER_TOKEN
from service.batcher.policy import Policy
from service.batcher.queue import Batch
from service.core.cache_plan import BLOCK
from service.core.jobs import SequenceJob
from service.core.prefix_cache import PrefixIndex
from tests.support.policies import SERVING, Answer, grouped, submit, take


def policy(budget: int, slots: int = 256, share: int | None = 16) -> Policy[Answer]:
    return Policy(budget, SERVING, share_min_tokens=share, cache=PrefixIndex(slots, ["policy"]))


def launched(p: Policy[Answer], batch: Batch[Answer]) -> None:
    """The batch's launch is queued: what it pinned goes back."""
    p.settle(batch, queued=True)


def test_a_cached_prompt_is_neither_computed_nor_counted() -> None:
    """A request of one sample of a group, then another of the group's next four: the second reads the
    prompt's six whole blocks (96 of 100 tokens), so all four fit a budget that could not hold two
    with their prompt."""
    p = policy(budget=160)
    submit(p, [grouped(20, 1000)])
    first = take(p)
    assert first.tokens == 120
    assert first.plan is not None
    assert len(first.plan.jobs[0].write) == 120 // BLOCK
    launched(p, first)
    submit(p, [grouped(20, 2000 + 100 * k) for k in range(4)])
    second = take(p)
    assert len(second.pending) == 4
    assert [r.cached for r in second.plan.jobs] == [96] * 4  # type: ignore[union-attr]
    assert second.forest is not None
    assert second.forest.cached
    # the prompt's last 4 tokens once (the four share them past the cached root), then each response
    assert second.tokens == 4 + 4 * 20
    assert p.queued_tokens == 0


def test_a_long_sequence_is_chunked_only_past_what_it_computes() -> None:
    p = policy(budget=128)
    base = np.arange(300, dtype=np.int64)

    def long(extra: int) -> SequenceJob:
        tokens = np.concatenate([base, np.arange(5000, 5000 + extra)]).astype(np.int64)
        return SequenceJob(tokens, np.arange(280, tokens.shape[0]), 1.0, False)

    submit(p, [long(10)])
    spans = []
    while not p.idle:
        batch = take(p)
        assert batch.chunk is not None
        spans.append((batch.chunk.start, batch.chunk.end, batch.chunk.cached))
        launched(p, batch)
    assert spans == [(0, 128, 0), (128, 256, 0), (256, 310, 0)]
    # the same 310 tokens and 30 more: the 19 blocks the chunks wrote (304 tokens) cached, 36 to
    # compute: one whole sequence, not chunks; it writes blocks 19 and 20
    submit(p, [long(40)])
    batch = take(p)
    assert batch.chunk is None
    assert batch.plan is not None
    assert batch.plan.jobs[0].cached == 304
    assert batch.tokens == 340 - 304
    launched(p, batch)
    # 264 past the cached 336: chunks from the first uncached position, the first reading them
    submit(p, [long(300)])
    starts: list[tuple[int, int, bool]] = []
    while not p.idle:
        batch = take(p)
        assert batch.chunk is not None
        starts.append(
            (
                batch.chunk.start,
                batch.chunk.cached,
                bool(batch.plan and batch.plan.chunk and batch.plan.chunk.read),
            )
        )
        launched(p, batch)
    assert starts[0] == (336, 336, True)
    assert all(not read for _, _, read in starts[1:])


def test_a_micro_batch_gathers_a_bounded_number_of_cached_keys() -> None:
    budget = 64
    p = policy(budget=budget, slots=512)
    prompt = 200
    submit(p, [grouped(8, 1000, prompt=prompt)])
    while not p.idle:
        launched(p, take(p))
    submit(p, [grouped(4, 2000 + 10 * k, prompt=prompt) for k in range(8)])
    batch = take(p)
    assert batch.plan is not None
    reads = sum(r.cached for r in batch.plan.jobs)
    assert reads <= READS_PER_TOKEN * budget < reads + 192
    assert len(batch.pending) == READS_PER_TOKEN * budget // 192


def test_an_out_of_memory_split_reads_what_the_batch_read_and_writes_nothing() -> None:
    p = policy(budget=1000)
    submit(p, [grouped(40, 1000)])
    launched(p, take(p))
    submit(p, [grouped(40, 2000 + 100 * k) for k in range(4)])
    batch = take(p)
    assert batch.plan is not None
    p.settle(batch, queued=False)  # out of memory: the launch failed
    parts = p.split(batch)
    assert [len(part.pending) for part in parts] == [2, 2]
    for part in parts:
        assert part.plan is not None
        assert [r.cached for r in part.plan.jobs] == [96, 96]
        assert all(r.write == () for r in part.plan.jobs)
        assert part.lease is None
    # what the failed batch was to write is not held: the next sequence reads the prompt only
    assert p.cache is not None
    assert p.cache.lookup(grouped(40, 2000)).cached == 96
