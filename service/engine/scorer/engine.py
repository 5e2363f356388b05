"""PackedScorer: the ScoringEngine over one packed row per micro-batch.

A micro-batch is packed once (tokens, positions, boundaries, action indices); every model the batch
asks for (the policy always; the reference policy and the critic when a sequence wants them) runs
its decoder over that same PackedBatch and its own head on the action positions only.

Sequences that share a prefix arrive with the micro-batch's Forest (prefixes.py): the prefix is packed
once and each sequence's later tokens attend to its keys (batch/packing.py, batch/kv_store.py).

A sequence may give the MoE routes its rollout took, and ask for those the policy uses
(batch/route_buffers.py, moe/replay.py): the policy's forward replays and records them; the reference and
the critic route live.

A sequence longer than a micro-batch arrives as chunks, in order, each the last segment of a
micro-batch; every model that scores it keeps its keys and values (a KVStore per model) from its
first chunk to its last.

The prefix cache: each served model's pool (cache/pool.py), sized at warm-up (memory.py), and the
index over them (core/prefix_cache.py) that the batcher plans micro-batches with; a micro-batch's
plan says what it reads and writes (cache/row_slots.py). New weights drop their model's entries.

This module launches and collects; what it builds (build.py), the models it runs (models.py), the
copies back to the host (inflight.py), reloads (weight_update.py), the self-check (self_check.py) and the
warm-up and memory sizing (memory.py) are apart.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from service.core.cache_plan import BLOCK, CachePlan
from service.core.jobs import Chunk, GivenRoutes, SequenceJob, SequenceScores
from service.core.prefix_cache import PrefixIndex
from service.core.prefixes import Forest
from service.engine.batch.kv_store import KVStore
from service.engine.batch.packing import PackedBatch, pack
from service.engine.cache.pool import ModelPool
from service.engine.config import EngineConfig, batch_budget
from service.engine.contract import (
    Bucket,
    EngineInfo,
    OutOfMemory,
    Received,
    ReloadOrder,
    StagedWeights,
    Target,
    WeightGroup,
    WeightsState,
)
from service.engine.decoder import graphs
from service.engine.loading.critic import Critic
from service.engine.loading.load import Whole, load_models
from service.engine.loading.pretrained import LoadedModel, resolve_device, resolve_dtype, text_part
from service.engine.ops.attention import AttentionBackend, choose_backend, invariant, register
from service.engine.parallel.sharding import Sharded
from service.engine.scorer import build, memory, self_check, weight_update
from service.engine.scorer.inflight import (
    InFlight,
    done_event,
    extra_host,
    host_copier,
    host_counts,
    host_routes,
)
from service.engine.scorer.models import Served, critic_values
from service.engine.transfer.receiver import PushReceiver

log = logging.getLogger(__name__)


class PackedScorer:
    def __init__(
        self,
        loaded: LoadedModel,
        device: torch.device,
        backend: AttentionBackend,
        config: EngineConfig,
        *,
        reference: LoadedModel | None = None,
        critic: Critic | None = None,
        sharded: Sharded | None = None,
    ) -> None:
        """Prepare each model's forward per config.decoder and config.kernels, and describe them.
        `sharded`: the models are this rank's shards (tensor parallel; loading/shards.py): fused
        decoders whose row-parallel projections all-reduce, no CUDA graphs."""
        # batch invariance (strategies/gemm.py): fixed-tile GEMMs, or GEMMs of fixed rows with tokens and
        # actions padded to them
        bases = [loaded.model.base_model]
        bases += [reference.model.base_model] if reference is not None else []
        bases += [critic.decoder] if critic is not None else []
        self._gemm = build.token_gemms(config, device, bases)
        if config.batch_invariant:  # attention that reduces each row alike however queries are cut
            backend = invariant(backend)
        self._step = self._gemm.step
        self._device = device
        self._sharded = sharded
        self._config = config
        on_gpu = device.type == "cuda"
        moe = build.moe_shape(loaded.model.base_model)
        self._budget = batch_budget(config.max_batch_tokens, moe_on_gpu=on_gpu and moe is not None)
        self._stores: dict[int, dict[Target, KVStore]] = {}  # chunked sequence -> each model's store
        self._pools: dict[Target, ModelPool] = {}  # the prefix cache's, from warm-up on
        self._index: PrefixIndex | None = None
        self._served, kernels = build.serve(
            loaded, device, backend, config, self._budget, self._gemm, reference, critic, sharded
        )
        self._info = dataclasses.replace(
            build.describe(
                loaded, device, backend, config, self._budget, self._served, kernels, reference, sharded, moe
            ),
            gemm=self._gemm.name,
        )
        self._weights = build.initial_weights(config, loaded.name, self._info)
        self._receiver: PushReceiver | None = None
        self._routed_probe: list[SequenceJob] = []  # an MoE policy's: its routed modes to check while idle
        self._routed_replay: list[SequenceJob] = []  # the probe's records, to replay the next idle time

    @classmethod
    def from_config(cls, config: EngineConfig) -> PackedScorer:
        device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, device)
        backend = choose_backend(config.attention, device)
        models = load_models(config, Whole(dtype, device, register(backend)))
        return cls(models.policy, device, backend, config, reference=models.reference, critic=models.critic)

    @property
    def info(self) -> EngineInfo:
        return self._info

    @property
    def weights(self) -> Mapping[str, WeightsState]:
        return self._weights

    @property
    def served(self) -> Served:
        """The models this engine runs (their transformers modules and forwards)."""
        return self._served

    @property
    def prefix_cache(self) -> PrefixIndex | None:
        """The prefix cache's index over this engine's pools (None: off, or not warmed up)."""
        return self._index

    def flush_cache(self) -> None:
        """Drop every entry of the prefix cache."""
        if self._index is not None:
            self._index.flush()

    @property
    def receiver(self) -> PushReceiver:
        """The engine's side of weight pushes (transfer/receiver.py), made at its first use."""
        if self._receiver is None:
            rank = self._sharded.shard.rank if self._sharded is not None else 0
            self._receiver = PushReceiver(
                self._served.module,
                lambda target: weight_update.push_names(self._served, target, self._sharded),
                self._device,
                lambda: self._weights,
                rank,
            )
        return self._receiver

    def join_group(self, group: WeightGroup) -> None:
        self.receiver.join_group(group)

    def leave_group(self, name: str) -> None:
        self.receiver.leave_group(name)

    def receive(self, bucket: Bucket) -> Received:
        return self.receiver.receive(bucket)

    def drain(self, bucket: Bucket) -> None:
        self.receiver.drain(bucket)

    def stage_received(self, target: Target, version: str) -> StagedWeights:
        return self.receiver.stage_received(target, version)

    def drop_received(self, target: Target) -> None:
        self.receiver.drop_received(target)

    def stage(self, order: ReloadOrder) -> StagedWeights:
        """Read, check and place new weights for `order.target`; the served ones are untouched."""
        return weight_update.stage(self._served, order, self._device, self._sharded)

    def apply(self, staged: StagedWeights) -> WeightsState:
        """Serve the staged weights from the next micro-batch on. Engine thread only."""
        target = staged.target
        state = weight_update.apply(self._served, staged, self._weights[target])
        self._weights = {**self._weights, target: state}
        self.weights_changed(target)
        return state

    def weights_changed(self, target: Target) -> None:
        """`target`'s weights changed (a reload, a push): the prefix cache drops what the old ones
        computed. Engine thread, between micro-batches."""
        if self._index is not None:
            self._index.drop(target)

    def launch(
        self,
        jobs: Sequence[SequenceJob],
        chunk: Chunk | None = None,
        forest: Forest | None = None,
        cache: CachePlan | None = None,
    ) -> InFlight:
        """Queue the micro-batch's forwards and the copies of its scores to host memory; no wait."""
        try:
            return self._launch(jobs, chunk, forest, cache if self._pools else None)
        except torch.OutOfMemoryError as exc:  # a chunk's stores stay: the batcher retries it
            if self._device.type == "cuda":
                torch.cuda.empty_cache()
            whole = forest.computed_tokens if forest is not None else sum(job.num_tokens for job in jobs)
            tokens = whole + (chunk.num_tokens if chunk else 0)
            raise OutOfMemory(f"out of memory on {len(jobs)} sequences, {tokens} tokens") from exc
        except Exception:
            if chunk is not None:
                self.release(chunk.sequence)
            raise

    def release(self, sequence: int) -> None:
        """Drop the stores of a chunked sequence (its last chunk drops them itself)."""
        self._stores.pop(sequence, None)

    def score(self, jobs: Sequence[SequenceJob], forest: Forest | None = None) -> list[SequenceScores]:
        """launch(jobs, forest=forest).result(): the scores, waiting for them."""
        return self.launch(jobs, forest=forest).result()

    def _stores_of(self, chunk: Chunk | None) -> dict[Target, KVStore]:
        if chunk is None:
            return {}
        if chunk.start == chunk.cached:  # its first chunk (past what the prefix cache serves)
            job, capacity = chunk.job, chunk.job.num_tokens + self._step  # a chunk's filler's keys too
            wanted: dict[Target, bool] = {
                "policy": True,
                "reference": job.return_ref,
                "critic": job.return_values,
            }
            roles = [role for role in wanted if wanted[role] and role in self._weights]
            self._stores[chunk.sequence] = {role: KVStore(capacity) for role in roles}
        return self._stores[chunk.sequence]

    @torch.inference_mode()
    def _launch(
        self, jobs: Sequence[SequenceJob], chunk: Chunk | None, forest: Forest | None, cache: CachePlan | None
    ) -> InFlight:
        served, pools = self._served, self._pools
        batch = pack(
            jobs, self._device, self._step, chunk=chunk, forest=forest, moe=self._info.moe, cache=cache
        )
        stores = self._stores_of(chunk)
        every = [*jobs, chunk.job] if chunk is not None else list(jobs)

        def attached(of: PackedBatch, role: Target) -> PackedBatch:
            return of.attach(stores.get(role), pools.get(role), role)

        policy = served.policy.logprobs(attached(batch, "policy"), batch.want_entropy, extras=True)
        expert_counts = host_counts(served.policy.forward.expert_counts())  # before another forward
        routes = host_routes(batch, every, self._info.moe)
        others = batch.without_routes()  # replay is the policy's: the other models route live
        ref = None
        if served.reference is not None and any(job.return_ref for job in every):
            ref = served.reference.logprobs(attached(others, "reference"), want_entropy=False).logprobs
        values = None
        if served.critic is not None and any(job.return_values for job in every):
            assert served.critic_forward is not None
            values = critic_values(
                served.critic, served.critic_forward, attached(others, "critic"), self._gemm
            )
        if chunk is not None and chunk.last:
            self.release(chunk.sequence)  # freed once the work queued on the stores is done
        to_host = host_copier(self._device, batch.num_actions)  # the padding actions' scores stay behind
        logprobs = to_host(policy.logprobs)
        assert logprobs is not None
        return InFlight(
            jobs=every,
            actions_per_sequence=batch.actions_per_sequence,
            logprobs=logprobs,
            entropy=to_host(policy.entropy),
            ref_logprobs=to_host(ref),
            values=to_host(values),
            extras=extra_host(self._device, batch.extras, policy.extras),
            done=done_event(self._device),
            expert_counts=expert_counts,
            routes=routes,
        )

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Run every model's kernels once and check the heads reproduce the models' own final logits;
        on a GPU, meet every GEMM shape and measure a micro-batch's working set; allocate the prefix
        cache's pools; capture the graphs (which write the pools) and size the longest sequence. An
        MoE policy's routed modes are checked later, in the engine's idle time (`tend`)."""
        rng = random.Random(0)
        jobs = [self._random_job(rng, min(64, self._info.max_positions)) for _ in range(4)]
        self.score(jobs)
        cuda = self._device.type == "cuda"
        if self._sharded is None:  # the models' own forwards need every rank's shard: no self-check
            self._self_check(jobs[0])
        if cuda:
            self.meet_shapes()
        working = self._measure(rng) if cuda else 0
        self._open_cache(working)
        if self._sharded is not None:
            log.info("warm-up done (rank %d of %d)", self._sharded.shard.rank, self._sharded.shard.world)
            return
        probe = pack(jobs[: max(1, self._budget // len(jobs[0].tokens))], self._device, self._step)
        for forward in self._served.forwards():
            forward.capture(probe)  # as a micro-batch
        if cuda and self._info.max_positions > self._budget:
            self._size_longest(working)
        policy = self._served.policy.forward
        if isinstance(policy, graphs.GraphedDecoder) and policy.disabled is not None:
            kernels = self._info.kernels.replace("+graphs", "")
            self._info = dataclasses.replace(self._info, kernels=kernels)
        if (
            isinstance(policy, graphs.GraphedDecoder)
            and policy.disabled is None
            and self._info.moe is not None
        ):
            self._routed_probe = jobs

    def _check_routed(self, policy: graphs.GraphedDecoder) -> None:
        """One of the routed modes' checks (graphs.py captures and checks each mode's first graph): the
        warm-up's jobs recorded, or, the next call, those records replayed, and then every N's routed
        graphs queued for the idle time. Idle-time work, not the start's: with cold caches the routed
        kernels' compiles take 5 s of a Qwen3-30B-A3B start on an H200 (benchmarks.startup), which no
        request needs before it sends routes (one that does meanwhile is checked in its launch, as
        met); in two steps, so that a request that comes meanwhile waits for one of them."""
        started = time.perf_counter()
        # each step's list stays until the step is done, so that pending_graphs, read by other threads
        # (a benchmark waiting for the idle time's graphs), never reads 0 while a step runs
        try:
            if self._routed_probe:
                jobs = self._routed_probe
                recorded = self.score([dataclasses.replace(job, return_routes=True) for job in jobs])
                self._routed_replay = [
                    dataclasses.replace(job, routes=GivenRoutes(0, scores.routes))
                    for job, scores in zip(jobs, recorded, strict=True)
                    if scores.routes is not None
                ]
                self._routed_probe = []
                log.info("CUDA graphs: routed recording checked in %.1f s", time.perf_counter() - started)
                return
            self.score(self._routed_replay)
        except Exception as exc:  # routed scoring fails alike when served: serving goes on
            self._routed_probe, self._routed_replay = [], []
            log.warning("routed micro-batches' CUDA graphs left to be captured as met: %s", exc)
            return
        queued = policy.plan_routed()
        self._routed_replay = []
        seconds = time.perf_counter() - started
        log.info(
            "CUDA graphs: routed replay checked in %.1f s, %d shapes left for idle time", seconds, queued
        )

    @torch.inference_mode()
    def tend(self) -> int:
        """One step of the engine's idle-time work: an MoE policy's routed modes checked (the first
        two), else one CUDA graph queued for it captured (graphs.py); how many graphs are left. The
        batcher calls it on the engine thread with nothing launched."""
        policy = self._served.policy.forward
        if (self._routed_probe or self._routed_replay) and isinstance(policy, graphs.GraphedDecoder):
            self._check_routed(policy)
            return self.pending_graphs
        waiting = [f for f in self._graphed() if f.pending]
        if waiting:
            waiting[0].capture_pending()
        return self.pending_graphs

    @property
    def pending_graphs(self) -> int:
        """CUDA graphs left for the engine's idle time (`tend`): those queued, and the routed modes'
        first ones while their checks wait (recording's and replay's)."""
        checks = (2 if self._routed_probe else 0) + (1 if self._routed_replay else 0)
        return sum(f.pending for f in self._graphed()) + checks

    def _graphed(self) -> list[graphs.GraphedDecoder]:
        """The served models' forwards that replay CUDA graphs."""
        return [f for f in self._served.forwards() if isinstance(f, graphs.GraphedDecoder)]

    def meet_shapes(self) -> None:
        memory.meet_shapes(self._served, self._device, self._budget)

    def _random_job(self, rng: random.Random, length: int) -> SequenceJob:
        """A random sequence that asks every served model for everything."""
        return SequenceJob(
            tokens=np.asarray([rng.randrange(self._info.vocab_size) for _ in range(length)], dtype=np.int64),
            actions=np.arange(1, length, dtype=np.int64),
            temperature=1.0,
            return_entropy=True,
            return_values=self._served.critic is not None,
            return_ref=self._served.reference is not None,
        )

    def _self_check(self, job: SequenceJob) -> None:
        """Every model against its own transformers forward (self_check.py); a policy whose fused
        decoder gave way is described as the transformers decoder it now runs."""
        served, setting = self._served, self._config.decoder
        checked = self_check.check_or_fall_back(served.policy, job, self._device, "policy", setting)
        if checked.fell_back:
            kernels = "none" if self._info.kernels.startswith(("triton", "none")) else self._info.kernels
            self._info = dataclasses.replace(
                self._info, decoder="transformers", kernels=kernels, moe_kernel="none"
            )
        delta = checked.delta
        if served.reference is not None:
            ref = self_check.check_or_fall_back(served.reference, job, self._device, "reference", setting)
            delta = max(delta, ref.delta)
        if served.critic is not None and served.critic_forward is not None:
            self_check.check_hidden(served.critic.decoder, served.critic_forward, job, self._device, "critic")
        log.info("warm-up done; self-check max |Δ logits| = %.3g", delta)

    def _measure(self, rng: random.Random) -> int:
        """The bytes a micro-batch's work takes beyond what is allocated now: the peak over a sequence
        of two full chunks, every model asked (the chunked path's kernels met before serving too), or
        over one full micro-batch where the positions allow no longer sequence."""
        most = self._budget
        length = min(2 * most, self._info.max_positions)
        torch.cuda.synchronize(self._device)
        base = torch.cuda.memory_allocated(self._device)
        torch.cuda.reset_peak_memory_stats(self._device)
        if length > most:
            job = self._random_job(rng, length)
            for start in range(0, length, most):
                chunk = Chunk(job, sequence=-1, start=start, end=min(start + most, length))
                self.launch([], chunk).result()
        else:
            self.score([self._random_job(rng, length) for _ in range(max(1, most // length))])
        torch.cuda.synchronize(self._device)
        return torch.cuda.max_memory_allocated(self._device) - base

    def _open_cache(self, working: int) -> None:
        """Allocate each served model's prefix-cache pool (memory.cache_slots; under tensor parallel the
        fewest any rank holds, so that every rank has each slot) and the index over them."""
        if not self._config.prefix_cache:
            return
        roles = self._served.roles()
        slots = memory.cache_slots(list(roles.values()), self._device, self._config, working)
        if self._sharded is not None:
            slots = memory.fewest(slots, self._sharded.shard, self._device)
        if slots <= 0:
            log.warning("prefix cache off: no memory left for it")
            return
        for role, module in roles.items():
            dtype = next(module.parameters()).dtype
            self._pools[role] = ModelPool.allocate(text_part(module.config), slots, dtype, self._device)
            forward = self._served.forward(role)
            if isinstance(forward, graphs.GraphedDecoder):
                forward.attach_pool(self._pools[role])
        self._index = PrefixIndex(slots, roles)
        held = sum(pool.nbytes() for pool in self._pools.values())
        self._info = dataclasses.replace(
            self._info, prefix_cache_tokens=slots * BLOCK, prefix_cache_bytes=held
        )
        log.info("prefix cache: %d tokens a model, %.2f GiB", slots * BLOCK, held / (1 << 30))

    def _size_longest(self, working: int) -> None:
        """The longest sequence: what the memory left beside a micro-batch's working set holds of one
        store per model."""
        fits = memory.tokens_that_fit(self._served, self._device, working, self._step)
        longest = memory.longest(self._info.max_positions, fits, self._config.max_sequence_tokens)
        self._info = dataclasses.replace(self._info, **longest)
        log.info(
            "longest sequence: %d tokens (%s)", self._info.max_sequence_tokens, self._info.max_sequence_limit
        )
