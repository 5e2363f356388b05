"""The typed objects that cross the boundary between the HTTP side and the engine.

They hold numpy arrays, never torch tensors: the engine converts them on its side.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float32]


@dataclass(frozen=True, slots=True)
class SequenceJob:
    """One unpadded sequence to score.

    tokens:  [L] real token ids, no padding.
    actions: [A] sorted positions t in 1..L-1 whose log-prob is wanted (after the EOS policy).
    """

    tokens: IntArray
    actions: IntArray
    temperature: float
    return_entropy: bool
    return_values: bool = False
    return_ref: bool = False

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])


@dataclass(frozen=True, slots=True)
class SequenceScores:
    """Scores of one SequenceJob, aligned with its `actions`: [A] float32 each (None: not asked)."""

    logprobs: FloatArray
    entropy: FloatArray | None
    values: FloatArray | None = None
    ref_logprobs: FloatArray | None = None
