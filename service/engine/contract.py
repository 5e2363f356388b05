"""The engine contract, free of torch so that the HTTP side can depend on it."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

from service.core.cache_plan import CachePlan
from service.core.jobs import Chunk, IntArray, SequenceJob, SequenceScores
from service.core.prefix_cache import PrefixIndex
from service.core.prefixes import Forest

# Token and action counts are padded up to a multiple of this, so that a micro-batch's GEMMs take one
# of few shapes, which the engine's warm-up meets before serving: cuBLAS stalls the host (holding the
# GIL) the first time it meets some shapes, until the device is idle. Costs under 1 % of a full
# micro-batch's tokens. The batcher gives a chunk no less (a smaller one would pass a padded size).
SHAPE_STEP = 128
# Rows of every GEMM call over tokens in batch-invariant mode (strategies/gemm.py); micro-batches and
# actions are padded to multiples of it.
GEMM_ROWS = 1024

Target = Literal["policy", "reference", "critic"]
ReloadMode = Literal["auto", "copy", "swap"]


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """One model of the engine: its role (policy, reference, critic) and what it costs."""

    role: Target
    name: str
    architecture: str
    parameters: int
    memory_bytes: int


@dataclass(frozen=True, slots=True)
class MoeShape:
    """The policy's mixture-of-experts layers as routes address them: `layers` sparse layers (in
    model order), `experts` experts each, `top_k` chosen per token."""

    layers: int
    experts: int
    top_k: int


@dataclass(frozen=True, slots=True)
class EngineInfo:
    model: str
    demo: bool
    architecture: str
    dtype: str
    device: str
    attention_backend: str
    decoder: str
    kernels: str
    vocab_size: int
    max_positions: int  # with the model's rope scaling
    versions: dict[str, str]
    max_batch_tokens: int  # the micro-batch token budget the engine runs (config.batch_budget)
    models: tuple[ModelInfo, ...] = ()
    max_sequence_tokens: int = 0  # the longest sequence scored (0: max_positions)
    max_sequence_limit: str = "positions"  # what sets it: positions | memory | setting
    batch_invariant: bool = False  # scores bitwise independent of the batch (strategies/gemm.py)
    gemm: str = "one-call"  # how GEMMs over tokens run: one-call | fixed-rows-1024 | fixed-tiles-quack
    moe_kernel: str = "none"  # the fused decoder's experts: grouped_mm | loop; none: no sparse layer fused
    head_kernel: str = "chunked"  # the policy's head on log-prob-only calls: quack | chunked
    tensor_parallel_size: int = 1  # ranks (GPUs) each model is sharded over
    moe: MoeShape | None = None  # the policy's sparse layers; None: a dense policy
    prefix_cache_tokens: int = 0  # tokens each served model's prefix-cache pool holds (0: no cache)
    prefix_cache_bytes: int = 0  # every pool's bytes

    @property
    def roles(self) -> frozenset[str]:
        return frozenset(m.role for m in self.models)


@dataclass(frozen=True, slots=True)
class WeightsState:
    """Which weights one model serves, and how they arrived.

    mode: "initial" (loaded at start), "swap" (staged on the device beside the old weights, then
    copied into the parameters there) or "copy" (staged in host memory, then copied into the
    parameters in place).
    """

    target: Target
    version: str
    source: str
    mode: str
    loaded_at: float  # unix time they began serving
    reloads: int = 0


@dataclass(frozen=True, slots=True)
class ReloadOrder:
    target: Target
    path: Path
    version: str
    mode: ReloadMode = "auto"


class WeightsRejected(ValueError):
    """The checkpoint cannot replace the served weights (unreadable, another architecture or shape,
    non-finite values, no room); the served weights are untouched."""


class StagedWeights(Protocol):
    """New weights read (or received), checked and placed, ready to apply between micro-batches."""

    @property
    def target(self) -> Target: ...

    @property
    def version(self) -> str: ...

    @property
    def source(self) -> str:
        """Where they came from: a checkpoint's path, or the push group that sent them."""

    @property
    def mode(self) -> str: ...

    @property
    def nbytes(self) -> int: ...


@dataclass(frozen=True, slots=True)
class WeightGroup:
    """A trainer's weight-update group (SGLang's POST /init_weights_update_group). The trainer is rank
    0 and hosts the rendezvous store at master_address:master_port; this replica's ranks are
    rank_offset + its tensor-parallel rank, of world_size. A collective waits at most timeout_s."""

    name: str
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    backend: str  # "nccl", "gloo", or a device map such as "cpu:gloo,cuda:nccl"
    timeout_s: float


@dataclass(frozen=True, slots=True)
class Bucket:
    """One POST /update_weights_from_distributed: tensors the trainer broadcasts from rank 0 over
    `group`, in `names` order, one broadcast each or (flattened) one uint8 broadcast of their bytes
    back to back. Names are the Hugging Face checkpoint's; dtypes torch's, with or without "torch.".
    `mode` stages the version it begins (swap, copy or auto); later buckets keep that version's."""

    group: str
    target: Target
    version: str
    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    flattened: bool = False
    mode: ReloadMode = "auto"


@dataclass(frozen=True, slots=True)
class Received:
    """What one bucket left pending for its target: `complete` once every tensor the target holds
    has a value under `version` (then stage and apply it)."""

    target: Target
    version: str
    mode: str  # swap | copy: how the version is staged
    tensors: int  # this bucket's
    nbytes: int  # this bucket's, as broadcast
    complete: bool
    missing: int  # tensors of the target with no value under `version` yet


class PushRefused(WeightsRejected):
    """A bucket whose metadata does not fit the model (unknown name, wrong shape, a dtype it cannot
    take, misaligned flattened offsets, non-finite values): its broadcasts were received and dropped,
    nothing of it is pending, the group lives on."""


class PushBroken(RuntimeError):
    """The group failed mid-push (the trainer died or stalled past the timeout, or sent what cannot be
    received): the group is gone, with what it left pending; the served weights are untouched."""


@runtime_checkable
class WeightReceiver(Protocol):
    """An engine that takes weights a trainer pushes over a process group (engine/transfer/).

    Values received under a version stay pending, never served, until `stage_received` turns them
    into StagedWeights, which apply between micro-batches as a reload's do. `join_group` blocks until
    the trainer's rendezvous; `receive` until its bucket arrived (both any thread, one call of one
    group at a time, in the trainer's order)."""

    def join_group(self, group: WeightGroup) -> None: ...

    def leave_group(self, name: str) -> None:
        """Destroy the group; what it left pending is dropped."""

    def receive(self, bucket: Bucket) -> Received: ...

    def drain(self, bucket: Bucket) -> None:
        """Meet the bucket's broadcasts and drop them (it was refused before it was looked at);
        PushBroken where they cannot be met."""

    def stage_received(self, target: Target, version: str) -> StagedWeights:
        """What is pending for `target` (complete or not: the rest keeps its values), as `version`;
        with nothing pending, the served weights relabelled `version`."""

    def drop_received(self, target: Target) -> None: ...


class OutOfMemory(RuntimeError):
    """The accelerator ran out of memory on a micro-batch; the engine has released what it could.

    The batcher answers by splitting the micro-batch and retrying the halves.
    """


class Launched(Protocol):
    """A micro-batch whose work is queued on the accelerator."""

    def result(self) -> list[SequenceScores]:
        """Wait for the accelerator to finish it; its scores, in the order of its jobs. Any thread."""

    def expert_load(self) -> IntArray | None:
        """The real tokens each expert of each of the policy's sparse layers took in it, [layers,
        experts] (the layers the engine counts); None for a dense policy or one it does not count.
        Waits like `result`."""


class ScoringEngine(Protocol):
    """What the batcher needs: score packed micro-batches, and swap weights between micro-batches.

    `launch` queues a micro-batch's work and returns without waiting for it, so the next one can be
    queued behind it while the host collects this one's scores (`Launched.result`, on another
    thread). A micro-batch may end with one chunk of a sequence longer than a micro-batch; the
    chunks of a sequence are launched in order, and its scores are the chunks' scores, joined.
    `release` drops what the engine keeps of a chunked sequence whose last chunk will not come.
    `tend` does one step of the work the engine keeps for its idle time (an MoE policy's routed modes
    checked, then one CUDA graph captured a call) and says how many graphs are left; the batcher calls
    it while nothing is launched or queued.
    `launch`, `release`, `tend` and `apply` are called from the one engine thread only; `stage` from a
    loader thread, while micro-batches run.

    The prefix cache (core/prefix_cache.py): `prefix_cache` is the index over the engine's pools, from
    warm-up on (None: off), which the batcher plans each micro-batch's reads and writes with (the
    `cache` plan of `launch`); `apply` drops the entries of the model whose weights it replaces, and
    `flush_cache` every entry.
    """

    @property
    def info(self) -> EngineInfo: ...

    @property
    def weights(self) -> Mapping[str, WeightsState]: ...

    @property
    def prefix_cache(self) -> PrefixIndex | None: ...

    def launch(
        self,
        jobs: Sequence[SequenceJob],
        chunk: Chunk | None = None,
        forest: Forest | None = None,
        cache: CachePlan | None = None,
    ) -> Launched:
        """Scores of `jobs`, then of `chunk`'s actions if given. `forest`: the prefixes `jobs` share,
        each computed once (None: every job whole; a root past 0: its first tokens cached); `cache`:
        what the micro-batch reads from and writes to the prefix cache (None: nothing)."""

    def release(self, sequence: int) -> None: ...

    def tend(self) -> int: ...

    def flush_cache(self) -> None: ...

    def warm_up(self) -> None: ...

    def stage(self, order: ReloadOrder) -> StagedWeights: ...

    def apply(self, staged: StagedWeights) -> WeightsState: ...


class TokenText(Protocol):
    """The text of token ids under the checkpoint's own tokenizer (engine/tokenizer.py builds it).

    `piece(id)` is what `tokenizer.decode([id])` gives, vLLM's `decoded_token` and the OpenAI
    completions' `tokens`; `decode(ids)` is the text of a whole sequence (the echoed prompt).
    """

    def piece(self, token_id: int) -> str: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...


@runtime_checkable
class Supervised(Protocol):
    """An engine of several processes (tensor parallel: tensor_parallel/ranks.py), which fail together."""

    def supervise(self, on_failure: Callable[[str], None]) -> None:
        """Call `on_failure(reason)`, on another thread, once one of the engine's processes has died or
        diverged; the engine ends this process itself (exit status 1) if it has not ended soon after."""

    def close(self) -> None:
        """Stop the engine's other processes; after the batcher has stopped."""
