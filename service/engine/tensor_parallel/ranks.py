"""Tensor parallel over the GPUs of one host: this process is rank 0 and serves; ranks 1..N-1 follow.

`load` starts N - 1 processes (multiprocessing spawn, daemonic), joins them in one torch.distributed
group (NCCL on CUDA, gloo on CPU; rendezvous through a file store in a fresh temporary directory)
and loads rank 0's shards (replica.py: what can run, each rank's device, the group, its scorer).
Each rank loads its own shard of every model (loading/shards.py) into a PackedScorer of its own.

Data flow stays one way: the batcher calls rank 0's engine as it calls any ScoringEngine. Every call
that runs collectives or changes state (launch, release, warm_up, apply) is first sent, in order,
down a pipe to every follower, which makes the same call on its scorer: all ranks pack the same
micro-batch from the same jobs and run the same forward on their shards, meeting in the same
all-reduces; only rank 0's scores are read. The prefix cache's index is rank 0's: its plan travels
with each launch, and every rank reads and writes the same slots of its own pools (its own heads'
keys and values; the pools' slots are the fewest any rank holds). A reload: each rank stages its
slices on a loader thread and says whether it could; rank 0 applies only when all could, and its
`apply` is one more call in the stream, so every rank swaps at the same micro-batch boundary. A
weight push: every rank joins the trainer's group and receives each bucket, on a thread of its own
(pushes.py); a version applies as a reload's does. Followers answer on their pipe, each answer
queued by kind (`listen`).

Failure. A follower that dies (or whose forward fails, which ends it) leaves the others stuck in a
collective, so a replica's ranks live and die together: rank 0 watches its followers' process
sentinels; when one ends, rank 0 reports the failure to the app
(readiness fails, the server stops, exit status 1) and ends the process itself EXIT_GRACE_S later if
it has not ended by then (a forward stuck in a collective never returns). A follower watches rank 0
the same way (its parent's sentinel) and exits at once when rank 0 is gone. An error in a forward
(out of memory included) may have struck one rank only, so under tensor parallel it is fatal too.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import queue
import shutil
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from service.core import heap
from service.core.cache_plan import CachePlan
from service.core.jobs import Chunk, SequenceJob
from service.core.prefix_cache import PrefixIndex
from service.core.prefixes import Forest
from service.engine.config import EngineConfig
from service.engine.contract import (
    Bucket,
    EngineInfo,
    Launched,
    Received,
    ReloadOrder,
    StagedWeights,
    Target,
    WeightGroup,
    WeightsRejected,
    WeightsState,
)
from service.engine.scorer.engine import PackedScorer
from service.engine.tensor_parallel import replica
from service.engine.tensor_parallel.pushes import Pushes
from service.engine.tensor_parallel.pushes import serve as serve_push

log = logging.getLogger(__name__)

# after a rank fails: how long the app has to stop before this process ends itself
EXIT_GRACE_S = 10.0


@dataclass(slots=True)
class _Follower:
    rank: int
    process: BaseProcess
    conn: Connection
    lock: threading.Lock  # sends come from the engine thread, the loader thread and pushes
    # the follower's answers by kind: "staged" (a reload), "pushed" (pushes.py); None: it is gone
    replies: dict[str, queue.SimpleQueue[tuple[Any, ...] | None]] = field(
        default_factory=lambda: {"staged": queue.SimpleQueue(), "pushed": queue.SimpleQueue()}
    )

    def send(self, message: tuple[str, Any]) -> None:
        with self.lock:
            self.conn.send(message)

    def listen(self) -> None:
        """Put each answer the follower sends in its kind's queue, until the pipe closes."""
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                for waiting in self.replies.values():
                    waiting.put(None)
                return
            self.replies[message[0]].put(message)

    def reply(self, kind: str) -> tuple[Any, ...]:
        message = self.replies[kind].get()
        if message is None:
            raise RuntimeError(f"rank {self.rank} is gone")
        return message


@dataclass(frozen=True, slots=True)
class ParallelStaged:
    """Rank 0's staged weights, once every follower has staged its own."""

    local: StagedWeights

    @property
    def target(self) -> Target:
        return self.local.target

    @property
    def version(self) -> str:
        return self.local.version

    @property
    def source(self) -> str:
        return self.local.source

    @property
    def mode(self) -> str:
        return self.local.mode

    @property
    def nbytes(self) -> int:
        return self.local.nbytes


class TensorParallelEngine:
    """Rank 0's ScoringEngine: its own PackedScorer, each call sent first to the followers."""

    def __init__(self, scorer: PackedScorer, followers: list[_Follower], store: Path) -> None:
        self._scorer = scorer
        self._followers = followers
        self._store = store
        self._stopping = threading.Event()
        self._failed = threading.Event()
        self._on_failure: Callable[[str], None] | None = None
        self._stage_lock = threading.Lock()  # one reload at a time reads the followers' replies
        self._pushes = Pushes(scorer, followers)
        for follower in followers:
            threading.Thread(
                target=follower.listen, name=f"logprobd-tp-listen{follower.rank}", daemon=True
            ).start()
        threading.Thread(target=self._watch, name="logprobd-tp-watch", daemon=True).start()

    @property
    def info(self) -> EngineInfo:
        return self._scorer.info

    @property
    def weights(self) -> Mapping[str, WeightsState]:
        return self._scorer.weights

    def _broadcast(self, message: tuple[str, Any]) -> None:
        for follower in self._followers:
            follower.send(message)

    @property
    def prefix_cache(self) -> PrefixIndex | None:
        return self._scorer.prefix_cache

    def flush_cache(self) -> None:
        self._scorer.flush_cache()  # the followers' indexes are unused: rank 0's plans name their slots

    def launch(
        self,
        jobs: Sequence[SequenceJob],
        chunk: Chunk | None = None,
        forest: Forest | None = None,
        cache: CachePlan | None = None,
    ) -> Launched:
        self._broadcast(("launch", (list(jobs), chunk, forest, cache)))
        try:
            return self._scorer.launch(jobs, chunk, forest, cache)
        except Exception as exc:  # the followers may not have failed alike: the ranks have diverged
            self.fail(f"rank 0: a forward failed ({type(exc).__name__}: {exc}); the ranks diverged")
            raise

    def release(self, sequence: int) -> None:
        self._broadcast(("release", sequence))
        self._scorer.release(sequence)

    def warm_up(self) -> None:
        self._broadcast(("warm_up", None))
        self._scorer.warm_up()

    def tend(self) -> int:
        return 0  # the ranks' decoders run without CUDA graphs: nothing waits for idle time

    def stage(self, order: ReloadOrder) -> StagedWeights:
        """Every rank stages its slices; unless all could, WeightsRejected and every staged copy dropped."""
        with self._stage_lock:
            self._broadcast(("stage", order))
            local: StagedWeights | None = None
            failure: Exception | None = None
            try:
                local = self._scorer.stage(order)
            except Exception as exc:  # the followers' replies are read all the same
                failure = exc
            refusals = [str(failure)] if isinstance(failure, WeightsRejected) else []
            for follower in self._followers:
                _, error = follower.reply("staged")  # ("staged", None | reason)
                if error is not None:
                    refusals.append(f"rank {follower.rank}: {error}")
            if local is None or refusals:
                self._broadcast(("drop", None))
                if refusals:
                    raise WeightsRejected("; ".join(refusals)) from failure
                assert failure is not None
                raise failure
            return ParallelStaged(local)

    def apply(self, staged: StagedWeights) -> WeightsState:
        assert isinstance(staged, ParallelStaged)
        self._broadcast(("apply", None))
        return self._scorer.apply(staged.local)

    def join_group(self, group: WeightGroup) -> None:
        self._pushes.join_group(group)

    def leave_group(self, name: str) -> None:
        self._pushes.leave_group(name)

    def receive(self, bucket: Bucket) -> Received:
        return self._pushes.receive(bucket)

    def drain(self, bucket: Bucket) -> None:
        self._pushes.drain(bucket)

    def stage_received(self, target: Target, version: str) -> StagedWeights:
        return ParallelStaged(self._pushes.stage_received(target, version))

    def drop_received(self, target: Target) -> None:
        self._pushes.drop_received(target)

    def supervise(self, on_failure: Callable[[str], None]) -> None:
        self._on_failure = on_failure

    def fail(self, reason: str) -> None:
        """The replica cannot go on: tell the app, and end the process EXIT_GRACE_S from now."""
        if self._stopping.is_set() or self._failed.is_set():
            return
        self._failed.set()
        log.critical("tensor parallel: %s; this replica stops", reason)
        if self._on_failure is not None:
            self._on_failure(reason)
        timer = threading.Timer(EXIT_GRACE_S, os._exit, args=(1,))
        timer.daemon = True
        timer.start()

    def _watch(self) -> None:
        """Rank 0's watchdog: the first follower to exit while not stopping fails the replica."""
        sentinels = {f.process.sentinel: f for f in self._followers}
        ready = multiprocessing.connection.wait(list(sentinels))
        follower = sentinels[ready[0]]  # type: ignore[index]
        follower.process.join(timeout=1)
        self.fail(
            f"rank {follower.rank} (pid {follower.process.pid}) exited with {follower.process.exitcode}"
        )

    def close(self) -> None:
        """Stop the followers (each gets `stop` after what it was sent), then leave the group."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        for follower in self._followers:
            with contextlib.suppress(OSError):  # already gone
                follower.send(("stop", None))
        for follower in self._followers:
            follower.process.join(timeout=EXIT_GRACE_S)
            if follower.process.is_alive():
                follower.process.kill()
        if not self._failed.is_set() and dist.is_initialized():
            dist.destroy_process_group()
        shutil.rmtree(self._store.parent, ignore_errors=True)


def load(config: EngineConfig) -> TensorParallelEngine:
    """Start ranks 1..N-1, join them, load rank 0's shards; the followers load theirs meanwhile."""
    replica.check(config)  # before any process starts: a clear error, at once
    for name, value in replica.NCCL_ENV.items():
        os.environ.setdefault(name, value)  # the followers inherit the environment
    world = config.tensor_parallel_size
    store = Path(tempfile.mkdtemp(prefix="logprobd-tp-")) / "rendezvous"
    context = multiprocessing.get_context("spawn")
    followers = []
    for rank in range(1, world):
        here, there = context.Pipe()
        process = context.Process(
            target=follow, args=(rank, config, store, there), name=f"logprobd-rank{rank}", daemon=True
        )
        process.start()
        there.close()
        followers.append(_Follower(rank, process, here, threading.Lock()))
        log.info("tensor parallel: started rank %d of %d (pid %d)", rank, world, process.pid)
    try:
        device = replica.device_of(config, 0)
        shard = replica.join(config, 0, store, device)
        scorer = replica.load_scorer(config, shard)
        for follower in followers:
            status, error = follower.conn.recv()
            if status != "loaded":
                raise RuntimeError(f"rank {follower.rank} failed to load: {error}")
    except BaseException:
        for follower in followers:
            follower.process.kill()
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    return TensorParallelEngine(scorer, followers, store)


def follow(rank: int, config: EngineConfig, store: Path, conn: Connection) -> None:
    """A follower rank's process: load its shards, then make each call rank 0 sends, in order."""
    logging.basicConfig(
        level=config.log_level.upper(),
        format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s",
    )
    parent = multiprocessing.parent_process()
    assert parent is not None
    threading.Thread(target=_exit_with, args=(parent,), name="logprobd-tp-parent", daemon=True).start()
    device = replica.device_of(config, rank)
    if device.type == "cpu":  # the ranks share the host's cores
        torch.set_num_threads(max(1, torch.get_num_threads() // config.tensor_parallel_size))
    try:
        scorer = replica.load_scorer(config, replica.join(config, rank, store, device))
    except Exception as exc:
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        raise SystemExit(1) from exc
    conn.send(("loaded", None))
    _serve(scorer, conn)


def _exit_with(parent: BaseProcess) -> None:
    """End this process at once when rank 0 is gone (it may be stuck in a collective meanwhile)."""
    multiprocessing.connection.wait([parent.sentinel])
    os._exit(1)


def _serve(scorer: PackedScorer, conn: Connection) -> None:
    """The follower's loop; any error is fatal (rank 0 sees this process exit)."""
    sending = threading.Lock()  # answers go from the loader and the push thread

    def send(message: tuple[Any, ...]) -> None:
        with sending:
            conn.send(message)

    pushes = ThreadPoolExecutor(1, thread_name_prefix="logprobd-tp-push")  # in order, beside scoring
    with torch.inference_mode():
        previous: Launched | None = None
        staged: dict[str, StagedWeights | None] = {}
        loader: threading.Thread | None = None

        def stage(order: ReloadOrder) -> None:
            try:
                staged["weights"] = scorer.stage(order)
                send(("staged", None))
            except Exception as exc:  # reported to rank 0, which refuses the reload on every rank
                staged["weights"] = None
                send(("staged", f"{type(exc).__name__}: {exc}"))

        while True:
            try:
                command, argument = conn.recv()
            except EOFError:
                raise SystemExit(1) from None
            if command == "launch":
                flight = scorer.launch(*argument)
                if previous is not None:
                    previous.result()  # at most two in flight, as on rank 0
                previous = flight
            elif command == "release":
                scorer.release(argument)
            elif command == "warm_up":
                scorer.warm_up()
                heap.freeze()  # as rank 0 does at ready
            elif command == "stage":
                loader = threading.Thread(target=stage, args=(argument,), name="logprobd-tp-stage")
                loader.start()
            elif command == "push":  # answered on the push thread (pushes.py)
                pushes.submit(serve_push, scorer, send, argument, staged)
            elif command in ("apply", "drop"):
                if loader is not None:  # a reload's (a push's version was staged on the push thread)
                    loader.join()
                weights = staged.pop("weights", None)
                if command == "apply":
                    assert weights is not None
                    scorer.apply(weights)
            elif command == "stop":
                if previous is not None:
                    previous.result()
                pushes.shutdown(wait=False, cancel_futures=True)
                return
