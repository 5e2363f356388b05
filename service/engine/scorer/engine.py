"""PackedScorer: the ScoringEngine over one packed row per micro-batch.

A micro-batch is packed once (tokens, positions, boundaries, action indices); every model the batch
asks for (the policy always; the reference policy and the critic when a sequence wants them) runs
its decoder over that same PackedBatch and its own head on the action positions only.

Sequences that share a prefix arrive with the micro-batch's Forest (prefixes.py): the prefix is packed
once and each sequence's later tokens attend to its keys (packing.py, context.py).

A sequence longer than a micro-batch arrives as chunks, in order, each the last segment of a
micro-batch; every model that scores it keeps its keys and values (a KVStore per model, context.py)
from its first chunk to its last. The longest sequence is the model's positions, or what the
accelerator's memory holds of one store per model beside the weights and a full micro-batch's
activations, measured at warm-up.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import logging
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

import service
from service.engine.batch.kv_store import KVStore, cache_bytes_per_token
from service.engine.batch.packing import SHAPE_STEP, PackedBatch, pack
from service.engine.config import EngineConfig
from service.engine.contract import (
    EngineInfo,
    ModelInfo,
    OutOfMemory,
    ReloadOrder,
    StagedWeights,
    Target,
    WeightsRejected,
    WeightsState,
)
from service.engine.decoder import fused as decoder
from service.engine.decoder import graphs
from service.engine.decoder.fused import Decoder
from service.engine.decoder.mlp_chunks import chunk_mlps, resolve_tokens
from service.engine.heads import vocab_parallel
from service.engine.heads.chunked import ActionScores, LogitTransform, score_actions
from service.engine.loading import reload as weights
from service.engine.loading.checkpoint import read_all
from service.engine.loading.critic import Critic, load_critic, read_value_head
from service.engine.loading.models import LoadedModel, load_model, resolve_device, resolve_dtype, text_part
from service.engine.moe import layer as moe
from service.engine.ops import gate_up as gated
from service.engine.ops.attention import AttentionBackend, choose_backend, register
from service.engine.ops.elementwise import Ops
from service.engine.ops.liger import apply_fused_kernels
from service.engine.parallel.sharding import Sharded
from service.engine.strategies import gemm as gemms
from service.engine.strategies.gemm import FixedRows, TokenGemms
from service.engine.strategies.sums import LOCAL, AllReduce, PartialSums
from service.jobs import Chunk, FloatArray, IntArray, SequenceJob, SequenceScores
from service.prefixes import Forest

log = logging.getLogger(__name__)

# |own forward - ours| <= RTOL * max|logit| + ATOL, per dtype, in the start-up self-check
_SELF_CHECK_TOL = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 2e-2), torch.float16: (4e-3, 4e-3)}
# ‖fused - transformers‖ / ‖transformers‖ over final hidden states, per dtype, in the same self-check
_DECODER_TOL = {torch.float32: 1e-4, torch.bfloat16: 0.1, torch.float16: 0.02}
# Share of token-expert pairs a fused MoE router must choose as transformers' does at start: rounding
# flips a few near-tied pairs in half precision; a misread router (rule, top-k, weight) most of them
_ROUTING_AGREEMENT = 0.8
# Share of the accelerator's memory the engine plans to use (the rest: fragmentation, the CUDA context)
_MEMORY_FRACTION = 0.95


class CausalLM:
    """A causal LM split into its decoder and its head, so the head runs on action rows only."""

    def __init__(self, model: Any, forward: Decoder, chunk_rows: int) -> None:
        self.model = model
        self.forward = forward  # over model.base_model
        self.lm_head = model.get_output_embeddings()
        self.transform = LogitTransform.from_config(model.config)
        self.chunk_rows = chunk_rows
        self.vocab_size = min(
            vocab_parallel.full_rows(model.get_input_embeddings()), vocab_parallel.full_rows(self.lm_head)
        )
        sharded = isinstance(self.lm_head, vocab_parallel.VocabParallelHead)
        self.score = vocab_parallel.score_actions if sharded else score_actions

    def warm_head(self, step: int) -> None:
        """The lm_head's GEMM over every row count a chunk of padded actions can have."""
        weight = self.lm_head.weight
        for rows in sorted({*range(step, self.chunk_rows + 1, step), self.chunk_rows}):
            self.lm_head(torch.zeros(rows, weight.shape[1], dtype=weight.dtype, device=weight.device))

    def logprobs(self, batch: PackedBatch, want_entropy: bool) -> ActionScores:
        return self.score(
            hidden=self.forward(batch, batch.hidden_index),
            targets=batch.targets,
            inv_temperature=batch.inv_temperature,
            lm_head=self.lm_head,
            transform=self.transform,
            chunk_rows=self.chunk_rows,
            want_entropy=want_entropy,
        )

    @torch.inference_mode()
    def self_check(self, job: SequenceJob, device: torch.device) -> float:
        """Largest |Δ| between the model's own logits and ours on one sequence; raise if too large.

        Two checks, one cause each: the head on transformers' own decoder must give the model's own
        logits (catches a final-logit transform LogitTransform misses: the same decoder on both
        sides, so a tight bound), and a fused decoder must give transformers' hidden states up to
        rounding (check_hidden: catches a layer it misreads).
        """
        batch = pack([job], device, step=1)  # the model's own forward reads the row as one sequence
        every = torch.arange(batch.num_tokens, device=device)
        own = self.model(input_ids=batch.input_ids, use_cache=False).logits[0].float()  # [L, V]
        hidden = decoder.TransformersDecoder(self.model.base_model)(batch, every)
        ours = self.transform(self.lm_head(hidden).float())  # [L, V]
        rtol, atol = _SELF_CHECK_TOL[hidden.dtype]
        delta = float((own - ours).abs().max())
        bound = rtol * float(own.abs().max()) + atol
        if not delta <= bound:
            raise RuntimeError(
                f"{type(self.model).__name__}: its own forward gives logits that differ from "
                f"lm_head(hidden) + {self.transform} by {delta:.3g} (allowed {bound:.3g}); it applies a "
                "final-logit transform logprobd does not reproduce, so its scores would be wrong"
            )
        if self.forward.kind == "fused":
            check_hidden(self.model.base_model, self.forward, job, device, type(self.model).__name__)
        return delta


def _critic_values(critic: Critic, forward: Decoder, batch: PackedBatch, gemm: TokenGemms) -> torch.Tensor:
    hidden = forward(batch, batch.hidden_index)
    return gemm.by_rows(critic.head, hidden)  # [A] float32: head(h_{t-1})


@dataclass(frozen=True, slots=True)
class InFlight:
    """A launched micro-batch: its [A] float32 scores, host tensors that the copies queued on the
    device fill; `done` is recorded after those copies (None: computed on the host, ready)."""

    jobs: Sequence[SequenceJob]
    actions_per_sequence: list[int]
    logprobs: torch.Tensor
    entropy: torch.Tensor | None
    ref_logprobs: torch.Tensor | None
    values: torch.Tensor | None
    done: torch.cuda.Event | None
    expert_counts: torch.Tensor | None = None  # [layers, E] int32 host copy: decoder.expert_counts

    def expert_load(self) -> IntArray | None:
        if self.done is not None:
            self.done.synchronize()
        return None if self.expert_counts is None else self.expert_counts.numpy().astype(np.int64)

    def result(self) -> list[SequenceScores]:
        if self.done is not None:
            self.done.synchronize()  # releases the GIL while the device works
        splits = np.cumsum(self.actions_per_sequence)[:-1]

        def per_sequence(values: torch.Tensor | None) -> list[FloatArray] | None:
            # views of the host tensor, which they keep alive (its pinned block is not reused under them)
            return None if values is None else np.split(values.numpy(), splits)

        lp, ent = per_sequence(self.logprobs), per_sequence(self.entropy)
        rf, vl = per_sequence(self.ref_logprobs), per_sequence(self.values)
        assert lp is not None
        return [
            SequenceScores(
                logprobs=lp[i],
                entropy=ent[i] if ent is not None and job.return_entropy else None,
                values=vl[i] if vl is not None and job.return_values else None,
                ref_logprobs=rf[i] if rf is not None and job.return_ref else None,
            )
            for i, job in enumerate(self.jobs)
        ]


def _host_copier(device: torch.device, rows: int) -> Callable[[torch.Tensor | None], torch.Tensor | None]:
    """A float32 host copy of a device tensor's first `rows`: on CUDA, into pinned memory, queued on
    the stream."""

    def copy(values: torch.Tensor | None) -> torch.Tensor | None:
        if values is None:
            return None
        values = values[:rows]
        if device.type != "cuda":
            return values.float().cpu()
        host = torch.empty(values.shape, dtype=torch.float32, pin_memory=True)
        host.copy_(values, non_blocking=True)
        return host

    return copy


def _host_counts(counts: torch.Tensor | None) -> torch.Tensor | None:
    """A host copy of device counts; on CUDA, into pinned memory, queued on the stream."""
    if counts is None or counts.device.type != "cuda":
        return None if counts is None else counts.clone()
    host = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True)
    host.copy_(counts, non_blocking=True)
    return host


def _event(device: torch.device) -> torch.cuda.Event | None:
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record()
    return event


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
        `sharded`: the models are this rank's shards (tensor parallel; sharded.py): fused decoders
        whose row-parallel GEMMs all-reduce, no CUDA graphs."""
        ops = Ops.for_device(device, allow_triton=config.kernels != "none")
        # batch invariance (strategies/gemm.py): GEMMs of fixed rows, tokens and actions padded to them
        self._gemm = gemms.choose(config.batch_invariant)
        self._step = self._gemm.step
        chunk_rows = config.logits_chunk_rows
        if self._gemm.rows is not None and self._gemm.rows % chunk_rows:  # whole chunks of padded actions
            chunk_rows = self._gemm.rows
        self._sharded = sharded
        cuda_graphs = config.cuda_graphs if sharded is None else "off"  # a graph of collectives: not yet
        recorder = None
        if device.type == "cuda" and cuda_graphs != "off":
            recorder = graphs.CudaRecorder(device)  # one memory pool for every model's graphs

        # tensor parallel: the row-parallel projections' partial sums all-reduced (strategies/sums.py)
        sums = AllReduce(sharded.shard.all_reduce_) if sharded is not None else LOCAL

        def forward(model: Any, base: Any) -> tuple[Decoder, str]:
            built, kernels = _prepare(model, base, config, backend, ops, device, self._gemm, sums)
            if sharded is not None and not isinstance(built, decoder.FusedDecoder):
                raise RuntimeError("tensor parallel runs the fused decoder; this model runs another")
            wrapped = graphs.wrap(
                built,
                cuda_graphs,
                backend.name,
                device,
                recorder,
                config.max_batch_tokens,
                config.cuda_graph_limit,
            )
            return wrapped, f"{kernels}+graphs" if wrapped is not built else kernels

        policy_forward, kernels = forward(loaded.model, loaded.model.base_model)
        self._policy = CausalLM(loaded.model, policy_forward, chunk_rows)
        self._reference = None
        if reference is not None:
            ref_forward, _ = forward(reference.model, reference.model.base_model)
            self._reference = CausalLM(reference.model, ref_forward, chunk_rows)
        self._critic = critic
        self._critic_forward = forward(critic.decoder, critic.decoder)[0] if critic is not None else None
        self._device = device
        self._max_tokens = config.max_batch_tokens
        self._decoder_setting = config.decoder
        self._stores: dict[int, dict[Target, KVStore]] = {}  # chunked sequence -> each model's store
        self._max_sequence_setting = config.max_sequence_tokens
        model_config = loaded.model.config
        text = text_part(model_config)
        vocab = self._policy.vocab_size
        if self._reference is not None and self._reference.vocab_size != vocab:
            raise ValueError(
                f"reference model vocabulary {self._reference.vocab_size} differs from the policy's {vocab}"
            )
        if critic is not None:
            vocab = min(vocab, vocab_parallel.full_rows(critic.decoder.get_input_embeddings()))
        models = [_model_info("policy", loaded.name, loaded.model)]
        if reference is not None:
            models.append(_model_info("reference", reference.name, reference.model))
        if critic is not None:
            models.append(_model_info("critic", f"critic ({critic.head.format} value head)", critic.decoder))
        self._info = EngineInfo(
            model=loaded.name,
            demo=loaded.demo,
            architecture=(model_config.architectures or [type(loaded.model).__name__])[0],
            dtype=str(loaded.model.dtype).removeprefix("torch."),
            device=str(device),
            attention_backend=backend.name,
            decoder=policy_forward.kind,
            kernels=kernels,
            moe_kernel=_moe_kernel(policy_forward),
            vocab_size=vocab,
            max_positions=max_positions(text),
            batch_invariant=config.batch_invariant,
            versions=_versions(),
            models=tuple(models),
            tensor_parallel_size=sharded.shard.world if sharded is not None else 1,
        )
        longest = _longest(self._info.max_positions, None, config.max_sequence_tokens)
        self._info = dataclasses.replace(self._info, **longest)
        now = time.time()
        initial = {
            "policy": (config.weights_version, config.model or loaded.name),
            "reference": (config.ref_weights_version, config.ref_model),
            "critic": (config.critic_weights_version, config.critic),
        }
        self._weights: dict[str, WeightsState] = {
            m.role: WeightsState(m.role, initial[m.role][0], str(initial[m.role][1]), "initial", now)
            for m in models
        }

    @classmethod
    def from_config(cls, config: EngineConfig) -> PackedScorer:
        device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, device)
        backend = choose_backend(config.attention, device)
        attn = register(backend)
        loaded = load_model(config.model, config.model_name, dtype, device, attn)
        reference = None
        if config.ref_model is not None:
            reference = load_model(config.ref_model, None, dtype, device, attn, role="reference")
        critic = load_critic(config.critic, dtype, device, attn) if config.critic is not None else None
        return cls(loaded, device, backend, config, reference=reference, critic=critic)

    @property
    def info(self) -> EngineInfo:
        return self._info

    @property
    def weights(self) -> Mapping[str, WeightsState]:
        return self._weights

    def stage(self, order: ReloadOrder) -> StagedWeights:
        """Read, check and place new weights for `order.target`; the served ones are untouched."""
        module, prefix, head = self._reloadable(order.target), "", None
        if order.target == "critic":
            assert self._critic is not None
            prefix = f"{module.base_model_prefix}."
            if not order.path.is_dir():
                raise WeightsRejected(f"{order.path}: a critic reload needs the checkpoint directory")
            try:
                head = read_value_head(order.path, int(module.config.hidden_size), self._device)
            except (OSError, ValueError) as exc:
                raise WeightsRejected(str(exc)) from exc
        served: Any = text_part(module.config)
        read: Callable[[dict[str, Path], set[str]], dict[str, torch.Tensor]] = read_all
        if self._sharded is not None:  # this rank's slices, checked against the whole model's config
            served, read = self._sharded.configs[order.target], self._sharded.layouts[order.target].read
        weights.check_config(order.path, served)
        mode = weights.choose_mode(order.mode, weights.module_bytes(module), self._device)
        return weights.stage(
            dataclasses.replace(order, mode=mode),
            module,
            prefix=prefix,
            allow_extra=lambda name: bool(prefix) and not name.startswith(prefix),  # the critic's heads
            extra=head,
            read=read,
        )

    def apply(self, staged: StagedWeights) -> WeightsState:
        """Serve the staged weights from the next micro-batch on. Engine thread only."""
        assert isinstance(staged, weights.Staged)
        target = staged.order.target
        weights.apply(staged)
        {
            "policy": self._policy.forward,
            "reference": self._reference.forward if self._reference else None,
            "critic": self._critic_forward,
        }[target].refresh()  # type: ignore[union-attr]  # a served target has a forward
        if target == "critic":
            assert self._critic is not None
            assert staged.extra is not None
            self._critic = Critic(self._critic.decoder, staged.extra)
        state = WeightsState(
            target,
            staged.order.version,
            str(staged.order.path),
            staged.mode,
            time.time(),
            self._weights[target].reloads + 1,
        )
        self._weights = {**self._weights, target: state}
        return state

    def _reloadable(self, target: Target) -> Any:
        model = {
            "policy": self._policy.model,
            "reference": self._reference.model if self._reference else None,
            "critic": self._critic.decoder if self._critic else None,
        }[target]
        if model is None:
            raise WeightsRejected(f"this server has no {target} model to reload")
        return model

    def launch(
        self, jobs: Sequence[SequenceJob], chunk: Chunk | None = None, forest: Forest | None = None
    ) -> InFlight:
        """Queue the micro-batch's forwards and the copies of its scores to host memory; no wait."""
        try:
            return self._launch(jobs, chunk, forest)
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
        if chunk.start == 0:
            job, capacity = chunk.job, chunk.job.num_tokens + SHAPE_STEP  # the filler's keys too
            wanted: dict[Target, bool] = {
                "policy": True,
                "reference": job.return_ref,
                "critic": job.return_values,
            }
            roles = [role for role in wanted if wanted[role] and role in self._weights]
            self._stores[chunk.sequence] = {role: KVStore(capacity) for role in roles}
        return self._stores[chunk.sequence]

    @torch.inference_mode()
    def _launch(self, jobs: Sequence[SequenceJob], chunk: Chunk | None, forest: Forest | None) -> InFlight:
        batch = pack(jobs, self._device, self._step, chunk=chunk, forest=forest)
        stores = self._stores_of(chunk)
        every = [*jobs, chunk.job] if chunk is not None else list(jobs)
        policy = self._policy.logprobs(batch.attach(stores.get("policy")), batch.want_entropy)
        expert_counts = _host_counts(self._policy.forward.expert_counts())  # before another forward
        ref = None
        if self._reference is not None and any(job.return_ref for job in every):
            ref = self._reference.logprobs(batch.attach(stores.get("reference")), want_entropy=False).logprobs
        values = None
        if self._critic is not None and any(job.return_values for job in every):
            assert self._critic_forward is not None
            values = _critic_values(
                self._critic, self._critic_forward, batch.attach(stores.get("critic")), self._gemm
            )
        if chunk is not None and chunk.last:
            self.release(chunk.sequence)  # freed once the work queued on the stores is done
        to_host = _host_copier(self._device, batch.num_actions)  # the padding actions' scores stay behind
        logprobs = to_host(policy.logprobs)
        assert logprobs is not None
        return InFlight(
            jobs=every,
            actions_per_sequence=batch.actions_per_sequence,
            logprobs=logprobs,
            entropy=to_host(policy.entropy),
            ref_logprobs=to_host(ref),
            values=to_host(values),
            done=_event(self._device),
            expert_counts=expert_counts,
        )

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Run every model's kernels once and check the heads reproduce the models' own final logits."""
        rng = random.Random(0)
        vocab = self._info.vocab_size
        n = min(64, self._info.max_positions)
        jobs = [
            SequenceJob(
                tokens=np.asarray([rng.randrange(vocab) for _ in range(n)], dtype=np.int64),
                actions=np.arange(1, n, dtype=np.int64),
                temperature=1.0,
                return_entropy=True,
                return_values=self._critic is not None,
                return_ref=self._reference is not None,
            )
            for _ in range(4)
        ]
        self.score(jobs)
        if self._sharded is not None:  # the models' own forwards need every rank's shard: no self-check
            log.info("warm-up done (rank %d of %d)", self._sharded.shard.rank, self._sharded.shard.world)
            if self._device.type == "cuda":
                self.meet_shapes()
            return
        delta = self._self_check(self._policy, jobs[0], "policy")
        if self._reference is not None:
            delta = max(delta, self._self_check(self._reference, jobs[0], "reference"))
        if self._critic is not None and self._critic_forward is not None:
            check_hidden(self._critic.decoder, self._critic_forward, jobs[0], self._device, "critic")
        log.info("warm-up done; self-check max |Δ logits| = %.3g", delta)
        if self._device.type == "cuda":
            self.meet_shapes()
        probe = pack(jobs[: max(1, self._max_tokens // n)], self._device, self._step)  # as a micro-batch
        for forward in self._forwards():
            forward.capture(probe)
        if self._device.type == "cuda":
            self._measure_longest(rng)
        policy = self._policy.forward
        if isinstance(policy, graphs.GraphedDecoder) and policy.disabled is not None:
            kernels = self._info.kernels.replace("+graphs", "")
            self._info = dataclasses.replace(self._info, kernels=kernels)

    def _self_check(self, lm: CausalLM, job: SequenceJob, role: str) -> float:
        """lm.self_check; under decoder=auto, a fused decoder that fails it gives way to the
        transformers decoder, with a warning, instead of failing the start (a model whose hidden states
        drift further in half precision than the bound expects is served, if slower)."""
        try:
            return lm.self_check(job, self._device)
        except DecoderMismatch as exc:
            if self._decoder_setting != "auto":
                raise
            log.warning("%s: %s; serving it with the transformers decoder instead", role, exc)
        lm.forward = decoder.TransformersDecoder(lm.model.base_model)
        if role == "policy":
            kernels = "none" if self._info.kernels.startswith(("triton", "none")) else self._info.kernels
            self._info = dataclasses.replace(
                self._info, decoder="transformers", kernels=kernels, moe_kernel="none"
            )
        return lm.self_check(job, self._device)

    def _measure_longest(self, rng: random.Random) -> None:
        """Score a sequence of two full chunks, every model asked (the chunked path's kernels met
        before serving), and set the longest sequence from the memory left beside its peak."""
        length = min(2 * self._max_tokens, self._info.max_positions)
        if length <= self._max_tokens:
            return
        job = SequenceJob(
            tokens=np.asarray([rng.randrange(self._info.vocab_size) for _ in range(length)], dtype=np.int64),
            actions=np.arange(1, length, dtype=np.int64),
            temperature=1.0,
            return_entropy=True,
            return_values=self._critic is not None,
            return_ref=self._reference is not None,
        )
        torch.cuda.synchronize(self._device)
        torch.cuda.reset_peak_memory_stats(self._device)
        for start in range(0, length, self._max_tokens):
            chunk = Chunk(job, sequence=-1, start=start, end=min(start + self._max_tokens, length))
            self.launch([], chunk).result()
        peak = torch.cuda.max_memory_allocated(self._device)
        free, total = torch.cuda.mem_get_info(self._device)
        elsewhere = total - free - torch.cuda.memory_reserved(self._device)  # other processes, the context
        room = int(total * _MEMORY_FRACTION) - elsewhere - peak
        per_token = sum(
            cache_bytes_per_token(text_part(m.config), next(m.parameters()).dtype)
            for m in self._cached_models()
        )
        layers = min(int(text_part(m.config).num_hidden_layers) for m in self._cached_models())
        # one store per model, and a layer's keys and values copied once more while it attends
        fits = max(0, int(room / (per_token * (1 + 2 / layers))) - SHAPE_STEP)
        self._info = dataclasses.replace(
            self._info, **_longest(self._info.max_positions, fits, self._max_sequence_setting)
        )
        log.info(
            "longest sequence: %d tokens (%s); a store costs %.1f KiB a token, %.1f GiB free for them",
            self._info.max_sequence_tokens,
            self._info.max_sequence_limit,
            per_token / 1024,
            room / (1 << 30),
        )

    def _cached_models(self) -> list[Any]:
        lms = [lm.model for lm in (self._policy, self._reference) if lm is not None]
        return lms + ([self._critic.decoder] if self._critic is not None else [])

    def _forwards(self) -> list[Decoder]:
        lms = [lm.forward for lm in (self._policy, self._reference) if lm is not None]
        return lms + [f for f in [self._critic_forward] if f is not None]

    @torch.inference_mode()
    def meet_shapes(self) -> None:
        """Run every GEMM shape a micro-batch can take, once (packing pads its token and action
        counts to multiples of SHAPE_STEP): cuBLAS stalls the host, holding the GIL, until the device
        is idle the first time it meets some shapes; on a live server that starves the event loop."""
        started = time.perf_counter()
        lms = [lm for lm in (self._policy, self._reference) if lm is not None]
        forwards = self._forwards()
        most = -(-self._max_tokens // SHAPE_STEP) * SHAPE_STEP
        for rows in range(SHAPE_STEP, most + 1, SHAPE_STEP):
            for forward in forwards:
                forward.warm(rows)
            if self._critic is not None:
                head = self._critic.head
                head(torch.zeros(rows, head.weight.shape[1], dtype=head.weight.dtype, device=self._device))
        for lm in lms:
            lm.warm_head(SHAPE_STEP)
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        log.info("met the GEMM shapes of up to %d tokens in %.1f s", most, time.perf_counter() - started)


def _prepare(  # noqa: PLR0917
    model: Any,
    base: Any,
    config: EngineConfig,
    backend: AttentionBackend,
    ops: Ops,
    device: torch.device,
    gemm: TokenGemms = gemms.ONE_CALL,
    sums: PartialSums = LOCAL,
) -> tuple[Decoder, str]:
    """The forward of `base` (the decoder of `model`) and the fused kernels it runs: triton|liger|none.

    kernels=liger patches transformers' modules, so it keeps the transformers decoder. `gemm`: how
    every GEMM over tokens runs (fixed-row calls in batch-invariant mode, transformers' own modules
    patched alike); `sums`: how the fused decoder's projections add into the residual.
    """
    setting = config.decoder
    if config.kernels == "liger":
        if setting == "fused":
            raise RuntimeError("kernels=liger patches the transformers decoder, not decoder=fused")
        setting = "transformers"
    dtype = next(model.parameters()).dtype
    chunk = resolve_tokens(config.mlp_chunk_tokens, text_part(model.config), dtype)
    mlp_kernel = "split" if config.mlp_kernel == "auto" and config.kernels == "none" else config.mlp_kernel

    def projection() -> gated.GatedProjection:  # chosen (and probed) only for a fused decoder
        return gated.choose(mlp_kernel, device, dtype, ops.swiglu)

    def moe_kernel() -> moe.MoeKernel:  # chosen (and probed) only for a fused decoder with experts
        return moe.choose(config.moe_kernel, device, dtype)

    chunk = gemm.whole_calls(chunk)
    forward = decoder.build(
        base, setting, backend.kernel, ops, chunk, projection, gemm=gemm, sums=sums, moe_kernel=moe_kernel
    )
    if isinstance(forward, decoder.FusedDecoder):
        kernels = "triton" if ops.name == "triton" else "none"
        return forward, f"{kernels}+quack" if forward.gated.name == "quack" else kernels
    if config.mlp_kernel == "quack":
        raise RuntimeError("mlp_kernel=quack runs in the fused decoder, which this model does not run")
    if config.moe_kernel in {"quack", "grouped_mm"} and decoder.sparse(base):
        raise RuntimeError(
            f"moe_kernel={config.moe_kernel} runs in the fused decoder, which this model does not run"
        )
    kernels = apply_fused_kernels(model, config.kernels, device, batch_invariant=gemm.rows is not None)
    chunk_mlps(model, chunk)  # after the kernels: wraps their MLP
    gemm.patch(base)
    if isinstance(gemm, FixedRows):
        moe.block_sparse(base, gemm.rows)
    return forward, kernels


def _fused(forward: Decoder) -> decoder.FusedDecoder | None:
    """The FusedDecoder `forward` runs (itself, or the one its CUDA graphs replay); None for another."""
    inner = forward.inner if isinstance(forward, graphs.GraphedDecoder) else forward
    return inner if isinstance(inner, decoder.FusedDecoder) else None


def _moe_kernel(forward: Decoder) -> str:
    """What runs the experts of `forward`'s sparse layers: quack | grouped_mm | loop; none: no sparse
    layer runs fused."""
    fused = _fused(forward)
    return fused.moe_kernel.name if fused is not None and fused.sparse else "none"


class DecoderMismatch(RuntimeError):
    """A fused decoder's hidden states are further from transformers' than rounding explains."""


@torch.inference_mode()
def check_hidden(base: Any, forward: Decoder, job: SequenceJob, device: torch.device, role: str) -> float:
    """‖ours - transformers'‖ / ‖transformers'‖ over the final hidden states [T, H] of one sequence;
    raise past _DECODER_TOL. Two half-precision forwards that round in another order drift apart over
    the layers (a few % at 28 bf16 layers), so the norm ratio, not the largest element, is bounded;
    a misread layer (a lost window, norm or rotation) moves it by tens of %.

    A fused decoder with mixture-of-experts layers runs pinned to the experts transformers' forward
    chose (its own router weights them): rounding flips near-tied router logits for a few tokens,
    and one token sent to another expert would count as a misread layer. What the routing itself
    gets right is bounded apart: in every sparse layer the experts it would have chosen must match
    transformers' for _ROUTING_AGREEMENT of the token-expert pairs."""
    batch = pack([job], device, step=1)
    every = torch.arange(batch.num_tokens, device=device)
    fused = _fused(forward)
    layers = fused.sparse_layers if fused is not None else []
    routes, own = _recorded_routes(base, batch, every, len(layers))
    if routes is None:
        ours = forward(batch, every)
    else:
        assert fused is not None
        ours = _pinned_forward(fused, layers, routes, batch, every, role)
    error = decoder.relative_error(ours, own)
    bound = _DECODER_TOL[next(base.parameters()).dtype]
    if not error <= bound:
        raise DecoderMismatch(
            f"{role}: the {forward.kind} decoder's hidden states differ from transformers' by {error:.3g} "
            f"of their norm (allowed {bound:.3g}); try decoder=transformers"
        )
    log.info("%s: the %s decoder is within %.3g of transformers' hidden states", role, forward.kind, error)
    return error


def _recorded_routes(
    base: Any, batch: PackedBatch, every: torch.Tensor, sparse_layers: int
) -> tuple[list[torch.Tensor] | None, torch.Tensor]:
    """transformers' final hidden states [T, H] of `batch`, and the expert ids [T, k] its sparse
    layers' routers chose (None where the fused decoder has no sparse layer, or the routers do not
    return (logits, weights, ids) as transformers 5's do)."""
    blocks = [layer.mlp for layer in base.layers if hasattr(layer.mlp, "experts")]
    if not sparse_layers or len(blocks) != sparse_layers:
        return None, decoder.TransformersDecoder(base)(batch, every)
    seen: list[Any] = []
    hooks = [block.gate.register_forward_hook(lambda _m, _i, out: seen.append(out)) for block in blocks]
    try:
        own = decoder.TransformersDecoder(base)(batch, every)
    finally:
        for hook in hooks:
            hook.remove()
    if len(seen) != len(blocks) or not all(isinstance(out, tuple) and len(out) == 3 for out in seen):
        return None, own
    return [out[2] for out in seen], own


def _pinned_forward(  # noqa: PLR0917
    fused: decoder.FusedDecoder,
    layers: list[moe.SparseMoe],
    routes: list[torch.Tensor],
    batch: PackedBatch,
    every: torch.Tensor,
    role: str,
) -> torch.Tensor:
    """The fused decoder's hidden states, run eagerly (no graph keeps the pins) with each sparse layer
    pinned to `routes`; raise where a layer's own routing agrees with them too little."""
    for i, (layer, route) in enumerate(zip(layers, routes, strict=True)):
        if route.shape != (batch.num_tokens, layer.routing.top_k):
            raise DecoderMismatch(
                f"{role}: sparse layer {i}: transformers' router chose {tuple(route.shape)} expert ids "
                f"where the fused decoder routes {batch.num_tokens} tokens to {layer.routing.top_k} each"
            )
        layer.pinned = moe.Pin(route)
    try:
        ours = fused(batch, every)
    finally:
        pins = [layer.pinned for layer in layers]
        for layer in layers:
            layer.pinned = None
    shares = [_agreement(torch.cat(pin.own), route) for pin, route in zip(pins, routes, strict=True) if pin]
    worst = min(range(len(shares)), key=shares.__getitem__)
    if not shares[worst] >= _ROUTING_AGREEMENT:
        raise DecoderMismatch(
            f"{role}: sparse layer {worst}: the fused decoder's router chose transformers' experts for "
            f"{shares[worst]:.1%} of the token-expert pairs (at least {_ROUTING_AGREEMENT:.0%} expected); "
            "try decoder=transformers"
        )
    log.info(
        "%s: the fused routers chose transformers' experts for >= %.1f%% of pairs", role, 100 * shares[worst]
    )
    return ours


def _agreement(got: torch.Tensor, want: torch.Tensor) -> float:
    """The share of token-expert pairs of want [T, k] that got [T, k] also has (each token's set)."""
    return float((got[:, :, None] == want[:, None, :]).any(dim=-1).float().mean())


def max_positions(config: Any) -> int:
    """The longest sequence `config`'s positions cover, with its rope scaling (YaRN, linear, dynamic:
    original_max_position_embeddings x factor where that is more)."""
    positions = int(getattr(config, "max_position_embeddings", 0) or 0)
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if isinstance(rope, dict) and isinstance(rope.get("factor"), int | float):
        original = int(rope.get("original_max_position_embeddings") or positions)
        positions = max(positions, int(original * float(rope["factor"])))
    return positions or 1 << 30


def _longest(positions: int, memory: int | None, setting: int | None) -> dict[str, Any]:
    """max_sequence_tokens and what sets it: the positions, the memory (None: not measured) or the
    setting (an explicit max_sequence_tokens below both; above the memory it fails the start)."""
    if setting is not None and memory is not None and setting > memory and setting <= positions:
        raise RuntimeError(
            f"max_sequence_tokens={setting}: this accelerator's memory holds the keys and values of "
            f"sequences of at most {memory} tokens beside the models and a micro-batch"
        )
    limits = [(positions, "positions")]
    if memory is not None:
        limits.append((memory, "memory"))
    if setting is not None:
        limits.append((setting, "setting"))
    tokens, limit = min(limits, key=lambda item: item[0])
    return {"max_sequence_tokens": tokens, "max_sequence_limit": limit}


def _model_info(role: Target, name: str, model: Any) -> ModelInfo:
    params = list(model.parameters())
    return ModelInfo(
        role=role,
        name=name,
        architecture=type(model).__name__,
        parameters=sum(p.numel() for p in params),
        memory_bytes=sum(p.numel() * p.element_size() for p in params)
        + sum(b.numel() * b.element_size() for b in model.buffers()),
    )


def _versions() -> dict[str, str]:
    import transformers

    versions = {
        "service": service.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    # the distributions' versions: flash-attn 4 alone leaves `flash_attn` a namespace, with no __version__
    for distribution in ("flash-attn", "flash-attn-4", "quack-kernels", "nvidia-cutlass-dsl"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[distribution.replace("-", "_")] = importlib.metadata.version(distribution)
    return versions
