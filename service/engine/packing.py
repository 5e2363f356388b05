"""SequenceJobs -> one packed row on the device, with everything the forward and the head need."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from service.jobs import SequenceJob

# Token and action counts are padded up to a multiple of this, so that a micro-batch's GEMMs take one
# of few shapes, which the engine's warm-up meets before serving: cuBLAS stalls the host (holding the
# GIL) the first time it meets some shapes, until the device is idle. Costs under 1 % of a full
# micro-batch's tokens.
SHAPE_STEP = 128


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

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def num_actions(self) -> int:
        return sum(self.actions_per_sequence)

    def forward_kwargs(self) -> dict[str, object]:
        """Keyword arguments of a transformers decoder forward over this batch (no KV cache)."""
        return {
            "input_ids": self.input_ids,
            "position_ids": self.position_ids,
            "use_cache": False,
            "cu_seq_lens_q": self.cu_seqlens,
            "cu_seq_lens_k": self.cu_seqlens,
            "max_length_q": self.max_len,
            "max_length_k": self.max_len,
        }


def pack(jobs: Sequence[SequenceJob], device: torch.device, step: int = SHAPE_STEP) -> PackedBatch:
    real = [job.num_tokens for job in jobs]
    filler = -sum(real) % step
    lengths = np.asarray(real + ([filler] if filler else []), dtype=np.int64)
    starts = np.concatenate(([0], np.cumsum(lengths)))  # [S+1]
    tokens = np.concatenate([job.tokens for job in jobs] + [np.zeros(filler, dtype=np.int64)])  # [N]
    positions = np.arange(tokens.shape[0], dtype=np.int64) - np.repeat(starts[:-1], lengths)
    action_index = np.concatenate([job.actions + start for job, start in zip(jobs, starts, strict=False)])
    inv_temperature = np.concatenate(
        [np.full(job.actions.shape[0], 1.0 / job.temperature, dtype=np.float32) for job in jobs]
    )
    extra = -action_index.shape[0] % step
    hidden_index = np.concatenate([action_index - 1, np.zeros(extra, dtype=np.int64)])
    targets = np.concatenate([tokens[action_index], np.zeros(extra, dtype=np.int64)])
    inv_temperature = np.concatenate([inv_temperature, np.ones(extra, dtype=np.float32)])

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
        targets=to(targets),
        inv_temperature=None if all(job.temperature == 1.0 for job in jobs) else to(inv_temperature),
        actions_per_sequence=[int(job.actions.shape[0]) for job in jobs],
        want_entropy=any(job.return_entropy for job in jobs),
    )
