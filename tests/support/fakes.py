"""A deterministic engine with no model, for testing the layers above the engine."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from service.core.cache_plan import CachePlan
from service.core.jobs import Chunk, SequenceJob, SequenceScores
from service.core.prefix_cache import PrefixIndex
from service.core.prefixes import Forest
from service.engine.config import BATCH_TOKENS
from service.engine.contract import (
    Bucket,
    EngineInfo,
    OutOfMemory,
    PushBroken,
    PushRefused,
    Received,
    ReloadOrder,
    StagedWeights,
    Target,
    WeightGroup,
    WeightsRejected,
    WeightsState,
)


@dataclass(frozen=True, slots=True)
class FakeStaged:
    target: Target
    version: str
    source: str
    mode: str
    nbytes: int
    shift: float


@dataclass(slots=True)
class FakeLaunched:
    number: int  # of the micro-batch, from 1
    scores: list[SequenceScores]
    delay: float
    fail: bool
    engine: FakeEngine

    def result(self) -> list[SequenceScores]:
        self.engine.collected_on.add(threading.current_thread().name)
        if self.delay:
            time.sleep(self.delay)
        self.engine.events.append(("collected", self.number))
        if self.fail:
            raise RuntimeError("injected device error")
        return self.scores

    def expert_load(self) -> None:
        return None


class FakeEngine:
    """logprob of action t = -(x_t + t) / T - shift; entropy = t. Records every micro-batch it sees.

    Weights: a checkpoint path ending in a number N is weights whose shift is N; one ending in
    "corrupt" is refused. `stage_delay` makes staging slow.
    """

    def __init__(
        self, delay: float = 0.0, fail_on_token: int | None = None, oom_over_tokens: int | None = None
    ) -> None:
        self.delay = delay
        self.fail_on_token = fail_on_token
        self.oom_over_tokens = oom_over_tokens  # raise OutOfMemory on larger micro-batches
        self.fail_late_on_token: int | None = None
        self.collected_on: set[str] = set()  # the threads that waited for results
        self.events: list[tuple[str, int]] = []  # ("launch" | "collected" | "apply", micro-batch number)
        self.stage_delay = 0.0
        self.shift = 0.0
        self.applied_between: list[int] = []  # micro-batches seen before each apply
        self._weights = {"policy": WeightsState("policy", "initial", "fake", "initial", time.time())}
        self.batches: list[list[int]] = []  # token count of each sequence, per micro-batch
        self.chunks: list[Chunk] = []  # every chunk launched
        self.chunked: dict[int, int] = {}  # chunked sequence -> where its next chunk starts
        self.released: list[int] = []
        self.forests: list[Forest | None] = []  # the prefixes each micro-batch shared (None: none)
        self.plans: list[CachePlan | None] = []  # each micro-batch's prefix-cache plan (None: none)
        self.threads: set[str] = set()
        self.tended: list[int] = []  # per call of `tend`: the micro-batches launched before it
        self._entered = threading.Condition()  # notified as each micro-batch enters `launch`
        self.info = EngineInfo(
            model="fake",
            demo=False,
            architecture="Fake",
            dtype="float32",
            device="cpu",
            attention_backend="none",
            decoder="transformers",
            kernels="none",
            vocab_size=1000,
            max_positions=4096,
            versions={},
            max_batch_tokens=BATCH_TOKENS,
        )

    def warm_up(self) -> None:
        pass

    idle_work = 0  # pieces of work for the engine's idle time, each `tend_delay` s (a test sets them)
    tend_delay = 0.0

    def tend(self) -> int:
        """One piece of `idle_work`, and how many are left; `tended` gets the micro-batches launched
        by then, each call."""
        self.threads.add(threading.current_thread().name)
        if self.idle_work:
            time.sleep(self.tend_delay)
            self.idle_work -= 1
        with self._entered:
            self.tended.append(len(self.batches))
            self._entered.notify_all()
        return self.idle_work

    def wait_tended(self, count: int, timeout: float = 30.0) -> None:
        """Block until `tend` has been called `count` times."""
        with self._entered:
            if not self._entered.wait_for(lambda: len(self.tended) >= count, timeout):
                raise TimeoutError(f"{len(self.tended)} calls of tend, not {count}, in {timeout} s")

    prefix_cache: PrefixIndex | None = None  # a test may give it one: launches then record their plans

    def flush_cache(self) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.flush()

    def launch(
        self,
        jobs: Sequence[SequenceJob],
        chunk: Chunk | None = None,
        forest: Forest | None = None,
        cache: CachePlan | None = None,
    ) -> FakeLaunched:
        """Fails or runs out of memory at once, as a real launch does; the `delay` is the device's
        time, spent in `result`. A token `fail_late_on_token` fails there, as an error the device
        reports late does. A chunk counts as a sequence of its tokens, last in `batches`; its
        sequence's chunks must come in order. `forests` records each micro-batch's forest."""
        self.threads.add(threading.current_thread().name)
        self.batches.append([job.num_tokens for job in jobs] + ([chunk.num_tokens] if chunk else []))
        if forest is not None:
            assert len(forest.paths) == len(jobs)
        self.forests.append(forest)
        self.plans.append(cache)
        if chunk is not None:
            assert self.chunked.get(chunk.sequence, 0) == chunk.start, "chunks out of order"
            self.chunked[chunk.sequence] = chunk.end
            self.chunks.append(chunk)
        self.events.append(("launch", len(self.batches)))
        with self._entered:
            self._entered.notify_all()
        pieces = [job.tokens for job in jobs] + ([chunk.job.tokens[chunk.start : chunk.end]] if chunk else [])
        if self.fail_on_token is not None and any(self.fail_on_token in tokens for tokens in pieces):
            raise RuntimeError("injected failure")
        if self.oom_over_tokens is not None and sum(job.num_tokens for job in jobs) > self.oom_over_tokens:
            raise OutOfMemory("injected out-of-memory")
        late = self.fail_late_on_token is not None and any(self.fail_late_on_token in j.tokens for j in jobs)
        scores = [expected_scores(job, self.shift) for job in jobs]
        if chunk is not None:
            scores.append(expected_scores(dataclasses.replace(chunk.job, actions=chunk.actions), self.shift))
            if chunk.last:
                self.chunked.pop(chunk.sequence)
        return FakeLaunched(len(self.batches), scores, self.delay, late, self)

    def wait_launched(self, count: int, timeout: float = 30.0) -> None:
        """Block until `count` micro-batches have entered `launch` (for tests on another thread)."""
        with self._entered:
            if not self._entered.wait_for(lambda: len(self.batches) >= count, timeout):
                raise TimeoutError(f"{len(self.batches)} micro-batches launched, not {count}, in {timeout} s")

    def release(self, sequence: int) -> None:
        self.released.append(sequence)
        self.chunked.pop(sequence, None)

    def score(self, jobs: Sequence[SequenceJob]) -> list[SequenceScores]:
        return self.launch(jobs).result()

    @property
    def weights(self) -> Mapping[str, WeightsState]:
        return self._weights

    def stage(self, order: ReloadOrder) -> StagedWeights:
        time.sleep(self.stage_delay)
        if order.path.name == "corrupt":
            raise WeightsRejected(f"{order.path}: unreadable")
        mode = "copy" if order.mode == "auto" else order.mode
        return FakeStaged(order.target, order.version, str(order.path), mode, 8, float(order.path.name))

    def apply(self, staged: StagedWeights) -> WeightsState:
        assert isinstance(staged, FakeStaged)
        self.threads.add(threading.current_thread().name)
        self.applied_between.append(len(self.batches))
        self.events.append(("apply", len(self.batches)))
        self.shift = staged.shift
        old = self._weights["policy"]
        state = dataclasses.replace(
            old,
            version=staged.version,
            source=staged.source,
            mode=staged.mode,
            reloads=old.reloads + 1,
        )
        self._weights = {"policy": state}
        return state


def expected_scores(job: SequenceJob, shift: float = 0.0) -> SequenceScores:
    values = -(job.targets + job.actions).astype(np.float32) / np.float32(job.temperature)
    values -= np.float32(shift)
    return SequenceScores(logprobs=values, entropy=job.actions.astype(np.float32))


class FakePushEngine(FakeEngine):
    """A FakeEngine that takes pushed weights (contract.WeightReceiver). The policy holds the tensors
    REQUIRED; applying a push makes the shift the count of its tensors received. A name that starts
    with "unknown" is refused (PushRefused), "die" breaks the group (PushBroken); `receive_delay`
    makes each bucket slow (`receiving` is set as one starts); with `meet` set, each bucket waits in
    `receive` until as many as the barrier's parties are there (BrokenBarrierError after 10 s);
    `received` records each bucket's (version, names), in order, and `drained` the names of buckets
    refused before they were looked at; while `staging` is clear, a reload's stage waits."""

    REQUIRED = ("a", "b", "c")

    def __init__(self) -> None:
        super().__init__()
        self.groups: dict[str, WeightGroup] = {}
        self.receive_delay = 0.0
        self.meet: threading.Barrier | None = None
        self.receiving = threading.Event()  # set when a bucket reaches `receive`
        self.received: list[tuple[str, tuple[str, ...]]] = []
        self.left: list[str] = []
        self.drained: list[tuple[str, ...]] = []  # buckets refused before they were looked at
        self.staging = threading.Event()  # cleared: a reload's stage waits until it is set
        self.staging.set()
        self._lock = threading.Lock()
        # target -> (version, names received, the groups that sent them)
        self._pushed: dict[str, tuple[str, set[str], set[str]]] = {}

    def stage(self, order: ReloadOrder) -> StagedWeights:
        self.staging.wait(30)
        return super().stage(order)

    def join_group(self, group: WeightGroup) -> None:
        if group.master_address == "unreachable":
            raise TimeoutError("no trainer came")
        self.groups[group.name] = group

    def leave_group(self, name: str) -> None:
        self.left.append(name)
        del self.groups[name]
        self._drop_from(name)

    def receive(self, bucket: Bucket) -> Received:
        if bucket.group not in self.groups:
            raise PushRefused(f"Group {bucket.group} not in {list(self.groups)}")
        self.receiving.set()
        if self.meet is not None:
            self.meet.wait(10)
        time.sleep(self.receive_delay)
        if any(name.startswith("die") for name in bucket.names):
            del self.groups[bucket.group]
            self._drop_from(bucket.group)
            self._pushed.pop(bucket.target, None)  # the version the bucket was for
            raise PushBroken("the trainer went away")
        unknown = [name for name in bucket.names if name not in self.REQUIRED]
        if unknown:
            raise PushRefused(f"{unknown[0]}: the served policy has no such tensor")
        with self._lock:
            self.received.append((bucket.version, bucket.names))
            version, names, groups = self._pushed.setdefault(bucket.target, (bucket.version, set(), set()))
            assert version == bucket.version, "a bucket of another version before the pending one was staged"
            names.update(bucket.names)
            groups.add(bucket.group)
            missing = len(set(self.REQUIRED) - names)
        return Received(
            bucket.target, version, "swap", len(bucket.names), 4 * len(bucket.names), not missing, missing
        )

    def drain(self, bucket: Bucket) -> None:
        self.drained.append(bucket.names)

    def stage_received(self, target: Target, version: str) -> StagedWeights:
        _, names, _ = self._pushed.pop(target, ("", set(), set()))
        shift = float(len(names)) if names else self.shift
        return FakeStaged(target, version, "push", "swap", 4 * len(names), shift)

    def drop_received(self, target: Target) -> None:
        self._pushed.pop(target, None)

    def _drop_from(self, group: str) -> None:
        with self._lock:
            for target in [t for t, (_, _, groups) in self._pushed.items() if group in groups]:
                del self._pushed[target]


def with_top(job: SequenceJob, scores: SequenceScores, vocab: int) -> SequenceScores:
    """FakeEngine's scores with the head's extras: K distinct ids per action, the action's token
    first (rank 1) where its position is even, else absent (rank K + position); log-probs sorted."""
    k = job.top_logprobs
    actions = job.actions
    token = job.targets
    among = actions % 2 == 0
    first = np.where(among, token, (token + 1) % vocab)
    ids = (first[:, None] + np.arange(k) * 7) % vocab
    top = scores.logprobs[:, None] - np.arange(k, dtype=np.float32) / 4
    return SequenceScores(
        logprobs=np.where(among, top[:, 0], top[:, -1] - 1).astype(np.float32),
        entropy=None,
        top_ids=ids.astype(np.int32),
        top_logprobs=top.astype(np.float32),
        ranks=np.where(among, 1, k + actions).astype(np.int64),
        drawn=ids[:, 0].astype(np.int64) if job.draw_seed is not None else None,
    )


class TopEngine(FakeEngine):
    """FakeEngine with the head's extras (with_top); `seeds` the draw seeds of every job launched."""

    def __init__(self) -> None:
        super().__init__()
        self.seeds: list[int | None] = []

    def launch(
        self,
        jobs: Sequence[SequenceJob],
        chunk: Chunk | None = None,
        forest: Forest | None = None,
        cache: CachePlan | None = None,
    ) -> FakeLaunched:
        assert chunk is None
        self.seeds += [job.draw_seed for job in jobs]
        launched = super().launch(jobs, chunk, forest, cache)
        launched.scores = [
            with_top(job, s, self.info.vocab_size) for job, s in zip(jobs, launched.scores, strict=True)
        ]
        return launched
