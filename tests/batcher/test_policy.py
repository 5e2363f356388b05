"""The batcher's policy without an event loop: exactly which sequences and chunks form each
micro-batch, what is refused, split and released, and the queued-token count after each step."""

from __future__ import annotations

import numpy as np
import pytest

from service.batcher.policy import LOOKAHEAD, Policy, Taken, sharing
from service.batcher.queue import Batch
from service.core.errors import Overloaded, VersionMismatch
from service.core.jobs import SequenceJob
from service.settings import Settings
from tests.support.policies import SERVING, Answer, grouped, submit, take


def job(length: int, first: int = 0) -> SequenceJob:
    tokens = np.arange(first, first + length, dtype=np.int64)
    return SequenceJob(tokens, np.arange(1, length, dtype=np.int64), 1.0, False)


def firsts(batch: Batch[Answer]) -> list[int]:
    """The first token of each whole sequence: which job it is."""
    return [int(p.job.tokens[0]) for p in batch.pending]


def span(batch: Batch[Answer]) -> tuple[int, int] | None:
    return None if batch.chunk is None else (batch.chunk.start, batch.chunk.end)


def test_sequences_are_taken_in_order_while_they_fit_the_budget() -> None:
    policy: Policy[Answer] = Policy(50, SERVING)
    submit(policy, [job(n, first=100 * i) for i, n in enumerate([30, 20, 25, 10, 40])])
    assert policy.queued_tokens == 125
    assert policy.full
    assert [firsts(take(policy)) for _ in range(3)] == [[0, 100], [200, 300], [400]]
    assert policy.queued_tokens == 0
    assert policy.idle
    assert not take(policy)


def test_a_sequence_over_what_is_left_waits_even_if_a_later_one_fits() -> None:
    policy: Policy[Answer] = Policy(50, SERVING)
    submit(policy, [job(30), job(30, first=100), job(5, first=200)])
    assert firsts(take(policy)) == [0]  # FIFO: 5 would fit beside 30, but 30 is ahead of it
    assert firsts(take(policy)) == [100, 200]


def test_a_first_sequence_is_taken_alone_however_big_it_is_up_to_the_budget() -> None:
    policy: Policy[Answer] = Policy(16, SERVING)
    submit(policy, [job(16), job(1, first=50)])
    assert firsts(take(policy)) == [0]
    assert firsts(take(policy)) == [50]


def test_a_capped_request_keeps_the_micro_batches_holding_its_sequences_under_its_cap() -> None:
    """Budget 100; a request capped at 40 (a streamed completions answer): none of its micro-batches
    computes more than 40, whoever else they hold; uncapped sequences fill the budget as before."""
    policy: Policy[Answer] = Policy(100, SERVING)
    submit(policy, [job(50, first=1000)])
    submit(policy, [job(30, first=100 * i) for i in range(3)], batch_tokens=40)
    submit(policy, [job(20, first=2000), job(25, first=3000), job(50, first=4000)])
    batches = [take(policy) for _ in range(5)]
    assert [firsts(b) for b in batches] == [[1000], [0], [100], [200], [2000, 3000, 4000]]
    assert [b.tokens for b in batches] == [50, 30, 30, 30, 95]
    assert policy.idle


def test_a_capped_request_fits_by_the_tokens_its_group_computes() -> None:
    """8 x (100 + 20) sent, 260 computed under a cap of 200: 100 + 5 x 20 in the first micro-batch."""
    policy: Policy[Answer] = Policy(1000, SERVING, share_min_tokens=16)
    submit(policy, [grouped(20, 1000 + 100 * i) for i in range(8)], batch_tokens=200)
    first, second = take(policy), take(policy)
    assert (len(first.pending), first.tokens) == (5, 200)
    assert (len(second.pending), second.tokens) == (3, 160)


def test_a_chunk_beside_a_capped_sequence_takes_what_the_cap_leaves() -> None:
    policy: Policy[Answer] = Policy(64, SERVING)
    submit(policy, [job(10, first=100)], batch_tokens=32)
    submit(policy, [job(200)])
    batch = take(policy)
    assert (firsts(batch), span(batch), batch.tokens) == ([100], (0, 22), 32)
    assert span(take(policy)) == (22, 86)  # uncapped: the whole budget


def test_long_sequences_are_chunked_one_at_a_time_beside_short_ones() -> None:
    """Budget 16: short ones take at most half (8) beside a chunk; the chunk takes the rest."""
    policy: Policy[Answer] = Policy(16, SERVING)
    submit(policy, [job(4), job(40, first=100), job(4, first=200), job(37, first=300)])
    assert policy.queued_tokens == 85
    first = take(policy)
    assert (firsts(first), span(first)) == ([0, 200], (0, 8))
    assert first.chunked is not None
    assert first.chunk is not None
    assert first.chunk.job.tokens[0] == 100
    long_a = first.chunk.sequence
    spans = []
    for _ in range(5):
        batch = take(policy)
        assert batch.pending == []
        assert batch.chunk is not None
        spans.append((batch.chunk.sequence, span(batch)))
    long_b = spans[-1][0]
    assert long_b != long_a
    assert spans == [
        (long_a, (8, 24)),
        (long_a, (24, 40)),  # its last chunk: the next long one starts only now
        (long_b, (0, 16)),
        (long_b, (16, 32)),
        (long_b, (32, 37)),
    ]
    assert policy.queued_tokens == 0
    assert policy.idle


def test_a_short_sequence_behind_a_long_one_rides_with_its_next_chunk() -> None:
    policy: Policy[Answer] = Policy(16, SERVING)
    submit(policy, [job(400)])
    assert (firsts(take(policy)), span(take(policy))) == ([], (16, 32))
    submit(policy, [job(5, first=1000)])
    batch = take(policy)
    assert (firsts(batch), span(batch)) == ([1000], (32, 43))  # the chunk takes what it leaves
    assert batch.tokens == 16
    assert policy.queued_tokens == 400 - 43


def test_no_chunk_when_whole_sequences_leave_less_than_the_least_chunk() -> None:
    """The least chunk is min(SHAPE_STEP, budget // 8) = 2 at budget 16: a sequence of 15 taken
    before the long one is met leaves 1, so its first chunk waits for the next micro-batch."""
    policy: Policy[Answer] = Policy(16, SERVING)
    submit(policy, [job(15, first=100), job(40), job(3, first=200)])
    batch = take(policy)
    assert (firsts(batch), span(batch)) == ([100], None)
    assert policy.chunked is not None
    assert policy.queued_tokens == 43
    batch = take(policy)
    assert (firsts(batch), span(batch)) == ([200], (0, 13))


def test_a_group_fits_by_the_tokens_it_computes() -> None:
    """8 x (100 + 20) = 960 tokens sent, 100 + 8 x 20 = 260 computed: one micro-batch of 300."""
    policy: Policy[Answer] = Policy(300, SERVING, share_min_tokens=16)
    submit(policy, [grouped(20, 1000 + 100 * i) for i in range(8)])
    batch = take(policy)
    assert len(batch.pending) == 8
    assert batch.chunk is None
    assert batch.forest is not None
    assert batch.tokens == 260
    assert batch.shares() == pytest.approx([100 / 8 + 20] * 8)
    assert policy.queued_tokens == 0


def test_without_sharing_the_budget_counts_every_token() -> None:
    policy: Policy[Answer] = Policy(300, SERVING)
    submit(policy, [grouped(20, 1000 + 100 * i) for i in range(3)])
    batch = take(policy)
    assert (len(batch.pending), batch.forest, batch.tokens) == (2, None, 240)


def test_sharers_behind_a_sequence_that_does_not_fit_join_the_micro_batch() -> None:
    policy: Policy[Answer] = Policy(300, SERVING, share_min_tokens=16)
    submit(policy, [grouped(20, 1000)])
    submit(policy, [job(250, first=5000)])
    submit(policy, [job(10, first=6000)])  # fits, shares nothing: stays in line
    submit(policy, [grouped(20, 2000 + 100 * i) for i in range(4)])
    batch = take(policy)
    assert firsts(batch) == [0] * 5
    assert batch.tokens == 100 + 5 * 20
    assert firsts(take(policy)) == [5000, 6000]


@pytest.mark.parametrize(("strangers", "joins"), [(LOOKAHEAD - 1, True), (LOOKAHEAD, False)])
def test_the_look_ahead_stops_after_lookahead_sequences(strangers: int, joins: bool) -> None:
    """Behind the first sequence that does not fit, `LOOKAHEAD` sequences are looked at: a sharer
    behind it and `LOOKAHEAD - 1` strangers joins, one behind `LOOKAHEAD` strangers does not."""
    policy: Policy[Answer] = Policy(300, SERVING, share_min_tokens=16)
    submit(policy, [grouped(20, 1000)])
    submit(policy, [job(250, first=5000)])
    submit(policy, [job(4, first=10_000 + 10 * i) for i in range(strangers)])
    submit(policy, [grouped(20, 2000)])
    batch = take(policy)
    assert firsts(batch) == ([0, 0] if joins else [0])
    assert policy.queued_tokens == 250 + 4 * strangers + (0 if joins else 120)


def test_cancelled_sequences_are_dropped_and_uncounted() -> None:
    policy: Policy[Answer] = Policy(64, SERVING)
    submit(policy, [job(8, first=1)])
    doomed = submit(policy, [job(9, first=500)])
    submit(policy, [job(7, first=2)])
    assert doomed.futures[0].cancel()
    assert firsts(take(policy)) == [1, 2]
    assert policy.queued_tokens == 0


def test_a_request_starts_on_the_served_weights_when_its_first_sequence_is_taken() -> None:
    policy: Policy[Answer] = Policy(16, SERVING)
    request = submit(policy, [job(10), job(10, first=100)])
    assert request.versions is None
    take(policy)
    assert request.versions == SERVING
    policy.versions = {"policy": "v2"}
    take(policy)
    assert request.versions == SERVING  # a started request keeps its weights


def test_a_request_pinned_to_weights_gone_by_its_start_is_refused_whole() -> None:
    policy: Policy[Answer] = Policy(16, SERVING)
    running = submit(policy, [job(10), job(10, first=50)])
    stale = submit(policy, [job(8, first=100), job(8, first=200)], pins={"policy": "v1"})
    fresh = submit(policy, [job(3, first=300)], pins={"policy": "v2"})
    assert firsts(take(policy)) == [0]
    policy.versions = {"policy": "v2"}  # a swap, once the started request is done
    assert firsts(take(policy, only_started=True)) == [50]
    taken: Taken[Answer] = policy.take(only_started=False)
    assert taken.refused == [stale]
    assert stale.refused is not None
    assert stale.versions is None
    assert (stale.refused.target, stale.refused.requested, stale.refused.serving) == ("policy", "v1", "v2")
    assert firsts(taken.batch) == [300]
    assert (running.versions, fresh.versions) == (SERVING, {"policy": "v2"})
    assert policy.queued_tokens == 0


def test_while_a_swap_waits_only_started_requests_are_taken() -> None:
    policy: Policy[Answer] = Policy(16, SERVING)
    started = submit(policy, [job(10, first=i) for i in range(3)])
    later = submit(policy, [job(10, first=50 + i) for i in range(2)])
    assert not policy.open()
    assert firsts(take(policy)) == [0]
    assert policy.open()  # the barrier is not reached: two of its sequences are queued
    assert [firsts(take(policy, only_started=True)) for _ in range(2)] == [[1], [2]]
    assert not policy.open()
    assert not take(policy, only_started=True)
    assert later.versions is None
    assert started.versions == SERVING
    assert policy.queued_tokens == 20
    assert [firsts(take(policy)) for _ in range(2)] == [[50], [51]]


def test_a_sequence_in_chunks_holds_the_barrier_until_its_last_chunk() -> None:
    policy: Policy[Answer] = Policy(16, SERVING)
    submit(policy, [job(40)])
    assert span(take(policy)) == (0, 16)
    assert policy.open()
    assert span(take(policy, only_started=True)) == (16, 32)
    assert span(take(policy, only_started=True)) == (32, 40)
    assert not policy.open()


def test_admission_refuses_past_the_queue_cap_with_retry_after() -> None:
    policy: Policy[Answer] = Policy(64, SERVING, max_queued_tokens=50)
    policy.admit({}, 80, tokens_per_s=0.0)  # an empty queue takes anything
    submit(policy, [job(40)])
    policy.admit({}, 10, tokens_per_s=0.0)
    with pytest.raises(Overloaded, match="40 tokens are queued; this server accepts at most 50") as raised:
        policy.admit({}, 11, tokens_per_s=0.0)
    assert raised.value.retry_after == 1  # 40 tokens at the budget's 64 a second
    with pytest.raises(Overloaded) as slow:
        policy.admit({}, 11, tokens_per_s=0.5)
    assert slow.value.retry_after == 60  # 80 s, capped
    with pytest.raises(Overloaded) as fast:
        policy.admit({}, 11, tokens_per_s=13.0)
    assert fast.value.retry_after == 4  # ceil(40 / 13)
    assert policy.queued_tokens == 40


def test_admission_refuses_pins_that_are_not_served() -> None:
    policy: Policy[Answer] = Policy(64, SERVING)
    policy.admit({"policy": "v1"}, 5, tokens_per_s=0.0)
    with pytest.raises(VersionMismatch) as raised:
        policy.admit({"policy": "v0"}, 5, tokens_per_s=0.0)
    assert (raised.value.target, raised.value.requested, raised.value.serving) == ("policy", "v0", "v1")
    with pytest.raises(VersionMismatch):
        policy.admit({"critic": "v1"}, 5, tokens_per_s=0.0)


def test_out_of_memory_splits_the_chunk_apart_then_halves_then_gives_up() -> None:
    policy: Policy[Answer] = Policy(16, SERVING)
    submit(policy, [job(40), job(3, first=100), job(4, first=200)])
    mixed = take(policy)
    assert (firsts(mixed), span(mixed)) == ([100, 200], (0, 9))
    whole, chunk = policy.split(mixed)
    assert (firsts(whole), span(whole)) == ([100, 200], None)
    assert (firsts(chunk), span(chunk), chunk.chunked) == ([], (0, 9), mixed.chunked)
    halves = policy.split(whole)
    assert [firsts(h) for h in halves] == [[100], [200]]
    assert policy.split(halves[0]) == []
    assert policy.split(chunk) == []
    three = Batch([*whole.pending, *halves[1].pending])
    assert [firsts(h) for h in policy.split(three)] == [[100], [200, 200]]


def test_a_failed_chunk_ends_its_sequence_and_releases_its_stores() -> None:
    policy: Policy[Answer] = Policy(16, SERVING)
    submit(policy, [job(60), job(50, first=1000)])
    take(policy)
    second = take(policy)
    assert span(second) == (16, 32)
    assert policy.queued_tokens == 60 - 32 + 50
    assert second.chunk is not None
    assert policy.abandon(second) == second.chunk.sequence
    assert policy.chunked is None
    assert policy.queued_tokens == 50
    nxt = take(policy)
    assert nxt.chunk is not None
    assert nxt.chunk.job.tokens[0] == 1000
    assert span(nxt) == (0, 16)
    assert policy.abandon(Batch([])) is None


def test_a_failed_last_chunk_releases_its_stores_only() -> None:
    policy: Policy[Answer] = Policy(16, SERVING)
    submit(policy, [job(20)])
    take(policy)
    last = take(policy)
    assert span(last) == (16, 20)
    assert policy.chunked is None
    assert last.chunk is not None
    assert policy.abandon(last) == last.chunk.sequence
    assert policy.queued_tokens == 0


def test_a_cancelled_long_request_stops_its_chunks_and_frees_them() -> None:
    policy: Policy[Answer] = Policy(16, SERVING)
    long = submit(policy, [job(400)])
    first = take(policy)
    assert first.chunk is not None
    assert long.futures[0].cancel()
    submit(policy, [job(5, first=1000)])
    taken = policy.take(only_started=False)
    assert taken.release == first.chunk.sequence
    assert (firsts(taken.batch), span(taken.batch)) == ([1000], None)
    assert policy.queued_tokens == 0
    assert policy.idle


def test_the_started_sequences_of_a_micro_batch_include_a_first_chunk_only() -> None:
    policy: Policy[Answer] = Policy(16, SERVING)
    submit(policy, [job(40), job(3, first=100)])
    first = take(policy)
    assert [int(p.job.tokens[0]) for p in first.started()] == [100, 0]
    assert take(policy).started() == []


def test_beside_a_chunk_whole_sequences_take_at_most_half_the_budget() -> None:
    policy: Policy[Answer] = Policy(16, SERVING)
    submit(policy, [job(100)])
    assert span(take(policy)) == (0, 16)
    submit(policy, [job(6, first=1000), job(6, first=2000)])
    batches = [take(policy) for _ in range(2)]
    assert [(firsts(b), span(b)) for b in batches] == [([1000], (16, 26)), ([2000], (26, 36))]


def test_prefixes_are_shared_in_batch_invariant_mode_too() -> None:
    """A shared prefix changes which rows run, not a row's bits (tests/parity/test_invariant.py)."""
    assert sharing(Settings(batch_invariant=True, share_min_tokens=24)) == 24
    assert sharing(Settings(batch_invariant=True, share_prefixes=False)) is None


def test_a_group_that_does_not_fit_whole_waits_for_the_next_micro_batch() -> None:
    """Budget 100: group A computes 20 + 3 x 10 = 50; group B's first sample (40 + 10) fits beside
    it, but B as a whole (40 + 3 x 10 = 70) does not, and would fit alone: B waits whole rather than
    have its prompt computed in both micro-batches (50 + 50, then 40 + 2 x 10: 160 tokens)."""
    policy: Policy[Answer] = Policy(100, SERVING, share_min_tokens=16)
    submit(policy, [grouped(10, 1000 + 100 * i, prompt=20) for i in range(3)])
    b = [grouped(10, 5000 + 100 * i, prompt=40) for i in range(3)]
    for j in b:
        j.tokens[:40] += 500  # B's own prompt, sharing nothing with A's
    submit(policy, b)
    first, second = take(policy), take(policy)
    assert (len(first.pending), first.tokens) == (3, 50)
    assert (len(second.pending), second.tokens) == (3, 70)
    assert policy.queued_tokens == 0


def test_a_group_larger_than_the_budget_still_fills_what_is_left() -> None:
    """A group that fits no micro-batch whole is split wherever it is: waiting would gain nothing."""
    policy: Policy[Answer] = Policy(100, SERVING, share_min_tokens=16)
    submit(policy, [grouped(10, 1000, prompt=20)])
    b = [grouped(10, 5000 + 100 * i, prompt=40) for i in range(8)]  # 40 + 8 x 10 = 120 > 100
    for j in b:
        j.tokens[:40] += 500
    submit(policy, b)
    first = take(policy)
    assert (len(first.pending), first.tokens) == (1 + 3, 30 + 40 + 3 * 10)
