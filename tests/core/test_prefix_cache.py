"""The prefix cache's index (service/core/prefix_cache.py): what a sequence reads and what a micro-batch
writes, per model and weights generation; the hidden states an action inside a cached prefix needs;
least-recently-used eviction of leaves, never of what a plan pins; chunks that chain their blocks;
sequences that give MoE routes kept apart."""

from __future__ import annotations

import numpy as np
import pytest

from service.core.cache_plan import BLOCK
from service.core.jobs import GivenRoutes, SequenceJob
from service.core.prefix_cache import ChunkStep, PrefixIndex, scored_by

MODELS = ("policy", "reference")


def job(tokens: list[int], actions: list[int] | None = None, **flags: object) -> SequenceJob:
    length = len(tokens)
    acts = actions if actions is not None else [length - 1]
    return SequenceJob(
        tokens=np.asarray(tokens, dtype=np.int64),
        actions=np.asarray(acts, dtype=np.int64),
        temperature=1.0,
        return_entropy=False,
        **flags,  # type: ignore[arg-type]
    )


def tokens(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 1000, n)]


def scored(index: PrefixIndex, *jobs: SequenceJob) -> list[int]:
    """Plan one micro-batch of `jobs` (lookups first), release it; what each read."""
    lease = index.plan([(j, index.lookup(j)) for j in jobs])
    index.release(lease)
    return [r.cached for r in lease.plan.jobs]


def test_a_prompt_written_once_is_read_by_the_next_sequence_in_whole_blocks() -> None:
    index = PrefixIndex(64, MODELS)
    prompt = tokens(0, 5 * BLOCK + 3)
    first = job(prompt + tokens(1, 40))
    assert scored(index, first) == [0]
    second = job(prompt + tokens(2, 30))  # its actions after the prompt
    assert index.lookup(second).cached == 5 * BLOCK
    # the same sequence again: every whole block short of its last token
    again = job(first.tokens.tolist())
    assert index.lookup(again).cached == (first.num_tokens - 1) // BLOCK * BLOCK
    stats = index.stats()
    assert stats.hit_tokens == 0
    assert stats.miss_tokens == first.num_tokens
    assert stats.held_blocks == first.num_tokens // BLOCK


def test_an_action_inside_a_cached_prefix_needs_its_hidden_state() -> None:
    """A teacher's prompt_logprobs over a shared system prompt reads the hidden states its first call
    kept; a sequence whose actions fall where none was kept reads up to the first such action."""
    index = PrefixIndex(64, MODELS)
    system = tokens(3, 4 * BLOCK)
    first = job(system + tokens(4, 20), actions=list(range(1, 4 * BLOCK + 20)))  # every position scored
    scored(index, first)
    teacher = job(system + tokens(5, 20), actions=list(range(1, 4 * BLOCK + 20)))
    assert index.lookup(teacher).cached == 4 * BLOCK
    grpo = job(system + tokens(6, 20))  # actions after the prompt only: wrote no hidden state there
    scored(index, grpo)
    late = job(system + tokens(7, 20), actions=[2 * BLOCK + 5, 4 * BLOCK + 10])
    assert index.lookup(late).cached == 4 * BLOCK  # the first call's hidden states are still held
    index.flush()
    plain = job(system + tokens(8, 20))
    scored(index, plain)  # wrote the system prompt's keys; its only hidden states past it
    inside = job(system + tokens(9, 20), actions=[BLOCK + 3, 4 * BLOCK + 10])
    assert index.lookup(inside).cached == BLOCK  # up to the block of position BLOCK + 2


def test_each_model_reads_what_its_own_weights_computed() -> None:
    index = PrefixIndex(64, MODELS)
    prompt = tokens(10, 3 * BLOCK)
    scored(index, job([*prompt, 5]))  # the policy alone ran
    with_ref = job([*prompt, 6], return_ref=True)
    assert scored_by(with_ref, MODELS) == {"policy", "reference"}
    assert index.lookup(with_ref).cached == 0
    assert index.lookup(job([*prompt, 7])).cached == 3 * BLOCK
    scored(index, with_ref)  # both ran: the blocks are the reference's too
    assert index.lookup(job([*prompt, 8], return_ref=True)).cached == 3 * BLOCK
    index.drop("policy")  # new policy weights: the reference's entries stay
    assert index.lookup(job([*prompt, 9])).cached == 0
    assert index.lookup(job([*prompt, 9], return_ref=True)).cached == 0
    scored(index, job([*prompt, 1]))
    assert index.lookup(job([*prompt, 2], return_ref=True)).cached == 3 * BLOCK


def test_writes_of_a_sequence_whose_prefix_one_model_lacks_are_not_that_models() -> None:
    """A micro-batch runs the reference (one sequence asks for it); a policy-only sequence reads blocks
    the reference never computed: its own keys under the reference attend to no valid prefix."""
    index = PrefixIndex(64, MODELS)
    prompt = tokens(11, 2 * BLOCK)
    scored(index, job([*prompt, 5]))
    policy_only = job(prompt + tokens(12, 2 * BLOCK))
    lease = index.plan(
        [
            (policy_only, index.lookup(policy_only)),
            (job(tokens(13, 40), return_ref=True), index.lookup(job(tokens(13, 40), return_ref=True))),
        ]
    )
    index.release(lease)
    assert lease.plan.jobs[0].models == {"policy"}
    assert lease.plan.jobs[1].models == {"policy", "reference"}


def test_least_recently_used_leaves_go_first_and_pinned_blocks_never() -> None:
    index = PrefixIndex(6, ["policy"])
    a, b = tokens(20, 3 * BLOCK + 1), tokens(21, 3 * BLOCK + 1)
    scored(index, job(a))
    scored(index, job(b))  # 6 blocks: full
    assert index.lookup(job(a)).cached == 3 * BLOCK
    scored(index, job([*a[: 2 * BLOCK], 7]))  # a's first two blocks used again, after b
    c = tokens(22, 2 * BLOCK + 1)
    held = index.plan([(job([*a, 1]), index.lookup(job([*a, 1])))])  # pins a's blocks, unreleased
    scored(index, job(c))  # two slots: b's leaf, then b's middle block
    assert index.stats().evicted_blocks == 2
    assert index.lookup(job(b)).cached == BLOCK
    assert index.lookup(job([*a, 2])).cached == 3 * BLOCK
    full = tokens(23, 4 * BLOCK + 1)
    scored(index, job(full))  # b's root, then c's leaf and root go: three blocks written, not four
    assert index.lookup(job(full)).cached == 3 * BLOCK
    assert index.lookup(job(c)).cached == 0
    assert index.lookup(job(b)).cached == 0
    assert index.lookup(job([*a, 3])).cached == 3 * BLOCK  # pinned throughout
    index.release(held)


def test_a_full_cache_writes_nothing_more_and_scoring_goes_on() -> None:
    index = PrefixIndex(2, ["policy"])
    held = index.plan([(job(tokens(30, 2 * BLOCK + 1)), index.lookup(job(tokens(30, 2 * BLOCK + 1))))])
    lease = index.plan([(job(tokens(31, 5 * BLOCK)), index.lookup(job(tokens(31, 5 * BLOCK))))])
    assert lease.plan.jobs[0].write == ()
    index.release(lease)
    index.release(held)


def test_a_failed_launch_leaves_nothing_it_was_to_write() -> None:
    index = PrefixIndex(16, ["policy"])
    prompt = tokens(40, 3 * BLOCK)
    lease = index.plan([(job([*prompt, 1]), index.lookup(job([*prompt, 1])))])
    index.abandon(lease)
    assert index.lookup(job([*prompt, 2])).cached == 0


def test_sequences_that_give_routes_neither_read_nor_write_and_recorders_do_not_read() -> None:
    index = PrefixIndex(16, ["policy"])
    prompt = tokens(50, 2 * BLOCK)
    routes = GivenRoutes(0, np.zeros((2 * BLOCK + 1, 2, 2), dtype=np.uint8))
    given = job([*prompt, 1], routes=routes)
    lease = index.plan([(given, index.lookup(given))])
    assert lease.plan.jobs[0].write == ()
    index.release(lease)
    assert index.lookup(job([*prompt, 2])).cached == 0
    scored(index, job([*prompt, 3]))
    assert index.lookup(job([*prompt, 4], return_routes=True)).cached == 0
    assert index.lookup(job([*prompt, 4], routes=routes)).cached == 0


def test_a_chunked_sequence_reads_at_its_first_chunk_and_chains_its_writes() -> None:
    index = PrefixIndex(64, ["policy"])
    prompt = tokens(60, 4 * BLOCK)
    scored(index, job([*prompt, 1]))
    long = job(prompt + tokens(61, 5 * BLOCK + 7))
    hit = index.lookup(long)
    assert hit.cached == 4 * BLOCK
    tail = None
    for start, end in [
        (4 * BLOCK, 6 * BLOCK + 5),
        (6 * BLOCK + 5, 8 * BLOCK + 3),
        (8 * BLOCK + 3, long.num_tokens),
    ]:
        lease = index.plan([], ChunkStep(long, start, end, hit, tail))
        index.release(lease)
        assert lease.plan.chunk is not None
        assert lease.plan.chunk.read == (tuple(b.slot for b in hit.blocks) if start == hit.cached else ())
        assert lease.plan.chunk.write_from == start // BLOCK
        assert len(lease.plan.chunk.write) == end // BLOCK - start // BLOCK
        tail = lease.tail
    assert index.lookup(job([*long.tokens.tolist(), 5])).cached == long.num_tokens // BLOCK * BLOCK


@pytest.mark.parametrize("seed", range(8))
def test_random_traffic_keeps_the_tree_consistent(seed: int) -> None:
    """Random sequences planned and released, some abandoned, with drops and flushes between: every
    hit's blocks chain from the root with the sequence's own tokens, and slots are never shared."""
    rng = np.random.default_rng(seed)
    index = PrefixIndex(24, MODELS)
    bases = [tokens(100 + k, int(rng.integers(BLOCK, 6 * BLOCK))) for k in range(4)]
    for _ in range(60):
        batch = []
        for _ in range(int(rng.integers(1, 4))):
            base = bases[int(rng.integers(len(bases)))]
            seq = base[: int(rng.integers(1, len(base) + 1))] + tokens(
                int(rng.integers(1 << 30)), int(rng.integers(1, 40))
            )
            batch.append(job(seq, return_ref=bool(rng.integers(2))))
        hits = [index.lookup(j) for j in batch]
        for j, hit in zip(batch, hits, strict=True):
            parent = -1
            for k, block in enumerate(hit.blocks):
                assert block.alive
                assert block.key == (parent, j.tokens[k * BLOCK : (k + 1) * BLOCK].tobytes())
                parent = block.slot
        lease = index.plan(list(zip(batch, hits, strict=True)))
        (index.abandon if rng.random() < 0.1 else index.release)(lease)
        roll = rng.random()
        if roll < 0.05:
            index.flush()
        elif roll < 0.1:
            index.drop("policy")
        slots = [b.slot for b in index._blocks.values()]
        assert len(slots) == len(set(slots)) <= index.capacity
