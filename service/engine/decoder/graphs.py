"""CUDA graphs of the fused decoder's layers, one per padded micro-batch shape.

The fused decoder launches about ten kernels a layer from Python, and the flash-attn 4 and quack
kernels each pass through a Python wrapper: at Qwen2.5-0.5B the host needs most of a micro-batch's
device time to launch it, and it shares the GIL with the HTTP event loop, so under load the device
waits for launches. A graph launches a micro-batch's layers in one call.

What a graph covers: the embedding, the rotary tables and every layer but the last. The last layer
(whose output projection and MLP run on the rows the heads read, which vary per micro-batch) and the
heads run as before, on views of the graph's outputs: about fifteen launches.

Static buffers. The graphs of one decoder read token ids, positions and sequence boundaries from
buffers sized for the largest micro-batch and write the residual stream and the rotary tables into
others; a replay copies the batch in (four small copies), replays and hands the views to the last
layer. Every graph of every decoder allocates its intermediates from one memory pool: one stream runs
the replays one after another and no intermediate outlives its graph, so they share its blocks.

Keys. A graph is fixed to N tokens (packing pads N to a multiple of SHAPE_STEP), to a number of
sequence slots (the boundaries end in empty sequences up to it) and to the `max_len` bound the
attention kernel is given. flash-attn 4's varlen grid depends on N and the slots only, so it takes
max_len = N and the sequences' count rounded up to a power of two, at least 64 slots: one graph per N
serves every micro-batch of up to 64 sequences (RL traffic: 16 to 60 in a 16k-token micro-batch),
and those are captured largest first: at start those of the largest START_TOKENS tokens' worth of N,
the rest queued for the idle time (a size met before its turn is captured there and then, as any live
shape first met is); a micro-batch of more sequences replays one of
128, 256, ... slots, captured the first time its size is met (each empty slot costs the kernel
time, so the start-up graphs hold no more than RL traffic fills). The other
kernels' grids grow with max_len x slots, so those round both up to powers of two and are captured the
first time they are met. Past `limit` graphs the least recently used one goes.

Shared prefixes. A micro-batch whose segments attend to prefixes other segments compute (the
batch's KVContext without a store: GRPO groups, multi-turn traffic) gathers each layer's keys and
values by its `key_index`. Its graphs (the key's `keys`) read that index, its length K and the key
boundaries from static buffers too: the index holds KEYS_PER_TOKEN x the token capacity rows, of
which the gather (batch/key_gather.py) reads the first K, and attention is given that many keys (rows
past K unread) and, with a total-bounded kernel, the index's size as the longest key segment. A
micro-batch of more keys, or with a chunk's cached context, runs eagerly. Where one graph serves each
N, the shared graphs are captured at start beside the others, after a check on the probe with each
segment given the one before it as its prefix; otherwise each variant's first graph is checked
where it is captured, as routed ones are. A failed check turns graphs off for shared micro-batches
only (`shared_off`). In batch-invariant mode they run eagerly, the path its bitwise GPU suite covers.

Routes. A micro-batch that records MoE routes (R2) or replays given ones (R3, moe/replay.py) replays
a graph of its own mode (the key's `mode`: live / record / replay). Its routes go through static
buffers (graph_routes.py): the given ids copied in, the records copied out after the last layer. The
first graph of a mode is checked where it is captured: its replay, over outputs cleared first,
against the eager forward of the same batch (hidden states within the start-up check's bound, the
records equal); a mismatch or a failed capture turns graphs off for that mode (a warning; eager from
then on), never for live routing. For an MoE policy the engine checks each mode on its warm-up
probe in its first idle times after the start (allocating the static routes then), and `plan_routed`
queues a record and a replay graph for every N: captured one at a time while the engine idles
(`capture_pending`, which the batcher calls between bursts), not at start, where they would double
the graphs' share of the time to ready. A
routed shape met before its graph is captured runs eagerly and goes to the queue's front; met again
before the engine idled, its graph is captured there and then, as a live one's would be. The queue
never evicts a graph: past the limit, what is left of it is dropped.

The prefix cache. Where the engine keeps a pool for this decoder's model (`attach_pool`, before the
graphs are captured), every graph writes each layer's keys and values of its N rows into the pool at
the rows of a static index (cache/pool.py), those the micro-batch does not keep to the pool's trash
row; a replay fills the index first. A micro-batch that reads the pool (cached prefixes, a chunk's
cached context) runs eagerly.

Safety. Capture runs in thread-local mode, so the results thread's waits on events go on meanwhile.
`capture` checks a graph's result against the eager forward at start; a capture that fails turns
graphs off for the decoder with a warning, and it runs eagerly from then on (cuda_graphs=on: graphs
off by the end of the start fail it; while serving no request fails for them). A reload that rebinds
parameters (swap mode) drops the graphs, which read the old tensors; they are captured again as met.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from service.engine.batch.kv_store import KVContext
from service.engine.batch.packing import SHAPE_STEP, PackedBatch
from service.engine.cache.pool import ModelPool, PoolIO, Saves
from service.engine.decoder.base import Decoder, DecoderKind, relative_error
from service.engine.decoder.fused import FusedDecoder, Stream
from service.engine.decoder.graph_routes import RouteBuffers, RouteMode, mode_of
from service.engine.runtime.packages import FAST_DTYPES

log = logging.getLogger(__name__)

# the attention kernels whose varlen grid depends on N and the number of sequences only
TOTAL_BOUNDED = frozenset({"flash_attn_cute"})
# the attention kernels that can be captured (sdpa reads the boundaries on the host)
CAPTURABLE = frozenset({"flash_attn_cute", "flash_attn", "torch_varlen"})
MIN_SLOTS = {True: 64, False: 8}  # sequence slots of a graph, by TOTAL_BOUNDED
# ‖graph - eager‖ / ‖eager‖ over final hidden states in the start-up check: the same kernels on the
# same shapes, so only a wrong buffer or boundary moves it
_CHECK_TOL = 1e-3
# gathered key rows a shared micro-batch's graph holds, per token of the capacity: a GRPO group of G
# completions under a prompt of P tokens reads about (G + 1) P + sum of completions keys for its
# P + sum of completions tokens, at most G + 1 times as many
KEYS_PER_TOKEN = 8
# The sizes the start captures, where one graph serves each N: those of the largest START_TOKENS
# tokens' worth of N (two graphs each, live and shared); the smaller N wait for the idle time's
# queue. Each N's first capture compiles kernels on a cold cache: a Qwen3-30B-A3B start on an H200
# took 36 s to ready for a budget of 16,384 tokens and 62.5 s for 24,576, all sizes captured.
START_TOKENS = 16384


class Recorder(Protocol):
    def capture(self, body: Callable[[], None]) -> Callable[[], None]:
        """Record `body`'s device work; the returned call runs it again, on the current stream."""


class CudaRecorder:
    """torch.cuda.CUDAGraph capture on a side stream, into one memory pool shared by every graph."""

    def __init__(self, device: torch.device) -> None:
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        # The allocator frees a pool once no graph uses it, and a later capture into the freed pool's
        # handle fails an internal assertion: this graph of one tiny kernel keeps it while the others go
        # (evicted, or dropped by a reload).
        mark = torch.zeros(1, device=device)
        self._anchor = self._graph(lambda: mark.add_(1))

    def capture(self, body: Callable[[], None]) -> Callable[[], None]:
        replay: Callable[[], None] = self._graph(body).replay
        return replay

    def _graph(self, body: Callable[[], object]) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
            try:
                body()
            finally:
                graph.capture_end()
        torch.cuda.current_stream().wait_stream(self.stream)
        return graph


class EagerRecorder:
    """The CPU twin of CudaRecorder: a replay runs the body again, over the same static buffers."""

    def capture(self, body: Callable[[], None]) -> Callable[[], None]:
        return body


@dataclass(frozen=True, slots=True)
class GraphKey:
    tokens: int  # N
    slots: int  # sequence slots: cu has slots + 1 entries
    max_len: int  # the bound the attention kernel is given
    mode: RouteMode = "live"  # what the sparse layers do with routes (graph_routes.py)
    keys: int = 0  # rows of the shared-prefix gather's static index (0: each segment's own keys)
    max_len_k: int = 0  # with keys: the longest key segment the attention kernel is given


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


class _Buffers:
    """The static inputs and outputs every graph of one decoder reads and writes (views of these)."""

    def __init__(self, inner: FusedDecoder, capacity: int, slots: int) -> None:
        weight = inner.decoder.embed_tokens.weight
        device, dtype = weight.device, weight.dtype
        self.ids = torch.zeros(capacity, dtype=torch.long, device=device)
        self.positions = torch.zeros(1, capacity, dtype=torch.long, device=device)
        self.cu = torch.zeros(slots + 1, dtype=torch.int32, device=device)
        # a shared micro-batch's gather: its key_index, K, and its key boundaries (ending at K)
        self.key_index = torch.zeros(KEYS_PER_TOKEN * capacity, dtype=torch.long, device=device)
        self.key_count = torch.zeros(1, dtype=torch.int32, device=device)
        self.cu_k = torch.zeros(slots + 1, dtype=torch.int32, device=device)
        self.save_to = torch.zeros(capacity, dtype=torch.long, device=device)  # pool rows of the row's keys
        self.x = torch.zeros(capacity, weight.shape[1], dtype=dtype, device=device)
        self.cos = torch.zeros(capacity, inner.head_dim, dtype=dtype, device=device)
        self.sin = torch.zeros(capacity, inner.head_dim, dtype=dtype, device=device)


class GraphedDecoder:
    """A FusedDecoder whose layers but the last replay from CUDA graphs; the same function."""

    kind: DecoderKind = "fused"

    def __init__(  # noqa: PLR0917
        self,
        inner: FusedDecoder,
        recorder: Recorder,
        max_tokens: int,
        total_bounded: bool,
        limit: int,
        strict: bool = False,
        shared: bool = True,
        start_tokens: int = START_TOKENS,
    ) -> None:
        self.inner = inner
        self._recorder = recorder
        self._capacity = -(-max_tokens // SHAPE_STEP) * SHAPE_STEP
        self._start_below = max(0, self._capacity - start_tokens)  # N up to this: captured while idle
        self._total_bounded = total_bounded
        self._limit = limit
        self._strict = strict  # cuda_graphs=on: graphs off at the end of `capture` fail the start
        self._graphs: OrderedDict[GraphKey, Callable[[], None]] = OrderedDict()
        self._buffers: _Buffers | None = None
        self._params = self._signature()
        self.disabled: str | None = None  # why graphs are off for this decoder
        self.modes_off: dict[RouteMode, str] = {}  # why graphs are off for routed micro-batches of a mode
        self.shared_off: str | None = None  # why graphs are off for shared-prefix micro-batches
        if not shared:
            self.shared_off = "shared-prefix micro-batches run eagerly in batch-invariant mode"
        self._checked: set[tuple[RouteMode, bool]] = set()  # (mode, shared) variants whose check passed
        self._pending: OrderedDict[GraphKey, None] = OrderedDict()  # to capture while the engine idles
        self._met: set[GraphKey] = set()  # routed shapes run eagerly once while their graph was pending
        self._planned = False  # plan_routed queued every N's routed graphs (again after a rebind)
        self._routes: RouteBuffers | None = None
        self._pool: ModelPool | None = None

    def attach_pool(self, pool: ModelPool) -> None:
        """The prefix cache's pool of this decoder's model: every graph captured from now on writes it;
        those the warm-up captured before (meeting shapes, measuring) are dropped, to be captured again
        with it."""
        self._graphs.clear()
        self._pool = pool

    @property
    def graphs(self) -> int:
        return len(self._graphs)

    @property
    def key_capacity(self) -> int:
        """The most gathered keys a shared micro-batch's graph holds."""
        return KEYS_PER_TOKEN * self._capacity

    def key(self, tokens: int, sequences: int, max_len: int, max_len_k: int | None = None) -> GraphKey | None:
        """The graph a micro-batch of `tokens` over `sequences` (the longest `max_len`; with shared
        prefixes, the longest key segment `max_len_k`) replays; None: it runs eagerly (a shape packing
        does not give a micro-batch, or past the buffers)."""
        if tokens % SHAPE_STEP or not 0 < tokens <= self._capacity:
            return None
        slots = max(_pow2(sequences), MIN_SLOTS[self._total_bounded])
        bound = tokens if self._total_bounded else min(tokens, max(_pow2(max_len), SHAPE_STEP))
        if max_len_k is None:
            return GraphKey(tokens, slots, bound)
        keys = self.key_capacity
        bound_k = keys if self._total_bounded else min(keys, max(_pow2(max_len_k), SHAPE_STEP))
        return GraphKey(tokens, slots, bound, keys=keys, max_len_k=bound_k)

    def __call__(self, batch: PackedBatch, rows: torch.Tensor) -> torch.Tensor:
        sequences = batch.cu_seqlens.shape[0] - 1
        context = batch.context
        max_len_k = None if context is None or context.gather is None else context.max_len_k
        key = self.key(batch.num_tokens, sequences, batch.max_len, max_len_k)
        routes, mode = batch.routes, mode_of(batch.routes)
        if key is None or self.disabled is not None or not (self._gathers(context) and self._routable(batch)):
            return self.inner(batch, rows)  # a chunk, a shape no graph holds, a variant whose graphs are off
        key = dataclasses.replace(key, mode=mode)
        buffers, n = self._ready(), key.tokens
        self.inner.begin(batch)
        buffers.ids[:n].copy_(batch.input_ids[0])
        buffers.positions[:, :n].copy_(batch.position_ids)
        buffers.cu[: sequences + 1].copy_(batch.cu_seqlens)
        buffers.cu[sequences + 1 : key.slots + 1].fill_(n)  # empty sequences up to the graph's slots
        if self._pool is not None:  # the pool rows the row's keys go to; the trash for those not kept
            buffers.save_to[:n].fill_(self._pool.trash)
            save = context.io.save if context is not None and context.io is not None else None
            if save is not None:
                assert save.src is not None
                buffers.save_to.index_copy_(0, save.src, save.dst)
        if context is not None and context.gather is not None:
            count = context.gather.shape[0]
            buffers.key_index[:count].copy_(context.gather)
            buffers.key_count.fill_(count)
            buffers.cu_k[: sequences + 1].copy_(context.cu_k)
            buffers.cu_k[sequences + 1 : key.slots + 1].fill_(count)
        static = None
        if routes is not None:
            assert self._routes is not None
            self._routes.load(routes, n)
            static = self._routes.view(mode, n)
        replay = self._graphs.get(key)
        if replay is not None:
            self._graphs.move_to_end(key)
            replay()
        elif self._unchecked(key):  # a variant's first graph: checked as captured
            if not self._record_checked(key):
                return self.inner(batch, rows)
        else:  # first met: run what the graph will record, eagerly (every kernel of the shape is then
            self._body(key)  # compiled and loaded: loading one inside a capture fails it), then record it
            self._met_eagerly(key)
        x, cos, sin = buffers.x[:n], buffers.cos[:n], buffers.sin[:n]
        stream = Stream(x, cos, sin, batch.cu_seqlens, batch.max_len, context)
        with self.inner.routed(static):  # the last layer records into the same buffers
            out = self.inner.finish(stream, rows)
        if routes is not None:
            assert self._routes is not None
            self._routes.unload(routes, n)
        return out

    def _met_eagerly(self, key: GraphKey) -> None:
        """`key`'s body has just run eagerly: capture its graph now (a live shape, or a routed one met
        before), or queue it first for the engine's next idle moment (a routed shape met first)."""
        if key.mode == "live" or key in self._met:
            self._pending.pop(key, None)
            self._record(key)
            return
        self._met.add(key)
        self._pending[key] = None
        self._pending.move_to_end(key, last=False)

    @property
    def pending(self) -> int:
        """Graphs queued to capture while the engine idles."""
        return len(self._pending)

    def plan_routed(self) -> int:
        """Queue a record and a replay graph for every N, largest first, where one graph serves each N
        and both modes' checks have passed (the static routes allocated): how many were queued."""
        if self.disabled is not None or not self._total_bounded or self._routes is None:
            return 0
        self._planned = True
        routed: tuple[RouteMode, ...] = ("record", "replay")
        modes = [mode for mode in routed if mode not in self.modes_off and (mode, False) in self._checked]
        for tokens in range(self._capacity, 0, -SHAPE_STEP):
            live = self.key(tokens, 1, tokens)
            if live is None:
                continue
            for mode in modes:
                key = dataclasses.replace(live, mode=mode)
                if key not in self._graphs:
                    self._pending.setdefault(key, None)
        return len(self._pending)

    def capture_pending(self) -> bool:
        """Capture the next queued graph (none past the limit: the queue is dropped then); True while
        more are queued. On the engine's thread, between micro-batches: a capture launches nothing."""
        while self._pending:
            key, _ = self._pending.popitem(last=False)
            off = self.disabled is not None or key.mode in self.modes_off
            if key in self._graphs or off or (key.keys and self.shared_off is not None):
                continue
            if len(self._graphs) >= self._limit:
                dropped = len(self._pending) + 1
                log.info("CUDA graphs: %d queued shapes dropped at the limit of %d", dropped, self._limit)
                self._pending.clear()
                break
            self._prime(key)
            self._record(key)
            break
        return bool(self._pending)

    def _prime(self, key: GraphKey) -> None:
        """Run `key`'s body eagerly before its capture, as a first-met micro-batch's is (a kernel met
        first inside a capture fails it), over static inputs of its own: its N tokens of id 0 in
        segments of at most its max_len, each attending to its own keys only, none written to the
        prefix cache's pool (the trash row), nothing given."""
        buffers, n = self._ready(), key.tokens
        longest = min(key.max_len, key.max_len_k) if key.keys else key.max_len
        starts = np.arange(0, n, longest)  # at most key.slots: a micro-batch of the key had no more
        bounds = np.full(key.slots + 1, n, dtype=np.int32)
        bounds[: starts.shape[0]] = starts
        rows = np.arange(n)
        device = buffers.ids.device
        buffers.ids[:n].zero_()
        buffers.positions[0, :n].copy_(torch.from_numpy(rows % longest).to(device))
        buffers.cu[: key.slots + 1].copy_(torch.from_numpy(bounds).to(device))
        if self._pool is not None:
            buffers.save_to[:n].fill_(self._pool.trash)
        if key.keys:
            buffers.key_index[:n].copy_(torch.from_numpy(rows).to(device))
            buffers.key_count.fill_(n)
            buffers.cu_k[: key.slots + 1].copy_(buffers.cu[: key.slots + 1])
        if self._routes is not None:
            self._routes.covered[:n].zero_()
        self._body(key)

    def _gathers(self, context: KVContext | None) -> bool:
        """Whether a graph may run a micro-batch with `context`: none, or shared prefixes' keys within
        the static index while shared graphs are on (no chunk's store, no read of the prefix cache), or
        only keys the prefix cache keeps."""
        if context is None:
            return True
        if context.store is not None or (context.io is not None and context.io.reads):
            return False
        if context.gather is None:
            return context.io is not None and self._pool is not None
        if self.shared_off is not None:
            return False
        return context.gather.shape[0] <= self.key_capacity

    def _unchecked(self, key: GraphKey) -> bool:
        """Whether `key` is the first graph of a variant checked where it is captured: routed modes,
        and shared prefixes where no start-up check covered them."""
        return (key.mode != "live" or key.keys > 0) and (key.mode, key.keys > 0) not in self._checked

    def _routable(self, batch: PackedBatch) -> bool:
        """Whether a graph may run `batch`'s routes (allocating the static ones the first time)."""
        routes = batch.routes
        if routes is None:
            return True
        if mode_of(routes) in self.modes_off:
            return False
        if self._routes is None:
            given = routes.given.dtype if routes.given is not None else torch.uint8
            self._routes = RouteBuffers(self._capacity, routes, given)
        return self._routes.fits(routes, batch.num_tokens)

    def _record_checked(self, key: GraphKey) -> bool:
        """Capture the first graph of a variant (a routed mode, shared prefixes) and check it: the
        eager body and the graph's replay (over cleared outputs) must give the same hidden states and
        records. False (graphs off for the variant, the static buffers then unreliable) where the
        capture fails or the check does."""
        buffers, n, mode = self._ready(), key.tokens, key.mode
        outputs = [] if mode == "live" or self._routes is None else self._routes.outputs(mode, n)
        for out in outputs:
            out.fill_(-1)
        self._body(key)
        want_x, want = buffers.x[:n].clone(), [out.clone() for out in outputs]
        try:
            replay = self._recorder.capture(lambda: self._body(key))
        except Exception as exc:  # this variant runs eagerly
            self._variant_off(key, f"capture of {key} failed: {type(exc).__name__}: {exc}")
            return False
        buffers.x[:n].zero_()
        for out in outputs:
            out.fill_(-1)
        replay()
        error = relative_error(buffers.x[:n], want_x)
        same = all(torch.equal(got, wanted) for got, wanted in zip(outputs, want, strict=True))
        if not (error <= _CHECK_TOL and same):
            records = "equal" if same else "different"
            reason = f"a graph's hidden states are {error:.3g} from the eager ones, records {records}"
            self._variant_off(key, reason)
            return False
        variant = f"{mode} routes" + (" and shared prefixes" if key.keys else "")
        log.info("CUDA graphs for %s: within %.3g of the eager forward, the same records", variant, error)
        self._checked.add((mode, key.keys > 0))
        self._graphs[key] = replay
        if len(self._graphs) > self._limit:
            self._graphs.popitem(last=False)
        return True

    def _variant_off(self, key: GraphKey, reason: str) -> None:
        """Graphs off for `key`'s variant: shared prefixes where they were what was new, its routed
        mode where that was (both, where neither had passed a check)."""
        shared_new = key.keys > 0 and ("live", True) not in self._checked
        mode_new = key.mode != "live" and (key.mode, False) not in self._checked
        if key.keys and (shared_new or not mode_new):
            self._shared_off(reason)
        if key.mode != "live" and (mode_new or not key.keys):
            self._mode_off(key.mode, reason)

    def _shared_off(self, reason: str) -> None:
        self.shared_off = reason
        for key in [key for key in self._graphs if key.keys]:
            del self._graphs[key]
        log.warning("CUDA graphs off for micro-batches with shared prefixes (%s); they run eagerly", reason)

    def _mode_off(self, mode: RouteMode, reason: str) -> None:
        self.modes_off[mode] = reason
        for key in [key for key in self._graphs if key.mode == mode]:
            del self._graphs[key]
        log.warning("CUDA graphs off for micro-batches with %s routes (%s); they run eagerly", mode, reason)

    def refresh(self) -> None:
        self.inner.refresh()
        params = self._signature()
        if params != self._params:  # a swap reload rebound parameters the graphs read
            self._params = params
            self._graphs.clear()
            self._pending.clear()
            self._met.clear()
            if self._planned:
                self.plan_routed()
            log.info("weights rebound: CUDA graphs dropped, captured again as micro-batches meet them")

    def warm(self, rows: int) -> None:
        self.inner.warm(rows)

    def expert_counts(self) -> torch.Tensor | None:
        return self.inner.expert_counts()

    def capture(self, probe: PackedBatch) -> None:
        """Check a graph against the eager forward on `probe` (turning graphs off, with a warning, if
        it fails); then, where one graph serves each N, capture them all, largest first (the engine's
        warm-up has run every kernel they record: meet_shapes the GEMMs of each N, the probe the rest).
        With cuda_graphs=on, graphs off by then (here, or in the warm-up's scoring) fail the start."""
        if self.disabled is None:
            self._check(probe)
        if self.disabled is None and self._total_bounded:
            if self.shared_off is None:
                self._check_shared(probe)
            self._capture_sizes()
        if self.disabled is not None and self._strict:
            raise RuntimeError(f"cuda_graphs=on: {self.disabled}")

    def _check(self, probe: PackedBatch) -> None:
        key = self.key(probe.num_tokens, probe.cu_seqlens.shape[0] - 1, probe.max_len)
        if key is None:
            self._turn_off(f"no graph holds the {probe.num_tokens}-token probe to check them on")
            return
        every = torch.arange(probe.num_tokens, device=probe.input_ids.device)
        self(probe, every)  # recorded (run eagerly first) unless the warm-up's scoring met the shape
        if self.disabled is not None:
            return
        other = dataclasses.replace(probe, input_ids=probe.input_ids.flip(1))  # the same shape, new tokens
        error = relative_error(self(other, every), self.inner(other, every))  # replayed, and eager
        if not error <= _CHECK_TOL:
            self._turn_off(f"a graph's hidden states are {error:.3g} of their norm from the eager ones")
            return
        log.info("CUDA graphs: within %.3g of the eager forward", error)

    def _check_shared(self, probe: PackedBatch) -> None:
        """Check the shared-prefix graphs on `probe` with every segment attending to the one before it
        too, as to a prefix: captured and checked as met (`_record_checked`), then replayed on other
        tokens against the eager forward. A failure turns them off (`shared_off`)."""
        shared = dataclasses.replace(probe, context=_prefixed(probe.cu_seqlens))
        every = torch.arange(probe.num_tokens, device=probe.input_ids.device)
        self(shared, every)
        if self.shared_off is not None or self.disabled is not None:
            return
        other = dataclasses.replace(shared, input_ids=probe.input_ids.flip(1))
        error = relative_error(self(other, every), self.inner(other, every))
        if not error <= _CHECK_TOL:
            self._shared_off(f"a shared graph's hidden states are {error:.3g} of their norm from the eager")

    def _capture_sizes(self) -> None:
        """One graph per N, largest first, and one for shared micro-batches of each N (where on): those
        of N above the start's share now, the others queued for the idle time (START_TOKENS)."""
        started = time.perf_counter()
        keys = [
            key
            for tokens in range(self._capacity, 0, -SHAPE_STEP)
            for key in (self.key(tokens, 1, tokens), self.key(tokens, 1, tokens, tokens))
        ]
        for key in keys:
            if key is None or key in self._graphs or (key.keys and self.shared_off is not None):
                continue
            if key.tokens <= self._start_below:
                self._pending.setdefault(key, None)
                continue
            if len(self._graphs) >= self._limit:  # keep the largest: the smaller ones are captured as met
                break
            if not self._record(key) and self.disabled is not None:
                return
        seconds = time.perf_counter() - started
        log.info(
            "CUDA graphs: captured %d shapes in %.1f s, %d left for idle time",
            len(self._graphs),
            seconds,
            len(self._pending),
        )

    def _turn_off(self, reason: str) -> None:
        """Graphs off for this decoder: the micro-batch at hand and every later one run eagerly."""
        self.disabled = reason
        self._graphs.clear()
        log.warning("CUDA graphs off (%s); the decoder launches its kernels one by one", reason)

    def _record(self, key: GraphKey) -> bool:
        """Capture `key`'s graph; False if that failed, which turns graphs off."""
        self._ready()  # the buffers are allocated outside every graph (inside, a replay would zero them)
        try:
            replay = self._recorder.capture(lambda: self._body(key))
        except Exception as exc:  # graphs go off (for a variant: its own); micro-batches run eagerly
            reason = f"capture of {key} failed: {type(exc).__name__}: {exc}"
            if key.mode == "live" and not key.keys:
                self._turn_off(reason)
            else:
                self._variant_off(key, reason)
            return False
        self._graphs[key] = replay
        if len(self._graphs) > self._limit:
            self._graphs.popitem(last=False)
        return True

    def _body(self, key: GraphKey) -> None:
        """What a graph of `key` records: the static inputs through every layer but the last."""
        buffers, n, inner = self._ready(), key.tokens, self.inner
        cu = buffers.cu[: key.slots + 1]
        fresh = inner.start(buffers.ids[:n], buffers.positions[:, :n], cu, key.max_len)
        buffers.x[:n].copy_(fresh.x)
        buffers.cos[:n].copy_(fresh.cos)
        buffers.sin[:n].copy_(fresh.sin)
        del fresh
        context = None
        io = None if self._pool is None else PoolIO(self._pool, save=Saves(None, buffers.save_to[:n]))
        if key.keys:
            count = buffers.key_count
            cu_k = buffers.cu_k[: key.slots + 1]
            context = KVContext(cu_k, key.max_len_k, buffers.key_index, count=count, io=io)
        elif io is not None:
            context = KVContext(cu, key.max_len, io=io)
        stream = Stream(buffers.x[:n], buffers.cos[:n], buffers.sin[:n], cu, key.max_len, context)
        routes = None if self._routes is None else self._routes.view(key.mode, n)
        with inner.routed(routes):
            for layer in inner.layers[:-1]:
                inner.run_layer(layer, stream)

    def _ready(self) -> _Buffers:
        if self._buffers is None:
            slots = max(_pow2(self._capacity), MIN_SLOTS[self._total_bounded])
            self._buffers = _Buffers(self.inner, self._capacity, slots)
        return self._buffers

    def _signature(self) -> tuple[int, ...]:
        """Where every tensor the graphs read lives."""
        module = self.inner.decoder
        return tuple(t.data_ptr() for t in (*module.parameters(), *module.buffers()))


def _prefixed(cu: torch.Tensor) -> KVContext:
    """Keys for a packed row's segments (boundaries `cu`, [S+1]) where each attends to the one before
    it as to its prefix, then to itself: a shared micro-batch's layout on any row, for checks."""
    bounds = cu.cpu().numpy().astype(np.int64)
    parts, lengths = [], []
    for i in range(bounds.shape[0] - 1):
        first = bounds[max(i - 1, 0)]
        parts.append(np.arange(first, bounds[i + 1]))
        lengths.append(bounds[i + 1] - first)
    key_lengths = np.asarray(lengths, dtype=np.int64)
    cu_k = np.concatenate(([0], np.cumsum(key_lengths))).astype(np.int32)
    gather = torch.from_numpy(np.concatenate(parts)).to(cu.device)
    return KVContext(torch.from_numpy(cu_k).to(cu.device), int(key_lengths.max()), gather)


def wrap(  # noqa: PLR0917
    forward: Decoder,
    setting: str,
    backend: str,
    device: torch.device,
    recorder: Recorder | None,
    max_tokens: int,
    limit: int,
    batch_invariant: bool = False,
) -> Decoder:
    """Resolve the `cuda_graphs` setting for one decoder: auto graphs a fused decoder on CUDA in bf16/fp16
    with a capturable attention kernel; on requires it. In batch-invariant mode a micro-batch that
    shares prefixes runs eagerly: the mode's GPU bitwise suite covers that path."""
    if setting == "off":
        return forward
    dtype = forward.decoder.embed_tokens.weight.dtype if isinstance(forward, FusedDecoder) else None
    reason = None
    if not isinstance(forward, FusedDecoder):
        reason = "the transformers decoder runs here (graphs cover the fused decoder)"
    elif device.type != "cuda" or recorder is None:
        reason = "the device is not CUDA"
    elif backend not in CAPTURABLE:
        reason = f"attention={backend} reads the sequence boundaries on the host"
    elif dtype not in FAST_DTYPES:
        reason = f"{dtype} attention falls back to a kernel that reads the boundaries on the host"
    elif forward.sparse and forward.moe_kernel.name == "loop":
        reason = "the experts' loop reads each expert's rows on the host (moe_kernel=loop)"
    if reason is not None:
        if setting == "on":
            raise RuntimeError(f"cuda_graphs=on: {reason}")
        return forward
    assert isinstance(forward, FusedDecoder)
    assert recorder is not None
    strict = setting == "on"
    bounded = backend in TOTAL_BOUNDED
    return GraphedDecoder(forward, recorder, max_tokens, bounded, limit, strict, shared=not batch_invariant)
