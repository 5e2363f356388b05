"""SequenceJobs (their shared prefixes once, and at most one chunk of a long sequence) -> one packed
row on the device, with everything the forward and the head need."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from service.core.cache_plan import CachePlan
from service.core.jobs import Chunk, SequenceJob
from service.core.prefixes import Forest, alone
from service.engine.batch import asks
from service.engine.batch import route_buffers as moe_routes
from service.engine.batch.asks import Extras
from service.engine.batch.device_routes import BatchRoutes
from service.engine.batch.kv_store import CONTEXT_KWARG, KVContext, KVStore
from service.engine.cache import row_slots as cache_rows
from service.engine.cache.pool import ModelPool
from service.engine.cache.row_slots import CacheRows
from service.engine.contract import SHAPE_STEP, MoeShape
from service.engine.runtime.copies import to_device

__all__ = ["SHAPE_STEP", "PackedBatch", "pack"]


@dataclass(frozen=True, slots=True)
class PackedBatch:
    """N tokens of S segments in one row; A action tokens to score.

    input_ids, position_ids: [1, N]   (each segment's positions in its sequence)
    cu_seqlens:              [S+1] int32 segment boundaries; max_len the longest segment
    hidden_index:            [A] index in N of the position t-1 that predicts each action t
    targets:                 [A] the action token ids
    inv_temperature:         [A] float32, 1 / T of each action's request; None when every T is 1
    extras:                  what some action rows ask beyond the log-prob (batch/asks.py); None: none

    A segment is a node of the micro-batch's Forest (prefixes.py): a whole sequence, or positions
    [start, end) of the sequences below a shared prefix, whose keys are then its ancestors' rows'
    keys followed by its own: key_index [K] gathers them, segment after segment, with key
    boundaries cu_k_own / max_len_k_own (None: every segment's keys are its own tokens).

    With `step` > 1, N and A are padded to multiples of it: a filler segment of token 0 ends the
    row (S counts it), and filler actions (row 0, token 0, T = 1) end the actions; `num_actions`
    are the real ones, first, and `actions_per_sequence` covers only them.

    With a chunk (tokens [start, end) of a long sequence), the chunk is the row's last segment, its
    positions start..end-1, and the filler joins it (after its real tokens, so no real token sees
    one): cu_k / max_len_k are the key boundaries once the segment's context of `start` cached
    tokens is in front of it, and `attach` gives the batch one model's context. Its actions come
    last in the actions.

    `routes`: the MoE routes the policy's forward replays and records (route_buffers.py), where a
    sequence gives or asks for them; `route_rows` where each sequence's positions lie in the row.

    With the prefix cache (cache/row_slots.py): a root that starts past 0 reads its first tokens' keys
    from the pool, gathered after the row's N rows (key_index then indexes [N + cached rows]); an
    action predicted inside them takes its hidden state from the pool (its hidden_index entry is
    row 0, unread); written blocks are kept. `attach` gives the batch one model's pool.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_len: int
    hidden_index: torch.Tensor
    targets: torch.Tensor
    inv_temperature: torch.Tensor | None
    actions_per_sequence: list[int]
    want_entropy: bool
    chunk_start: int | None = None  # the chunk's first position in its sequence; None: no chunk
    chunk_row: int = 0  # where the chunk's segment starts in the row (the other segments' tokens)
    cu_k: torch.Tensor | None = None  # [S+1] int32 key boundaries with the chunk's context
    max_len_k: int | None = None
    key_index: torch.Tensor | None = None  # [K] rows of every segment's keys (shared prefixes)
    shared_keys: int = 0  # entries of key_index before the chunk's segment's own
    cu_k_own: torch.Tensor | None = None  # [S+1] int32 boundaries of key_index's segments
    max_len_k_own: int | None = None
    context: KVContext | None = None
    filler: int = 0  # the row's last tokens, the filler (no sequence's)
    extras: Extras | None = None
    routes: BatchRoutes | None = None
    route_rows: moe_routes.RouteRows | None = None
    cache: CacheRows | None = None
    pool: ModelPool | None = None  # the attached model's
    model: str = "policy"

    def without_routes(self) -> PackedBatch:
        """This batch for a model that does not replay (the reference, the critic): its own routers."""
        return self if self.routes is None else dataclasses.replace(self, routes=None)

    def attach(
        self, store: KVStore | None, pool: ModelPool | None = None, model: str = "policy"
    ) -> PackedBatch:
        """This batch with one model's keys beyond each segment's own: the store of the chunk's
        context (None: the chunk's segment attends to itself only, for a model whose scores of it
        are not read), the shared prefixes' keys and the prefix cache's rows of `model`'s `pool`."""
        io = None if self.cache is None or pool is None else self.cache.io(model, pool)
        context = None
        if store is not None and self.chunk_start is not None:
            assert self.cu_k is not None
            assert self.max_len_k is not None
            gather = None if self.key_index is None else self.key_index[: self.shared_keys]
            context = KVContext(
                self.cu_k, self.max_len_k, gather, store, self.chunk_start, self.chunk_row, io=io
            )
        elif self.key_index is not None:
            assert self.cu_k_own is not None
            assert self.max_len_k_own is not None
            context = KVContext(self.cu_k_own, self.max_len_k_own, self.key_index, io=io)
        elif io is not None and io.save is not None:
            context = KVContext(self.cu_seqlens, self.max_len, io=io)
        return dataclasses.replace(self, context=context, pool=pool, model=model)

    def hidden(self, compute: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """[A, H] the action rows' final hidden states, `compute(rows)` being the attached model's
        decoder over this batch: the pool's where an action is predicted inside a cached prefix."""
        if self.cache is None or self.pool is None:
            return compute(self.hidden_index)
        return self.cache.hidden(compute, self.hidden_index, self.model, self.pool)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def num_actions(self) -> int:
        return sum(self.actions_per_sequence)

    def forward_kwargs(self) -> dict[str, object]:
        """Keyword arguments of a transformers decoder forward over this batch (no transformers KV
        cache; the packed attention reads the keys beyond each segment's own from CONTEXT_KWARG)."""
        kwargs: dict[str, object] = {
            "input_ids": self.input_ids,
            "position_ids": self.position_ids,
            "use_cache": False,
            "cu_seq_lens_q": self.cu_seqlens,
            "cu_seq_lens_k": self.cu_seqlens,
            "max_length_q": self.max_len,
            "max_length_k": self.max_len,
        }
        if self.context is not None:
            kwargs |= {
                "cu_seq_lens_k": self.context.cu_k,
                "max_length_k": self.context.max_len_k,
                CONTEXT_KWARG: self.context,
            }
        return kwargs


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The concatenation of arange(start, start + length) over the pairs."""
    if lengths.size == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = np.repeat(starts - np.concatenate(([0], np.cumsum(lengths)[:-1])), lengths)
    ranges: np.ndarray = np.arange(int(lengths.sum()), dtype=np.int64) + offsets
    return ranges


def _hidden_rows(
    jobs: Sequence[SequenceJob],
    forest: Forest,
    starts: np.ndarray,
    node_first: np.ndarray,
    node_lengths: np.ndarray,
) -> list[np.ndarray]:
    """Per job, [A] the row of the position t - 1 that predicts each action t: in the node of its
    path that holds t - 1."""
    rows = []
    for job, path in zip(jobs, forest.paths, strict=True):
        before = job.actions - 1
        root = node_first[path[0]]  # past 0: positions before it are cached (their row: 0, unread)
        if len(path) == 1:  # a sequence in one node (nothing shared): no search
            found = before + (starts[path[0]] - root)
        else:
            nodes = np.asarray(path, dtype=np.int64)
            at = nodes[np.searchsorted(node_first[nodes] + node_lengths[nodes], before, side="right")]
            found = starts[at] + before - node_first[at]
        rows.append(np.where(before >= root, found, 0) if root else found)
    return rows


def _key_index(
    forest: Forest, starts: np.ndarray, lengths: np.ndarray, read_at: dict[int, int], rows: int
) -> np.ndarray:
    """[K] the rows of every segment's keys, in turn: a node's root's cached rows (where it reads
    the prefix cache: `read_at` the root's first, past the row's `rows`), its ancestors' rows, then
    its own; the segments after the nodes (the filler, the chunk's) their own."""
    nodes = forest.nodes
    chains: list[list[int]] = []
    for i, node in enumerate(nodes):
        chains.append([*(chains[node.parent] if node.parent != -1 else []), i])
    firsts: list[np.ndarray] = []
    counts: list[np.ndarray] = []
    for chain in chains:
        at = np.asarray(chain, dtype=np.int64)
        if chain[0] in read_at:
            firsts.append(np.asarray([rows + read_at[chain[0]]], dtype=np.int64))
            counts.append(np.asarray([nodes[chain[0]].start], dtype=np.int64))
        firsts.append(starts[at])
        counts.append(lengths[at])
    for segment in range(len(nodes), lengths.shape[0]):
        firsts.append(starts[segment : segment + 1])
        counts.append(lengths[segment : segment + 1])
    return _ranges(np.concatenate(firsts), np.concatenate(counts))


def pack(  # noqa: PLR0915 (one row's arrays, built together)
    jobs: Sequence[SequenceJob],
    device: torch.device,
    step: int = SHAPE_STEP,
    chunk: Chunk | None = None,
    forest: Forest | None = None,
    *,
    moe: MoeShape | None = None,
    cache: CachePlan | None = None,
) -> PackedBatch:
    """The row of `jobs` (their shared prefixes once, per `forest`; None: each job whole), then the
    chunk's segment; padded to multiples of `step`. `moe`: the policy's sparse layers, which the routes
    jobs give or ask for address (route_buffers.py); `cache`: what the micro-batch reads from and
    writes to the prefix cache (its roots then start where each job's cached tokens end)."""
    if forest is None:
        forest = alone([job.num_tokens for job in jobs])
    nodes = forest.nodes
    node_lengths = np.asarray([n.length for n in nodes], dtype=np.int64)
    node_first = np.asarray([n.start for n in nodes], dtype=np.int64)
    others = int(node_lengths.sum())
    own = chunk.num_tokens if chunk is not None else 0
    filler = -(others + own) % step
    parts = [jobs[n.owner].tokens[n.start : n.end] for n in nodes]
    if chunk is None:
        lengths = np.concatenate((node_lengths, [filler] if filler else [])).astype(np.int64)
        first = np.concatenate((node_first, [0] if filler else [])).astype(np.int64)
    else:
        lengths = np.concatenate((node_lengths, [own + filler])).astype(np.int64)
        first = np.concatenate((node_first, [chunk.start])).astype(np.int64)
        parts.append(chunk.job.tokens[chunk.start : chunk.end])
    starts = np.concatenate(([0], np.cumsum(lengths)))  # [S+1]
    tokens = np.concatenate([*parts, np.zeros(filler, dtype=np.int64)])  # [N]
    positions = np.arange(tokens.shape[0], dtype=np.int64) + np.repeat(first - starts[:-1], lengths)
    hidden_rows = _hidden_rows(jobs, forest, starts, node_first, node_lengths)
    targets = [job.targets for job in jobs]
    inv_temperature = [np.full(job.actions.shape[0], 1.0 / job.temperature, dtype=np.float32) for job in jobs]
    per_sequence = [int(job.actions.shape[0]) for job in jobs]
    if chunk is not None:
        positions[others + own :] = 0  # the filler's: any position; 0 is one every model has
        actions = chunk.actions
        before = actions - 1
        hidden_rows.append(np.where(before >= chunk.start, before - chunk.start + others, 0))
        targets.append(chunk.targets)
        inv_temperature.append(np.full(actions.shape[0], 1.0 / chunk.job.temperature, dtype=np.float32))
        per_sequence.append(int(actions.shape[0]))
    firsts = np.concatenate(([0], np.cumsum(per_sequence)))  # each job's first action (then the chunk's)
    everything = np.concatenate(hidden_rows) if hidden_rows else np.zeros(0, dtype=np.int64)
    extra = -everything.shape[0] % step
    hidden_index = np.concatenate([everything, np.zeros(extra, dtype=np.int64)])

    def to(array: np.ndarray) -> torch.Tensor:
        return to_device(array, device)

    rows: CacheRows | None = None
    read_at: dict[int, int] = {}
    if cache is not None:
        rows, read_at = cache_rows.lay_out(cache, jobs, forest, starts, chunk, firsts, hidden_index, step, to)
    key_lengths = lengths.copy()
    key_index = None
    if forest.shared or forest.cached:
        key_lengths[: len(nodes)] = [node.end for node in nodes]
        key_index = _key_index(forest, starts, lengths, read_at, int(tokens.shape[0]))
    target_ids = np.concatenate([*targets, np.zeros(extra, dtype=np.int64)])
    inv_temperatures = np.concatenate([*inv_temperature, np.ones(extra, dtype=np.float32)])
    temperatures = [job.temperature for job in jobs] + ([chunk.job.temperature] if chunk else [])
    wants = [job.return_entropy for job in jobs] + ([chunk.job.return_entropy] if chunk else [])

    def bounds(key_lengths: np.ndarray) -> torch.Tensor:
        return to(np.concatenate(([0], np.cumsum(key_lengths))).astype(np.int32))

    context_lengths = key_lengths.copy()
    if chunk is not None:
        context_lengths[-1] += chunk.start
    scored = [asks.Part(job, 0, int(job.actions.shape[0]), int(firsts[i])) for i, job in enumerate(jobs)]
    if chunk is not None:
        lo = chunk.action_range[0]
        scored.append(asks.Part(chunk.job, lo, lo + per_sequence[-1], int(firsts[-2])))
    routed = moe_routes.lay_out(jobs, chunk, forest, starts, int(tokens.shape[0]), moe, device, to)
    return PackedBatch(
        input_ids=to(tokens)[None],
        position_ids=to(positions)[None],
        cu_seqlens=to(starts.astype(np.int32)),
        max_len=int(lengths.max()),
        hidden_index=to(hidden_index),
        targets=to(target_ids),
        inv_temperature=None if all(t == 1.0 for t in temperatures) else to(inv_temperatures),
        actions_per_sequence=per_sequence,
        want_entropy=any(wants),
        chunk_start=None if chunk is None else chunk.start,
        chunk_row=others,
        cu_k=None if chunk is None else bounds(context_lengths),
        max_len_k=None if chunk is None else int(context_lengths.max()),
        key_index=None if key_index is None else to(key_index),
        shared_keys=0 if key_index is None else int(key_lengths[: len(nodes)].sum()),
        cu_k_own=None if key_index is None else bounds(key_lengths),
        max_len_k_own=None if key_index is None else int(key_lengths.max()),
        filler=filler,
        extras=asks.extras(scored, to),
        routes=None if routed is None else routed[0],
        route_rows=None if routed is None else routed[1],
        cache=rows,
    )
