"""The batcher's scheduling policy: admission, and which queued sequences and chunks form the next
micro-batch. Synchronous and clock-free; `runner.py` calls it and moves what it decides.

- A micro-batch takes queued sequences in order while the tokens they compute fit the budget (at
  least one). With prefix sharing on, a shared prefix counts once; a sequence that opens a prefix
  group (the sequences queued behind it that share its prefix: a GRPO request's samples) whose whole
  does not fit what is left, but would fit a micro-batch alone, waits with its group for the next
  one, rather than have the group's prefix computed twice. Past the first sequence that does not
  fit, up to `LOOKAHEAD` more are looked at for those that share a prefix with it and fit.
- A sequence longer than the budget is scored in chunks, one such sequence at a time: each
  micro-batch ends with its next chunk, in what the whole sequences leave of the budget (they take
  at most half of it while one is chunked). Batch-invariant mode takes the same micro-batches: its
  scores do not depend on where chunks end or on what is shared (ops/attention.py `invariant`).
- A request starts, on the weights then served, when its first sequence is taken; pinned to others,
  it is refused. While a swap waits only started requests are taken; the barrier is reached when
  none of them has anything queued or in chunks (`open`).
- A request may cap the micro-batches holding its sequences (`Request.batch_tokens`, below the
  budget): a streamed answer's first choices are sent while later ones compute.
- A micro-batch that runs out of memory is split (`split`): its chunk apart, then halves.
- The prefix cache (core/prefix_cache.py): a sequence's first tokens that the cache holds are
  neither computed nor counted (its cost starts past them; only sequences reading the same cached
  prefix share further), and a sequence is chunked only when what it computes passes the budget. A
  micro-batch gathers at most caching.READS_PER_TOKEN (16) x the budget cached keys (beside a first
  sequence).
  Its plan (what it reads and writes) is made with it, and settled once its launch is queued or
  failed (`settle`); the parts of one that ran out of memory read what it read and write nothing.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic

from service.batcher.caching import Caching, Lookups
from service.batcher.queue import Batch, Chunked, F, Pending, Request
from service.core.errors import Overloaded, VersionMismatch
from service.core.jobs import Chunk, SequenceJob
from service.core.prefix_cache import MISS, ChunkStep, Hit, PrefixIndex
from service.core.prefixes import Grouper, common_routed_prefix
from service.engine.contract import SHAPE_STEP
from service.settings import Settings

LOOKAHEAD = 256  # queued sequences looked at, behind the first that does not fit, for prefix sharers


@dataclass(slots=True, eq=False)
class Taken(Generic[F]):
    """What `Policy.take` decided: the micro-batch (maybe empty), the requests it refused (their
    answers are to fail with `refused`), and an engine sequence whose stores to drop (its request
    is gone mid-chunks)."""

    batch: Batch[F]
    refused: list[Request[F]] = field(default_factory=list)
    release: int | None = None


class Policy(Generic[F]):
    """The queue of sequences, the chunked sequence, and the rules that take micro-batches from them."""

    def __init__(
        self,
        budget: int,
        versions: Mapping[str, str],
        *,
        max_queued_tokens: int | None = None,
        share_min_tokens: int | None = None,
        cache: PrefixIndex | None = None,
    ) -> None:
        self.budget = budget
        self.cache = cache
        self.caching: Caching[F] = Caching(cache, share_min_tokens, budget)
        self.versions = versions  # model -> the version served: what a request starting now runs on
        self.max_queued = max_queued_tokens
        self.share_min = share_min_tokens
        self.queued_tokens = 0  # of queued sequences and the chunked one's unscored rest
        self.chunked: Chunked[F] | None = None  # the long sequence being scored
        self._queue: deque[Pending[F]] = deque()
        self._sequence_ids = itertools.count()

    def admit(self, pins: Mapping[str, str], tokens: int, tokens_per_s: float) -> None:
        """Raise VersionMismatch when `pins` are not what is served, Overloaded (with a Retry-After
        from the engine's speed) when `tokens` more would pass `max_queued_tokens`."""
        check_pins(pins, self.versions)
        if self.max_queued is not None and self._queue and self.queued_tokens + tokens > self.max_queued:
            speed = tokens_per_s or float(self.budget)
            raise Overloaded(
                f"{self.queued_tokens} tokens are queued; this server accepts at most {self.max_queued} "
                f"(max_queued_tokens)",
                retry_after=max(1, min(60, math.ceil(self.queued_tokens / speed))),
            )

    def enqueue(self, request: Request[F], jobs: Sequence[SequenceJob]) -> None:
        """Queue `jobs`, answered by `request.futures` in order."""
        self._queue.extend(Pending(job, f, request) for job, f in zip(jobs, request.futures, strict=True))
        self.queued_tokens += sum(job.num_tokens for job in jobs)

    @property
    def idle(self) -> bool:
        """Nothing queued and no sequence in chunks."""
        return not self._queue and self.chunked is None

    @property
    def full(self) -> bool:
        """A full budget is queued."""
        return self.queued_tokens >= self.budget

    def collating_since(self) -> float | None:
        """When the oldest queued sequence arrived, where a collation window applies (none while a
        long sequence keeps the accelerator busy, or with nothing queued)."""
        if self.chunked is not None or not self._queue:
            return None
        return self._queue[0].enqueued

    def open(self) -> bool:
        """Whether a started request still has queued sequences, or a sequence in chunks (a weights
        swap's barrier is not reached)."""
        if self.chunked is not None and not self.chunked.pending.future.done():
            return True
        return any(p.request.versions is not None and not p.gone for p in self._queue)

    def take(self, only_started: bool) -> Taken[F]:
        """Pop queued sequences in order while what they compute fits the token budget (at least
        one), then sharers from behind the first that does not, then the next chunk of the long
        sequence being scored. With `only_started` (a swap is waiting) only sequences of started
        requests are taken."""
        if self.cache is None:
            return self._take(only_started, Lookups(None))
        with self.cache.lock:  # no weights dropped or flush between a lookup and the plan made of it
            return self._take(only_started, Lookups(self.cache))

    def _take(self, only_started: bool, hit: Lookups) -> Taken[F]:  # noqa: PLR0915 (one pass over the queue)
        taken: Taken[F] = Taken(Batch([]))
        if self.chunked is not None and self.chunked.pending.future.done():  # its request is gone
            taken.release = self._end_chunked()
        batch: list[Pending[F]] = []
        skipped: list[Pending[F]] = []  # passed over: unstarted while a swap waits, or long behind another
        tokens = 0  # computed
        shared = self.budget - self.budget // 2  # whole sequences' part beside a chunk
        room = self.budget if self.chunked is None else shared
        cap = self.budget  # the budget, or the least Request.batch_tokens below it of the sequences taken
        grouper = Grouper(self.share_min) if self.share_min is not None else None
        looked: int | None = None  # behind the first that did not fit: how many looked at
        reads = 0  # cached keys the micro-batch gathers
        while self._queue:
            p = self._queue.popleft()
            cost: int | None = None  # what it computes beside the micro-batch, once known
            if looked is not None:
                assert grouper is not None
                if looked == LOOKAHEAD:
                    self._queue.appendleft(p)
                    break
                looked += 1
                h = hit(p)
                cost = grouper.cost(p.job.tokens, p.job.routes, h.cached, h.root)
                alone = cost == p.job.num_tokens - h.cached
                if (
                    alone
                    or tokens + cost > min(room, cap, _cap(p))
                    or p.gone
                    or not self.caching.reads_fit(reads, h)
                ):
                    skipped.append(p)  # shares nothing with the micro-batch, or does not fit
                    continue
            if not p.gone and p.request.versions is None and not only_started:
                self._start(p.request, taken.refused)
            if p.gone:
                self.queued_tokens -= p.job.num_tokens
                continue
            if only_started and p.request.versions is None:
                skipped.append(p)
                continue
            h = hit(p)
            if p.job.num_tokens - h.cached > self.budget:
                if self.chunked is None:
                    self.chunked = Chunked(p, next(self._sequence_ids), next_start=h.cached, hit=h)
                    self.queued_tokens -= h.cached  # served, never computed
                    room = shared
                else:
                    skipped.append(p)
                continue
            if cost is None:
                computed = p.job.num_tokens - h.cached
                cost = grouper.cost(p.job.tokens, p.job.routes, h.cached, h.root) if grouper else computed
            limit = min(room, cap, _cap(p))
            too_much = tokens + cost > limit or not self.caching.reads_fit(reads, h)
            if batch and (too_much or self._would_split(p, cost, limit - tokens, limit, h)):
                if grouper is None:
                    self._queue.appendleft(p)
                    break
                skipped.append(p)
                looked = 0
                continue
            self.queued_tokens -= p.job.num_tokens
            batch.append(p)
            tokens += cost
            reads += h.cached
            cap = min(cap, _cap(p))
            if grouper is not None:
                grouper.add(p.job.tokens, p.job.routes, h.cached, h.root)
        self._queue.extendleft(reversed(skipped))
        taken.batch = self._with_chunk(batch, tokens, cap, hit)
        return taken

    def settle(self, batch: Batch[F], queued: bool) -> None:
        """After `batch`'s launch (queued, or failed): caching.py's."""
        self.caching.settle(batch, queued)

    def _would_split(self, p: Pending[F], cost: int, left: int, limit: int, h: Hit = MISS) -> bool:
        """Whether p opens a prefix group that does not fit in the `left` tokens of the micro-batch
        but would fit one of `limit` alone. Its group: the sequences queued right behind p that
        share more with it (at least share_min tokens) than p shares with the micro-batch (a GRPO
        request's samples). Taking only part of it would compute the group's prefix twice, once
        here and once beside the rest of the group in the next micro-batch (unless the prefix cache
        serves it: then it is computed once whichever micro-batch takes the rest)."""
        if self.share_min is None or h.cached:
            return False
        shared = p.job.num_tokens - cost  # what p shares with the micro-batch
        group = cost
        for q in itertools.islice(self._queue, LOOKAHEAD):
            common = common_routed_prefix(p.job.tokens, q.job.tokens, p.job.routes, q.job.routes)
            if common < max(self.share_min, shared + 1) or q.gone:
                break
            group += q.job.num_tokens - common
            if group > limit:
                return False
        return left < group <= limit

    def split(self, batch: Batch[F]) -> list[Batch[F]]:
        """The parts to retry a micro-batch that ran out of memory as: its whole sequences apart from
        its chunk, else two halves; none when it is one sequence or one chunk (that one fails)."""
        if batch.chunk is not None and batch.pending:
            return [
                self.caching.part(batch, 0, len(batch.pending), False),
                self.caching.part(batch, 0, 0, True),
            ]
        if len(batch.pending) > 1:
            half = len(batch.pending) // 2
            return [
                self.caching.part(batch, 0, half, False),
                self.caching.part(batch, half, len(batch.pending), False),
            ]
        return []

    def abandon(self, batch: Batch[F]) -> int | None:
        """After `batch` failed: the engine sequence whose stores to drop, if it held a chunk (the
        chunked sequence then stops; its later chunks never come)."""
        if batch.chunked is not None and batch.chunked is self.chunked:
            return self._end_chunked()
        if batch.chunk is not None:  # its last chunk: the engine may still hold its stores
            return batch.chunk.sequence
        return None

    def _end_chunked(self) -> int:
        """Stop scoring the chunked sequence (failed or cancelled); its engine sequence id."""
        chunked = self.chunked
        assert chunked is not None
        self.chunked = None
        self.queued_tokens -= chunked.pending.job.num_tokens - chunked.next_start
        return chunked.sequence

    def _with_chunk(self, batch: list[Pending[F]], tokens: int, cap: int, hit: Lookups) -> Batch[F]:
        """`batch`, ended by the next chunk of the chunked sequence, in what `cap` leaves (the budget,
        or the least batch_tokens of batch's requests below it); planned with the prefix cache."""
        hits = None if self.cache is None else [hit(p) for p in batch]
        chunked = self.chunked
        least = min(SHAPE_STEP, max(1, self.budget // 8))
        if chunked is None or (batch and cap - tokens < least):  # no room: the next one
            return self.caching.planned(Batch.of(batch, self.share_min, hits=hits), None)
        job = chunked.pending.job
        if self.cache is not None and chunked.next_start == chunked.cached:  # its first chunk: looked up now
            fresh = hit(chunked.pending)
            self.queued_tokens += chunked.cached - fresh.cached
            chunked.hit, chunked.next_start = fresh, fresh.cached
        start = chunked.next_start
        end = min(job.num_tokens, start + cap - tokens)
        chunked.next_start = end
        self.queued_tokens -= end - start
        if end == job.num_tokens:
            self.chunked = None  # the last chunk: the engine drops the stores after it
        chunk = Chunk(job, chunked.sequence, start, end, chunked.cached)
        step = None
        if self.cache is not None and chunked.hit is not None:
            step = ChunkStep(job, start, end, chunked.hit, chunked.tail)
        return self.caching.planned(Batch.of(batch, self.share_min, chunk, chunked, hits), step)

    def _start(self, request: Request[F], refused: list[Request[F]]) -> None:
        try:
            check_pins(request.pins, self.versions)
        except VersionMismatch as exc:
            request.refused = exc
            refused.append(request)
            return
        request.versions = self.versions


def _cap(p: Pending[F]) -> int:
    """The most tokens a micro-batch holding p may compute, by its request (no cap: any)."""
    return p.request.batch_tokens or 1 << 62


def check_pins(pins: Mapping[str, str], versions: Mapping[str, str]) -> None:
    """Raise VersionMismatch for the first model whose pinned version is not `versions`'."""
    for target, wanted in pins.items():
        serving = versions.get(target)
        if serving != wanted:
            raise VersionMismatch(target=target, requested=wanted, serving=serving)


def sharing(settings: Settings) -> int | None:
    """The shortest prefix sequences share (None: sharing off). On in batch-invariant mode too: a
    shared prefix changes which rows are computed, not any row's bits."""
    if not settings.share_prefixes:
        return None
    return settings.share_min_tokens
