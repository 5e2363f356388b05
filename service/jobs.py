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
class Chunk:
    """Tokens [start, end) of a sequence too long for one micro-batch, scored after [0, start).

    The engine keeps the keys and values of every layer of the tokens before `start` under
    `sequence` (an id unique in the process): the chunk's queries attend to them and, causally, to
    their own. Its actions are the job's actions t whose predicting position t - 1 lies in
    [start, end); the chunks of a sequence run in order, the last one has end == job.num_tokens.
    """

    job: SequenceJob
    sequence: int
    start: int
    end: int

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    @property
    def last(self) -> bool:
        return self.end == self.job.num_tokens

    @property
    def actions(self) -> IntArray:
        """[a] this chunk's actions, as positions in the whole sequence."""
        actions = self.job.actions
        lo, hi = np.searchsorted(actions, [self.start + 1, self.end + 1])
        return actions[lo:hi]


@dataclass(frozen=True, slots=True)
class SequenceScores:
    """Scores of one SequenceJob, aligned with its `actions`: [A] float32 each (None: not asked)."""

    logprobs: FloatArray
    entropy: FloatArray | None
    values: FloatArray | None = None
    ref_logprobs: FloatArray | None = None

    @classmethod
    def join(cls, parts: list[SequenceScores]) -> SequenceScores:
        """One sequence's scores from those of its chunks, in order."""

        def cat(values: list[FloatArray | None]) -> FloatArray | None:
            if values[0] is None:
                return None
            return np.concatenate([v for v in values if v is not None])

        logprobs = cat([p.logprobs for p in parts])
        assert logprobs is not None
        return cls(
            logprobs=logprobs,
            entropy=cat([p.entropy for p in parts]),
            values=cat([p.values for p in parts]),
            ref_logprobs=cat([p.ref_logprobs for p in parts]),
        )
