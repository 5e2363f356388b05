"""The typed objects that cross the boundary between the HTTP side and the engine.

They hold numpy arrays, never torch tensors: the engine converts them on its side.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float32]
RouteArray = npt.NDArray[np.integer[Any]]  # expert ids in route_dtype (any integer dtype is read)
IdArray = npt.NDArray[np.integer[Any]]  # token ids: the engine's int32 (any integer dtype is read)

AFTER_LAST = 0  # the token an action one past a sequence's last token is scored as (SequenceJob)


def route_dtype(experts: int) -> np.dtype[np.integer[Any]]:
    """The narrowest integer dtype routes of a policy with `experts` experts travel in: uint8 up to
    256 experts, int16 up to 32768, else int32."""
    if experts <= 256:
        return np.dtype(np.uint8)
    return np.dtype(np.int16) if experts <= 1 << 15 else np.dtype(np.int32)


@dataclass(frozen=True, slots=True)
class GivenRoutes:
    """The experts a rollout engine chose for a sequence (routing replay, R3; docs/semantics.md).

    experts: [P, moe_layers, top_k] expert ids for positions start .. start + P - 1 of the sequence,
             every sparse layer of the policy in order, distinct within one (position, layer); any
             integer dtype (normalise gives route_dtype's).
    Positions outside [start, start + P) use the live router.
    """

    start: int
    experts: RouteArray

    @property
    def end(self) -> int:
        return self.start + int(self.experts.shape[0])


@dataclass(frozen=True, slots=True)
class Sampling:
    """The sampler a rollout drew with, after the temperature (vLLM's order; docs/semantics.md).

    top_k: keep the k most likely tokens (0: off); top_p: the smallest most-likely set whose mass
    reaches p (1: off); min_p: tokens at least min_p times the most likely one's probability (0: off).
    """

    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    @property
    def off(self) -> bool:
        return self.top_k == 0 and self.top_p >= 1.0 and self.min_p <= 0.0


@dataclass(frozen=True, slots=True)
class RouteAgreement:
    """How far the live router strayed from given routes over one sequence's covered positions.

    compared: (position, layer) pairs with given routes; exact: those whose live top-k set equals the
    given set; overlap: the sum over them of |given ∩ live| / top_k.
    """

    compared: int
    exact: int
    overlap: float

    @staticmethod
    def join(parts: list[RouteAgreement]) -> RouteAgreement:
        return RouteAgreement(
            compared=sum(p.compared for p in parts),
            exact=sum(p.exact for p in parts),
            overlap=sum(p.overlap for p in parts),
        )


@dataclass(frozen=True, slots=True)
class SequenceJob:
    """One unpadded sequence to score.

    tokens:  [L] real token ids, no padding.
    actions: [A] sorted positions t in 1..L whose log-prob is wanted (after the EOS policy). t = L,
             one past the last token, is the distribution that follows the sequence (what the
             completions API draws from): read at position L - 1 like any action, its token is not
             given, so its log-prob and rank are those of token AFTER_LAST (unused by the callers).
    """

    tokens: IntArray
    actions: IntArray
    temperature: float
    return_entropy: bool
    return_values: bool = False
    return_ref: bool = False
    routes: GivenRoutes | None = None  # replay these experts (MoE policy only)
    return_routes: bool = False  # record the experts each position's sparse layers used
    top_logprobs: int = 0  # K > 0: the K most likely tokens at each action, and the action's rank
    candidate_ids: IntArray | None = None  # [C] for every action, or [A, C] one list per action
    sampling: Sampling | None = None  # processed log-probs under this sampler (with temperature)
    draw_seed: int | None = (
        None  # draw a token at the last action from softmax(g(z) / T), noise per (seed, t)
    )

    @property
    def wants_extras(self) -> bool:
        """Asks the head for more than the log-prob and entropy (SequenceScores' top-K fields on)."""
        return (
            bool(self.top_logprobs)
            or self.candidate_ids is not None
            or self.sampling is not None
            or (self.draw_seed is not None)
        )

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def targets(self) -> IntArray:
        """[A] the token at each action (AFTER_LAST at an action one past the last token)."""
        return targets_at(self.tokens, self.actions)


def targets_at(tokens: IntArray, actions: IntArray) -> IntArray:
    """tokens[actions], AFTER_LAST where an action is one past the last token."""
    past = actions >= tokens.shape[0]
    if not past.any():
        return tokens[actions]
    return np.where(past, AFTER_LAST, tokens[np.minimum(actions, tokens.shape[0] - 1)])


@dataclass(frozen=True, slots=True)
class Chunk:
    """Tokens [start, end) of a sequence too long for one micro-batch, scored after [0, start).

    The engine keeps the keys and values of every layer of the tokens before `start` under
    `sequence` (an id unique in the process): the chunk's queries attend to them and, causally, to
    their own. Its actions are the job's actions t whose predicting position t - 1 lies in
    [start, end); the chunks of a sequence run in order, the last one has end == job.num_tokens.
    `cached`: the sequence's first tokens the prefix cache served (prefix_cache.py): its first chunk
    starts there, copies their keys and values into the store, and also scores the actions whose
    predicting position lies before it (from the cache's hidden states).
    """

    job: SequenceJob
    sequence: int
    start: int
    end: int
    cached: int = 0

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    @property
    def last(self) -> bool:
        return self.end == self.job.num_tokens

    @property
    def action_range(self) -> tuple[int, int]:
        """[lo, hi) of job.actions that are this chunk's."""
        first = 1 if self.start == self.cached else self.start + 1
        lo, hi = np.searchsorted(self.job.actions, [first, self.end + 1])
        return int(lo), int(hi)

    @property
    def actions(self) -> IntArray:
        """[a] this chunk's actions, as positions in the whole sequence."""
        lo, hi = self.action_range
        return self.job.actions[lo:hi]

    @property
    def targets(self) -> IntArray:
        """[a] the token at each of this chunk's actions (SequenceJob.targets)."""
        return targets_at(self.job.tokens, self.actions)


@dataclass(frozen=True, slots=True)
class SequenceScores:
    """Scores of one SequenceJob, aligned with its `actions`: [A] float32 each (None: not asked)."""

    logprobs: FloatArray
    entropy: FloatArray | None
    values: FloatArray | None = None
    ref_logprobs: FloatArray | None = None
    routes: RouteArray | None = None  # [L, moe_layers, top_k] the experts used at every position (narrow)
    route_agreement: RouteAgreement | None = None  # when the job gave routes
    top_ids: IdArray | None = None  # [A, K] int32 from the engine, most likely first, ties by the lower id
    top_logprobs: FloatArray | None = None  # [A, K]
    ranks: IntArray | None = None  # [A] the action token's rank, 1 = most likely (with top_logprobs)
    candidate_logprobs: FloatArray | None = None  # [A, C]
    processed_logprobs: FloatArray | None = None  # [A] under job.sampling; -inf outside its kept set
    drawn: IntArray | None = (
        None  # [A] the token drawn at the last action (job.draw_seed); the others unspecified
    )

    @classmethod
    def join(cls, parts: list[SequenceScores]) -> SequenceScores:
        """One sequence's scores from those of its chunks, in order (each field along its first axis)."""

        def cat(values: list[Any]) -> Any:
            if values[0] is None:
                return None
            return np.concatenate([v for v in values if v is not None])

        agreements = [p.route_agreement for p in parts if p.route_agreement is not None]
        return cls(
            logprobs=cat([p.logprobs for p in parts]),
            entropy=cat([p.entropy for p in parts]),
            values=cat([p.values for p in parts]),
            ref_logprobs=cat([p.ref_logprobs for p in parts]),
            routes=cat([p.routes for p in parts]),
            route_agreement=RouteAgreement.join(agreements) if agreements else None,
            top_ids=cat([p.top_ids for p in parts]),
            top_logprobs=cat([p.top_logprobs for p in parts]),
            ranks=cat([p.ranks for p in parts]),
            candidate_logprobs=cat([p.candidate_logprobs for p in parts]),
            processed_logprobs=cat([p.processed_logprobs for p in parts]),
            drawn=cat([p.drawn for p in parts]),
        )
