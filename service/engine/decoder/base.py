"""What a decoder's forward is to the engine: final hidden states of the rows the heads read, from one
packed row (Decoder), and the helpers both forwards share.

Boundary: a PackedBatch and rows [R] in; [R, H] final (normalised) hidden states out.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol

import torch

from service.engine.batch.packing import PackedBatch

DecoderKind = Literal["fused", "transformers"]


class Decoder(Protocol):
    kind: DecoderKind

    def __call__(self, batch: PackedBatch, rows: torch.Tensor) -> torch.Tensor:
        """[len(rows), H]: the final (normalised) hidden state at each index of `rows` in the row."""

    def refresh(self) -> None:
        """Take up parameters that a reload rebound."""

    def warm(self, rows: int) -> None:
        """Run once, on zeros, the GEMMs a forward over `rows` rows runs (the same calls and shapes):
        cuBLAS stalls the host the first time it meets some shapes, so a server meets them first."""

    def capture(self, probe: PackedBatch) -> None:
        """Capture the CUDA graphs that serve micro-batches, checked on `probe` (graphs.py); none here."""

    def expert_counts(self) -> torch.Tensor | None:
        """After a forward (read on the device's stream after it): the real tokens each expert of each
        sparse layer but the last took, [layers, E] int32 on the device (the last layer runs its experts
        on the rows the heads read only); None where no layer is counted."""


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """‖got - want‖ / ‖want‖ over every element, in float32: how two forwards' hidden states differ."""
    got, want = got.float(), want.float()
    return float(torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want).clamp_min(1e-30))


def zeros(like: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    return torch.zeros(rows, width, dtype=like.dtype, device=like.device)


def warm_rotary(decoder: Any, x: torch.Tensor) -> None:
    """The rotary embedding's outer product of frequencies and positions (a batched GEMM) over x's rows."""
    rotary = getattr(decoder, "rotary_emb", None)
    if rotary is not None:
        rotary(x[None], torch.zeros(1, x.shape[0], dtype=torch.long, device=x.device))
