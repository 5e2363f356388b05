"""SequenceJobs -> one packed row on the device, with everything the forward and the head need."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from service.jobs import SequenceJob


@dataclass(frozen=True, slots=True)
class PackedBatch:
    """N tokens of S sequences in one row; A action tokens to score.

    input_ids, position_ids: [1, N]   (positions restart at 0 for every sequence)
    cu_seqlens:              [S+1] int32 boundaries; max_len the longest sequence
    hidden_index:            [A] index in N of the position t-1 that predicts each action t
    targets:                 [A] the action token ids
    inv_temperature:         [A] float32, 1 / T of each action's request; None when every T is 1
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


def pack(jobs: Sequence[SequenceJob], device: torch.device) -> PackedBatch:
    lengths = np.fromiter((job.num_tokens for job in jobs), dtype=np.int64, count=len(jobs))
    starts = np.concatenate(([0], np.cumsum(lengths)))  # [S+1]
    tokens = np.concatenate([job.tokens for job in jobs])  # [N]
    positions = np.arange(tokens.shape[0], dtype=np.int64) - np.repeat(starts[:-1], lengths)
    action_index = np.concatenate([job.actions + start for job, start in zip(jobs, starts, strict=False)])
    inv_temperature = np.concatenate(
        [np.full(job.actions.shape[0], 1.0 / job.temperature, dtype=np.float32) for job in jobs]
    )

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
        hidden_index=to(action_index - 1),
        targets=to(tokens[action_index]),
        inv_temperature=None if all(job.temperature == 1.0 for job in jobs) else to(inv_temperature),
        actions_per_sequence=[int(job.actions.shape[0]) for job in jobs],
        want_entropy=any(job.return_entropy for job in jobs),
    )
