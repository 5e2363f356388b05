"""SequenceJobs (and at most one chunk of a long sequence) -> one packed row on the device, with
everything the forward and the head need."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from service.engine.base import SHAPE_STEP
from service.engine.context import CONTEXT_KWARG, KVContext, KVStore
from service.jobs import Chunk, SequenceJob

__all__ = ["SHAPE_STEP", "PackedBatch", "pack"]


@dataclass(frozen=True, slots=True)
class PackedBatch:
    """N tokens of S sequences in one row; A action tokens to score.

    input_ids, position_ids: [1, N]   (positions restart at 0 for every sequence)
    cu_seqlens:              [S+1] int32 boundaries; max_len the longest sequence
    hidden_index:            [A] index in N of the position t-1 that predicts each action t
    targets:                 [A] the action token ids
    inv_temperature:         [A] float32, 1 / T of each action's request; None when every T is 1

    With `step` > 1, N and A are padded to multiples of it: a filler sequence of token 0 ends the
    row (S counts it), and filler actions (row 0, token 0, T = 1) end the actions; `num_actions`
    are the real ones, first, and `actions_per_sequence` covers only them.

    With a chunk (tokens [start, end) of a long sequence), the chunk is the row's last segment, its
    positions start..end-1, and the filler joins it (after its real tokens, so no real token sees
    one): cu_k / max_len_k are the key boundaries once the segment's context of `start` cached
    tokens is in front of it, and `attach` gives the batch one model's context. Its actions come
    last in the actions.
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
    context: KVContext | None = None

    def attach(self, store: KVStore | None) -> PackedBatch:
        """This batch with one model's store of the chunk's context (None: the chunk's segment
        attends to itself only, for a model whose scores of it are not read)."""
        if store is None or self.chunk_start is None:
            return dataclasses.replace(self, context=None)
        return dataclasses.replace(self, context=KVContext(store, self.chunk_start, self.chunk_row))

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def num_actions(self) -> int:
        return sum(self.actions_per_sequence)

    def forward_kwargs(self) -> dict[str, object]:
        """Keyword arguments of a transformers decoder forward over this batch (no transformers KV
        cache; the packed attention reads a chunk's context from CONTEXT_KWARG)."""
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
                "cu_seq_lens_k": self.cu_k,
                "max_length_k": self.max_len_k,
                CONTEXT_KWARG: self.context,
            }
        return kwargs


def pack(
    jobs: Sequence[SequenceJob], device: torch.device, step: int = SHAPE_STEP, chunk: Chunk | None = None
) -> PackedBatch:
    real = [job.num_tokens for job in jobs]
    others = sum(real)
    own = chunk.num_tokens if chunk is not None else 0
    filler = -(others + own) % step
    parts = [job.tokens for job in jobs]
    if chunk is None:
        lengths = np.asarray(real + ([filler] if filler else []), dtype=np.int64)
    else:
        lengths = np.asarray([*real, own + filler], dtype=np.int64)
        parts.append(chunk.job.tokens[chunk.start : chunk.end])
    starts = np.concatenate(([0], np.cumsum(lengths)))  # [S+1]
    tokens = np.concatenate([*parts, np.zeros(filler, dtype=np.int64)])  # [N]
    positions = np.arange(tokens.shape[0], dtype=np.int64) - np.repeat(starts[:-1], lengths)
    action_index = [job.actions + start for job, start in zip(jobs, starts, strict=False)]
    targets = [tokens[index] for index in action_index]
    inv_temperature = [np.full(job.actions.shape[0], 1.0 / job.temperature, dtype=np.float32) for job in jobs]
    per_sequence = [int(job.actions.shape[0]) for job in jobs]
    key_lengths = lengths
    if chunk is not None:
        positions[others : others + own] += chunk.start
        positions[others + own :] = 0  # the filler's: any position; 0 is one every model has
        actions = chunk.actions
        action_index.append(actions - chunk.start + others)
        targets.append(chunk.job.tokens[actions])
        inv_temperature.append(np.full(actions.shape[0], 1.0 / chunk.job.temperature, dtype=np.float32))
        per_sequence.append(int(actions.shape[0]))
        key_lengths = lengths.copy()
        key_lengths[-1] += chunk.start
    everything = np.concatenate(action_index)
    extra = -everything.shape[0] % step
    hidden_index = np.concatenate([everything - 1, np.zeros(extra, dtype=np.int64)])
    target_ids = np.concatenate([*targets, np.zeros(extra, dtype=np.int64)])
    inv_temperatures = np.concatenate([*inv_temperature, np.ones(extra, dtype=np.float32)])
    temperatures = [job.temperature for job in jobs] + ([chunk.job.temperature] if chunk else [])
    wants = [job.return_entropy for job in jobs] + ([chunk.job.return_entropy] if chunk else [])

    def to(array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(array)
        if device.type == "cuda":  # from pageable memory the copy may wait for the work queued before it
            tensor = tensor.pin_memory()
        return tensor.to(device, non_blocking=True)

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
        cu_k=None if chunk is None else to(np.concatenate(([0], np.cumsum(key_lengths))).astype(np.int32)),
        max_len_k=None if chunk is None else int(key_lengths.max()),
    )
